"""ciar_device.maths (numpy) against the torch definitions it mirrors: ciar.decoding.sampling, ciar.collab.protocol,
ciar.collab.interval and ciar.collab.gating; plus the shipped device's gate decisions and a torch-free import.

Tolerances (see the module docstring of ciar_device.maths for why each is what it is):
  bit-identical   guide, guided_interval, quantize_draft's q_sent, the greedy one-hot, softmax_score
  q_used          bit-identical when the float16 values sum below 1, else within 8 float32 ulps (measured: 4)
  probabilities   PROB_RTOL relative (+ PROB_ATOL for torch's flushed subnormals), same support
  InterFuse       BOUND_RTOL relative + BOUND_ATOL; scores SCORE_RTOL; features FEATURE_RTOL + FEATURE_ATOL
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "device"))  # until the client package is installed (`pip install -e device`)

from ciar_device import maths as M  # noqa: E402

from ciar.collab import gating as G, interval as I  # noqa: E402
from ciar.collab.protocol import draft_distribution, quantize_draft  # noqa: E402
from ciar.decoding.sampling import SamplingParams, logits_to_probs  # noqa: E402

PROB_RTOL, PROB_ATOL = 1e-5, 2e-38  # torch's float32 softmax: ~20-ulp exp on AVX512 (measured <= 4.4e-6), and
# float32 subnormals flushed to 0
BOUND_RTOL, BOUND_ATOL = 1e-6, 1e-12
SCORE_RTOL = 1e-6
FEATURE_RTOL, FEATURE_ATOL = 1e-5, 1e-6

VOCABS = (1, 2, 7, 64, 1024, 16384)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference runs small per-row ops: one thread is as fast and does not spin on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def T(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def logits_case(rng, shape, scale=3.0, masked=0.0, ties=False):
    """Random float32 logits [*shape]; `ties`: small integers (many equal values); `masked`: that fraction -inf
    (never a whole row)."""
    if ties:
        x = rng.integers(-3, 4, size=shape).astype(np.float32)
    else:
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if masked:
        m = rng.random(shape) < masked
        m[..., 0] = False
        x[m] = -np.inf
    return x


def box_case(rng, shape, scale=3.0, rmax=2.0, masked=0.0):
    return logits_case(rng, shape, scale, masked), (rng.random(shape) * rmax).astype(np.float32)


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def ulp_diff32(a, b):
    """|a - b| in float32 ulps (both non-negative)."""
    return np.abs(np.asarray(a, np.float32).view(np.int32).astype(np.int64)
                  - np.asarray(b, np.float32).view(np.int32).astype(np.int64))


def assert_probs_close(ours, ref):
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=PROB_RTOL, atol=PROB_ATOL)
    # same support (tokens torch flushes to 0 as float32 subnormals aside)
    assert np.array_equal(ours > PROB_ATOL, ref > PROB_ATOL)


# ---------------------------------------------------------------------------------------------- torch-free


def test_import_does_not_load_torch():
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "device"))
    code = "import sys; import ciar_device.maths; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO)


# ---------------------------------------------------------------------------------------------- sampling

PARAMS = [
    SamplingParams(),
    SamplingParams(cfg_scale=1.5),
    SamplingParams(cfg_scale=7.5, temperature=1.0, top_k=1000),  # LlamaGen's defaults
    SamplingParams(cfg_scale=3.3, temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(top_k=3),
    SamplingParams(top_k=100_000),  # top_k > V: disabled
    SamplingParams(top_p=1e-6),  # only the most probable (and its ties)
    SamplingParams(temperature=1e-30),  # tiny temperature: logits shifted to <= 0 first, no NaN
    SamplingParams(cfg_scale=2.0, temperature=0.0),  # greedy after guidance
    SamplingParams(temperature=0.0, top_k=5, top_p=0.3),  # greedy ignores the filters
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: repr(p.to_dict()))
@pytest.mark.parametrize("V", VOCABS)
def test_logits_to_probs_matches_torch(params, V):
    rng = np.random.default_rng(V * 7 + PARAMS.index(params))
    for shape, kw in [((V,), {}), ((3, V), {"masked": 0.3}), ((2, 2, V), {"ties": True}),
                      ((4, V), {"scale": 12.0, "masked": 0.05})]:
        # masked conditional logits (-inf) against finite unconditional ones stay -inf after guidance
        cond = logits_case(rng, shape, **kw)
        uncond = logits_case(rng, shape, **{k: v for k, v in kw.items() if k != "masked"})
        for u in (None, uncond):
            ref = logits_to_probs(T(cond), params, uncond_logits=None if u is None else T(u)).numpy()
            ours = M.logits_to_probs(cond, params.cfg_scale, params.temperature, params.top_k, params.top_p,
                                     uncond_logits=u)
            if params.greedy:
                assert bits_equal(ours, ref)  # the same one-hot (lowest index on ties)
            else:
                assert_probs_close(ours, ref)
                np.testing.assert_allclose(ours.sum(-1), 1.0, rtol=1e-5)


def test_logits_to_probs_takes_a_params_object_or_mapping():
    rng = np.random.default_rng(0)
    c, u = logits_case(rng, (2, 50)), logits_case(rng, (2, 50))
    p = SamplingParams(cfg_scale=2.5, temperature=0.8, top_k=10, top_p=0.8)
    a = M.logits_to_probs(c, p.cfg_scale, p.temperature, p.top_k, p.top_p, uncond_logits=u)
    assert bits_equal(M.logits_to_probs(c, p, uncond_logits=u), a)
    assert bits_equal(M.logits_to_probs(c, p.to_dict(), uncond_logits=u), a)
    assert bits_equal(M.logits_to_probs(c, SimpleNamespace(**p.to_dict()), uncond_logits=u), a)
    # cfg 1 or no unconditional rows: no guidance
    assert bits_equal(M.logits_to_probs(c, 1.0, uncond_logits=u), M.logits_to_probs(c))


@pytest.mark.parametrize("kw, field", [({"cfg_scale": 0.5}, "cfg_scale"), ({"temperature": -1.0}, "temperature"),
                                       ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                       ({"temperature": float("nan")}, "temperature")])
def test_logits_to_probs_validates(kw, field):
    with pytest.raises(ValueError, match=field):
        M.logits_to_probs(np.zeros(4, np.float32), **kw)


def test_top_k_and_top_p_tie_rules():
    logits = np.array([[2.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    for p in (SamplingParams(top_k=2), SamplingParams(top_k=1), SamplingParams(top_p=0.5),
              SamplingParams(top_p=0.3), SamplingParams(top_p=1e-6)):
        ref = logits_to_probs(T(logits), p).numpy()
        ours = M.logits_to_probs(logits, p)
        assert np.array_equal(ours > 0, ref > 0), p
        assert_probs_close(ours, ref)
    # top-k keeps every logit tied with the k-th: row 0 keeps 2.0 and the three 1.0s
    assert (M.logits_to_probs(logits, SamplingParams(top_k=2))[0] > 0).sum() == 4


@pytest.mark.parametrize("V", VOCABS)
def test_quantize_draft_bit_identical(V):
    rng = np.random.default_rng(V)
    rows, n = [], 64 if V <= 1024 else 8
    for scale in (0.5, 3.0, 8.0, 20.0):  # flat ... one token takes (nearly) everything: float16 underflow
        rows.append(torch.softmax(T(logits_case(rng, (n, V), scale=scale)), -1).numpy())
    rows.append(np.eye(min(V, 3), V, dtype=np.float32))  # one-hots
    rows.append(np.full((1, V), 1.0 / V, np.float32))  # uniform
    q = np.concatenate(rows)
    ref_sent, ref_used = (x.numpy() for x in quantize_draft(T(q)))
    q_sent, q_used = M.quantize_draft(q)
    assert q_sent.dtype == np.float16 and q_used.dtype == np.float32
    assert bits_equal(q_sent, ref_sent)  # the float16 draft distribution as sent: identical, always
    assert bits_equal(M.draft_distribution(ref_sent), q_used)
    assert bits_equal(draft_distribution(T(q_sent)).numpy(), ref_used)
    below = q_sent.astype(np.float64).sum(-1) < 1.0  # both float32 sums exact: the same bits
    assert bits_equal(q_used[below], ref_used[below])
    # else torch's float32 sum may round once partial sums pass 1 (measured: <= 4 ulps in ~2 % of rows)
    assert ulp_diff32(q_used, ref_used).max() <= 8
    assert V == 1 or (below.any() and (~below).any())
    # ours is the exact-sum normalisation: what torch gives with a float64 sum, on any device
    s = T(q_sent).float()
    assert bits_equal(q_used, (s / s.sum(-1, keepdim=True, dtype=torch.float64).float()).numpy())


def test_float16_conversions_are_numpys():
    """to_float16 / from_float16 (fast paths for float16 subnormals) give numpy's (IEEE round-to-nearest-even) bits."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # every float16
    assert bits_equal(M.from_float16(h), h.astype(np.float32))
    rng = np.random.default_rng(0)
    m = np.arange(0, 1026, dtype=np.float64)
    ties = ((m + 0.5) * 2.0 ** -24).astype(np.float32)  # halfway between float16 subnormals: ties to even
    x = np.concatenate([ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(1)),
                        rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.array([0.0, -0.0, 2.0 ** -14, 65504.0, 65520.0, 1e9, np.inf, -np.inf], np.float32)])
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore"):
        ours, ref = M.to_float16(x), x.astype(np.float16)
    keep = ~np.isnan(x)  # NaN payloads aside (both NaN)
    assert bits_equal(ours[keep], ref[keep]) and np.isnan(ours[~keep]).all()


