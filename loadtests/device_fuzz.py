"""Fuzz the device channel (ws://HOST/v1/device/sessions, services.device_endpoint) against a live endpoint, while
witness devices make real images; part of `loadtests.fuzz`, which starts the cluster and scans its logs.

    python -m loadtests.fuzz --examples 0 --device-frames 3000 --out runs/device-fuzz     # starts a cluster
    python -m loadtests.fuzz --host http://127.0.0.1:8000 --examples 0 --device-frames 1000 \
        --device-key ciar-dev-device-key --device-key OTHER_KEY

What is sent (`DeviceFuzzer.run`), every wait bounded by `Target.timeout_s` (an answer later than that is a hang):
  frames     hypothesis strategies (`frame_strategies`), by kind: random bodies behind a valid header, bad magic,
             unknown types, another version, truncated and mutated valid frames, well-formed frames with random
             field values and tokens, server-only types, first frames before HELLO, and well-formed VERIFY / RESUME /
             CLOSE frames with random contents on a real session with its valid token (each followed by an empty
             VERIFY: a frame must never leave its session wedged);
  limits     a frame over the frame limit (1009), one exactly at it (answered), empty and text frames (4000);
  order      OPEN before HELLO (4000), HELLO twice (400), VERIFY / RESUME / CLOSE of a session never opened (403),
             OPEN twice for one id (answered as the first: the same token and prefix), another OPEN under an open
             id (409; the session intact and still counted), VERIFY after CLOSE (410);
  tokens     a random token, a token of another session, a token of a closed session (403; 410 on its own session),
             another device's session with its real token (403 with the same message as a session that does not
             exist: nothing is learnt about it);
  sessions   a device opening hundreds of sessions, also opening each id twice and after VERIFYs of sessions it does
             not hold: exactly the per-device limit succeed, the rest are 429 naming session_id, and all of them can
             be opened again once closed (nothing leaked); the verifier holds as many sessions after the run as before;
  readers    a slow reader (sends, never reads; tiny receive buffer; asks for the largest replies, its sessions'
             captions): dropped by the server's send timeout while another connection is answered meanwhile (the
             serving processes' memory is recorded when `Target.server_memory` can read it);
  connections  up to the endpoint's connection limit and beyond (1013, "retry after N s"), the health route and a
             new device answered meanwhile; a handshake held for seconds instead of refused is a failure (a queue in
             front of the endpoint); inconclusive, not failed, when connections that sent no HELLO were closed
             before the last ones were open (the limit was not reached); the per-device connection limit (1008);
             connections that vanish right after HELLO do not use up their device's connections.
Witnesses (`Witnesses`: `ciar_client.loop.generate` over a `DeviceConnection` on the second device key; the tests
pass a torch decoder) make their images once before the fuzz and then in a loop during it: every image must be
bit-identical to the quiet one, without a reconnect. After the fuzz the health route must answer and one more
witness image must be identical. Passes: no ERROR 5xx other than 503, no close 1011, no answer out of time or to
another request id, every answer the expected one.

`run()` -> the summary written to OUT/device_fuzz.json: frames (by kind), answers (by "close:CODE", "error:STATUS",
"reply:TYPE", "timeout"), probes (per probe's figures), phases_s, failures (the first 50, `failure_count` all; a
hang's or a server error's frame whole in `frame_b64`, to replay it), witnesses, healthy, ok. `secrets()`: the
device keys and the session tokens seen (hex), for the log scan.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

import numpy as np

from ciar_client import wire
from ciar_client.connection import DEFAULT_PATH, DeviceConnection
from ciar_client.wire import (BODY_TYPES, CLOSE, ERROR, HELLO, MAGIC, OPEN, OPEN_REPLY, PROTOCOL_VERSION,
                              RESUME, RULES, VERIFY, VERIFY_REPLY, WELCOME, CloseReply, CloseRequest, ErrorReply,
                              Frame, Hello, InjectedFeatures, OpenReply, OpenRequest, ResumeRequest, RuleConfig,
                              Sampling, VerifyReply, VerifyRequest, Welcome)

PROMPT = "a small red circle at the top on a gray background"
WITNESS_CASES = ((PROMPT, 7), ("a large blue square at the bottom", 11))  # (prompt, seed) per witness image
CLIENT_TYPES = (OPEN, VERIFY, RESUME, CLOSE)
# share of --device-frames per hypothesis kind
FRAME_KINDS = {"random_body": 0.08, "bad_magic": 0.04, "unknown_type": 0.04, "wrong_version": 0.03,
               "truncated": 0.14, "mutated": 0.2, "fields": 0.18, "session_frames": 0.14, "server_types": 0.03,
               "before_hello": 0.12}
ANY_REQUEST_ANSWER = ("reply:", "error:400", "error:403", "error:409", "error:410", "error:422", "error:429",
                      "error:503")
MAX_FAILURES_KEPT = 50
HANGS_PER_KIND = 3  # a kind stops after this many hangs (each costs timeout_s)
WITNESS_ERRORS = 5  # the witness loop stops after this many failed images
QUEUED_HANDSHAKE_S = 5.0  # a WebSocket handshake this slow was queued, not refused (the connection-limit probe)
FULL_FRAME_BYTES = 16 << 10  # a hang's or a server error's frame is kept whole (base64) up to this size


# ---------------------------------------------------------------------- target, witnesses
@dataclass
class Target:
    """A live device endpoint and what the fuzz needs to know about it."""

    url: str  # ws://HOST:PORT (the route is added)
    keys: tuple[str, str]  # the fuzzed device's key; another device's (cross-device probes, witnesses)
    health_url: str | None = None  # GET -> 200 while the replica is healthy
    max_connections: int | None = None  # the endpoint's connection limit (DeviceEndpointConfig), when known
    max_connections_per_device: int | None = None
    send_timeout_s: float = 10.0  # the endpoint's send timeout (how long a slow reader is left unread)
    timeout_s: float = 30.0  # every probe's bound: no answer in this time is a hang
    verifier_sessions: Callable[[], int] | None = None  # sessions the verifier pool holds (leak check), if reachable
    server_memory: Callable[[], dict] | None = None  # RSS of the serving processes in MB (slow reader), if reachable

    @property
    def ws_url(self) -> str:
        return self.url if self.url.rstrip("/").endswith(DEFAULT_PATH) else self.url.rstrip("/") + DEFAULT_PATH


@dataclass
class Witnesses:
    """Real images made over the device channel: `image(conn, prompt, seed, session_id)` -> tokens [N] int64, on a
    `DeviceConnection` of `vocab_size` (arrays made by `array`)."""

    image: Callable[[DeviceConnection, str, int, str], np.ndarray]
    vocab_size: int
    array: Callable | None = None
    cases: tuple[tuple[str, int], ...] = WITNESS_CASES


def onnx_witnesses(model_dir: str) -> Witnesses:
    """Witnesses on the exported device model (`python -m pipelines.export_onnx`): the torch-free device loop at the
    calibrated point (`policy="fixed"`: the adaptive policy would choose from the costs the fuzz inflates, and a
    witness checks the channel, not the policy)."""
    from ciar_client.loop import generate
    from ciar_client.runtime import DeviceRuntime

    rt = DeviceRuntime(model_dir)
    return Witnesses(lambda conn, prompt, seed, sid: generate(rt, conn, prompt, seed, session_id=sid,
                                                              policy="fixed").tokens, rt.vocab_size)


class _RecordingConnection(DeviceConnection):
    """A DeviceConnection that remembers the session tokens it was issued (for the log scan)."""

    def __init__(self, *args, seen: set, **kw):
        super().__init__(*args, **kw)
        self.seen = seen

    def open(self, request):
        reply = super().open(request)
        self.seen.add(self.sessions[request.session_id].token.hex())
        return reply


class WitnessLoop(threading.Thread):
    """Makes the witness images over and over until stopped; each must equal its quiet reference."""

    def __init__(self, target: Target, w: Witnesses, reference: list[np.ndarray], seen: set):
        super().__init__(daemon=True, name="device-fuzz-witness")
        self.t, self.w, self.reference, self.seen = target, w, reference, seen
        self.stop = threading.Event()
        self.images, self.mismatches, self.errors = 0, 0, []
        self.reconnects = self.resumes = 0

    def _connection(self) -> DeviceConnection:
        return _RecordingConnection(self.t.url, self.t.keys[1], self.w.vocab_size, array=self.w.array,
                                    timeout_s=self.t.timeout_s, connect_timeout_s=self.t.timeout_s, seen=self.seen)

    def run(self) -> None:
        conn = self._connection()
        while not self.stop.is_set() and len(self.errors) < WITNESS_ERRORS:
            for i, (prompt, seed) in enumerate(self.w.cases):
                try:
                    tokens = np.asarray(self.w.image(conn, prompt, seed, f"witness-{i}"))
                except Exception as e:  # noqa: BLE001 - reported; the next image on a fresh connection
                    self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                    self._forget(conn)
                    conn = self._connection()
                    continue
                self.images += 1
                self.mismatches += not np.array_equal(tokens, self.reference[i])
        self._forget(conn)

    def _forget(self, conn: DeviceConnection) -> None:
        self.reconnects += conn.reconnects
        self.resumes += conn.resumes
        conn.disconnect()


# ---------------------------------------------------------------------- one raw connection
@dataclass(frozen=True)
class Answer:
    """What came back for a frame: a reply, an ERROR, the connection's close, a timeout, or garbage."""

    kind: str  # reply | error | close | timeout | garbage
    label: str = ""  # reply type, error status, close code
    frame: Frame | None = None
    reason: str = ""  # close reason or garbage description

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.label}" if self.label else self.kind

    @property
    def error(self) -> ErrorReply | None:
        return self.frame.body if self.kind == "error" else None

    def describe(self) -> str:
        if self.kind == "error":
            e = self.error
            return f"{self.key} {e.message[:160]!r}" + (f" field={e.field}" if e.field else "")
        return self.key + (f" {self.reason[:160]!r}" if self.reason else "")


