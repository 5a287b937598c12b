"""The page's CIAR loop (web/src: loop.js, connection.js, runtime.js on onnxruntime-web) run under node against a
real device endpoint on loopback (the torch CloudVerifier behind services.device_endpoint): images complete with
consistent stats and bytes as the socket carried them, a reply lost in flight is resumed to the same image, an
unreachable cloud ends in a degraded image, the gate's threshold decides what is sent, a wrong key is refused, and
the adaptive policy (the default) chooses each image's point from the costs it primed and observed, a point that
remakes the image under the fixed policy. The tests of the loop's mechanics pin the fixed policy: their expectations
(a drafted image, the same image twice) hold at the calibrated point, whatever point the costs would choose.
(The page itself, in chromium against the Serve application: tests/services/test_api.py.)"""

import json
import os

import pytest

KEY, SECRET = "web-loop-key", "web-loop-secret"
FIXED = {"policy": "fixed"}
SERVED: dict = {}  # the server fixture's endpoint and verifier (the retry tests check what they hold)


@pytest.fixture(scope="module")
def server():
    from ciar.sim.runtime import make_verifier
    from ciar.world import load_world
    from services.device_endpoint import DeviceEndpoint
    from services.config import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    verifier = make_verifier(load_world(None))
    endpoint = DeviceEndpoint(InProcessBackend(verifier, SECRET), [key_digest(KEY)])
    with loopback_endpoint(endpoint) as url:
        SERVED.update(endpoint=endpoint, verifier=verifier)
        yield url


def _prompts(n, start=20):
    from ciar.data.scenes import scene_at

    return [scene_at("val", start + i).caption for i in range(n)]


def _run(node, server, onnx_dir, jobs, **extra):
    return node("generate", {"url": server, "key": KEY, "model_dir": onnx_dir, "jobs": jobs, **extra})


def _client(server, onnx_dir, jobs, **knobs) -> list:
    """The torch-free client's images of `jobs` (`ciar_device.loop.generate` over a socket to the same endpoint)."""
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate
    from ciar_device.runtime import DeviceRuntime

    rt = DeviceRuntime(onnx_dir)
    conn = DeviceConnection(server, key=KEY, vocab_size=rt.vocab_size)
    try:
        return [generate(rt, conn, j["prompt"], j["seed"], **knobs) for j in jobs]
    finally:
        conn.disconnect()


def test_images_complete_with_consistent_stats(node, server, onnx_dir):
    jobs = [{"prompt": p, "seed": i, "session_id": f"web-{i}"} for i, p in enumerate(_prompts(3))]
    out = _run(node, server, onnx_dir, jobs, options=FIXED)
    n_verify = 0
    for r in out["results"]:
        assert "error" not in r, r
        st, who = r["stats"], r["who"]
        assert len(r["tokens"]) == len(who) == st["total_tokens"] == 144
        assert all(0 <= t < 1024 for t in r["tokens"])
        assert who.count("device") == st["device_tokens"] > 0 and who.count("cloud") == st["cloud_tokens"] > 0
        assert st["cloud_tokens"] == st["prefix_tokens"] + st["accepted"] + st["verifications"] + st["burst_tokens"]
        assert st["cloud_requests"] == st["verifications"] + 1 and not st["degraded"] and st["resumes"] == 0
        assert st["cloud_call_rate"] == pytest.approx(st["cloud_tokens"] / 144)
        assert st["device_ms_per_token"] > 0 and st["round_trip_ms"] > 0
        assert st["handovers"] == st["adapted"] == 0 and st["est_cloud_step_s"] == 0  # fixed: nothing estimated
        n_verify += st["verifications"]
    ex = out["exchanges"]
    # bytes as the socket carried them: the stats add up the OPEN and VERIFY frames (CLOSE is not charged)
    charged = [e for e in ex if e["kind"] in ("OPEN", "VERIFY")]
    assert [e["kind"] for e in ex].count("VERIFY") == n_verify and len(charged) == n_verify + 3
    assert sum(r["stats"]["bytes_up"] for r in out["results"]) == sum(e["up"] for e in charged)
    assert sum(r["stats"]["bytes_down"] for r in out["results"]) == sum(e["down"] for e in charged)
    assert out["reconnects"] == 0 and out["resumes"] == 0


