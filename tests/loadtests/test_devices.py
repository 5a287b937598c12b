"""loadtests.devices: the summary arithmetic on fixed records (the model's price, percentiles, the message table,
batch sizes), two real client processes for one image each against the loopback device endpoint (an in-process
verifier of the shipped world, no Ray): records that add up to the loop's own stats, the summary and the codec
benchmark on the frames they carried; and a client the parent has to stop at its deadline."""

import json
import socket

import pytest

from loadtests import devices

KEY, SECRET = "device-load-test-key", "device-load-test-secret"


# ---------------------------------------------------------------------------------------------------- arithmetic
def _ex(kind, up, down, s, cloud=None, batch=None):
    return {"kind": kind, "up": up, "down": down, "s": s, "cloud_s": cloud, "batch_size": batch,
            "reply": {"OPEN": "OPEN_REPLY", "VERIFY": "VERIFY_REPLY", "CLOSE": "CLOSED"}[kind]}


def _record(client, t_start, latency, device_s, exchanges, ok=True):
    stats = {"device_s": device_s, "cloud_requests": sum(e["kind"] != "CLOSE" for e in exchanges),
             "cloud_call_rate": 0.25, "device_ms_per_token": 1000 * device_s / 144} if ok else None
    return {"client": client, "image": 0, "t_start": t_start, "latency_s": latency, "ok": ok,
            "error": None if ok else "ConnectionError: lost", "stats": stats, "exchanges": exchanges,
            "resumes": 0, "reconnects": 0}


def test_summary_arithmetic():
    a = _record(0, 100.0, 1.0, 0.4, [_ex("OPEN", 150, 30000, 0.20, 0.15), _ex("VERIFY", 4000, 54, 0.10, 0.05, 1),
                                     _ex("VERIFY", 6000, 54, 0.10, 0.06, 3), _ex("CLOSE", 56, 24, 0.01)])
    b = _record(1, 100.5, 2.0, 0.5, [_ex("OPEN", 150, 30000, 0.30, 0.20), _ex("VERIFY", 5000, 54, 0.20, 0.10, 3),
                                     _ex("CLOSE", 56, 24, 0.02)])
    bad = _record(1, 102.5, 0.5, 0.0, [], ok=False)
    s = devices.summarise([a, b, bad], network="5g", profiles=("none", "5g"))
    assert (s["devices"], s["images"], s["failures"], s["errors"]) == (2, 2, 1, ["ConnectionError"])
    assert s["window_s"] == pytest.approx(3.0)  # first start 100.0, last end 102.5 + 0.5
    assert s["images_per_s"] == pytest.approx(2 / 3.0)
    assert s["latency_ms"]["p50"] == pytest.approx(1000.0) and s["latency_ms"]["p99"] == pytest.approx(2000.0)
    assert s["latency_ms"]["mean"] == pytest.approx(1500.0)
    per = s["per_image"]
    assert per["cloud_s"] == pytest.approx((0.26 + 0.30) / 2) and per["wire_s"] == pytest.approx((0.41 + 0.52) / 2)
    assert per["rtt_minus_cloud_s"] == pytest.approx(per["wire_s"] - per["cloud_s"])
    assert per["client_other_s"] == pytest.approx(1.5 - 0.45 - per["wire_s"])
    assert per["exchanges"] == 3.5 and per["bytes_up"] == pytest.approx((10206 + 5206) / 2)
    # the ideal link: device + reported cloud; 5g: + per exchange 2 x 10 ms + (up + down) bytes at 300 Mbit/s
    none, g5 = s["model"]["none"], s["model"]["5g"]
    assert none["predicted_s"]["mean"] == pytest.approx((0.4 + 0.26 + 0.5 + 0.30) / 2) and none["link_s"] == 0
    rtt = (4 + 3) / 2 * 0.020  # mean exchanges per image x two transmissions x 10 ms
    bytes_a, bytes_b = 30150 + 4054 + 6054 + 80, 30150 + 5054 + 80
    bw = (bytes_a + bytes_b) / 2 * 8 / 300e6
    assert g5["rtt_s"] == pytest.approx(rtt) and g5["bandwidth_s"] == pytest.approx(bw)
    assert g5["link_s"] == pytest.approx(rtt + bw) and g5["bandwidth_share"] == pytest.approx(bw / (rtt + bw))
    assert g5["predicted_s"]["mean"] == pytest.approx(none["predicted_s"]["mean"] + rtt + bw)
    assert g5["measured_over_predicted"] == pytest.approx(1.5 / g5["predicted_s"]["mean"])
    assert s["loopback_gap_s"] == pytest.approx(1.5 - none["predicted_s"]["mean"])
    m = s["messages"]
    assert set(m) == {"OPEN", "VERIFY", "CLOSE"} and m["VERIFY"]["count"] == 3 and m["VERIFY"]["per_image"] == 1.5
    assert m["VERIFY"]["up_bytes"] == 5000 and m["VERIFY"]["cloud_ms"] == pytest.approx(70.0)
    assert m["VERIFY"]["rtt_minus_cloud_ms"]["p50"] == pytest.approx(50.0)  # 50, 40, 100 ms
    assert m["VERIFY"]["ws_header_up"] == 2 + 2 + 4 and m["OPEN"]["ws_header_down"] == 2 + 2  # masked uplink
    assert m["CLOSE"]["cloud_ms"] == 0 and m["CLOSE"]["ws_header_up"] == 2 + 4
    # two 8-byte frame headers + the WebSocket headers (6 up, 2 down) of 56 + 24 bytes of frames
    assert m["CLOSE"]["framing_share"] == pytest.approx((16 + 8) / (80 + 8))
    assert s["batch_size_seen"] == {"hist": {"1": 1, "3": 2}, "mean": pytest.approx(7 / 3)}
    assert devices.ws_header_bytes(70000, False) == 10 and devices.summarise([])["images"] == 0


