"""Tests of ciar.collab.gating: every gate's shape/scale, reproducibility, monotonicity and input checks."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ciar.collab.gating import GATES, gate_scores, topk_score

FAST = settings(max_examples=60, deadline=None)


def make_inputs(seed: int, B: int, V: int, scale: float = 5.0, rmax: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(B, V, generator=g) * scale
    radius = torch.rand(B, V, generator=g) * rmax
    return center, radius, torch.softmax(center, -1)


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), V=st.integers(2, 300), kind=st.sampled_from(GATES),
       topk=st.sampled_from([1, 5, 100, 400]))
def test_every_gate_shape(seed, B, V, kind, topk):
    center, radius, probs = make_inputs(seed, B, V)
    drafted = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(seed))
    s = gate_scores(kind, center=center, radius=radius, probs=probs, generator=torch.Generator().manual_seed(seed),
                    topk=topk, drafted=drafted)
    assert s.shape == (B,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    assert (s >= 0).all()
    if kind in ("entropy", "softmax", "random", "topk"):
        assert (s <= 1).all()


def test_random_gate_reproducible():
    _, _, probs = make_inputs(0, 32, 10)
    a = gate_scores("random", probs=probs, generator=torch.Generator().manual_seed(5))
    b = gate_scores("random", probs=probs, generator=torch.Generator().manual_seed(5))
    c = gate_scores("random", probs=probs, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ((a >= 0) & (a < 1)).all()
    center, _, _ = make_inputs(0, 7, 10)
    assert gate_scores("random", center=center, generator=torch.Generator().manual_seed(5)).shape == (7,)


def test_entropy_and_softmax_extremes():
    V = 37
    uniform = torch.full((2, V), 1.0 / V)
    onehot = torch.zeros(2, V)
    onehot[:, 3] = 1.0
    assert torch.allclose(gate_scores("entropy", probs=uniform), torch.ones(2), atol=1e-6)
    assert torch.equal(gate_scores("entropy", probs=onehot), torch.zeros(2))
    assert torch.equal(gate_scores("softmax", probs=onehot), torch.zeros(2))
    assert torch.allclose(gate_scores("softmax", probs=uniform), torch.full((2,), 1 - 1 / V))


def test_interval_gate_monotone_in_radius():
    center, radius, _ = make_inputs(3, 2, 64, scale=3.0, rmax=1.0)
    scores = torch.stack([gate_scores("interval", center=center, radius=radius * m)
                          for m in (0.0, 0.1, 0.3, 1.0, 2.0)])  # [5, B]
    assert (scores[1:] > scores[:-1]).all()


@pytest.mark.parametrize("k", [1, 5, 100, 200])
def test_topk_gate_extremes(k):
    V = 300
    center = torch.linspace(0, -30, V).repeat(2, 1)
    center[:, 0] = 40.0  # clear winner
    s0 = gate_scores("topk", center=center, radius=torch.zeros_like(center), topk=k)
    kk = min(k, V)
    assert (s0 < 1.0 / kk).all() and (s0 >= 0).all()
    s1 = gate_scores("topk", center=center, radius=torch.full_like(center, 100.0), topk=k)
    assert (s1 >= (kk - 1) / kk).all() and (s1 < 1).all()
    # intermediate: two near-tied leaders with a small radius -> exactly 2 feasible winners
    c2 = center.clone()
    c2[:, 1] = 39.9
    s2 = topk_score(c2, torch.full_like(c2, 0.2), topk=k)
    if kk >= 2:
        assert ((s2 >= 1.0 / kk) & (s2 < 2.0 / kk)).all()


def test_topk_clamped_to_vocab():
    center, radius, _ = make_inputs(1, 3, 10, rmax=50.0)
    a = gate_scores("topk", center=center, radius=radius + 100, topk=400)
    assert (a >= 9 / 10).all()


def test_bad_inputs():
    center, radius, probs = make_inputs(0, 2, 8)
    with pytest.raises(ValueError, match="nope"):
        gate_scores("nope", probs=probs)
    with pytest.raises(ValueError, match="radius"):
        gate_scores("interval", center=center)
    with pytest.raises(ValueError, match="center"):
        gate_scores("topk", radius=radius)
    with pytest.raises(ValueError, match="probs"):
        gate_scores("entropy", center=center, radius=radius)
    with pytest.raises(ValueError, match="probs"):
        gate_scores("softmax")
    with pytest.raises(ValueError, match="generator"):
        gate_scores("random", probs=probs)


def test_lower_gate_is_minus_log_of_the_interfuse_lower_bound():
    from ciar.collab.interval import inter_fuse

    center, radius, _ = make_inputs(3, 16, 50)
    x = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1))
    p_lo, _ = inter_fuse(center, radius, margin=0.0)
    want = -torch.log(p_lo.double().gather(-1, x[:, None]).squeeze(-1))
    got = gate_scores("lower", center=center, radius=radius, drafted=x)
    assert torch.allclose(got.double(), want, rtol=1e-5)


def test_lower_gate_is_monotone_in_the_box():
    """A wider radius on the drafted token, or a lower center, can only raise the score; a zero box is -log q(x)."""
    center = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    x = torch.tensor([0])
    zero = gate_scores("lower", center=center, radius=torch.zeros_like(center), drafted=x)
    assert torch.allclose(zero, -torch.log_softmax(center, -1)[:, 0], atol=1e-6)
    prev = zero
    for r in (0.1, 0.5, 1.0, 2.0):
        s = gate_scores("lower", center=center, radius=torch.full_like(center, r), drafted=x)
        assert (s > prev).all()
        prev = s
    # a masked-out draft (center -inf) is infinitely uncertain, and tiny p_lo do not saturate
    masked = gate_scores("lower", center=torch.tensor([[-math.inf, 0.0]]), radius=torch.zeros(1, 2),
                         drafted=torch.tensor([0]))
    assert torch.isinf(masked).all()
    wide = gate_scores("lower", center=center, radius=torch.full_like(center, 8.0), drafted=x)
    assert torch.isfinite(wide).all() and wide.item() > 10


def test_lower_gate_needs_the_draft():
    center, radius, _ = make_inputs(0, 2, 5)
    with pytest.raises(ValueError, match="drafted"):
        gate_scores("lower", center=center, radius=radius)
