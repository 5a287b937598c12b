"""Procedural captioned scenes: the default world's dataset (docs/architecture.md §9).

A deterministic renderer of small RGB scenes (one to three objects on a background) with a caption from a fixed
grammar and structured labels per object. The same (split, seed, index) always gives the same scene.

Splits
  train    objects never use a held-out (shape, color) pair
  val      same distribution as train, different random stream
  heldout  every scene holds at least one object with a held-out (shape, color) pair (never seen in training)
  probe    every combination, used to train the measuring instruments (attribute probe, FID features)

Export a split in the MS-COCO captions layout (plus the rendered references and the labels):

    python -m ciar.data.scenes export --split heldout --n 200 --seed 0 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

IMAGE_SIZE = 48  # pixels per side; the 3x3 grid makes 16-pixel cells
GRID = 3
SUPERSAMPLE = 4  # anti-aliasing: render at 4x and average down

SHAPES = ("circle", "square", "triangle", "diamond")
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
COLOR_NAMES = tuple(COLORS)
SIZES = {"small": 0.24, "large": 0.44}  # radius as a fraction of a cell
SIZE_NAMES = tuple(SIZES)
POSITIONS = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
BACKGROUNDS = ("gray", "white", "black", "gray gradient", "sand and sky")
# (shape, color) pairs that never occur in train/val and occur in every held-out scene
HELDOUT_PAIRS = frozenset({("circle", "purple"), ("square", "orange"), ("triangle", "blue"), ("diamond", "yellow")})
SPLITS = {"train": 0, "val": 1, "heldout": 2, "probe": 3}
NUM_OBJECTS_P = (0.3, 0.4, 0.3)  # P(1 object), P(2), P(3)
POSITION_JITTER = 0.08  # of a cell


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    size: str
    cell: int  # 0..8, row-major in the 3x3 grid
    dx: float = 0.0  # jitter of the centre, in cells
    dy: float = 0.0

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]

    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.shape} at the {self.position}"


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: str
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def caption(self) -> str:
        phrases = [o.phrase() for o in self.objects]
        body = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
        return f"{body} on a {self.background} background"

    def labels(self) -> dict:
        return {
            "caption": self.caption,
            "background": self.background,
            "objects": [dict(asdict(o), position=o.position) for o in self.objects],
        }

    @staticmethod
    def from_labels(labels: dict) -> "Scene":
        objs = tuple(
            SceneObject(o["shape"], o["color"], o["size"], int(o["cell"]), float(o.get("dx", 0)), float(o.get("dy", 0)))
            for o in labels["objects"]
        )
        return Scene(objs, labels["background"])


def _sample_object(rng: np.random.Generator, cell: int, split: str, force_heldout: bool) -> SceneObject:
    size = SIZE_NAMES[rng.integers(len(SIZE_NAMES))]
    dx, dy = (rng.uniform(-POSITION_JITTER, POSITION_JITTER, size=2)).tolist()
    if force_heldout:
        pairs = sorted(HELDOUT_PAIRS)
        shape, color = pairs[rng.integers(len(pairs))]
        return SceneObject(shape, color, size, cell, dx, dy)
    while True:
        shape = SHAPES[rng.integers(len(SHAPES))]
        color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        if split in ("train", "val") and (shape, color) in HELDOUT_PAIRS:
            continue
        return SceneObject(shape, color, size, cell, dx, dy)


def sample_scene(rng: np.random.Generator, split: str) -> Scene:
    """Draw one scene of `split` from `rng`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    n = int(rng.choice(len(NUM_OBJECTS_P), p=NUM_OBJECTS_P)) + 1
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    heldout_slot = int(rng.integers(n)) if split == "heldout" else -1
    objects = tuple(_sample_object(rng, int(c), split, i == heldout_slot) for i, c in enumerate(cells))
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    return Scene(objects, background)


def scene_at(split: str, index: int, seed: int = 0) -> Scene:
    """The `index`-th scene of `split` for `seed` (independent of any other index: random access)."""
    rng = np.random.default_rng([int(seed), SPLITS[split], int(index)])
    return sample_scene(rng, split)


