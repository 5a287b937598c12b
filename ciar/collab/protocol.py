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

`CloudClient` is the interface the device side codes against. `ciar.collab.verifier.InProcessCloud` implements
it with direct calls (tests, benchmarks, CLI); the Ray implementation lives in `services/`. Payload sizes follow
the encodings below (a fixed `HEADER_BYTES` per message, token ids bit-packed at ceil(log2 V) bits, float vectors
as float16), so every transport charges the same bytes to the network model.

Errors every transport shares (defined here, raised by the verifier): `SessionError` (a request that does not fit
the session: a client bug, 4xx), `SessionLostError` (the session is not held), `CapacityError` (no free slot).

Recovery: a verify naming a session the cloud no longer holds (replica lost, slot evicted) fails with
`SessionLostError`; `resume` rebuilds the session from the device's committed tokens (and the
interval features it injected, `InjectedFeatures`), after which the verify is re-sent. `ciar.collab.recovery.
RecoveringClient` does this for any client; the result equals an uninterrupted session's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ciar.decoding.sampling import SamplingParams


HEADER_BYTES = 64  # every message: a fixed header


def token_bytes(n: int, vocab_size: int) -> int:
    """Bytes for n token ids of a V-entry vocabulary, bit-packed at ceil(log2 V) bits each."""
    bits = max(1, math.ceil(math.log2(max(2, vocab_size))))
    return (n * bits + 7) // 8


def feature_bytes(n: int, dim: int) -> int:
    """Bytes for n float16 vectors of size dim."""
    return 2 * n * dim


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
    committed tokens) and re-sends the request (`ciar.collab.recovery.RecoveringClient`)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id

    def __reduce__(self):  # keep session_id across pickling (Ray ships exceptions between processes)
        return type(self), (str(self), self.session_id)


class CapacityError(RuntimeError):
    """No free cache slot for a new session."""


class CloudUnreachableError(ConnectionError):
    """The cloud cannot be reached: the device's link is down, or no verifier replica answers. A generation that
    already has its caption falls back to device-only decoding (`CollabConfig.fallback`) and is marked degraded."""


@dataclass
class RuleConfig:
    """How the cloud judges drafts (ciar.collab.acceptance)."""

    rule: str = "exact"  # exact | lantern | greedy | cascade
    lantern_k: int = 1000  # LANTERN: nearest codebook neighbours considered
    lantern_delta: float = 0.15  # LANTERN: total-variation budget
    cascade_threshold: float = 0.9  # CASCADE: cosine-similarity threshold


@dataclass
class OpenRequest:
    session_id: str
    prompt: str  # caption text (the cloud encodes it)
    seed: int  # the cloud's sampling stream for this session (prefix tokens, recovered and bonus tokens)
    sampling: SamplingParams
    prefix_len: int  # tokens the cloud generates itself before the device drafts (N for cloud-only)
    rule: RuleConfig = field(default_factory=RuleConfig)
    want_caption: bool = True  # return the caption embeddings (the device needs them to draft)

    def nbytes(self) -> int:
        return HEADER_BYTES + len(self.prompt.encode("utf-8"))


@dataclass
class OpenReply:
    session_id: str
    prefix_tokens: torch.Tensor  # [prefix_len] int64
    caption_emb: torch.Tensor | None  # [L, caption_dim] float16 (None unless want_caption)
    caption_mask: torch.Tensor | None  # [L] bool
    cloud_s: float  # cloud compute time spent on this request (the whole batched work it waited for)
    forward_passes: int  # sequential cloud forwards (prefill + one per prefix token after the first)
    vocab_size: int

    def nbytes(self) -> int:
        n = HEADER_BYTES + token_bytes(int(self.prefix_tokens.numel()), self.vocab_size)
        if self.caption_emb is not None:
            n += self.caption_emb.numel() * 2 + self.caption_mask.numel()  # float16 + one byte per mask entry
        return n


@dataclass
class VerifyRequest:
    session_id: str
    new_tokens: torch.Tensor  # [m] int64 accepted locally since the last exchange (m >= 0)
    draft_tokens: torch.Tensor  # [k] int64 the span (k >= 0)
    draft_probs: torch.Tensor  # [k, V] the device's post-guidance draft distributions q (sent as float16)
    device_hidden: torch.Tensor | None = None  # [m, d_device] projector inputs (interval-enhanced decoding)
    features: torch.Tensor | None = None  # [m, F] interval features of the new tokens
    burst: int = 0  # cloud burst: after a rejection the cloud samples up to this many more tokens itself
    burst_entropy: float = 0.0  # ... and stops early once its next distribution's entropy / log V is below this

    def nbytes(self, vocab_size: int) -> int:
        n = HEADER_BYTES + 2 + token_bytes(int(self.new_tokens.numel()) + int(self.draft_tokens.numel()), vocab_size)
        n += int(self.draft_probs.numel()) * 2
        if self.device_hidden is not None:
            n += feature_bytes(int(self.device_hidden.shape[0]), int(self.device_hidden.shape[-1]))
        if self.features is not None:
            n += feature_bytes(int(self.features.shape[0]), int(self.features.shape[-1]))
        return n


@dataclass
class VerifyReply:
    session_id: str
    num_accepted: int  # drafts accepted (0..k)
    next_token: int  # recovered (after a rejection) or bonus (after a full accept) token
    recovered: bool
    cloud_s: float  # cloud compute time of the batched forward + acceptance this request waited for
    batch_size: int  # sessions verified in that forward
    forward_passes: int = 1
    resumed: bool = False  # the client re-created the session before this reply (cloud_s / forward_passes include it)
    burst_tokens: torch.Tensor | None = None  # [g] int64 the cloud's own samples after next_token (cloud burst)
    vocab_size: int = 0  # for the burst tokens' encoding

    @property
    def num_burst(self) -> int:
        return 0 if self.burst_tokens is None else int(self.burst_tokens.numel())

    def nbytes(self) -> int:
        n = HEADER_BYTES + 8
        if self.num_burst:
            n += token_bytes(self.num_burst, self.vocab_size)
        return n


@dataclass
class InjectedFeatures:
    """The interval features a session's device sent with its locally accepted tokens (VerifyRequest.device_hidden /
    .features), keyed by the tokens' indices in the committed history. The cloud added their projection to those
    tokens' embeddings, so `resume` needs them to rebuild the same cache (interval-enhanced decoding)."""

    positions: torch.Tensor  # [n] int64 indices into the history (each < len(history) - 1)
    device_hidden: torch.Tensor  # [n, d_device]
    features: torch.Tensor  # [n, F]

    def nbytes(self) -> int:
        n = int(self.positions.numel())
        return 2 * n + feature_bytes(n, int(self.device_hidden.shape[-1])) + \
            feature_bytes(n, int(self.features.shape[-1]))


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
