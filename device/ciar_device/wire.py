"""The device <-> cloud wire format: CIAR's protocol messages as binary frames, defined once (numpy only).

    frame = encode_frame(Frame(VERIFY, request_id, VerifyRequest(...), token=session_token))    # -> bytes
    frame = decode_frame(data)                      # -> Frame with numpy arrays (WireError on anything malformed)
    frame = decode_frame(data, array=torch.from_numpy, sampling=SamplingParams)   # the server's view

The messages (`OpenRequest`, `OpenReply`, `VerifyRequest`, `VerifyReply`, `InjectedFeatures`, ...) are the ones
`ciar.collab.protocol` documents and every transport implements (in-process calls, Ray handles, this codec over a
WebSocket). Their array fields hold numpy arrays on a device and torch tensors in the cluster: the codec reads
either (`np.asarray`) and writes numpy (or whatever `array=` makes of it). Each message's `nbytes()` is the exact
size of its frame, computed from its shapes without encoding it, so the network model charges a simulated link the
bytes a real socket carries (tested: `len(encode_frame(...)) == nbytes()` for every message type).

Frame = 8-byte header + body, little-endian:

    header   magic b"CI" | version u8 | type u8 | request_id u32   (replies carry their request's id)
    str8     u8 length + UTF-8;  str16: u16 length + UTF-8
    tokens   token ids bit-packed at ceil(log2 V) bits each, little-endian bit order, padded to a byte
    f16[..]  IEEE half floats (draft distributions, caption embeddings, interval features)
    token32  the 32-byte session token (opaque to the device; issued by the verifier at open)

| type          | body                                                                                           |
|---------------|------------------------------------------------------------------------------------------------|
| HELLO 1       | str16 device key, str8 client name                                                             |
| WELCOME 2     | str8 device id, u32 max frame bytes, u16 max sessions, f64 messages/s, f64 idle timeout s,     |
|               | str8 server name, f64 span forward s, f64 sampled step s, f64 queue wait s (0: not measured)   |
| OPEN 3        | str8 session, i64 seed, f64 cfg_scale, f64 temperature, u32 top_k, f64 top_p, u16 prefix_len,  |
|               | u16 jacobi_window, u8 rule, u32 lantern_k, f64 lantern_delta, f64 cascade_threshold,           |
|               | u16 gsd_ranks, f64 gsd_prob_gap, f64 gsd_distance, u8 want_caption, str16 prompt               |
| OPEN_REPLY 4  | str8 session, token32, u32 V, u16 p, tokens[p], f64 cloud_s, f64 queue_s, u32 forward_passes,  |
|               | u8 caption,                                                                                    |
|               | [u16 L, u16 D, f16[L*D] caption embedding, bits[L] caption mask]                               |
| VERIFY 5      | str8 session, token32, u32 V, u16 m, u16 k, tokens[m + k] (new, then drafts), f16[k*V] draft    |
|               | distributions, u8 flags (1 hidden, 2 features), [u16 d, f16[m*d]], [u16 F, f16[m*F]], u16 burst,|
|               | f64 burst_entropy                                                                              |
| VERIFY_REPLY 6| str8 session, u16 accepted, u32 next token, u8 flags (1 recovered, 2 resumed), f64 cloud_s,     |
|               | f64 queue_s, u16 batch size, u16 forward passes, u32 V, u16 g, tokens[g] burst                 |
| RESUME 7      | OPEN's body, token32, u32 V, u16 c, tokens[c] history, u16 n, [u16[n] positions, u16 d, u16 F,  |
|               | f16[n*d], f16[n*F]] injected interval features                                                 |
| CLOSE 8       | str8 session, token32                                                                          |
| CLOSED 9      | str8 session                                                                                   |
| ERROR 10      | u16 status, f64 retry-after s, str8 session, str8 field, str16 message                         |

Errors answer a request (ERROR with its request id and an HTTP-like status: 400 bad request, 403 not this device's
session, 409 an OPEN of an id that is open with another request, 410 session lost (resume it), 413 frame too large,
422 a field out of range, 429 rate limited, 503 no capacity or the verifier past its deadline (retry after), 500
internal); a connection-level fault closes the WebSocket with a reason (`CLOSE_*`).
A frame of another protocol version raises `VersionError`; the server closes with `CLOSE_VERSION` and a reason
naming both versions.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# 2: VERIFY_REPLY carries the verifier's queue wait; 3: WELCOME carries the verifier's recent costs and OPEN_REPLY
# its queue wait (issue 29)
PROTOCOL_VERSION = 5
MAGIC = b"CI"
HEADER_BYTES = 8
TOKEN_BYTES = 32  # a session token: HMAC-SHA256
MAX_SESSION_ID = 64  # bytes of a session id on the wire (the server may allow fewer)

HELLO, WELCOME, OPEN, OPEN_REPLY, VERIFY, VERIFY_REPLY, RESUME, CLOSE, CLOSED, ERROR = range(1, 11)
TYPE_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", OPEN: "OPEN", OPEN_REPLY: "OPEN_REPLY", VERIFY: "VERIFY",
              VERIFY_REPLY: "VERIFY_REPLY", RESUME: "RESUME", CLOSE: "CLOSE", CLOSED: "CLOSED", ERROR: "ERROR"}
RULES = ("exact", "lantern", "greedy", "cascade", "gsd")

# WebSocket close codes of the device endpoint (1000-2999 are the RFC's, 4000-4999 the application's)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # idle timeout, server shutting down
CLOSE_POLICY = 1008  # rate limit abused, slow reader
CLOSE_TOO_BIG = 1009  # frame over the limit
CLOSE_OVERLOADED = 1013  # "try again later": the reason says "retry after N s"
CLOSE_PROTOCOL = 4000  # a frame that is not this protocol (bad magic, malformed HELLO, no HELLO first)
CLOSE_UNAUTHORIZED = 4001  # unknown device key
CLOSE_VERSION = 4002  # another protocol version


class WireError(ValueError):
    """A frame that is not a well-formed message of this protocol (truncated, trailing bytes, a count or id out of
    range, a non-finite float). `field`: the message field at fault, when one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class VersionError(WireError):
    """A frame of another protocol version (`version`)."""

    def __init__(self, version: int):
        super().__init__(f"unsupported protocol version {version}: this side speaks version {PROTOCOL_VERSION}",
                         field="version")
        self.version = version


