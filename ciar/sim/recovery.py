"""Recoverable cloud sessions: a `CloudClient` wrapper that re-creates a lost session and re-sends the request.

    client = RecoveringClient(InProcessCloud(verifier))                      # or any transport's client
    client = RecoveringClient(http_client, is_lost=lambda e: isinstance(e, (SessionLostError, ActorDiedError)))
    decoder = CollabDecoder(device_model, client, config, sampling)          # nothing else changes

The wrapper remembers, per open session, its OpenRequest and the committed tokens both sides agree on: the prefix
tokens of the OpenReply, then after each verification new_tokens + draft_tokens[:num_accepted] + [next_token]
(the cloud's own bookkeeping, so it may run one token past what the device keeps at the very end; nothing is verified
after that), plus the interval features the device sent with its locally accepted tokens. When `inner.verify`
raises an error that `is_lost(exc)` accepts (default: `SessionLostError`: the replica holding the session's cache
was lost or restarted, or the slot was evicted), it calls `inner.resume(request with want_caption=False, history,
injected)` and re-sends the verify; a session lost again under that verify (the replica it was resumed on lost in
turn) is resumed again, up to `LOST_RETRIES` resumes a verify. The reply is marked `resumed=True` and carries the
resumes' cloud_s and forward_passes too (the decoder counts `GenerationStats.resumes`). An open, resume or verify
whose forward failed (`ForwardFault`: nothing of it was kept) is sent again as it is, up to `FAULT_RETRIES` times; a
failed forward after the verdict drops the session (`SessionLostError`), which is then resumed as above.

Why the result is exact (equal to an uninterrupted session's): the cloud's state for a session is (a) the KV cache,
a deterministic function of the caption, the committed tokens and the features injected with them, which `resume`
recomputes from exactly those inputs, and (b) its draws, each keyed by (seed, stream, image position)
(`ciar.engine.judge`), so they carry no history either. The prefix tokens are part of the history, not redrawn.
The retried verify therefore sees the same target distributions (up to floating-point summation order of the
rebuilt cache) and the same draws, and returns the same (num_accepted, next_token).

Not covered: a verify that the cloud applied but whose reply was lost (the retry would then run against a session
that is one step ahead); transports should surface that as a failed request, not as a lost session. One session's
calls must be sequential (as `CollabDecoder` makes them); different sessions may share the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ciar.collab.protocol import CloudClient, InjectedFeatures, OpenReply, OpenRequest, VerifyReply, VerifyRequest
from ciar.collab.protocol import ForwardFault, SessionLostError
from ciar_device.connection import LOST_RETRIES
from ciar_device.history import SessionHistory


def _is_session_lost(exc: BaseException) -> bool:
    return isinstance(exc, SessionLostError)


class RecoveringClient:
    """`CloudClient` over `inner` (any CloudClient with `resume`) that survives lost cloud sessions; see the module
    docstring. `is_lost(exc)`: which errors of `inner.verify` / `inner.close` mean "the cloud lost this session"."""

    FAULT_RETRIES = 3  # a verify whose forward failed (`ForwardFault`) is sent again up to this many times
    LOST_RETRIES = LOST_RETRIES  # a verify whose session was lost is resumed and sent again up to this many times

    def __init__(self, inner: CloudClient, is_lost: Callable[[BaseException], bool] | None = None):
        self.inner = inner
        self.is_lost = is_lost or _is_session_lost
        self._sessions: dict[str, SessionHistory] = {}
        self.resumes = 0  # sessions re-created through this wrapper (all sessions together)
        self.faults = 0  # calls made again after a failed forward

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def cost_hint(self):
        """The inner client's (`CloudClient`'s optional cost hint), None when it has none."""
        hint = getattr(self.inner, "cost_hint", None)
        return hint() if hint is not None else None

    @property
    def open_sessions(self) -> int:
        """Sessions tracked now (opened or resumed, not yet closed): 0 between generations."""
        return len(self._sessions)

    def open(self, request: OpenRequest) -> OpenReply:
        reply = self._again(self.inner.open, request)
        self._sessions[request.session_id] = SessionHistory(replace(request, want_caption=False),
                                                            reply.prefix_tokens.tolist())
        return reply

    def resume(self, request: OpenRequest, history: torch.Tensor,
               injected: InjectedFeatures | None = None) -> OpenReply:
        """Pass-through (the wrapper then tracks the session from `history`)."""
        reply = self._resume(request, history, injected)
        self._sessions[request.session_id] = SessionHistory.resumed(replace(request, want_caption=False), history,
                                                                    injected)
        return reply

    def verify(self, request: VerifyRequest) -> VerifyReply:
        """inner.verify; a session lost under it (and again under the verify sent after its resume: the replica it
        was resumed on lost in turn) is resumed from its history and the verify sent again, up to LOST_RETRIES
        resumes."""
        t = self._sessions.get(request.session_id)
        cloud_s, passes = 0.0, 0  # of this verify's resumes
        for lost in range(self.LOST_RETRIES + 1):
            try:
                reply = self._again(self.inner.verify, request)
                break
            except Exception as e:
                if t is None or not self.is_lost(e) or lost == self.LOST_RETRIES:
                    raise
            res = self._resume(t.request, t.history(torch.from_numpy), t.injected(torch.from_numpy))
            self.resumes += 1
            cloud_s, passes = cloud_s + res.cloud_s, passes + res.forward_passes
        if lost:
            reply = replace(reply, resumed=True, cloud_s=reply.cloud_s + cloud_s,
                            forward_passes=reply.forward_passes + passes)
        if t is not None:
            t.commit(request, reply)
        return reply

    def _resume(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None) -> OpenReply:
        # only pass `injected` when there is some, so that clients without interval features need not accept it
        return self._again(self.inner.resume, request, history) if injected is None else \
            self._again(self.inner.resume, request, history, injected)

    def _again(self, call, *args):
        """call(*args), made again when its forward failed (`ForwardFault`: nothing of it was kept, so the same
        request gives the same reply), up to FAULT_RETRIES times."""
        for attempt in range(self.FAULT_RETRIES + 1):
            try:
                return call(*args)
            except Exception as e:
                if not isinstance(e, ForwardFault) or attempt == self.FAULT_RETRIES:
                    raise
                self.faults += 1

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        try:
            self.inner.close(session_id)
        except Exception as e:
            if not self.is_lost(e):
                raise
