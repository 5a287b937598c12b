"""The device endpoint (services.device_endpoint) over real sockets, without Ray: a uvicorn server on loopback
serving the endpoint against an in-process verifier (services.testing.InProcessBackend: a test double of the Verifier
deployment with its session tokens), and `ciar_device.connection.DeviceConnection` as the device. The Serve
application's route is tested in tests/services/test_app.py."""

import numpy as np
import pytest
import torch

from ciar.testing import cutting_connection
from ciar_device import wire
from ciar_device.connection import ConnectionRefused, DeviceConnection, ServerError
from ciar_device.wire import CLOSE, HELLO, VERIFY, CloseRequest, Frame, Hello, OpenRequest, Sampling

KEY, OTHER_KEY = "device-key-one", "device-key-two"
SECRET = "test-secret"


@pytest.fixture(scope="module")
def server(tiny_cloud, stub_text):
    from ciar.engine.verifier import CloudVerifier
    from services.device_endpoint import DeviceEndpoint
    from services.endpoint_limits import EndpointLimits
    from services.config import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    backend = InProcessBackend(CloudVerifier(tiny_cloud, stub_text, max_sessions=8), SECRET)
    endpoint = DeviceEndpoint(backend, [key_digest(KEY), key_digest(OTHER_KEY)],
                              EndpointLimits(max_frame_bytes=64 << 10, max_sessions_per_device=3, messages_per_s=50,
                                             burst=60, idle_timeout_s=5.0))
    with loopback_endpoint(endpoint) as url:
        yield url, endpoint, backend


def _conn(url, key=KEY, **kw):
    return DeviceConnection(url, key, vocab_size=64, array=torch.from_numpy, **kw)


def _generate(client, tiny_device, median_tau, seed=3):
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.decoding.sampling import SamplingParams

    cfg = method_config("ciar", tau=median_tau, gate="interval", burst=2, network="none", policy="fixed")
    dec = CollabDecoder(tiny_device, client, cfg, SamplingParams(cfg_scale=2.0), num_tokens=36)
    return dec.generate("a red circle", seed=seed, session_id=f"img-{seed}", trace=True)


@pytest.fixture(scope="module")
def reference(tiny_cloud, tiny_device, stub_text, median_tau):
    from ciar.engine.verifier import CloudVerifier, InProcessCloud

    return _generate(InProcessCloud(CloudVerifier(tiny_cloud, stub_text, max_sessions=4)), tiny_device, median_tau)


def test_generation_over_the_socket_equals_in_process(server, reference, tiny_device, median_tau):
    url, endpoint, _ = server
    conn = _conn(url)
    out = _generate(conn, tiny_device, median_tau)
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace
    assert (out.stats.bytes_up, out.stats.bytes_down) == (reference.stats.bytes_up, reference.stats.bytes_down)
    # every exchange's real frames are the sizes the decoder charged (the close is not charged)
    sent = [e for e in conn.exchanges if e.kind != "CLOSE"]
    assert sum(e.up_bytes for e in sent) == out.stats.bytes_up and sum(e.down_bytes for e in sent) == \
        out.stats.bytes_down
    assert conn.reconnects == 0 and conn.resumes == 0 and not conn.sessions
    conn.disconnect()


def test_welcome_carries_the_verifiers_recent_costs_once_it_has_served(server, tiny_device, median_tau,
                                                                       monkeypatch):
    """WELCOME's cost hint (protocol v3): the verifier's running span forward, sampled step and queue wait over its
    replies, which the device's adaptive policy starts from; the connection times its handshake. (The endpoint asks
    the verifier at most once per HINT_TTL_S: 0 here, so the hint is the verifier's latest.)"""
    url, endpoint, backend = server
    monkeypatch.setattr(endpoint, "HINT_TTL_S", 0.0)
    conn = _conn(url)
    for seed in range(11, 17):  # until a span was accepted whole: its one-forward reply is the span's cost
        _generate(conn, tiny_device, median_tau, seed=seed)  # verified spans (and bursts after rejections)
        if backend.v.cost_hint() is not None:
            break
    conn.disconnect()
    hint = conn.cost_hint()  # a new connection, a new WELCOME
    want = backend.v.cost_hint()
    assert hint is not None and hint.span_s == pytest.approx(want.span_s) and hint.span_s > 0
    assert hint.step_s == pytest.approx(want.step_s) and hint.queue_s == pytest.approx(want.queue_s)
    assert conn.welcome.verify_s == pytest.approx(hint.span_s) and conn.handshake_s > 0
    conn.disconnect()


