"""The device-channel fuzz (loadtests.device_fuzz) against the device endpoint served on loopback
(services.testing.loopback_endpoint, an in-process verifier on the small random models), with torch witnesses: the
whole run once (few examples), then what each probe was answered; the answer oracle on fixed frames; and a broken
backend is reported, not passed."""

import struct

import pytest
import torch

from ciar_device import wire
from ciar_device.wire import CLOSE, HELLO, OPEN, CloseRequest, Frame, Hello, OpenRequest, Sampling
from loadtests.device_fuzz import FRAME_KINDS, DeviceFuzzer, Target, Witnesses, expected_answers

KEYS = ("fuzz-device-key-a", "fuzz-device-key-b")
LIMIT = 64 << 10


def _endpoint(backend, **kw):
    from services.device_endpoint import DeviceEndpoint
    from services.endpoint_limits import EndpointLimits
    from services.config import key_digest

    limits = dict(max_frame_bytes=LIMIT, max_sessions_per_device=3, messages_per_s=5000, burst=5000,
                  idle_timeout_s=30.0, max_connections=12, max_connections_per_device=4, send_timeout_s=0.3)
    return DeviceEndpoint(backend, [key_digest(k) for k in KEYS], EndpointLimits(**{**limits, **kw}))


def _target(url, endpoint, verifier=None):
    lim = endpoint.limits
    return Target(url, KEYS, max_connections=lim.max_connections,
                  max_connections_per_device=lim.max_connections_per_device, send_timeout_s=lim.send_timeout_s,
                  timeout_s=10.0, verifier_sessions=(lambda: verifier.num_sessions) if verifier else None,
                  endpoint_connections=lambda key: _connections(endpoint, key))


def _connections(endpoint, key):
    """The endpoint's connections in all (key None), or the device of `key`'s (its own count, in-process)."""
    from services.device_endpoint import device_id_of
    from services.config import key_digest

    if key is None:
        return endpoint.connections
    device = endpoint.devices.get(device_id_of(key_digest(key)))
    return device.connections if device is not None else 0


@pytest.fixture(scope="module")
def witnesses(tiny_device, median_tau):
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.decoding.sampling import SamplingParams

    # the calibrated point: under the fuzz the adaptive policy would choose from the costs it inflates, and a
    # witness checks the channel, not the policy (as loadtests.device_fuzz.onnx_witnesses)
    cfg = method_config("ciar", tau=median_tau, gate="interval", burst=2, network="none", policy="fixed")

    def image(conn, prompt, seed, sid):
        dec = CollabDecoder(tiny_device, conn, cfg, SamplingParams(cfg_scale=2.0), num_tokens=36)
        return dec.generate(prompt, seed=seed, session_id=sid).tokens.numpy()

    return Witnesses(image, 64, array=torch.from_numpy)


@pytest.fixture(scope="module")
def fuzzed(tiny_cloud, stub_text, witnesses):
    """One fuzz run: -> (report, endpoint, fuzzer)."""
    from ciar.engine.verifier import CloudVerifier
    from services.testing import InProcessBackend, loopback_endpoint

    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=16)
    endpoint = _endpoint(InProcessBackend(verifier))
    # small buffers: a slow reader blocks sends soon; a 2 s close timeout: the dropped reader's connection ends (the
    # server's closing handshake, unanswered, then a reset) within ~6 s of the drop, far inside the probe's window
    with loopback_endpoint(endpoint, sndbuf=16 << 10, close_timeout_s=2.0) as url:
        fuzzer = DeviceFuzzer(_target(url, endpoint, verifier), witnesses, seed=1)
        report = fuzzer.run(frames=160, sessions_tried=40, connections_extra=4, witness_images=2)
    return report, endpoint, fuzzer