def test_the_browser_the_client_and_the_clusters_device_make_the_same_image(node, server, onnx_dir):
    """One request, seed and operating point, three devices: the page's loop (onnxruntime-web), the torch-free
    client (`ciar_device.loop` on onnxruntime, over a socket to the same endpoint) and the cluster's simulated phone
    on the same runtime (`CollabDecoder` with the onnx runtime, in process): the same tokens, decided by the same
    side, since they draw at the same position-keyed uniforms from the same draft distributions."""
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.sim.runtime import device_runtime
    from ciar.engine.verifier import InProcessCloud
    from ciar.world import load_world

    prompts = _prompts(3, 60)
    jobs = [{"prompt": p, "seed": 70 + i, "session_id": f"web-same-{i}"} for i, p in enumerate(prompts)]
    browser = _run(node, server, onnx_dir, jobs, options=FIXED)["results"]
    client = _client(server, onnx_dir, jobs, policy="fixed")
    world = load_world(None)
    phone = CollabDecoder(world.device_model, InProcessCloud(SERVED["verifier"]),
                          method_config("ciar", network="none", policy="fixed"), world.sampling,
                          runtime=device_runtime("onnx", world.device_model, world.weights_dir, world.device_file,
                                                 onnx_dir))
    for job, b, c in zip(jobs, browser, client):
        assert "error" not in b, b
        cluster = phone.generate(job["prompt"], job["seed"], trace=True)
        assert b["tokens"] == c.tokens.tolist() == cluster.tokens.tolist()
        assert b["who"] == c.who == cluster.trace
        assert 0 < c.stats["device_tokens"] < 144  # drafted, not handed over


@pytest.mark.parametrize("gate", ["random", "topk", "always", "never"])
def test_every_gate_of_the_python_loop_runs_in_the_page_to_the_same_image(node, server, onnx_dir, gate):
    """The baseline gates (random, top-k) and the methods' "always" (EAGLE-style, every token verified) and "never"
    (CoDe-style, none) run in the page as in `ciar_device.loop`: the same tokens, decided by the same side."""
    prompt, seed = _prompts(1, 80)[0], 81
    job = {"prompt": prompt, "seed": seed, "session_id": f"web-gate-{gate}", "options": {**FIXED, "gate": gate}}
    (b,) = _run(node, server, onnx_dir, [job])["results"]
    assert "error" not in b, b
    (c,) = _client(server, onnx_dir, [job], gate=gate, policy="fixed")
    assert b["tokens"] == c.tokens.tolist() and b["who"] == c.who
    assert c.stats["verifications"] == 0 if gate == "never" else c.stats["verifications"] > 0
    assert c.stats["device_tokens"] == 0 if gate == "always" else c.stats["device_tokens"] > 0


def test_a_reply_lost_in_flight_is_resumed_to_the_same_image(node, server, onnx_dir):
    job = [{"prompt": _prompts(1, 30)[0], "seed": 4, "session_id": "web-cut"}]
    plain = _run(node, server, onnx_dir, job, options=FIXED)["results"][0]
    cut = _run(node, server, onnx_dir, job, options=FIXED, cuts=[2, 4])
    r = cut["results"][0]
    assert "error" not in r, r
    assert r["tokens"] == plain["tokens"] and r["who"] == plain["who"]
    assert cut["resumes"] == 2 and cut["reconnects"] == 2 and r["stats"]["resumes"] == 2
    assert [e["kind"] for e in cut["exchanges"]].count("RESUME") == 2


def test_a_session_lost_again_under_its_resent_verify_is_resumed_again(node, server, onnx_dir, monkeypatch):
    """web/src/connection.js as ciar_device.connection: the verifier loses the session under a VERIFY (410) and again
    under the VERIFY sent after each RESUME; the page resumes again, up to LOST_RETRIES times a request, and makes the
    same image; one loss more and the image fails with the 410."""
    backend = SERVED["endpoint"].backend
    job = [{"prompt": _prompts(1, 34)[0], "seed": 8, "session_id": "web-lost"}]
    plain = _run(node, server, onnx_dir, job, options=FIXED)["results"][0]
    monkeypatch.setattr(backend, "lose", 3)  # from the second VERIFY on, the session is gone (LOST_RETRIES times)
    monkeypatch.setattr(backend, "lose_after", 1)
    lost = _run(node, server, onnx_dir, job, options=FIXED)
    r = lost["results"][0]
    assert "error" not in r, r
    assert r["tokens"] == plain["tokens"] and r["who"] == plain["who"] and lost["resumes"] == 3
    backend.lose, backend.lose_after = 4, 1
    r = _run(node, server, onnx_dir, job, options=FIXED)["results"][0]
    assert r.get("status") == 410, r


