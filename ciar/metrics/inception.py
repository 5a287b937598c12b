"""The FID Inception-v3 network, loaded from a LOCAL weights file (docs/architecture.md §8, the real-model path).

FID on real images is defined by one network: the TensorFlow Inception-v3 graph of 2015-12-05 that the original
FID code used, converted to PyTorch as `pt_inception-2015-12-05-6726825d.pth` (pytorch-fid) and
`weights-inception-2015-12-05-6726825d.pth` (torch-fidelity; same hash tag, same layout). This module is our own
implementation of that graph for that file's state-dict layout (`Conv2d_1a_3x3.conv.weight`,
`Mixed_5b.branch5x5_1.bn.running_mean`, ..., `fc.weight`), so FID needs neither torchvision nor torch-fidelity
(neither installs beside the CPU torch wheel these machines pin) and nothing is ever downloaded.

What makes it the FID network and not torchvision's Inception-v3:
- input: uint8 RGB [B, 3, H, W], resized to 299 x 299 with TensorFlow 1.x's bilinear resize (no half-pixel
  offset: source coordinate = destination * in / out, in float32), then mapped to [-1, 1] as (x - 128) / 128;
- batch norm eps 1e-3 (TensorFlow's), inference statistics only;
- the 3 x 3 average pools inside the 35 x 35, 17 x 17 and first 8 x 8 blocks do not count the zero padding;
- the last 8 x 8 block (`Mixed_7c`) pools its side branch with a 3 x 3 MAX pool (a quirk of that graph);
- features: the 2048-d global average of `Mixed_7c` ("pool3"), or the 64 / 192 / 768-d averages of earlier
  stages (torchmetrics' `feature` choices).

    net = load_fid_inception("pt_inception-2015-12-05-6726825d.pth")      # feature=2048
    feats = net(uint8_images)                                              # [B, 2048] float32

`FIDInceptionV3` has `num_features`, so torchmetrics' `FrechetInceptionDistance(feature=net)` uses it as is
(`ciar.metrics.fid.make_fid("inception", path)`).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.models.checkpoint import load_strict

INPUT_SIZE = 299
FEATURE_DIMS = (64, 192, 768, 2048)
NUM_LOGITS = 1008  # the 2015 graph's classifier (1000 ImageNet classes + 8 unused); kept for the file's `fc` keys
# keys a conversion may or may not carry; they hold no inference state, so they are dropped before the strict load
IGNORED_KEY_SUFFIXES = (".num_batches_tracked",)


def tf1_resize_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """TensorFlow 1.x `resize_bilinear(align_corners=False)` of float [B, C, H, W] to [B, C, size, size].

    Differs from `F.interpolate(mode="bilinear")`: destination pixel i samples source coordinate i * in / out
    (no half-pixel centres), computed in float32 as TensorFlow does, clamped at the far edge."""

    def axis(n_in: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = torch.arange(size, dtype=torch.float32, device=x.device) * torch.tensor(n_in / size, dtype=torch.float32)
        lo = src.long()
        return lo, (lo + 1).clamp_max(n_in - 1), (src - lo.float()).to(x.dtype)

    y0, y1, wy = axis(x.shape[2])
    x0, x1, wx = axis(x.shape[3])
    rows0, rows1 = x.index_select(2, y0), x.index_select(2, y1)
    top = rows0.index_select(3, x0) + (rows0.index_select(3, x1) - rows0.index_select(3, x0)) * wx
    bottom = rows1.index_select(3, x0) + (rows1.index_select(3, x1) - rows1.index_select(3, x0)) * wx
    return top + (bottom - top) * wy.view(-1, 1)


class FrozenBatchNorm(nn.Module):
    """Inference-only batch norm with TensorFlow's eps (the file's `bn.weight/bias/running_mean/running_var`)."""

    def __init__(self, channels: int, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        for name, init in (("weight", torch.ones), ("bias", torch.zeros), ("running_mean", torch.zeros),
                           ("running_var", torch.ones)):
            self.register_buffer(name, init(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class ConvBN(nn.Module):
    """Bias-free conv -> batch norm -> ReLU (the file's `NAME.conv` / `NAME.bn`)."""

    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = FrozenBatchNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


# A mixed block is a list of branches whose outputs are concatenated on channels, in order. A branch is
# (pool, convs, fork): an optional pool applied to the block input first; a chain of named convs
# (name, out channels, kernel, stride, padding); and an optional fork, two named convs applied to the chain's
# output side by side and concatenated (the 8 x 8 blocks). Pools: "avg" (3x3, stride 1, padding 1, zero padding
# not counted), "max" (3x3, stride 1, padding 1), "max/2" (3x3, stride 2, no padding; a branch of its own).
_K1, _K3, _K5 = (1, 1), (3, 3), (5, 5)
_ROW3, _COL3, _ROW7, _COL7 = (1, 3), (3, 1), (1, 7), (7, 1)
_P_ROW3, _P_COL3, _P_ROW7, _P_COL7 = (0, 1), (1, 0), (0, 3), (3, 0)


def _block35(pool_channels: int) -> list:
    return [(None, [("branch1x1", 64, _K1, 1, 0)], None),
            (None, [("branch5x5_1", 48, _K1, 1, 0), ("branch5x5_2", 64, _K5, 1, 2)], None),
            (None, [("branch3x3dbl_1", 64, _K1, 1, 0), ("branch3x3dbl_2", 96, _K3, 1, 1),
                    ("branch3x3dbl_3", 96, _K3, 1, 1)], None),
            ("avg", [("branch_pool", pool_channels, _K1, 1, 0)], None)]


def _reduce35() -> list:
    return [(None, [("branch3x3", 384, _K3, 2, 0)], None),
            (None, [("branch3x3dbl_1", 64, _K1, 1, 0), ("branch3x3dbl_2", 96, _K3, 1, 1),
                    ("branch3x3dbl_3", 96, _K3, 2, 0)], None),
            ("max/2", [], None)]


def _block17(c7: int) -> list:
    return [(None, [("branch1x1", 192, _K1, 1, 0)], None),
            (None, [("branch7x7_1", c7, _K1, 1, 0), ("branch7x7_2", c7, _ROW7, 1, _P_ROW7),
                    ("branch7x7_3", 192, _COL7, 1, _P_COL7)], None),
            (None, [("branch7x7dbl_1", c7, _K1, 1, 0), ("branch7x7dbl_2", c7, _COL7, 1, _P_COL7),
                    ("branch7x7dbl_3", c7, _ROW7, 1, _P_ROW7), ("branch7x7dbl_4", c7, _COL7, 1, _P_COL7),
                    ("branch7x7dbl_5", 192, _ROW7, 1, _P_ROW7)], None),
            ("avg", [("branch_pool", 192, _K1, 1, 0)], None)]


def _reduce17() -> list:
    return [(None, [("branch3x3_1", 192, _K1, 1, 0), ("branch3x3_2", 320, _K3, 2, 0)], None),
            (None, [("branch7x7x3_1", 192, _K1, 1, 0), ("branch7x7x3_2", 192, _ROW7, 1, _P_ROW7),
                    ("branch7x7x3_3", 192, _COL7, 1, _P_COL7), ("branch7x7x3_4", 192, _K3, 2, 0)], None),
            ("max/2", [], None)]


def _block8(pool: str) -> list:
    return [(None, [("branch1x1", 320, _K1, 1, 0)], None),
            (None, [("branch3x3_1", 384, _K1, 1, 0)],
             [("branch3x3_2a", 384, _ROW3, 1, _P_ROW3), ("branch3x3_2b", 384, _COL3, 1, _P_COL3)]),
            (None, [("branch3x3dbl_1", 448, _K1, 1, 0), ("branch3x3dbl_2", 384, _K3, 1, 1)],
             [("branch3x3dbl_3a", 384, _ROW3, 1, _P_ROW3), ("branch3x3dbl_3b", 384, _COL3, 1, _P_COL3)]),
            (pool, [("branch_pool", 192, _K1, 1, 0)], None)]


def _pool(kind: str | None, x: torch.Tensor) -> torch.Tensor:
    if kind is None:
        return x
    if kind == "avg":
        return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    if kind == "max":
        return F.max_pool2d(x, 3, stride=1, padding=1)
    return F.max_pool2d(x, 3, stride=2)  # "max/2"


class MixedBlock(nn.Module):
    def __init__(self, cin: int, branches: list):
        super().__init__()
        self.branches = branches
        self.out_channels = 0
        for pool, convs, fork in branches:
            c = cin
            for name, cout, kernel, stride, padding in convs:
                self.add_module(name, ConvBN(c, cout, kernel, stride, padding))
                c = cout
            if fork:
                for name, cout, kernel, stride, padding in fork:
                    self.add_module(name, ConvBN(c, cout, kernel, stride, padding))
                c = sum(f[1] for f in fork)
            self.out_channels += c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for pool, convs, fork in self.branches:
            y = _pool(pool, x)
            for name, *_ in convs:
                y = getattr(self, name)(y)
            if fork:
                y = torch.cat([getattr(self, name)(y) for name, *_ in fork], 1)
            outs.append(y)
        return torch.cat(outs, 1)


# (module name, block spec) in order; the stem's convs are (name, cin, cout, kernel, stride, padding)
_STEM_A = (("Conv2d_1a_3x3", 3, 32, 3, 2, 0), ("Conv2d_2a_3x3", 32, 32, 3, 1, 0), ("Conv2d_2b_3x3", 32, 64, 3, 1, 1))
_STEM_B = (("Conv2d_3b_1x1", 64, 80, 1, 1, 0), ("Conv2d_4a_3x3", 80, 192, 3, 1, 0))
_STAGE_768 = (("Mixed_5b", _block35(32)), ("Mixed_5c", _block35(64)), ("Mixed_5d", _block35(64)),
              ("Mixed_6a", _reduce35()), ("Mixed_6b", _block17(128)), ("Mixed_6c", _block17(160)),
              ("Mixed_6d", _block17(160)), ("Mixed_6e", _block17(192)))
_STAGE_2048 = (("Mixed_7a", _reduce17()), ("Mixed_7b", _block8("avg")), ("Mixed_7c", _block8("max")))


class FIDInceptionV3(nn.Module):
    """The FID Inception-v3: uint8 RGB [B, 3, H, W] (any size) -> float32 features [B, feature]."""

    def __init__(self, feature: int = 2048):
        super().__init__()
        if feature not in FEATURE_DIMS:
            raise ValueError(f"feature must be one of {FEATURE_DIMS}, got {feature!r}")
        self.num_features = feature
        for name, cin, cout, k, s, p in _STEM_A + _STEM_B:
            self.add_module(name, ConvBN(cin, cout, k, s, p))
        c = 192
        for name, spec in _STAGE_768 + _STAGE_2048:
            block = MixedBlock(c, spec)
            self.add_module(name, block)
            c = block.out_channels
        assert c == 2048
        self.fc = nn.Linear(2048, NUM_LOGITS)
        self.requires_grad_(False)
        self.eval()

    @staticmethod
    def _pooled(x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"FID Inception expects uint8 images [B, 3, H, W], got {images.dtype} "
                             f"{tuple(images.shape)}")
        x = images.float()
        if x.shape[2:] != (INPUT_SIZE, INPUT_SIZE):
            x = tf1_resize_bilinear(x, INPUT_SIZE)
        x = (x - 128.0) / 128.0
        for name, *_ in _STEM_A:
            x = getattr(self, name)(x)
        x = F.max_pool2d(x, 3, stride=2)
        if self.num_features == 64:
            return self._pooled(x)
        for name, *_ in _STEM_B:
            x = getattr(self, name)(x)
        x = F.max_pool2d(x, 3, stride=2)
        if self.num_features == 192:
            return self._pooled(x)
        for name, _ in _STAGE_768:
            x = getattr(self, name)(x)
        if self.num_features == 768:
            return self._pooled(x)
        for name, _ in _STAGE_2048:
            x = getattr(self, name)(x)
        return self._pooled(x)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """The graph's 1008 classifier logits (Inception Score); needs a net built with feature=2048."""
        if self.num_features != 2048:
            raise ValueError("logits need the 2048-d pool features (feature=2048)")
        return self.fc(self(images))


def read_inception_state(path: str) -> dict[str, torch.Tensor]:
    """The state dict of a local FID Inception file: a bare state dict, or one under "state_dict" / "model"."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Inception weights file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{path}: not a readable PyTorch weights file ({type(e).__name__}: {e})") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a state dict of tensors (the FID Inception-v3 layout)")
    return {k: v for k, v in obj.items() if not k.endswith(IGNORED_KEY_SUFFIXES)}


def load_fid_inception(path: str, feature: int = 2048, device: str | torch.device = "cpu") -> FIDInceptionV3:
    """`FIDInceptionV3` with the weights of a LOCAL file (pt_inception-2015-12-05-6726825d.pth or torch-fidelity's
    copy), loaded strictly: a wrong file fails with the missing / unexpected / mis-shaped keys named."""
    net = FIDInceptionV3(feature)
    load_strict(net, read_inception_state(path), what=f"FID Inception-v3 ({path})")
    return net.to(device)

