"""The fuzzed device's side of the channel and the run's ledger: `Recorder` connects, sends, checks every answer
against what is allowed (`check`: a hang, a 5xx other than 503, a 1011, garbage, an answer to another request id,
an answer not allowed) and records it: frames by kind, answers by key, failures, the probes' figures and the
session tokens seen. The frame fuzz (`frames`) and the fixed probes (`protocol`, `connections`) all ask through it."""

from __future__ import annotations

import base64
import time
from collections import Counter
from typing import Any

import numpy as np

from ciar_device import wire
from ciar_device.wire import (CLOSE, HELLO, OPEN, VERIFY, CloseRequest, Frame, Hello, OpenRequest, Sampling,
                              VerifyRequest, Welcome)
from loadtests.device_fuzz.channel import PROMPT, Answer, Probe, Target, answer_allowed, http_status, rid_of

MAX_FAILURES_KEPT = 50
FULL_FRAME_BYTES = 16 << 10  # a hang's or a server error's frame is kept whole (base64) up to this size


class Recorder:
    """Asks the endpoint of `target` as the fuzzed device (`t.keys[0]`) and records what it answers."""

    def __init__(self, target: Target, seed: int = 0):
        self.t, self.seed = target, seed
        self.frames: Counter = Counter()  # frames sent, by kind
        self.answers: Counter = Counter()  # answers, by key
        self.failures: list[dict] = []
        self.failure_count = 0
        self.hangs: Counter = Counter()
        self.probes: dict[str, Any] = {}
        self.tokens_seen: set[str] = set()
        self.welcome: Welcome | None = None
        self.vocab: int | None = None
        self.sid_count = 0  # session ids made (`new_sid`)

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
        elif a.frame is not None and rid_of(data) is not None and a.frame.request_id != rid_of(data):
            problem = f"answer to request id {a.frame.request_id}, the frame had {rid_of(data)}"
        elif allowed is not None and not answer_allowed(a.key, allowed):
            problem = f"expected {' or '.join(allowed)}"
        if problem:
            self.fail(kind, what, problem, data, a)
        if a.key == "error:429" and not a.error.field:
            time.sleep(min(a.error.retry_after_s, 0.5))  # rate limited (not a session limit): a polite fuzzer waits
        return a

    def settle(self, pause_s: float, at_most: int | None = None) -> None:
        """The connections closed so far are let go by the server: wait until the fuzzed device holds none (or, with
        `at_most`, the endpoint holds no more than that many in all), when the endpoint's counts are reachable
        (`Target.endpoint_connections`; the probe's bound is the hang guard); else pause `pause_s`."""
        count = self.t.endpoint_connections
        if count is None:
            time.sleep(pause_s)
            return
        deadline = time.monotonic() + self.t.timeout_s
        while time.monotonic() < deadline and (count(self.t.keys[0]) > 0 if at_most is None else
                                               count(None) > at_most):
            time.sleep(0.02)

    def connections_now(self) -> int | None:
        """The endpoint's connections in all, when reachable."""
        return self.t.endpoint_connections(None) if self.t.endpoint_connections is not None else None

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
        self.sid_count += 1
        return f"{prefix}-{self.seed}-{self.sid_count}"

    def open(self, p: Probe, kind: str, sid: str, allowed=("reply:OPEN_REPLY",)) -> Answer:
        req = OpenRequest(sid, PROMPT, self.sid_count, Sampling(), 1, want_caption=False)
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

    def verifier_sessions(self) -> int | None:
        if self.t.verifier_sessions is None:
            return None
        try:
            return int(self.t.verifier_sessions())
        except Exception as e:  # noqa: BLE001
            self.fail("sessions", "verifier sessions", f"could not ask the verifier: {type(e).__name__}")
            return None

    def memory(self) -> dict | None:
        try:
            return self.t.server_memory() if self.t.server_memory is not None else None
        except Exception as e:  # noqa: BLE001 - a figure, not a check
            return {"error": type(e).__name__}

    def secrets(self) -> list[str]:
        """The device keys and every session token seen (hex): none may appear in a log."""
        return list(self.t.keys) + sorted(self.tokens_seen)

    def close_elsewhere(self, sid: str, token: bytes) -> None:
        """Close one of the fuzzed device's sessions from a new connection (its own may be gone)."""
        q, _ = self.connect("cleanup")
        if q is not None:
            self.close_session(q, "cleanup", sid, token)
            q.close()
