"""A `CloudClient` over the device endpoint: the wire codec on a WebSocket, with reconnection and resumption.

    conn = DeviceConnection("ws://localhost:8000/v1/device/sessions", key="ciar-dev-device-key", vocab_size=1024)
    reply = conn.open(OpenRequest(...))        # -> OpenReply (numpy arrays; array=torch.from_numpy for torch)
    reply = conn.verify(VerifyRequest(...))    # -> VerifyReply
    conn.close(session_id)

The same four calls as every `CloudClient` (`ciar.collab.protocol`): the device loop (`ciar_device.loop`) runs
over it on a real device, and a simulated phone (`CollabDecoder`) can too. Synchronous, one request at a time (a device's loop waits for
each reply), any number of sessions on one connection.

Resumption. The connection remembers, per open session, its OpenRequest, its session token and the committed tokens
both sides agree on (prefix, then new + accepted drafts + next + burst after each verify), with the interval features
injected along the way. When the socket drops, it reconnects (backoff, `retries` attempts). A request that was in
flight when the socket dropped may or may not have reached the verifier, so the session is re-created from its
history (RESUME, which replaces any copy the verifier still holds) and the request is sent again; the same happens
when the verifier answers 410 (it lost the session: a replica restarted, an idle eviction), up to `LOST_RETRIES`
times a request (the replica a session was resumed on may be lost in turn). Position-keyed
randomness on the cloud makes the finished image bit-identical to an uninterrupted one. An OPEN that was in flight is
sent again as it is: the verifier answers a repeated OPEN as it answered the first (or, when the first never reached
it, opens the session; its prefix tokens are drawn from the session's seed: the same tokens). A CLOSE is sent again
too (closing a session that is not held does nothing). The retry semantics of every message: docs/architecture.md §5.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ciar_device import wire
from ciar_device.history import SessionHistory
from ciar_device.policy import CostHint
from ciar_device.wire import (CLOSE, ERROR, HELLO, OPEN, RESUME, VERIFY, WELCOME, CloseRequest, Frame, Hello,
                              InjectedFeatures, OpenReply, OpenRequest, ResumeRequest, VerifyReply, VerifyRequest)

DEFAULT_PATH = "/v1/device/sessions"
LOST_RETRIES = 3  # a VERIFY whose session the verifier lost (410) is resumed and sent again up to this many times


class ServerError(Exception):
    """An ERROR frame: `status` (HTTP-like), `field`, `retry_after_s`."""

    def __init__(self, status: int, message: str, field: str = "", retry_after_s: float = 0.0):
        super().__init__(f"{status}: {message}" + (f" (field {field})" if field else ""))
        self.status, self.field, self.retry_after_s = status, field, retry_after_s


class SessionLost(ServerError):
    """410: the verifier does not hold the session (resume it from its history)."""


class ConnectionRefused(ConnectionError):
    """The server closed the connection for good: unknown key, another protocol version, a policy. `code`, `reason`."""

    def __init__(self, code: int, reason: str):
        super().__init__(f"connection closed by the server ({code}): {reason}")
        self.code, self.reason = code, reason


class _Dropped(Exception):
    """The socket went away (not a refusal): reconnect."""


FATAL_CLOSES = (wire.CLOSE_UNAUTHORIZED, wire.CLOSE_VERSION, wire.CLOSE_PROTOCOL, wire.CLOSE_TOO_BIG)


class _Session(SessionHistory):
    """A session's history plus the token the verifier issued for it (sent with every later request)."""

    def __init__(self, request: OpenRequest, token: bytes, tokens: list[int]):
        super().__init__(request, tokens)
        self.token = token


@dataclass
class Exchange:
    """One request/reply as the device saw it (the load test's figures)."""

    kind: str
    up_bytes: int
    down_bytes: int
    seconds: float  # wall time from send to reply


