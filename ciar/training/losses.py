"""Inter-DRO: the training loss of the device model's Inter-Head (docs/architecture.md §7, paper Eq. 5-8).

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


# ---------------------------------------------------------------------------------------------------------------
# Distillation against the *guided* cloud, with a coverage-trained interval (docs/architecture.md §12.2)
# ---------------------------------------------------------------------------------------------------------------

DISTILL_TERMS = ("kl", "cond_kl", "coverage", "inter_dro")


@dataclass(frozen=True)
class DistillConfig:
    """Weights of `distill_loss`'s terms; any of DISTILL_TERMS can be switched off with `ablate`.

    kl        KL(guided cloud || guided device), the main term: the distribution the device drafts from
    cond_kl   KL(cloud cond row || device cond row), an optional anchor for the conditional row (needs the cloud's
              conditional logits, which the teacher cache does not keep; off by default)
    coverage  `coverage_loss` of the guided box: it should hold the cloud's guided log-probabilities of the tokens
              that carry mass, at a price per unit of width
    inter_dro the paper's Inter-DRO terms (`inter_dro_loss`) on the guided box, labels = the on-policy tokens
    """

    kl: float = 1.0
    cond_kl: float = 0.0
    coverage: float = 1.0
    inter_dro: float = 0.0
    coverage_width: float = 0.1  # price of the box's log(S_hi / S_lo) (see `coverage_loss`)
    dro: InterDROConfig = InterDROConfig()

    def __post_init__(self):
        for name in DISTILL_TERMS + ("coverage_width",):
            if getattr(self, name) < 0:
                raise ValueError(f"DistillConfig.{name} must be >= 0, got {getattr(self, name)}")

    def ablate(self, term: str) -> "DistillConfig":
        if term not in DISTILL_TERMS:
            raise ValueError(f"unknown distillation term {term!r}; known: {', '.join(DISTILL_TERMS)}")
        return replace(self, **{term: 0.0})


def kl_rows(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row for p [M, V] (zeros allowed) and log q [M, V] (finite where p > 0) -> [M]."""
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum(-1)


