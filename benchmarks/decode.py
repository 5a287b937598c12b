"""Cloud-only decoding throughput: our GPT (static KV cache) next to a Hugging Face Llama of the same size.

    python -m benchmarks.decode --out decode.json [--batch-sizes 1,16] [--tokens 144] [--repeats 3] \
        [--threads 1] [--config scenes-cloud | --world llamagen.yaml] [--device cpu|cuda] [--override dim=64,n_layer=2]

Both sides do the same work per generation, timed end to end (image tokens per second = batch * tokens / s):
- ours: `ciar.decoding.generate.generate_cloud` with `cfg_scale=1.0` (B rows): prefill of the `cls_token_num`
  condition positions, then one token per step through the preallocated KV cache;
- HF: `transformers.LlamaForCausalLM` (same width, depth, heads, FFN hidden size, vocab, RMSNorm eps, no bias)
  with its own `DynamicCache`: a prefill forward over `inputs_embeds` [B, cls_token_num, dim] with the same
  caption-padding mask, then one token per step with `past_key_values` and `use_cache=True`.
Both sample with the project's `logits_to_probs` + `sample` and a seeded `torch.Generator`. Runs are
interleaved (ours, hf, ours, hf, ...) after one untimed warm-up each; the median over repeats is reported.

Weights: the shipped cloud model (`weights/scenes-v2/cloud.safetensors`) when it exists and fits the config,
else a seeded random initialisation; the HF model gets a copy of the same weights (q|k|v split from `wqkv`), so
both compute the same network up to the position encoding (2D RoPE vs Llama's 1D RoPE, identical cost class).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ciar.decoding.generate import generate_cloud
from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample
from ciar.models.gpt import GPT, GPTConfig, build_gpt, gpt_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_CLOUD = os.path.join(REPO, "weights", "scenes-v2", "cloud.safetensors")


# ---------------------------------------------------------------------------------------------- models
def load_ours(config: str, overrides: dict, seed: int, device: torch.device) -> tuple[GPT, str]:
    """-> (model in eval mode, weights source). Shipped weights are used only when they fit the requested config."""
    cfg = gpt_config(config, **overrides)
    if config == "scenes-cloud" and os.path.isfile(SHIPPED_CLOUD):
        from ciar.models.checkpoint import load_strict, read_model_file

        state, _, cfg_dict, _ = read_model_file(SHIPPED_CLOUD)
        shipped = GPTConfig.from_dict(cfg_dict)
        if not overrides or shipped == cfg:
            model = GPT(shipped)
            load_strict(model, state, what="shipped cloud model")
            return model.to(device).eval(), os.path.relpath(SHIPPED_CLOUD, REPO)
    torch.manual_seed(seed)
    model = build_gpt(cfg)
    torch.nn.init.normal_(model.output.weight, std=cfg.initializer_range)  # zero-init head would sample uniformly
    return model.to(device).eval(), f"random (seed {seed})"


def hf_llama_like(model: GPT):
    """A `LlamaForCausalLM` with `model`'s shape and a copy of its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden,
                         num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.norm_eps, rope_theta=c.rope_base,
                         max_position_embeddings=c.seq_len + 16, attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0)
    hf_cfg._attn_implementation = "sdpa"  # the same kernel family as ours (F.scaled_dot_product_attention)
    hf = LlamaForCausalLM(hf_cfg)
    dev = model.output.weight.device
    q, k = c.dim, c.kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        wq, wk, wv = layer.attention.wqkv.weight.split([q, k, k], dim=0)
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                      p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer.attention.wo.weight,
                      p + "mlp.gate_proj.weight": layer.feed_forward.w1.weight,
                      p + "mlp.up_proj.weight": layer.feed_forward.w3.weight,
                      p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
                      p + "input_layernorm.weight": layer.attention_norm.weight,
                      p + "post_attention_layernorm.weight": layer.ffn_norm.weight})
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return hf.to(dev).eval()


# ---------------------------------------------------------------------------------------------- generation
@torch.inference_mode()
def run_ours(model: GPT, cond: torch.Tensor, cond_mask: torch.Tensor, tokens: int, params: SamplingParams,
             seed: int) -> torch.Tensor:
    return generate_cloud(model, cond, cond_mask, params, seed, num_tokens=tokens)  # [B, tokens]


@torch.inference_mode()
def run_hf(hf, embeds: torch.Tensor, cond_mask: torch.Tensor, tokens: int, params: SamplingParams,
           seed: int) -> torch.Tensor:
    """The cloud-only loop with HF's own cache: prefill embeds [B, L, dim], then one sampled token per step."""
    from transformers import DynamicCache

    gen = torch.Generator(device=embeds.device).manual_seed(seed)
    b, L, _ = embeds.shape
    # caption padding masked as in ours; image positions always valid (sliced, never re-concatenated per step)
    attn = torch.cat([cond_mask.long(), torch.ones(b, tokens, dtype=torch.long, device=embeds.device)], dim=1)
    cache = DynamicCache(config=hf.config)
    logits = hf(inputs_embeds=embeds, attention_mask=attn[:, :L], past_key_values=cache, use_cache=True,
                logits_to_keep=1).logits[:, -1].float()  # [B, V]
    out = torch.empty(b, tokens, dtype=torch.long, device=embeds.device)
    for i in range(tokens):
        tok = sample(logits_to_probs(logits, params), gen)  # [B]
        out[:, i] = tok
        if i + 1 == tokens:
            break
        logits = hf(input_ids=tok.view(b, 1), attention_mask=attn[:, : L + i + 1], past_key_values=cache,
                    use_cache=True).logits[:, -1].float()
    return out


