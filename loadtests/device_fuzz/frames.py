"""The hypothesis frames (`fuzz_frames`): about N frames shared among the kinds as `FRAME_KINDS` says, each kind on
a connection of its own (a new one after a close), every answer checked against `expected_answers`; a kind stops
after `HANGS_PER_KIND` hangs."""

from __future__ import annotations

from typing import Callable

from loadtests.device_fuzz.channel import ANY_REQUEST_ANSWER, Probe, expected_answers
from loadtests.device_fuzz.recorder import Recorder
from loadtests.device_fuzz.strategies import FRAME_KINDS, frame_strategies, run_examples

HANGS_PER_KIND = 3  # a kind stops after this many hangs (each costs timeout_s)


def fuzz_frames(fuzz: Recorder, frames: int, round_: int = 0) -> None:
    """About `frames` hypothesis frames (at least one of each kind), each kind with its own seed (another in each
    `round_`: a run that goes on fuzzing sends new frames)."""
    strategies = frame_strategies(fuzz.vocab or 2, fuzz.welcome.max_frame_bytes)
    for i, (kind, share) in enumerate(FRAME_KINDS.items()):
        n = max(1, round(frames * share))
        state = {"probe": None}  # the kind's connection
        each = {"before_hello": lambda data: _first_frame(fuzz, data),
                "session_frames": lambda make, state=state: _session_frame(fuzz, make, state)}.get(kind)
        try:
            run_examples(strategies[kind], n, fuzz.seed + i + round_ * len(FRAME_KINDS),
                         each or (lambda data, kind=kind, state=state: _frame(fuzz, kind, data, state)))
        finally:
            _drop(state)


def _connection(fuzz: Recorder, kind: str, state: dict) -> Probe | None:
    """The kind's authenticated connection: a new one when it has none or its last one was closed."""
    p = state["probe"]
    if p is None or not p.alive:
        p, _ = fuzz.connect(kind)
        state["probe"] = p
    return p


def _drop(state: dict) -> None:
    if state["probe"] is not None:
        state["probe"].close()
    state["probe"] = None


def _frame(fuzz: Recorder, kind: str, data: bytes, state: dict) -> None:
    """One frame on an authenticated connection (a new one after a close); OPENs that succeed are closed."""
    if fuzz.hangs[kind] >= HANGS_PER_KIND:
        return
    p = _connection(fuzz, kind, state)
    if p is None:
        return
    a = fuzz.ask(p, kind, "fuzzed frame", data, expected_answers(data, fuzz.welcome.max_frame_bytes))
    if a.kind == "timeout":
        _drop(state)
    elif a.key == "reply:OPEN_REPLY":
        fuzz.tokens_seen.add(a.frame.token.hex())
        fuzz.close_session(p, kind, a.frame.body.session_id, a.frame.token)


def _first_frame(fuzz: Recorder, data: bytes) -> None:
    """A fuzzed first frame of a connection (no HELLO before it)."""
    kind = "before_hello"
    if fuzz.hangs[kind] >= HANGS_PER_KIND:
        return
    p = Probe.attempt(fuzz.t)
    if isinstance(p, Exception):
        fuzz.fail(kind, "connect", f"no connection: {type(p).__name__}")
        return
    try:
        fuzz.ask(p, kind, "first frame", data, expected_answers(data, fuzz.welcome.max_frame_bytes, False))
    finally:
        p.close()


def _session_frame(fuzz: Recorder, make: Callable[[str, bytes], bytes | None], state: dict) -> None:
    """A fuzzed VERIFY / RESUME / CLOSE on a real session with its valid token, then an empty VERIFY (the
    session must not be wedged: answered, and not 'in flight'), then CLOSE."""
    kind = "session_frames"
    if fuzz.hangs[kind] >= HANGS_PER_KIND:
        return
    p = _connection(fuzz, kind, state)
    if p is None:
        return
    sid = fuzz.new_sid()
    opened = fuzz.open(p, kind, sid, ANY_REQUEST_ANSWER)
    if opened.key != "reply:OPEN_REPLY":
        return
    token = opened.frame.token
    data = make(sid, token)
    if data is None:
        fuzz.close_session(p, kind, sid, token)
        return
    allowed = tuple(a for a in expected_answers(data, fuzz.welcome.max_frame_bytes) if a != "error:403")
    a = fuzz.ask(p, kind, "fuzzed frame on an open session", data, allowed)  # its token is valid: never 403
    if not p.alive or a.kind == "timeout":
        _drop(state)
        fuzz.close_elsewhere(sid, token)
        return
    follow = fuzz.ask(p, kind, "empty VERIFY after the fuzzed frame", fuzz.empty_verify(sid, token, p.next_rid()),
                      ("reply:VERIFY_REPLY", "error:400", "error:410"))
    if follow.kind == "error" and "in flight" in follow.error.message:
        fuzz.fail(kind, "session wedged", "the fuzzed frame left its session with a request in flight forever",
                  data, follow)
    if follow.kind == "timeout":
        _drop(state)
        fuzz.close_elsewhere(sid, token)
        return
    fuzz.close_session(p, kind, sid, token)
