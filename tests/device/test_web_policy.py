"""The page's adaptive policy (web/src/policy.js, under node) against the Python device's (ciar_device.policy): on
hand-made and random costs the same expected costs, the same chosen points (with and without the switch margin,
before the open and mid-image, with a price on cloud steps) and the same message sizes; a CostObserver scripted
through the same priming, exchanges, verdicts, escalations and a thousand decisions (the exploration's backoff to
EXPLORE_MAX and its reset) holds the same estimates and makes the same choices at every step."""

import dataclasses
import math
import random
import re

import numpy as np
import pytest

from ciar_device import policy as P
from ciar_device.wire import VERIFY_REPLY, Frame, VerifyReply, encode_frame

REL = 1e-9
BASE = P.Costs(device_step_s=1e-3, latency_s=0.010, bandwidth_Bps=300e6 / 8, cloud_step_s=0.060, queue_s=0.0,
               escalation_rate=0.25, accept_first=0.5, accept_next=0.9, vocab_size=1024)


def _num(v):
    """A number as JSON for the harness (non-finite ones as the strings it reads back and answers with)."""
    return v if v is None or math.isfinite(v) else {math.inf: "Infinity", -math.inf: "-Infinity"}.get(v, "NaN")


def _back(v):
    """The harness's answer with its non-finite numbers' strings as floats."""
    if isinstance(v, str) and v in ("Infinity", "-Infinity", "NaN"):
        return float(v.lower().replace("infinity", "inf"))
    if isinstance(v, list):
        return [_back(x) for x in v]
    if isinstance(v, dict):
        return {k: _back(x) for k, x in v.items()}
    return v


