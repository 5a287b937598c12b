"""loadtests.soak: the slope fit and its classification, the series analysis and the verdict (fast), and one short
soak end to end against a cluster of the shipped world (slow)."""

import json
import os
import random
import subprocess
import sys

import pytest

from loadtests import soak

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fit_slope_recovers_a_line_exactly():
    ts = [0, 1, 2, 3, 4, 5]
    f = soak.fit_slope(ts, [10 + 2.5 * t for t in ts])
    assert f["slope"] == pytest.approx(2.5) and f["intercept"] == pytest.approx(10)
    assert f["se"] == pytest.approx(0, abs=1e-12) and f["span"] == 5 and f["n"] == 6
    assert f["first_half_mean"] == pytest.approx(12.5) and f["second_half_mean"] == pytest.approx(20)


def test_fit_slope_standard_error_matches_the_textbook():
    # sxx = 5, sxy = 5.5: b = 1.1, a = 1.1; residuals -0.1, 0.8, -1.3, 0.6: s^2 = 2.7 / 2, se = sqrt(s^2 / sxx)
    ts, ys = [0, 1, 2, 3], [1.0, 3.0, 2.0, 5.0]
    f = soak.fit_slope(ts, ys)
    assert f["slope"] == pytest.approx(1.1) and f["intercept"] == pytest.approx(1.1)
    assert f["se"] == pytest.approx((1.35 / 5) ** 0.5)


