"""LlamaGen's GPT for image tokens (text- or class-conditional), with a static KV cache for span verification.

Architecture and parameter names follow LlamaGen's `autoregressive/models/gpt.py` so its checkpoints load
strictly (`load_llamagen_gpt`); the code is ours. Facts reproduced (docs/architecture.md §9):
- bias-free linear layers, RMSNorm (eps 1e-5), SwiGLU FFN `w2(silu(w1 x) * w3 x)` with hidden size
  int(8d/3) rounded up to a multiple of 256, fused `wqkv` (q|k|v);
- 2D RoPE over the image grid (head_dim halves: rows / columns, interleaved pairs), and zero cos/sin for the
  first `cls_token_num` condition positions (their q and k vanish, as in LlamaGen);
- t2i condition: `cls_embedding.cap_proj` (fc1 -> GELU(tanh) -> fc2) over caption token embeddings, with the
  buffer `cls_embedding.uncond_embedding` replacing the caption for classifier-free guidance;
- caption padding is on the left and masked out of attention (LlamaGen's `emb_masks`), with the diagonal kept.

Sequence layout: positions 0..cls_token_num-1 hold the condition, image token i sits at cls_token_num + i.
The logits at position p predict the image token at p - cls_token_num + 1.

Cached decoding (`forward_cached`) accepts any number of tokens per row at arbitrary per-row positions
(`input_pos` [B, T]) and maps rows to cache slots (`slots` [B]); this is what span verification needs.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.models import slot_attention
from ciar.models.kv_cache import KVCache


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    dim: int = 1280
    n_layer: int = 36
    n_head: int = 20
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    cap_proj_bias: bool = False  # LlamaGen's caption MLP is bias-free; the scenes-v1 cloud model has biases
    model_type: str = "t2i"  # "t2i" (caption embeddings) or "c2i" (class labels)
    vocab_size: int = 16384
    cls_token_num: int = 120
    block_size: int = 256  # image tokens per image (grid_size ** 2)
    lm_head: bool = True  # False: no `output` layer (the CIAR device model puts its Inter-Head there instead)
    # rotary table of the condition positions: "zero" = LlamaGen (cos = sin = 0, so their q and k vanish and every
    # image token sees the caption as a uniform average); "identity" = cos 1, sin 0 (q/k kept, unrotated), which
    # lets image tokens attend to caption words by content. LlamaGen configs use "zero"; see the scenes-v1 card.
    cls_rope: str = "zero"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        return int(math.isqrt(self.block_size))

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def seq_len(self) -> int:
        return self.cls_token_num + self.block_size

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "GPTConfig":
        return GPTConfig(**d)


_LLAMAGEN_T2I = dict(caption_dim=2048, cls_token_num=120, vocab_size=16384, model_type="t2i")
GPT_CONFIGS: dict[str, GPTConfig] = {
    # the default world's cloud model: 12x12 tokens, 1024 codes, MiniLM captions (<= 40 tokens)
    "scenes-cloud": GPTConfig(dim=256, n_layer=8, n_head=8, vocab_size=1024, caption_dim=384, cls_token_num=40,
                              block_size=144, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0,
                              class_dropout_prob=0.1, cap_proj_bias=True, cls_rope="identity"),
    # LlamaGen sizes (t2i defaults; pass model_type="c2i", cls_token_num=1 for class-conditional checkpoints)
    "GPT-B": GPTConfig(dim=768, n_layer=12, n_head=12, **_LLAMAGEN_T2I),
    "GPT-L": GPTConfig(dim=1024, n_layer=24, n_head=16, **_LLAMAGEN_T2I),
    "GPT-XL": GPTConfig(dim=1280, n_layer=36, n_head=20, **_LLAMAGEN_T2I),
    "GPT-XXL": GPTConfig(dim=1536, n_layer=48, n_head=24, **_LLAMAGEN_T2I),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    if name not in GPT_CONFIGS:
        raise KeyError(f"unknown GPT config {name!r}; known: {sorted(GPT_CONFIGS)}")
    return replace(GPT_CONFIGS[name], **overrides)


def precompute_freqs_cis_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int,
                            cls_rope: str = "zero") -> torch.Tensor:
    """-> [cls_token_num + grid_size**2, head_dim // 2, 2] (cos, sin); the condition positions get zeros
    (`cls_rope="zero"`, LlamaGen) or the identity rotation (`"identity"`: cos 1, sin 0)."""
    if cls_rope not in ("zero", "identity"):
        raise ValueError(f"cls_rope must be 'zero' or 'identity', got {cls_rope!r}")
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # [head_dim // 4]
    t = torch.arange(grid_size, dtype=torch.float32)
    f = torch.outer(t, freqs)  # [grid, head_dim // 4]
    grid = torch.cat([f[:, None, :].expand(-1, grid_size, -1), f[None, :, :].expand(grid_size, -1, -1)], dim=-1)
    cache = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)  # [grid**2, head_dim // 2, 2]
    cls = torch.zeros(cls_token_num, head_dim // 2, 2)
    if cls_rope == "identity":
        cls[..., 0] = 1.0
    return torch.cat([cls, cache])


def rotary_factors(freqs: torch.Tensor) -> torch.Tensor:
    """freqs [B or 1, T, D // 2, 2] (cos, sin) -> the complex factors [B or 1, T, 1, D // 2] that
    `apply_rotary_emb` multiplies by: computed once per forward and shared by every layer (each layer casting and
    viewing the table again cost a kernel a layer)."""
    return torch.view_as_complex(freqs.float().contiguous()).unsqueeze(-2)


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; freqs: [B or 1, T, D // 2, 2], or its `rotary_factors` -> rotated x (interleaved pairs),
    same dtype.

    Each pair (a, b) becomes (a cos - b sin, b cos + a sin): one complex product per pair in float32 (the same
    bits as the four real products, in a fifth of the kernel launches)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, D/2, 2]
    if xs.stride(-1) != 1 or xs.storage_offset() % 2 or any(st % 2 for st in xs.stride()[:-1]):
        xs = xs.contiguous()  # view_as_complex needs (re, im) pairs adjacent and pair-aligned
    if not freqs.is_complex() and torch.compiler.is_compiling():
        # a compiled block (`compiled_block`): the same product in real arithmetic, which the compiler fuses
        # (it generates no code for complex operators)
        f = freqs.float().unsqueeze(2)  # [B, T, 1, D/2, 2]
        a, b, c, s = xs[..., 0], xs[..., 1], f[..., 0], f[..., 1]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(3).type_as(x)
    f = freqs if freqs.is_complex() else rotary_factors(freqs)  # [B, T, 1, D/2] complex
    return torch.view_as_real(torch.view_as_complex(xs) * f).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == torch.float32:  # the fused kernel gives the same bits as the three steps below in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # low precision: normalise in float32, round, then scale (LlamaGen's order), the normalisation by the fused
        # kernel (on a CPU the same bits as xf * rsqrt(mean(xf^2) + eps), tests/models/test_gpt.py; four kernels
        # where the three steps took eight)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x) * self.weight


INVARIANT_ROWS = 8  # `batch_invariant`: every product runs as GEMMs of exactly this many rows
_invariant = threading.local()


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Inside, on a CPU, every linear layer of these models computes a row the same whatever rows share its batch:
    the rows are cut into blocks of INVARIANT_ROWS (the last padded with zeros) and multiplied as one batched
    product of blocks (`torch.bmm`, the weight expanded, not copied), so each block is one GEMM of the same shape.
    A plain product's row changes with the batch's row count on this CPU (up to 2.3e-5 at [64, 256] x [256, 768]):
    enough to flip a sampled token now and then, so the same request could give another image in another batch.
    The verifier's engine runs its forwards inside (`ciar.engine.runner`). Per thread; elsewhere (CUDA) it does
    nothing."""
    before = getattr(_invariant, "on", False)
    _invariant.on = on
    try:
        yield
    finally:
        _invariant.on = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariant inside `batch_invariant` on a CPU."""
    if not getattr(_invariant, "on", False) or x.device.type != "cpu" or x.dim() == 0:
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    m = -(-n // INVARIANT_ROWS) * INVARIANT_ROWS
    blocks = F.pad(rows, (0, 0, 0, m - n)).view(m // INVARIANT_ROWS, INVARIANT_ROWS, k)
    out = torch.bmm(blocks, weight.t().unsqueeze(0).expand(blocks.shape[0], k, weight.shape[0]))
    out = out.reshape(m, weight.shape[0])[:n]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def project(module, x: torch.Tensor) -> torch.Tensor:
    """module(x); an nn.Linear batch-invariant inside `batch_invariant` on a CPU (a subclass may put another
    callable in a layer's place: it runs as it is)."""
    if type(module) is nn.Linear and getattr(_invariant, "on", False):
        return linear(x, module.weight, module.bias)
    return module(x)


def _dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` in training; x itself otherwise (no module call per op in the decoding loops)."""
    return module(x) if module.training and module.p > 0 else x


class FeedForward(nn.Module):
    w13: torch.Tensor | None = None  # `fuse`: w1 and w3 stacked, [2 ffn_hidden, dim] (their weights are views of it)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.ffn_dropout = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x):
        if self.w13 is not None:  # one GEMM for both input projections
            gate, up = linear(x, self.w13).chunk(2, dim=-1)
            return _dropout(self.ffn_dropout, project(self.w2, F.silu(gate) * up))
        return _dropout(self.ffn_dropout, project(self.w2, F.silu(project(self.w1, x)) * project(self.w3, x)))

    def fuse(self, on: bool = True) -> None:
        """For inference: w1 and w3 as one [2 ffn_hidden, dim] matrix, one GEMM where there were two; the two
        weights become views of it (no memory added). `on=False` gives them storages of their own again. A fused
        module is not for training or saving (its two weights share one storage)."""
        if on == (self.w13 is not None):
            return
        w1, w3 = self.w1.weight, self.w3.weight
        if on:
            self.w13 = torch.cat([w1.detach(), w3.detach()])
            h = w1.shape[0]
            self.w1.weight = nn.Parameter(self.w13[:h], requires_grad=w1.requires_grad)
            self.w3.weight = nn.Parameter(self.w13[h:], requires_grad=w3.requires_grad)
        else:
            self.w1.weight = nn.Parameter(w1.detach().clone(), requires_grad=w1.requires_grad)
            self.w3.weight = nn.Parameter(w3.detach().clone(), requires_grad=w3.requires_grad)
            self.w13 = None


def kv_runs(slots: torch.Tensor | None, batch: int) -> list[tuple[int, int, int]] | None:
    """How a cached forward reads keys: [(first row, first slot, rows)] runs of rows on consecutive slots, or None
    to gather rows one by one. `slots` None means rows 0..B-1 (one run).

    A run's keys are a view of the cache; a gather copies [rows, kv_len, heads, head_dim] per layer, which on a CPU
    costs more than the attention itself at long contexts. On CUDA the copy is cheap next to one kernel launch per
    run, so only a single run skips it there."""
    if slots is None:
        return [(0, 0, batch)]
    ids = slots.tolist()
    runs = []
    for row, slot in enumerate(ids):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([row, slot, 1])
    if len(runs) > 1 and slots.device.type != "cpu":
        return None
    return [tuple(r) for r in runs]


def _consecutive(input_pos: torch.Tensor, table: int) -> int | None:
    """p0 when every row feeds the positions p0..p0+T-1 inside the rotary table (`input_pos` a CPU vector [T], or
    [B, T] with equal rows), else None.

    Shared consecutive positions are what the device's own loop, every prefill and a lone session's CFG rows in the
    verifier feed. Reading them costs one host copy of the positions, so GPU positions (a sync) skip the check."""
    if input_pos.device.type != "cpu" or input_pos.numel() == 0 or input_pos.dim() not in (1, 2):
        return None
    rows = input_pos.tolist() if input_pos.dim() == 2 else [input_pos.tolist()]
    pos = rows[0]
    p0 = pos[0]
    if p0 < 0 or p0 + len(pos) > table or pos != list(range(p0, p0 + len(pos))):
        return None
    return p0 if all(r == pos for r in rows[1:]) else None


class SlotQuery(NamedTuple):
    """What attention over the cache reads in place of a mask when the slot kernel runs (`ciar.models.slot_attention`):
    each row's slot [B], its queries' positions [B, T] and the cache's key validity [slots, S]."""

    slots: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


_DENSE_MAX = 32  # one-token steps of at most this many rows copy their keys into a dense block (below)
_DENSE_DEVICES = ("cpu",)  # ... on these devices only
_DENSE_MAX_BYTES = 16 << 20  # ... and only when a layer's keys and values to copy are at most this many bytes


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def _qkv(self, x, freqs):
        """-> q [B, T, H, D], k and v [B, T, Hkv, D]; q and k rotated together (one RoPE pass over their heads)."""
        b, t, _ = x.shape
        h, hkv, d = self.n_head, self.n_kv_head, self.head_dim
        qkv = project(self.wqkv, x)  # [B, T, (H + 2 Hkv) D]
        qk = apply_rotary_emb(qkv[..., : (h + hkv) * d].view(b, t, h + hkv, d), freqs)
        q, k = qk.split([h, hkv], dim=2)
        return q, k, qkv[..., (h + hkv) * d:].view(b, t, hkv, d)

    def _attend(self, q, keys, values, mask, is_causal=False):
        """q: [B, T, H, D]; keys/values: [B, Hkv, S, D]; mask: [B, 1, T, S] (bool, or additive float) or None.
        -> [B, T, H, D]."""
        if self.n_kv_head != self.n_head:
            keys = keys.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            values = values.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=is_causal,
                                           dropout_p=self.cfg.attn_dropout_p if self.training else 0.0)
        return o.transpose(1, 2)

    def _project(self, o):
        b, t = o.shape[:2]
        return _dropout(self.resid_dropout, project(self.wo, o.reshape(b, t, self.cfg.dim)))

    def _out(self, q, keys, values, mask, is_causal=False):
        return self._project(self._attend(q, keys, values, mask, is_causal))

    def forward(self, x, freqs, mask):
        q, k, v = self._qkv(x, freqs)
        return self._out(q, k.transpose(1, 2), v.transpose(1, 2), mask, is_causal=mask is None)

    def forward_cached(self, x, freqs, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len):
        """Write this step's k/v at (slot, pos) and attend over the slot's first `kv_len` positions.

        `runs` [(first row, first slot, rows)] cover the batch in row order; each run's rows use consecutive
        slots, so its keys are a view of the cache (no copy). `None`: gather every row's slot (`slot_idx[:, 0]`)."""
        q, k, v = self._qkv(x, freqs)
        return self._project(self._attend_cached(q, k, v, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len))

    def _attend_cached(self, q, k, v, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len):
        """q [B, T, H, D], k/v [B, T, Hkv, D]: write k/v into the cache, attend. -> [B, T, H, D].

        `pos` [B, T] positions at slots `slot_idx` [B, T]; or a slice of positions shared by every row, with the
        rows' slots given by `runs` (`slot_idx` None)."""
        if isinstance(pos, slice):
            for r, s, n in runs:  # [n, T, Hkv, D] into the slots' [n, Hkv, T, D] block
                k_cache[s:s + n, :, pos] = k[r:r + n].transpose(1, 2).to(k_cache.dtype)
                v_cache[s:s + n, :, pos] = v[r:r + n].transpose(1, 2).to(v_cache.dtype)
        else:
            k_cache[slot_idx, :, pos] = k.to(k_cache.dtype)  # [B, T, Hkv, D] into [slots, Hkv, max_seq, D]
            v_cache[slot_idx, :, pos] = v.to(v_cache.dtype)
        if isinstance(mask, SlotQuery):
            return slot_attention.slot_attention(q, k_cache, v_cache, mask.slots, mask.pos, mask.valid, kv_len)
        if runs is None:
            slots = slot_idx[:, 0]
            keys = k_cache[:, :, :kv_len].index_select(0, slots)
            values = v_cache[:, :, :kv_len].index_select(0, slots)
            return self._attend(q, keys.to(q.dtype), values.to(q.dtype), mask)
        # one-token steps (cloud-only decoding) copy a run's keys into a dense block first: inside a decode loop the
        # keys are cold, and the flash kernel reads a dense block faster than the same keys as a view of the cache
        # (CPU, batch 16, 40..184 keys: 1.39 -> 1.31 s per image, copy included). Spans of several queries (the
        # verifier) read the view: there the copy costs more than it saves (core benchmark: ~3% fewer spans/s); so do
        # steps of more than _DENSE_MAX rows (CPU, 112 keys, one forward: 4 rows 4.3 vs 4.6 ms, 32 rows 14.0 vs 15.0,
        # 64 rows 34.7-40.3 with the copy vs 26.5 ms without). On a GPU the copy only costs: LlamaGen-XL's decode step
        # in bf16 on an H100, graph replays, 1 / 8 / 32 rows: 3.59 / 4.68 / 7.47 ms with it, 3.30 / 3.81 / 4.63
        # without (benchmarks/results/2026-11-26-gpu, `dense_copy`); so only the CPU copies (_DENSE_DEVICES). Nor does
        # a large block pay for its copy: LlamaGen-XL on this CPU, one-token steps of 16 rows, best of 3 x 4 (keys
        # copied / read as the view): bf16 at 249 keys 0.68 / 0.58 s, at 1,017 keys (Stage II's late positions) 3.20
        # / 1.69 s; float32 at 185 keys 1.24 / 0.71 s (benchmarks/results/2026-11-26c/README.md); the scenes world's
        # blocks, which the copy was tuned on, stay under _DENSE_MAX_BYTES (32 rows x 184 keys: 12 MB)
        dense = q.shape[1] == 1 and q.shape[0] <= _DENSE_MAX and q.device.type in _DENSE_DEVICES and \
            2 * q.shape[0] * kv_len * k_cache.shape[1] * k_cache.shape[-1] * k_cache.element_size() <= _DENSE_MAX_BYTES
        outs = []
        for r, s, n in runs:
            keys, values = k_cache[s:s + n, :, :kv_len].to(q.dtype), v_cache[s:s + n, :, :kv_len].to(q.dtype)
            if dense:
                keys, values = keys.contiguous(), values.contiguous()
            outs.append(self._attend(q[r:r + n], keys, values, mask[r:r + n]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def forward_packed(self, x, freqs, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len, packed, shape):
        """`forward_cached` for the real tokens of a padded batch only: x [N, dim] holds the tokens at flat indices
        `packed` of the [B, T] batch (`shape`), `freqs` their rotary factors [1, N, 1, D/2]. Projections run on the
        N tokens; q, k and v are scattered into the padded layout for the cache write and the attention, and the
        attention output is gathered back. -> [N, dim]."""
        b, t = shape
        h, hkv, d = self.n_head, self.n_kv_head, self.head_dim
        qkv = project(self.wqkv, x)  # [N, (H + 2 Hkv) D]
        qk = apply_rotary_emb(qkv[None, :, : (h + hkv) * d].view(1, -1, h + hkv, d), freqs)[0]  # [N, H + Hkv, D]
        dense = qkv.new_zeros(b * t, h + 2 * hkv, d)
        dense[packed, : h + hkv] = qk
        dense[packed, h + hkv:] = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        dense = dense.view(b, t, h + 2 * hkv, d)
        q, k, v = dense.split([h, hkv, hkv], dim=2)
        o = self._attend_cached(q, k, v, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len)  # [B, T, H, D]
        return _dropout(self.resid_dropout, project(self.wo, o.reshape(b * t, h * d)[packed]))


def _static_block(layer, x, freqs, mask, k_cache, v_cache, slot_idx, pos, kv_len):
    return TransformerBlock.forward_cached(layer, x, freqs, mask, k_cache, v_cache, slot_idx, pos, None, kv_len)


def _static_packed_block(layer, x, freqs, mask, k_cache, v_cache, slot_idx, pos, kv_len, packed, b, t):
    return TransformerBlock.forward_cached(layer, x, freqs, mask, k_cache, v_cache, slot_idx, pos, None, kv_len,
                                           packed, (b, t))


def _unpack(hp: torch.Tensor, packed: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """A packed forward's states [N, dim] back in the padded layout [B, T, dim] (zeros where nothing was fed)."""
    out = hp.new_zeros(b * t, hp.shape[-1])
    out[packed] = hp
    return out.view(b, t, hp.shape[-1])


_COMPILED_BLOCK: dict = {}


def compiled_block(packed: bool = False):
    """One transformer block of a static forward (`GPT.forward_cached(..., static=True, block=...)`) compiled by
    `torch.compile` (dynamic shapes: one compilation serves every layer and every bucket but for a few
    specialisations, where a compiled forward would unroll every layer per shape). The compiler fuses each block's
    elementwise chains (RMSNorm with the residual add, RoPE in real arithmetic with its cast, SiLU with its product)
    into a few kernels; the GEMMs, the cache writes and the attention stay library calls. Made once per process.
    `packed`: the block of a packed static forward (its tokens [N, dim], the attention on the padded layout)."""
    if packed not in _COMPILED_BLOCK:
        _COMPILED_BLOCK[packed] = torch.compile(_static_packed_block if packed else _static_block, dynamic=True)
    return _COMPILED_BLOCK[packed]


def repeatable_attention(device) -> None:
    """Make attention on `device` bit-repeatable: on CUDA, switch cuDNN's attention backend off for the process
    (`torch.backends.cuda.enable_cudnn_sdp(False)`), so that SDPA takes the flash or memory-efficient kernels; a
    no-op elsewhere. Measured on an H100 in bfloat16 (benchmarks/results/2026-11-26-gpu, `engine_bisect` and
    `engine_repeat`): with cuDNN's kernels two fresh verifiers fed the same pieces returned different logits from
    the first decode step on (3 of 16 pieces, by up to 0.094) and 24-30 of 48 replies matched, so the same request
    and seed could give another image; with them off, 70 of 70 steps and 48 of 48 replies were equal (also with
    torch's defaults for cuBLAS). torch's backend flags are global: the switch holds for the whole process."""
    if torch.device(device).type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, freqs, mask):
        h = x + self.attention(self.attention_norm(x), freqs, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_cached(self, x, freqs, mask, k_cache, v_cache, slot_idx, pos, runs, kv_len, packed=None, shape=None):
        """Dense [B, T, dim], or with `packed` the real tokens [N, dim] of a padded [B, T] batch (`shape`)."""
        if packed is None:
            a = self.attention.forward_cached(self.attention_norm(x), freqs, mask, k_cache, v_cache, slot_idx, pos,
                                              runs, kv_len)
        else:
            a = self.attention.forward_packed(self.attention_norm(x), freqs, mask, k_cache, v_cache, slot_idx, pos,
                                              runs, kv_len, packed, shape)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))


class MLP(nn.Module):
    def __init__(self, cin: int, hidden: int, cout: int, bias: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(cin, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, cout, bias=bias)

    def forward(self, x):
        return project(self.fc2, F.gelu(project(self.fc1, x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Caption token embeddings -> model width; the learned `uncond_embedding` stands in for a dropped caption."""

    def __init__(self, caption_dim: int, dim: int, uncond_prob: float, token_num: int, bias: bool = False):
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim, bias)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim ** 0.5)
        self.uncond_prob = uncond_prob

    def forward(self, caption: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """caption: [B, L, caption_dim]; drop: [B] bool, rows whose caption is replaced by the unconditional one."""
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


class LabelEmbedder(nn.Module):
    """Class label -> embedding; index `num_classes` is the unconditional (CFG) label."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + (dropout_prob > 0), dim)
        self.num_classes = num_classes

    def forward(self, labels: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        if cfg.model_type == "t2i":
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.class_dropout_prob, cfg.cls_token_num,
                                             cfg.cap_proj_bias)
        elif cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.class_dropout_prob)
        else:
            raise ValueError(f"model_type must be 't2i' or 'c2i', got {cfg.model_type!r}")
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if cfg.lm_head else None
        self.register_buffer("freqs_cis", precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base,
                                                                  cfg.cls_token_num, cfg.cls_rope), persistent=False)
        self.apply(self._init_weights)
        if self.output is not None:
            nn.init.zeros_(self.output.weight)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=self.config.initializer_range)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=self.config.initializer_range)

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Final hidden states [..., dim] -> float32 logits [..., V]; None for a model built with lm_head=False."""
        return None if self.output is None else project(self.output, h).float()

    # ------------------------------------------------------------------ conditioning
    def embed_condition(self, cond: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """t2i: cond [B, cls_token_num, caption_dim]; c2i: labels [B]. -> [B, cls_token_num, dim]."""
        return self.cls_embedding(cond, drop)[:, : self.config.cls_token_num]

    def cfg_condition(self, cond: torch.Tensor, cond_mask: torch.Tensor | None):
        """Double a batch for classifier-free guidance: rows [cond..., uncond...] (uncond keeps the mask, as LlamaGen)."""
        b = cond.shape[0]
        drop = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)]).to(cond.device)
        mask = None if cond_mask is None else torch.cat([cond_mask, cond_mask])
        return torch.cat([cond, cond]), mask, drop

    # ------------------------------------------------------------------ full forward (training)
    def forward(self, idx: torch.Tensor, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                drop: torch.Tensor | None = None, targets: torch.Tensor | None = None, return_hidden: bool = False,
                extra_emb: torch.Tensor | None = None):
        """idx: [B, T] image tokens (T <= block_size); cond as in `embed_condition`; cond_mask [B, cls] bool.

        Returns logits [B, T + 1, V] (position j predicts image token j) and the mean CE against `targets` [B, T+1]
        if given; with `return_hidden` also the final hidden states [B, T + 1, dim] (after the last norm).
        `extra_emb` [B, T, dim] is added to the token embeddings (CIAR's interval-feature injection).
        """
        c = self.config
        e = self.tok_embeddings(idx)
        if extra_emb is not None:
            e = e + extra_emb.to(e.dtype)
        h = torch.cat([self.embed_condition(cond, drop), e], dim=1)
        h = _dropout(self.tok_dropout, h)
        s = h.shape[1]
        freqs = rotary_factors(self.freqs_cis[:s].unsqueeze(0))
        mask = None
        if cond_mask is not None and c.model_type == "t2i":
            valid = torch.cat([cond_mask, torch.ones(h.shape[0], s - c.cls_token_num, dtype=torch.bool,
                                                     device=h.device)], dim=1)
            causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
            eye = torch.eye(s, dtype=torch.bool, device=h.device)
            mask = ((causal[None] & valid[:, None, :]) | eye[None]).unsqueeze(1)  # [B, 1, S, S]
        for layer in self.layers:
            h = layer(h, freqs, mask)
        h = self.norm(h)[:, c.cls_token_num - 1:]
        logits = self.logits(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if return_hidden:
            return logits, loss, h
        return logits, loss

    # ------------------------------------------------------------------ cached decoding
    def new_cache(self, slots: int, max_seq: int | None = None, dtype: torch.dtype | None = None,
                  device=None) -> KVCache:
        c = self.config
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = device or self.tok_embeddings.weight.device
        repeatable_attention(device)  # every cached decoding (the verifier's runner, ciar.decoding) starts here
        # slack beyond the sequence so padded rows of a ragged batch never collide with real positions
        return KVCache(c.n_layer, slots, max_seq or c.seq_len + 16, c.kv_heads, c.head_dim, dtype, device)

    def forward_cached(self, cache: KVCache, h: torch.Tensor, input_pos: torch.Tensor,
                       slots: torch.Tensor | None = None, kv_len: int | None = None,
                       packed: torch.Tensor | None = None, static: bool = False, block=None) -> torch.Tensor:
        """Run embeddings h [B, T, dim] at positions input_pos ([T] shared or [B, T] per row) through the layers,
        writing k/v into cache slots `slots` [B] (default rows 0..B-1). -> normed hidden states [B, T, dim].

        `packed` [N] (flat indices into B x T of the real positions of a ragged batch): the projections and the
        feed-forward run on those N tokens only, the attention on the padded layout (a ragged batch's padding then
        costs attention only); hidden states at the other positions come back as zeros.

        Queries see cache keys at positions <= their own (and valid caption keys), so stale entries beyond a
        rolled-back pointer are ignored. `kv_len` bounds the keys read (default: max(input_pos) + 1).

        `static`: the same computation with no decision taken on the inputs' values (no host read of positions or
        slots, every row's keys gathered, `kv_len` given, positions [B, T]): one sequence of kernels per shape, which
        a CUDA graph can capture (`ciar.engine.runner.ModelRunner`); `packed` then has a fixed length (a bucket: its
        spare entries name one padding position of the batch, computed and never read). `block` (static only): each
        layer runs as block(layer, h, freqs [B, T, D/2, 2], mask, k_cache, v_cache, slots [B, T], positions, kv_len),
        e.g. `compiled_block`, or packed as block(layer, h [N, dim], freqs [1, N, D/2, 2], ..., kv_len, packed, B, T),
        e.g. `compiled_block(packed=True)`.
        """
        b, t, _ = h.shape
        rows = torch.arange(b, device=h.device) if slots is None else slots
        if static:
            if kv_len is None or input_pos.dim() != 2:
                raise ValueError("a static forward takes kv_len and [B, T] positions")
            runs = None
        else:
            runs = kv_runs(slots, b)
        p0 = _consecutive(input_pos, self.freqs_cis.shape[0]) if runs is not None and packed is None else None
        if input_pos.dim() == 1:
            input_pos = input_pos.unsqueeze(0).expand(b, t)
        if p0 is not None:
            # every row feeds positions p0..p0+t-1 (the device's loop, a prefill, one session's rows): the rotary
            # rows are a slice and the cache writes are slices (no gather or scatter of indices per layer)
            kv_len = p0 + t if kv_len is None else kv_len
            freqs = self.freqs_cis[p0:p0 + t].unsqueeze(0)  # [1, T, D/2, 2]
            slot_idx, write_pos = None, slice(p0, p0 + t)
        else:
            if kv_len is None:
                kv_len = int(input_pos.max()) + 1
            freqs = self.freqs_cis[input_pos.clamp_max(self.freqs_cis.shape[0] - 1)]  # [B, T, D/2, 2]
            slot_idx, write_pos = rows[:, None].expand(b, t), input_pos
        if slot_attention.usable(h, self.config.head_dim):
            # on CUDA every row reads its keys in place (ciar.models.slot_attention): no gathered keys, no mask
            mask = SlotQuery(rows.to(h.device), input_pos.to(h.device), cache.key_valid)
        else:
            mask = slot_attention.key_mask(
                cache.key_valid[rows, :kv_len], input_pos, kv_len,
                p0 is not None and t == 1 and kv_len == p0 + 1 and p0 >= self.config.cls_token_num, h.dtype)
        h = _dropout(self.tok_dropout, h)
        dim = h.shape[-1]
        if block is not None:
            if not static:
                raise ValueError("a block function runs static forwards only")
            if packed is not None:
                freqs = freqs.reshape(b * t, *freqs.shape[2:])[packed][None]  # [1, N, D/2, 2]
                hp = h.reshape(b * t, dim)[packed]
                for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
                    hp = block(layer, hp, freqs, mask, k_cache, v_cache, slot_idx, write_pos, kv_len, packed, b, t)
                return _unpack(self.norm(hp), packed, b, t)
            for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
                h = block(layer, h, freqs, mask, k_cache, v_cache, slot_idx, write_pos, kv_len)
            return self.norm(h)
        freqs = rotary_factors(freqs)  # [B or 1, T, 1, D/2] complex, once for every layer
        if packed is not None:
            freqs = freqs.reshape(b * t, *freqs.shape[2:])[packed][None]  # the real tokens' factors [1, N, 1, D/2]
            hp = h.reshape(b * t, dim)[packed]
            for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
                hp = layer.forward_cached(hp, freqs, mask, k_cache, v_cache, slot_idx, write_pos, runs, kv_len,
                                          packed, (b, t))
            return _unpack(self.norm(hp), packed, b, t)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            h = layer.forward_cached(h, freqs, mask, k_cache, v_cache, slot_idx, write_pos, runs, kv_len)
        return self.norm(h)

    def prefill(self, cache: KVCache, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                drop: torch.Tensor | None = None, slots: torch.Tensor | None = None, return_hidden: bool = False):
        """Write the condition into the cache; -> logits [B, V] for the first image token."""
        c = self.config
        b = cond.shape[0]
        rows = list(range(b)) if slots is None else slots.tolist()
        if cond_mask is not None and c.model_type == "t2i":
            cache.key_valid[rows, : c.cls_token_num] = cond_mask.to(cache.device)
            cache.key_valid[rows, c.cls_token_num:] = True
        else:
            cache.key_valid[rows] = True
        pos = torch.arange(c.cls_token_num, device=cond.device)
        h = self.forward_cached(cache, self.embed_condition(cond, drop), pos, slots, kv_len=c.cls_token_num)
        cache.set_length(rows, c.cls_token_num)
        h = h[:, -1]
        logits = self.logits(h)
        return (logits, h) if return_hidden else logits

    def decode(self, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
               slots: torch.Tensor | None = None, extra_emb: torch.Tensor | None = None, kv_len: int | None = None,
               return_hidden: bool = False):
        """Feed image tokens [B, T] at positions input_pos ([T] or [B, T]); -> logits [B, T, V].

        `extra_emb` [B, T, dim] is added to the token embeddings (interval-feature injection of CIAR).
        The caller records the committed length (`cache.set_length`): only it knows which fed tokens it keeps.
        """
        e = self.tok_embeddings(tokens)
        if extra_emb is not None:
            e = e + extra_emb.to(e.dtype)
        h = self.forward_cached(cache, e, input_pos, slots, kv_len)
        logits = self.logits(h)
        return (logits, h) if return_hidden else logits


def fuse_feed_forward(model: nn.Module, on: bool = True) -> None:
    """`FeedForward.fuse` on every block of `model` (inference only)."""
    for m in model.modules():
        if isinstance(m, FeedForward):
            m.fuse(on)


def build_gpt(name_or_cfg: str | GPTConfig = "scenes-cloud", **overrides) -> GPT:
    cfg = gpt_config(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else replace(name_or_cfg, **overrides)
    return GPT(cfg)


# Keys in LlamaGen checkpoints that are not model parameters here: none are expected in the plain model state,
# but training checkpoints of some forks carry the rotary table or KV-cache buffers; they are ignored by name.
GPT_IGNORED_KEY_PREFIXES = ("freqs_cis", "causal_mask")
GPT_IGNORED_KEY_SUFFIXES = (".kv_cache.k_cache", ".kv_cache.v_cache")


def load_llamagen_gpt(path: str, config: str = "GPT-XL", image_size: int = 256, downsample: int = 16,
                      dtype: torch.dtype = torch.float32, **overrides) -> GPT:
    """Load a LlamaGen GPT checkpoint (e.g. `t2i_XL_stage1_256.pt`) strictly, its weights in `dtype`.

    `image_size / downsample` sets the token grid (256 px -> 16x16, 512 px -> 32x32). Raises
    `CheckpointMismatchError` naming every missing, unexpected or mis-shaped key (checked on the shapes, before the
    weights are read). The model is built on the meta device and the file read one tensor at a time
    (`open_checkpoint`), each cast to `dtype` as it is read (`load_cast`): the peak memory is the model in `dtype`
    plus one checkpoint tensor, not the float32 checkpoint plus a float32 model. The weights are those of a float32
    load cast to `dtype` afterwards (in float32: the checkpoint's values, as `load_strict` copies them).
    """
    import itertools

    from ciar.models.checkpoint import load_cast, load_strict, open_checkpoint

    grid = image_size // downsample
    with torch.device("meta"):  # shapes only: no float32 weights allocated, no random initialisation run
        model = build_gpt(config, block_size=grid * grid, **overrides)
    what = f"LlamaGen {config} model"
    with open_checkpoint(path) as stored:
        stored = {k: v for k, v in stored.items() if not k.endswith(GPT_IGNORED_KEY_SUFFIXES)}
        load_strict(model, {k: v.placeholder() for k, v in stored.items()}, ignore_prefixes=GPT_IGNORED_KEY_PREFIXES,
                    what=what)
        load_cast(model, stored, dtype, ignore_prefixes=GPT_IGNORED_KEY_PREFIXES, what=what)
    c = model.config  # the one buffer no checkpoint holds, computed as GPT.__init__ does (then cast, as .to(dtype))
    model.freqs_cis = precompute_freqs_cis_2d(c.grid_size, c.head_dim, c.rope_base, c.cls_token_num,
                                              c.cls_rope).to(dtype)
    unset = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unset:  # a buffer GPT.__init__ computes that is not recomputed above
        raise RuntimeError(f"{what}: neither in the checkpoint nor computed on load: {unset}")
    return model.eval()