def test_prompts_are_held_out_distinct_and_seeded():
    from ciar.data.scenes import scene_at

    plan = devices.plan_prompts(3, 2, seed=1)
    flat = [p for c in plan for p in c]
    assert [p["index"] for p in flat] == list(range(6)) and len({p["prompt"] for p in flat}) == 6
    assert flat[4] == {"index": 4, "prompt": scene_at("heldout", 4, 1).caption, "seed": 1000003 + 4}


def test_serve_latency_from_prometheus_text():
    text = ('ray_serve_deployment_processing_latency_ms_sum{application="ciar",deployment="Verifier",route="verify"}'
            ' 300.0\n'
            'ray_serve_deployment_processing_latency_ms_count{application="ciar",deployment="Verifier",route="verify"}'
            ' 6.0\n'
            'ray_serve_deployment_processing_latency_ms_count{application="ciar",deployment="Device",route="x"} 9.0\n')
    assert devices.serve_latency(text) == {"verify": {"count": 6, "mean_ms": 50.0}}


# ---------------------------------------------------------------------------------------------------- real clients
@pytest.fixture(scope="module")
def endpoint():
    from ciar.sim.runtime import make_verifier
    from ciar.world import load_world
    from services.device_endpoint import DeviceEndpoint
    from services.config import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    backend = InProcessBackend(make_verifier(load_world(None)), SECRET)
    with loopback_endpoint(DeviceEndpoint(backend, [key_digest(KEY)])) as url:
        yield url, backend