class Probe:
    """One WebSocket to the endpoint (websockets' sync client): frames out, answers in, every wait bounded.
    `rcvbuf` / `max_queue` make a slow reader (a small socket buffer, no reading ahead)."""

    def __init__(self, target: Target, rcvbuf: int | None = None, max_queue: int = 16):
        from websockets.sync.client import connect

        self.timeout_s = target.timeout_s
        sock = None
        if rcvbuf is not None:
            u = urlparse(target.ws_url)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window stays small
            sock.settimeout(target.timeout_s)
            sock.connect((u.hostname, u.port))
            sock.settimeout(None)
        self.ws = connect(target.ws_url, sock=sock, max_size=None, compression=None, proxy=None, ping_interval=None,
                          open_timeout=target.timeout_s, close_timeout=2, max_queue=max_queue, legacy=True)
        self.alive = True
        self.rid = 0

    @classmethod
    def attempt(cls, target: Target, **kw) -> "Probe | Exception":
        try:
            return cls(target, **kw)
        except Exception as e:  # noqa: BLE001 - the caller classifies it
            return e

    def next_rid(self) -> int:
        self.rid = (self.rid + 1) & 0xFFFFFFFF
        return self.rid

    def send(self, data: bytes | str) -> bool:
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(data)
            return True
        except (ConnectionClosed, OSError):
            self.alive = False
            return False

    def answer(self, timeout: float | None = None) -> Answer:
        from websockets.exceptions import ConnectionClosed

        try:
            raw = self.ws.recv(timeout=self.timeout_s if timeout is None else timeout)
        except TimeoutError:
            return Answer("timeout")
        except ConnectionClosed as e:
            self.alive = False
            rc = e.rcvd
            return Answer("close", str(rc.code) if rc is not None else "1006", reason=rc.reason if rc else "")
        except OSError as e:
            self.alive = False
            return Answer("close", "1006", reason=f"{type(e).__name__}")
        if isinstance(raw, str):
            return Answer("garbage", "text", reason=raw[:80])
        try:
            f = wire.decode_frame(raw)
        except wire.WireError as e:
            return Answer("garbage", "frame", reason=str(e))
        return Answer("error", str(f.body.status), f) if f.type == ERROR else Answer("reply", f.name, f)

    def hello(self, key: str) -> Answer:
        self.send(wire.encode_frame(Frame(HELLO, 0, Hello(key, "device-fuzz"))))
        return self.answer()

    def close(self) -> None:
        self.alive = False
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


def _allowed(key: str, allowed) -> bool:
    return any(key.startswith(a) if a.endswith(":") else key == a for a in allowed)


def expected_answers(data: bytes | str, max_frame_bytes: int, hello_done: bool = True) -> tuple[str, ...]:
    """The answers the endpoint may give to `data` (as ciar_client.wire and services.device_endpoint define them):
    "close:CODE", "error:STATUS", "reply:TYPE" or a prefix "reply:"."""
    if isinstance(data, str):
        return ("close:4000",)
    if len(data) > max_frame_bytes:
        return ("close:1009",)
    if len(data) < wire.HEADER_BYTES or data[:2] != MAGIC:
        return ("close:4000",)
    if data[2] != PROTOCOL_VERSION:
        return ("close:4002",)
    ftype = data[3]
    if not hello_done:  # the first frame: WELCOME for a valid HELLO of a known key, else a close
        return ("close:4000", "close:4001") + (("reply:WELCOME",) if ftype == HELLO else ())
    if ftype not in BODY_TYPES:
        return ("error:400",)
    if ftype not in CLIENT_TYPES:
        return ("error:400", "error:422")  # a decoding error names its field (422) or not (400); else "not sent by
        # a device" (400)
    reply = {OPEN: "OPEN_REPLY", VERIFY: "VERIFY_REPLY", RESUME: "OPEN_REPLY", CLOSE: "CLOSED"}[ftype]
    return (f"reply:{reply}",) + ANY_REQUEST_ANSWER[1:]


def _rid_of(data) -> int | None:
    return struct.unpack_from("<I", data, 4)[0] if isinstance(data, bytes) and len(data) >= 8 else None