def test_draft_distribution_of_an_all_zero_row_is_zero():
    z = np.zeros((2, 5), np.float16)
    assert bits_equal(M.draft_distribution(z), draft_distribution(T(z)).numpy())


def test_sample_inverse_cdf():
    q = np.array([0.1, 0.0, 0.6, 0.3, 0.0], np.float32)
    draws = np.array([M.sample(q, M.uniform(0, M.DRAFT_STREAM, i)) for i in range(20_000)])
    freq = np.bincount(draws, minlength=5) / draws.size
    assert freq[1] == 0 and freq[4] == 0  # zero-probability tokens are never drawn
    np.testing.assert_allclose(freq, q, atol=0.015)
    assert M.sample(q, 0.0) == 0 and M.sample(q, 0.1) == 2 and M.sample(q, 0.7) == 3  # the first cdf entry > u
    for i in range(5):  # a one-hot row always gives its token
        assert M.sample(np.eye(5, dtype=np.float32)[i], 0.5) == i
    assert M.sample(np.array([0.0, 0.0, 1e-30], np.float32), 0.99) == 2
    with pytest.raises(ValueError):
        M.sample(np.zeros(3, np.float32), 0.5)


def test_sample_never_runs_past_the_last_positive_token():
    assert M.sample(np.array([0.3, 0.7, 0.0, 0.0], np.float32), np.nextafter(1.0, 0.0)) == 1


