"""One raw WebSocket to the device endpoint and what it may answer: the `Target` (the endpoint and what the fuzz knows
about it), an `Answer` to a frame, the `Probe` (one connection, every wait bounded) and the oracle `expected_answers`
(the answers ciar_device.wire and services.device_endpoint allow for a frame)."""

from __future__ import annotations

import socket
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

from ciar_device import wire
from ciar_device.connection import DEFAULT_PATH
from ciar_device.wire import (BODY_TYPES, CLOSE, ERROR, HELLO, MAGIC, OPEN, PROTOCOL_VERSION, RESUME, VERIFY,
                              ErrorReply, Frame, Hello)

PROMPT = "a small red circle at the top on a gray background"
CLIENT_TYPES = (OPEN, VERIFY, RESUME, CLOSE)
ANY_REQUEST_ANSWER = ("reply:", "error:400", "error:403", "error:409", "error:410", "error:422", "error:429",
                      "error:503")


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
    # connections the endpoint holds now (all of them, or a device key's), if reachable: a probe waits for the server
    # to let closed ones go (`Recorder.settle`) instead of a fixed pause
    endpoint_connections: Callable[[str | None], int] | None = None

    @property
    def ws_url(self) -> str:
        return self.url if self.url.rstrip("/").endswith(DEFAULT_PATH) else self.url.rstrip("/") + DEFAULT_PATH


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


def answer_allowed(key: str, allowed) -> bool:
    return any(key.startswith(a) if a.endswith(":") else key == a for a in allowed)


def expected_answers(data: bytes | str, max_frame_bytes: int, hello_done: bool = True) -> tuple[str, ...]:
    """The answers the endpoint may give to `data` (as ciar_device.wire and services.device_endpoint define them):
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


def rid_of(data) -> int | None:
    return struct.unpack_from("<I", data, 4)[0] if isinstance(data, bytes) and len(data) >= 8 else None


def http_status(url: str, timeout_s: float) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"
