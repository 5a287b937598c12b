"""FID with a pluggable feature extractor (docs/architecture.md §8).

- kind="scenes": `SceneFeatureNet`, a small CNN trained on rendered scenes (split "probe") to classify every
  cell's shape/colour/size and the background, the image's attribute histogram, and which degradation (if any)
  an image went through; the 128-d global average of its last feature map is the FID feature (the role of
  Inception's pool3 features). Separate weights and seed from the attribute probe. Its values are on their
  own scale (a few hundredths between disjoint reference sets of 500): compare them only with each other,
  at equal set sizes, never with Inception FID numbers.
- kind="inception": the standard FID Inception-v3 (`ciar.metrics.inception`, our implementation of the 2015
  TensorFlow graph, bit-exact with torch-fidelity's) from a LOCAL weights file; nothing is downloaded.

    fid = make_fid("scenes", "weights/scenes-v2/fid_features.safetensors")
    fid_between(fid, real_uint8, fake_uint8)   # [N, H, W, 3] uint8 each -> float

How torchmetrics 1.9 feeds a custom module: `FrechetInceptionDistance(feature=module)` reads
`module.num_features` (else it probes with a dummy image) and `update(imgs, real)` passes `imgs` to the module
unchanged (the `normalize` flag only rescales for the built-in Inception). `SceneFeatureNet` therefore accepts
uint8 images ([B, 3, H, W] or [B, H, W, 3], 0..255) and float images [B, 3, H, W] in [0, 1] (the torchmetrics
`normalize=True` convention; set `float_range=(-1, 1)` for model-space tensors). `fid_between` always feeds uint8.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.data import scenes as S
from ciar.metrics.probe import NUM_BACKGROUNDS, NUM_COLORS, NUM_SHAPES, NUM_SIZES, CellBackbone
from ciar.models.checkpoint import load_strict, read_model_file

FEATURES_KIND = "scene_fid_features"
DEGRADATIONS = ("clean", "blur", "noise", "color_shift", "resample", "posterize")
# attribute histogram read from the pooled features: counts of each shape, colour, size, (shape, colour) pair,
# and the background one-hot
NUM_COUNTS = (NUM_SHAPES - 1) + NUM_COLORS + NUM_SIZES + (NUM_SHAPES - 1) * NUM_COLORS + NUM_BACKGROUNDS


def count_targets(shape: torch.Tensor, color: torch.Tensor, size: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """Per-image attribute histogram [B, NUM_COUNTS] (float) from per-cell targets (as `scene_targets` gives)."""
    present = shape > 0
    s = (shape - 1).clamp_min(0)
    c, z = color.clamp_min(0), size.clamp_min(0)

    def hist(idx: torch.Tensor, k: int) -> torch.Tensor:
        return (F.one_hot(idx, k) * present.unsqueeze(-1)).sum(1).float()

    parts = [hist(s, NUM_SHAPES - 1), hist(c, NUM_COLORS), hist(z, NUM_SIZES), hist(s * NUM_COLORS + c,
             (NUM_SHAPES - 1) * NUM_COLORS), F.one_hot(background, NUM_BACKGROUNDS).float()]
    return torch.cat(parts, dim=1)


@dataclass
class FeatureNetConfig:
    image_size: int = S.IMAGE_SIZE
    grid: int = S.GRID
    channels: tuple[int, ...] = (24, 48, 96)
    num_features: int = 128
    hidden: int = 64
    num_shapes: int = NUM_SHAPES
    num_colors: int = NUM_COLORS
    num_sizes: int = NUM_SIZES
    num_backgrounds: int = NUM_BACKGROUNDS
    num_degradations: int = len(DEGRADATIONS)
    num_counts: int = NUM_COUNTS

    def to_dict(self) -> dict:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @staticmethod
    def from_dict(d: dict) -> "FeatureNetConfig":
        d = dict(d)
        d["channels"] = tuple(d["channels"])
        return FeatureNetConfig(**d)


class SceneFeatureNet(nn.Module):
    """Scene features for FID: forward(images) -> float32 [B, num_features], the global average of the last
    feature map (12x12, post-ReLU), as Inception's pool3 features are.

    Trained (`classify`) to read every cell's shape/colour/size and the background from that map, the image's
    attribute histogram (counts of shapes, colours, sizes, shape-colour pairs; background) linearly from the
    pooled features (content), and which degradation, if any, an image went through (blur, noise, colour
    shift, resampling, posterisation: rendering quality), so the features respond to both. `freeze()` fixes eval mode and turns off gradients."""

    def __init__(self, config: FeatureNetConfig | None = None, float_range: Sequence[float] = (0.0, 1.0)):
        super().__init__()
        self.config = c = config or FeatureNetConfig()
        self.num_features = int(c.num_features)
        self.float_range = tuple(float(v) for v in float_range)
        self.frozen = False
        self.backbone = CellBackbone(c.channels, c.grid)
        self.expand = nn.Sequential(nn.Conv2d(c.channels[-1], c.num_features, 1, bias=False),
                                    nn.BatchNorm2d(c.num_features), nn.ReLU(inplace=True))
        self.n_cell_out = c.num_shapes + c.num_colors + c.num_sizes
        self.cell_head = nn.Sequential(nn.Conv2d(2 * c.num_features, c.hidden, 1), nn.ReLU(inplace=True),
                                       nn.Conv2d(c.hidden, self.n_cell_out, 1))
        cells = c.grid * c.grid
        self.background_head = nn.Linear(2 * c.num_features * cells + 3 * cells, c.num_backgrounds)
        self.degradation_head = nn.Linear(c.num_features, c.num_degradations)
        self.count_head = nn.Linear(c.num_features, c.num_counts)

    def _input(self, imgs) -> torch.Tensor:
        x = torch.as_tensor(imgs)
        if x.dim() != 4:
            raise ValueError(f"expected a batch of images, got shape {tuple(x.shape)}")
        if x.dtype == torch.uint8:
            if x.shape[-1] == 3 and x.shape[1] != 3:
                x = x.permute(0, 3, 1, 2)
            x = x.float().div(127.5).sub(1.0)
        elif x.is_floating_point():
            lo, hi = self.float_range
            x = (x.float() - lo) * (2.0 / (hi - lo)) - 1.0
        else:
            raise TypeError(f"expected uint8 or float images, got {x.dtype}")
        size = self.config.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        return x.to(self.degradation_head.weight.device, self.degradation_head.weight.dtype)

    def feature_map(self, imgs) -> torch.Tensor:
        return self.expand(self.backbone.body(self._input(imgs)))

    def forward(self, imgs) -> torch.Tensor:
        return self.feature_map(imgs).mean(dim=(2, 3)).float()

    def classify(self, imgs) -> dict[str, torch.Tensor]:
        """Training heads: logits shape [B,9,5], color [B,9,6], size [B,9,2], background [B,5] (as
        `AttributeProbe`), degradation [B, num_degradations] (index into `DEGRADATIONS`), and counts
        [B, num_counts] (regression onto `count_targets`) read linearly from the pooled features."""
        c = self.config
        x = self._input(imgs)
        h = self.expand(self.backbone.body(x))
        cells = self.backbone.pool_cells(h)
        per_cell = self.cell_head(cells).flatten(2).transpose(1, 2)
        shape, color, size = per_cell.split([c.num_shapes, c.num_colors, c.num_sizes], dim=-1)
        coarse = F.adaptive_avg_pool2d(x, c.grid).flatten(1)
        pooled = h.mean(dim=(2, 3))
        return {"shape": shape, "color": color, "size": size,
                "background": self.background_head(torch.cat([cells.flatten(1), coarse], dim=1)),
                "degradation": self.degradation_head(pooled), "counts": self.count_head(pooled)}

    def freeze(self) -> "SceneFeatureNet":
        self.requires_grad_(False)
        self.frozen = True
        return super().train(False)

    def train(self, mode: bool = True) -> "SceneFeatureNet":
        return super().train(False if self.frozen else mode)


def load_feature_net(path: str, device: str | torch.device = "cpu") -> SceneFeatureNet:
    """A frozen `SceneFeatureNet` from a file written by `pipelines.train_probes`."""
    state, kind, config, _ = read_model_file(path)
    if kind != FEATURES_KIND:
        raise ValueError(f"{path}: expected a {FEATURES_KIND!r} weight file, found kind {kind!r}")
    net = SceneFeatureNet(FeatureNetConfig.from_dict(config))
    load_strict(net, state, what="FID feature network")
    return net.to(device).freeze()


def _default_scene_weights() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, "weights", "scenes-v2", "fid_features.safetensors")


def make_fid(kind: str = "scenes", weights_path: str | None = None, device: str | torch.device = "cpu",
             feature: int = 2048):
    """A ready torchmetrics `FrechetInceptionDistance` (expects uint8 images [B, 3, H, W]; use `fid_between`).

    kind="scenes": `weights_path` is a `fid_features.safetensors` (default: weights/scenes-v2's).
    kind="inception": `weights_path` is a LOCAL Inception-v3 FID weights file (`pt_inception-2015-12-05-6726825d.pth`
    or torch-fidelity's copy of it); `feature` in (64, 192, 768, 2048). Nothing is ever downloaded.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance

    if kind == "scenes":
        net = load_feature_net(weights_path or _default_scene_weights())
        metric = FrechetInceptionDistance(feature=net, normalize=False, reset_real_features=True)
    elif kind == "inception":
        from ciar.metrics.inception import load_fid_inception

        if not weights_path:
            raise ValueError("kind='inception' needs weights_path: a local Inception-v3 FID weights file "
                             "(e.g. pt_inception-2015-12-05-6726825d.pth); refusing to download one")
        net = load_fid_inception(weights_path, feature=feature)
        metric = FrechetInceptionDistance(feature=net, normalize=False, reset_real_features=True)
    else:
        raise ValueError(f"unknown FID kind {kind!r}; expected 'scenes' or 'inception'")
    return metric.to(device)


def _to_uint8_nchw(images) -> torch.Tensor:
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise TypeError(f"fid_between expects uint8 images, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"expected a batch of images, got shape {tuple(x.shape)}")
    if x.shape[-1] == 3 and x.shape[1] != 3:
        x = x.permute(0, 3, 1, 2)
    return x.contiguous()


@torch.no_grad()
def fid_between(fid_metric, real_uint8, fake_uint8, batch_size: int = 256) -> float:
    """FID between two image sets (uint8 [N, H, W, 3] or [N, 3, H, W], numpy or tensor; at least 2 each).

    Resets `fid_metric` first, so one metric object can be reused for many comparisons."""
    real, fake = _to_uint8_nchw(real_uint8), _to_uint8_nchw(fake_uint8)
    if len(real) < 2 or len(fake) < 2:
        raise ValueError("FID needs at least 2 images in each set")
    fid_metric.reset()
    device = fid_metric.device
    for imgs, is_real in ((real, True), (fake, False)):
        for s in range(0, len(imgs), batch_size):
            fid_metric.update(imgs[s:s + batch_size].to(device), real=is_real)
    value = float(fid_metric.compute())
    fid_metric.reset()
    return value


def feature_extractor(model_config: dict | None, weights_dir: str | None = None, device: str | torch.device = "cpu"):
    """The per-image FID feature function of an evaluation: uint8 [B, 3, H, W] -> float [B, F].

    Scenes worlds (no `model_config`): the scenes feature net of `weights_dir`. The real-model path: the FID
    Inception-v3 (2048-d pool features) from the local `inception_weights` file, or None when the config names
    none (then no FID is reported)."""
    if not model_config:
        path = os.path.join(weights_dir, "fid_features.safetensors") if weights_dir else _default_scene_weights()
        net = load_feature_net(path).to(device)
        return lambda imgs: net(imgs.to(device))
    if not model_config.get("inception_weights"):
        return None
    from ciar.metrics.inception import load_fid_inception

    net = load_fid_inception(model_config["inception_weights"], device=device)
    return lambda imgs: net(imgs.to(device))