def test_run_has_no_failures_and_identical_witnesses(fuzzed):
    report, endpoint, fuzzer = fuzzed
    assert report["failure_count"] == 0, report["failures"]
    assert report["ok"] and report["healthy"]["ok"]
    w = report["witnesses"]
    assert w["identical"] and w["identical_after"] and w["images_during"] >= 2 and w["mismatches_during"] == 0
    assert w["reconnects"] == 0 and w["resumes"] == 0
    assert set(FRAME_KINDS) <= set(report["by_kind"]) and report["frames"] >= 160
    # every close code / status the channel defines for these frames was seen, and no server error
    for key in ("close:4000", "close:4002", "close:1009", "close:1013", "close:1008", "error:400", "error:403",
                "error:410", "error:422", "error:429", "reply:OPEN_REPLY", "reply:VERIFY_REPLY", "reply:CLOSED"):
        assert report["answers"].get(key, 0) > 0, key
    assert not [k for k in report["answers"] if k.startswith("error:5") and k != "error:503"]
    assert "close:1011" not in report["answers"] and "timeout" not in report["answers"]
    # the secrets to look for in logs: both keys and the tokens issued (the witnesses' too)
    assert set(KEYS) <= set(fuzzer.secrets()) and len(fuzzer.tokens_seen) > 10
    assert report["probes"]["verifier_sessions"] == {"before": 0, "after": 0}


def test_endpoint_state_is_clean_after_the_run(fuzzed):
    _, endpoint, _ = fuzzed
    import time

    deadline = time.monotonic() + 60  # a hang guard: the server lets go of the run's last connections
    while endpoint.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert endpoint.connections == 0
    assert all(d.connections == 0 for d in endpoint.devices.values())  # no connection leaked by a vanished HELLO
    assert all(not d.sessions for d in endpoint.devices.values())  # no session counted that is not open
    assert endpoint.counts.get("close:1008", 0) >= 2  # the slow reader and the connection over the device's limit
    # the server's own view, replies the fuzz never read included: no server error, no internal-error close
    assert not [k for k in endpoint.counts if k.startswith("error:5") and k != "error:503"], endpoint.counts
    assert "close:1011" not in endpoint.counts and "close:1001" not in endpoint.counts


def test_out_of_order_frames(fuzzed):
    order = fuzzed[0]["probes"]["order"]
    assert order == {"OPEN before HELLO": "close:4000", "VERIFY before HELLO": "close:4000",
                     "CLOSE before HELLO": "close:4000", "HELLO twice": "error:400",
                     "VERIFY of a session never opened": "error:403", "RESUME of a session never opened": "error:403",
                     "CLOSE of a session never opened": "error:403", "OPEN twice": "reply:OPEN_REPLY",
                     "OPEN of an open id with another request": "error:409",
                     "VERIFY after OPEN twice": "reply:VERIFY_REPLY", "VERIFY after CLOSE": "error:410",
                     "CLOSE after CLOSE": "reply:CLOSED"}


def test_wrong_replayed_and_foreign_tokens(fuzzed):
    tokens = fuzzed[0]["probes"]["tokens"]
    for what in ("a random token", "an all-zero token", "the token of another session"):
        assert tokens[f"VERIFY with {what}"] == tokens[f"CLOSE with {what}"] == "error:403"
    for verb in ("VERIFY", "RESUME", "CLOSE"):  # another device's session: refused, and told nothing about it
        assert tokens[f"B: {verb} of A's session with A's token"] == "error:403"
    assert tokens["A: VERIFY after B's attempts"] == "reply:VERIFY_REPLY"
    assert tokens["VERIFY with a closed session's token"] == "error:403"
    assert tokens["VERIFY of the closed session, its token replayed"] == "error:410"


def test_hundreds_of_sessions_hit_the_device_limit(fuzzed):
    s = fuzzed[0]["probes"]["sessions"]
    assert s["max_sessions"] == 3
    for variant in ("plain", "each id twice", "after VERIFYs of sessions never opened"):
        assert s[variant]["opened"] == 3, variant
    assert s["plain"]["refused"] == {"429 session_id": 37}
    assert s["reopened_after_close"] == 3


def test_frame_limits_and_text_frames(fuzzed):
    assert fuzzed[0]["probes"]["frame_limits"] == {
        "over the frame limit": "close:1009", "exactly at the frame limit": "error:400",
        "an empty binary frame": "close:4000", "a text frame": "close:4000",
        "a text frame that holds a valid frame's bytes": "close:4000", "an empty binary frame before HELLO":
        "close:4000", "a text frame before HELLO": "close:4000", "a frame over the limit before HELLO": "close:1009"}


def test_slow_reader_is_dropped_and_others_are_served(fuzzed):
    slow = fuzzed[0]["probes"]["slow_reader"]
    assert slow["ended_by"] in ("close:1008", "close:1006") and slow["sent"] > 0
    assert slow["other_connection_s"]  # another connection was answered while the reader was stuck