def make_condition(cfg: GPTConfig, batch: int, seed: int, device: torch.device):
    """-> caption embeddings [B, L, caption_dim], mask [B, L] (left padding, 8..L valid tokens), HF embeds [B, L, dim]."""
    g = torch.Generator().manual_seed(seed)
    L = cfg.cls_token_num
    cond = torch.randn(batch, L, cfg.caption_dim, generator=g)
    valid = torch.randint(min(8, L), L + 1, (batch,), generator=g)
    mask = torch.arange(L)[None, :] >= (L - valid)[:, None]
    embeds = torch.randn(batch, L, cfg.dim, generator=g) * 0.02
    return cond.to(device), mask.to(device), embeds.to(device)


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- benchmark
def run_benchmark(config: str = "scenes-cloud", batch_sizes=(1, 16), tokens: int | None = None, repeats: int = 3,
                  threads: int = 1, device: str = "cpu", overrides: dict | None = None, seed: int = 0,
                  world: str | dict | None = None) -> dict:
    """`world` (a world file / dict, `ciar.world_spec`): benchmark that world's cloud GPT (a LlamaGen checkpoint)
    instead of `config`."""
    import transformers

    overrides = overrides or {}
    dev = torch.device(device)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if world is not None:
            from ciar.world import load_world_cloud

            model, weights = load_world_cloud(world, dev)
            config = f"world:{weights}"
        else:
            model, weights = load_ours(config, overrides, seed, dev)
        hf = hf_llama_like(model)
        cfg = model.config
        tokens = cfg.block_size if tokens is None else tokens
        if not 1 <= tokens <= cfg.block_size:
            raise ValueError(f"--tokens must be in 1..{cfg.block_size}, got {tokens}")
        params = SamplingParams(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)
        result: dict = {}
        for b in batch_sizes:
            cond, mask, embeds = make_condition(cfg, b, seed, dev)
            ours = lambda: run_ours(model, cond, mask, tokens, params, seed)  # noqa: E731
            theirs = lambda: run_hf(hf, embeds, mask, tokens, params, seed)  # noqa: E731
            ours(), theirs()  # warm-up (allocator, lazy init), untimed
            t_ours, t_hf = [], []
            for _ in range(repeats):
                t_ours.append(_timed(ours, dev))
                t_hf.append(_timed(theirs, dev))
            n = b * tokens
            o, h = n / statistics.median(t_ours), n / statistics.median(t_hf)
            result[f"batch_{b}"] = {"ours_tok_s": round(o, 2), "hf_tok_s": round(h, 2), "ratio": round(o / h, 4)}
        result["meta"] = {
            "config": config, "overrides": overrides, "model": cfg.to_dict(), "weights": weights,
            "hf_weights": "copy of ours (q|k|v split from wqkv)", "threads": threads, "device": str(dev),
            "torch": torch.__version__, "transformers": transformers.__version__, "tokens": tokens,
            "prefill_positions": cfg.cls_token_num, "repeats": repeats, "statistic": "median, interleaved",
            "sampling": "logits_to_probs + sample, " + repr(params), "hf_attn_implementation": "sdpa",
            "seed": seed,
        }
        return result
    finally:
        torch.set_num_threads(prev_threads)


def _parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        out[key.strip()] = value
    return out


def print_table(result: dict) -> None:
    m = result["meta"]
    print(f"cloud-only decoding, {m['config']}, {m['tokens']} tokens, {m['threads']} thread(s), {m['device']}, "
          f"median of {m['repeats']} (weights: {m['weights']})")
    print(f"{'batch':>6} {'ours tok/s':>12} {'hf tok/s':>12} {'ours/hf':>8}")
    for key, row in result.items():
        if key.startswith("batch_"):
            print(f"{key[6:]:>6} {row['ours_tok_s']:>12.1f} {row['hf_tok_s']:>12.1f} {row['ratio']:>8.3f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--tokens", type=int, default=None, help="image tokens per generation (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", default="scenes-cloud")
    ap.add_argument("--world", default=None, help="a world file (ciar.world_spec): benchmark its cloud GPT, e.g. a "
                                                  "LlamaGen-XL checkpoint (instead of --config)")
    ap.add_argument("--override", default="", help="GPTConfig overrides, e.g. dim=64,n_layer=2,n_head=4")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = run_benchmark(args.config, [int(b) for b in args.batch_sizes.split(",")], args.tokens, args.repeats,
                           args.threads, args.device, _parse_overrides(args.override), args.seed, world=args.world)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
