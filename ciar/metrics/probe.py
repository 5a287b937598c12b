"""Attribute probe: the default world's caption-fidelity instrument (docs/architecture.md §8).

A small CNN trained on rendered scenes (split "probe", every attribute combination) that reads, for each cell
of the 3x3 grid, the object's shape (0 = empty, 1..4), colour and size, plus the background. It stands in for
the CLIP score: `attribute_accuracy` checks every object a caption names against what the probe sees.

    probe = load_probe("weights/scenes-v2/probe.safetensors")
    report = attribute_accuracy(probe, images_uint8, scenes_or_labels)   # images [N, 48, 48, 3] uint8
    report["attribute_accuracy"]   # mean over (object, attribute) checks of shape/colour/size/position
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.data import scenes as S
from ciar.models.checkpoint import load_strict, read_model_file

PROBE_KIND = "attribute_probe"
NUM_CELLS = S.GRID * S.GRID
NUM_SHAPES = len(S.SHAPES) + 1  # 0 = empty cell
NUM_COLORS = len(S.COLOR_NAMES)
NUM_SIZES = len(S.SIZE_NAMES)
NUM_BACKGROUNDS = len(S.BACKGROUNDS)
ATTRIBUTES = ("shape", "color", "size", "position")


@dataclass
class ProbeConfig:
    image_size: int = S.IMAGE_SIZE
    grid: int = S.GRID
    channels: tuple[int, ...] = (16, 32, 64)  # at full, 1/2 and 1/4 resolution (48 -> 24 -> 12 px)
    hidden: int = 64  # per-cell head width
    num_shapes: int = NUM_SHAPES
    num_colors: int = NUM_COLORS
    num_sizes: int = NUM_SIZES
    num_backgrounds: int = NUM_BACKGROUNDS

    def to_dict(self) -> dict:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @staticmethod
    def from_dict(d: dict) -> "ProbeConfig":
        d = dict(d)
        d["channels"] = tuple(d["channels"])
        return ProbeConfig(**d)


def to_model_input(images, image_size: int = S.IMAGE_SIZE) -> torch.Tensor:
    """Images -> float [B, 3, S, S] in [-1, 1].

    Accepts uint8 (numpy or tensor) [B, H, W, 3] or [B, 3, H, W] in [0, 255], or a float tensor [B, 3, H, W]
    already in [-1, 1] (passed through). Other sizes are resized (antialiased bilinear) to `image_size`.
    """
    x = torch.as_tensor(images)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"expected a batch of images [B, H, W, 3] or [B, 3, H, W], got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        if x.shape[-1] == 3 and x.shape[1] != 3:
            x = x.permute(0, 3, 1, 2)
        x = x.float().div(127.5).sub(1.0)
    elif not x.is_floating_point():
        raise TypeError(f"expected uint8 or float images, got {x.dtype}")
    if x.shape[1] != 3:
        raise ValueError(f"expected 3 channels, got shape {tuple(x.shape)}")
    if x.shape[-2:] != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    return x.contiguous()


def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CellBackbone(nn.Module):
    """Convs 48 -> 24 -> 12 px, then per-cell pooling (mean and max over each cell's 4x4 region).

    Returns (cell features [B, 2*C, g, g], coarse image colours [B, 3*g*g]). Shared by the probe and the FID
    feature network (separate instances, separate weights)."""

    def __init__(self, channels: Sequence[int], grid: int):
        super().__init__()
        c0, c1, c2 = channels
        self.grid = grid
        self.body = nn.Sequential(
            _conv(3, c0), _conv(c0, c1, 2), _conv(c1, c1), _conv(c1, c2, 2), _conv(c2, c2),
        )
        self.out_channels = 2 * c2

    def pool_cells(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.adaptive_avg_pool2d(h, self.grid), F.adaptive_max_pool2d(h, self.grid)], dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cells = self.pool_cells(self.body(x))
        coarse = F.adaptive_avg_pool2d(x, self.grid).flatten(1)
        return cells, coarse


class AttributeProbe(nn.Module):
    """Per-cell attribute classifier. forward(images) -> dict of logits:
    shape [B, 9, 5], color [B, 9, 6], size [B, 9, 2], background [B, 5].
    Images: float [B, 3, 48, 48] in [-1, 1] or uint8 [B, 48, 48, 3] (see `to_model_input`)."""

    def __init__(self, config: ProbeConfig | None = None):
        super().__init__()
        self.config = c = config or ProbeConfig()
        self.backbone = CellBackbone(c.channels, c.grid)
        n_out = c.num_shapes + c.num_colors + c.num_sizes
        self.cell_head = nn.Sequential(
            nn.Conv2d(self.backbone.out_channels, c.hidden, 1), nn.ReLU(inplace=True), nn.Conv2d(c.hidden, n_out, 1))
        cells = c.grid * c.grid
        self.background_head = nn.Linear(self.backbone.out_channels * cells + 3 * cells, c.num_backgrounds)

    def forward(self, images) -> dict[str, torch.Tensor]:
        c = self.config
        x = to_model_input(images, c.image_size).to(next(self.parameters()).device)
        cells, coarse = self.backbone(x)
        per_cell = self.cell_head(cells).flatten(2).transpose(1, 2)  # [B, g*g, n_out]
        shape, color, size = per_cell.split([c.num_shapes, c.num_colors, c.num_sizes], dim=-1)
        background = self.background_head(torch.cat([cells.flatten(1), coarse], dim=1))
        return {"shape": shape, "color": color, "size": size, "background": background}


def probe_loss(logits: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy over cells (shape incl. empty; colour and size only where an object is) + background."""
    loss = F.cross_entropy(logits["shape"].flatten(0, 1), targets["shape"].flatten())
    for k in ("color", "size"):
        loss = loss + F.cross_entropy(logits[k].flatten(0, 1), targets[k].flatten(), ignore_index=-1)
    return loss + F.cross_entropy(logits["background"], targets["background"])


def _as_scene(item) -> S.Scene:
    if isinstance(item, S.Scene):
        return item
    if isinstance(item, dict):
        return S.Scene.from_labels(item)
    raise TypeError(f"expected a Scene or a labels() dict, got {type(item).__name__}")


def scene_targets(items) -> dict[str, torch.Tensor]:
    """Stacked per-cell targets of Scenes / labels dicts: shape/color/size [N, 9], background [N] (int64)."""
    ts = [S.targets(_as_scene(s)) for s in items]
    return {k: torch.as_tensor(np.stack([t[k] for t in ts])) for k in ("shape", "color", "size", "background")}


@torch.no_grad()
def predict(probe: nn.Module, images, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """Argmax predictions (CPU int64): shape/color/size [N, 9], background [N]. Runs in eval mode."""
    was_training = probe.training
    probe.eval()
    out: dict[str, list] = {"shape": [], "color": [], "size": [], "background": []}
    try:
        for s in range(0, len(images), batch_size):
            logits = probe(images[s:s + batch_size])
            for k in out:
                out[k].append(logits[k].argmax(-1).cpu())
    finally:
        probe.train(was_training)
    return {k: torch.cat(v) if v else torch.zeros((0, NUM_CELLS) if k != "background" else (0,), dtype=torch.long)
            for k, v in out.items()}


def _checks(pred: dict[str, torch.Tensor], target: dict[str, torch.Tensor]):
    """-> (checks {attribute: [N, 9] bool}, present [N, 9], detected [N, 9]): each named object's four checks."""
    present = target["shape"] > 0  # [N, 9]: cells the caption names
    detected = pred["shape"] > 0
    checks = {
        "position": detected,
        "shape": pred["shape"] == target["shape"],
        # an attribute of an object the probe does not see at its cell cannot be right
        "color": detected & (pred["color"] == target["color"]),
        "size": detected & (pred["size"] == target["size"]),
    }
    return checks, present, detected


def checks_per_image(pred: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """Per image: (checks right, checks made) of `attribute_accuracy` (four per named object), whose sums over the
    images give it: what a paired comparison of two methods on the same prompts resamples."""
    checks, present, _ = _checks(pred, target)
    right = sum((v & present).sum(1) for v in checks.values())
    return right.tolist(), (len(checks) * present.sum(1)).tolist()


def accuracy_from_predictions(pred: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict:
    """The `attribute_accuracy` report from predictions and targets (both as from `predict` / `scene_targets`)."""
    checks, present, detected = _checks(pred, target)
    n_obj = int(present.sum())
    correct = {k: int((v & present).sum()) for k, v in checks.items()}
    n_img = int(target["shape"].shape[0])
    spurious = detected & ~present
    bg_ok = pred["background"] == target["background"]
    all_ok = bg_ok & ~spurious.any(1)
    for v in checks.values():
        all_ok &= (v | ~present).all(1)
    report = {f"{k}_accuracy": correct[k] / n_obj if n_obj else float("nan") for k in ATTRIBUTES}
    report["attribute_accuracy"] = sum(correct.values()) / (len(ATTRIBUTES) * n_obj) if n_obj else float("nan")
    report["background_accuracy"] = float(bg_ok.float().mean()) if n_img else float("nan")
    report["spurious_objects"] = int(spurious.sum())
    report["spurious_per_image"] = int(spurious.sum()) / n_img if n_img else float("nan")
    report["image_all_correct"] = float(all_ok.float().mean()) if n_img else float("nan")
    report["num_images"] = n_img
    report["num_objects"] = n_obj
    return report


def attribute_accuracy(probe: nn.Module, images_uint8, scenes_or_labels, batch_size: int = 256) -> dict:
    """How well images show what their captions say, read by `probe`.

    images_uint8: [N, H, W, 3] uint8 (numpy or tensor); scenes_or_labels: N `Scene`s or `Scene.labels()` dicts.
    For each object of each scene: position correct = the probe sees an object at its cell; shape, colour, size
    correct = position correct and the probe's prediction at that cell equals the label.
    Returns {shape,color,size,position}_accuracy, attribute_accuracy (mean over all (object, attribute) checks
    of those four), background_accuracy, spurious_objects (cells the probe sees filled that no object names),
    spurious_per_image, image_all_correct (fraction of images with every check right and nothing spurious),
    num_images, num_objects.
    """
    items = list(scenes_or_labels)
    if len(items) != len(images_uint8):
        raise ValueError(f"{len(images_uint8)} images but {len(items)} scenes/labels")
    return accuracy_from_predictions(predict(probe, images_uint8, batch_size), scene_targets(items))


def load_probe(path: str, device: str | torch.device = "cpu") -> AttributeProbe:
    """An `AttributeProbe` from a file written by `pipelines.train_probes` (eval mode, no gradients)."""
    state, kind, config, _ = read_model_file(path)
    if kind != PROBE_KIND:
        raise ValueError(f"{path}: expected a {PROBE_KIND!r} weight file, found kind {kind!r}")
    probe = AttributeProbe(ProbeConfig.from_dict(config))
    load_strict(probe, state, what="attribute probe")
    probe.requires_grad_(False)
    return probe.to(device).eval()
