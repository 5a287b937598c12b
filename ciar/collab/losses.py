"""Inter-DRO: the training loss of the device model's Inter-Head (DESIGN.md section 4, paper Eq. 5-8).

    cfg = InterDROConfig(kl_weight=1.0, dro_eta=1.0).ablate("lower")     # paper Table 7 ablations
    total, parts = inter_dro_loss(center, radius, targets, cloud_probs, cfg)   # center/radius [M, V], targets [M]

With c the center logits, r >= 0 the radius, y the label (data token or the cloud's choice) and q the frozen
cloud's distribution:
  L_anchor = CE(c - r, y) + CE(c + r, y) + CE(c, y)
  L_lower  = sum_i w_i CE(c_i - r_i, y_i),  w = softmax(stopgrad(CE_i) / eta) over the batch (DRO: harder rows
             weigh more; eta -> inf is the plain mean)
  L_center = CE(c, y) + kl_weight * KL(q || softmax(c))
  L_upper  = CE(c + r, y)
  total    = anchor * L_anchor + lower * L_lower + center * L_center + upper * L_upper + radius_reg * mean(r)
Rows with target == ignore_index are left out of every term. `parts` holds each term's value (float) for logs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

LOSS_TERMS = ("anchor", "lower", "center", "upper")


@dataclass(frozen=True)
class InterDROConfig:
    anchor: float = 1.0
    lower: float = 1.0
    center: float = 1.0
    upper: float = 1.0
    kl_weight: float = 1.0  # lambda of the center term's KL to the cloud
    dro_eta: float = 1.0  # temperature of the DRO weights of the lower term
    radius_reg: float = 0.0  # optional L1 pull of the radius towards 0

    def __post_init__(self):
        for name in LOSS_TERMS + ("kl_weight", "radius_reg"):
            if getattr(self, name) < 0:
                raise ValueError(f"InterDROConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.dro_eta > 0:
            raise ValueError(f"InterDROConfig.dro_eta must be > 0, got {self.dro_eta}")

    def ablate(self, term: str) -> "InterDROConfig":
        """The same config with one of LOSS_TERMS switched off."""
        if term not in LOSS_TERMS:
            raise ValueError(f"unknown loss term {term!r}; known: {', '.join(LOSS_TERMS)}")
        return replace(self, **{term: 0.0})


def inter_dro_loss(center: torch.Tensor, radius: torch.Tensor, targets: torch.Tensor,
                   cloud_probs: torch.Tensor | None = None, config: InterDROConfig = InterDROConfig(),
                   ignore_index: int = -100) -> tuple[torch.Tensor, dict[str, float]]:
    """center, radius [M, V]; targets [M] int64; cloud_probs [M, V] or None (no KL) -> (scalar loss, parts)."""
    if center.shape != radius.shape or center.dim() != 2:
        raise ValueError(f"center and radius must both be [M, V], got {tuple(center.shape)} and {tuple(radius.shape)}")
    if targets.shape != center.shape[:1]:
        raise ValueError(f"targets must be [M] = [{center.shape[0]}], got {tuple(targets.shape)}")
    keep = targets != ignore_index
    c, r, y = center[keep].float(), radius[keep].float(), targets[keep]
    if y.numel() == 0:
        zero = center.sum() * 0.0
        return zero, {t: 0.0 for t in LOSS_TERMS}
    ce_c = F.cross_entropy(c, y, reduction="none")
    ce_lo = F.cross_entropy(c - r, y, reduction="none")
    ce_hi = F.cross_entropy(c + r, y, reduction="none")

    parts: dict[str, torch.Tensor] = {}
    parts["anchor"] = ce_lo.mean() + ce_hi.mean() + ce_c.mean()
    w = torch.softmax(ce_lo.detach() / config.dro_eta, dim=0)
    parts["lower"] = (w * ce_lo).sum()
    center_loss = ce_c.mean()
    if cloud_probs is not None and config.kl_weight > 0:
        q = cloud_probs[keep].float()
        logp = torch.log_softmax(c, dim=-1)
        kl = (q * (q.clamp_min(1e-12).log() - logp)).sum(-1).mean()
        parts["kl"] = kl
        center_loss = center_loss + config.kl_weight * kl
    parts["center"] = center_loss
    parts["upper"] = ce_hi.mean()

    total = sum(getattr(config, t) * parts[t] for t in LOSS_TERMS)
    if config.radius_reg:
        total = total + config.radius_reg * r.mean()
    parts["radius_mean"] = r.mean().detach()
    return total, {k: float(v.detach()) for k, v in parts.items()}