def test_cut_sockets_mid_image_resume_bit_identical(server, reference, tiny_device, median_tau):
    """The socket dies twice with a verify in flight (its reply lost): the device reconnects, re-creates the session
    from its history and finishes the same image."""
    url, _, _ = server
    conn = cutting_connection(url, KEY, 64, cuts=(2, 5), array=torch.from_numpy, backoff_s=0.01)
    out = _generate(conn, tiny_device, median_tau)
    assert out.stats.verifications >= 5
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace
    assert conn.reconnects == 2 and conn.resumes == 2 and out.stats.resumes == 2
    conn.disconnect()


def test_a_session_lost_again_under_its_resent_verify_is_resumed_again(server, reference, tiny_device, median_tau,
                                                                         monkeypatch):
    """The verifier loses the session under a VERIFY (410), then again under the VERIFY sent after the RESUME (the
    replica it was resumed on went too): the connection resumes again, up to LOST_RETRIES times a request, and the
    image is the same; one loss more and the 410 is the caller's."""
    from ciar_device.connection import LOST_RETRIES, SessionLost

    url, _, backend = server
    monkeypatch.setattr(backend, "lose", LOST_RETRIES)  # from the second VERIFY on, the session is gone
    monkeypatch.setattr(backend, "lose_after", 1)
    conn = _conn(url)
    out = _generate(conn, tiny_device, median_tau)
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace
    assert conn.resumes == LOST_RETRIES and out.stats.resumes == 1  # (one request, resumed three times)
    conn.disconnect()
    backend.lose, backend.lose_after = LOST_RETRIES + 1, 1
    conn = _conn(url)
    with pytest.raises(SessionLost):
        _generate(conn, tiny_device, median_tau)
    assert conn.resumes == LOST_RETRIES
    conn.disconnect()


def test_random_cuts_and_losses_leave_the_image_unchanged(server, tiny_cloud, tiny_device, stub_text, median_tau,
                                                          monkeypatch):
    """Sockets cut with a verify in flight and sessions lost under verifies, both at random (seeded) and together:
    the connection reconnects, resumes (again when a resumed session is lost in turn) and finishes the image the
    in-process verifier makes."""
    import random

    from ciar.engine.verifier import CloudVerifier, InProcessCloud
    from ciar_device.connection import LOST_RETRIES

    url, _, backend = server
    resumes = lost = 0
    for seed in range(4):
        rng = random.Random(seed)
        want = _generate(InProcessCloud(CloudVerifier(tiny_cloud, stub_text, max_sessions=2)), tiny_device,
                         median_tau, seed=20 + seed)
        losses = rng.randint(0, LOST_RETRIES)
        monkeypatch.setattr(backend, "lose", losses)
        monkeypatch.setattr(backend, "lose_after", rng.randint(0, 3))
        conn = cutting_connection(url, KEY, 64, cuts=rng.sample(range(1, 8), rng.randint(0, 3)),
                                  array=torch.from_numpy, backoff_s=0.01)
        out = _generate(conn, tiny_device, median_tau, seed=20 + seed)
        assert torch.equal(out.tokens, want.tokens) and out.trace == want.trace, seed
        assert not conn.sessions
        resumes, lost = resumes + conn.resumes, lost + losses - backend.lose
        conn.disconnect()
    assert resumes > 0 and lost > 0


def test_reconnect_without_loss_keeps_the_session(server, reference, tiny_device, median_tau):
    """A clean reconnect between requests: the session is still held, nothing is resumed."""

    class Reconnecting(DeviceConnection):
        def verify(self, request):
            self.disconnect()
            return super().verify(request)

    conn = Reconnecting(server[0], KEY, vocab_size=64, array=torch.from_numpy)
    out = _generate(conn, tiny_device, median_tau)
    assert torch.equal(out.tokens, reference.tokens)
    assert conn.reconnects >= 3 and conn.resumes == 0
    conn.disconnect()


def test_unknown_key_and_other_version_are_closed_with_a_reason(server):
    url = server[0]
    with pytest.raises(ConnectionRefused) as e:
        _conn(url, key="not-a-key").connect()
    assert e.value.code == wire.CLOSE_UNAUTHORIZED and "unknown device key" in e.value.reason
    from websockets.sync.client import connect

    ws = connect(url + "/v1/device/sessions", proxy=None, legacy=True)
    hello = bytearray(wire.encode_frame(Frame(HELLO, 0, Hello(KEY))))
    hello[2] = 9
    ws.send(bytes(hello))
    with pytest.raises(Exception) as e:
        ws.recv(timeout=5)
    assert e.value.rcvd.code == wire.CLOSE_VERSION and "version 9" in e.value.rcvd.reason


