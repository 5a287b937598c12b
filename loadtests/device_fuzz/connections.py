"""The fixed probes of the endpoint's resources: slow_reader, connections, device_connections (what each sends and
expects: the package's docstring). Each asks through the `Recorder` and leaves its figures in `fuzz.probes[kind]`."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ciar_device import wire
from ciar_device.wire import (HELLO, MAGIC, PROTOCOL_VERSION, RESUME, Frame, Hello, OpenRequest, ResumeRequest,
                              Sampling)
from loadtests.device_fuzz.channel import PROMPT, Probe, http_status
from loadtests.device_fuzz.recorder import Recorder

QUEUED_HANDSHAKE_S = 5.0  # a WebSocket handshake this slow was queued, not refused (the connection-limit probe)


def probe_slow_reader(fuzz: Recorder, send_s: float | None = None) -> None:
    """A connection that sends but never reads (a tiny receive buffer, no read-ahead): it opens a few sessions,
    then asks for their captions again and again (RESUME with want_caption: the largest replies a device can
    ask for) for `send_s` (default send_timeout + 1 s; longer to get past the sockets' buffers, which hold
    megabytes) and waits send_timeout + 1 s more, unread. The server's send timeout must drop it, and another
    connection must be answered meanwhile."""
    kind = "slow_reader"
    out: dict[str, Any] = {}
    p, _ = fuzz.connect(kind, rcvbuf=4096, max_queue=1)
    other, _ = fuzz.connect(kind, fuzz.t.keys[1])
    if p is None or other is None:
        return
    sessions = {}
    for _ in range(min(3, fuzz.welcome.max_sessions)):
        sid = fuzz.new_sid("slow")
        a = fuzz.open(p, kind, sid)
        if a.key == "reply:OPEN_REPLY":
            sessions[sid] = (a.frame.token, int(a.frame.body.prefix_tokens[0]))
    if not sessions:
        return
    frames = [wire.encode_frame(Frame(RESUME, 0, ResumeRequest(
        OpenRequest(sid, PROMPT, fuzz.sid_count, Sampling(), 1, want_caption=True), np.array([tok0], np.int64), None,
        fuzz.vocab), token)) for sid, (token, tok0) in sessions.items()]
    sent, stop, dropped = [0], threading.Event(), threading.Event()
    send_s = send_s or fuzz.t.send_timeout_s + 1.0
    window_s = send_s + fuzz.t.send_timeout_s + 1.0
    # the server's sends block only once its replies fill the buffers, which takes longer on a slower machine (it
    # makes fewer replies a second): past `send_s` the reader keeps asking, unread, until its sends fail (the server
    # dropped it) or the hang guard ends
    guard_s = max(window_s, 3 * fuzz.t.timeout_s)

    def send_for_a_while():  # at the endpoint's message rate, round robin over the sessions
        t0, chunk = time.monotonic(), max(1, int(fuzz.welcome.messages_per_s / 10))
        while not stop.is_set() and time.monotonic() - t0 < guard_s:
            for _ in range(chunk):
                data = bytearray(frames[sent[0] % len(frames)])
                struct.pack_into("<I", data, 4, sent[0] + 1)
                if not p.send(bytes(data)):
                    dropped.set()
                    return
                sent[0] += 1
            time.sleep(0.1)

    sender = threading.Thread(target=send_for_a_while, daemon=True, name="device-fuzz-slow-reader")
    memory = {"before": fuzz.memory()}
    t0 = time.monotonic()
    sender.start()
    others = []
    while True:  # at least `window_s`; past it, until the server dropped the reader (or the guard ends)
        elapsed = time.monotonic() - t0
        if elapsed >= guard_s or (elapsed >= window_s and dropped.is_set()):
            break
        dropped.wait(min(1.0, window_s - elapsed) if elapsed < window_s else 1.0)
        t1 = time.perf_counter()
        a = fuzz.ask(other, kind, "another connection while a reader is stuck",
                     struct.pack("<2sBBI", MAGIC, PROTOCOL_VERSION, 200, other.next_rid()), ("error:400",))
        others.append(round(time.perf_counter() - t1, 3))
        if a.kind != "error":
            break
    stop.set()
    sender.join(timeout=fuzz.t.timeout_s)
    memory["unread"] = fuzz.memory()
    fuzz.frames[kind] += sent[0]
    got, ended = Counter(), None  # now read: the replies that made it, then how the connection ended
    deadline = time.monotonic() + fuzz.t.timeout_s
    while time.monotonic() < deadline:
        a = p.answer(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        if a.kind in ("reply", "error"):
            got[a.key] += 1
        elif a.kind != "timeout":
            ended = a
            break
    out.update({"sent": sent[0], "answers_read_after": dict(got), "sender_blocked": sender.is_alive(),
                "other_connection_s": others, "ended_by": ended.key if ended else "still open"})
    if fuzz.t.server_memory is not None:
        out["server_rss_mb"] = memory
    if ended is not None and ended.kind == "close":
        fuzz.answers[ended.key] += 1
    if ended is None or ended.kind != "close":
        fuzz.fail(kind, "slow reader", f"not dropped: {sent[0]} frames sent, nothing read for "
                  f"{time.monotonic() - t0:.1f} s, then {sum(got.values())} answers read ({dict(got)}) and the "
                  f"connection still open (the endpoint's send timeout is {fuzz.t.send_timeout_s:g} s; the sender "
                  f"{'still blocked' if sender.is_alive() else 'stopped'}; the other connection's answers took "
                  f"{others[-3:]} s)")
    elif ended.key not in ("close:1008", "close:1006"):
        fuzz.fail(kind, "slow reader", "ended by an unexpected close", answer=ended)
    p.close()
    for sid, (token, _) in sessions.items():
        fuzz.close_elsewhere(sid, token)
    other.close()
    fuzz.probes[kind] = out


def probe_connections(fuzz: Recorder, extra: int) -> None:
    """Up to the endpoint's connection limit and `extra` beyond, held open without HELLO: refused ones close
    with 1013 and "retry after N s"; meanwhile the health route and a new connection are answered in time."""
    kind = "connections"
    limit = fuzz.t.max_connections
    n = (limit + extra) if limit else 64
    out: dict[str, Any] = {"limit": limit, "tried": n}
    before = fuzz.connections_now()  # (others' connections: a witness's)

    def timed(_):
        t1 = time.perf_counter()
        c = Probe.attempt(fuzz.t)
        return c, time.perf_counter() - t1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(64, n)) as ex:
        conns, handshake_s = zip(*ex.map(timed, range(n)))
    out["open_s"] = round(time.perf_counter() - t0, 2)
    waited = sorted(x for x in handshake_s if x > QUEUED_HANDSHAKE_S)
    out["handshake_s"] = {"p50": round(float(np.median(handshake_s)), 3), "max": round(max(handshake_s), 3),
                          f"over_{QUEUED_HANDSHAKE_S:g}_s": len(waited)}
    fuzz.frames[kind] += n
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
        fuzz.answers[a.key] += 1
        if a.key == "close:1013" and "retry after" in a.reason:
            refused[a.reason] += 1
        elif a.key == "close:4000" and "HELLO" in a.reason:
            expired += 1  # held past the endpoint's HELLO timeout while the others were being opened
        else:
            other[a.describe()] += 1
    meanwhile = {}
    if fuzz.t.health_url:
        meanwhile["health"] = http_status(fuzz.t.health_url, fuzz.t.timeout_s)
    q = Probe.attempt(fuzz.t)
    if isinstance(q, Exception):
        meanwhile["new connection"] = f"{type(q).__name__}: {str(q)[:80]}"
    else:
        meanwhile["new connection"] = fuzz.check(kind, "a new connection at the limit", None,
                                                 q.hello(fuzz.t.keys[1]), ("reply:WELCOME", "close:1013")).key
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
        fuzz.fail(kind, "many connections", f"{len(waited)} connections waited {waited[0]:.1f}-{waited[-1]:.1f} s "
                  f"for their handshake instead of being refused with 1013 (held in a queue before the endpoint: "
                  f"its limit was never reached)")
    if other:
        fuzz.fail(kind, "many connections", f"answers other than 1013 with a retry-after: {dict(other)}")
    if limit and len(held) > limit:
        fuzz.fail(kind, "many connections", f"{len(held)} connections held, the limit is {limit}")
    if limit and n > limit and conclusive and not refused and not waited:
        fuzz.fail(kind, "many connections", f"{n} connections tried, the limit is {limit}: none refused with 1013")
    if meanwhile.get("health", 200) != 200:
        fuzz.fail(kind, "health route at the connection limit", f"answered {meanwhile['health']}")
    if not str(meanwhile["new connection"]).startswith(("reply:WELCOME", "close:1013")):
        fuzz.fail(kind, "a new connection at the limit", f"got {meanwhile['new connection']}")
    fuzz.settle(0.5, at_most=before)
    after, _ = fuzz.connect(kind)  # the count went back down
    out["after"] = "WELCOME" if after is not None else "refused"
    if after is not None:
        after.close()
    fuzz.probes[kind] = out


def probe_device_connections(fuzz: Recorder) -> None:
    """The per-device connection limit (1008 beyond it), and connections that vanish right after HELLO: they
    must not use up their device's connections."""
    kind = "device_connections"
    limit = fuzz.t.max_connections_per_device
    out: dict[str, Any] = {"limit": limit}
    fuzz.settle(0.3)  # the connections closed before are let go by the server
    if limit:
        conns = []
        for _ in range(limit):
            p, _ = fuzz.connect(kind)
            if p is not None:
                conns.append(p)
        q = Probe.attempt(fuzz.t)
        if not isinstance(q, Exception):
            fuzz.frames[kind] += 1
            hello = wire.encode_frame(Frame(HELLO, 0, Hello(fuzz.t.keys[0])))
            q.send(hello)
            out["one over the limit"] = fuzz.check(kind, "one connection over the device's limit", hello,
                                                   q.answer(), ("close:1008",)).key
            q.close()
        out["held"] = len(conns)
        for p in conns:
            p.close()
        fuzz.settle(0.3)
    vanished = 0
    for _ in range(2 * (limit or 8) + 1):
        p = Probe.attempt(fuzz.t)
        if isinstance(p, Exception):
            continue
        p.send(wire.encode_frame(Frame(HELLO, 0, Hello(fuzz.t.keys[0]))))
        fuzz.frames[kind] += 1
        try:  # gone without a closing handshake, before WELCOME could be read (a reset)
            p.ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            p.ws.socket.close()
        except OSError:
            pass
        p.close()
        vanished += 1
    fuzz.settle(0.5)
    out["vanished_after_hello"] = vanished
    p, a = fuzz.connect(kind)
    out["after"] = a.key if a is not None else "no connection"
    if p is not None:
        p.close()
    fuzz.probes[kind] = out