# ---------------------------------------------------------------------- sizes
def token_bits(vocab_size: int) -> int:
    """Bits per token id of a V-entry vocabulary: ceil(log2 V), at least 1."""
    return max(1, math.ceil(math.log2(max(2, int(vocab_size)))))


def token_bytes(n: int, vocab_size: int) -> int:
    """Bytes for n token ids of a V-entry vocabulary, bit-packed at ceil(log2 V) bits each."""
    return (n * token_bits(vocab_size) + 7) // 8


def feature_bytes(n: int, dim: int) -> int:
    """Bytes for n float16 vectors of size dim."""
    return 2 * n * dim


def _count(a) -> int:
    return 0 if a is None else int(math.prod(a.shape))


def _str_bytes(s: str, width: int) -> int:
    return width + len(s.encode("utf-8"))


# ---------------------------------------------------------------------- messages
@dataclass
class RuleConfig:
    """How the cloud judges drafts (ciar.collab.acceptance)."""

    rule: str = "exact"  # exact | lantern | greedy | cascade | gsd
    lantern_k: int = 1000  # LANTERN: nearest codebook neighbours considered
    lantern_delta: float = 0.15  # LANTERN: total-variation budget
    cascade_threshold: float = 0.9  # CASCADE: cosine-similarity threshold
    # GSD's group of a draft x (ciar.collab.acceptance.GsdConfig; the authors' values): the tokens ranked within
    # gsd_ranks of x in p, within gsd_prob_gap of p(x) and within squared embedding distance gsd_distance of x
    gsd_ranks: int = 7
    gsd_prob_gap: float = 0.15
    gsd_distance: float = 0.5


@dataclass(frozen=True)
class Sampling:
    """The sampling settings as the wire carries them (the cluster decodes them into its SamplingParams)."""

    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


# seed, sampling, prefix_len, jacobi_window, rule (lantern, cascade, gsd), want_caption
_OPEN_FIXED = 8 + 8 + 8 + 4 + 8 + 2 + 2 + 1 + 4 + 8 + 8 + 2 + 8 + 8 + 1


