"""Attention over the KV cache read in place by slot: every query row reads its own session's keys where they lie in
the cache, no gathered copy and no mask tensor.

    o = slot_attention(q, k_cache, v_cache, slots, pos, key_valid, kv_len)   # [B, T, H, D]

q [B, T, H, D] (any strides, the last 1); k_cache / v_cache [slots, Hkv, S, D] (one layer's cache); slots [B] the
cache row each query row reads; pos [B, T] each query's absolute position; key_valid [slots, S] bool (caption
padding is invalid). A query at position p sees the keys of its slot at positions < kv_len that are <= p and valid,
and always its own position (the rule `ciar.models.gpt.GPT.forward_cached` builds as a mask); a query past kv_len
(a static step's padding, at the scratch position) sees every valid key. Softmax scale 1/sqrt(D).

Why: the verifier's static steps gathered every row's keys per layer (`index_select`: a copy of each row's whole
key and value history, read again by the attention) and built an additive [B, 1, T, S] mask, which keeps SDPA on
its memory-efficient kernel; on an H200 the served one-token step at 128 rows took 23.6 ms against a bandwidth bound
of 2.5 ms (benchmarks/results/2026-11-28-gpu). Here each program reads one (row, head, 16 queries) tile's keys
straight from the cache in blocks of 64 with an online softmax (flash attention's recurrence), deciding the mask from
positions and validity as it goes.

On CUDA with Triton the kernel (`_kernel`) runs; elsewhere `reference` (the gather and SDPA, the same rule) does, and
`usable` says which a forward takes. The kernel's result for a row does not depend on the batch it is in, on the
keys read past the row's own (fully masked blocks leave the running sums exactly as they were), nor on T beyond its
16-query tile: static and dynamic steps give the same bits. `torch.compile` sees the kernel as one opaque operator
(`ciar::slot_attention`).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:  # Triton comes with CUDA builds of torch; a CPU install runs `reference`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

BLOCK_T = 16  # queries per program (a tile: the same tiling whatever T, so a row's bits do not depend on T)
BLOCK_N = 64  # keys per block of the online softmax
ENABLED = os.environ.get("CIAR_SLOT_ATTENTION", "1") != "0"  # the switch (benchmarks.gpu times both ways)


def usable(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a forward on `x`'s device takes the kernel: CUDA (or Triton's interpreter, `TRITON_INTERPRET=1`, for
    the CPU tests), Triton installed, the switch on, a power-of-two head size of 16 or more (`tl.dot`'s tiles)."""
    if not ENABLED or triton is None or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def key_mask(valid: torch.Tensor, pos: torch.Tensor, kv_len: int, newest_only: bool = False,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rule as an additive mask [B, 1, T, S] (what SDPA reads where the kernel does not run): a query sees its
    row's valid keys at positions <= its own and always its own (`valid` [B, S]: the rows' key validity up to
    kv_len; `pos` [B, T]). `newest_only`: one image-token query per row at the newest key, which sees every key but
    caption padding. Built once for all layers (a bool mask is converted inside every attention call); the diagonal
    is always kept, so no row is fully masked."""
    if newest_only:
        allowed = valid[:, None, :]
    else:
        key_pos = torch.arange(kv_len, device=valid.device)
        allowed = ((key_pos[None, None, :] <= pos[:, :, None]) & valid[:, None, :]) \
            | (key_pos[None, None, :] == pos[:, :, None])
    return torch.where(allowed, 0.0, float("-inf")).to(dtype).unsqueeze(1)


def reference(q, k_cache, v_cache, slots, pos, key_valid, kv_len: int) -> torch.Tensor:
    """The same attention with torch operations: the rows' keys gathered, the mask built, SDPA. -> [B, T, H, D]."""
    b, t, h, d = q.shape
    hkv = k_cache.shape[1]
    keys = k_cache[:, :, :kv_len].index_select(0, slots).to(q.dtype)
    values = v_cache[:, :, :kv_len].index_select(0, slots).to(q.dtype)
    if hkv != h:
        keys, values = keys.repeat_interleave(h // hkv, dim=1), values.repeat_interleave(h // hkv, dim=1)
    mask = key_mask(key_valid[slots, :kv_len], pos, kv_len, dtype=q.dtype)
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask).transpose(1, 2)


