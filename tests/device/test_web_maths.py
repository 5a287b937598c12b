"""The page's gate maths (web/src/maths.js, under node) against the Python device's (ciar_device.maths) on inputs
recorded from the real device model: the same escalate / accept decision at every calibrated threshold, the same
float16 draft bits, scores and interval features within float32 rounding; float16 conversion bit-exact everywhere;
sampling edge cases; the draws follow the distribution."""

import math

import numpy as np
import pytest

from ciar_device import maths as M

GATES = ("lower", "interval", "entropy", "softmax")


def _js(a) -> list:
    """An array as JSON for the harness: -inf (masked logits) as null."""
    return [None if v == -math.inf else float(v) for v in np.asarray(a, np.float64).reshape(-1)]


def _num(v: float):
    """A number as JSON for the harness (non-finite ones as the strings it reads back)."""
    return float(v) if math.isfinite(v) else {math.inf: "Infinity", -math.inf: "-Infinity"}.get(v, "NaN")


@pytest.fixture(scope="module")
def recorded(onnx_dir):
    """Positions the numpy device loop scored on 2 held-out prompts (every other one): the step's logits (both CFG
    rows), the guided box and the drawn token, with the Python side's draft and scores for every gate."""
    from ciar.sim.runtime import make_verifier
    from ciar.data.scenes import scene_at
    from ciar.world import load_world
    from ciar_device import loop
    from ciar_device.runtime import DeviceRuntime

    from test_loop import NumpyCloud

    rt = DeviceRuntime(onnx_dir)
    cloud = NumpyCloud(make_verifier(load_world(None)))
    seen = []
    real_draft, real_score = loop._Image.draft, loop._Image.score

    def draft(self, position):
        q_sent, q_used, x = real_draft(self, position)
        c = self.step.center
        seen.append({"cond": c[0].copy(), "uncond": c[1].copy(), "q_sent": q_sent, "q_used": q_used, "x": x})
        return q_sent, q_used, x

    def score(self, q_used, x):
        center, radius = self.guided_box()
        seen[-1].update(center=center.copy(), radius=radius.copy())
        return real_score(self, q_used, x)

    loop._Image.draft, loop._Image.score = draft, score
    try:
        for i in range(2):
            loop.generate(rt, cloud, scene_at("val", 10 + i).caption, seed=i)
    finally:
        loop._Image.draft, loop._Image.score = real_draft, real_score
    cases = [c for c in seen if "center" in c][::2]
    for c in cases:
        c["scores"] = {g: M.gate_score(g, center=c["center"], radius=c["radius"], probs=c["q_used"], drafted=c["x"],
                                       margin=0.0) for g in GATES + ("topk",)}
    return rt.manifest, cases


def test_gate_decisions_and_scores_equal_pythons(recorded, node):
    manifest, cases = recorded
    taus = manifest["ciar_defaults"]["taus"]
    calls = []
    for c in cases:
        box = {"center": _js(c["center"]), "radius": _js(c["radius"])}
        calls += [{"fn": "gateScore", "args": ["lower", {**box, "drafted": c["x"]}]},
                  {"fn": "gateScore", "args": ["interval", box]},
                  {"fn": "gateScore", "args": ["entropy", {"probs": _js(c["q_used"])}]},
                  {"fn": "gateScore", "args": ["softmax", {"probs": _js(c["q_used"])}]},
                  {"fn": "gateScore", "args": ["topk", box]}]
    out = node("maths", {"calls": calls})
    assert len(cases) >= 100
    closest = {}
    for i, c in enumerate(cases):
        for j, g in enumerate(GATES + ("topk",)):
            js, py = out[5 * i + j], c["scores"][g]
            assert (js > taus[g]) == (py > taus[g]), (g, js, py, taus[g])  # the same decision, every gate
            assert js == pytest.approx(py, rel=2e-6, abs=1e-7), (g, js, py)
            closest[g] = min(closest.get(g, math.inf), abs(py - taus[g]))
    # the decisions were tested near the thresholds, not only far from them
    assert closest["lower"] < 0.5 and closest["entropy"] < 0.05


def test_draft_bits_and_features_equal_pythons(recorded, node):
    manifest, cases = recorded
    s = manifest["sampling"]
    top = manifest["feature_top"]
    calls = []
    for c in cases:
        calls.append({"fn": "logitsToProbs", "args": [_js(c["cond"]), s, _js(c["uncond"])]})
        calls.append({"fn": "intervalFeatures", "args": [_js(c["center"]), _js(c["radius"]), top]})
    out = node("maths", {"calls": calls})
    q32 = [np.asarray(out[2 * i], np.float32) for i in range(len(cases))]
    drafts = node("maths", {"calls": [{"fn": "quantizeDraft", "args": [q.tolist()]} for q in q32]})
    same_rows = 0
    for i, c in enumerate(cases):
        py_q32 = M.logits_to_probs(c["cond"], s, uncond_logits=c["uncond"])
        np.testing.assert_allclose(q32[i], py_q32, rtol=2e-6, atol=1e-12)
        # from the same float32 q, the float16 bits and the distribution drawn from are bit-identical
        py_sent, py_used = M.quantize_draft(q32[i])
        assert drafts[i]["sent"] == py_sent.view(np.uint16).tolist()
        assert np.array_equal(np.asarray(drafts[i]["used"], np.float32), py_used)
        same_rows += np.array_equal(py_sent, c["q_sent"])
        feats = M.interval_features(c["center"], c["radius"], top=top)
        np.testing.assert_allclose(np.asarray(out[2 * i + 1], np.float32), feats, rtol=1e-5, atol=1e-6)
    # from the same logits, the drafts sent are the Python device's in (nearly) every row
    assert same_rows >= 0.97 * len(cases), (same_rows, len(cases))