@dataclass
class OpenRequest:
    session_id: str
    prompt: str  # caption text (the cloud encodes it)
    seed: int  # the cloud's sampling stream for this session (prefix tokens, recovered and bonus tokens)
    sampling: Any  # cfg_scale, temperature, top_k, top_p (`Sampling`; SamplingParams in the cluster)
    prefix_len: int  # tokens the cloud generates itself before the device drafts (N for cloud-only)
    rule: RuleConfig = field(default_factory=RuleConfig)
    want_caption: bool = True  # return the caption embeddings (the device needs them to draft)
    # the cloud decodes its prefix tokens by speculative Jacobi decoding with windows of this many drafts (SJD:
    # several tokens per forward, the same distribution; `ciar.engine.works.JacobiWork`); 0: one token per forward
    jacobi_window: int = 0

    def body_bytes(self) -> int:
        return _str_bytes(self.session_id, 1) + _OPEN_FIXED + _str_bytes(self.prompt, 2)

    def nbytes(self) -> int:
        return HEADER_BYTES + self.body_bytes()


@dataclass
class OpenReply:
    session_id: str
    prefix_tokens: Any  # [prefix_len] int64
    caption_emb: Any  # [L, caption_dim] float16 (None unless want_caption)
    caption_mask: Any  # [L] bool
    cloud_s: float  # cloud compute time spent on this request (the whole batched work it waited for)
    forward_passes: int  # sequential cloud forwards (prefill + one per prefix token after the first)
    vocab_size: int
    queue_s: float = 0.0  # seconds the request waited in the verifier's queue before its first forward

    def nbytes(self) -> int:
        n = HEADER_BYTES + _str_bytes(self.session_id, 1) + TOKEN_BYTES + 4 + 2 + \
            token_bytes(_count(self.prefix_tokens), self.vocab_size) + 8 + 8 + 4 + 1
        if self.caption_emb is not None:
            n += 4 + feature_bytes(*self.caption_emb.shape) + (int(self.caption_emb.shape[0]) + 7) // 8
        return n


@dataclass
class VerifyRequest:
    session_id: str
    new_tokens: Any  # [m] int64 accepted locally since the last exchange (m >= 0)
    draft_tokens: Any  # [k] int64 the span (k >= 0)
    draft_probs: Any  # [k, V] float16: the device's post-guidance draft distributions q, as sent (k may be 0)
    device_hidden: Any = None  # [m, d_device] float16 projector inputs (interval-enhanced decoding)
    features: Any = None  # [m, F] float16 interval features of the new tokens
    burst: int = 0  # cloud burst: after a rejection the cloud samples up to this many more tokens itself
    burst_entropy: float = 0.0  # ... and stops early once its next distribution's entropy / log V is below this

    def nbytes(self, vocab_size: int) -> int:
        m, k = _count(self.new_tokens), _count(self.draft_tokens)
        n = HEADER_BYTES + _str_bytes(self.session_id, 1) + TOKEN_BYTES + 4 + 2 + 2 + token_bytes(m + k, vocab_size)
        n += 2 * _count(self.draft_probs) + 1
        if self.device_hidden is not None:
            n += 2 + 2 * _count(self.device_hidden)
        if self.features is not None:
            n += 2 + 2 * _count(self.features)
        return n + 2 + 8


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
    burst_tokens: Any = None  # [g] int64 the cloud's own samples after next_token (cloud burst)
    vocab_size: int = 0  # for the burst tokens' encoding
    queue_s: float = 0.0  # seconds the request waited in the verifier's queue before its first forward

    @property
    def num_burst(self) -> int:
        return _count(self.burst_tokens)

    def nbytes(self) -> int:
        return HEADER_BYTES + _str_bytes(self.session_id, 1) + 2 + 4 + 1 + 8 + 8 + 2 + 2 + 4 + 2 + \
            token_bytes(self.num_burst, max(self.vocab_size, 2))


@dataclass
class InjectedFeatures:
    """The interval features a session's device sent with its locally accepted tokens (VerifyRequest.device_hidden /
    .features), keyed by the tokens' indices in the committed history. The cloud added their projection to those
    tokens' embeddings, so `resume` needs them to rebuild the same cache (interval-enhanced decoding)."""

    positions: Any  # [n] int64 indices into the history (each < len(history) - 1)
    device_hidden: Any  # [n, d_device] float16
    features: Any  # [n, F] float16

    def nbytes(self) -> int:
        n = _count(self.positions)
        return 2 * n + 2 + 2 + 2 * _count(self.device_hidden) + 2 * _count(self.features)