def test_two_client_processes_records_and_summary(endpoint, onnx_dir, tmp_path):
    from ciar_device import wire

    url, backend = endpoint
    cfg = devices.ClientsConfig(url, clients=2, images=1, duration_s=120, out=str(tmp_path), key=KEY,
                                model_dir=onnx_dir, grace_s=120, sample_frames=4)
    clients = devices.DeviceClients(cfg)
    clients.start()
    assert clients.wait() == [0, 0] and clients.stopped == []
    recs = sorted(clients.records(), key=lambda r: r["client"])
    assert [(r["client"], r["index"], r["seed"]) for r in recs] == [(0, 0, 0), (1, 1, 1)]
    for r in recs:
        assert r["ok"] and r["error"] is None and r["resumes"] == 0, r["error"]
        st, ex = r["stats"], r["exchanges"]
        kinds = [e["kind"] for e in ex]
        assert kinds[0] == "OPEN" and kinds[-1] == "CLOSE" and set(kinds[1:-1]) <= {"VERIFY"}
        charged = ex[:-1]  # the loop does not charge the close
        assert len(charged) == st["cloud_requests"] == st["verifications"] + 1
        assert sum(e["up"] for e in charged) == st["bytes_up"] and sum(e["down"] for e in charged) == st["bytes_down"]
        assert sum(e["cloud_s"] for e in charged) == pytest.approx(st["cloud_s"])
        # the endpoint's engine batches whatever is waiting when it steps: the other client's span, or not
        assert all(1 <= e["batch_size"] <= 2 for e in ex if e["kind"] == "VERIFY")
        assert sum(e["s"] for e in ex) + st["device_s"] <= r["latency_s"]
        assert st["total_tokens"] == 144
    s = devices.report(clients, network="5g")
    assert (s["devices"], s["images"], s["failures"]) == (2, 2, 0) and s["exit_codes"] == [0, 0]
    n_verify = sum(r["stats"]["verifications"] for r in recs)
    assert s["messages"]["VERIFY"]["count"] == n_verify and s["messages"]["OPEN"]["count"] == 2
    assert sum(s["batch_size_seen"]["hist"].values()) == n_verify
    assert s["model"]["none"]["predicted_s"]["mean"] == pytest.approx(
        sum(r["stats"]["device_s"] + r["stats"]["cloud_s"] for r in recs) / 2)
    codec = s["codec"]
    assert {"OPEN", "OPEN_REPLY", "VERIFY", "VERIFY_REPLY", "CLOSE", "CLOSED"} <= set(codec)
    assert codec["VERIFY"]["bytes"] == codec["VERIFY"]["body_bytes"] + wire.HEADER_BYTES
    for frame in clients.frames()["VERIFY"]:  # the kept frames are the ones sent: they round-trip exactly
        assert wire.encode_frame(wire.decode_frame(frame)) == frame
    assert json.loads(json.dumps(s)) == s


def test_a_client_past_its_deadline_is_stopped_by_pid(onnx_dir, tmp_path):
    with socket.socket() as server:  # listens, never answers the WebSocket handshake
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"ws://127.0.0.1:{server.getsockname()[1]}"
        cfg = devices.ClientsConfig(url, clients=1, images=2, duration_s=3.0, out=str(tmp_path), key=KEY,
                                    model_dir=onnx_dir, grace_s=1.0, reply_timeout_s=5.0)
        clients = devices.DeviceClients(cfg)
        clients.start()
        codes = clients.wait()
    assert clients.stopped == [0] and codes[0] is not None and codes[0] < 0  # ended by a signal
    assert clients.records() == []
    assert devices.summarise(clients.records())["images"] == 0


def test_transport_split_only_when_the_calls_are_the_exchanges():
    recs = [_record(0, 0.0, 1.0, 0.4, [_ex("OPEN", 150, 30000, 0.20, 0.15), _ex("VERIFY", 4000, 54, 0.10, 0.05, 1),
                                       _ex("CLOSE", 56, 24, 0.03)])]
    t = devices.transport_split(recs, {"/": {"count": 3, "mean_ms": 80.0}, "/v1/images/generations": {"count": 9}})
    assert t["client_rtt_ms"] == pytest.approx(110.0) and t["cloud_ms"] == pytest.approx(200 / 3)
    assert t["verifier_queue_ms"] == pytest.approx(80.0 - 200 / 3) and t["transport_ms"] == pytest.approx(30.0)
    assert t["client_rtt_ms"] == pytest.approx(t["cloud_ms"] + t["verifier_queue_ms"] + t["transport_ms"])
    other = devices.transport_split(recs, {"/": {"count": 7, "mean_ms": 80.0}})
    assert "note" in other and "transport_ms" not in other
    assert "note" in devices.transport_split(recs, {})