# ---------------------------------------------------------------------------------------------- the logit box


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("cfg, temp", [(None, 1.0), (None, 0.7), (1.5, 1.0), (3.3, 0.9), (7.5, 1.25), (0.5, 1.0)])
def test_guided_interval_bit_identical(V, cfg, temp):
    rng = np.random.default_rng(V)
    (cc, rc), (cu, ru) = box_case(rng, (3, V)), box_case(rng, (3, V))
    if cfg is None:
        ref = I.guided_interval(T(cc), T(rc), temperature=temp)
        ours = M.guided_interval(cc, rc, temperature=temp)
    else:
        ref = I.guided_interval(T(cc), T(rc), T(cu), T(ru), cfg_scale=cfg, temperature=temp)
        ours = M.guided_interval(cc, rc, cu, ru, cfg_scale=cfg, temperature=temp)
    for a, b in zip(ours, ref):
        assert bits_equal(a, b.numpy())
    assert bits_equal(M.guide(cc, cu, 3.3), I.guide(T(cc), T(cu), 3.3).numpy())


def test_guided_interval_checks():
    c = np.zeros(4, np.float32)
    for t in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            M.guided_interval(c, c, temperature=t)
    with pytest.raises(ValueError, match="together"):
        M.guided_interval(c, c, c_u=c)