def _background(name: str, n: int) -> np.ndarray:
    img = np.empty((n, n, 3), dtype=np.float32)
    if name == "gray":
        img[:] = (128, 128, 128)
    elif name == "white":
        img[:] = (240, 240, 240)
    elif name == "black":
        img[:] = (20, 20, 20)
    elif name == "gray gradient":
        t = np.linspace(0.0, 1.0, n, dtype=np.float32)[:, None, None]
        img[:] = (1 - t) * np.array((60, 60, 70), np.float32) + t * np.array((200, 200, 210), np.float32)
    elif name == "sand and sky":
        horizon = int(round(0.6 * n))
        img[:horizon] = (150, 200, 240)
        img[horizon:] = (220, 200, 150)
    else:
        raise ValueError(f"unknown background {name!r}")
    return img


def _shape_mask(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x, y: coordinates relative to the object's centre in units of its radius (y grows downwards)."""
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "square":
        return np.maximum(np.abs(x), np.abs(y)) <= 0.86
    if shape == "triangle":
        return (y <= 0.8) & (np.abs(x) <= (y + 1.0) / 1.8 * 1.05)
    if shape == "diamond":
        return np.abs(x) + np.abs(y) <= 1.1
    raise ValueError(f"unknown shape {shape!r}")


def render(scene: Scene, size: int = IMAGE_SIZE) -> np.ndarray:
    """Render `scene` to a uint8 array [size, size, 3]."""
    n = size * SUPERSAMPLE
    img = _background(scene.background, n)
    cell = n / GRID
    coords = (np.arange(n, dtype=np.float32) + 0.5)
    for o in scene.objects:
        row, col = divmod(o.cell, GRID)
        cx = (col + 0.5 + o.dx) * cell
        cy = (row + 0.5 + o.dy) * cell
        r = SIZES[o.size] * cell
        x = (coords[None, :] - cx) / r
        y = (coords[:, None] - cy) / r
        mask = _shape_mask(o.shape, x, y)
        img[mask] = COLORS[o.color]
    img = img.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE, 3).mean(axis=(1, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def targets(scene: Scene) -> dict[str, np.ndarray]:
    """Per-cell class targets for the attribute probe: shape 0 = empty, 1..4; color/size -1 where empty."""
    shape = np.zeros(GRID * GRID, np.int64)
    color = np.full(GRID * GRID, -1, np.int64)
    size = np.full(GRID * GRID, -1, np.int64)
    for o in scene.objects:
        shape[o.cell] = SHAPES.index(o.shape) + 1
        color[o.cell] = COLOR_NAMES.index(o.color)
        size[o.cell] = SIZE_NAMES.index(o.size)
    return {"shape": shape, "color": color, "size": size,
            "background": np.array(BACKGROUNDS.index(scene.background), np.int64)}


def batch(split: str, start: int, n: int, seed: int = 0, size: int = IMAGE_SIZE) -> tuple[np.ndarray, list[Scene]]:
    """Scenes start..start+n-1 of a split: images uint8 [n, size, size, 3] and their Scene records."""
    scenes = [scene_at(split, i, seed) for i in range(start, start + n)]
    return np.stack([render(s, size) for s in scenes]), scenes


def export(split: str, n: int, seed: int, out: str, size: int = IMAGE_SIZE) -> str:
    """Write `out/captions.json` (COCO captions layout), `out/images/*.png` and `out/labels.json`."""
    from PIL import Image

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    images, annotations, labels = [], [], {}
    for i in range(n):
        scene = scene_at(split, i, seed)
        name = f"{split}_{seed}_{i:06d}.png"
        Image.fromarray(render(scene, size)).save(os.path.join(out, "images", name))
        images.append({"id": i, "file_name": name, "width": size, "height": size})
        annotations.append({"id": i, "image_id": i, "caption": scene.caption})
        labels[str(i)] = scene.labels()
    coco = {
        "info": {"description": f"CIAR procedural scenes, split={split} seed={seed}", "version": "1"},
        "licenses": [],
        "images": images,
        "annotations": annotations,
    }
    path = os.path.join(out, "captions.json")
    with open(path, "w") as f:
        json.dump(coco, f)
    with open(os.path.join(out, "labels.json"), "w") as f:
        json.dump(labels, f)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ciar.data.scenes", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a split in the MS-COCO captions layout")
    ex.add_argument("--split", choices=sorted(SPLITS), default="heldout")
    ex.add_argument("--n", type=int, default=200)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--size", type=int, default=IMAGE_SIZE)
    ex.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.n <= 0:
        parser.error("--n must be positive")
    if args.size < GRID * 4:
        parser.error(f"--size must be at least {GRID * 4}")
    path = export(args.split, args.n, args.seed, args.out, args.size)
    print(f"wrote {args.n} {args.split} scenes to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
