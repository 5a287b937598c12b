"""Logits -> post-guidance next-token distribution, and seeded sampling from it.

This is the one place where logits become probabilities. The cloud-only loop, every drafter, every verifier and
every acceptance rule call `logits_to_probs`, so that drafts and verification compare the *same* distribution
(docs/architecture.md §7: "CFG -> temperature -> top-k/top-p, in that order").

Order of operations in `logits_to_probs` (all in float32, over the last dim, any leading shape):

1. classifier-free guidance: `l = u + (c - u) * cfg_scale` (LlamaGen's formula) when `uncond_logits` is given
   and `cfg_scale != 1`;
2. temperature: `l = l / temperature`; temperature 0 means greedy: the result is the one-hot of `argmax l`
   (lowest index on ties) and steps 3-4 are skipped (the argmax survives any top-k/top-p filter);
3. top-k (0 disables): keep the logits >= the k-th largest; ties with the k-th value are all kept, so the result
   does not depend on the order of equal logits (as LlamaGen's filter);
4. top-p (1 disables): softmax, then keep the smallest set of most probable tokens whose mass reaches top_p
   (the most probable token is always kept; tokens tied with the least probable kept one are kept too), and
   renormalise.

    params = SamplingParams(cfg_scale=3.0, top_k=100)
    probs = logits_to_probs(cond_logits, params, uncond_logits=uncond_logits)  # [B, V], rows sum to 1
    tokens = sample(probs, generator)                                          # [B] int64
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Scalar sampling settings shared by a whole batch; validated on construction (`validate`)."""

    cfg_scale: float = 1.0  # classifier-free guidance scale; > 1 enables guidance, 1 disables it
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables

    def __post_init__(self):
        self.validate()

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the field when a value is out of range; returns self."""
        def real(name, value):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if real("cfg_scale", self.cfg_scale) < 1.0:
            raise ValueError(f"cfg_scale must be >= 1 (1 disables guidance), got {self.cfg_scale!r}")
        if real("temperature", self.temperature) < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0.0 < real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables), got {self.top_p!r}")
        return self

    @property
    def uses_cfg(self) -> bool:
        """Whether decoding must run unconditional rows next to the conditional ones."""
        return self.cfg_scale > 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# LlamaGen's text-to-image sampling defaults (docs/architecture.md §9).
LLAMAGEN_T2I_DEFAULTS = SamplingParams(cfg_scale=7.5, temperature=1.0, top_k=1000, top_p=1.0)


def guide(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance on logits: `uncond + (cond - uncond) * cfg_scale` (shapes [..., V])."""
    return uncond_logits + (cond_logits - uncond_logits) * cfg_scale


def logits_to_probs(logits: torch.Tensor, params: SamplingParams,
                    uncond_logits: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] (conditional rows), uncond_logits [..., V] or None -> probs [..., V] float32.

    Applies CFG -> temperature -> top-k -> top-p, in that order (see the module docstring). Guidance is applied
    only when `uncond_logits` is given; callers that run CFG pass the unconditional rows' logits here.
    """
    logits = logits.float()
    if uncond_logits is not None and params.cfg_scale != 1.0:
        logits = guide(logits, uncond_logits.float(), params.cfg_scale)
    vocab = logits.shape[-1]

    if params.temperature == 0.0:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if params.temperature != 1.0:
        # shifted so the largest logit is 0 first: a tiny temperature then gives -inf, never inf - inf = NaN
        # (and at least float32's smallest normal number, so that it does not round to 0 in the division)
        t = max(params.temperature, torch.finfo(logits.dtype).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / t

    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))

    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p = torch.sort(probs, dim=-1, descending=True, stable=True).values  # [..., V]
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more probable tokens
        n_keep = (mass_before < params.top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # [..., 1], >= 1
        threshold = sorted_p.gather(-1, n_keep - 1)  # least probable kept probability
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [..., V] -> tokens [...] int64, one draw per row from `generator` (row-major order).

    Zero-probability tokens are never drawn, so a one-hot row always yields its token. If the generator lives on
    another device than `probs` (e.g. a CPU generator with CUDA probs), the draw happens on the generator's device
    and the tokens are moved back: same seed, same tokens, at the cost of a copy per call.
    """
    lead = probs.shape[:-1]
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.device.type != generator.device.type:
        out = torch.multinomial(flat.to(generator.device), 1, generator=generator).to(probs.device)
    else:
        out = torch.multinomial(flat, 1, generator=generator)
    return out.view(lead)