def test_float16_conversion_is_bit_exact(node):
    r = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 2**-25, 3 * 2**-25, 2**-24, 2**-14, 2**-14 * (1 - 2**-11), 2**-15 * 1.5,
                        1e-45, -1e-40, 0.1, 1 / 3, 65504.0, 65519.99, 65520.0, 1e9, -1e9, np.inf, -np.inf],
                       np.float32)
    values = np.concatenate([special, (r.standard_normal(4000) * 2.0 ** r.integers(-30, 18, 4000)).astype(np.float32),
                             r.random(2000).astype(np.float32) * 2**-14])
    calls = [{"fn": "toFloat16Bits", "args": [_num(float(v))]} for v in values]
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]
    calls += [{"fn": "fromFloat16Bits", "args": [int(b)]} for b in finite[::7]]
    out = node("maths", {"calls": calls})
    with np.errstate(over="ignore"):  # 65520 and beyond round to inf, as they should
        assert out[:len(values)] == values.astype(np.float16).view(np.uint16).tolist()
    back = np.asarray(out[len(values):], np.float64)
    assert np.array_equal(back, finite[::7].view(np.float16).astype(np.float64))


@pytest.mark.parametrize("sampling", [
    {"cfg_scale": 1.5, "temperature": 0.7, "top_k": 0, "top_p": 1.0},
    {"cfg_scale": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0},
    {"cfg_scale": 2.0, "temperature": 1.3, "top_k": 0, "top_p": 0.9},
    {"cfg_scale": 1.5, "temperature": 0.0, "top_k": 0, "top_p": 1.0},
    {"cfg_scale": 1.0, "temperature": 1.0, "top_k": 7, "top_p": 0.5},
])
def test_sampling_settings_equal_pythons(node, sampling):
    r = np.random.default_rng(1)
    cond, uncond = (r.standard_normal((2, 1024)) * 3).astype(np.float32)
    cond[:10] = cond[10]  # ties
    masked = cond.copy()
    masked[100:200] = -np.inf
    out = node("maths", {"calls": [{"fn": "logitsToProbs", "args": [_js(x), sampling, _js(uncond)]}
                                   for x in (cond, masked)]})
    for got, x in zip(out, (cond, masked)):
        ref = M.logits_to_probs(x, sampling, uncond_logits=uncond)
        got = np.asarray(got, np.float32)
        assert np.array_equal(got > 0, ref > 0)  # the same support (top-k / top-p / greedy rules, ties)
        np.testing.assert_allclose(got, ref, rtol=5e-6, atol=1e-12)


def test_draws_follow_the_distribution_and_skip_zeros(node):
    q = np.array([0.1, 0.0, 0.25, 0.05, 0.0, 0.4, 0.2, 0.0], np.float32)
    (draws,) = node("maths", {"calls": [{"fn": "sampleMany", "args": [q.tolist(), 7, 20000]}]})
    counts = np.bincount(draws, minlength=q.size) / len(draws)
    assert counts[q == 0].sum() == 0
    assert np.abs(counts - q).max() < 0.012  # ~4 standard errors at n = 20000
    (again,) = node("maths", {"calls": [{"fn": "sampleMany", "args": [q.tolist(), 7, 50]}]})
    assert again == draws[:50]  # keyed by (seed, position): the same draws
    assert draws[:2000] == [M.sample(q, M.uniform(7, M.DRAFT_STREAM, i)) for i in range(2000)]  # Python's too


def test_uniforms_are_pythons_bit_for_bit(node):
    """The page's counter-based uniforms equal `ciar_device.maths.uniform`'s, seeds up to 2**62 and negative ones
    (taken mod 2**64, as the wire's int64 would carry them), both streams."""
    keys = [(seed, stream, pos) for seed in (0, 1, 7, 123456789, 2**53 + 1, 2**62, -5)
            for stream in (M.DRAFT_STREAM, M.GATE_STREAM) for pos in (0, 1, 255, 1023, 70000)]
    (got,) = node("maths", {"calls": [{"fn": "uniforms", "args": [[[str(s), str(t), p] for s, t, p in keys]]}]})
    assert got == [M.uniform(s, t, p) for s, t, p in keys]


def test_refusals_name_the_problem(node):
    out = node("maths", {"calls": [{"fn": "gateScore", "args": ["nope", {"center": [0.0, 1.0], "radius": [0.0, 0.0]}]},
                                   {"fn": "gateScore", "args": ["lower", {"center": [0.0, 1.0], "radius": [0.0, 0.0]}]},
                                   {"fn": "logitsToProbs", "args": [[0.0, 1.0], {"cfg_scale": 0.5}, None]},
                                   {"fn": "sampleMany", "args": [[0.0, 0.0], 1, 1]}]})
    assert "not supported by the browser device" in out[0]["error"]
    assert "needs drafted" in out[1]["error"]
    assert "cfg_scale must be >= 1" in out[2]["error"]
    assert "positive, finite total" in out[3]["error"]
    (random,) = node("maths", {"calls": [{"fn": "gateScore", "args": ["random", {}]}]})
    assert "needs u" in random["error"]