# ---------------------------------------------------------------------- strategies
def frame_strategies(vocab: int, max_frame_bytes: int) -> dict[str, Any]:
    """Hypothesis strategies by kind. Each draws (bytes or str to send, {"sid", "token"} or None); the kinds
    "session_frames" draw a function (session id, token) -> bytes instead (a frame for a real session)."""
    from hypothesis import assume, strategies as st

    sid_ok = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
    sids = sid_ok | st.text(max_size=40) | st.sampled_from(["", "a/b", "../x", "x" * 64, "fz"])
    floats = st.floats(allow_nan=True, allow_infinity=True)
    prompts = st.sampled_from([PROMPT, "", " ", "a red \x00 circle", "a 😀 circle", "x" * 2000]) | \
        st.text(max_size=120)
    rids = st.integers(0, 2**32 - 1)
    tokens32 = st.binary(min_size=32, max_size=32)

    def sampling(draw) -> Sampling:
        if draw(st.booleans()):
            return Sampling(draw(st.floats(1, 5)), draw(st.floats(0, 2)), draw(st.integers(0, 64)),
                            draw(st.floats(0.05, 1)))
        return Sampling(draw(floats), draw(floats), draw(st.integers(0, 2**32 - 1)), draw(floats))

    def open_request(draw, sid: str | None = None) -> OpenRequest:
        rule = draw(st.sampled_from(RULES))
        return OpenRequest(sid if sid is not None else draw(sids), draw(prompts), draw(st.integers(-2**63, 2**63 - 1)),
                           sampling(draw), draw(st.integers(0, 3) | st.integers(0, 2**16 - 1)),
                           RuleConfig(rule, draw(st.integers(0, 2**32 - 1)), draw(floats), draw(floats)),
                           draw(st.booleans()))

    def arr(draw, shape, wild: bool) -> np.ndarray:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if wild:  # any float16 bit pattern: negatives, NaN, inf
            return rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(np.float16)
        return rng.random(shape).astype(np.float16)

    def verify_request(draw, sid: str | None = None) -> VerifyRequest:
        v = draw(st.sampled_from([vocab, vocab, vocab, 2, vocab + 1]) | st.integers(2, 600))
        m, k = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        ids = st.integers(0, v - 1)
        new = np.array(draw(st.lists(ids, min_size=m, max_size=m)), np.int64)
        drafts = np.array(draw(st.lists(ids, min_size=k, max_size=k)), np.int64)
        shape = draw(st.sampled_from(["uniform", "random", "wild"]))
        probs = np.full((k, v), 1.0 / v, np.float16) if shape == "uniform" else arr(draw, (k, v), shape == "wild")
        hidden = feats = None
        wild = st.sampled_from([False, False, False, True])  # mostly finite: they reach the verifier's projector
        if draw(st.booleans()):
            hidden = arr(draw, (m, draw(st.integers(0, 300))), draw(wild))
        if draw(st.booleans()):
            feats = arr(draw, (m, draw(st.integers(0, 64))), draw(wild))
        return VerifyRequest(sid if sid is not None else draw(sids), new, drafts, probs, hidden, feats,
                             draw(st.integers(0, 8) | st.integers(0, 2**16 - 1)), draw(st.floats(0, 1) | floats))

    def resume_request(draw, sid: str | None = None) -> ResumeRequest:
        req = open_request(draw, sid)
        v = draw(st.sampled_from([vocab, vocab, 2]) | st.integers(2, 600))
        c = draw(st.integers(0, 40) | st.integers(0, 3000))
        history = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, v, c).astype(np.int64)
        inj = None
        n = draw(st.integers(0, min(c, 6)))
        if n:
            pos = np.array(draw(st.lists(st.integers(0, 2**16 - 1) | st.integers(0, max(c - 2, 0)), min_size=n,
                                         max_size=n)), np.int64)
            inj = InjectedFeatures(pos, arr(draw, (n, draw(st.integers(0, 300))), draw(st.booleans())),
                                   arr(draw, (n, draw(st.integers(0, 64))), draw(st.booleans())))
        return ResumeRequest(req, history, inj, v)

    def encode(frame: Frame) -> bytes:
        try:
            data = wire.encode_frame(frame)
        except wire.WireError:  # a value the wire cannot carry (an over-long string, an id out of range)
            assume(False)
        assume(len(data) <= max_frame_bytes)
        return data

    @st.composite
    def client_frame(draw) -> bytes:
        t = draw(st.sampled_from(CLIENT_TYPES))
        rid = draw(rids)
        if t == OPEN:
            return encode(Frame(OPEN, rid, open_request(draw)))
        token = draw(tokens32)
        if t == VERIFY:
            return encode(Frame(VERIFY, rid, verify_request(draw), token))
        if t == RESUME:
            return encode(Frame(RESUME, rid, resume_request(draw), token))
        return encode(Frame(CLOSE, rid, CloseRequest(draw(sids)), token))

    @st.composite
    def server_frame(draw) -> bytes:
        body = draw(st.sampled_from([
            (HELLO, Hello("ciar-dev-device-key")), (WELCOME, Welcome("d0", 1024, 1, 1.0, 1.0)),
            (OPEN_REPLY, OpenReply("s", np.zeros(2, np.int64), None, None, 0.0, 1, vocab)),
            (VERIFY_REPLY, VerifyReply("s", 0, 1, True, 0.0, 1)), (wire.CLOSED, CloseReply("s")),
            (ERROR, ErrorReply(500, "x"))]))
        return encode(Frame(body[0], draw(rids), body[1], bytes(32) if body[0] == OPEN_REPLY else b""))

    def header(draw, ftype: int | None = None, version: int = PROTOCOL_VERSION) -> bytes:
        return struct.pack("<2sBBI", MAGIC, version, draw(st.integers(0, 255)) if ftype is None else ftype,
                           draw(rids))

    @st.composite
    def random_body(draw) -> bytes:
        return header(draw, draw(st.sampled_from(sorted(BODY_TYPES)))) + draw(st.binary(max_size=300))

    @st.composite
    def bad_magic(draw) -> bytes:
        data = draw(client_frame())
        return draw(st.binary(min_size=2, max_size=2).filter(lambda m: m != MAGIC)) + data[2:]

    @st.composite
    def unknown_type(draw) -> bytes:
        t = draw(st.integers(0, 255).filter(lambda t: t not in BODY_TYPES))
        return header(draw, t) + draw(st.binary(max_size=64))

    @st.composite
    def wrong_version(draw) -> bytes:
        data = draw(client_frame())
        return data[:2] + bytes([draw(st.integers(0, 255).filter(lambda v: v != PROTOCOL_VERSION))]) + data[3:]

    @st.composite
    def truncated(draw) -> bytes:
        data = draw(client_frame() | server_frame())
        return data[:draw(st.integers(0, len(data) - 1))]

    @st.composite
    def mutated(draw) -> bytes:
        data = bytearray(draw(client_frame()))
        lo = draw(st.sampled_from([0, wire.HEADER_BYTES, wire.HEADER_BYTES]))  # mostly past the header
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["set", "set", "insert", "delete"]))
            i = draw(st.integers(min(lo, len(data)), len(data)))
            if op == "set" and i < len(data):
                data[i] = draw(st.integers(0, 255))
            elif op == "insert":
                data[i:i] = draw(st.binary(min_size=1, max_size=8))
            elif i < len(data):
                del data[i:i + draw(st.integers(1, 8))]
        return bytes(data)

    @st.composite
    def first_frame(draw) -> bytes:
        hello = wire.encode_frame(Frame(HELLO, draw(rids), Hello(draw(st.text(max_size=40)),
                                                                 draw(st.text(max_size=20)))))
        return draw(st.sampled_from([hello]) | st.just(hello[:draw(st.integers(0, len(hello)))]) | client_frame() |
                    server_frame() | st.binary(max_size=64) | wrong_version())

    @st.composite
    def session_frame(draw) -> Callable[[str, bytes], bytes]:
        t = draw(st.sampled_from([VERIFY, VERIFY, VERIFY, RESUME, CLOSE]))
        rid = draw(rids)
        if t == VERIFY:
            req = verify_request(draw, sid="")
            return lambda sid, token: encode_ok(Frame(VERIFY, rid, _with_sid(req, sid), token), max_frame_bytes)
        if t == RESUME:
            req = resume_request(draw, sid="")
            return lambda sid, token: encode_ok(Frame(RESUME, rid, _with_sid(req, sid), token), max_frame_bytes)
        return lambda sid, token: encode_ok(Frame(CLOSE, rid, CloseRequest(sid), token), max_frame_bytes)

    return {"random_body": random_body(), "bad_magic": bad_magic(), "unknown_type": unknown_type(),
            "wrong_version": wrong_version(), "truncated": truncated(), "mutated": mutated(),
            "fields": client_frame(), "session_frames": session_frame(), "server_types": server_frame(),
            "before_hello": first_frame()}