if triton is not None:
    @triton.jit
    def _kernel(Q, K, V, O, SLOTS, POS, VALID,
                sq_b, sq_t, sq_h, sk_s, sk_h, sk_n, sv_s, sv_h, sv_n, so_b, so_t, so_h, sp_b, sval_s,
                T, kv_len, scale,
                GROUP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        t = tl.program_id(2) * BT + tl.arange(0, BT)
        d = tl.arange(0, D)
        hk = h // GROUP
        slot = tl.load(SLOTS + b).to(tl.int64)
        tin = t < T
        q = tl.load(Q + b.to(tl.int64) * sq_b + t[:, None] * sq_t + h * sq_h + d[None, :], mask=tin[:, None],
                    other=0.0)
        qpos = tl.load(POS + b.to(tl.int64) * sp_b + t, mask=tin, other=-1)
        m = tl.full([BT], float("-inf"), tl.float32)
        l = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, D], tl.float32)
        kbase = K + slot * sk_s + hk * sk_h
        vbase = V + slot * sv_s + hk * sv_h
        for n0 in range(0, kv_len, BN):
            n = n0 + tl.arange(0, BN)
            nin = n < kv_len
            k = tl.load(kbase + n[:, None] * sk_n + d[None, :], mask=nin[:, None], other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            ok = tl.load(VALID + slot * sval_s + n, mask=nin, other=0) != 0
            allowed = ((n[None, :] <= qpos[:, None]) & ok[None, :]) | (n[None, :] == qpos[:, None])
            s = tl.where(allowed & nin[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep the sums at zero, no NaN
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(vbase + n[:, None] * sv_n + d[None, :], mask=nin[:, None], other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(O + b.to(tl.int64) * so_b + t[:, None] * so_t + h * so_h + d[None, :],
                 out.to(O.dtype.element_ty), mask=tin[:, None])


def _launch(q, k_cache, v_cache, slots, pos, key_valid, kv_len: int) -> torch.Tensor:
    b, t, h, d = q.shape
    hkv = k_cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("slot_attention needs the cache's last dimension contiguous")
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    if b == 0 or t == 0:
        return o
    pos = pos.to(torch.int64)
    slots = slots.to(torch.int64)
    valid = key_valid.view(torch.uint8) if key_valid.dtype == torch.bool else key_valid
    grid = (b, h, triton.cdiv(t, BLOCK_T))
    _kernel[grid](q, k_cache, v_cache, o, slots, pos, valid,
                  q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1), o.stride(2),
                  pos.stride(0), valid.stride(0), t, kv_len, 1.0 / math.sqrt(d),
                  GROUP=h // hkv, D=d, BT=BLOCK_T, BN=BLOCK_N, IEEE=q.dtype == torch.float32, num_warps=4)
    return o


@torch.library.custom_op("ciar::slot_attention", mutates_args=())
def _op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
        key_valid: torch.Tensor, kv_len: int) -> torch.Tensor:
    return _launch(q, k_cache, v_cache, slots, pos, key_valid, kv_len)


@_op.register_fake
def _(q, k_cache, v_cache, slots, pos, key_valid, kv_len):
    return q.new_empty(q.shape)


def slot_attention(q, k_cache, v_cache, slots, pos, key_valid, kv_len: int) -> torch.Tensor:
    """The kernel (module docstring). -> [B, T, H, D], q's dtype."""
    if torch.compiler.is_compiling():  # an opaque operator to the compiler (a compiled block)
        return _op(q, k_cache, v_cache, slots, pos, key_valid, kv_len)
    return _launch(q, k_cache, v_cache, slots, pos, key_valid, kv_len)