def test_another_device_is_refused_and_learns_nothing(server, tiny_device):
    """Device B names device A's session id and presents A's token: 403, the same answer as for a session that does
    not exist, and A's image is unaffected."""
    url = server[0]
    a, b = _conn(url), _conn(url, key=OTHER_KEY)
    req = OpenRequest("shared", "a red circle", 1, Sampling(2.0), 2)
    a.open(req)
    token = a.sessions["shared"].token
    frame = Frame(VERIFY, 1, wire.VerifyRequest("shared", np.zeros(0, np.int64), np.zeros(1, np.int64),
                                                np.full((1, 64), 1 / 64, np.float16)), token)
    b.connect()
    b.ws.send(wire.encode_frame(frame))
    reply = wire.decode_frame(b.ws.recv(timeout=10))
    assert reply.type == wire.ERROR and reply.body.status == 403
    assert reply.body.message == "invalid session token for this session"  # names nothing of A's
    b.ws.send(wire.encode_frame(replace_sid(frame, "never-opened")))
    reply2 = wire.decode_frame(b.ws.recv(timeout=10))
    assert reply2.body.status == 403  # no difference between "exists but not yours" and "does not exist"
    # B opening the same id opens B's own session: A's is untouched
    b.open(req)
    assert torch.equal(torch.as_tensor(a.sessions["shared"].tokens), torch.as_tensor(b.sessions["shared"].tokens))
    a.close("shared")
    b.close("shared")
    a.disconnect()
    b.disconnect()


def replace_sid(frame, sid):
    from dataclasses import replace

    return replace(frame, body=replace(frame.body, session_id=sid))


def test_limits(server):
    url, endpoint, _ = server
    conn = _conn(url)
    for i in range(3):
        conn.open(OpenRequest(f"s{i}", "a red circle", i, Sampling(2.0), 1))
    conn.retries = 0
    with pytest.raises(ServerError) as e:
        conn.open(OpenRequest("s3", "a red circle", 3, Sampling(2.0), 1))
    assert e.value.status == 429 and e.value.field == "session_id"
    for i in range(3):
        conn.close(f"s{i}")
    # a bad session id, a bad sampling value: 422 naming the field
    with pytest.raises(ServerError) as e:
        conn.open(OpenRequest("no spaces", "a red circle", 0, Sampling(2.0), 1))
    assert (e.value.status, e.value.field) == (422, "session_id")
    with pytest.raises(ServerError) as e:
        conn.open(OpenRequest("ok", "a red circle", 0, Sampling(0.5), 1))
    assert (e.value.status, e.value.field) == (422, "sampling")
    # rate: 60 frames at once pass (the burst), the rest are answered 429 with the wait
    statuses = []
    conn.connect()
    for i in range(80):
        conn.ws.send(wire.encode_frame(Frame(CLOSE, 1000 + i, CloseRequest("nothing"), bytes(32))))
    for i in range(80):
        statuses.append(wire.decode_frame(conn.ws.recv(timeout=10)).body)
    limited = [s for s in statuses if getattr(s, "status", 0) == 429]
    assert limited and all(s.retry_after_s > 0 for s in limited)
    conn.disconnect()
    # a frame over the limit closes the connection with 1009
    conn = _conn(url)
    conn.connect()
    conn.ws.send(b"CI" + bytes(70_000))
    with pytest.raises(Exception) as e:
        conn.ws.recv(timeout=10)
    assert e.value.rcvd.code == wire.CLOSE_TOO_BIG
    # text frames: 4000
    conn = _conn(url)
    conn.connect()
    conn.ws.send("hello")
    with pytest.raises(Exception) as e:
        conn.ws.recv(timeout=10)
    assert e.value.rcvd.code == wire.CLOSE_PROTOCOL


def test_only_a_bad_session_token_is_answered_403():
    """The verifier's token check raises SessionTokenError (403 "invalid session token"); a PermissionError from
    anything else on a call's way (an OS call refused, issue 40's RESUME 403 candidate) is an internal error (500),
    not blamed on the device's token. Through Ray the error arrives wrapped: root_cause finds it either way."""
    from types import SimpleNamespace

    from ciar.collab.protocol import SessionTokenError
    from services.device_endpoint import DeviceEndpoint
    from services.endpoint_limits import EndpointLimits

    ep = SimpleNamespace(limits=EndpointLimits())
    wrapped = RuntimeError("the replica's call failed")
    wrapped.cause = SessionTokenError("session 'dx/s' belongs to another device (bad session token)")
    for e in (SessionTokenError("bad token"), wrapped):
        r = DeviceEndpoint._failure(ep, e, "dx", "s", wire.RESUME)
        assert (r.status, r.field) == (403, "token") and "invalid session token" in str(r), r
    r = DeviceEndpoint._failure(ep, PermissionError(13, "Permission denied"), "dx", "s", wire.RESUME)
    assert r.status == 500 and "token" not in str(r), r