def _with_sid(req, sid: str):
    from dataclasses import replace

    if isinstance(req, ResumeRequest):
        return replace(req, request=replace(req.request, session_id=sid))
    return replace(req, session_id=sid)


def encode_ok(frame: Frame, max_frame_bytes: int) -> bytes | None:
    """The frame's bytes, None when the wire cannot carry it or it is over the limit."""
    try:
        data = wire.encode_frame(frame)
    except wire.WireError:
        return None
    return data if len(data) <= max_frame_bytes else None


def _examples(strategy, n: int, seed: int, each: Callable[[Any], None]) -> None:
    """`each(example)` for n examples of `strategy` (no shrinking: failures are recorded, never raised)."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    @hseed(seed)
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.generate])
    @given(strategy)
    def one(example):
        each(example)

    one()


# ---------------------------------------------------------------------- the run
class DeviceFuzzer:
    """The device-channel fuzz run against one endpoint (see the module docstring)."""

    def __init__(self, target: Target, witnesses: Witnesses | None = None, seed: int = 0):
        self.t, self.w, self.seed = target, witnesses, seed
        self.frames: Counter = Counter()  # frames sent, by kind
        self.answers: Counter = Counter()  # answers, by key
        self.failures: list[dict] = []
        self.failure_count = 0
        self.hangs: Counter = Counter()
        self.probes: dict[str, Any] = {}
        self.tokens_seen: set[str] = set()
        self.welcome: Welcome | None = None
        self.vocab: int | None = None
        self._sid = 0

    # ------------------------------------------------------------------ bookkeeping
    def fail(self, kind: str, what: str, problem: str, data=None, answer: Answer | None = None) -> None:
        self.failure_count += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            entry = {"kind": kind, "what": what, "problem": problem}
            if data is not None:
                entry["frame"] = data[:60] if isinstance(data, str) else data[:48].hex() + \
                    (f"... ({len(data)} bytes)" if len(data) > 48 else "")
                if isinstance(data, bytes) and len(data) <= FULL_FRAME_BYTES and answer is not None and \
                        (answer.kind == "timeout" or answer.key.startswith("error:5")):
                    entry["frame_b64"] = base64.b64encode(data).decode()  # to replay it
            if answer is not None:
                entry["answer"] = answer.describe()
            self.failures.append(entry)

    def check(self, kind: str, what: str, data, a: Answer, allowed=None) -> Answer:
        """Count the answer; a failure when it is a hang, a 5xx other than 503, a 1011, garbage, an answer to
        another request, or not one of `allowed`."""
        self.answers[a.key] += 1
        problem = None
        if a.kind == "timeout":
            self.hangs[kind] += 1
            problem = f"no answer in {self.t.timeout_s:g} s"
        elif a.kind == "garbage":
            problem = f"the server sent something that is not a frame: {a.reason}"
        elif a.kind == "error" and a.error.status >= 500 and a.error.status != 503:
            problem = f"server error {a.error.status}"
        elif a.kind == "error" and not a.error.message:
            problem = "an ERROR without a message"
        elif a.key == "close:1011":
            problem = "closed with 1011 (internal error)"
        elif a.frame is not None and _rid_of(data) is not None and a.frame.request_id != _rid_of(data):
            problem = f"answer to request id {a.frame.request_id}, the frame had {_rid_of(data)}"
        elif allowed is not None and not _allowed(a.key, allowed):
            problem = f"expected {' or '.join(allowed)}"
        if problem:
            self.fail(kind, what, problem, data, a)
        if a.key == "error:429" and not a.error.field:
            time.sleep(min(a.error.retry_after_s, 0.5))  # rate limited (not a session limit): a polite fuzzer waits
        return a

    def connect(self, kind: str, key: str | None = None, **kw) -> tuple[Probe | None, Answer | None]:
        """A new connection, after HELLO with `key` (the fuzzed device's by default) -> (probe, WELCOME answer)."""
        p = Probe.attempt(self.t, **kw)
        if isinstance(p, Exception):
            self.fail(kind, "connect", f"no connection: {type(p).__name__}: {str(p)[:160]}")
            return None, None
        self.frames[kind] += 1
        hello = wire.encode_frame(Frame(HELLO, 0, Hello(key or self.t.keys[0], "device-fuzz")))
        p.send(hello)
        a = self.check(kind, "HELLO", hello, p.answer(), ("reply:WELCOME",))
        if a.key != "reply:WELCOME":
            p.close()
            return None, a
        return p, a

    def ask(self, p: Probe, kind: str, what: str, data: bytes | str | Frame, allowed=None) -> Answer:
        if isinstance(data, Frame):
            data = wire.encode_frame(data)
        self.frames[kind] += 1
        if not p.send(data):
            a = p.answer(timeout=1.0)  # the close that ended it
            return self.check(kind, what, data, a if a.kind == "close" else Answer("close", "1006"), allowed)
        return self.check(kind, what, data, p.answer(), allowed)

    def new_sid(self, prefix: str = "fz") -> str:
        self._sid += 1
        return f"{prefix}-{self.seed}-{self._sid}"

    def open(self, p: Probe, kind: str, sid: str, allowed=("reply:OPEN_REPLY",)) -> Answer:
        req = OpenRequest(sid, PROMPT, self._sid, Sampling(), 1, want_caption=False)
        a = self.ask(p, kind, f"OPEN {sid}", Frame(OPEN, p.next_rid(), req), allowed)
        if a.key == "reply:OPEN_REPLY":
            self.tokens_seen.add(a.frame.token.hex())
            self.vocab = self.vocab or a.frame.body.vocab_size
        return a

    def empty_verify(self, sid: str, token: bytes, rid: int) -> Frame:
        v = self.vocab or 2
        return Frame(VERIFY, rid, VerifyRequest(sid, np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                np.zeros((0, v), np.float16)), token)

    def close_session(self, p: Probe, kind: str, sid: str, token: bytes) -> Answer:
        return self.ask(p, kind, f"CLOSE {sid}", Frame(CLOSE, p.next_rid(), CloseRequest(sid), token),
                        ("reply:CLOSED",))

    # ------------------------------------------------------------------ witnesses
    def quiet_witnesses(self) -> list[np.ndarray]:
        conn = _RecordingConnection(self.t.url, self.t.keys[1], self.w.vocab_size, array=self.w.array,
                                    timeout_s=self.t.timeout_s, seen=self.tokens_seen)
        try:
            return [np.asarray(self.w.image(conn, prompt, seed, f"witness-{i}"))
                    for i, (prompt, seed) in enumerate(self.w.cases)]
        finally:
            conn.disconnect()

    def healthy(self) -> dict:
        out: dict[str, Any] = {}
        if self.t.health_url:
            out["health"] = http_status(self.t.health_url, self.t.timeout_s)
        p, a = self.connect("health")
        out["welcome"] = a.key if a is not None else "no connection"
        if p is not None:
            p.close()
        out["ok"] = out["welcome"] == "reply:WELCOME" and out.get("health", 200) == 200
        return out

    # ------------------------------------------------------------------ the whole run
    def run(self, frames: int = 1000, sessions_tried: int = 200, connections_extra: int = 8,
            slow_reader_s: float | None = None) -> dict:
        t0 = time.perf_counter()
        self.setup()
        sessions_before = self._verifier_sessions()

        reference, witness = None, None
        if self.w is not None:
            reference = self.quiet_witnesses()
            witness = WitnessLoop(self.t, self.w, reference, self.tokens_seen)
            witness.start()
        phases = {"frames": lambda: self.fuzz_frames(frames), "frame_limits": self.probe_frame_limits,
                  "order": self.probe_order, "tokens": self.probe_tokens,
                  "slow_reader": lambda: self.probe_slow_reader(slow_reader_s),
                  "connections": lambda: self.probe_connections(connections_extra),
                  "device_connections": self.probe_device_connections,
                  "sessions": lambda: self.probe_sessions(sessions_tried)}  # last: it also sees what others leaked
        phases_s = {}
        try:
            for name, phase in phases.items():
                t1 = time.perf_counter()
                phase()
                phases_s[name] = round(time.perf_counter() - t1, 1)
        finally:
            if witness is not None:
                witness.stop.set()
                witness.join(timeout=self.t.timeout_s * 4)
        health = self.healthy()
        witnesses = None
        if self.w is not None:
            after = self.quiet_witnesses()
            same_after = all(np.array_equal(x, y) for x, y in zip(after, reference))
            witnesses = {"cases": [list(c) for c in self.w.cases], "tokens": int(reference[0].size),
                         "images_during": witness.images, "mismatches_during": witness.mismatches,
                         "errors_during": witness.errors, "reconnects": witness.reconnects,
                         "resumes": witness.resumes, "identical_after": same_after,
                         "identical": witness.mismatches == 0 and not witness.errors and same_after
                         and witness.images > 0}
            if witness.is_alive():
                self.fail("witness", "witness loop", f"still running {self.t.timeout_s * 4:g} s after the fuzz")
            if not witnesses["identical"]:
                self.fail("witness", "images", f"{witness.mismatches} of {witness.images} images differ from the "
                          f"quiet run, errors {witness.errors}, identical after: {same_after}")
            if witness.reconnects or witness.resumes:
                self.fail("witness", "connection", f"the witness had to reconnect {witness.reconnects} times and "
                          f"resume {witness.resumes} sessions (the server stopped answering it)")
        sessions_after = self._verifier_sessions()
        if sessions_before is not None and sessions_after is not None:
            self.probes["verifier_sessions"] = {"before": sessions_before, "after": sessions_after}
            if sessions_after > sessions_before:
                self.fail("sessions", "verifier sessions", f"the verifier holds {sessions_after} sessions after the "
                          f"run, {sessions_before} before: {sessions_after - sessions_before} leaked")
        if not health["ok"]:
            self.fail("health", "after the fuzz", f"not healthy: {health}")
        return {"frames": sum(self.frames.values()), "by_kind": dict(sorted(self.frames.items())),
                "answers": dict(sorted(self.answers.items())), "failure_count": self.failure_count,
                "failures": self.failures, "probes": self.probes, "witnesses": witnesses, "healthy": health,
                "wall_s": round(time.perf_counter() - t0, 1), "phases_s": phases_s, "seed": self.seed,
                "ok": self.failure_count == 0 and (witnesses is None or witnesses["identical"]) and health["ok"]}

    def setup(self) -> None:
        """HELLO (the limits from WELCOME) and one session opened and closed (the vocabulary from its reply)."""
        p, a = self.connect("setup")
        if p is None:
            raise ConnectionError(f"the device endpoint {self.t.ws_url} refused the fuzzed device's key: "
                                  f"{a.describe() if a else 'no connection'}")
        self.welcome = a.frame.body
        sid = self.new_sid("setup")
        opened = self.open(p, "setup", sid)
        if opened.key == "reply:OPEN_REPLY":
            self.close_session(p, "setup", sid, opened.frame.token)
        p.close()

    def _verifier_sessions(self) -> int | None:
        if self.t.verifier_sessions is None:
            return None
        try:
            return int(self.t.verifier_sessions())
        except Exception as e:  # noqa: BLE001
            self.fail("sessions", "verifier sessions", f"could not ask the verifier: {type(e).__name__}")
            return None

    def _memory(self) -> dict | None:
        try:
            return self.t.server_memory() if self.t.server_memory is not None else None
        except Exception as e:  # noqa: BLE001 - a figure, not a check
            return {"error": type(e).__name__}

    def secrets(self) -> list[str]:
        """The device keys and every session token seen (hex): none may appear in a log."""
        return list(self.t.keys) + sorted(self.tokens_seen)

    # ------------------------------------------------------------------ hypothesis frames
    def fuzz_frames(self, frames: int) -> None:
        strategies = frame_strategies(self.vocab or 2, self.welcome.max_frame_bytes)
        for i, (kind, share) in enumerate(FRAME_KINDS.items()):
            n = max(1, round(frames * share))
            each = {"before_hello": self._first_frame, "session_frames": self._session_frame}.get(kind)
            state = {"probe": None}
            try:
                _examples(strategies[kind], n, self.seed + i,
                          each or (lambda data, kind=kind, state=state: self._frame(kind, data, state)))
            finally:
                if state["probe"] is not None:
                    state["probe"].close()
            if kind == "session_frames":
                self._close_session_probe()

    def _frame(self, kind: str, data: bytes, state: dict) -> None:
        """One frame on an authenticated connection (a new one after a close); OPENs that succeed are closed."""
        if self.hangs[kind] >= HANGS_PER_KIND:
            return
        p = state["probe"]
        if p is None or not p.alive:
            p, _ = self.connect(kind)
            state["probe"] = p
            if p is None:
                return
        a = self.ask(p, kind, "fuzzed frame", data, expected_answers(data, self.welcome.max_frame_bytes))
        if a.kind == "timeout":
            p.close()
            state["probe"] = None
        elif a.key == "reply:OPEN_REPLY":
            self.tokens_seen.add(a.frame.token.hex())
            self.close_session(p, kind, a.frame.body.session_id, a.frame.token)

    def _first_frame(self, data: bytes) -> None:
        """A fuzzed first frame of a connection (no HELLO before it)."""
        kind = "before_hello"
        if self.hangs[kind] >= HANGS_PER_KIND:
            return
        p = Probe.attempt(self.t)
        if isinstance(p, Exception):
            self.fail(kind, "connect", f"no connection: {type(p).__name__}")
            return
        try:
            self.ask(p, kind, "first frame", data, expected_answers(data, self.welcome.max_frame_bytes, False))
        finally:
            p.close()

    def _session_probe(self) -> Probe | None:
        p = getattr(self, "_sp", None)
        if p is None or not p.alive:
            p, _ = self.connect("session_frames")
            self._sp = p
        return p

    def _close_session_probe(self) -> None:
        p = getattr(self, "_sp", None)
        if p is not None:
            p.close()
        self._sp = None

    def _session_frame(self, make: Callable[[str, bytes], bytes | None]) -> None:
        """A fuzzed VERIFY / RESUME / CLOSE on a real session with its valid token, then an empty VERIFY (the
        session must not be wedged: answered, and not 'in flight'), then CLOSE."""
        kind = "session_frames"
        if self.hangs[kind] >= HANGS_PER_KIND:
            return
        p = self._session_probe()
        if p is None:
            return
        sid = self.new_sid()
        opened = self.open(p, kind, sid, ANY_REQUEST_ANSWER)
        if opened.key != "reply:OPEN_REPLY":
            return
        token = opened.frame.token
        data = make(sid, token)
        if data is None:
            self.close_session(p, kind, sid, token)
            return
        allowed = tuple(a for a in expected_answers(data, self.welcome.max_frame_bytes) if a != "error:403")
        a = self.ask(p, kind, "fuzzed frame on an open session", data, allowed)  # its token is valid: never 403
        if not p.alive or a.kind == "timeout":
            self._close_session_probe()
            self._close_elsewhere(sid, token)
            return
        follow = self.ask(p, kind, "empty VERIFY after the fuzzed frame", self.empty_verify(sid, token, p.next_rid()),
                          ("reply:VERIFY_REPLY", "error:400", "error:410"))
        if follow.kind == "error" and "in flight" in follow.error.message:
            self.fail(kind, "session wedged", "the fuzzed frame left its session with a request in flight forever",
                      data, follow)
        if follow.kind == "timeout":
            self._close_session_probe()
            self._close_elsewhere(sid, token)
            return
        self.close_session(p, kind, sid, token)

    # ------------------------------------------------------------------ fixed probes
    def probe_frame_limits(self) -> None:
        kind, limit = "frame_limits", self.welcome.max_frame_bytes
        out = {}
        for what, data, allowed in (
                ("over the frame limit", struct.pack("<2sBBI", MAGIC, PROTOCOL_VERSION, 200, 1) + bytes(limit - 7),
                 ("close:1009",)),
                ("exactly at the frame limit", struct.pack("<2sBBI", MAGIC, PROTOCOL_VERSION, 200, 2) +
                 bytes(limit - 8), ("error:400",)),
                ("an empty binary frame", b"", ("close:4000",)),
                ("a text frame", "hello", ("close:4000",)),
                ("a text frame that holds a valid frame's bytes",
                 wire.encode_frame(Frame(CLOSE, 3, CloseRequest("x"), bytes(32))).decode("latin-1"),
                 ("close:4000",))):
            p, _ = self.connect(kind)
            if p is None:
                continue
            out[what] = self.ask(p, kind, what, data, allowed).key
            p.close()
        for what, data, allowed in (("an empty binary frame before HELLO", b"", ("close:4000",)),
                                    ("a text frame before HELLO", "hello", ("close:4000",)),
                                    ("a frame over the limit before HELLO", b"CI" + bytes(limit), ("close:1009",))):
            p = Probe.attempt(self.t)
            if isinstance(p, Exception):
                self.fail(kind, what, f"no connection: {type(p).__name__}")
                continue
            out[what] = self.ask(p, kind, what, data, allowed).key
            p.close()
        self.probes[kind] = out

    def probe_order(self) -> None:
        kind = "order"
        out = {}
        for t, body, token in ((OPEN, OpenRequest("o", PROMPT, 0, Sampling(), 1), b""),
                               (VERIFY, VerifyRequest("o", np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                      np.zeros((0, 4), np.float16)), bytes(32)),
                               (CLOSE, CloseRequest("o"), bytes(32))):
            p = Probe.attempt(self.t)
            if isinstance(p, Exception):
                self.fail(kind, "connect", f"no connection: {type(p).__name__}")
                continue
            out[f"{wire.TYPE_NAMES[t]} before HELLO"] = self.ask(
                p, kind, f"{wire.TYPE_NAMES[t]} before HELLO", Frame(t, 1, body, token), ("close:4000",)).key
            p.close()
        p, _ = self.connect(kind)
        if p is None:
            return
        try:
            a = self.ask(p, kind, "HELLO twice", Frame(HELLO, p.next_rid(), Hello(self.t.keys[0])), ("error:400",))
            out["HELLO twice"] = a.key
            never, fake = self.new_sid("never"), os.urandom(32)
            o = OpenRequest(never, PROMPT, 0, Sampling(), 1, want_caption=False)
            for what, frame in (
                    ("VERIFY of a session never opened", self.empty_verify(never, fake, p.next_rid())),
                    ("RESUME of a session never opened",
                     Frame(RESUME, p.next_rid(), ResumeRequest(o, np.zeros(1, np.int64), None, self.vocab or 2), fake)),
                    ("CLOSE of a session never opened", Frame(CLOSE, p.next_rid(), CloseRequest(never), fake))):
                out[what] = self.ask(p, kind, what, frame, ("error:403",)).key
            # OPEN twice for one id: the same OPEN is answered as the first (a lost reply's retry: the same token
            # and prefix); another request under that id is refused (409); the session stays usable and counted
            sid = self.new_sid()
            first = self.open(p, kind, sid)
            if first.key == "reply:OPEN_REPLY":
                token = first.frame.token
                again = self.open(p, kind, sid)
                out["OPEN twice"] = again.key
                if again.key == "reply:OPEN_REPLY" and (
                        again.frame.token != token or again.frame.body.prefix_tokens.tolist() !=
                        first.frame.body.prefix_tokens.tolist()):
                    self.fail(kind, "OPEN twice", "a repeated OPEN was not answered as the first", answer=again)
                other = OpenRequest(sid, PROMPT + " (another)", self._sid, Sampling(), 1, want_caption=False)
                out["OPEN of an open id with another request"] = self.ask(
                    p, kind, "OPEN of an open id with another request", Frame(OPEN, p.next_rid(), other),
                    ("error:409",)).key
                out["VERIFY after OPEN twice"] = self.ask(p, kind, "VERIFY after OPEN twice",
                                                          self.empty_verify(sid, token, p.next_rid()),
                                                          ("reply:VERIFY_REPLY",)).key
                self.close_session(p, kind, sid, token)
                out["VERIFY after CLOSE"] = self.ask(p, kind, "VERIFY after CLOSE",
                                                     self.empty_verify(sid, token, p.next_rid()), ("error:410",)).key
                out["CLOSE after CLOSE"] = self.close_session(p, kind, sid, token).key
        finally:
            p.close()
        self.probes[kind] = out

    def probe_tokens(self) -> None:
        kind = "tokens"
        out = {}
        a_probe, welcome_a = self.connect(kind)
        b_probe, welcome_b = self.connect(kind, self.t.keys[1])
        try:
            if a_probe is None or b_probe is None:
                return
            x, y = self.new_sid("tok"), self.new_sid("tok")
            ox, oy = self.open(a_probe, kind, x), self.open(a_probe, kind, y)
            if ox.key != "reply:OPEN_REPLY" or oy.key != "reply:OPEN_REPLY":
                return
            tx, ty = ox.frame.token, oy.frame.token
            p = a_probe
            for what, token in (("a random token", os.urandom(32)), ("an all-zero token", bytes(32)),
                                ("the token of another session", ty)):
                out[f"VERIFY with {what}"] = self.ask(p, kind, f"VERIFY with {what}",
                                                      self.empty_verify(x, token, p.next_rid()), ("error:403",)).key
                out[f"CLOSE with {what}"] = self.ask(p, kind, f"CLOSE with {what}",
                                                     Frame(CLOSE, p.next_rid(), CloseRequest(x), token),
                                                     ("error:403",)).key
            # another device: B names A's session with A's real token
            never = self.new_sid("never")
            ref = self.ask(b_probe, kind, "B: VERIFY of a session that does not exist",
                           self.empty_verify(never, os.urandom(32), b_probe.next_rid()), ("error:403",))
            answers = []
            resume_x = ResumeRequest(OpenRequest(x, PROMPT, 0, Sampling(), 1, want_caption=False),
                                     np.zeros(1, np.int64), None, self.vocab)
            for what, frame in (
                    ("B: VERIFY of A's session with A's token", self.empty_verify(x, tx, b_probe.next_rid())),
                    ("B: RESUME of A's session with A's token", Frame(RESUME, b_probe.next_rid(), resume_x, tx)),
                    ("B: CLOSE of A's session with A's token", Frame(CLOSE, b_probe.next_rid(), CloseRequest(x), tx))):
                b = self.ask(b_probe, kind, what, frame, ("error:403",))
                out[what] = b.key
                answers.append((what, b))
            for what, b in answers:
                if b.kind != "error" or ref.kind != "error":
                    continue
                e, r = b.error, ref.error
                leaks = [s for s in (welcome_a.frame.body.device_id, "/", "another device") if s in e.message]
                if (e.message, e.field, e.status) != (r.message, r.field, r.status) or leaks:
                    self.fail(kind, what, f"the answer tells A's session from one that does not exist: "
                              f"{e.message!r} vs {r.message!r}" + (f", names {leaks}" if leaks else ""), answer=b)
            # A's session is untouched
            out["A: VERIFY after B's attempts"] = self.ask(p, kind, "A: VERIFY after B's attempts",
                                                           self.empty_verify(x, tx, p.next_rid()),
                                                           ("reply:VERIFY_REPLY",)).key
            # a closed session's token: 403 on another session, 410 on its own (it does not come back)
            self.close_session(p, kind, y, ty)
            out["VERIFY with a closed session's token"] = self.ask(
                p, kind, "VERIFY with a closed session's token", self.empty_verify(x, ty, p.next_rid()),
                ("error:403",)).key
            out["VERIFY of the closed session, its token replayed"] = self.ask(
                p, kind, "VERIFY of the closed session, its token replayed", self.empty_verify(y, ty, p.next_rid()),
                ("error:410",)).key
            self.close_session(p, kind, x, tx)
        finally:
            for q in (a_probe, b_probe):
                if q is not None:
                    q.close()
            self.probes[kind] = out

    def probe_sessions(self, tried: int) -> None:
        """Hundreds of OPENs from one device: exactly max_sessions succeed, the rest 429 (session_id); also with
        every id opened twice, and after VERIFYs of sessions the device does not hold; all reopenable after."""
        kind, limit = "sessions", self.welcome.max_sessions
        out: dict[str, Any] = {"max_sessions": limit, "tried": tried}
        p, _ = self.connect(kind)
        if p is None:
            return
        try:
            for variant in ("plain", "each id twice", "after VERIFYs of sessions never opened"):
                if variant.startswith("after"):
                    for _ in range(2 * limit + 2):
                        self.ask(p, kind, "VERIFY of a session never opened",
                                 self.empty_verify(self.new_sid("ghost"), os.urandom(32), p.next_rid()),
                                 ("error:403",))
                opened: dict[str, bytes] = {}
                refused = Counter()
                for i in range(tried if variant == "plain" else 2 * limit + 2):
                    sid = self.new_sid("many")
                    a = self.open(p, kind, sid, ("reply:OPEN_REPLY", "error:429"))
                    if a.key == "reply:OPEN_REPLY":
                        opened[sid] = a.frame.token
                        if variant == "each id twice":  # answered as the first, not counted again
                            self.open(p, kind, sid, ("reply:OPEN_REPLY", "error:429"))
                    elif a.kind == "error":
                        refused[f"{a.error.status} {a.error.field}"] += 1
                        if a.error.field != "session_id" or a.error.retry_after_s <= 0:
                            self.fail(kind, variant, "a 429 that does not name session_id with a retry-after",
                                      answer=a)
                    if not p.alive:
                        break
                out[variant] = {"opened": len(opened), "refused": dict(refused)}
                if len(opened) != limit:
                    self.fail(kind, variant, f"{len(opened)} sessions opened, the device's limit is {limit}"
                              + (" (sessions it does not hold count against it)" if len(opened) < limit else
                                 " (the limit was bypassed)"))
                for sid, token in opened.items():
                    self.close_session(p, kind, sid, token)
            again = {}
            for _ in range(limit):
                sid = self.new_sid("again")
                a = self.open(p, kind, sid)
                if a.key == "reply:OPEN_REPLY":
                    again[sid] = a.frame.token
            out["reopened_after_close"] = len(again)
            for sid, token in again.items():
                self.close_session(p, kind, sid, token)
        finally:
            p.close()
            self.probes[kind] = out

    def probe_slow_reader(self, send_s: float | None = None) -> None:
        """A connection that sends but never reads (a tiny receive buffer, no read-ahead): it opens a few sessions,
        then asks for their captions again and again (RESUME with want_caption: the largest replies a device can
        ask for) for `send_s` (default send_timeout + 1 s; longer to get past the sockets' buffers, which hold
        megabytes) and waits send_timeout + 1 s more, unread. The server's send timeout must drop it, and another
        connection must be answered meanwhile."""
        kind = "slow_reader"
        out: dict[str, Any] = {}
        p, _ = self.connect(kind, rcvbuf=4096, max_queue=1)
        other, _ = self.connect(kind, self.t.keys[1])
        if p is None or other is None:
            return
        sessions = {}
        for _ in range(min(3, self.welcome.max_sessions)):
            sid = self.new_sid("slow")
            a = self.open(p, kind, sid)
            if a.key == "reply:OPEN_REPLY":
                sessions[sid] = (a.frame.token, int(a.frame.body.prefix_tokens[0]))
        if not sessions:
            return
        frames = [wire.encode_frame(Frame(RESUME, 0, ResumeRequest(
            OpenRequest(sid, PROMPT, self._sid, Sampling(), 1, want_caption=True), np.array([tok0], np.int64), None,
            self.vocab), token)) for sid, (token, tok0) in sessions.items()]
        sent, stop = [0], threading.Event()
        send_s = send_s or self.t.send_timeout_s + 1.0
        window_s = send_s + self.t.send_timeout_s + 1.0

        def send_for_a_while():  # at the endpoint's message rate, round robin over the sessions
            t0, chunk = time.monotonic(), max(1, int(self.welcome.messages_per_s / 10))
            while not stop.is_set() and time.monotonic() - t0 < send_s:
                for _ in range(chunk):
                    data = bytearray(frames[sent[0] % len(frames)])
                    struct.pack_into("<I", data, 4, sent[0] + 1)
                    if not p.send(bytes(data)):
                        return
                    sent[0] += 1
                time.sleep(0.1)

        sender = threading.Thread(target=send_for_a_while, daemon=True, name="device-fuzz-slow-reader")
        memory = {"before": self._memory()}
        t0 = time.monotonic()
        sender.start()
        others = []
        while time.monotonic() - t0 < window_s:
            time.sleep(min(1.0, max(0.0, window_s - (time.monotonic() - t0))))
            t1 = time.perf_counter()
            a = self.ask(other, kind, "another connection while a reader is stuck",
                         struct.pack("<2sBBI", MAGIC, PROTOCOL_VERSION, 200, other.next_rid()), ("error:400",))
            others.append(round(time.perf_counter() - t1, 3))
            if a.kind != "error":
                break
        stop.set()
        sender.join(timeout=self.t.timeout_s)
        memory["unread"] = self._memory()
        self.frames[kind] += sent[0]
        got, ended = Counter(), None  # now read: the replies that made it, then how the connection ended
        deadline = time.monotonic() + self.t.timeout_s
        while time.monotonic() < deadline:
            a = p.answer(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            if a.kind in ("reply", "error"):
                got[a.key] += 1
            elif a.kind != "timeout":
                ended = a
                break
        out.update({"sent": sent[0], "answers_read_after": dict(got), "sender_blocked": sender.is_alive(),
                    "other_connection_s": others, "ended_by": ended.key if ended else "still open"})
        if self.t.server_memory is not None:
            out["server_rss_mb"] = memory
        if ended is not None and ended.kind == "close":
            self.answers[ended.key] += 1
        if ended is None or ended.kind != "close":
            self.fail(kind, "slow reader", f"not dropped: {sent[0]} frames sent in {send_s:g} s, nothing read for "
                      f"{window_s:g} s, then {sum(got.values())} answers read and the connection still open (the "
                      f"endpoint's send timeout is {self.t.send_timeout_s:g} s)")
        elif ended.key not in ("close:1008", "close:1006"):
            self.fail(kind, "slow reader", "ended by an unexpected close", answer=ended)
        p.close()
        for sid, (token, _) in sessions.items():
            self._close_elsewhere(sid, token)
        other.close()
        self.probes[kind] = out

    def _close_elsewhere(self, sid: str, token: bytes) -> None:
        """Close one of the fuzzed device's sessions from a new connection (its own may be gone)."""
        q, _ = self.connect("cleanup")
        if q is not None:
            self.close_session(q, "cleanup", sid, token)
            q.close()

    def probe_connections(self, extra: int) -> None:
        """Up to the endpoint's connection limit and `extra` beyond, held open without HELLO: refused ones close
        with 1013 and "retry after N s"; meanwhile the health route and a new connection are answered in time."""
        kind = "connections"
        limit = self.t.max_connections
        n = (limit + extra) if limit else 64
        out: dict[str, Any] = {"limit": limit, "tried": n}
        def timed(_):
            t1 = time.perf_counter()
            c = Probe.attempt(self.t)
            return c, time.perf_counter() - t1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(64, n)) as ex:
            conns, handshake_s = zip(*ex.map(timed, range(n)))
        out["open_s"] = round(time.perf_counter() - t0, 2)
        waited = sorted(x for x in handshake_s if x > QUEUED_HANDSHAKE_S)
        out["handshake_s"] = {"p50": round(float(np.median(handshake_s)), 3), "max": round(max(handshake_s), 3),
                              f"over_{QUEUED_HANDSHAKE_S:g}_s": len(waited)}
        self.frames[kind] += n
        time.sleep(0.5)
        held, refused, other, expired = [], Counter(), Counter(), 0
        for c in conns:
            if isinstance(c, Exception):
                other[f"handshake {type(c).__name__}: {str(c)[:80]}"] += 1
                continue
            a = c.answer(timeout=0.001)  # a refusal came already: the close is queued on the client
            if a.kind == "timeout":
                held.append(c)
                continue
            self.answers[a.key] += 1
            if a.key == "close:1013" and "retry after" in a.reason:
                refused[a.reason] += 1
            elif a.key == "close:4000" and "HELLO" in a.reason:
                expired += 1  # held past the endpoint's HELLO timeout while the others were being opened
            else:
                other[a.describe()] += 1
        meanwhile = {}
        if self.t.health_url:
            meanwhile["health"] = http_status(self.t.health_url, self.t.timeout_s)
        q = Probe.attempt(self.t)
        if isinstance(q, Exception):
            meanwhile["new connection"] = f"{type(q).__name__}: {str(q)[:80]}"
        else:
            meanwhile["new connection"] = self.check(kind, "a new connection at the limit", None,
                                                     q.hello(self.t.keys[1]), ("reply:WELCOME", "close:1013")).key
            q.close()
        for c in conns:
            if not isinstance(c, Exception):
                c.close()
        # the limit was reached unless connections expired (no HELLO in time) before the last ones were open and
        # none waited: a handshake held (not refused) while the others were open says the server queued it
        conclusive = bool(refused) or not expired or bool(waited)
        out.update({"held": len(held), "refused_1013": sum(refused.values()), "refusal_reasons": dict(refused),
                    "expired_before_all_open": expired, "other": dict(other), "meanwhile": meanwhile,
                    "conclusive": conclusive})
        if not conclusive:
            out["note"] = (f"the limit was not reached: {expired} connections were closed for sending no HELLO "
                           f"before all {n} were open ({out['open_s']} s); open them faster or lower the limit")
        if waited and not refused:
            self.fail(kind, "many connections", f"{len(waited)} connections waited {waited[0]:.1f}-{waited[-1]:.1f} s "
                      f"for their handshake instead of being refused with 1013 (held in a queue before the endpoint: "
                      f"its limit was never reached)")
        if other:
            self.fail(kind, "many connections", f"answers other than 1013 with a retry-after: {dict(other)}")
        if limit and len(held) > limit:
            self.fail(kind, "many connections", f"{len(held)} connections held, the limit is {limit}")
        if limit and n > limit and conclusive and not refused and not waited:
            self.fail(kind, "many connections", f"{n} connections tried, the limit is {limit}: none refused with 1013")
        if meanwhile.get("health", 200) != 200:
            self.fail(kind, "health route at the connection limit", f"answered {meanwhile['health']}")
        if not str(meanwhile["new connection"]).startswith(("reply:WELCOME", "close:1013")):
            self.fail(kind, "a new connection at the limit", f"got {meanwhile['new connection']}")
        time.sleep(0.5)
        after, _ = self.connect(kind)  # the count went back down
        out["after"] = "WELCOME" if after is not None else "refused"
        if after is not None:
            after.close()
        self.probes[kind] = out

    def probe_device_connections(self) -> None:
        """The per-device connection limit (1008 beyond it), and connections that vanish right after HELLO: they
        must not use up their device's connections."""
        kind = "device_connections"
        limit = self.t.max_connections_per_device
        out: dict[str, Any] = {"limit": limit}
        time.sleep(0.3)  # the connections closed before are let go by the server
        if limit:
            conns = []
            for _ in range(limit):
                p, _ = self.connect(kind)
                if p is not None:
                    conns.append(p)
            q = Probe.attempt(self.t)
            if not isinstance(q, Exception):
                self.frames[kind] += 1
                hello = wire.encode_frame(Frame(HELLO, 0, Hello(self.t.keys[0])))
                q.send(hello)
                out["one over the limit"] = self.check(kind, "one connection over the device's limit", hello,
                                                       q.answer(), ("close:1008",)).key
                q.close()
            out["held"] = len(conns)
            for p in conns:
                p.close()
            time.sleep(0.3)
        vanished = 0
        for _ in range(2 * (limit or 8) + 1):
            p = Probe.attempt(self.t)
            if isinstance(p, Exception):
                continue
            p.send(wire.encode_frame(Frame(HELLO, 0, Hello(self.t.keys[0]))))
            self.frames[kind] += 1
            try:  # gone without a closing handshake, before WELCOME could be read (a reset)
                p.ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                p.ws.socket.close()
            except OSError:
                pass
            p.close()
            vanished += 1
        time.sleep(0.5)
        out["vanished_after_hello"] = vanished
        p, a = self.connect(kind)
        out["after"] = a.key if a is not None else "no connection"
        if p is not None:
            p.close()
        self.probes[kind] = out


def http_status(url: str, timeout_s: float) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def summary_lines(report: dict) -> list[str]:
    """A few lines for the console."""
    w = report.get("witnesses") or {}
    lines = [f"device channel: {report['frames']} frames in {report['wall_s']} s; answers "
             + ", ".join(f"{k} {v}" for k, v in sorted(report["answers"].items(), key=lambda kv: -kv[1])[:12]),
             f"witnesses: {w.get('images_during', 0)} images during the fuzz, identical: {w.get('identical')}; "
             f"healthy after: {report['healthy'].get('ok')}",
             f"failures: {report['failure_count']}"]
    lines += [f"  {f['kind']}: {f['what']}: {f['problem']}" + (f" [{f['answer']}]" if "answer" in f else "")
              for f in report["failures"][:10]]
    return lines