def box_cases(V):
    rng = np.random.default_rng(1000 + V)
    yield box_case(rng, (V,))
    yield box_case(rng, (3, V), scale=1.0, rmax=0.05)  # narrow boxes
    yield box_case(rng, (2, 2, V), scale=8.0, rmax=6.0)  # wide boxes: bounds near 0 and 1
    yield box_case(rng, (3, V), masked=0.4)  # masked centers
    c, r = box_case(rng, (2, V))
    r[0] = 0.0  # a point box
    r[1, : V // 2] = -1.0  # negative radii count as 0
    yield c, r
    c = np.full((2, V), -np.inf, np.float32)
    c[:, 0] = 1.0  # a sole finite entry
    yield c, (rng.random((2, V)) * 2).astype(np.float32)


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("margin, max_radius", [(0.0, None), (0.01, None), (0.05, 1.0)])
def test_inter_fuse_matches_torch(V, margin, max_radius):
    for c, r in box_cases(V):
        ref = I.inter_fuse(T(c), T(r), margin=margin, max_radius=max_radius)
        ours = M.inter_fuse(c, r, margin=margin, max_radius=max_radius)
        for a, b in zip(ours, ref):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b.numpy(), rtol=BOUND_RTOL, atol=BOUND_ATOL)
        assert (ours[0] <= ours[1]).all() and (ours[1] <= 1).all() and (ours[0] >= 0).all()
        # U, normalised or not, on the same bounds and through the whole chain
        for norm in (True, False):
            ref_u = I.interval_uncertainty(T(c), T(r), margin=margin, max_radius=max_radius, normalized=norm)
            ours_u = M.interval_uncertainty(c, r, margin=margin, max_radius=max_radius, normalized=norm)
            np.testing.assert_allclose(ours_u, ref_u.numpy(), rtol=SCORE_RTOL, atol=1e-12)
        np.testing.assert_allclose(M.uncertainty(*ref), I.uncertainty(*ref).numpy(), rtol=SCORE_RTOL, atol=1e-12)


def test_inter_fuse_broadcasts_and_checks_margin():
    rng = np.random.default_rng(0)
    c, r = box_case(rng, (3, 40))
    ref = I.inter_fuse(T(c), T(r[0]))
    ours = M.inter_fuse(c, r[0])
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b.numpy(), rtol=BOUND_RTOL, atol=BOUND_ATOL)
    with pytest.raises(ValueError, match="margin"):
        M.inter_fuse(c, r, margin=-0.1)


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("top", [1, 8, 12])
def test_interval_features_match_torch(V, top):
    for c, r in box_cases(V):
        ref = I.interval_features(T(c), T(r), top=top).numpy()
        ours = M.interval_features(c, r, top=top)
        assert ours.dtype == np.float32 and ours.shape == ref.shape == c.shape[:-1] + (M.interval_feature_dim(top),)
        k = min(top, V)
        if np.isinf(c).any():  # tied (-inf) centers among the top: which of them torch.topk picks is unspecified
            np.testing.assert_array_equal(ours[..., :top], ref[..., :top])  # rel (floored) is the same
            finite = np.concatenate([ref[..., :k] > M.FEATURE_LOGIT_FLOOR, np.zeros_like(ref[..., k:top], bool)], -1)
            np.testing.assert_array_equal(ours[..., top:2 * top][finite], ref[..., top:2 * top][finite])
            np.testing.assert_allclose(ours[..., 2 * top:], ref[..., 2 * top:], rtol=FEATURE_RTOL,
                                       atol=FEATURE_ATOL)
        else:
            np.testing.assert_allclose(ours, ref, rtol=FEATURE_RTOL, atol=FEATURE_ATOL)
    with pytest.raises(ValueError):
        M.interval_features(c, r, top=0)


# ---------------------------------------------------------------------------------------------- the gates