@dataclass
class ResumeRequest:
    """Re-create a lost session from the device's committed tokens (`CloudClient.resume`)."""

    request: OpenRequest
    history: Any  # [c] int64 committed tokens
    injected: InjectedFeatures | None = None
    vocab_size: int = 0  # the vocabulary the history's ids are packed for

    def nbytes(self) -> int:
        n = HEADER_BYTES + self.request.body_bytes() + TOKEN_BYTES + 4 + 2 + \
            token_bytes(_count(self.history), self.vocab_size) + 2
        if self.injected is not None and _count(self.injected.positions):
            n += self.injected.nbytes()
        return n


@dataclass
class CloseRequest:
    session_id: str

    def nbytes(self) -> int:
        return HEADER_BYTES + _str_bytes(self.session_id, 1) + TOKEN_BYTES


@dataclass
class CloseReply:
    session_id: str

    def nbytes(self) -> int:
        return HEADER_BYTES + _str_bytes(self.session_id, 1)


@dataclass
class Hello:
    """The first frame of a connection: the device's key (checked against the server's digests) and its name."""

    key: str
    client: str = ""

    def nbytes(self) -> int:
        return HEADER_BYTES + _str_bytes(self.key, 2) + _str_bytes(self.client, 1)


@dataclass
class Welcome:
    """The server's answer to HELLO: who the device is to it, and the limits it enforces."""

    device_id: str
    max_frame_bytes: int
    max_sessions: int
    messages_per_s: float
    idle_timeout_s: float
    server: str = ""
    # the verifier's recent figures, as its replies reported them (the adaptive policy's start: CostHint); 0: none
    verify_s: float = 0.0  # its span forward
    step_s: float = 0.0  # one token it samples itself
    queue_s: float = 0.0  # the queue wait per verify

    def nbytes(self) -> int:
        return HEADER_BYTES + _str_bytes(self.device_id, 1) + 4 + 2 + 8 + 8 + _str_bytes(self.server, 1) + 3 * 8


@dataclass
class ErrorReply:
    status: int  # HTTP-like: 400, 403, 409, 410, 413, 422, 429, 500, 503
    message: str
    retry_after_s: float = 0.0
    session_id: str = ""
    field: str = ""  # the request field at fault, when one is

    def nbytes(self) -> int:
        return HEADER_BYTES + 2 + 8 + _str_bytes(self.session_id, 1) + _str_bytes(self.field, 1) + \
            _str_bytes(self.message, 2)


BODY_TYPES = {HELLO: Hello, WELCOME: Welcome, OPEN: OpenRequest, OPEN_REPLY: OpenReply, VERIFY: VerifyRequest,
              VERIFY_REPLY: VerifyReply, RESUME: ResumeRequest, CLOSE: CloseRequest, CLOSED: CloseReply,
              ERROR: ErrorReply}
SESSION_TYPES = (OPEN_REPLY, VERIFY, RESUME, CLOSE)  # frames that carry a session token


@dataclass
class Frame:
    type: int  # HELLO .. ERROR
    request_id: int  # u32; a reply carries its request's id
    body: Any  # the message (BODY_TYPES[type])
    token: bytes = b""  # the session token (OPEN_REPLY issues it; VERIFY / RESUME / CLOSE present it)

    @property
    def name(self) -> str:
        return TYPE_NAMES.get(self.type, str(self.type))


MAX_SPAN = 32  # the longest span a device drafts (the span knob's range, ciar.collab.knobs; ciar_device.policy.SPANS)


