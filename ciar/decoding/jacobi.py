"""Speculative Jacobi decoding (SJD): the cloud model alone, several tokens per forward, the same distribution.

    tokens, stats = generate_sjd(model, caption_emb, caption_mask, params, seed=0, window=16)
    stats.forwards        # sequential cloud passes for the image (cloud-only: one per token)

SJD (Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with Training-free Speculative Jacobi
Decoding", ICLR 2025; the authors' code: github.com/tyshiwo1/Accelerating-T2I-AR-with-SJD, read for the rule, not
copied) drafts a window of future tokens from the model's own previous iteration instead of a draft model:

1. The window holds `window` draft tokens after the committed ones, each with the distribution q it was drawn from.
   Positions never drafted start as uniformly random tokens (q uniform: SJD's random initialisation).
2. One forward feeds the last committed token and the window: row j gives p_j, the model's distribution for window
   position j given the committed tokens and drafts 0..j-1 (exact for j = 0).
3. Speculative sampling's test, left to right (the same `verify_span` "exact" rule as every verification here): draft
   j is kept with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
   norm(max(p_j - q_j, 0)); after a whole accepted window, one more from p_L. At least one token per forward.
4. The Jacobi update: the window positions after the committed ones are drafted again from this forward's p (the
   distributions of positions the forward computed, conditioned on drafts that may have changed), the rest randomly.

Every committed token is distributed as cloud-only decoding's (speculative sampling is exact whatever q is, as long as
the draft was drawn from q); `tests/decoding/test_jacobi.py` checks it with chi-square. The draws are counter-based
like every other draw here: the test of the draft at image position i is `uniform(seed, ACCEPT_STREAM, i)` and the
token drawn there `uniform(seed, NEXT_STREAM, i)` (each read once: a position is decided once), a draft at position i
in a window drafted with c tokens committed `uniform(seed, JACOBI_STREAM, c * 2**32 + i)`. Every iteration commits at
least one token, so (c, i) names one draft of one window, and c is fixed by the tokens alone, not by how many
iterations made them: a verifier that rebuilds a session from its tokens (a resume) drafts the same windows. So the
same caption and seed give the same image, but not cloud-only's tokens (another use of the randomness).

The cache keeps the verifier's invariant: the condition and every committed token but the last are fed; a rejected
draft's keys are overwritten by the next forward before anything reads them (each forward rewrites every position from
the last committed one on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ciar.collab.acceptance import SpanDraws, verify_span
from ciar.decoding.sampling import SamplingParams, keyed_uniform, logits_to_probs, sample_at, stream_keys
from ciar.models.gpt import GPT
from ciar_device.maths import ACCEPT_STREAM, JACOBI_STREAM, NEXT_STREAM

DEFAULT_WINDOW = 16  # SJD's Jacobi window for LlamaGen and Lumina-mGPT in the authors' code


@dataclass
class JacobiStats:
    forwards: int  # sequential cloud passes after the prefill (cloud-only: one per token but the first)
    positions: int  # image positions fed per CFG row over those passes (what a saturated accelerator pays for)
    accepted: list[int]  # tokens committed per pass

    @property
    def tokens_per_forward(self) -> float:
        return sum(self.accepted) / max(self.forwards, 1)


@torch.inference_mode()
def generate_sjd(model: GPT, cond_emb: torch.Tensor, cond_mask: torch.Tensor | None, params: SamplingParams,
                 seed: int, num_tokens: int | None = None, window: int = DEFAULT_WINDOW
                 ) -> tuple[torch.Tensor, JacobiStats]:
    """One image by speculative Jacobi decoding (module docstring). cond_emb [1, L, caption_dim] (one caption),
    cond_mask [1, L] or None. -> (tokens [num_tokens] int64, JacobiStats)."""
    params.validate()
    c = model.config
    n = c.block_size if num_tokens is None else int(num_tokens)
    if not 1 <= n <= c.block_size:
        raise ValueError(f"num_tokens must be in [1, {c.block_size}], got {num_tokens}")
    if cond_emb.shape[0] != 1:
        raise ValueError(f"generate_sjd decodes one caption at a time, got {cond_emb.shape[0]}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    weight = model.tok_embeddings.weight
    dev, v = weight.device, c.vocab_size
    cond = cond_emb.to(device=dev, dtype=weight.dtype) if cond_emb.is_floating_point() else cond_emb.to(dev)
    mask = None if cond_mask is None else cond_mask.to(device=dev, dtype=torch.bool)
    drop = None
    if params.uses_cfg:
        cond, mask, drop = model.cfg_condition(cond, mask)
    rows = cond.shape[0]
    accept_key, next_key, draft_key = (stream_keys([seed], s, dev) for s in (ACCEPT_STREAM, NEXT_STREAM,
                                                                             JACOBI_STREAM))

    def probs_of(logits: torch.Tensor) -> torch.Tensor:  # [rows, T, V] -> post-guidance [T, V]
        if params.uses_cfg:
            return logits_to_probs(logits[0], params, uncond_logits=logits[1])
        return logits_to_probs(logits[0], params)

    def draft(p: torch.Tensor, first: int) -> torch.Tensor:  # p [T, V] -> a window's tokens [T] from p, `first`
        pos = torch.arange(first, first + p.shape[0], device=dev) + (first << 32)  # tokens committed before it
        return sample_at(p, keyed_uniform(draft_key, pos))

    was_training = model.training
    model.eval()
    cache = model.new_cache(rows)
    try:
        first = probs_of(model.prefill(cache, cond, mask, drop)[:, None])  # [1, V]: image token 0, exact
        # image token 0 needs no forward of its own: the first window is drafted randomly, tested from position 0
        committed: list[int] = []
        uniform_q = torch.full((v,), 1.0 / v, device=dev)
        q = uniform_q.expand(min(window, n), v)
        drafts = draft(q, 0)
        stats = JacobiStats(0, 0, [])
        while len(committed) < n:
            cpos = len(committed)
            k = drafts.shape[0]
            # feed the last committed token and every draft: rows give p for window positions 0..k (k: the bonus);
            # the first window starts at image position 0, whose target the prefill gave
            fed = drafts[None] if cpos == 0 else torch.cat([torch.tensor([[committed[-1]]], device=dev),
                                                            drafts[None]], dim=1)
            start = c.cls_token_num + max(cpos - 1, 0)
            pos = torch.arange(start, start + fed.shape[1], device=dev)
            p = probs_of(model.decode(cache, fed.expand(rows, -1), pos, kv_len=start + fed.shape[1]))
            if cpos == 0:
                p = torch.cat([first, p])  # [k + 1, V]
            stats.forwards += 1
            stats.positions += fed.shape[1]
            draws = SpanDraws.keyed(accept_key, next_key, torch.tensor([cpos], device=dev), k)
            out = verify_span("exact", drafts[None], q[None], p[None], draws, check=False)
            got, z = int(out.num_accepted), int(out.next_token)
            new = (drafts[:got].tolist() + [z])[: n - cpos]  # a bonus past the last image token is dropped
            committed += new
            stats.accepted.append(len(new))
            if len(committed) >= n:
                break
            c_new = len(committed)
            cache.set_length(range(rows), c.cls_token_num + c_new - 1)
            # the Jacobi update: the positions this forward computed past the commit are drafted from its p (rows
            # c_new - cpos .. k), the rest of the window randomly
            k_new = min(window, n - c_new)
            keep = p[got + 1:][:k_new]
            q = torch.cat([keep, uniform_q.expand(k_new - keep.shape[0], v)])
            drafts = draft(q, c_new)
    finally:
        model.train(was_training)
    return torch.tensor(committed[:n], dtype=torch.long), stats
