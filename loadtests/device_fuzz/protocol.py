"""The fixed probes of the protocol: frame_limits, order, tokens, sessions (what each sends and expects: the
package's docstring). Each asks through the `Recorder` and leaves its figures in `fuzz.probes[kind]`."""

from __future__ import annotations

import os
import struct
from collections import Counter
from typing import Any

import numpy as np

from ciar_device import wire
from ciar_device.wire import (CLOSE, HELLO, MAGIC, OPEN, PROTOCOL_VERSION, RESUME, VERIFY, CloseRequest, Frame, Hello,
                              OpenRequest, ResumeRequest, Sampling, VerifyRequest)
from loadtests.device_fuzz.channel import PROMPT, Probe
from loadtests.device_fuzz.recorder import Recorder


def probe_frame_limits(fuzz: Recorder) -> None:
    kind, limit = "frame_limits", fuzz.welcome.max_frame_bytes
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
        p, _ = fuzz.connect(kind)
        if p is None:
            continue
        out[what] = fuzz.ask(p, kind, what, data, allowed).key
        p.close()
    for what, data, allowed in (("an empty binary frame before HELLO", b"", ("close:4000",)),
                                ("a text frame before HELLO", "hello", ("close:4000",)),
                                ("a frame over the limit before HELLO", b"CI" + bytes(limit), ("close:1009",))):
        p = Probe.attempt(fuzz.t)
        if isinstance(p, Exception):
            fuzz.fail(kind, what, f"no connection: {type(p).__name__}")
            continue
        out[what] = fuzz.ask(p, kind, what, data, allowed).key
        p.close()
    fuzz.probes[kind] = out


def probe_order(fuzz: Recorder) -> None:
    kind = "order"
    out = {}
    for t, body, token in ((OPEN, OpenRequest("o", PROMPT, 0, Sampling(), 1), b""),
                           (VERIFY, VerifyRequest("o", np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                  np.zeros((0, 4), np.float16)), bytes(32)),
                           (CLOSE, CloseRequest("o"), bytes(32))):
        p = Probe.attempt(fuzz.t)
        if isinstance(p, Exception):
            fuzz.fail(kind, "connect", f"no connection: {type(p).__name__}")
            continue
        out[f"{wire.TYPE_NAMES[t]} before HELLO"] = fuzz.ask(
            p, kind, f"{wire.TYPE_NAMES[t]} before HELLO", Frame(t, 1, body, token), ("close:4000",)).key
        p.close()
    p, _ = fuzz.connect(kind)
    if p is None:
        return
    try:
        a = fuzz.ask(p, kind, "HELLO twice", Frame(HELLO, p.next_rid(), Hello(fuzz.t.keys[0])), ("error:400",))
        out["HELLO twice"] = a.key
        never, fake = fuzz.new_sid("never"), os.urandom(32)
        o = OpenRequest(never, PROMPT, 0, Sampling(), 1, want_caption=False)
        for what, frame in (
                ("VERIFY of a session never opened", fuzz.empty_verify(never, fake, p.next_rid())),
                ("RESUME of a session never opened",
                 Frame(RESUME, p.next_rid(), ResumeRequest(o, np.zeros(1, np.int64), None, fuzz.vocab or 2), fake)),
                ("CLOSE of a session never opened", Frame(CLOSE, p.next_rid(), CloseRequest(never), fake))):
            out[what] = fuzz.ask(p, kind, what, frame, ("error:403",)).key
        # OPEN twice for one id: the same OPEN is answered as the first (a lost reply's retry: the same token
        # and prefix); another request under that id is refused (409); the session stays usable and counted
        sid = fuzz.new_sid()
        first = fuzz.open(p, kind, sid)
        if first.key == "reply:OPEN_REPLY":
            token = first.frame.token
            again = fuzz.open(p, kind, sid)
            out["OPEN twice"] = again.key
            if again.key == "reply:OPEN_REPLY" and (
                    again.frame.token != token or again.frame.body.prefix_tokens.tolist() !=
                    first.frame.body.prefix_tokens.tolist()):
                fuzz.fail(kind, "OPEN twice", "a repeated OPEN was not answered as the first", answer=again)
            other = OpenRequest(sid, PROMPT + " (another)", fuzz.sid_count, Sampling(), 1, want_caption=False)
            out["OPEN of an open id with another request"] = fuzz.ask(
                p, kind, "OPEN of an open id with another request", Frame(OPEN, p.next_rid(), other),
                ("error:409",)).key
            out["VERIFY after OPEN twice"] = fuzz.ask(p, kind, "VERIFY after OPEN twice",
                                                      fuzz.empty_verify(sid, token, p.next_rid()),
                                                      ("reply:VERIFY_REPLY",)).key
            fuzz.close_session(p, kind, sid, token)
            out["VERIFY after CLOSE"] = fuzz.ask(p, kind, "VERIFY after CLOSE",
                                                 fuzz.empty_verify(sid, token, p.next_rid()), ("error:410",)).key
            out["CLOSE after CLOSE"] = fuzz.close_session(p, kind, sid, token).key
    finally:
        p.close()
    fuzz.probes[kind] = out