@pytest.mark.parametrize("V", VOCABS)
def test_lower_score_matches_torch(V):
    for c, r in box_cases(V):
        rng = np.random.default_rng(V)
        x = rng.integers(0, V, size=c.shape[:-1])
        ref = G.lower_score(T(c.reshape(-1, V)), T(r.reshape(-1, V)), T(x.reshape(-1))).numpy().reshape(x.shape)
        ours = M.lower_score(c, r, x)
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, rtol=SCORE_RTOL, atol=1e-12)
        assert np.array_equal(np.isinf(ours), np.isinf(ref))  # masked drafted tokens: inf in both


@pytest.mark.parametrize("V", VOCABS)
def test_probability_gates_match_torch(V):
    rng = np.random.default_rng(V)
    for scale in (0.1, 3.0, 30.0):
        probs = torch.softmax(T(logits_case(rng, (5, V), scale=scale, masked=0.2)), -1).numpy()
        np.testing.assert_allclose(M.entropy_score(probs), G.entropy_score(T(probs)).numpy(), rtol=SCORE_RTOL,
                                   atol=1e-7)
        assert bits_equal(M.softmax_score(probs), G.softmax_score(T(probs)).numpy())


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("k", [1, 5, 200, 20_000])
def test_topk_score_matches_torch(V, k):
    if k > V > 1024:
        pytest.skip("torch's O(k^2) comparison is slow at V = 16384 (k > V is covered at the smaller V)")
    for c, r in box_cases(V):
        if np.isinf(c).sum(-1).max() > V - min(k, V):  # masked centers inside the top k: ties at -inf
            continue
        for margin in (0.0, 0.01):
            ref = G.topk_score(T(c), T(r), topk=k, margin=margin).numpy()
            np.testing.assert_allclose(M.topk_score(c, r, topk=k, margin=margin), ref, rtol=SCORE_RTOL, atol=1e-7)


def test_gate_score_dispatch_matches_gate_scores():
    rng = np.random.default_rng(3)
    V = 300
    c, r = box_case(rng, (V,))
    q = torch.softmax(T(c), -1).numpy()
    x = 17
    for kind in ("interval", "lower", "entropy", "softmax", "topk"):
        for margin in (0.0, 0.01):
            ref = float(G.gate_scores(kind, center=T(c[None]), radius=T(r[None]), probs=T(q[None]), topk=50,
                                      margin=margin, drafted=torch.tensor([x]))[0])
            ours = M.gate_score(kind, center=c, radius=r, probs=q, topk=50, margin=margin, drafted=x)
            assert isinstance(ours, float)
            assert ours == pytest.approx(ref, rel=SCORE_RTOL, abs=1e-7), kind
    u = M.uniform(5, M.GATE_STREAM, 3)
    assert 0.0 <= u < 1.0 and M.gate_score("random", u=u) == u
    for kind, kw in [("lower", {"center": c, "radius": r}), ("entropy", {}), ("random", {}),
                     ("interval", {"center": c}), ("nope", {})]:
        with pytest.raises(ValueError, match="needs|unknown"):
            M.gate_score(kind, **kw)
    assert set(M.GATES) == set(G.GATES)


# ---------------------------------------------------------------------------------------------- the shipped device


@pytest.fixture(scope="module")
def recorded(one_torch_thread):
    """Real device inputs: every draft of the shipped scenes device (CIAR, its calibrated gate, no network) on four
    val prompts: (center [rows, V], radius [rows, V], q as sent, drafted token, gate score, scored?) per draft."""
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.data.scenes import scene_at
    from ciar.world import load_world
    from ciar_device.loop import _Image

    world = load_world(None)
    decoder = make_decoder(world, make_verifier(world), "ciar", network="none", policy="fixed")
    rows = []
    draft, score = _Image.draft, _Image.score

    def spy_draft(image, position):
        q_sent, q_used, x = draft(image, position)
        rows.append([image.step.center.copy(), image.step.radius.copy(), q_sent.copy(), x, None, False])
        return q_sent, q_used, x

    def spy_score(image, q_used, x):  # the first draft of a position is scored (the loop's numpy gate)
        rows[-1][4:] = score(image, q_used, x), True
        return rows[-1][4]

    _Image.draft, _Image.score = spy_draft, spy_score
    try:
        for i in range(4):
            decoder.generate(scene_at("val", i).caption, seed=i)
    finally:
        _Image.draft, _Image.score = draft, score
    return SimpleNamespace(world=world, config=decoder.config, sampling=decoder.sampling, rows=rows)