def _costs(c: P.Costs) -> dict:
    return {k: _num(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(c).items()}


def _point(p: P.OperatingPoint):
    return "cloud-only" if p.cloud_only else [p.span, p.burst]


def _decision(d: P.Decision) -> dict:
    return {"point": _point(d.point), "seconds": d.outlook.seconds, "cloud_steps": d.outlook.cloud_steps,
            "objective_s": d.objective_s}


def _same(js, py, where=""):
    """Equal structures, floats to REL."""
    if isinstance(py, dict):
        assert isinstance(js, dict) and js.keys() == py.keys(), (where, js, py)
        for k in py:
            _same(js[k], py[k], f"{where}.{k}")
    elif isinstance(py, (list, tuple)):
        assert isinstance(js, list) and len(js) == len(py), (where, js, py)
        for i, (a, b) in enumerate(zip(js, py)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(py, float) and not isinstance(py, bool):
        assert js == pytest.approx(py, rel=REL, abs=1e-300), (where, js, py)
    else:
        assert js == py and isinstance(js, bool) == isinstance(py, bool), (where, js, py)


def _cases() -> list[P.Costs]:
    """Hand-made corners, then random costs (a fixed seed)."""
    r = P.Costs
    hand = [
        BASE,
        dataclasses.replace(BASE, hidden_dim=256, feature_dim=20),  # Inter-Enhance: projector inputs go up
        dataclasses.replace(BASE, escalation_rate=0.0),  # no exchange: every drafting point costs the same
        dataclasses.replace(BASE, escalation_rate=1.0),
        dataclasses.replace(BASE, escalation_rate=1 / 3.5),  # (1 - e) / e is 2.5: Python rounds it half to even
        dataclasses.replace(BASE, escalation_rate=0.4),  # ... 1.4999999999999998
        dataclasses.replace(BASE, accept_next=1.0, accept_first=1.0),  # every span accepted whole: no burst
        dataclasses.replace(BASE, accept_first=0.0, accept_next=0.0),
        dataclasses.replace(BASE, bandwidth_Bps=math.inf, latency_s=0.0),  # a perfect link
        dataclasses.replace(BASE, device_step_s=0.5, cloud_step_s=0.004, decode_step_s=0.002),  # cloud-only wins
        dataclasses.replace(BASE, device_step_s=0.0, queue_s=0.3, latency_s=0.2, bandwidth_Bps=1e5),  # a slow link
        r(device_step_s=2e-3, latency_s=0.03, bandwidth_Bps=2e6, cloud_step_s=0.2, queue_s=0.05, escalation_rate=0.1,
          accept_first=0.7, accept_next=0.95, vocab_size=16384, hidden_dim=768, feature_dim=20, decode_step_s=0.02),
        r(device_step_s=5e-3, latency_s=1e-3, bandwidth_Bps=1e9, cloud_step_s=0.01, queue_s=0.0, escalation_rate=0.5,
          accept_first=0.3, accept_next=0.6, vocab_size=3),
    ]
    g = random.Random(20261125)
    rand = []
    for _ in range(60):
        log = lambda lo, hi: math.exp(g.uniform(math.log(lo), math.log(hi)))  # noqa: E731
        rand.append(r(device_step_s=log(1e-4, 0.3), latency_s=log(1e-4, 0.3), bandwidth_Bps=log(1e4, 1e9),
                      cloud_step_s=log(1e-3, 0.5), queue_s=g.choice([0.0, log(1e-4, 0.2)]),
                      escalation_rate=g.uniform(0.01, 0.99), accept_first=g.random(), accept_next=g.random(),
                      vocab_size=g.choice([1024, 16384, 1000]), hidden_dim=g.choice([0, 256]),
                      feature_dim=g.choice([0, 20]), decode_step_s=g.choice([None, log(1e-3, 0.5)])))
    return hand + rand


def _calibrated(i: int) -> P.OperatingPoint:
    return [P.OperatingPoint(1, 0), P.OperatingPoint(4, 0), P.OperatingPoint(2, 4), P.OperatingPoint(32, 0),
            P.OperatingPoint(5, 32), P.OperatingPoint(3, 1)][i % 6]


def test_expected_costs_choices_and_sizes_equal_pythons(node):
    calls, want = [], []
    g = random.Random(7)
    for i, costs in enumerate(_cases()):
        c, cal = _costs(costs), _calibrated(i)
        remaining = [135, 1, 0, 144, g.randint(2, 300)][i % 5]
        calls.append({"fn": "pendingPerExchange", "costs": c})
        want.append(costs.pending_per_exchange)
        for point in (cal, P.OperatingPoint(cal.span + 1, 2), P.OperatingPoint(8, 16), P.CLOUD_ONLY):
            for at_open in (False, True):
                for pending in (0, 7):
                    calls.append({"fn": "expectedCost", "costs": c, "point": _point(point), "remaining": remaining,
                                  "pending": pending, "at_open": at_open})
                    o = P.expected_cost(costs, point, remaining, pending, at_open)
                    want.append({"seconds": o.seconds, "cloud_steps": o.cloud_steps})
        price = [0.0, 0.0, g.uniform(0.001, 0.2)][i % 3]
        for margin in (0.0, P.SWITCH_MARGIN):
            for at_open in (False, True):
                spans = P.SPANS if (i + at_open) % 2 else P.candidate_spans(cal.span)
                kw = dict(pending=i % 4, at_open=at_open, margin=margin)
                calls.append({"fn": "choose", "costs": c, "calibrated": _point(cal), "remaining": remaining,
                              "price": price, "spans": list(spans), **kw})
                want.append(_decision(P.choose(costs, cal, remaining, price, spans=spans, **kw)))
        for span, pending in ((0, 0), (1, 0), (cal.span, costs.pending_per_exchange), (32, 500), (3, 1)):
            calls.append({"fn": "requestBytes", "costs": c, "span": span, "pending": pending})
            want.append(P.request_bytes(costs, span, pending))
        for tokens in (0, 1, 2, 33, 144, remaining):
            calls.append({"fn": "replyBytes", "costs": c, "tokens": tokens})
            want.append(P.reply_bytes(costs, tokens))
    out = _back(node("policy", {"calls": calls}))
    assert len(out) == len(want)
    chosen = set()
    for i, (js, py) in enumerate(zip(out, want)):
        assert not (isinstance(js, dict) and "error" in js), (calls[i], js)
        _same(js, py, f"{calls[i]['fn']}#{i}")
        if calls[i]["fn"] == "choose":
            chosen.add("cloud-only" if py["point"] == "cloud-only" else "calibrated"
                       if py["point"] == calls[i]["calibrated"] else "other")
    assert chosen == {"cloud-only", "calibrated", "other"}  # the cases exercise every kind of choice


def test_the_grids_and_refusals_equal_pythons(node):
    calls = [{"fn": "candidateSpans", "k": k} for k in (1, 2, 3, 4, 7, 11, 16, 31, 32)]
    want = [P.candidate_spans(k) for k in (1, 2, 3, 4, 7, 11, 16, 31, 32)]
    for cal, spans, bursts in ((P.OperatingPoint(4, 0), None, None), (P.OperatingPoint(2, 4), [1, 2, 3, 8], [0, 4, 8]),
                               (P.CLOUD_ONLY, None, None)):
        calls.append({"fn": "allowedPoints", "calibrated": _point(cal), "spans": spans, "bursts": bursts})
        want.append([_point(p) for p in P.allowed_points(cal, spans or P.SPANS, bursts or P.BURSTS)])
    out = node("policy", {"calls": calls + [
        {"fn": "choose", "costs": _costs(BASE), "calibrated": [4, 0], "remaining": 10, "margin": 1.0},
        {"fn": "choose", "costs": _costs(BASE), "calibrated": [4, 0], "remaining": 10, "price": -1.0},
        {"fn": "expectedCost", "costs": {**_costs(BASE), "escalation_rate": 1.5}, "point": [1, 0], "remaining": 1},
        {"fn": "expectedCost", "costs": {**_costs(BASE), "bandwidth_Bps": 0.0}, "point": [1, 0], "remaining": 1},
        {"fn": "expectedCost", "costs": _costs(BASE), "point": [0, 0], "remaining": 1}]})
    assert out[:len(want)] == want
    errors = [o["error"] for o in out[len(want):]]
    assert "margin must be in [0, 1)" in errors[0] and "cloudStepPriceS must be >= 0" in errors[1]
    assert "escalationRate must be in [0, 1]" in errors[2] and "bandwidthBps must be > 0" in errors[3]
    assert "needs span >= 1" in errors[4]


def test_message_sizes_are_the_encoded_frames(node):
    """wire.js's byte formulas are its encoder's frames (and Python's nbytes, above); the reply's is the size of the
    frame the Python codec sends."""
    shapes = [(1024, 0, 0, None, None), (1024, 3, 4, 256, 20), (1000, 5, 1, 0, 20), (7, 2, 3, None, None),
              (16384, 1, 2, 4, 0), (2, 9, 9, None, None)]
    calls = [{"fn": "verifyFrame", "V": V, "m": m, "k": k, "hidden_dim": h, "feature_dim": f}
             for V, m, k, h, f in shapes]
    replies = [(1024, 0), (1024, 1), (1024, 31), (1000, 7), (16384, 143), (2, 5)]
    calls += [{"fn": "verifyReplyBytes", "V": V, "burst": g} for V, g in replies]
    out = node("policy", {"calls": calls})
    for r in out[:len(shapes)]:
        assert r["formula"] == r["encoded"], r
    for (V, g), js in zip(replies, out[len(shapes):]):
        rep = VerifyReply(P.SESSION_ID, 1, 0, False, 0.5, 1, burst_tokens=np.zeros(g, np.int64), vocab_size=V)
        assert js == len(encode_frame(Frame(VERIFY_REPLY, 1, rep))) == rep.nbytes()


# ---------------------------------------------------------------------------------------------- the observer
def _camel(k: str) -> str:
    return re.sub(r"_([a-zA-Z])", lambda m: m.group(1).upper(), k)


def _state(o: P.CostObserver) -> dict:
    """The harness's observerState, in Python."""
    steps = o.cloud.steps()
    return {"ready": o.ready, "primed": o.primed, "link_samples": o.link.samples, "latency_s": o.link.latency_s,
            "bandwidth_Bps": o.link.bandwidth_Bps, "cloud_steps": None if steps is None else list(steps),
            "cloud_samples": o.cloud.samples, "queue_s": o.queue.value, "verifier_s": o.verifier.value,
            "device_step_s": o.device_step.value, "escalation": o.escalation.value,
            "escalation_observed": o.escalation.observed, "accept_first": o.accept_first.value,
            "accept_next": o.accept_next.value, "streak": o.cloud_only_streak, "explore_after": o.explore_after,
            "exploring": o.exploring}


def _replay(init: dict, ops: list[dict]) -> list[dict]:
    """The harness's observerRun, in Python."""
    o = P.CostObserver(init.get("weight", 0.2), init.get("rates"), init.get("decay", 0.998))
    out = []
    for op in ops:
        step = {}
        kind = op["op"]
        if kind == "prime":
            h = op.get("hint")
            o.prime(op.get("latency_s"), op.get("device_step_s"),
                    None if h is None else P.CostHint(h.get("span_s"), h.get("step_s"), h.get("queue_s")))
        elif kind == "exchange":
            o.observe_exchange(op["up"], op["down"], op["link_s"], op["cloud_s"], op["passes"], op["queue_s"],
                               op["verify"], op.get("tokens"))
        elif kind == "verdict":
            o.observe_verdict(op["span"], op["accepted"])
        elif kind == "escalation":
            o.escalation.observe(op["x"])
        elif kind == "device_step":
            o.device_step.update(op["s"])
        elif kind == "decide":
            costs = o.costs(op["vocab"], op.get("hidden", 0), op.get("feature", 0), op.get("device_step_s"))
            step["costs"] = {_camel(k): v for k, v in dataclasses.asdict(costs).items()}
            cal = P.CLOUD_ONLY if op["calibrated"] == "cloud-only" else P.OperatingPoint(*op["calibrated"])
            step.update(_decision(o.decide(costs, cal, op["remaining"], op.get("price", 0.0), spans=op.get("spans"))))
        out.append({**step, "state": _state(o)})
    return out


def _drafting_script(g: random.Random) -> list[dict]:
    """A device that drafts: primed, then 40 images of an open, verify exchanges with their verdicts, the gate's
    escalations and the image's device step, each image decided first. A slow link (30 ms each way, 5 MB/s) and
    spans mostly accepted whole: longer spans pay."""
    link = lambda nbytes: 0.06 + nbytes / 5e6 + g.uniform(0.0, 0.002)  # noqa: E731
    extra = random.Random(7)
    ops = [{"op": "prime", "latency_s": 0.004, "device_step_s": 0.003,
            "hint": {"span_s": 0.02, "step_s": 0.015, "queue_s": 0.001}}]
    for image in range(40):
        ops.append({"op": "decide", "vocab": 1024, "hidden": 256, "feature": 20, "calibrated": [4, 0],
                    "remaining": 135, "price": [0.0, 0.01][image % 2],
                    "device_step_s": None if image % 3 else g.uniform(1e-3, 5e-3)})
        up, down = g.randint(150, 200), g.randint(9000, 12000)
        ops.append({"op": "exchange", "up": up, "down": down, "link_s": link(up + down),
                    "cloud_s": g.uniform(0.05, 0.2), "passes": 9, "queue_s": 0.0, "verify": False})
        for _ in range(g.randint(3, 8)):
            for _ in range(g.randint(0, 6)):
                ops.append({"op": "escalation", "x": 0.0})
            ops.append({"op": "escalation", "x": 1.0})
            span, passes = 4, g.choice([1, 1, 1, 3, 5])
            up, down = g.randint(8300, 14000), g.randint(70, 80)
            # the burst tokens the reply carried (from their own generator: the script's other draws as before): one
            # a forward, or one short (an entropy stop); bursts by windows: the unprimed script
            tokens = extra.choice([passes - 1, max(0, passes - 2)])
            ops.append({"op": "exchange", "up": up, "down": down, "link_s": link(up + down),
                        "cloud_s": g.uniform(0.01, 0.03) * passes, "passes": passes,
                        "queue_s": g.choice([0.0, g.uniform(0.0, 0.01)]), "verify": True, "tokens": tokens})
            ops.append({"op": "verdict", "span": span, "accepted": g.choice([0, 2, span, span])})
        ops.append({"op": "device_step", "s": g.uniform(1e-3, 6e-3) * (10 if image == 20 else 1)})  # one stall
    return ops


def _cloud_only_script() -> list[dict]:
    """A slow device on a fast cloud: images go to the cloud whole (long opens, towards t_s) and the looks at
    drafting back off to EXPLORE_MAX; then the device turns fast and drafts again (the wait starts over)."""
    ops = [{"op": "prime", "latency_s": 0.001, "device_step_s": 0.5, "hint": {"span_s": 0.005, "step_s": 0.002}}]
    decide = {"op": "decide", "vocab": 1024, "calibrated": [2, 0], "remaining": 135}
    for image in range(1100):
        ops.append(decide)
        ops.append({"op": "exchange", "up": 120, "down": 200, "link_s": 0.002, "cloud_s": 0.3, "passes": 144,
                    "queue_s": 0.0, "verify": False})
    ops += [{"op": "device_step", "s": 1e-4}, decide, decide]
    return ops


def _unprimed_script() -> list[dict]:
    """Not ready until every cost has a value: a prime without a latency or a hint, then the replies' own figures;
    a hint with only t_s; the built-in rate priors (no device file's)."""
    return [{"op": "prime", "device_step_s": 0.002},
            {"op": "exchange", "up": 100, "down": 5000, "link_s": 0.004, "cloud_s": 0.1, "passes": 10, "queue_s": 0.0,
             "verify": False},
            {"op": "decide", "vocab": 16384, "calibrated": [1, 0], "remaining": 100},
            {"op": "exchange", "up": 40000, "down": 80, "link_s": 0.01, "cloud_s": 0.06, "passes": 3, "queue_s": 0.02,
             "verify": True},
            {"op": "exchange", "up": 90000, "down": 90, "link_s": 0.02, "cloud_s": 0.02, "passes": 1, "queue_s": 0.0,
             "verify": True},
            {"op": "exchange", "up": 60000, "down": 85, "link_s": 0.015, "cloud_s": 0.05, "passes": 2,
             "queue_s": 0.01, "verify": True},
            {"op": "verdict", "span": 1, "accepted": 1}, {"op": "verdict", "span": 3, "accepted": 2},
            {"op": "exchange", "up": 200, "down": 300, "link_s": 0.004, "cloud_s": 0.2, "passes": 40,
             "queue_s": 0.0, "verify": False, "tokens": 144},  # a cloud-only open by Jacobi windows
            {"op": "exchange", "up": 60000, "down": 95, "link_s": 0.015, "cloud_s": 0.07, "passes": 3,
             "queue_s": 0.0, "verify": True, "tokens": 8},  # a burst of 8 tokens in 2 rounds
            {"op": "decide", "vocab": 16384, "calibrated": [1, 0], "remaining": 100, "price": 0.05},
            {"op": "prime", "hint": {"step_s": 0.003}},
            {"op": "decide", "vocab": 16384, "calibrated": "cloud-only", "remaining": 50}]


@pytest.mark.parametrize("script", ["drafting", "cloud-only", "unprimed"])
def test_a_scripted_observer_equals_pythons(node, script):
    init, ops = {"rates": {"escalation_rate": 0.2, "accept_first": 0.6, "accept_next": 0.85}}, None
    if script == "drafting":
        ops = _drafting_script(random.Random(3))
    elif script == "cloud-only":
        ops = _cloud_only_script()
        init["decay"] = 0.99
    else:
        init, ops = {"weight": 0.3}, _unprimed_script()
    want = _replay(init, ops)
    (got,) = node("policy", {"calls": [{"fn": "observer", "init": init, "ops": ops}]})
    assert not (isinstance(got, dict) and "error" in got), got
    got = _back(got)
    assert len(got) == len(want)
    for i, (js, py) in enumerate(zip(got, want)):
        _same(js, py, f"{script} op {i} ({ops[i]['op']})")
    points = [w["point"] for w in want if "point" in w]
    states = [w["state"] for w in want]
    if script == "drafting":  # the device drafted, and moved off the calibrated point
        assert "cloud-only" not in points and any(p != [4, 0] for p in points)
    elif script == "cloud-only":  # looked at drafting with a backing-off wait, capped, and reset once drafting won
        looks = [w for w in want if "point" in w and w["state"]["exploring"]]
        assert len(looks) == 5 and max(s["explore_after"] for s in states) == P.EXPLORE_MAX
        assert points[-1] != "cloud-only" and states[-1]["explore_after"] == P.EXPLORE_EVERY
    else:
        assert [s["ready"] for s in states][:2] == [False, True] and points[-1] == "cloud-only"