def test_random_cuts_and_losses_leave_the_browsers_image_unchanged(node, server, onnx_dir, monkeypatch):
    """As the Python connection's random test (tests/services/test_device_endpoint.py): sockets cut right after a
    VERIFY is sent (its reply lost) and sessions lost under VERIFYs, at random (seeded) and together; the page
    reconnects, resumes (again when a resumed session is lost in turn) and makes the undisturbed image."""
    import random

    backend = SERVED["endpoint"].backend
    resumes = 0
    for seed in range(3):
        rng = random.Random(seed)
        job = [{"prompt": _prompts(1, 40 + seed)[0], "seed": 10 + seed, "session_id": f"web-chaos-{seed}"}]
        plain = _run(node, server, onnx_dir, job, options=FIXED)["results"][0]
        monkeypatch.setattr(backend, "lose", rng.randint(0, 3))
        monkeypatch.setattr(backend, "lose_after", rng.randint(0, 3))
        out = _run(node, server, onnx_dir, job, options=FIXED, cuts=sorted(rng.sample(range(1, 8), rng.randint(0, 2))))
        r = out["results"][0]
        assert "error" not in r, (seed, r)
        assert r["tokens"] == plain["tokens"] and r["who"] == plain["who"], seed
        resumes += out["resumes"]
    assert resumes > 0


VERIFY_LOST = ("up", "VERIFY", 2, "drop")  # a verify lost on its way: the page then RESUMEs
RETRY_CUTS = {  # as tests/services/test_retry_semantics.py: every frame of an image, each direction
    "HELLO": [("up", "HELLO", 1)], "WELCOME": [("down", "WELCOME", 1)],
    "OPEN": [("up", "OPEN", 1)], "OPEN_REPLY": [("down", "OPEN_REPLY", 1)],
    "VERIFY": [("up", "VERIFY", 2)], "VERIFY_REPLY": [("down", "VERIFY_REPLY", 2)],
    "RESUME": [VERIFY_LOST, ("up", "RESUME", 1)], "RESUME_REPLY": [VERIFY_LOST, ("down", "OPEN_REPLY", 2)],
    "CLOSE": [("up", "CLOSE", 1)], "CLOSED": [("down", "CLOSED", 1)],
}


@pytest.fixture(scope="module")
def retry_plain(node, server, onnx_dir):
    job = [{"prompt": _prompts(1, 32)[0], "seed": 6, "session_id": "web-retry"}]
    return job, _run(node, server, onnx_dir, job, options=FIXED)["results"][0]


@pytest.mark.parametrize("mode", ["deliver", "drop"])
@pytest.mark.parametrize("frame", list(RETRY_CUTS))
def test_every_message_is_retried_safely_by_the_browsers_connection(node, server, onnx_dir, retry_plain, frame,
                                                                    mode):
    """docs/architecture.md §5's retry semantics, for web/src/connection.js: a real socket cut at one frame, relayed
    or not (services.testing.CuttingProxy); the same image as without the cut, and nothing left held afterwards."""
    import time

    from ciar_device import wire
    from services.testing import CuttingProxy

    job, plain = retry_plain
    asked = [(r[0], getattr(wire, r[1]), r[2], r[3] if len(r) == 4 else mode) for r in RETRY_CUTS[frame]]
    with CuttingProxy(server, asked) as proxy:
        out = _run(node, proxy.url, onnx_dir, job, options=FIXED)
    r = out["results"][0]
    assert proxy.fired == asked, (proxy.fired, proxy.frames)
    assert "error" not in r, r
    assert r["tokens"] == plain["tokens"] and r["who"] == plain["who"] and not r["stats"]["degraded"]
    deadline = time.monotonic() + 5.0
    while SERVED["verifier"].num_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert SERVED["verifier"].num_sessions == 0
    assert sum(dev.live(1e9) for dev in SERVED["endpoint"].devices.values()) == 0


def test_an_unreachable_cloud_ends_in_a_degraded_image(node, server, onnx_dir):
    r = _run(node, server, onnx_dir, [{"prompt": _prompts(1, 31)[0], "seed": 1}], options=FIXED,
             vanish_after=2)["results"][0]
    assert "error" not in r, r
    st = r["stats"]
    assert len(r["tokens"]) == 144 and st["degraded"] == 1 and st["verifications"] == 2
    assert st["degraded_tokens"] > 0 and st["device_tokens"] + st["cloud_tokens"] == 144


