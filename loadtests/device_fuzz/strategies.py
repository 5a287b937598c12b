"""The hypothesis frames: strategies by kind (`frame_strategies`) and their share of a run (`FRAME_KINDS`)."""

from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np

from ciar_device import wire
from ciar_device.wire import (BODY_TYPES, CLOSE, ERROR, HELLO, MAGIC, OPEN, OPEN_REPLY, PROTOCOL_VERSION, RESUME,
                              RULES, VERIFY, VERIFY_REPLY, WELCOME, CloseReply, CloseRequest, ErrorReply, Frame,
                              Hello, InjectedFeatures, OpenReply, OpenRequest, ResumeRequest, RuleConfig, Sampling,
                              VerifyReply, VerifyRequest, Welcome)
from loadtests.device_fuzz.channel import CLIENT_TYPES, PROMPT

# share of --device-frames per hypothesis kind
FRAME_KINDS = {"random_body": 0.08, "bad_magic": 0.04, "unknown_type": 0.04, "wrong_version": 0.03,
               "truncated": 0.14, "mutated": 0.2, "fields": 0.18, "session_frames": 0.14, "server_types": 0.03,
               "before_hello": 0.12}


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


def run_examples(strategy, n: int, seed: int, each: Callable[[Any], None]) -> None:
    """`each(example)` for n examples of `strategy` (no shrinking: failures are recorded, never raised)."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    @hseed(seed)
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.generate])
    @given(strategy)
    def one(example):
        each(example)

    one()