def probe_tokens(fuzz: Recorder) -> None:
    kind = "tokens"
    out = {}
    a_probe, welcome_a = fuzz.connect(kind)
    b_probe, welcome_b = fuzz.connect(kind, fuzz.t.keys[1])
    try:
        if a_probe is None or b_probe is None:
            return
        x, y = fuzz.new_sid("tok"), fuzz.new_sid("tok")
        ox, oy = fuzz.open(a_probe, kind, x), fuzz.open(a_probe, kind, y)
        if ox.key != "reply:OPEN_REPLY" or oy.key != "reply:OPEN_REPLY":
            return
        tx, ty = ox.frame.token, oy.frame.token
        p = a_probe
        for what, token in (("a random token", os.urandom(32)), ("an all-zero token", bytes(32)),
                            ("the token of another session", ty)):
            out[f"VERIFY with {what}"] = fuzz.ask(p, kind, f"VERIFY with {what}",
                                                  fuzz.empty_verify(x, token, p.next_rid()), ("error:403",)).key
            out[f"CLOSE with {what}"] = fuzz.ask(p, kind, f"CLOSE with {what}",
                                                 Frame(CLOSE, p.next_rid(), CloseRequest(x), token),
                                                 ("error:403",)).key
        # another device: B names A's session with A's real token
        never = fuzz.new_sid("never")
        ref = fuzz.ask(b_probe, kind, "B: VERIFY of a session that does not exist",
                       fuzz.empty_verify(never, os.urandom(32), b_probe.next_rid()), ("error:403",))
        answers = []
        resume_x = ResumeRequest(OpenRequest(x, PROMPT, 0, Sampling(), 1, want_caption=False),
                                 np.zeros(1, np.int64), None, fuzz.vocab)
        for what, frame in (
                ("B: VERIFY of A's session with A's token", fuzz.empty_verify(x, tx, b_probe.next_rid())),
                ("B: RESUME of A's session with A's token", Frame(RESUME, b_probe.next_rid(), resume_x, tx)),
                ("B: CLOSE of A's session with A's token", Frame(CLOSE, b_probe.next_rid(), CloseRequest(x), tx))):
            b = fuzz.ask(b_probe, kind, what, frame, ("error:403",))
            out[what] = b.key
            answers.append((what, b))
        for what, b in answers:
            if b.kind != "error" or ref.kind != "error":
                continue
            e, r = b.error, ref.error
            leaks = [s for s in (welcome_a.frame.body.device_id, "/", "another device") if s in e.message]
            if (e.message, e.field, e.status) != (r.message, r.field, r.status) or leaks:
                fuzz.fail(kind, what, f"the answer tells A's session from one that does not exist: "
                          f"{e.message!r} vs {r.message!r}" + (f", names {leaks}" if leaks else ""), answer=b)
        # A's session is untouched
        out["A: VERIFY after B's attempts"] = fuzz.ask(p, kind, "A: VERIFY after B's attempts",
                                                       fuzz.empty_verify(x, tx, p.next_rid()),
                                                       ("reply:VERIFY_REPLY",)).key
        # a closed session's token: 403 on another session, 410 on its own (it does not come back)
        fuzz.close_session(p, kind, y, ty)
        out["VERIFY with a closed session's token"] = fuzz.ask(
            p, kind, "VERIFY with a closed session's token", fuzz.empty_verify(x, ty, p.next_rid()),
            ("error:403",)).key
        out["VERIFY of the closed session, its token replayed"] = fuzz.ask(
            p, kind, "VERIFY of the closed session, its token replayed", fuzz.empty_verify(y, ty, p.next_rid()),
            ("error:410",)).key
        fuzz.close_session(p, kind, x, tx)
    finally:
        for q in (a_probe, b_probe):
            if q is not None:
                q.close()
        fuzz.probes[kind] = out


def probe_sessions(fuzz: Recorder, tried: int) -> None:
    """Hundreds of OPENs from one device: exactly max_sessions succeed, the rest 429 (session_id); also with
    every id opened twice, and after VERIFYs of sessions the device does not hold; all reopenable after."""
    kind, limit = "sessions", fuzz.welcome.max_sessions
    out: dict[str, Any] = {"max_sessions": limit, "tried": tried}
    p, _ = fuzz.connect(kind)
    if p is None:
        return
    try:
        for variant in ("plain", "each id twice", "after VERIFYs of sessions never opened"):
            if variant.startswith("after"):
                for _ in range(2 * limit + 2):
                    fuzz.ask(p, kind, "VERIFY of a session never opened",
                             fuzz.empty_verify(fuzz.new_sid("ghost"), os.urandom(32), p.next_rid()),
                             ("error:403",))
            opened: dict[str, bytes] = {}
            refused = Counter()
            for i in range(tried if variant == "plain" else 2 * limit + 2):
                sid = fuzz.new_sid("many")
                a = fuzz.open(p, kind, sid, ("reply:OPEN_REPLY", "error:429"))
                if a.key == "reply:OPEN_REPLY":
                    opened[sid] = a.frame.token
                    if variant == "each id twice":  # answered as the first, not counted again
                        fuzz.open(p, kind, sid, ("reply:OPEN_REPLY", "error:429"))
                elif a.kind == "error":
                    refused[f"{a.error.status} {a.error.field}"] += 1
                    if a.error.field != "session_id" or a.error.retry_after_s <= 0:
                        fuzz.fail(kind, variant, "a 429 that does not name session_id with a retry-after",
                                  answer=a)
                if not p.alive:
                    break
            out[variant] = {"opened": len(opened), "refused": dict(refused)}
            if len(opened) != limit:
                fuzz.fail(kind, variant, f"{len(opened)} sessions opened, the device's limit is {limit}"
                          + (" (sessions it does not hold count against it)" if len(opened) < limit else
                             " (the limit was bypassed)"))
            for sid, token in opened.items():
                fuzz.close_session(p, kind, sid, token)
        again = {}
        for _ in range(limit):
            sid = fuzz.new_sid("again")
            a = fuzz.open(p, kind, sid)
            if a.key == "reply:OPEN_REPLY":
                again[sid] = a.frame.token
        out["reopened_after_close"] = len(again)
        for sid, token in again.items():
            fuzz.close_session(p, kind, sid, token)
    finally:
        p.close()
        fuzz.probes[kind] = out