def test_connection_limits(fuzzed):
    c = fuzzed[0]["probes"]["connections"]
    assert c["tried"] == 16 and c["held"] <= 12 and c["refused_1013"] >= 4 and not c["other"]
    assert all("retry after" in r for r in c["refusal_reasons"])
    assert c["meanwhile"]["new connection"] in ("reply:WELCOME", "close:1013") and c["after"] == "WELCOME"
    d = fuzzed[0]["probes"]["device_connections"]
    assert d["one over the limit"] == "close:1008" and d["held"] == 4
    assert d["vanished_after_hello"] == 9 and d["after"] == "reply:WELCOME"


def test_expected_answers_oracle():
    ok = wire.encode_frame(Frame(CLOSE, 5, CloseRequest("s"), bytes(32)))
    assert expected_answers("text", LIMIT) == ("close:4000",)
    assert expected_answers(b"CI" + bytes(LIMIT), LIMIT) == ("close:1009",)
    assert expected_answers(ok[:7], LIMIT) == ("close:4000",)
    assert expected_answers(b"XX" + ok[2:], LIMIT) == ("close:4000",)
    assert expected_answers(ok[:2] + bytes([wire.PROTOCOL_VERSION + 1]) + ok[3:], LIMIT) == ("close:4002",)
    assert expected_answers(ok[:3] + b"\xc8" + ok[4:], LIMIT) == ("error:400",)
    assert expected_answers(ok, LIMIT)[0] == "reply:CLOSED" and "error:403" in expected_answers(ok, LIMIT)
    assert "reply:OPEN_REPLY" in expected_answers(
        wire.encode_frame(Frame(OPEN, 1, OpenRequest("s", "p", 0, Sampling(), 1))), LIMIT)
    hello = wire.encode_frame(Frame(HELLO, 0, Hello("k")))
    assert set(expected_answers(hello, LIMIT, hello_done=False)) == {"close:4000", "close:4001", "reply:WELCOME"}
    assert expected_answers(hello, LIMIT) == ("error:400", "error:422")
    assert struct.unpack_from("<I", ok, 4)[0] == 5


def test_a_broken_backend_is_reported(tiny_cloud, stub_text):
    """A backend whose close raises a bug: the fuzz lists the 500s as failures (it does not pass a broken server)."""
    from ciar.engine.verifier import CloudVerifier
    from services.testing import InProcessBackend, loopback_endpoint

    class Broken(InProcessBackend):
        async def close(self, *, session_id, device_id, token):
            raise RuntimeError("a bug")

    endpoint = _endpoint(Broken(CloudVerifier(tiny_cloud, stub_text, max_sessions=4)))
    with loopback_endpoint(endpoint) as url:
        fuzzer = DeviceFuzzer(_target(url, endpoint))
        fuzzer.setup()  # its own session cannot be closed: a failure already
        fuzzer.probe_order()
    problems = [f["problem"] for f in fuzzer.failures]
    assert fuzzer.failure_count >= 3 and "server error 500" in problems
    assert fuzzer.probes["order"]["CLOSE of a session never opened"] == "error:500"
    assert {f["kind"] for f in fuzzer.failures} == {"setup", "order"}


def test_cli_refuses_a_device_run_it_cannot_do(capsys):
    from loadtests.fuzz import device_target, main

    with pytest.raises(SystemExit) as e:
        main(["--device-frames", "5", "--onnx-dir", "/nonexistent"])
    assert e.value.code == 2 and "python -m pipelines.export_onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--host", "http://127.0.0.1:1", "--device-frames", "5", "--device-key", "only-one"])
    assert e.value.code == 2 and "two device keys" in capsys.readouterr().err
    t = device_target("http://127.0.0.1:8000", ["a", "b"], None, 5.0)  # a running cluster: the default limits
    assert t.ws_url == "ws://127.0.0.1:8000/v1/device/sessions" and t.health_url == "http://127.0.0.1:8000/healthz"
    from services.config import DeviceEndpointConfig

    d = DeviceEndpointConfig()
    assert (t.max_connections, t.max_connections_per_device, t.send_timeout_s) == \
        (d.max_connections, d.max_connections_per_device, d.send_timeout_s) == (192, 16, 10.0)
    assert t.verifier_sessions is None and t.server_memory is None