def test_a_lost_verifier_replica_is_a_410_for_a_verify_and_a_503_for_the_rest():
    """Seen in loadtests.nodeloss: a RESUME routed to the replica a node took with it was answered 410 ('resume it
    from its history'), which the device, already resuming, took as the end of the image. A call that never reached
    a live replica is safe to send again as it is for OPEN, RESUME and CLOSE (503 + retry-after: the router then
    sends it to the session's new owner); only a VERIFY, which may have been applied, asks for a RESUME (410)."""
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from services.device_endpoint import DeviceEndpoint
    from services.endpoint_limits import EndpointLimits

    ep = SimpleNamespace(limits=EndpointLimits())
    for lost in (ActorDiedError(), ActorUnavailableError("node gone", b"\x00" * 16)):
        assert DeviceEndpoint._failure(ep, lost, "dx", "s", wire.VERIFY).status == 410
        for ftype in (wire.OPEN, wire.RESUME, wire.CLOSE):
            r = DeviceEndpoint._failure(ep, lost, "dx", "s", ftype)
            assert r.status == 503 and r.retry_after_s == ep.limits.retry_after_s, (ftype, r)


def _raw_websocket(url: str, rcvbuf: int):
    """A WebSocket opened by hand on a plain socket with a small receive buffer (no client library: nothing reads
    behind the test's back), its handshake read; -> (socket, send a binary frame, read one frame)."""
    import base64
    import os
    import socket
    import struct
    from urllib.parse import urlparse

    from services.testing import ROUTE

    u = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window stays small
    sock.settimeout(10)
    sock.connect((u.hostname, u.port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {ROUTE} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head

    def frame(payload: bytes) -> bytes:  # a client's binary frame, masked
        n, mask = len(payload), os.urandom(4)
        size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
        return bytes([0x82]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))

    def read_frame() -> bytes:
        def exactly(n):
            out = b""
            while len(out) < n:
                out += sock.recv(n - len(out))
            return out

        b0, b1 = exactly(2)
        n = b1 & 0x7F
        n = struct.unpack(">H", exactly(2))[0] if n == 126 else struct.unpack(">Q", exactly(8))[0] if n == 127 else n
        return exactly(n)

    return sock, frame, read_frame


def test_a_reader_that_never_reads_is_disconnected_not_left_open(tiny_cloud, stub_text):
    """A device that sends but never reads: the endpoint's send timeout drops it, and the server ends the TCP
    connection itself (its closing handshake, which such a peer never answers, runs to its end: a reset), instead of
    leaving a socket whose unread replies it would wait to flush for as long as the peer lives. The device here is a
    plain socket that only sends (requests answered with small errors, paced under the rate limit) until its sends
    fail; the server's close handshake waits 0.5 s a step (`close_timeout_s`)."""
    import select
    import struct
    import time

    from ciar.engine.verifier import CloudVerifier
    from services.config import key_digest
    from services.device_endpoint import DeviceEndpoint
    from services.endpoint_limits import EndpointLimits
    from services.testing import InProcessBackend, loopback_endpoint

    endpoint = DeviceEndpoint(InProcessBackend(CloudVerifier(tiny_cloud, stub_text, max_sessions=2), SECRET),
                              [key_digest(KEY)], EndpointLimits(messages_per_s=5000, burst=5000, send_timeout_s=0.3,
                                                                idle_timeout_s=30.0))
    with loopback_endpoint(endpoint, sndbuf=16 << 10, close_timeout_s=0.5) as url:
        sock, frame, read_frame = _raw_websocket(url, rcvbuf=4096)
        sock.sendall(frame(wire.encode_frame(Frame(HELLO, 0, Hello(KEY, "never-reads")))))
        assert wire.decode_frame(read_frame()).name == "WELCOME"  # the last frame it reads
        sock.setblocking(False)
        pending, sent, ended = bytearray(), 0, None
        guard = time.monotonic() + 60  # a hang guard: the server ends it within a few close timeouts
        while ended is None and time.monotonic() < guard:
            if not pending:  # the next request: an unknown frame type, answered with a 400 each
                pending += frame(struct.pack("<2sBBI", wire.MAGIC, wire.PROTOCOL_VERSION, 200, sent + 1))
                sent += 1
                time.sleep(0.001)  # (about 1,000 a second: under the endpoint's rate limit)
            if not select.select([], [sock], [], 0.2)[1]:
                continue  # the server reads no more: wait
            try:
                del pending[:sock.send(pending)]
            except (ConnectionResetError, BrokenPipeError) as e:
                ended = type(e).__name__
        sock.close()
    assert ended is not None, (f"{sent} requests sent, never read, and the connection still open ({endpoint.counts}, "
                               f"{endpoint.connections} connections)")
    assert endpoint.counts.get("close:1008", 0) == 1  # dropped by the send timeout, once
    assert endpoint.connections == 0
