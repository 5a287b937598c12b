"""The verifier's sessions and their KV-cache slots: which sessions are open, which slots each holds, idle expiry.

    table = SessionTable(cache, max_sessions=64, idle_timeout_s=60.0)
    s = table.open(request)        # slots taken (idle sessions evicted first when too few are free)
    s = table.get("session-id")    # SessionLostError when this verifier does not hold it
    table.close("session-id")      # its slots reset and freed
    table.evict_idle(300.0)        # close the sessions idle for 5 minutes -> their ids

A session is one image being generated (`ciar.collab.protocol`'s vocabulary). It holds 2 cache slots with CFG (cond,
uncond), 1 without, out of the cache's 2 * `max_sessions`; its committed image tokens, the sampling and acceptance
rule of its OpenRequest, its seed (the cloud's draws are keyed by it: `ciar.engine.judge`), and the work in flight
for it (one at a time: `ciar.engine.core`). Every open / resume / verify stamps `last_used` (time.monotonic);
`evict_idle(s)` closes the sessions idle for at least s seconds, and with `idle_timeout_s` set, an open that finds too
few free slots first evicts such idle sessions (least recently used first) before raising `CapacityError`. A session
with a work in flight is never idle; closing one is the verifier's (`CloudVerifier.close` fails its work first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ciar.collab.protocol import CapacityError, OpenRequest, RuleConfig, SessionError, SessionLostError
from ciar.decoding.sampling import SamplingParams


@dataclass
class Session:
    slots: list[int]  # [cond] or [cond, uncond]
    tokens: list[int]  # committed image tokens
    sampling: SamplingParams
    rule: RuleConfig
    first_logits: torch.Tensor | None  # [rows, V] prefill logits, kept while no token is committed
    seed: int = 0  # the OpenRequest's seed: every cloud draw is keyed by (seed, stream, position) (ciar.engine.judge)
    last_used: float = 0.0  # time.monotonic() of the last open/resume/verify
    work: object = None  # the request in flight for this session (one at a time), or None
    owner: str = ""  # the device that opened (or resumed) it
    open_request: OpenRequest | None = None  # the OPEN that created it (None after a resume)
    open_reply: object = None  # that OPEN's reply, kept until the session moves on (a repeated OPEN gets it again)
    closed: bool = False  # taken out of its table (closed, evicted, replaced): its slots are no longer its own
    jacobi_window: int = 0  # the OPEN's: the tokens the cloud makes itself go by Jacobi windows of this many drafts

    @property
    def live(self) -> bool:
        return not self.closed


def slots_needed(request: OpenRequest) -> int:
    """Cache slots a session of `request` holds: a cond and an uncond row with CFG, else one."""
    return 2 if request.sampling.uses_cfg else 1


class SessionTable:
    def __init__(self, cache, max_sessions: int, idle_timeout_s: float | None = None):
        """`cache`: the verifier's KV cache with 2 * `max_sessions` slots (`reset(slots)` empties them);
        `idle_timeout_s`: when an open lacks free slots, sessions idle for at least this long are evicted first
        (None: never evict on demand; `evict_idle` can still be called)."""
        self.cache = cache
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, Session] = {}
        self.free_slots = list(range(2 * max_sessions))

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionLostError(f"unknown session {session_id!r} (never opened, closed, or evicted)",
                                   session_id) from None

    def check_new(self, session_id: str) -> None:
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} is already open")

    def reserve(self, need: int) -> None:
        """Make sure `need` slots are free: evict idle sessions (least recently used first, only those idle for at
        least `idle_timeout_s`, only as many as needed), else raise CapacityError."""
        if need > len(self.free_slots) and self.idle_timeout_s is not None:
            now = time.monotonic()
            idle = sorted((s.last_used, sid) for sid, s in self.sessions.items()
                          if s.work is None and now - s.last_used >= self.idle_timeout_s)
            for _, sid in idle:
                if need <= len(self.free_slots):
                    break
                self.close(sid)
        if need > len(self.free_slots):
            raise CapacityError(f"verifier full: {len(self.sessions)} sessions open, {len(self.free_slots)} free "
                                f"slots, this batch needs {need}")

    def open(self, request: OpenRequest) -> Session:
        """A new session for `request`: its slots (reserved first), no tokens yet. SessionError when the id is open
        already, CapacityError when no slots can be had."""
        self.check_new(request.session_id)
        need = slots_needed(request)
        self.reserve(need)
        slots = [self.free_slots.pop(0) for _ in range(need)]
        s = Session(slots, [], request.sampling, request.rule, None, seed=int(request.seed),
                    last_used=time.monotonic(), jacobi_window=int(request.jacobi_window))
        self.sessions[request.session_id] = s
        return s

    def pop(self, session_id: str) -> Session | None:
        """Take a session out of the table (lookups fail from here, `closed` is set); its slots stay held until
        `free`."""
        s = self.sessions.pop(session_id, None)
        if s is not None:
            s.closed = True
        return s

    def free(self, session: Session) -> None:
        """Reset and free the slots of a session taken out with `pop`."""
        self.cache.reset(session.slots)
        self.free_slots.extend(session.slots)

    def close(self, session_id: str) -> None:
        """Free a session's slots (nothing when it is not open)."""
        s = self.pop(session_id)
        if s is not None:
            self.free(s)

    def evict_idle(self, max_idle_s: float) -> list[str]:
        """Close the sessions idle (no work in flight, no open/resume/verify) for at least `max_idle_s` seconds;
        -> their ids."""
        now = time.monotonic()
        gone = [sid for sid, s in self.sessions.items() if s.work is None and now - s.last_used >= max_idle_s]
        for sid in gone:
            self.close(sid)
        return gone
