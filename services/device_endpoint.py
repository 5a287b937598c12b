"""The device endpoint: real devices (phones, laptops, browsers) run the CIAR loop against the verifier pool.

    ws://HOST:8000/v1/device/sessions     (a route of the Ingress; `python -m ciar_device` speaks it)

One WebSocket carries any number of a device's sessions; every message is one binary frame of `ciar_device.wire`
(the codec the cluster and the torch-free client share). The connection starts with HELLO (the device key) and the
server answers WELCOME (the device's id and the limits below) or closes with a reason. Then OPEN / VERIFY / RESUME /
CLOSE frames are forwarded to the Verifier deployment exactly as the simulated devices' calls are: through its
handle, routed by session (Ray's consistent-hash router), so real and simulated devices share the engine's forwards.
Every request is answered with its reply or an ERROR frame carrying the request id and an HTTP-like status.

Why a WebSocket: it goes through Serve's HTTP proxy and any L7 load balancer as one long-lived connection, browsers
speak it (issue 28's page), and a device's exchanges are small request/reply messages on one session, where gRPC's
HTTP/2 streams would add a second server and a protobuf toolchain to every client without a gain in bytes.

Isolation. Device keys are checked like the API keys (SHA-256 digests in the config or `$CIAR_DEVICE_KEYS`; never
logged). The session ids a device chooses are scoped by its device id on the verifier (`<device>/<session>`), so no
device can name another's session; the verifier's session token (`ciar.engine.service.session_token`, issued at OPEN)
must come with every VERIFY / RESUME / CLOSE (403 otherwise). Limits per device: open sessions (429), frame size (close
1009), message rate (429 with the time to wait; a device that keeps going past it is closed, 1008), connections (close
1008); an idle connection is closed (1001); an ingress at its connection limit closes new ones with 1013 and "retry
after N s". No stack trace, key or session token is ever logged or sent: errors are logged by type.

Resumption. Sessions outlive their connection (until the verifier's idle timeout): a device that reconnects goes
on with the same session ids and tokens; one that lost a reply in flight, or finds its session gone (410), sends
RESUME with its committed history (`ciar_device.connection` does both) and gets the same image (docs/architecture.md,
Determinism). Every message is safe to send again after a lost reply (an OPEN is answered
as the first was: `ciar.engine.service`); the table is in docs/architecture.md §5. Every call to the verifier has a
deadline (`verifier_call_timeout_s`); a request in flight when its connection closes is cancelled on the verifier.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import time
import weakref
from dataclasses import replace
from typing import Any, Protocol

from starlette.websockets import WebSocketDisconnect, WebSocketState

from ciar.engine.service import session_token  # noqa: F401 - the token the Verifier issues (re-exported)
from ciar_device import wire
from ciar_device.wire import (CLOSE, CLOSED, ERROR, HELLO, OPEN, OPEN_REPLY, RESUME, VERIFY, VERIFY_REPLY, WELCOME,
                              CloseReply, ErrorReply, Frame, VersionError, WireError, Welcome)
from services import errors
from services.endpoint_limits import DeviceRecord, EndpointLimits, TokenBucket

logger = logging.getLogger("ray.serve")
SESSION_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
IDLE = object()  # what _receive returns when nothing came in time (an empty frame is b"", a malformed frame)


def device_id_of(digest: str) -> str:
    """A device's id: derived from its key's digest (not the digest itself, which a config holds)."""
    return "d" + hashlib.sha256(f"ciar-device|{digest}".encode()).hexdigest()[:15]


class VerifierBackend(Protocol):
    """The verifier pool as the endpoint calls it (services.verifier.Verifier's methods, awaited)."""

    async def open(self, request, *, session_id: str, device_id: str) -> tuple[Any, str]: ...

    async def verify(self, request, *, session_id: str, device_id: str, token: str) -> Any: ...

    async def resume(self, request, history, injected, *, session_id: str, device_id: str, token: str) -> Any: ...

    async def close(self, *, session_id: str, device_id: str, token: str) -> None: ...

    async def cost_hint(self) -> Any: ...  # the verifier's recent costs (ciar_device.policy.CostHint) or None


class RequestFailed(Exception):
    """An ERROR frame to answer (status, message, field, retry-after)."""

    def __init__(self, status: int, message: str, field: str = "", retry_after_s: float = 0.0):
        super().__init__(message)
        self.status, self.field, self.retry_after_s = status, field, retry_after_s


class _Close(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def _cluster_decoding() -> dict:
    """How the cluster decodes a frame: torch tensors and SamplingParams (validated on construction)."""
    import torch

    from ciar.decoding.sampling import SamplingParams

    return {"array": torch.from_numpy, "sampling": SamplingParams}


class DeviceEndpoint:
    """Serves device connections (`serve(websocket)`, a Starlette WebSocket) against a VerifierBackend."""

    HINT_TTL_S = 1.0  # a WELCOME's cost hint is at most this old
    HINT_TIMEOUT_S = 2.0

    def __init__(self, backend: VerifierBackend, key_digests: list[str], limits: EndpointLimits | None = None,
                 server: str = "ciar", observe=None):
        self.backend = backend
        self.keys = {bytes.fromhex(d): device_id_of(d) for d in key_digests}
        self.limits = limits or EndpointLimits()
        self.server = server
        self.devices: dict[str, DeviceRecord] = {}
        self.connections = 0
        self.counts: dict[str, int] = {}  # frames by type, errors by status, closes by code (stats, tests)
        self._observe = observe  # optional callback(event, label) feeding Prometheus
        # one send at a time per connection: concurrent sends on a backpressured socket fail in the transport
        self._send_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a connection's closing handshake
        self._decoding = _cluster_decoding()
        self._hint, self._hint_at = None, -math.inf  # the verifier's last cost hint and when it was asked (WELCOME)

    async def cost_hint(self):
        """The verifier's recent costs for a WELCOME (`CostHint`, None when it has none or does not answer within
        `HINT_TIMEOUT_S`), asked at most once per `HINT_TTL_S` once it has one: a storm of connections costs the
        verifier one call."""
        now = time.monotonic()
        if self._hint is None or now - self._hint_at >= self.HINT_TTL_S:
            self._hint_at = now
            ask = getattr(self.backend, "cost_hint", None)
            try:
                self._hint = await asyncio.wait_for(ask(), self.HINT_TIMEOUT_S) if ask is not None else None
            except Exception:  # noqa: BLE001 - a hint: without it the device's first image drafts as calibrated
                logger.warning("no cost hint from the verifier", exc_info=True)
                self._hint = None
        return self._hint

    def device_of(self, key: str) -> str | None:
        """The device id of a device key, None for an unknown key (compared by digest, in constant time per key)."""
        digest = hashlib.sha256(key.encode()).digest()
        return next((dev for d, dev in self.keys.items() if hmac.compare_digest(d, digest)), None)

    def _count(self, event: str, label: str) -> None:
        key = f"{event}:{label}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self._observe is not None:
            self._observe(event, label)

    # ------------------------------------------------------------------ one connection
    async def serve(self, ws) -> None:
        await ws.accept()
        lim = self.limits
        if self.connections >= lim.max_connections:
            await self._close(ws, wire.CLOSE_OVERLOADED, f"server overloaded: retry after {lim.retry_after_s:g} s")
            return
        self.connections += 1
        device_id = None
        try:
            device_id = await self._hello(ws)
            await self._loop(ws, device_id)
        except _Close as c:
            await self._close(ws, c.code, c.reason)
        except WebSocketDisconnect:  # the device went away (a reply could not be sent): nobody to tell
            pass
        except Exception as e:  # noqa: BLE001 - a socket error or a bug: never a traceback with a token in it
            logger.warning("device connection ended by %s", type(e).__name__)
            await self._close(ws, 1011, "internal error")
        finally:
            closing = self._closing.pop(ws, None)
            if closing is not None:  # the connection counts until its closing handshake has ended
                await closing
            self.connections -= 1
            if device_id is not None:
                self.devices[device_id].connections -= 1

    async def _close(self, ws, code: int, reason: str) -> None:
        """Close the connection with `code`: the closing handshake runs to its end even when the caller is cancelled
        (a request's task, when the connection's loop ends), and `serve` waits for it. Against a peer that does not
        read, only that end ends the TCP connection (the server's close timeouts, then a reset): cut short, the
        server would wait to flush the unread replies for as long as the peer lives."""
        if self._ended(ws):
            return  # closed already (by a request whose reply could not be delivered)
        self._count("close", str(code))
        closing = self._closing[ws] = asyncio.ensure_future(self._handshake(ws, code, reason))
        await asyncio.shield(closing)

    async def _handshake(self, ws, code: int, reason: str) -> None:
        try:
            # after the reply being sent, if any (its own send timeout bounds it): websockets lets one coroutine wait
            # on a full socket at a time, and a close that meets another's wait fails at once, its handshake never
            # run to its end
            async with self._send_lock(ws):
                await ws.close(code=code, reason=reason[:120])
        except Exception:  # noqa: BLE001 - already closed
            pass

    def _ended(self, ws) -> bool:
        """Closed, or closing (`_close`): nothing more is read from it or sent to it."""
        return getattr(ws, "application_state", None) == WebSocketState.DISCONNECTED or ws in self._closing

    def _send_lock(self, ws) -> asyncio.Lock:
        """The connection's one send at a time (a close waits for it too)."""
        return self._send_locks.setdefault(ws, asyncio.Lock())

    async def _receive(self, ws, timeout: float | None):
        """The next binary frame; None when the peer went away, IDLE when nothing came in `timeout` s; _Close on a
        text frame or an oversized one."""
        try:
            msg = await asyncio.wait_for(ws.receive(), timeout)
        except asyncio.TimeoutError:
            return IDLE
        if msg["type"] == "websocket.disconnect" or self._ended(ws):  # gone, or closed (closing) by a request whose
            return None  # reply could not be delivered: nothing more is read or answered
        data = msg.get("bytes")
        if data is None:
            raise _Close(wire.CLOSE_PROTOCOL, "binary frames only (ciar_device.wire)")
        if len(data) > self.limits.max_frame_bytes:
            raise _Close(wire.CLOSE_TOO_BIG, f"frame of {len(data)} bytes over the {self.limits.max_frame_bytes}-byte "
                                             "limit")
        return data

    async def _send(self, ws, frame: Frame) -> None:
        lock = self._send_lock(ws)

        async def send(data: bytes) -> None:
            async with lock:
                if self._ended(ws):
                    raise WebSocketDisconnect(1006)  # closed meanwhile (a slow reader): nobody to answer
                await ws.send_bytes(data)

        try:  # the wait for the lock counts: behind a reply that cannot be delivered, none can
            await asyncio.wait_for(send(wire.encode_frame(frame)), self.limits.send_timeout_s)
        except asyncio.TimeoutError:
            raise _Close(wire.CLOSE_POLICY, "slow reader: a reply could not be delivered in time") from None

    async def _hello(self, ws) -> str:
        data = await self._receive(ws, self.limits.hello_timeout_s)
        if data is None or data is IDLE or not data:
            raise _Close(wire.CLOSE_PROTOCOL, "expected a HELLO frame first")
        try:
            frame = wire.decode_frame(data)
        except VersionError as e:
            raise _Close(wire.CLOSE_VERSION, str(e)) from None
        except WireError as e:
            raise _Close(wire.CLOSE_PROTOCOL, f"bad HELLO: {e}") from None
        if frame.type != HELLO:
            raise _Close(wire.CLOSE_PROTOCOL, f"expected a HELLO frame first, got {frame.name}")
        device_id = self.device_of(frame.body.key)
        if device_id is None:
            self._count("auth", "refused")
            raise _Close(wire.CLOSE_UNAUTHORIZED, "unknown device key")
        dev = self.devices.setdefault(device_id, DeviceRecord())
        if dev.connections >= self.limits.max_connections_per_device:
            raise _Close(wire.CLOSE_POLICY, f"too many connections for this device "
                                            f"({self.limits.max_connections_per_device})")
        dev.connections += 1
        lim = self.limits
        try:
            hint = await self.cost_hint()
            await self._send(ws, Frame(WELCOME, frame.request_id, Welcome(
                device_id, lim.max_frame_bytes, lim.max_sessions_per_device, lim.messages_per_s, lim.idle_timeout_s,
                self.server, *((hint.span_s or 0.0, hint.step_s or 0.0, hint.queue_s or 0.0) if hint else ()))))
        except BaseException:  # gone before its WELCOME: not connected (its connection must not stay counted)
            dev.connections -= 1
            raise
        return device_id

    async def _loop(self, ws, device_id: str) -> None:
        lim = self.limits
        bucket = TokenBucket(lim.messages_per_s, lim.burst)
        inflight: set[asyncio.Task] = set()
        refused = 0
        try:
            while True:
                data = await self._receive(ws, lim.idle_timeout_s)
                if data is None:
                    return
                if data is IDLE:  # nothing for idle_timeout_s
                    if inflight:
                        continue
                    raise _Close(wire.CLOSE_GOING_AWAY, f"idle for {lim.idle_timeout_s:g} s")
                wait = bucket.take()
                try:
                    version, ftype, rid = wire.decode_header(data)
                except WireError as e:
                    raise _Close(wire.CLOSE_PROTOCOL, str(e)) from None
                if version != wire.PROTOCOL_VERSION:
                    raise _Close(wire.CLOSE_VERSION, str(VersionError(version)))
                if wait:
                    refused += 1
                    if refused > lim.max_refused:
                        raise _Close(wire.CLOSE_POLICY, "message rate limit exceeded")
                    await self._error(ws, rid, RequestFailed(429, f"over {lim.messages_per_s:g} messages/s",
                                                             retry_after_s=wait))
                    continue
                refused = 0
                if len(inflight) >= lim.max_sessions_per_device + 1:
                    await self._error(ws, rid, RequestFailed(429, "too many requests in flight on this connection",
                                                             retry_after_s=lim.retry_after_s))
                    continue
                task = asyncio.ensure_future(self._request(ws, device_id, rid, data))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
        finally:
            for t in inflight:
                t.cancel()

    async def _error(self, ws, rid: int, e: RequestFailed, session_id: str = "") -> None:
        self._count("error", str(e.status))
        await self._send(ws, Frame(ERROR, rid, ErrorReply(e.status, str(e), e.retry_after_s, session_id, e.field)))

    async def _request(self, ws, device_id: str, rid: int, data: bytes) -> None:
        """Answer one request (a task of the connection's loop); a reply that cannot be delivered in time ends the
        connection here (the loop, waiting for the next frame, then sees it closed)."""
        try:
            await self._answer(ws, device_id, rid, data)
        except _Close as c:
            await self._close(ws, c.code, c.reason)
        except WebSocketDisconnect:  # the device went away: nobody to answer
            pass

    async def _answer(self, ws, device_id: str, rid: int, data: bytes) -> None:
        sid = ""
        try:
            try:
                frame = wire.decode_frame(data, **self._decoding)
            except WireError as e:
                raise RequestFailed(422 if e.field not in (None, "header", "body", "type") else 400, str(e),
                                    e.field or "") from None
            self._count("frame", frame.name)
            body = frame.body
            sid = getattr(body, "session_id", "") or getattr(getattr(body, "request", None), "session_id", "")
            reply = await self._dispatch(device_id, frame, sid)
            await self._send(ws, reply)
        except RequestFailed as e:
            await self._error(ws, rid, e, sid)
        except (_Close, WebSocketDisconnect, asyncio.CancelledError):  # the reply's delivery, not the request, failed
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status; logged by type only
            await self._error(ws, rid, self._failure(e, device_id, sid, wire.decode_header(data)[1]), sid)

    async def _dispatch(self, device_id: str, frame: Frame, sid: str) -> Frame:
        t, rid, body = frame.type, frame.request_id, frame.body
        if t not in (OPEN, VERIFY, RESUME, CLOSE):
            raise RequestFailed(400, f"a device does not send {frame.name} frames", "type")
        if not SESSION_ID.match(sid):
            raise RequestFailed(422, "session_id must be 1-64 characters of A-Z a-z 0-9 . _ -", "session_id")
        scoped = f"{device_id}/{sid}"
        dev = self.devices[device_id]
        token = frame.token.hex()
        if t == VERIFY:
            reply = await self.backend.verify(replace(body, session_id=scoped), session_id=scoped,
                                              device_id=device_id, token=token)
            dev.sessions[sid] = time.monotonic()  # after the verifier answered: a refused VERIFY counts nothing
            return Frame(VERIFY_REPLY, rid, replace(reply, session_id=sid))
        if t in (OPEN, RESUME):
            live = dev.live(self.limits.session_ttl_s)
            fresh = sid not in dev.sessions
            if fresh and live >= self.limits.max_sessions_per_device:
                raise RequestFailed(429, f"this device has {self.limits.max_sessions_per_device} open sessions: "
                                    "close one first", "session_id", self.limits.retry_after_s)
            dev.sessions[sid] = time.monotonic()  # counted from now: concurrent OPENs cannot pass the limit together
            try:
                if t == OPEN:
                    reply, issued = await self.backend.open(replace(body, session_id=scoped), session_id=scoped,
                                                            device_id=device_id)
                    return Frame(OPEN_REPLY, rid, replace(reply, session_id=sid), bytes.fromhex(issued))
                reply = await self.backend.resume(replace(body.request, session_id=scoped), body.history,
                                                  body.injected, session_id=scoped, device_id=device_id, token=token)
                return Frame(OPEN_REPLY, rid, replace(reply, session_id=sid), frame.token)
            except BaseException:
                if fresh:  # uncount only what this frame counted (an OPEN of an id already open keeps it counted)
                    dev.sessions.pop(sid, None)
                raise
        await self.backend.close(session_id=scoped, device_id=device_id, token=token)
        dev.sessions.pop(sid, None)
        return Frame(CLOSED, rid, CloseReply(sid))

    def _failure(self, e: BaseException, device_id: str, sid: str, ftype: int = 0) -> RequestFailed:
        """A backend error -> the ERROR to answer, by the one table both the socket and the HTTP API read
        (`services.errors`). Messages name the device's own session id, never the scoped one. A VERIFY whose effect
        is unknown (its call timed out, its replica was lost) is answered 410 (RESUME, then send it again); OPEN,
        RESUME and CLOSE are safe to send again as they are (503 with a retry-after: a 410 to a RESUME would tell
        the device to resume, which is what it was doing)."""
        rule = errors.answer(e, errors.SOCKET)
        cause = errors.root_cause(e)
        verify = ftype == VERIFY and rule.verify_status is not None
        msg = rule.text(errors.SOCKET, verify, cause=cause, sid=sid, name=type(cause).__name__)
        if rule is errors.INTERNAL:
            logger.warning("device request failed: %s", type(cause).__name__)
        return RequestFailed(rule.verify_status if verify else rule.status, msg.replace(f"{device_id}/", ""),
                             rule.field or "", self.limits.retry_after_s if rule.retry and not verify else 0.0)


