"""CIAR's Inter-Head, InterFuse and interval uncertainty (paper Sec. 3; docs/architecture.md §7).

The device model predicts, per position, a *box* of logits: a center c [V] and a radius r >= 0 [V], i.e. every
logit vector l with c - r <= l <= c + r. InterFuse turns the box into the tight per-token probability bounds of
softmax(l) over the box; the uncertainty score summarises how wide those bounds are.

    head = InterHead(dim=256, vocab_size=1024, num_heads=1)
    head.init_center_from(cloud.output.weight)            # center starts at the cloud's logits, radius at 0.5
    center, radius = head(hidden)                          # [B, V] each, float32
    c, r = guided_interval(center_cond, radius_cond, center_uncond, radius_uncond, cfg_scale=3.0)
    p_lo, p_hi = inter_fuse(c, r)                          # [B, V]; 0 <= p_lo <= p_hi <= 1
    u = interval_uncertainty(c, r)                         # [B], normalised scale; escalate when u > tau

Uncertainty scale. With delta = p_hi - p_lo [V], Omega = sum(delta) (the L1 volume of the box) and sigma the
population std of delta over V, the raw score is U = Omega * sigma. For a fixed Omega, sigma is largest when all
the width sits on one token (one-hot delta): sigma_max(Omega) = Omega * sqrt(V - 1) / V. The *normalised* score

    U_norm = U * V / sqrt(V - 1) = Omega^2 * kappa,   kappa = sigma / sigma_max(Omega) in [0, 1]

does not grow with the vocabulary size: no factor of V. It still depends on the model: the paper's tau 0.30 on this
scale escalated every token of the scenes-v2 device (its calibrated tau was ~1312), because the score follows the
radius the device learned. So no tau is built in: a device's calibrated thresholds travel in its file's metadata
(`ciar.collab.defaults`, written by `python -m pipelines.calibrate`). Gates score the tight bounds, before the
safety margin (`inter_fuse(margin=0)`), see `ciar.collab.gating`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ciar.decoding.sampling import guide

COMBINES = ("ensemble", "voting")
MAX_HEADS = 5
INIT_RADIUS = 0.5
# interval_features: centers relative to the max are floored here so masked (-inf) logits stay finite features.
FEATURE_LOGIT_FLOOR = -50.0
_QUANTILE_MAX_NUMEL = 16_000_000  # torch.quantile's input-size limit


class InterHead(nn.Module):
    """Interval head: hidden [..., dim] -> (center logits, radius) [..., V], one or more linear heads.

    Each head is a single `nn.Linear(dim, 2V)`: the first V outputs are the center logits c, the last V the raw
    radius, mapped to r = softplus(raw).clamp(max=max_radius) >= 0. All arithmetic runs in float32 (autocast off).
    """

    def __init__(self, dim: int, vocab_size: int, num_heads: int = 1, combine: str = "ensemble",
                 max_radius: float = 8.0):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or not 1 <= num_heads <= MAX_HEADS:
            raise ValueError(f"num_heads must be an integer in 1..{MAX_HEADS}, got {num_heads!r}")
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        if not (isinstance(max_radius, (int, float)) and max_radius > 0 and math.isfinite(max_radius)):
            raise ValueError(f"max_radius must be a finite number > 0, got {max_radius!r}")
        if dim < 1 or vocab_size < 1:
            raise ValueError(f"dim and vocab_size must be >= 1, got dim={dim!r}, vocab_size={vocab_size!r}")
        self.dim, self.vocab_size, self.num_heads = dim, vocab_size, num_heads
        self.combine, self.max_radius = combine, float(max_radius)
        self.heads = nn.ModuleList([nn.Linear(dim, 2 * vocab_size) for _ in range(num_heads)])

    def forward_heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., dim] -> (centers, radii), each [H, ..., V] float32 (H = num_heads)."""
        if h.shape[-1] != self.dim:
            raise ValueError(f"expected hidden states [..., {self.dim}], got {tuple(h.shape)}")
        V = self.vocab_size
        centers, radii = [], []
        with torch.autocast(device_type=h.device.type, enabled=False):
            x = h.float()
            for head in self.heads:
                out = F.linear(x, head.weight.float(), head.bias.float())  # [..., 2V]
                centers.append(out[..., :V])
                radii.append(F.softplus(out[..., V:]).clamp(max=self.max_radius))
        return torch.stack(centers), torch.stack(radii)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., dim] -> (center, radius) [..., V] float32: the mean over heads (ensemble).

        With combine="voting" the caller decides from per-head scores (`forward_heads`); this still returns the mean.
        """
        centers, radii = self.forward_heads(h)
        return centers.mean(dim=0), radii.mean(dim=0)

    @torch.no_grad()
    def init_center_from(self, weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Copy the cloud's output layer weight [V, dim] into every head's center rows; radius starts at 0.5.

        Head 0: center rows = weight, center bias = 0, radius rows = 0, radius bias = softplus^{-1}(0.5). Heads
        1.. start from the same point plus seeded noise (`generator`, else the global RNG): center rows
        + N(0, (0.1 std(weight))^2), radius rows N(0, 0.02^2). Without it every head would get the same gradients
        and stay a bit-for-bit copy of head 0, so an ensemble or a vote of heads would be one head.
        """
        V = self.vocab_size
        if tuple(weight.shape) != (V, self.dim):
            raise ValueError(f"expected an output weight of shape ({V}, {self.dim}), got {tuple(weight.shape)}")
        radius_bias = math.log(math.expm1(INIT_RADIUS))
        w = weight.detach().float().cpu()
        for i, head in enumerate(self.heads):
            center, radius = w.clone(), torch.zeros_like(w)
            if i > 0:
                center += torch.randn(w.shape, generator=generator) * (0.1 * float(w.std()))
                radius += torch.randn(w.shape, generator=generator) * 0.02
            head.weight[:V].copy_(center.to(head.weight))
            head.weight[V:].copy_(radius.to(head.weight))
            head.bias[:V].zero_()
            head.bias[V:].fill_(radius_bias)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, vocab_size={self.vocab_size}, num_heads={self.num_heads}, "
                f"combine={self.combine!r}, max_radius={self.max_radius}")


