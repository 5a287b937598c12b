"""Escalation gates: CIAR's interval uncertainty and the baselines that replace it (paper Tables 2-3).

Every gate maps a batch of next-token predictions to one score per row, higher = more uncertain; the decoder
escalates a position to the cloud when score > tau.

    s = gate_scores("lower", center=center, radius=radius, drafted=x)   # center/radius [B, V], x [B] -> [B]
    escalate = s > tau            # the gate and tau of a run: CollabConfig (ciar.sim.decoder)

Thresholds are the gate's own scale and depend on the device model: the calibrated tau (and gate) of a shipped
device travel in its file's metadata (`ciar.collab.defaults`), written by `python -m pipelines.calibrate`.
Interval gates score the tight InterFuse bounds *before* the paper's safety margin (margin 0 by default): the
margin rescales p_lo / p_hi by up to ~1 % of their sum, which at small radii is larger than the widths it should
measure and inverts U's ranking.

Why "lower" beside the paper's U: U = Omega * sigma is largest when the width is spread over a few tokens and falls
again when it spreads over many, so it ranks broad, very uncertain positions below near-ties (measured on
scenes-v2: even an oracle box ranks disagreements with AUROC ~0.76 under U, ~0.85 under 1 - p_lo[top]). The "lower"
gate is monotone in the drafted token's worst-case probability p_lo[x]: it escalates exactly the drafts that the box
cannot vouch for, whatever the shape of the rest of the distribution. It is reported as -log p_lo[x] (not
1 - p_lo[x]) because a wide box drives p_lo to ~1e-7, where 1 - p_lo saturates in float32; the ranking is the same.

| kind       | inputs          | score                                                         | scale          |
|------------|-----------------|---------------------------------------------------------------|----------------|
| "interval" | center, radius  | normalised U = Omega^2 * kappa (ciar.collab.interval), paper  | >= 0           |
| "lower"    | center, radius, | -log p_lo[x]: the drafted token x's lower probability bound   | >= 0 (nats)    |
|            | drafted         | (InterFuse); high when x may be improbable anywhere in the box|                |
| "entropy"  | probs           | Shannon entropy / log V (Entropy-Lens-style)                  | [0, 1]         |
| "softmax"  | probs           | 1 - max p (SoftmaxCorr: maximum softmax probability)          | [0, 1 - 1/V]   |
| "random"   | generator (+B)  | uniform draw per row                                          | [0, 1)         |
| "topk"     | center, radius  | (n_feasible - 1 + Omega_k / (1 + Omega_k)) / k, discrete set  | [0, 1)         |
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ciar.collab.interval import inter_fuse, interval_uncertainty
from ciar.collab.names import GATES  # the gates' names, defined once without torch


def _need(kind: str, **inputs) -> None:
    missing = [name for name, value in inputs.items() if value is None]
    if missing:
        raise ValueError(f"gate {kind!r} needs {', '.join(missing)}")


def entropy_score(probs: torch.Tensor) -> torch.Tensor:
    """probs [B, V] -> Shannon entropy / log V in [0, 1], [B] (0 log 0 = 0; 0 when V == 1)."""
    p = probs.float()
    V = p.shape[-1]
    if V < 2:
        return p.new_zeros(p.shape[:-1])
    return (torch.special.entr(p).sum(dim=-1) / math.log(V)).clamp(0.0, 1.0)


def softmax_score(probs: torch.Tensor) -> torch.Tensor:
    """probs [B, V] -> 1 - max p, [B]."""
    return 1.0 - probs.float().amax(dim=-1)


def topk_score(center: torch.Tensor, radius: torch.Tensor, topk: int = 200, margin: float = 0.0) -> torch.Tensor:
    """Discrete solution-set uncertainty over the k largest centers; center, radius [B, V] -> [B].

    InterFuse over the restricted set gives [p_lo, p_hi] [B, k]; token i is a feasible winner iff
    p_hi_i >= p_lo_j for every j (explicit [B, k, k] comparison, O(k^2) like the enumeration the paper criticises).
    score = (n_feasible - 1 + Omega_k / (1 + Omega_k)) / k, with Omega_k = sum(p_hi - p_lo) breaking ties.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk!r}")
    center, radius = torch.broadcast_tensors(center.float(), radius.float())
    k = min(int(topk), center.shape[-1])
    c_k, idx = center.topk(k, dim=-1)
    r_k = radius.gather(-1, idx)
    p_lo, p_hi = inter_fuse(c_k, r_k, margin=margin)  # [B, k]
    feasible = (p_hi.unsqueeze(-1) >= p_lo.unsqueeze(-2)).all(dim=-1)  # [B, k, k] -> [B, k]
    n_feasible = feasible.sum(dim=-1).float()
    omega = (p_hi - p_lo).sum(dim=-1)
    frac = omega / (1.0 + omega)
    return (n_feasible - 1.0 + frac) / k


def lower_score(center: torch.Tensor, radius: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """-log p_lo[x]: center, radius [B, V], drafted [B] int64 -> [B] >= 0 (inf where x is masked out).

    p_lo[x] = exp(c_x - r_x) / (exp(c_x - r_x) + sum_{j != x} exp(c_j + r_j)), the tight InterFuse lower bound, is
    evaluated for the drafted token alone (O(V), one log-sum-exp), without materialising the whole bound vector.
    """
    c, r = torch.broadcast_tensors(center.double(), radius.double().clamp(min=0.0))
    x = drafted.reshape(-1, 1).to(c.device)
    log_lo_x = (c - r).gather(-1, x).squeeze(-1)
    hi = c + r
    rest = torch.logsumexp(hi.scatter(-1, x, -math.inf), dim=-1)  # log sum_{j != x} exp(c_j + r_j)
    score = -F.logsigmoid(log_lo_x - rest)  # -log(lo_x / (lo_x + rest)), exact in log space
    return torch.where(torch.isfinite(log_lo_x), score, torch.full_like(score, math.inf)).float()


def gate_scores(kind: str, *, center: torch.Tensor | None = None, radius: torch.Tensor | None = None,
                probs: torch.Tensor | None = None, generator: torch.Generator | None = None, topk: int = 200,
                margin: float = 0.0, drafted: torch.Tensor | None = None) -> torch.Tensor:
    """One uncertainty score per row, [B] float32, higher = more uncertain (escalate when score > tau).

    center, radius: [B, V] logit box (guided and temperature-scaled); probs: [B, V] the draft distribution;
    drafted: [B] the drafted tokens (the "lower" gate);
    generator: CPU torch.Generator of the "random" gate. See the module docstring for each gate's scale.
    Unknown kind or a missing input -> ValueError naming it.
    """
    if kind == "interval":
        _need(kind, center=center, radius=radius)
        return interval_uncertainty(center, radius, margin=margin).float()
    if kind == "lower":
        _need(kind, center=center, radius=radius, drafted=drafted)
        return lower_score(center, radius, drafted)  # the tight bound: no safety margin
    if kind == "entropy":
        _need(kind, probs=probs)
        return entropy_score(probs)
    if kind == "softmax":
        _need(kind, probs=probs)
        return softmax_score(probs)
    if kind == "random":
        _need(kind, generator=generator)
        ref = probs if probs is not None else center
        if ref is None:
            raise ValueError("gate 'random' needs probs or center (for the batch size)")
        draws = torch.rand(ref.shape[0], generator=generator)
        return draws.to(ref.device)
    if kind == "topk":
        _need(kind, center=center, radius=radius)
        return topk_score(center, radius, topk=topk, margin=margin)
    raise ValueError(f"unknown gate kind {kind!r}; expected one of {GATES}")
