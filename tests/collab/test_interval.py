"""Tests of ciar.collab.interval: InterFuse guarantees, U's properties, guidance boxes, InterHead, thresholds."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ciar.collab.interval import (InterHead, guided_interval, inter_fuse, interval_feature_dim, interval_features,
                                  interval_uncertainty, normalized_uncertainty, threshold_for_rate, uncertainty)
from ciar.decoding.sampling import guide

FAST = settings(max_examples=60, deadline=None)


def random_box(seed: int, rows: int, V: int, scale: float, rmax: float, mask_frac: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    c = (torch.rand(rows, V, generator=g, dtype=torch.float64) * 2 - 1) * scale
    r = torch.rand(rows, V, generator=g, dtype=torch.float64) * rmax
    if mask_frac > 0:
        mask = torch.rand(rows, V, generator=g) < mask_frac
        mask[:, 0] = False  # at least one finite center per row
        c = c.masked_fill(mask, -math.inf)
    return c.float(), r.float()


def check_valid(p_lo, p_hi, tol=1e-5):
    assert not torch.isnan(p_lo).any() and not torch.isnan(p_hi).any()
    assert (p_lo >= 0).all() and (p_hi <= 1).all()
    assert (p_lo <= p_hi).all()
    assert (p_lo.sum(-1) <= 1 + tol).all()
    assert (p_hi.sum(-1) >= 1 - tol).all()


box_args = dict(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 300), scale=st.floats(0.0, 50.0),
                rmax=st.floats(0.0, 10.0), mask_frac=st.sampled_from([0.0, 0.0, 0.3, 0.9]),
                margin=st.sampled_from([0.0, 0.01, 0.05]))


@FAST
@given(**box_args)
def test_inter_fuse_valid(seed, V, scale, rmax, mask_frac, margin):
    c, r = random_box(seed, 3, V, scale, rmax, mask_frac)
    p_lo, p_hi = inter_fuse(c, r, margin=margin)
    assert p_lo.shape == c.shape and p_lo.dtype == torch.float32
    check_valid(p_lo, p_hi)
    assert (p_lo[c == -math.inf] == 0).all() and (p_hi[c == -math.inf] == 0).all()
    if margin > 0:
        assert (p_lo.sum(-1) <= 1 - margin + 1e-5).all()


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 300), scale=st.floats(0.0, 50.0),
       mask_frac=st.sampled_from([0.0, 0.3]))
def test_zero_radius_is_softmax(seed, V, scale, mask_frac):
    c, _ = random_box(seed, 3, V, scale, 0.0, mask_frac)
    p_lo, p_hi = inter_fuse(c, torch.zeros_like(c), margin=0.0)
    ref = torch.softmax(c.double(), -1).float()
    assert torch.allclose(p_lo, ref, atol=1e-6, rtol=1e-5)
    assert torch.allclose(p_hi, ref, atol=1e-6, rtol=1e-5)


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 300), scale=st.floats(0.0, 50.0),
       rmax=st.floats(0.0, 10.0), mask_frac=st.sampled_from([0.0, 0.3]))
def test_box_contains_softmax_of_members(seed, V, scale, rmax, mask_frac):
    c, r = random_box(seed, 2, V, scale, rmax, mask_frac)
    p_lo, p_hi = inter_fuse(c, r, margin=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(4):
        u = torch.rand(c.shape, generator=g) * 2 - 1
        cp = c.double() + u.double() * r.double()  # uniform in [c - r, c + r]; -inf stays -inf
        q = torch.softmax(cp, -1).float()
        assert (q >= p_lo - 1e-6).all() and (q <= p_hi + 1e-6).all()


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 300), shift=st.floats(-1e3, 1e3),
       margin=st.sampled_from([0.0, 0.01]))
def test_shift_invariance(seed, V, shift, margin):
    c, r = random_box(seed, 2, V, 20.0, 5.0, 0.2)
    a = inter_fuse(c, r, margin=margin)
    b = inter_fuse(c.double() + shift, r, margin=margin)  # float64 shift: no rounding of the centers
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-6)


def test_large_scale_no_overflow():
    c, r = random_box(0, 4, 100, 1e4, 10.0, 0.1)
    p_lo, p_hi = inter_fuse(c, r)
    check_valid(p_lo, p_hi)
    c2 = torch.tensor([[1e4, 1e4 - 5.0, -1e4]])
    p_lo, p_hi = inter_fuse(c2, torch.full_like(c2, 1.0), margin=0.0)
    check_valid(p_lo, p_hi)
    assert torch.allclose(p_lo[0, 0], torch.tensor(1 / (1 + math.exp(-3.0)))) and p_hi[0, 2] < 1e-12


def test_edge_cases():
    # one finite center: it gets probability 1; V == 1
    c = torch.tensor([[0.0, -math.inf, -math.inf]])
    p_lo, p_hi = inter_fuse(c, torch.ones_like(c), margin=0.0)
    assert p_lo.tolist() == [[1.0, 0.0, 0.0]] and p_hi.tolist() == [[1.0, 0.0, 0.0]]
    p_lo, p_hi = inter_fuse(torch.zeros(2, 1), torch.ones(2, 1))
    check_valid(p_lo, p_hi)
    # huge radii: no 0/0 anywhere, every token may win
    c, r = random_box(3, 2, 50, 5.0, 0.0)
    p_lo, p_hi = inter_fuse(c, torch.full_like(c, 500.0))
    check_valid(p_lo, p_hi)
    assert (p_hi == 1).all()
    # max_radius clamps
    a = inter_fuse(c, torch.full_like(c, 500.0), max_radius=2.0)
    b = inter_fuse(c, torch.full_like(c, 2.0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError):
        inter_fuse(c, r, margin=-0.1)


# ---- U ----

@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 300), lam=st.floats(0.0, 10.0))
def test_uncertainty_properties(seed, V, lam):
    g = torch.Generator().manual_seed(seed)
    delta = torch.rand(3, V, generator=g, dtype=torch.float64)
    zeros = torch.zeros_like(delta)
    u = uncertainty(zeros, delta)
    assert u.shape == (3,) and (u >= 0).all()
    # U scales as lam^2, up to the float32 rounding U is computed in: sigma's sum of squares loses up to a few ulps
    # of the values (relative to sigma itself, a lot when the row's values are nearly equal), times Omega
    scaled = lam * delta
    ulps = 8 * torch.finfo(torch.float32).eps * scaled.sum(-1) * scaled.abs().amax(-1)
    assert ((uncertainty(zeros, scaled) - lam ** 2 * u).abs() <= 2 * ulps + 1e-4 * lam ** 2 * u + 1e-7).all()
    assert (uncertainty(zeros, zeros) == 0).all()
    assert torch.allclose(uncertainty(zeros, torch.full_like(delta, 0.37)), torch.zeros(3), atol=1e-6)
    # sigma <= Omega sqrt(V-1)/V, with equality for one-hot delta
    omega, sigma = delta.sum(-1), delta.std(-1, correction=0)
    assert (sigma <= omega * math.sqrt(V - 1) / V + 1e-9).all()
    mass = float(torch.rand(1, generator=g)) * 2
    onehot = torch.zeros(V, dtype=torch.float64)
    onehot[int(torch.randint(V, (1,), generator=g))] = mass
    s1 = onehot.std(correction=0)
    assert math.isclose(float(s1), mass * math.sqrt(V - 1) / V, rel_tol=1e-9, abs_tol=1e-12)
    u1 = normalized_uncertainty(uncertainty(torch.zeros(V), onehot.float()), V)
    assert math.isclose(float(u1), mass ** 2, rel_tol=1e-4, abs_tol=1e-6)
    # normalised U lies in [0, Omega^2]
    un = normalized_uncertainty(u, V)
    assert (un <= omega.float() ** 2 * (1 + 1e-4) + 1e-6).all()


def test_interval_uncertainty_grows_with_radius():
    c, _ = random_box(1, 1, 64, 5.0, 0.0)
    us = [float(interval_uncertainty(c, torch.full_like(c, m))[0]) for m in (0.0, 0.1, 0.5, 1.0)]
    assert all(a < b for a, b in zip(us, us[1:]))
    raw = interval_uncertainty(c, torch.full_like(c, 0.5), normalized=False)
    assert torch.allclose(normalized_uncertainty(raw, 64), interval_uncertainty(c, torch.full_like(c, 0.5)))


# ---- guidance ----

def test_guided_identity():
    c, r = random_box(2, 3, 17, 5.0, 2.0)
    gc, gr = guided_interval(c, r)
    assert torch.equal(gc, c) and torch.equal(gr, r) and gc.dtype == torch.float32
    gc, gr = guided_interval(c, r, temperature=2.0)
    assert torch.allclose(gc, c / 2) and torch.allclose(gr, r / 2)
    with pytest.raises(ValueError):
        guided_interval(c, r, temperature=0.0)
    with pytest.raises(ValueError):
        guided_interval(c, r, c_u=c)


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 100), s=st.sampled_from([0.5, 1.0, 3.0]),
       temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_guided_box_contains_guided_members(seed, V, s, temperature):
    c, r = random_box(seed, 2, V, 10.0, 3.0)
    cu, ru = random_box(seed + 7, 2, V, 10.0, 3.0)
    gc, gr = guided_interval(c, r, cu, ru, cfg_scale=s, temperature=temperature)
    assert torch.allclose(gc, guide(c, cu, s) / temperature)
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        cp = c + (torch.rand(c.shape, generator=g) * 2 - 1) * r
        up = cu + (torch.rand(c.shape, generator=g) * 2 - 1) * ru
        x = guide(cp, up, s) / temperature
        assert ((x - gc).abs() <= gr + 1e-4).all()


# ---- InterHead ----

def test_inter_head_shapes_and_init():
    torch.manual_seed(0)
    head = InterHead(16, 40, num_heads=1, max_radius=3.0)
    assert set(head.state_dict()) == {"heads.0.weight", "heads.0.bias"}
    h = torch.randn(2, 5, 16) * 10
    c, r = head(h)
    assert c.shape == (2, 5, 40) and r.shape == (2, 5, 40) and c.dtype == torch.float32
    assert (r >= 0).all() and (r <= 3.0).all()
    cs, rs = head.forward_heads(h.bfloat16())
    assert cs.shape == (1, 2, 5, 40) and cs.dtype == torch.float32 and rs.dtype == torch.float32
    w = torch.randn(40, 16)
    head.init_center_from(w)
    c, r = head(h)
    assert torch.allclose(c, h @ w.T, atol=1e-4)
    assert torch.allclose(r, torch.full_like(r, 0.5), atol=1e-6)
    with pytest.raises(ValueError):
        head.init_center_from(torch.randn(16, 40))


def test_inter_head_multi():
    torch.manual_seed(1)
    head = InterHead(8, 12, num_heads=3, combine="voting")
    assert sorted(head.state_dict()) == sorted(f"heads.{i}.{p}" for i in range(3) for p in ("weight", "bias"))
    h = torch.randn(4, 8)
    cs, rs = head.forward_heads(h)
    assert cs.shape == (3, 4, 12) and rs.shape == (3, 4, 12)
    c, r = head(h)
    assert torch.allclose(c, cs.mean(0)) and torch.allclose(r, rs.mean(0))
    w = torch.randn(12, 8)
    head.init_center_from(w, generator=torch.Generator().manual_seed(0))
    cs, rs = head.forward_heads(h)
    # head 0 is the plain init (the single-head device's), the others start perturbed around it: identical heads
    # would get identical gradients and stay copies forever (a 2-head ensemble trained that way was one head)
    assert torch.allclose(cs[0], h @ w.T, atol=1e-5) and torch.allclose(rs[0], torch.full_like(rs[0], 0.5))
    assert not torch.allclose(cs[1], cs[0]) and not torch.allclose(cs[1], cs[2]) and not torch.allclose(rs[1], rs[0])
    assert (cs[1:] - cs[0]).abs().mean() < 0.5 * cs[0].abs().mean()  # a perturbation of the cloud's logits
    other = InterHead(8, 12, num_heads=3, combine="voting")
    other.init_center_from(w, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), other.state_dict().values()))


@pytest.mark.parametrize("kwargs", [dict(num_heads=0), dict(num_heads=6), dict(combine="max"),
                                    dict(max_radius=0.0)])
def test_inter_head_bad_args(kwargs):
    with pytest.raises(ValueError):
        InterHead(8, 12, **kwargs)


# ---- thresholds ----

@pytest.mark.parametrize("rate", [0.1, 0.3, 0.9])
def test_threshold_for_rate(rate):
    scores = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    tau = threshold_for_rate(scores, rate)
    assert abs(float((scores > tau).float().mean()) - rate) <= 0.01


def test_threshold_extremes():
    scores = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert int((scores > threshold_for_rate(scores, 0.0)).sum()) == 0
    assert bool((scores > threshold_for_rate(scores, 1.0)).all())
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            threshold_for_rate(scores, bad)


# ---- features ----

@pytest.mark.parametrize("V,top", [(50, 8), (5, 8), (64, 4)])
def test_interval_features(V, top):
    c, r = random_box(4, 6, V, 10.0, 2.0, 0.3)
    f = interval_features(c, r, top=top)
    assert interval_feature_dim(top) == 2 * top + 4
    assert f.shape == (6, interval_feature_dim(top)) and f.dtype == torch.float32
    assert torch.isfinite(f).all()
    assert (f[:, 0] == 0).all()
    assert (f[:, :top] <= 0).all()
    omega, kappa, u_norm, ent = f[:, 2 * top:].unbind(-1)
    assert (kappa >= 0).all() and (kappa <= 1).all() and (ent >= 0).all() and (ent <= 1 + 1e-6).all()
    assert torch.allclose(u_norm, interval_uncertainty(c, r), rtol=1e-4, atol=1e-6)
    assert torch.allclose(u_norm, omega ** 2 * kappa, rtol=1e-3, atol=1e-6)
    if V < top:
        assert (f[:, V:top] == 0).all() and (f[:, top + V:2 * top] == 0).all()
    f3 = interval_features(c.view(2, 3, V), r.view(2, 3, V), top=top)
    assert f3.shape == (2, 3, 2 * top + 4) and torch.allclose(f3.view(6, -1), f)