def guided_interval(c_c: torch.Tensor, r_c: torch.Tensor, c_u: torch.Tensor | None = None,
                    r_u: torch.Tensor | None = None, cfg_scale: float = 1.0,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The logit box after classifier-free guidance and temperature; inputs and outputs [..., V] float32.

    With the unconditional box (c_u, r_u): center = guide(c_c, c_u, s) = s c_c + (1 - s) c_u (the same formula as
    `ciar.decoding.sampling.guide`) and radius = |s| r_c + |1 - s| r_u, the tight box of the linear combination.
    Without it the box is (c_c, r_c). Both are then divided by `temperature` (> 0, else ValueError).
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if (c_u is None) != (r_u is None):
        raise ValueError("c_u and r_u must be given together (the unconditional center and radius)")
    center, radius = c_c.float(), r_c.float()
    if c_u is not None:
        s = float(cfg_scale)
        center = guide(center, c_u.float(), s)
        radius = abs(s) * radius + abs(1.0 - s) * r_u.float()
    if temperature != 1.0:
        center, radius = center / temperature, radius / temperature
    return center, radius


def _log_rest(a: torch.Tensor) -> torch.Tensor:
    """a [..., V] float64 (entries may be -inf) -> log sum_{j != i} exp(a_j) for every i, [..., V].

    Exact in log space, O(V): for i that is not the row's argmax, exp(a_i - lse) <= 1/2, so
    lse + log1p(-exp(a_i - lse)) has no cancellation; the argmax's own entry is a logsumexp with it left out.
    -inf when nothing else is finite.
    """
    V = a.shape[-1]
    if V == 1:
        return torch.full_like(a, -math.inf)
    lse = torch.logsumexp(a, dim=-1, keepdim=True)
    rest = lse + torch.log1p(-torch.exp(a - lse).clamp(max=0.5))
    idx = a.argmax(dim=-1, keepdim=True)
    rest_of_max = torch.logsumexp(a.scatter(-1, idx, -math.inf), dim=-1, keepdim=True)
    return rest.scatter(-1, idx, rest_of_max)


def inter_fuse(center: torch.Tensor, radius: torch.Tensor, margin: float = 0.01,
               max_radius: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InterFuse: the tight softmax bounds over the logit box [c - r, c + r]; center, radius [..., V] -> [..., V] x 2.

    With lo_i = exp(c_i - r_i), hi_i = exp(c_i + r_i):
        p_lo_i = lo_i / (lo_i + sum_{j != i} hi_j),   p_hi_i = hi_i / (hi_i + sum_{j != i} lo_j)
    (token i at its lowest while every other token is at its highest, and vice versa). Evaluated in float64 as
    sigmoid(log lo_i - log sum_{j != i} hi_j), with the "rest" sums taken in log space relative to the row max (the
    max trick done exactly, see `_log_rest`), so nothing overflows or underflows to 0/0. Definitions at the edges:
    a center of -inf (masked upstream) gives p_lo = p_hi = 0; a sole finite entry of a row gets p_lo = p_hi = 1.
    Negative radii are treated as 0; `max_radius` (if given) clamps the radius first. Rows need >= 1 finite center.

    Safety margin (paper): if sum p_lo > 1 - margin, p_lo is scaled down to sum to 1 - margin; if sum p_hi < 1 + margin
    p_hi is scaled up to sum to 1 + margin; then p_hi is clamped to <= 1. Result (float32):
    0 <= p_lo <= p_hi <= 1 and sum p_lo <= 1 <= sum p_hi.
    """
    if margin < 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    c, r = torch.broadcast_tensors(center.double(), radius.double())
    r = r.clamp(min=0.0)
    if max_radius is not None:
        r = r.clamp(max=float(max_radius))
    live = c > -math.inf  # masked entries (center -inf) get 0 bounds
    log_lo, log_hi = c - r, c + r
    p_lo = torch.sigmoid(log_lo - _log_rest(log_hi))
    p_hi = torch.sigmoid(log_hi - _log_rest(log_lo))
    zero = torch.zeros((), dtype=p_lo.dtype, device=p_lo.device)
    p_lo, p_hi = torch.where(live, p_lo, zero), torch.where(live, p_hi, zero)
    p_lo = torch.minimum(p_lo, p_hi)  # exact mathematically; guard the last ulp

    s_lo = p_lo.sum(dim=-1, keepdim=True)
    cap = 1.0 - margin
    p_lo = torch.where(s_lo > cap, p_lo * (cap / s_lo.clamp(min=1e-300)), p_lo)
    s_hi = p_hi.sum(dim=-1, keepdim=True)
    floor = 1.0 + margin
    p_hi = torch.where(s_hi < floor, p_hi * (floor / s_hi.clamp(min=1e-300)), p_hi).clamp(max=1.0)
    return p_lo.float(), p_hi.float()


def uncertainty(p_lo: torch.Tensor, p_hi: torch.Tensor) -> torch.Tensor:
    """Raw interval uncertainty U = Omega * sigma of delta = p_hi - p_lo; [..., V] x 2 -> [...].

    Omega = sum(delta) (L1 volume), sigma = population std of delta over the last dim.
    """
    delta = (p_hi - p_lo).float()
    omega = delta.sum(dim=-1)
    sigma = delta.std(dim=-1, correction=0)
    return omega * sigma


def normalized_uncertainty(u: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U [...] -> U_norm = U * V / sqrt(V - 1) = Omega^2 * kappa (see the module docstring); 0 when V == 1."""
    if vocab_size < 2:
        return torch.zeros_like(u)
    return u * (vocab_size / math.sqrt(vocab_size - 1))


def interval_uncertainty(center: torch.Tensor, radius: torch.Tensor, margin: float = 0.01,
                         max_radius: float | None = None, normalized: bool = True) -> torch.Tensor:
    """center, radius [..., V] -> uncertainty [...] float32: InterFuse, then U (normalised unless told otherwise)."""
    p_lo, p_hi = inter_fuse(center, radius, margin=margin, max_radius=max_radius)
    u = uncertainty(p_lo, p_hi)
    return normalized_uncertainty(u, p_lo.shape[-1]) if normalized else u


def threshold_for_rate(scores: torch.Tensor, rate: float) -> float:
    """The tau such that the fraction of `scores` (any shape) strictly above tau is about `rate` (in [0, 1]).

    tau = quantile(scores, 1 - rate) (float64, linear interpolation); rate 0 -> max score (nothing escalates);
    rate 1 -> -inf (everything escalates).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate!r}")
    x = scores.detach().reshape(-1).double()
    if x.numel() == 0:
        raise ValueError("threshold_for_rate needs at least one score")
    if rate == 1.0:
        return -math.inf
    if rate == 0.0:
        return float(x.max())
    q = 1.0 - rate
    if x.numel() <= _QUANTILE_MAX_NUMEL:
        return float(torch.quantile(x, q))
    xs = x.sort().values  # same linear interpolation as torch.quantile
    pos = q * (xs.numel() - 1)
    i = int(math.floor(pos))
    j = min(i + 1, xs.numel() - 1)
    return float(xs[i] + (xs[j] - xs[i]) * (pos - i))


def interval_feature_dim(top: int) -> int:
    """Width of `interval_features(..., top)`: 2 * top + 4."""
    return 2 * top + 4


def interval_features(center: torch.Tensor, radius: torch.Tensor, top: int = 8) -> torch.Tensor:
    """center, radius [..., V] -> [..., 2 * top + 4] float32 per-position summary for the interval projector.

    Layout: the `top` largest centers minus the max center (first entry 0; floored at FEATURE_LOGIT_FLOOR so masked
    logits stay finite), the radii at those indices, then Omega, kappa (sigma / sigma_max, 0 when Omega = 0),
    U_norm, and the entropy of softmax(center) / log V. Bounds come from `inter_fuse` with the default margin.
    Zero-padded when V < top.
    """
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top!r}")
    center, radius = torch.broadcast_tensors(center.float(), radius.float())
    V = center.shape[-1]
    k = min(top, V)
    c_top, idx = center.topk(k, dim=-1)
    rel = (c_top - c_top[..., :1]).clamp(min=FEATURE_LOGIT_FLOOR)
    r_top = radius.gather(-1, idx)
    if k < top:
        pad = center.new_zeros(*center.shape[:-1], top - k)
        rel, r_top = torch.cat([rel, pad], dim=-1), torch.cat([r_top, pad], dim=-1)

    p_lo, p_hi = inter_fuse(center, radius)
    delta = p_hi - p_lo
    omega = delta.sum(dim=-1)
    sigma = delta.std(dim=-1, correction=0)
    if V > 1:
        sigma_max = omega * (math.sqrt(V - 1) / V)
        kappa = torch.where(omega > 0, sigma / sigma_max.clamp(min=1e-30), torch.zeros_like(omega)).clamp(0.0, 1.0)
        ent = torch.special.entr(torch.softmax(center, dim=-1)).sum(dim=-1) / math.log(V)
    else:
        kappa, ent = torch.zeros_like(omega), torch.zeros_like(omega)
    u_norm = normalized_uncertainty(omega * sigma, V)
    stats = torch.stack([omega, kappa, u_norm, ent], dim=-1)
    return torch.cat([rel, r_top.clamp(min=0.0), stats], dim=-1).float()
