"""The page's CIAR loop (web/src: loop.js, connection.js, runtime.js on onnxruntime-web) run under node against a
real device endpoint on loopback (the torch CloudVerifier behind services.device_endpoint): images complete with
consistent stats and bytes as the socket carried them, a reply lost in flight is resumed to the same image, an
unreachable cloud ends in a degraded image, the gate's threshold decides what is sent, a wrong key is refused.
(The page itself, in chromium against the Serve application: tests/services/test_api.py.)"""

import pytest

KEY, SECRET = "web-loop-key", "web-loop-secret"


@pytest.fixture(scope="module")
def server():
    from ciar.collab.runtime import make_verifier
    from ciar.world import load_world
    from services.device_endpoint import DeviceEndpoint
    from services.schemas import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    verifier = make_verifier(load_world(None))
    with loopback_endpoint(DeviceEndpoint(InProcessBackend(verifier, SECRET), [key_digest(KEY)])) as url:
        yield url


def _prompts(n, start=20):
    from ciar.data.scenes import scene_at

    return [scene_at("val", start + i).caption for i in range(n)]


def _run(node, server, onnx_dir, jobs, **extra):
    return node("generate", {"url": server, "key": KEY, "model_dir": onnx_dir, "jobs": jobs, **extra})


def test_images_complete_with_consistent_stats(node, server, onnx_dir):
    jobs = [{"prompt": p, "seed": i, "session_id": f"web-{i}"} for i, p in enumerate(_prompts(3))]
    out = _run(node, server, onnx_dir, jobs)
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
        n_verify += st["verifications"]
    ex = out["exchanges"]
    # bytes as the socket carried them: the stats add up the OPEN and VERIFY frames (CLOSE is not charged)
    charged = [e for e in ex if e["kind"] in ("OPEN", "VERIFY")]
    assert [e["kind"] for e in ex].count("VERIFY") == n_verify and len(charged) == n_verify + 3
    assert sum(r["stats"]["bytes_up"] for r in out["results"]) == sum(e["up"] for e in charged)
    assert sum(r["stats"]["bytes_down"] for r in out["results"]) == sum(e["down"] for e in charged)
    assert out["reconnects"] == 0 and out["resumes"] == 0


def test_a_reply_lost_in_flight_is_resumed_to_the_same_image(node, server, onnx_dir):
    job = [{"prompt": _prompts(1, 30)[0], "seed": 4, "session_id": "web-cut"}]
    plain = _run(node, server, onnx_dir, job)["results"][0]
    cut = _run(node, server, onnx_dir, job, cuts=[2, 4])
    r = cut["results"][0]
    assert "error" not in r, r
    assert r["tokens"] == plain["tokens"] and r["who"] == plain["who"]
    assert cut["resumes"] == 2 and cut["reconnects"] == 2 and r["stats"]["resumes"] == 2
    assert [e["kind"] for e in cut["exchanges"]].count("RESUME") == 2


def test_an_unreachable_cloud_ends_in_a_degraded_image(node, server, onnx_dir):
    r = _run(node, server, onnx_dir, [{"prompt": _prompts(1, 31)[0], "seed": 1}], vanish_after=2)["results"][0]
    assert "error" not in r, r
    st = r["stats"]
    assert len(r["tokens"]) == 144 and st["degraded"] == 1 and st["verifications"] == 2
    assert st["degraded_tokens"] > 0 and st["device_tokens"] + st["cloud_tokens"] == 144


def test_the_threshold_decides_what_is_sent(node, server, onnx_dir):
    prompt = _prompts(1, 32)[0]
    jobs = [{"prompt": prompt, "seed": 2}]
    never = _run(node, server, onnx_dir, jobs, options={"tau": 1e9})["results"][0]["stats"]
    always = _run(node, server, onnx_dir, jobs, options={"tau": -1.0})["results"][0]["stats"]
    assert never["verifications"] == 0 and never["device_tokens"] == 144 - never["prefix_tokens"]
    assert always["device_tokens"] == 0 and always["verifications"] > 0
    assert always["cloud_call_rate"] == 1.0


def test_a_wrong_key_is_refused(node, server, onnx_dir):
    out = node("generate", {"url": server, "key": "not-a-device-key", "model_dir": onnx_dir,
                            "jobs": [{"prompt": "a red circle", "seed": 0}]})
    r = out["results"][0]
    assert r["error"].startswith("ConnectionRefused") and r["code"] == 4001 and "unknown device key" in r["error"]