def test_fit_slope_edge_cases():
    assert soak.fit_slope([], [])["slope"] is None
    assert soak.fit_slope([1.0], [5.0])["mean"] == 5.0
    two = soak.fit_slope([0, 1], [0, 1])
    assert two["slope"] == pytest.approx(1) and two["se"] is None
    with pytest.raises(ValueError):
        soak.fit_slope([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError):
        soak.fit_slope([1, 2], [1])


def test_classify_flat_drift_growing_falling():
    rng = random.Random(0)
    ts = [float(t) for t in range(1, 31)]
    noise = [rng.gauss(0, 2.0) for _ in ts]
    flat = soak.fit_slope(ts, [500 + e for e in noise])
    assert soak.classify(flat, floor=4.0) == "flat"
    grow = soak.fit_slope(ts, [500 + 1.0 * t + e for t, e in zip(ts, noise)])  # 29 MB over the span
    assert soak.classify(grow, floor=4.0) == "growing"
    fall = soak.fit_slope(ts, [500 - 1.0 * t + e for t, e in zip(ts, noise)])
    assert soak.classify(fall, floor=4.0) == "falling"
    tiny = soak.fit_slope(ts, [500 + 0.05 * t + 0.001 * e for t, e in zip(ts, noise)])  # 1.45 MB: under the floor
    assert soak.classify(tiny, floor=4.0) == "drift"
    # a step (not a line) in noisy points is not significant at 3 standard errors
    step = soak.fit_slope([1, 2, 3, 4, 5, 6], [10, 12, 9, 13, 11, 12])
    assert soak.classify(step, floor=1.0) == "flat"
    # too few points to say anything, however straight the line
    assert soak.classify(soak.fit_slope([1, 2, 3, 4], [4, 5, 6, 7]), floor=1.0) == "unknown"
    assert soak.classify(soak.fit_slope([0, 1], [0, 9]), floor=1.0) == "unknown"
    assert soak.classify(soak.fit_slope(ts, [7.0] * len(ts)), floor=1.0) == "flat"  # constant: se 0, slope 0


def test_judge_tells_a_leak_from_a_warmup():
    ts = [float(t) for t in range(1, 31)]
    rng = random.Random(1)
    leak = [300 + 0.5 * t + rng.gauss(0, 0.3) for t in ts]  # 15 MB over the run, steadily
    warm = [300 + 20 * (1 - 0.8 ** t) + rng.gauss(0, 0.3) for t in ts]  # +20 MB, then a level
    j = soak.judge(ts, leak, floor=4.0)
    assert j["class"] == "growing" and j["late_class"] == "growing" and j["late_slope"] == pytest.approx(0.5, abs=0.1)
    w = soak.judge(ts, warm, floor=4.0)
    assert soak.classify(soak.fit_slope(ts, warm), 4.0) == "growing"  # the whole span alone would say so
    assert w["class"] == "settling" and w["late_class"] == "flat"
    short = soak.judge([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 5.0, 9.0, 13.0, 17.0], floor=1.0)
    assert short["late_slope"] is None and short["class"] == "growing"


def test_analyse_skips_the_warmup_and_missing_values():
    samples = [{"t_min": t, "series": {"rss_mb:Verifier": 100 + (50 if t < 1 else 0) + 0.0 * t,
                                       "fds:Ingress": 40 + 2 * t, "sessions:verifier": None if t == 2 else 0}}
               for t in (0, 0.5, 1, 2, 3, 4, 5, 6)]
    fits = soak.analyse(samples, warmup_min=1.0)
    v = fits["rss_mb:Verifier"]
    assert v["n"] == 6 and v["slope"] == pytest.approx(0) and v["class"] == "flat" and v["unit"] == "MB"
    assert fits["fds:Ingress"]["class"] == "growing" and fits["fds:Ingress"]["slope"] == pytest.approx(2)
    assert fits["sessions:verifier"]["n"] == 5 and fits["sessions:verifier"]["class"] == "flat"


def test_labels_are_stable_and_short():
    lab = soak.Labels()
    assert lab.label("SERVE_REPLICA::ciar#Device#b", "ServeReplica:ciar:Device") == "Device-1"
    assert lab.label("SERVE_REPLICA::ciar#Device#a", "ServeReplica:ciar:Device") == "Device-2"
    assert lab.label("SERVE_REPLICA::ciar#Device#b", "ServeReplica:ciar:Device") == "Device-1"
    assert lab.label("SERVE_REPLICA::ciar#Verifier#x", "ServeReplica:ciar:Verifier") == "Verifier"
    assert lab.label("SERVE_CONTROLLER_ACTOR", "ServeController") == "controller"
    assert lab.label("SERVE_PROXY_ACTOR-n1", "ProxyActor") == "proxy"


def _report(**kw):
    r = {"counts": {"http_plain": {"attempted": 3, "ok": 3}}, "unfinished": 0, "restarts": [],
         "reconfiguration": {"in_place": True},
         "settled": {"verifier": {"sessions": 0}, "devices": {"session_tokens": 0, "batch_size_records": 0,
                                                              "tracked_sessions": 0}},
         "fits": {"rss_mb:Verifier": {"class": "flat"}, "uss_mb:Verifier": {"class": "drift"}}}
    r.update(kw)
    return r


def test_verdict_names_each_reason():
    assert soak.verdict(_report()) == []
    assert "1 lost" in soak.verdict(_report(counts={"http_plain": {"attempted": 3, "ok": 2, "lost": 1}}))[0]
    assert "degraded" in soak.verdict(_report(counts={"device_ws": {"attempted": 1, "degraded": 1}}))[0]
    assert "restarted: Verifier" in soak.verdict(_report(restarts=["Verifier"]))[0]
    assert "not in place" in soak.verdict(_report(reconfiguration={"in_place": False}))[0]
    assert "not in place" in soak.verdict(_report(reconfiguration=None))[0]
    left = soak.verdict(_report(settled={"verifier": {"sessions": 2}, "devices": {}}))[0]
    assert "verifier_sessions" in left
    assert soak.verdict(_report(fits={"fds:Ingress": {"class": "growing"}})) == ["growing: fds:Ingress"]


def test_cut_socket_without_a_socket_does_nothing():
    class Conn:
        ws = None

    assert soak.cut_socket(Conn()) is False


@pytest.mark.slow
@pytest.mark.cluster  # starts Ray / Serve (tests/conftest.py)
@pytest.mark.timeout(1200)
def test_short_soak_end_to_end(tmp_path):
    """Two minutes of the mix against 2 phones of the shipped world: nothing lost, the cut images resumed, the
    reconfiguration in place, nothing left; the only failure allowed is a series that grows (2 minutes are a
    warm-up more than a soak), and soak.json / soak.png are written."""
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "loadtests.soak", "--minutes", "2", "--sample-s", "20", "--warmup-min", "0.5",
           "--devices", "2", "--http-workers", "2", "--device-clients", "1", "--cut-every", "2",
           "--set", "Verifier.idle_timeout_s=5", "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=1100)
    assert (out / "soak.json").exists(), p.stdout[-4000:] + p.stderr[-3000:]
    r = json.loads((out / "soak.json").read_text())
    assert all(reason.startswith("growing: ") for reason in r["reasons"]), r["reasons"]
    assert p.returncode == (0 if r["ok"] else 1)
    c = r["counts"]
    assert sum(k.get("lost", 0) for k in c.values()) == 0 and r["unfinished"] == 0
    assert c["http_plain"]["ok"] >= 1 and c.get("device_ws_cut", {}).get("resumes", 0) >= 1
    assert r["reconfiguration"]["in_place"] and not r["restarts"]
    assert len(r["samples"]) >= 6 and any(n.startswith("rss_mb:Verifier") for n in r["fits"])
    assert (out / "soak.png").stat().st_size > 10_000