def largest_frame_bytes(num_tokens: int, vocab_size: int, hidden_dim: int = 0, feature_dim: int = 0,
                        max_span: int = MAX_SPAN, session_id_bytes: int = MAX_SESSION_ID,
                        prompt_bytes: int = 1600) -> int:
    """The largest frame a device sends while making an image of `num_tokens` tokens: a VERIFY carrying every token
    accepted locally since its last exchange (m of them, each with its interval features: `hidden_dim` +
    `feature_dim` float16 values, 0 and 0 without Inter-Enhance) and a span of k <= `max_span` drafts with their
    [k, V] float16 distributions (m + k <= num_tokens), or a RESUME of the whole history with every injected
    feature (a RESUME carries the OPEN's prompt: `prompt_bytes`, the API's 400 characters at 4 UTF-8 bytes each).
    What the device endpoint's `max_frame_bytes` must allow for that world (services.config.DeviceEndpointConfig):
    LlamaGen-XL's device (1,280-d hidden, 16,384 codes) at Stage I's 256 tokens needs 1.6 MB, at Stage II's
    1,024 tokens 3.6 MB."""
    n = int(num_tokens)
    sid, prompt = "s" * int(session_id_bytes), "p" * int(prompt_bytes)
    per_token = (hidden_dim, feature_dim)

    def verify(m: int, k: int) -> int:
        feats = [np.empty((m, d), np.float16) if hidden_dim else None for d in per_token]
        return VerifyRequest(sid, np.empty(m), np.empty(k), np.empty((k, vocab_size), np.float16),
                             *feats).nbytes(vocab_size)

    # the size is linear in (m, k) with m + k <= n: the largest is at a corner (the longest span, or one draft)
    k_max = max(1, min(int(max_span), n))
    largest = max(verify(n - k_max, k_max), verify(n - 1, 1))
    injected = (InjectedFeatures(np.empty(n - 1), np.empty((n - 1, hidden_dim), np.float16),
                                 np.empty((n - 1, feature_dim), np.float16)) if hidden_dim and n > 1 else None)
    resume = ResumeRequest(OpenRequest(sid, prompt, 0, Sampling(), 0), np.empty(n), injected, vocab_size)
    return max(largest, resume.nbytes())


# ---------------------------------------------------------------------- encoding
def _np(a, dtype) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor (read without importing torch)
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)