class DeviceConnection:
    def __init__(self, url: str, key: str, vocab_size: int, *, array: Callable[[np.ndarray], Any] | None = None,
                 client_name: str = "ciar-device/0.1", retries: int = 8, backoff_s: float = 0.2,
                 timeout_s: float = 300.0, connect_timeout_s: float = 10.0):
        """`url`: ws://HOST:PORT (the endpoint's path is added when missing) or the full endpoint URL. `array`:
        what decoded arrays become (numpy by default; `torch.from_numpy` where a caller wants tensors)."""
        self.url = url if url.rstrip("/").endswith(DEFAULT_PATH) else url.rstrip("/") + DEFAULT_PATH
        self.key, self.vocab_size, self.array = key, int(vocab_size), array
        self.client_name = client_name
        self.retries, self.backoff_s, self.timeout_s, self.connect_timeout_s = retries, backoff_s, timeout_s, \
            connect_timeout_s
        self.ws = None
        self.welcome = None
        self.handshake_s: float | None = None  # the last HELLO -> WELCOME round trip (the link's first sample)
        self.sessions: dict[str, _Session] = {}
        self._rid = 0
        self.reconnects = 0  # connections made after the first
        self.resumes = 0  # sessions re-created from their history
        self.exchanges: list[Exchange] = []

    # ------------------------------------------------------------------ the socket
    def connect(self) -> None:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        if self.ws is not None:
            return
        try:
            ws = connect(self.url, max_size=None, compression=None, open_timeout=self.connect_timeout_s, proxy=None,
                         ping_interval=None, legacy=True)
        except OSError as e:
            raise _Dropped(f"cannot connect to {self.url}: {e}") from e
        try:
            t = time.perf_counter()
            ws.send(wire.encode_frame(Frame(HELLO, 0, Hello(self.key, self.client_name))))
            frame = wire.decode_frame(ws.recv(timeout=self.connect_timeout_s))
            self.handshake_s = time.perf_counter() - t
        except ConnectionClosed as e:
            raise self._closed(e) from None
        except TimeoutError:
            ws.close()
            raise _Dropped("no WELCOME from the server") from None
        if frame.type != WELCOME:
            ws.close()
            raise ConnectionRefused(wire.CLOSE_PROTOCOL, f"expected WELCOME, got {frame.name}")
        if self.welcome is not None:
            self.reconnects += 1
        self.ws, self.welcome = ws, frame.body

    def cost_hint(self) -> CostHint | None:
        """The verifier's recent costs as the WELCOME carried them (connecting first), None where it had none."""
        self._retrying(self.connect)
        w = self.welcome
        hint = CostHint(w.verify_s or None, w.step_s or None, w.queue_s or None)
        return hint if hint.span_s is not None or hint.step_s is not None else None

    def _closed(self, e) -> Exception:
        rcvd = getattr(e, "rcvd", None)
        if rcvd is not None and rcvd.code in FATAL_CLOSES + (wire.CLOSE_POLICY,):
            return ConnectionRefused(rcvd.code, rcvd.reason)
        if rcvd is not None and rcvd.code == wire.CLOSE_OVERLOADED:
            return _Dropped(rcvd.reason)
        return _Dropped(str(e))

    def disconnect(self) -> None:
        """Close the socket (the sessions stay open on the verifier until closed or idle)."""
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:  # noqa: BLE001
                pass

    def drop(self) -> None:
        """Cut the socket without a closing handshake (tests: a tunnel, a lost Wi-Fi)."""
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.socket.close()

    def _exchange(self, ftype: int, body, token: bytes = b"") -> Frame:
        """Send one request, wait for its reply (other frames are ignored); ERROR -> ServerError / SessionLost."""
        from websockets.exceptions import ConnectionClosed

        self.connect()
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        data = wire.encode_frame(Frame(ftype, self._rid, body, token))
        t0 = time.perf_counter()
        try:
            self.ws.send(data)
            while True:
                raw = self.ws.recv(timeout=self.timeout_s)
                reply = wire.decode_frame(raw, array=self.array)
                if reply.request_id == self._rid:
                    break
        except ConnectionClosed as e:
            self.ws = None
            raise self._closed(e) from None
        except (OSError, TimeoutError) as e:
            self.drop()
            raise _Dropped(str(e)) from None
        self.exchanges.append(Exchange(wire.TYPE_NAMES[ftype], len(data), len(raw), time.perf_counter() - t0))
        if reply.type == ERROR:
            b = reply.body
            cls = SessionLost if b.status == 410 else ServerError
            raise cls(b.status, b.message, b.field, b.retry_after_s)
        return reply

    def _retrying(self, call: Callable[[], Any], on_drop: Callable[[], None] | None = None):
        """call() until it succeeds: reconnect after a drop (then on_drop()), wait out 429 / 503 answers."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except _Dropped:
                if attempt == self.retries:
                    raise ConnectionError(f"lost the connection to {self.url} {self.retries + 1} times") from None
                time.sleep(min(2.0, self.backoff_s * 2 ** attempt))
                self.ws = None
                if on_drop is not None:
                    try:
                        self.connect()
                        on_drop()
                    except _Dropped:
                        continue
                    except ServerError as e:  # a busy or lost replica: the next attempt finds the session's state
                        if e.status not in (429, 503) or attempt == self.retries:
                            raise
                        time.sleep(max(e.retry_after_s, self.backoff_s))
            except ServerError as e:
                if e.status not in (429, 503) or attempt == self.retries:
                    raise
                time.sleep(max(e.retry_after_s, self.backoff_s))

    # ------------------------------------------------------------------ CloudClient
    def open(self, request: OpenRequest) -> OpenReply:
        sid = request.session_id
        # an OPEN whose reply was lost is sent again as it is: the verifier answers a repeated OPEN as the first
        frame = self._retrying(lambda: self._exchange(OPEN, request))
        self.sessions[sid] = _Session(replace(request, want_caption=False), frame.token,
                                      wire._np(frame.body.prefix_tokens, np.int64).reshape(-1).tolist())
        return frame.body

    def verify(self, request: VerifyRequest) -> VerifyReply:
        s = self.sessions.get(request.session_id)
        if s is None:
            raise SessionLost(410, f"session {request.session_id!r} was not opened on this connection")
        extra = [0.0, 0]  # cloud seconds and forwards of resumes made for this request

        def resume():
            rep = self._resume(s)
            extra[0] += rep.cloud_s
            extra[1] += rep.forward_passes

        def attempt():  # (lost again under the retry: the replica it was resumed on went too; resume again)
            for lost in range(LOST_RETRIES + 1):
                try:
                    return self._exchange(VERIFY, request, s.token)
                except SessionLost:
                    if lost == LOST_RETRIES:
                        raise
                    resume()

        frame = self._retrying(attempt, on_drop=resume)
        reply = frame.body
        if extra[1]:
            reply = replace(reply, resumed=True, cloud_s=reply.cloud_s + extra[0],
                            forward_passes=reply.forward_passes + extra[1])
        s.commit(request, reply)
        return reply

    def _resume(self, s: _Session) -> OpenReply:
        self.resumes += 1
        body = ResumeRequest(s.request, s.history(), s.injected(), self.vocab_size)
        return self._exchange(RESUME, body, s.token).body

    def resume(self, request: OpenRequest, history, injected: InjectedFeatures | None = None) -> OpenReply:
        """Re-create a session from its committed history (the CloudClient call; `verify` does it by itself)."""
        s = self.sessions.get(request.session_id)
        if s is None:
            raise SessionLost(410, f"session {request.session_id!r} was not opened on this connection: no token")
        h = SessionHistory.resumed(replace(request, want_caption=False), history, injected)
        s.request, s.tokens, s.positions, s.hidden, s.features = h.request, h.tokens, h.positions, h.hidden, h.features
        body = ResumeRequest(request, s.history(), s.injected(), self.vocab_size)
        return self._retrying(lambda: self._exchange(RESUME, body, s.token)).body

    def close(self, session_id: str) -> None:
        """Close a session, best effort: sent on a live connection only (a close never reconnects: after the link was
        lost the verifier frees the idle session itself); the local state goes either way."""
        s = self.sessions.pop(session_id, None)
        if s is None or self.ws is None:
            return
        try:
            self._retrying(lambda: self._exchange(CLOSE, CloseRequest(session_id), s.token))
        except (ServerError, ConnectionError):
            pass  # best effort: the verifier frees idle sessions itself
