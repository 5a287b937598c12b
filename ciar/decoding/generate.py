"""Cloud-only generation: the cloud GPT samples every image token itself (the reference every method is judged by).

    model = world.cloud
    cap = world.text.encode(["a small red circle at the top on a gray background"])
    tokens = generate_cloud(model, cap.emb, cap.mask, world.sampling, seed=0)                             # [1, N]
    images = world.vq.decode_code(tokens)                                                                 # [-1, 1]

Loop (gpt-fast style): one prefill of the `cls_token_num` condition positions gives the first image token's
logits; then each step feeds the token just sampled at its position (`cls_token_num + i`) through the static KV
cache and gets the next token's logits. With `cfg_scale > 1` the batch is doubled into rows
[cond..., uncond...] (`model.cfg_condition`) and every step guides with
`logits_to_probs(cond, params, uncond_logits=uncond)`. The key length is passed as a Python int, so the loop
makes no host syncs; its only per-step allocations are the model's own activations.
"""

from __future__ import annotations

import torch

from ciar.decoding.sampling import SamplingParams, keyed_uniform, logits_to_probs, sample_at, stream_keys
from ciar_device.maths import CLOUD_STREAM
from ciar.models.gpt import GPT
from ciar.models.kv_cache import KVCache


@torch.no_grad()
def generate_cloud(model: GPT, cond_emb: torch.Tensor, cond_mask: torch.Tensor | None, params: SamplingParams,
                   seed, num_tokens: int | None = None, cache: KVCache | None = None,
                   return_probs: bool = False):
    """Sample `num_tokens` (default: `block_size`) image tokens per caption with the cloud model alone.

    cond_emb: [B, L, caption_dim] caption embeddings (t2i) or [B] labels (c2i); cond_mask: [B, L] bool or None.
    seed: an integer (row b draws with seed + b, as image b of a request does) or one seed per row. The only source
    of randomness: token i of row b is drawn at `counter_uniform(seed_b, CLOUD_STREAM, i)` (inverse CDF,
    `sample_at`), the draw the verifier makes for a prefix or cloud-only token at that position, so the cloud-only
    method through the cluster gives these tokens, and a row's tokens do not depend on the rest of the batch.
    cache: optional preallocated cache with at least B (2B with CFG) slots; rows use slots 0..B-1 (cond) and
    B..2B-1 (uncond). Afterwards it holds the condition and the first N-1 tokens and its
    `lengths` say so (the last token is sampled, never fed).

    -> tokens [B, N] int64; with `return_probs`, (tokens, probs [B, N, V] float32) where probs[:, i] is the
    post-guidance distribution token i was drawn from.
    """
    params.validate()
    c = model.config
    n = c.block_size if num_tokens is None else int(num_tokens)
    if not 1 <= n <= c.block_size:
        raise ValueError(f"num_tokens must be in [1, {c.block_size}], got {num_tokens}")
    weight = model.tok_embeddings.weight
    device = weight.device
    b = cond_emb.shape[0]
    if isinstance(seed, torch.Generator) or isinstance(seed, bool):
        raise TypeError("generate_cloud takes a seed (an int, or one per row), not a torch.Generator")
    seeds = [int(seed) + i for i in range(b)] if isinstance(seed, int) else [int(x) for x in seed]
    if len(seeds) != b:
        raise ValueError(f"{len(seeds)} seeds for {b} rows")
    keys = stream_keys(seeds, CLOUD_STREAM, device)

    cond = cond_emb.to(device=device, dtype=weight.dtype) if cond_emb.is_floating_point() else cond_emb.to(device)
    mask = None if cond_mask is None else cond_mask.to(device=device, dtype=torch.bool)
    drop = None
    if params.uses_cfg:
        cond, mask, drop = model.cfg_condition(cond, mask)
    rows = cond.shape[0]  # B, or 2B with CFG

    if cache is None:
        cache = model.new_cache(rows)
    elif cache.slots < rows or cache.max_seq < c.cls_token_num + n:
        raise ValueError(f"cache has {cache.slots} slots x {cache.max_seq} positions; this call needs "
                         f"{rows} x {c.cls_token_num + n}")

    tokens = torch.empty(b, n, dtype=torch.long, device=device)  # [B, N]
    probs_out = torch.empty(b, n, c.vocab_size, dtype=torch.float32, device=device) if return_probs else None
    step_in = torch.empty(rows, 1, dtype=torch.long, device=device)  # [rows, 1] the token fed this step
    positions = torch.arange(c.cls_token_num, c.cls_token_num + n, device=device)  # [N] image token i -> cls + i

    was_training = model.training
    model.eval()
    try:
        logits = model.prefill(cache, cond, mask, drop)  # [rows, V] -> image token 0
        for i in range(n):
            if params.uses_cfg:
                probs = logits_to_probs(logits[:b], params, uncond_logits=logits[b:])  # [B, V]
            else:
                probs = logits_to_probs(logits, params)
            tok = sample_at(probs, keyed_uniform(keys, torch.full_like(keys, i)))  # [B]
            tokens[:, i] = tok
            if probs_out is not None:
                probs_out[:, i] = probs
            if i == n - 1:
                break
            step_in.view(-1, b).copy_(tok.unsqueeze(0).expand(rows // b, b))  # same token in cond and uncond rows
            pos = c.cls_token_num + i
            logits = model.decode(cache, step_in, positions[i:i + 1], kv_len=pos + 1)[:, -1]  # [rows, V]
    finally:
        model.train(was_training)
    cache.set_length(range(rows), c.cls_token_num + n - 1)
    return (tokens, probs_out) if return_probs else tokens
