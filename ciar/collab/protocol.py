"""The device <-> cloud protocol: three messages (and a recovery call), transport-agnostic.

    client.open(OpenRequest(...))     -> OpenReply     caption embeddings + the cloud's prefix tokens (prefix injection)
    client.verify(VerifyRequest(...)) -> VerifyReply   catch up on locally accepted tokens, verify a drafted span
    client.resume(OpenRequest(...), history)  -> OpenReply   re-create a lost session from the committed tokens
    client.close(session_id)

Vocabulary (used everywhere in `ciar.collab`): a *session* is one image being generated; *committed* tokens are
the ones both sides agree on; tokens *accepted locally* by the device (uncertainty <= tau) are committed on the
device at once and reach the cloud with the next VerifyRequest as `new_tokens` (the cloud's *catch-up*); a
*span* holds the *draft* tokens the device wants verified; the cloud answers with the number *accepted* and one
*next token* (recovered at the first rejection, or a bonus token after a fully accepted span). With a *cloud burst*
(`VerifyRequest.burst` = g > 0) a reply after a rejection also carries up to g *burst tokens*: the cloud's own
samples after the next token, exact cloud tokens that cost a cloud step each and no round trip.

`CloudClient` is the interface the device side codes against. `ciar.engine.verifier.InProcessCloud` implements
it with direct calls (tests, benchmarks, CLI), `services.verifier_client.RayCloudClient` over Ray handles (the simulated
devices in the cluster), `ciar_device.connection.DeviceConnection` over a WebSocket (real devices). The messages
and their binary encoding are defined once in `ciar_device.wire` (numpy only, shared with the torch-free device
client): an 8-byte header, token ids bit-packed at ceil(log2 V) bits, float vectors as float16. Each message's
`nbytes()` is the exact size of its frame, so a simulated link charges the bytes a real socket carries.

Errors every transport shares (defined here, raised by the verifier): `SessionError` (a request that does not fit
the session: a client bug, 4xx), `SessionLostError` (the session is not held), `CapacityError` (no free slot) and
its `ForwardFault` (the step's forward failed; send the request again).

Recovery: a verify naming a session the cloud no longer holds (replica lost, slot evicted) fails with
`SessionLostError`; `resume` rebuilds the session from the device's committed tokens (and the
interval features it injected, `InjectedFeatures`), after which the verify is re-sent. `ciar.sim.recovery.
RecoveringClient` does this for any client; the result equals an uninterrupted session's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

# the messages are defined once, with their wire encoding, in the client package's codec (numpy only), so that the
# cluster and a torch-free device share the very same module
from ciar_device.wire import (HEADER_BYTES, CloseRequest, InjectedFeatures, OpenReply, OpenRequest,  # noqa: F401
                              ResumeRequest, RuleConfig, VerifyReply, VerifyRequest, feature_bytes, token_bytes)


def verify_tensors(request: VerifyRequest) -> VerifyRequest:
    """A VerifyRequest with its arrays as torch tensors (the device loop sends numpy arrays; the socket decodes to
    either): the verifier's view of a request from any transport."""
    arrays = ("new_tokens", "draft_tokens", "draft_probs", "device_hidden", "features")
    conv = {name: torch.from_numpy(np.ascontiguousarray(getattr(request, name))) for name in arrays
            if isinstance(getattr(request, name), np.ndarray)}
    return replace(request, **conv) if conv else request


def quantize_draft(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft distribution as it travels: q [..., V] float32 -> (q_sent float16, q_used float32).

    The device sends q as float16 (`VerifyRequest.draft_probs`) and must draw its token from exactly the distribution
    the cloud will judge it by, so it draws from `q_used = draft_distribution(q_sent)`: the float16 values, normalised.
    A token whose probability underflows to 0 in float16 can then never be drawn (no infinite p/q ratio), and the
    exact rule stays lossless with respect to what the cloud sees."""
    q_sent = q.to(torch.float16)
    return q_sent, draft_distribution(q_sent)


def draft_distribution(q_sent: torch.Tensor) -> torch.Tensor:
    """float16 draft probabilities as sent [..., V] -> the normalised float32 distribution both sides use."""
    q = q_sent.float()
    return q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


class SessionError(ValueError):
    """A request names an unknown session, or does not fit the session's state (a client bug, reported as 4xx)."""


class SessionLostError(SessionError):
    """A verify names a session this verifier does not hold (never opened, closed, evicted, or lost with a replica).

    Not a client bug when the session was open before: the client re-creates it with `resume_batch` (the device's
    committed tokens) and re-sends the request (`ciar.sim.recovery.RecoveringClient`)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id

    def __reduce__(self):  # keep session_id across pickling (Ray ships exceptions between processes)
        return type(self), (str(self), self.session_id)


class SessionConflictError(SessionError):
    """An OPEN names a session that is open with another request, by another device, or that has moved on since its
    open (409 on the socket). The same OPEN repeated by its device is not a conflict: it is answered as the first."""


class SessionTokenError(PermissionError):
    """A VERIFY, RESUME or CLOSE whose session token the verifier did not issue for this session and device (another
    device's session, a forged or stale token): 403 on the socket. Only this error is answered 403 "invalid session
    token": a PermissionError raised by anything else on the way (an OS call refused) is an internal error, answered
    500 and logged by its type, not blamed on the device's token."""


class CapacityError(RuntimeError):
    """No free cache slot for a new session (or, `ForwardFault`, no forward to be had now): 503 + Retry-After."""


class ForwardFault(CapacityError):
    """The cloud forward of the step that carried this request failed (out of memory, non-finite logits, a broken
    kernel): only that step's requests fail, and the replica goes on. The session is as it was before the request,
    so the request is safe to send again as it is (503 + Retry-After; `RecoveringClient` re-sends a verify); a
    verification that had already committed its verdict loses its session instead (`SessionLostError`: resume).
    `origin`: the error the forward raised (not chained as `__cause__`: the transports unwrap causes to find the
    verifier's own error, and must find this one)."""

    def __init__(self, message: str, origin: BaseException | None = None):
        super().__init__(message)
        self.origin = origin


class CloudUnreachableError(ConnectionError):
    """The cloud cannot be reached: the device's link is down, or no verifier replica answers. A generation that
    already has its caption falls back to device-only decoding (`CollabConfig.fallback`) and is marked degraded."""


class CloudTimeoutError(CloudUnreachableError):
    """The verifier did not answer a call within its deadline (the call's own, or what is left of the request's):
    the call was cancelled, and the device treats the cloud as unreachable (before the open: a retryable 503)."""


class CloudClient(Protocol):
    """What the device side needs from the cloud; implementations decide transport and batching."""

    vocab_size: int

    def open(self, request: OpenRequest) -> OpenReply: ...

    def verify(self, request: VerifyRequest) -> VerifyReply: ...

    def resume(self, request: OpenRequest, history: torch.Tensor,
               injected: InjectedFeatures | None = None) -> OpenReply:
        """Re-create session `request.session_id` from its committed tokens `history` ([c] int64, c >= 0) and, with
        interval-enhanced decoding, the features injected with them. `prefix_len` is ignored (no tokens are
        generated); a still-open copy of the session is replaced. -> OpenReply with empty prefix_tokens (caption
        only if `want_caption`), its cloud_s and forward_passes."""
        ...

    def close(self, session_id: str) -> None: ...

    # optional: `cost_hint() -> ciar_device.policy.CostHint | None`, the verifier's recent span forward, sampled
    # step and queue wait, which the adaptive policy starts from before a device's first image (`CollabDecoder`
    # reads it when the client has it; WELCOME carries it to a device on the network)