def _torch_box(center, radius, p):
    if p.uses_cfg:
        return I.guided_interval(T(center[0]), T(radius[0]), T(center[1]), T(radius[1]), cfg_scale=p.cfg_scale,
                                 temperature=p.temperature or 1.0)
    return I.guided_interval(T(center[0]), T(radius[0]), temperature=p.temperature or 1.0)


def _numpy_box(center, radius, p):
    if p.uses_cfg:
        return M.guided_interval(center[0], radius[0], center[1], radius[1], cfg_scale=p.cfg_scale,
                                 temperature=p.temperature or 1.0)
    return M.guided_interval(center[0], radius[0], temperature=p.temperature or 1.0)


def test_shipped_device_drafts(recorded):
    """The draft of every recorded position: the device loop sent numpy's q, bit for bit; torch's q from the same
    logits (what the cloud's and calibration's maths compute) is within one float16 ulp of it, and equal in most
    rows."""
    p = recorded.sampling
    same_rows = 0
    for center, radius, q_sent, x, _, _ in recorded.rows:
        uncond = center[1] if p.uses_cfg else None
        assert bits_equal(M.quantize_draft(M.logits_to_probs(center[0], p, uncond_logits=uncond))[0], q_sent)
        q32_torch = logits_to_probs(T(center[0]), p, uncond_logits=None if uncond is None else T(uncond)).numpy()
        torch_sent = M.quantize_draft(q32_torch)[0]
        assert np.abs(torch_sent.view(np.int16).astype(np.int32) - q_sent.view(np.int16)).max() <= 1
        same_rows += bits_equal(torch_sent, q_sent)
        assert M.draft_distribution(q_sent)[x] > 0
    assert same_rows >= 0.9 * len(recorded.rows)


def test_shipped_device_gate_decisions(recorded):
    """The numpy "lower" and "interval" gates escalate exactly the positions torch's gates (what calibration scores
    with) escalate, at the device's calibrated thresholds, on >= 300 real positions; the recorded scores are the
    device loop's own (the spy saw the real thing)."""
    cfg, p = recorded.config, recorded.sampling
    taus = recorded.world.device_model.ciar_defaults.taus
    assert cfg.tau == taus[cfg.gate]
    assert len(recorded.rows) >= 300
    gaps = {}
    for kind in ("lower", "interval"):
        tau = taus[kind]
        ref, ours = [], []
        for center, radius, _, x, score, scored in recorded.rows:
            tc, tr = _torch_box(center, radius, p)
            nc, nr = _numpy_box(center, radius, p)
            assert bits_equal(nc, tc.numpy()) and bits_equal(nr, tr.numpy())
            s_ref = float(G.gate_scores(kind, center=tc[None], radius=tr[None], margin=cfg.margin,
                                        drafted=torch.tensor([x]))[0])
            if kind == cfg.gate and scored:
                assert score == pytest.approx(s_ref, rel=SCORE_RTOL)
            ref.append(s_ref)
            ours.append(M.gate_score(kind, center=nc, radius=nr, margin=cfg.margin, drafted=x))
        ref, ours = np.array(ref), np.array(ours)
        np.testing.assert_allclose(ours, ref, rtol=SCORE_RTOL)
        assert np.array_equal(ours > tau, ref > tau), kind
        assert 0 < (ref > tau).sum() < len(ref)  # both decisions occur
        gaps[kind] = float(np.abs(ref - tau).min())
    print(f"\n{len(recorded.rows)} positions; closest |score - tau|: {gaps}")


def test_shipped_device_features(recorded):
    p = recorded.sampling
    boxes = [_numpy_box(c, r, p) for c, r, *_ in recorded.rows]
    c, r = np.stack([b[0] for b in boxes]), np.stack([b[1] for b in boxes])
    ref = I.interval_features(T(c), T(r), top=8).numpy()
    np.testing.assert_allclose(M.interval_features(c, r, top=8), ref, rtol=FEATURE_RTOL, atol=FEATURE_ATOL)