def test_the_threshold_decides_what_is_sent(node, server, onnx_dir):
    prompt = _prompts(1, 32)[0]
    jobs = [{"prompt": prompt, "seed": 2}]
    never = _run(node, server, onnx_dir, jobs, options={"tau": 1e9, **FIXED})["results"][0]["stats"]
    always = _run(node, server, onnx_dir, jobs, options={"tau": -1.0, **FIXED})["results"][0]["stats"]
    assert never["verifications"] == 0 and never["device_tokens"] == 144 - never["prefix_tokens"]
    assert always["device_tokens"] == 0 and always["verifications"] > 0
    assert always["cloud_call_rate"] == 1.0


def test_adaptive_reports_its_point_and_estimates_and_the_point_remakes_the_image(node, server, onnx_dir):
    """The browser device runs the adaptive policy by default: before its first image it knows the link from its
    handshake, its step from one timed step and the verifier's costs from the WELCOME (the verifier has served an
    image by then: the endpoint asks it for a hint at each HELLO until it has one); one observer is kept across the
    connection's images; the same job with the reported point as fixed knobs (the whole image on the cloud when it
    was handed over) makes the same tokens, drafted or handed over."""
    with open(os.path.join(onnx_dir, "manifest.json"), encoding="utf-8") as f:
        calibrated = json.load(f)["ciar_defaults"]
    _run(node, server, onnx_dir, [{"prompt": _prompts(1, 39)[0], "seed": 9}], options=FIXED)  # served an image
    jobs = [{"prompt": p, "seed": 30 + i, "session_id": f"web-adaptive-{i}"} for i, p in enumerate(_prompts(3, 40))]
    # the last at a price on cloud steps that no device here makes worth handing 144 cloud steps over for: whatever
    # the costs choose for the others (cloud-only where the device's step is slow), it drafts
    jobs[2]["options"] = {"cloudStepPriceS": 0.1}
    out = _run(node, server, onnx_dir, jobs)
    obs = out["observer"]
    assert out["handshake_s"] > 0 and obs["primed"] and obs["ready"] and obs["link_samples"] >= 2
    again = []
    for i, (job, r) in enumerate(zip(jobs, out["results"])):
        assert "error" not in r, r
        st = r["stats"]
        assert len(r["tokens"]) == st["total_tokens"] == 144 and st["handovers"] in (0, 1)
        # primed before the first image: the hint (no reply seen yet), the handshake, the timed step; later images
        # read the link's fit, whose latency on loopback may come out at 0
        assert st["est_device_step_s"] > 0 and st["est_cloud_step_s"] > 0
        assert st["est_link_latency_s"] > 0 if i == 0 else st["est_link_latency_s"] >= 0
        if st["handovers"]:  # cloud-only: one open for every token, nothing made or run on the device
            assert st["prefix_tokens"] == 144 and st["cloud_requests"] == 1 and st["device_forward_passes"] == 0
            fixed = {"prefixRate": 1}
        else:
            assert st["span_used"] >= calibrated["span"] and st["burst_used"] >= calibrated["burst"]
            point = (st["span_used"], st["burst_used"])
            assert st["adapted"] == int(point != (calibrated["span"], calibrated["burst"]))
            fixed = {"span": st["span_used"], "burst": st["burst_used"]}
        again.append({**job, "session_id": job["session_id"] + "-fixed", "options": {**FIXED, **fixed}})
    assert out["results"][2]["stats"]["handovers"] == 0
    remade = _run(node, server, onnx_dir, again)
    for r, a in zip(out["results"], remade["results"]):
        assert "error" not in a, a
        assert a["tokens"] == r["tokens"] and a["who"] == r["who"]
        if not r["stats"]["handovers"]:
            assert (a["stats"]["span_used"], a["stats"]["burst_used"]) == (r["stats"]["span_used"],
                                                                           r["stats"]["burst_used"])


def test_a_wrong_key_is_refused(node, server, onnx_dir):
    # the adaptive default asks for the WELCOME's hint before the open: the refusal comes from there
    out = node("generate", {"url": server, "key": "not-a-device-key", "model_dir": onnx_dir,
                            "jobs": [{"prompt": "a red circle", "seed": 0}]})
    r = out["results"][0]
    assert r["error"].startswith("ConnectionRefused") and r["code"] == 4001 and "unknown device key" in r["error"]