def coverage_loss(center: torch.Tensor, radius: torch.Tensor, cloud_logp: torch.Tensor, width: float = 0.1
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Coverage of the cloud by the box, with a width penalty; all inputs [M, V] -> (scalar, parts).

    e_i = |log softmax(c)_i - log p_cloud_i| is the device's log-probability error on token i. Per row

        L = sum_i w_i (e_i - r_i)_+  +  width * [logsumexp(c + r) - logsumexp(c - r)],   w_i = (p_i + q_i) / 2

    The first term asks the box to hold the cloud's log-probability of the tokens that carry mass (under either
    model). The second prices width by what it does to InterFuse's bounds: log(S_hi / S_lo), the log-ratio of the
    box's largest and smallest partition sums, so widening token i costs ~ width * (its share of S_hi + of S_lo).
    At the optimum w_i P(e_i > r_i) = width (softmax(c + r)_i + softmax(c - r)_i): a token's coverage rises with
    its mass, and a token the device over-estimates (the cloud gives it ~0) cannot buy a huge symmetric box that
    would inflate every other token's bounds (with a per-token price instead, ~40 tokens per row reached the radius
    clamp and p_lo of a likely draft fell to ~1e-9). Only the radius is trained here (the center is detached). If
    every token's log-probability lies in its box, the cloud's logit vector lies in [c - r, c + r] (logits are
    defined up to a constant), so p_cloud lies inside InterFuse's bounds. Tokens the cloud gives zero probability
    (top-k/p truncation) are left out of the first term.
    """
    c = center.detach().float()
    logq = torch.log_softmax(c, dim=-1)
    live = torch.isfinite(cloud_logp)
    lp = torch.where(live, cloud_logp.float(), logq)
    err = (logq - lp).abs()
    r = radius.float()
    w = 0.5 * (lp.exp() * live + logq.exp()) * live
    miss = (w * (err - r).clamp(min=0.0)).sum(-1)
    spread = torch.logsumexp(c + r, dim=-1) - torch.logsumexp(c - r, dim=-1)
    loss = (miss + width * spread).mean()
    inside = ((err <= r) & live).float()
    covered_mass = (inside * lp.exp() * live).sum(-1).mean()
    return loss, {"coverage_of_cloud_mass": covered_mass.detach(), "box_log_spread": spread.mean().detach()}


def guided_logp(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None, params) -> torch.Tensor:
    """The cloud's guided, temperature-scaled, *untruncated* log-distribution [..., V] float32 (CFG -> temperature;
    top-k/p are left to `truncate`). logits_to_probs(cond, params, uncond) == truncate(guided_logp(...), params)."""
    from ciar.decoding.sampling import guide

    lg = cond_logits.float()
    if uncond_logits is not None and params.uses_cfg:
        lg = guide(lg, uncond_logits.float(), params.cfg_scale)
    return torch.log_softmax(lg / (params.temperature or 1.0), dim=-1)


def truncate(logp: torch.Tensor, params) -> torch.Tensor:
    """Guided log-probs [..., V] -> the sampling distribution after top-k/p (`logits_to_probs` without CFG and
    temperature, which `guided_logp` applied)."""
    from ciar.decoding.sampling import SamplingParams, logits_to_probs

    if not (params.top_k or params.top_p < 1.0):
        return logp.float().exp()
    return logits_to_probs(logp, SamplingParams(top_k=params.top_k, top_p=params.top_p))


def distill_loss(dev_c: torch.Tensor, dev_r: torch.Tensor, cloud_logp: torch.Tensor, params,
                 targets: torch.Tensor | None = None, config: DistillConfig = DistillConfig(),
                 cloud_cond_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Distil the device towards the guided cloud; -> (scalar loss, parts as floats).

    dev_c, dev_r: [2, M, V] device center / radius of the conditional (0) and unconditional (1) rows, or [1, M, V]
    without CFG; cloud_logp [M, V]: the cloud's `guided_logp` (computed live or read from the teacher cache);
    params: the world's SamplingParams; targets [M]: the on-policy tokens (labels of the optional Inter-DRO terms);
    cloud_cond_logits [M, V]: the cloud's conditional row (only for the `cond_kl` term).

    The guided device box is `guided_interval` of its rows (the box the deployed gate sees); the cloud's sampling
    distribution p = truncate(cloud_logp) is the KL target, its untruncated log-probabilities the coverage target.
    """
    from ciar.collab.interval import guided_interval

    temp = params.temperature or 1.0
    if dev_c.shape[0] == 2 and params.uses_cfg:
        c_g, r_g = guided_interval(dev_c[0], dev_r[0], dev_c[1], dev_r[1], cfg_scale=params.cfg_scale,
                                   temperature=temp)
    else:
        c_g, r_g = guided_interval(dev_c[0], dev_r[0], temperature=temp)
    p = truncate(cloud_logp, params)
    logq = torch.log_softmax(c_g, dim=-1)
    parts: dict[str, torch.Tensor] = {}
    total = c_g.sum() * 0.0
    if config.kl:
        parts["kl"] = kl_rows(p, logq).mean()
        total = total + config.kl * parts["kl"]
    if config.cond_kl:
        if cloud_cond_logits is None:
            raise ValueError("the cond_kl term needs cloud_cond_logits (the cloud's conditional row)")
        pc = torch.softmax(cloud_cond_logits.float(), dim=-1)
        parts["cond_kl"] = kl_rows(pc, torch.log_softmax(dev_c[0].float(), dim=-1)).mean()
        total = total + config.cond_kl * parts["cond_kl"]
    if config.coverage:
        parts["coverage"], extra = coverage_loss(c_g, r_g, cloud_logp.float(), config.coverage_width)
        parts.update(extra)
        total = total + config.coverage * parts["coverage"]
    if config.inter_dro:
        if targets is None:
            raise ValueError("the inter_dro term needs targets (the on-policy tokens)")
        dro, _ = inter_dro_loss(c_g, r_g, targets, p, config.dro)
        parts["inter_dro"] = dro
        total = total + config.inter_dro * dro
    with torch.no_grad():
        q = logq.exp()
        parts["tv"] = 0.5 * (p - q).abs().sum(-1).mean()
        parts["agree"] = (p.argmax(-1) == q.argmax(-1)).float().mean()
        parts["radius_mean"] = r_g.mean()
    return total, {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in parts.items()}
