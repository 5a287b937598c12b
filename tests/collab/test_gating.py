"""Tests of ciar.collab.gating: every gate's shape/scale, reproducibility, monotonicity and input checks."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ciar.collab.gating import GATES, GateConfig, gate_scores, topk_score

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
    s = gate_scores(kind, center=center, radius=radius, probs=probs, generator=torch.Generator().manual_seed(seed),
                    topk=topk)
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


def test_gate_config():
    cfg = GateConfig()
    assert cfg.validate() is cfg and cfg.kind == "interval" and cfg.tau == 0.30
    for bad in (dict(kind="nope"), dict(topk=0), dict(tau=math.nan)):
        with pytest.raises(ValueError):
            GateConfig(**bad).validate()
    assert GateConfig(kind="topk", tau=math.inf).validate().kind == "topk"
