"""Attention over the KV cache read in place by slot (ciar.models.slot_attention): the rule, the kernel against it,
and the kernel's invariances (what lets static and dynamic steps give the same bits)."""

import os
import subprocess
import sys

import pytest
import torch

from ciar.models import slot_attention as sa

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _case(b, t, h, hkv, d, s, kv_len, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(6, hkv, s, d, generator=g).to(device, dtype)
    v = torch.randn(6, hkv, s, d, generator=g).to(device, dtype)
    valid = (torch.rand(6, s, generator=g) > 0.2).to(device)
    slots = torch.tensor([4, 1, 5, 0][:b], device=device)
    pos = torch.stack([torch.arange(kv_len - t, kv_len) for _ in range(b)]).to(device)
    pos[0, -1] = s - 1  # a static step's padding query, at the scratch position past kv_len
    qkv = torch.randn(b, t, h + 2 * hkv, d, generator=g).to(device, dtype)
    return qkv[:, :, :h], k, v, slots, pos, valid  # q a strided view, as the model's split gives it


def test_reference_follows_the_rule():
    """A query sees its slot's valid keys at positions <= its own (< kv_len), always its own, and a padding query
    past kv_len every valid key: the reference against a softmax written out query by query."""
    q, k, v, slots, pos, valid = _case(3, 4, 4, 2, 16, 40, 30, torch.float64, "cpu")
    out = sa.reference(q, k, v, slots, pos, valid, 30)
    for b in range(3):
        for t in range(4):
            for h in range(4):
                ks, vs = k[slots[b], h // 2, :30], v[slots[b], h // 2, :30]
                p = int(pos[b, t])
                seen = [j for j in range(30) if (j <= p and bool(valid[slots[b], j])) or j == p]
                w = torch.softmax(ks[seen] @ q[b, t, h] / 4.0, 0)
                torch.testing.assert_close(out[b, t, h], w @ vs[seen])


def _kernel_checks(device):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        if dtype == torch.bfloat16 and device == "cpu":
            continue  # the interpreter computes in numpy, which has no bfloat16
        for shape in ((3, 1, 4, 4, 16, 40, 37), (2, 5, 4, 2, 32, 80, 70), (2, 20, 2, 2, 64, 60, 50)):
            q, k, v, slots, pos, valid = _case(*shape, dtype, device)
            kv_len = shape[-1]
            out = sa.slot_attention(q, k, v, slots, pos, valid, kv_len)
            ref = sa.reference(q.float(), k.float(), v.float(), slots, pos, valid, kv_len)
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
            # a row's bits do not depend on its company, on keys read past its own, or on T beyond its tile
            alone = sa.slot_attention(q[1:2], k, v, slots[1:2], pos[1:2], valid, kv_len)
            assert torch.equal(alone, out[1:2])
            longer = sa.slot_attention(q, k, v, slots, pos, valid, min(kv_len + 64, shape[5]))
            assert torch.equal(longer[1:], out[1:])  # (row 0's padding query sees the extra keys)
            assert torch.equal(sa.slot_attention(q[:, :1], k, v, slots, pos[:, :1], valid, kv_len), out[:, :1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or sa.triton is None, reason="needs a CUDA device and Triton")
def test_the_kernel_on_a_gpu():
    _kernel_checks("cuda")


@pytest.mark.skipif(not INTERPRETED, reason="runs inside test_the_kernel_in_tritons_interpreter")
def test_the_kernel_interpreted():
    assert sa.usable(torch.zeros(1), 16)
    _kernel_checks("cpu")


@pytest.mark.skipif(sa.triton is None, reason="Triton is not installed (it comes with CUDA builds of torch)")
def test_the_kernel_in_tritons_interpreter():
    """The kernel's code on the CPU through Triton's interpreter (set before the kernel is defined: a process of its
    own)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::"
                        "test_the_kernel_interpreted"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