class _Writer:
    def __init__(self):
        self.buf = bytearray()

    def pack(self, fmt: str, *values) -> None:
        try:
            self.buf += struct.pack("<" + fmt, *values)
        except struct.error as e:
            raise WireError(f"value out of range for the wire: {values!r} ({e})") from None

    def str_(self, s: str, width: int, what: str) -> None:
        b = s.encode("utf-8")
        if len(b) >= 1 << (8 * width):
            raise WireError(f"{what} of {len(b)} bytes is too long for the wire", field=what)
        self.pack("B" if width == 1 else "H", len(b))
        self.buf += b

    def tokens(self, ids, vocab_size: int, what: str) -> None:
        a = _np(ids, np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise WireError(f"{what}: token ids must be in [0, {vocab_size})", field=what)
        bits = token_bits(vocab_size)
        b = ((a.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
        self.buf += np.packbits(b.reshape(-1), bitorder="little").tobytes()

    def f16(self, a) -> None:
        self.buf += _np(a, np.float16).tobytes()

    def token(self, token: bytes) -> None:
        if token and len(token) != TOKEN_BYTES:
            raise WireError(f"a session token has {TOKEN_BYTES} bytes, got {len(token)}", field="token")
        self.buf += token or bytes(TOKEN_BYTES)


def _open_body(w: _Writer, r: OpenRequest) -> None:
    s = r.sampling
    if r.rule.rule not in RULES:
        raise WireError(f"unknown acceptance rule {r.rule.rule!r}", field="rule")
    w.str_(r.session_id, 1, "session_id")
    rule = r.rule
    w.pack("qddIdHHBIddHddB", int(r.seed), float(s.cfg_scale), float(s.temperature), int(s.top_k), float(s.top_p),
           int(r.prefix_len), int(r.jacobi_window), RULES.index(rule.rule), int(rule.lantern_k),
           float(rule.lantern_delta), float(rule.cascade_threshold), int(rule.gsd_ranks), float(rule.gsd_prob_gap),
           float(rule.gsd_distance), int(bool(r.want_caption)))
    w.str_(r.prompt, 2, "prompt")


def encode_frame(frame: Frame) -> bytes:
    """Frame -> bytes (the frame's header, then its body as the module docstring lays it out)."""
    w = _Writer()
    w.pack("2sBBI", MAGIC, PROTOCOL_VERSION, frame.type, frame.request_id)
    b, t = frame.body, frame.type
    if not isinstance(b, BODY_TYPES.get(t, ())):
        raise WireError(f"frame type {frame.name} carries a {BODY_TYPES.get(t, object).__name__}, "
                        f"got {type(b).__name__}")
    if t == HELLO:
        w.str_(b.key, 2, "key")
        w.str_(b.client, 1, "client")
    elif t == WELCOME:
        w.str_(b.device_id, 1, "device_id")
        w.pack("IHdd", b.max_frame_bytes, b.max_sessions, b.messages_per_s, b.idle_timeout_s)
        w.str_(b.server, 1, "server")
        w.pack("ddd", float(b.verify_s), float(b.step_s), float(b.queue_s))
    elif t == OPEN:
        _open_body(w, b)
    elif t == OPEN_REPLY:
        w.str_(b.session_id, 1, "session_id")
        w.token(frame.token)
        w.pack("IH", b.vocab_size, _count(b.prefix_tokens))
        w.tokens(b.prefix_tokens, b.vocab_size, "prefix_tokens")
        w.pack("ddIB", float(b.cloud_s), float(b.queue_s), int(b.forward_passes), int(b.caption_emb is not None))
        if b.caption_emb is not None:
            emb = b.caption_emb
            if not (emb.is_floating_point() if hasattr(emb, "is_floating_point") else
                    np.issubdtype(np.asarray(emb).dtype, np.floating)):
                # token ids as float16 would be rounded above 2048: a token-id world sends its prompt's embeddings
                raise WireError("caption_emb must be float embeddings [L, D], got integer values (token ids)",
                                field="caption_emb")
            n_pos, dim = b.caption_emb.shape
            w.pack("HH", n_pos, dim)
            w.f16(b.caption_emb)
            mask = np.ones(n_pos, bool) if b.caption_mask is None else _np(b.caption_mask, bool).reshape(-1)
            if mask.size != n_pos:
                raise WireError(f"caption_mask has {mask.size} entries for {n_pos} positions", field="caption_mask")
            w.buf += np.packbits(mask, bitorder="little").tobytes()
    elif t == VERIFY:
        m, k = _count(b.new_tokens), _count(b.draft_tokens)
        if len(b.draft_probs.shape) != 2:
            raise WireError(f"draft_probs must be [k, V], got {tuple(b.draft_probs.shape)}", field="draft_probs")
        vocab = int(b.draft_probs.shape[1])
        _check_vocab(vocab)
        w.str_(b.session_id, 1, "session_id")
        w.token(frame.token)
        w.pack("IHH", vocab, m, k)
        w.tokens(np.concatenate([_np(b.new_tokens, np.int64).reshape(-1), _np(b.draft_tokens, np.int64).reshape(-1)]),
                 vocab, "tokens")
        if _count(b.draft_probs) != k * vocab:
            raise WireError(f"draft_probs must be [{k}, {vocab}], got {tuple(b.draft_probs.shape)}",
                            field="draft_probs")
        w.f16(b.draft_probs)
        w.pack("B", int(b.device_hidden is not None) | 2 * int(b.features is not None))
        for name, a in (("device_hidden", b.device_hidden), ("features", b.features)):
            if a is not None:
                if a.shape[0] != m or len(a.shape) != 2:
                    raise WireError(f"{name} must be [{m}, dim], got {tuple(a.shape)}", field=name)
                w.pack("H", int(a.shape[1]))
                w.f16(a)
        w.pack("Hd", int(b.burst), float(b.burst_entropy))
    elif t == VERIFY_REPLY:
        w.str_(b.session_id, 1, "session_id")
        w.pack("HIBddHHIH", int(b.num_accepted), int(b.next_token), int(bool(b.recovered)) | 2 * int(bool(b.resumed)),
               float(b.cloud_s), float(b.queue_s), int(b.batch_size), int(b.forward_passes), int(b.vocab_size),
               b.num_burst)
        if b.num_burst:
            w.tokens(b.burst_tokens, b.vocab_size, "burst_tokens")
    elif t == RESUME:
        vocab = int(b.vocab_size)
        _check_vocab(vocab)
        _open_body(w, b.request)
        w.token(frame.token)
        w.pack("IH", vocab, _count(b.history))
        w.tokens(b.history, vocab, "history")
        inj = b.injected
        n = _count(inj.positions) if inj is not None else 0
        w.pack("H", n)
        if n:
            w.buf += _np(inj.positions, np.uint16).tobytes()
            w.pack("HH", int(inj.device_hidden.shape[-1]), int(inj.features.shape[-1]))
            w.f16(inj.device_hidden)
            w.f16(inj.features)
    elif t == CLOSE:
        w.str_(b.session_id, 1, "session_id")
        w.token(frame.token)
    elif t == CLOSED:
        w.str_(b.session_id, 1, "session_id")
    elif t == ERROR:
        w.pack("Hd", int(b.status), float(b.retry_after_s))
        w.str_(b.session_id, 1, "session_id")
        w.str_(b.field, 1, "field")
        w.str_(b.message, 2, "message")
    return bytes(w.buf)


# ---------------------------------------------------------------------- decoding
class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError(f"truncated frame: {what} needs {n} bytes, {len(self.data) - self.pos} left", field=what)
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size, what))

    def str_(self, width: int, what: str, limit: int | None = None) -> str:
        (n,) = self.unpack("B" if width == 1 else "H", what)
        if limit is not None and n > limit:
            raise WireError(f"{what} of {n} bytes is over the {limit}-byte limit", field=what)
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"{what} is not valid UTF-8", field=what) from None

    def tokens(self, n: int, vocab_size: int, what: str) -> np.ndarray:
        bits = token_bits(vocab_size)
        raw = np.frombuffer(self.take((n * bits + 7) // 8, what), np.uint8)
        b = np.unpackbits(raw, count=n * bits, bitorder="little").reshape(n, bits).astype(np.int64)
        ids = (b << np.arange(bits, dtype=np.int64)).sum(axis=1) if n else np.zeros(0, np.int64)
        if n and ids.max() >= vocab_size:
            raise WireError(f"{what}: token ids must be in [0, {vocab_size})", field=what)
        return ids

    def f16(self, shape: tuple, what: str, finite: bool = True) -> np.ndarray:
        n = int(math.prod(shape))
        a = np.frombuffer(self.take(2 * n, what), np.float16).reshape(shape).copy()
        if finite and n and not np.isfinite(a).all():
            raise WireError(f"{what} holds non-finite values", field=what)
        return a

    def token(self) -> bytes:
        return bytes(self.take(TOKEN_BYTES, "token"))


def _open_read(r: _Reader, sampling: Callable) -> OpenRequest:
    sid = r.str_(1, "session_id", MAX_SESSION_ID)
    seed, cfg, temp, top_k, top_p, prefix_len, window, rule, lk, ld, ct, gr, gp, gd, want = r.unpack(
        "qddIdHHBIddHddB", "open")
    if rule >= len(RULES):
        raise WireError(f"unknown acceptance rule {rule}", field="rule")
    try:
        params = sampling(cfg_scale=cfg, temperature=temp, top_k=top_k, top_p=top_p)
    except (TypeError, ValueError) as e:
        raise WireError(f"sampling: {e}", field="sampling") from None
    prompt = r.str_(2, "prompt")
    return OpenRequest(sid, prompt, seed, params, prefix_len, RuleConfig(RULES[rule], lk, ld, ct, gr, gp, gd),
                       bool(want), window)


def decode_header(data: bytes) -> tuple[int, int, int]:
    """-> (version, type, request_id) of a frame; WireError when it is not one (VersionError is not raised here)."""
    if len(data) < HEADER_BYTES:
        raise WireError(f"truncated frame: {len(data)} bytes, the header alone has {HEADER_BYTES}", field="header")
    magic, version, ftype, rid = struct.unpack_from("<2sBBI", data)
    if magic != MAGIC:
        raise WireError("not a CIAR frame (bad magic)", field="header")
    return version, ftype, rid


def decode_frame(data: bytes, *, array: Callable[[np.ndarray], Any] | None = None,
                 sampling: Callable[..., Any] = Sampling) -> Frame:
    """bytes -> Frame. Arrays are numpy (int64 token ids, float16 vectors, bool masks) unless `array` converts them
    (e.g. `torch.from_numpy`); OPEN / RESUME sampling settings are built with `sampling(**fields)` (a ValueError
    there is a WireError naming `sampling`). Raises WireError on anything malformed, VersionError on another
    version, never anything else."""
    version, ftype, rid = decode_header(data)
    if version != PROTOCOL_VERSION:
        raise VersionError(version)
    if ftype not in BODY_TYPES:
        raise WireError(f"unknown frame type {ftype}", field="type")
    arr = array or (lambda a: a)
    r = _Reader(data)
    r.pos = HEADER_BYTES
    token = b""
    if ftype == HELLO:
        body = Hello(r.str_(2, "key", 4096), r.str_(1, "client"))
    elif ftype == WELCOME:
        dev = r.str_(1, "device_id")
        mf, ms, rate, idle = r.unpack("IHdd", "welcome")
        server = r.str_(1, "server")
        body = Welcome(dev, mf, ms, rate, idle, server, *r.unpack("ddd", "welcome"))
    elif ftype == OPEN:
        body = _open_read(r, sampling)
    elif ftype == OPEN_REPLY:
        sid = r.str_(1, "session_id", MAX_SESSION_ID)
        token = r.token()
        vocab, p = r.unpack("IH", "open_reply")
        _check_vocab(vocab)
        prefix = r.tokens(p, vocab, "prefix_tokens")
        cloud_s, queue_s, passes, has_cap = r.unpack("ddIB", "open_reply")
        emb = mask = None
        if has_cap:
            n_pos, dim = r.unpack("HH", "caption")
            emb = r.f16((n_pos, dim), "caption_emb")
            bits = np.frombuffer(r.take((n_pos + 7) // 8, "caption_mask"), np.uint8)
            mask = arr(np.unpackbits(bits, count=n_pos, bitorder="little").astype(bool))
            emb = arr(emb)
        body = OpenReply(sid, arr(prefix), emb, mask, cloud_s, passes, vocab, queue_s)
    elif ftype == VERIFY:
        sid = r.str_(1, "session_id", MAX_SESSION_ID)
        token = r.token()
        vocab, m, k = r.unpack("IHH", "verify")
        _check_vocab(vocab)
        ids = r.tokens(m + k, vocab, "tokens")
        probs = r.f16((k, vocab), "draft_probs")
        if k and (probs < 0).any():
            raise WireError("draft_probs must be >= 0", field="draft_probs")
        (flags,) = r.unpack("B", "flags")
        if flags & ~3:
            raise WireError(f"unknown verify flags {flags:#x}", field="flags")
        hidden = feats = None
        if flags & 1:
            (d,) = r.unpack("H", "device_hidden")
            hidden = arr(r.f16((m, d), "device_hidden"))
        if flags & 2:
            (f,) = r.unpack("H", "features")
            feats = arr(r.f16((m, f), "features"))
        burst, burst_entropy = r.unpack("Hd", "burst")
        body = VerifyRequest(sid, arr(ids[:m].copy()), arr(ids[m:].copy()), arr(probs), hidden, feats, burst,
                             burst_entropy)
    elif ftype == VERIFY_REPLY:
        sid = r.str_(1, "session_id", MAX_SESSION_ID)
        n, z, flags, cloud_s, queue_s, bs, passes, vocab, g = r.unpack("HIBddHHIH", "verify_reply")
        burst = None
        if g:
            _check_vocab(vocab)
            burst = arr(r.tokens(g, vocab, "burst_tokens"))
        body = VerifyReply(sid, n, z, bool(flags & 1), cloud_s, bs, passes, bool(flags & 2), burst, vocab, queue_s)
    elif ftype == RESUME:
        req = _open_read(r, sampling)
        token = r.token()
        vocab, c = r.unpack("IH", "resume")
        _check_vocab(vocab)
        history = r.tokens(c, vocab, "history")
        (n,) = r.unpack("H", "injected")
        inj = None
        if n:
            pos = np.frombuffer(r.take(2 * n, "positions"), np.uint16).astype(np.int64)
            d, f = r.unpack("HH", "injected")
            inj = InjectedFeatures(arr(pos), arr(r.f16((n, d), "device_hidden")), arr(r.f16((n, f), "features")))
        body = ResumeRequest(req, arr(history), inj, vocab)
    elif ftype == CLOSE:
        body = CloseRequest(r.str_(1, "session_id", MAX_SESSION_ID))
        token = r.token()
    elif ftype == CLOSED:
        body = CloseReply(r.str_(1, "session_id", MAX_SESSION_ID))
    else:  # ERROR
        status, retry = r.unpack("Hd", "error")
        sid = r.str_(1, "session_id")
        fld = r.str_(1, "field")
        body = ErrorReply(status, r.str_(2, "message"), retry, sid, fld)
    if r.pos != len(r.data):
        raise WireError(f"{len(r.data) - r.pos} trailing bytes after a {TYPE_NAMES[ftype]} frame", field="body")
    return Frame(ftype, rid, body, token)


def _check_vocab(vocab: int) -> None:
    if not 2 <= vocab <= 1 << 24:
        raise WireError(f"vocabulary size {vocab} out of range [2, 2^24]", field="vocab_size")
