"""The device's maths on numpy: guidance and sampling, the float16 draft, the logit box, the gates, the features.

A torch-free port (numpy only) of what the torch device side computes for every drafted token, one function for
one function, on arrays of shape [..., V] (V = 1024 for the scenes world, 16384 for LlamaGen; vectorised, no
Python loop over V):

    logits_to_probs   ciar.decoding.sampling.logits_to_probs (CFG -> temperature -> top-k -> top-p; `guide`)
    sample, uniform   the device's draw (see "Draws" below; the cloud's sampler is ciar.decoding.sampling.sample)
    quantize_draft    ciar.collab.protocol.quantize_draft
    draft_distribution  ciar.collab.protocol.draft_distribution
    guided_interval   ciar.collab.interval.guided_interval
    inter_fuse        ciar.collab.interval.inter_fuse (with `_log_rest`)
    uncertainty, normalized_uncertainty, interval_uncertainty   ciar.collab.interval (same names)
    interval_features, interval_feature_dim                     ciar.collab.interval (same names, same layout)
    lower_score, entropy_score, softmax_score, topk_score       ciar.collab.gating (same names)
    gate_score        ciar.collab.gating.gate_scores for one position (returns a float)

    q32 = logits_to_probs(cond, cfg_scale=1.5, uncond_logits=uncond)   # or logits_to_probs(cond, params, ...)
    q_sent, q_used = quantize_draft(q32)                                # float16 as sent, float32 to draw from
    x = sample(q_used, uniform(seed, DRAFT_STREAM, position))           # the draw of image token `position`
    c, r = guided_interval(c_cond, r_cond, c_uncond, r_uncond, cfg_scale=1.5)
    escalate = gate_score("lower", center=c, radius=r, drafted=x) > tau

Precision: the same dtypes as the torch code (float32 in and out; float64 inside InterFuse, the lower bound and the
top-p running sum), with deliberate differences that are each at least as accurate as the original and give the same
bits on every CPU: softmax is evaluated in float64 and rounded to float32 once; sums of float32 vectors (Omega, the
renormalisations) accumulate in float64 and are rounded once (torch's float32 std already accumulates in float64);
entropies are taken in float64; `_log_rest` takes one exp pass instead of three (same formula otherwise).
Elementwise float32 steps (guidance, temperature, the radius combination, float16 rounding) are the same IEEE
operations as torch's (python scalars rounded to float32 first, as torch does), hence bit-identical.

Measured against torch 2.13 on CPU (AVX512) by tests/device/test_maths.py (random inputs of several shapes, V = 1 ..
16384, ties, masked -inf logits, every sampling edge case) and on 408 real drafts of the shipped scenes device:
  - quantize_draft of the same float32 q: q_sent bit-identical, always. q_used: bit-identical whenever the float16
    values sum below 1 (both sums are then exact); otherwise ours is the exact sum rounded once while torch's float32
    sum may round again once partial sums pass 1: up to 4 float32 ulps in ~2 % of peaked random rows (3 of 408 real
    rows). A float64 sum in `ciar.collab.protocol.draft_distribution` would make the two bit-identical everywhere.
  - logits_to_probs: within 4.4e-6 relative (tests allow 1e-5; torch's float32 softmax uses a ~20-ulp exp on AVX512
    and flushes float32 subnormals to 0), same support under every top-k / top-p / tie rule tested; temperature 0
    gives the identical one-hot. From the same logits, our float16 draft equals the device's in 404 of 408 real rows
    (4 entries off by one float16 ulp). The protocol is unaffected: the cloud judges the q_sent the device sent.
  - guided_interval, guide, softmax_score: bit-identical. inter_fuse bounds: bit-identical in every tested case
    (tests allow 1e-6 relative + 1e-12). lower_score: bit-identical (all 408 real scores too). interval U: within
    2.4e-7 relative (float32 sum order). interval_features: within 2e-6 absolute / 1.2e-6 relative on values > 1e-3
    (tests: 1e-5 relative + 1e-6). entropy_score within 1.2e-7, topk_score within 1.5e-8 absolute.
  - the shipped device's calibrated gates ("lower" at tau 7.375, "interval" at tau 52) make the same escalate /
    accept decision as torch's on all 408 real positions; the closest score was 0.015 (lower) / 0.44 (interval)
    from its tau.
  - interval_features on exactly tied centers among the `top` (e.g. masked -inf ones): the radii of the tied
    entries may come in another order than torch.topk's, which is itself unspecified.

Draws: `sample` is an inverse-CDF draw at one uniform double u, the index of the first entry whose float64 running
sum exceeds u * total; zero-probability tokens are never drawn (a one-hot row always gives its token). u comes from
`uniform(seed, stream, position)`, a counter-based generator (splitmix64 of the seed, the stream and the image
position), which `web/src/maths.js` computes bit for bit: devices that compute the same draft distribution draw the
same token (docs/architecture.md §7, "Draws").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

GATES = ("interval", "lower", "entropy", "softmax", "random", "topk")
FEATURE_LOGIT_FLOOR = -50.0  # ciar.collab.interval.FEATURE_LOGIT_FLOOR
_F32_TINY = float(np.finfo(np.float32).tiny)
_SAMPLING_FIELDS = ("cfg_scale", "temperature", "top_k", "top_p")


# ---------------------------------------------------------------------------------------------- helpers


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _logsumexp(a: np.ndarray) -> np.ndarray:
    """float64 [..., V] (entries may be -inf) -> [..., 1]; -inf when the row has no finite entry."""
    m = a.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(a - m).sum(axis=-1, keepdims=True)) + m


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """float64 logistic, stable at both ends (sigmoid(inf) = 1, sigmoid(-inf) = 0)."""
    e = np.exp(-np.abs(x))
    d = 1.0 / (1.0 + e)
    return np.where(x >= 0, d, e * d)


def _softmax64(x: np.ndarray) -> np.ndarray:
    """softmax over the last axis, evaluated in float64 (returned as float64)."""
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def _softmax_entropy(x: np.ndarray) -> np.ndarray:
    """Entropy of softmax(x) over the last axis, float64: log s - sum p (x - max), with e = exp(x - max), s = sum e,
    p = e / s (masked -inf entries contribute 0); one exp pass and no log over V."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        d = x - m
        e = np.exp(d)
        s = e.sum(axis=-1, keepdims=True)
        d = np.where(e > 0, d, 0.0)
        return np.log(s[..., 0]) - (e * d).sum(axis=-1) / s[..., 0]


def _entr_sum(p: np.ndarray) -> np.ndarray:
    """sum over the last axis of -p log p (0 log 0 = 0), float64."""
    p = p.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), np.where(p == 0, 0.0, -np.inf))
    return e.sum(axis=-1)


def _sum32(x: np.ndarray, keepdims: bool = False) -> np.ndarray:
    """float32 sum over the last axis, accumulated in float64 and rounded once."""
    return x.sum(axis=-1, dtype=np.float64, keepdims=keepdims).astype(np.float32)


_F16_MIN_NORMAL = np.float32(2.0 ** -14)


def to_float16(x) -> np.ndarray:
    """float32 -> float16, round to nearest even: the same bits as `x.astype(np.float16)` (and torch's
    `.to(torch.float16)`), fast for the many probabilities below float16's smallest normal (2^-14).

    numpy's own conversion takes ~70 ns per element whose result is a float16 subnormal (or underflows to 0), which
    a peaked 16384-token distribution is nearly all of: ~1.2 ms per draft. Those entries are rounded here in float32
    instead: |x| + 0.5 - 0.5 rounds |x| < 2^-14 to a multiple of 2^-24 with ties to even (0.5's float32 ulp is
    2^-24, and 0.5 is an even multiple), and m = that / 2^-24 (0..1024) is exactly the float16 bit pattern.
    """
    x = _f32(x)
    a = np.abs(x)
    small = a < _F16_MIN_NORMAL  # NaN: False
    m = ((np.where(small, a, np.float32(0.0)) + np.float32(0.5)) - np.float32(0.5)) * np.float32(2.0 ** 24)
    small_bits = m.astype(np.uint16) | ((x.view(np.uint32) >> 16) & 0x8000).astype(np.uint16)
    big_bits = np.where(small, np.float32(0.0), x).astype(np.float16).view(np.uint16)
    return np.where(small, small_bits, big_bits).view(np.float16)


def from_float16(h) -> np.ndarray:
    """float16 -> float32, exact: the same bits as `h.astype(np.float32)`, by integer arithmetic (numpy's own
    conversion is ~4x slower on float16 subnormals, the bulk of a float16 draft distribution)."""
    b = np.asarray(h, dtype=np.float16).view(np.uint16).astype(np.uint32)
    mag = b & np.uint32(0x7FFF)
    bits = (mag << np.uint32(13)) + np.uint32(112 << 23)  # normal: rebias the exponent 15 -> 127
    bits = np.where(mag >= 0x7C00, bits + np.uint32(112 << 23), bits)  # inf / NaN: exponent all ones
    tiny = (mag.astype(np.float32) * np.float32(2.0 ** -24)).view(np.uint32)  # subnormal (and 0): m * 2^-24
    return (np.where(mag < 0x400, tiny, bits) | ((b & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


def kth_largest(x: np.ndarray, k: int) -> np.ndarray:
    """x [..., V], 1 <= k <= V -> [..., 1]: each row's k-th largest value, equal values counted apart (a selection,
    no sort). `logits_to_probs`'s top-k threshold, and the cloud's on the host (`ciar.decoding.sampling`)."""
    at = x.shape[-1] - k
    return np.partition(x, at, axis=-1)[..., at:at + 1]


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices [..., k] of the k largest entries of x [..., V], in descending order of value (lowest index first
    among equal values inside the chosen set; which of several values tied at the k-th place is chosen is
    unspecified, as for torch.topk)."""
    V = x.shape[-1]
    if k < V:
        idx = np.sort(np.argpartition(-x, k - 1, axis=-1)[..., :k], axis=-1)
    else:
        idx = np.broadcast_to(np.arange(V), x.shape)
    order = np.argsort(-np.take_along_axis(x, idx, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_sampling(cfg_scale: float = 1.0, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> tuple[float, float, int, float]:
    """Validate the four sampling settings as `ciar.decoding.sampling.SamplingParams.validate` does (ValueError
    naming the field); -> (cfg_scale, temperature, top_k, top_p) as float, float, int, float."""
    if _real("cfg_scale", cfg_scale) < 1.0:
        raise ValueError(f"cfg_scale must be >= 1 (1 disables guidance), got {cfg_scale!r}")
    if _real("temperature", temperature) < 0.0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {top_k!r}")
    if not 0.0 < _real("top_p", top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables), got {top_p!r}")
    return float(cfg_scale), float(temperature), int(top_k), float(top_p)


# ---------------------------------------------------------------------------------------------- sampling


def guide(cond_logits, uncond_logits, cfg_scale: float) -> np.ndarray:
    """Classifier-free guidance on float32 logits: `uncond + (cond - uncond) * cfg_scale` ([..., V])."""
    u = _f32(uncond_logits)
    return u + (_f32(cond_logits) - u) * np.float32(cfg_scale)


def logits_to_probs(logits, cfg_scale=1.0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    uncond_logits=None) -> np.ndarray:
    """logits [..., V] (conditional rows), uncond_logits [..., V] or None -> probs [..., V] float32.

    CFG -> temperature -> top-k -> top-p, as `ciar.decoding.sampling.logits_to_probs`:
    1. guidance `u + (c - u) * cfg_scale` when `uncond_logits` is given and cfg_scale != 1;
    2. temperature 0: the one-hot of argmax (lowest index on ties), nothing else applies; otherwise
       (temperature != 1) `(l - max l) / max(temperature, float32 tiny)`;
    3. top-k (0 disables, k >= V too): keep the logits >= the k-th largest (ties with it all kept);
    4. softmax; top-p (1 disables): keep the smallest set of most probable tokens whose mass reaches top_p (the most
       probable always; ties with the least probable kept one kept too), measured on the float32 probabilities
       with a float64 running sum rounded to float32 (torch's CPU cumsum), and renormalise.

    The second argument may instead be a params object or mapping with the four fields (`cfg_scale`,
    `temperature`, `top_k`, `top_p`; e.g. `SamplingParams` or its `to_dict()`). Settings are validated as
    SamplingParams does (ValueError naming the field).
    """
    if isinstance(cfg_scale, Mapping):
        cfg_scale, temperature, top_k, top_p = (cfg_scale[f] for f in _SAMPLING_FIELDS)
    elif not isinstance(cfg_scale, numbers.Real):
        cfg_scale, temperature, top_k, top_p = (getattr(cfg_scale, f) for f in _SAMPLING_FIELDS)
    cfg_scale, temperature, top_k, top_p = check_sampling(cfg_scale, temperature, top_k, top_p)

    logits = _f32(logits)
    if uncond_logits is not None and cfg_scale != 1.0:
        logits = guide(logits, uncond_logits, cfg_scale)
    vocab = logits.shape[-1]

    if temperature == 0.0:
        probs = np.zeros(logits.shape, dtype=np.float32)
        np.put_along_axis(probs, logits.argmax(axis=-1)[..., None], np.float32(1.0), axis=-1)
        return probs
    if temperature != 1.0:
        t = np.float32(max(temperature, _F32_TINY))
        with np.errstate(invalid="ignore", over="ignore"):
            logits = (logits - logits.max(axis=-1, keepdims=True)) / t

    if 0 < top_k < vocab:
        kth = kth_largest(logits, top_k)
        logits = np.where(logits < kth, np.float32(-np.inf), logits)

    probs = _softmax64(logits).astype(np.float32)
    if top_p < 1.0:
        sorted_p = -np.sort(-probs, axis=-1)  # descending
        cum = np.cumsum(sorted_p, axis=-1, dtype=np.float64).astype(np.float32)
        mass_before = cum - sorted_p  # mass of strictly more probable tokens
        n_keep = np.maximum((mass_before < np.float32(top_p)).sum(axis=-1, keepdims=True), 1)
        threshold = np.take_along_axis(sorted_p, n_keep - 1, axis=-1)  # least probable kept probability
        probs = np.where(probs < threshold, np.float32(0.0), probs)
        probs = probs / _sum32(probs, keepdims=True)
    return probs


def quantize_draft(q) -> tuple[np.ndarray, np.ndarray]:
    """The draft distribution as it travels: q [..., V] float32 -> (q_sent float16, q_used float32), as
    `ciar.collab.protocol.quantize_draft`: the device sends q_sent and draws from
    q_used = draft_distribution(q_sent)."""
    q_sent = to_float16(q)
    return q_sent, draft_distribution(q_sent)


def draft_distribution(q_sent) -> np.ndarray:
    """float16 draft probabilities as sent [..., V] -> the normalised float32 distribution (q / max(sum q, tiny)).

    The sum of float16 values is exact in float64 (every float16 is a multiple of 2^-24) and rounded once to float32;
    torch's float32 sum is the same number whenever the values sum below 1."""
    q = from_float16(q_sent)
    return q / np.maximum(_sum32(q, keepdims=True), np.float32(_F32_TINY))


_MASK64 = (1 << 64) - 1
# Every draw of an image, device or cloud, is `uniform(seed, stream, position)` in one of these streams (each its
# own, so no two uses of a draw meet). On the device (this module): the draft token's and the random gate's. On the
# cloud (`ciar.decoding.sampling.counter_uniform`, the same bits computed in torch for every row of a step at once):
# a token the cloud samples itself (a prefix, cloud-only or burst token) at its image position, the acceptance test
# of the draft at an image position, and the next token (recovered or bonus; CASCADE's replacements) at its position.
DRAFT_STREAM = 0x6369617264726166  # "ciardraf"
GATE_STREAM = 0x6369617267617465  # "ciargate"
CLOUD_STREAM = 0x63696172636C6F64  # "ciarclod"
ACCEPT_STREAM = 0x6369617261637074  # "ciaracpt"
NEXT_STREAM = 0x636961726E657874  # "ciarnext"
JACOBI_STREAM = 0x636961726A636269  # "ciarjcbi": the cloud's own drafts in speculative Jacobi decoding


def splitmix64(x: int) -> int:
    """One splitmix64 step (Steele et al. 2014): a 64-bit integer -> a well-mixed 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, stream: int, position: int) -> float:
    """The device's uniform double in [0, 1) for image token `position` of the image with `seed`, in `stream`
    (DRAFT_STREAM, GATE_STREAM): splitmix64(splitmix64(splitmix64(seed mod 2**64) ^ stream) ^ position), its top 53
    bits / 2**53. Counter-based: a draw depends on (seed, stream, position) alone, never on what was drawn before, so
    every device (the cluster's, the torch-free client, the browser: `web/src/maths.js` computes the same bits)
    draws the same number at the same position, and a position drafted again after a rejection (with another
    context) draws it again. Fixed forever: changing it changes every image drafted for a given seed."""
    z = splitmix64(splitmix64(splitmix64(int(seed) & _MASK64) ^ (int(stream) & _MASK64)) ^ (int(position) & _MASK64))
    return (z >> 11) / 9007199254740992.0


def sample(q_used, u: float) -> int:
    """One token from a probability vector q_used [V] (need not sum exactly to 1), by inverse CDF at the uniform
    u in [0, 1) (`uniform`): the first index whose float64 running sum (left to right) exceeds u * total.
    Zero-probability entries are never drawn. ValueError if q has no positive entry."""
    q = np.asarray(q_used, dtype=np.float64).reshape(-1)
    cdf = np.cumsum(q)  # sequential (not pairwise), as the browser's loop sums
    total = cdf[-1] if cdf.size else 0.0
    if not total > 0.0 or not math.isfinite(total):
        raise ValueError("sample needs a probability vector with a positive, finite total")
    i = int(np.searchsorted(cdf, float(u) * total, side="right"))
    if i >= q.size:  # u * total rounded up to the total: the last token with mass
        i = int(np.flatnonzero(q > 0)[-1])
    return i


# ---------------------------------------------------------------------------------------------- the logit box


def guided_interval(c_c, r_c, c_u=None, r_u=None, cfg_scale: float = 1.0,
                    temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The logit box after guidance and temperature, float32 [..., V] (`ciar.collab.interval.guided_interval`):
    with the unconditional box, center = guide(c_c, c_u, s) and radius = |s| r_c + |1 - s| r_u; then both / T."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if (c_u is None) != (r_u is None):
        raise ValueError("c_u and r_u must be given together (the unconditional center and radius)")
    center, radius = _f32(c_c), _f32(r_c)
    if c_u is not None:
        s = float(cfg_scale)
        center = guide(center, c_u, s)
        radius = np.float32(abs(s)) * radius + np.float32(abs(1.0 - s)) * _f32(r_u)
    if temperature != 1.0:
        t = np.float32(temperature)
        center, radius = center / t, radius / t
    return center, radius


def _log_rest(a: np.ndarray) -> np.ndarray:
    """a [..., V] float64 (may hold -inf) -> log sum_{j != i} exp(a_j) for every i (`interval._log_rest`).

    The same exact log-space evaluation with one exp pass: with e = exp(a - max) and s = sum e, entry i is
    lse + log1p(-min(e_i / s, 1/2)) (no cancellation: e_i / s <= 1/2 unless i is the argmax), and the argmax's own
    entry is max + log(sum of e without it) (summed, never s - 1)."""
    V = a.shape[-1]
    if V == 1:
        return np.full_like(a, -np.inf)
    m = a.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(a - m)
        s = e.sum(axis=-1, keepdims=True)
        rest = np.log(s) + m + np.log1p(-np.minimum(e / s, 0.5))
        idx = a.argmax(axis=-1)[..., None]
        np.put_along_axis(e, idx, 0.0, axis=-1)
        np.put_along_axis(rest, idx, np.log(e.sum(axis=-1, keepdims=True)) + m, axis=-1)
    return rest


def inter_fuse(center, radius, margin: float = 0.01,
               max_radius: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """InterFuse: the tight softmax bounds over [c - r, c + r] -> (p_lo, p_hi) float32 [..., V], evaluated in float64
    with the same edge rules and safety margin as `ciar.collab.interval.inter_fuse`."""
    if margin < 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    c, r = np.broadcast_arrays(np.asarray(center, dtype=np.float64), np.asarray(radius, dtype=np.float64))
    r = np.maximum(r, 0.0)
    if max_radius is not None:
        r = np.minimum(r, float(max_radius))
    live = c > -np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        log_lo, log_hi = c - r, c + r
        p_lo = _sigmoid(log_lo - _log_rest(log_hi))
        p_hi = _sigmoid(log_hi - _log_rest(log_lo))
    if not live.all():
        p_lo, p_hi = np.where(live, p_lo, 0.0), np.where(live, p_hi, 0.0)
    p_lo = np.minimum(p_lo, p_hi)

    s_lo = p_lo.sum(axis=-1, keepdims=True)
    cap = 1.0 - margin
    p_lo = np.where(s_lo > cap, p_lo * (cap / np.maximum(s_lo, 1e-300)), p_lo)
    s_hi = p_hi.sum(axis=-1, keepdims=True)
    floor = 1.0 + margin
    p_hi = np.minimum(np.where(s_hi < floor, p_hi * (floor / np.maximum(s_hi, 1e-300)), p_hi), 1.0)
    return p_lo.astype(np.float32), p_hi.astype(np.float32)


def _omega_sigma(p_lo: np.ndarray, p_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """delta = p_hi - p_lo in float32 -> (Omega = sum, sigma = population std), float32 [...]."""
    delta = (_f32(p_hi) - _f32(p_lo)).astype(np.float64)
    return delta.sum(axis=-1).astype(np.float32), delta.std(axis=-1).astype(np.float32)


def uncertainty(p_lo, p_hi) -> np.ndarray:
    """Raw interval uncertainty U = Omega * sigma of delta = p_hi - p_lo; [..., V] x 2 -> [...] float32."""
    omega, sigma = _omega_sigma(p_lo, p_hi)
    return omega * sigma


def normalized_uncertainty(u, vocab_size: int) -> np.ndarray:
    """U [...] -> U * V / sqrt(V - 1) (float32); 0 when V == 1."""
    u = _f32(u)
    if vocab_size < 2:
        return np.zeros_like(u)
    return u * np.float32(vocab_size / math.sqrt(vocab_size - 1))


def interval_uncertainty(center, radius, margin: float = 0.01, max_radius: float | None = None,
                         normalized: bool = True) -> np.ndarray:
    """center, radius [..., V] -> U [...] float32 (normalised unless told otherwise): InterFuse, then U.
    The "interval" gate calls it with margin 0 (`gate_score`)."""
    p_lo, p_hi = inter_fuse(center, radius, margin=margin, max_radius=max_radius)
    u = uncertainty(p_lo, p_hi)
    return normalized_uncertainty(u, p_lo.shape[-1]) if normalized else u


def interval_feature_dim(top: int) -> int:
    """Width of `interval_features(..., top)`: 2 * top + 4."""
    return 2 * top + 4


def interval_features(center, radius, top: int = 8) -> np.ndarray:
    """center, radius [..., V] -> [..., 2 * top + 4] float32, the layout of `ciar.collab.interval.interval_features`:
    the `top` largest centers minus the max (floored at FEATURE_LOGIT_FLOOR), the radii there (>= 0), then Omega,
    kappa, U_norm (InterFuse with the default margin 0.01) and the entropy of softmax(center) / log V; zero-padded
    when V < top."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top!r}")
    center, radius = np.broadcast_arrays(_f32(center), _f32(radius))
    V = center.shape[-1]
    k = min(top, V)
    idx = _top_indices(center, k)
    c_top = np.take_along_axis(center, idx, axis=-1)
    with np.errstate(invalid="ignore"):
        rel = np.maximum(c_top - c_top[..., :1], np.float32(FEATURE_LOGIT_FLOOR))
    r_top = np.take_along_axis(radius, idx, axis=-1)
    if k < top:
        pad = np.zeros(center.shape[:-1] + (top - k,), dtype=np.float32)
        rel, r_top = np.concatenate([rel, pad], axis=-1), np.concatenate([r_top, pad], axis=-1)

    omega, sigma = _omega_sigma(*inter_fuse(center, radius))
    if V > 1:
        sigma_max = omega * np.float32(math.sqrt(V - 1) / V)
        with np.errstate(invalid="ignore", divide="ignore"):
            kappa = np.where(omega > 0, sigma / np.maximum(sigma_max, np.float32(1e-30)), np.float32(0.0))
        kappa = np.clip(kappa, 0.0, 1.0).astype(np.float32)
        ent = (_softmax_entropy(center) / math.log(V)).astype(np.float32)
    else:
        kappa = ent = np.zeros_like(omega)
    u_norm = normalized_uncertainty(omega * sigma, V)
    stats = np.stack([omega, kappa, u_norm, ent], axis=-1)
    return np.concatenate([rel, np.maximum(r_top, np.float32(0.0)), stats], axis=-1).astype(np.float32)


# ---------------------------------------------------------------------------------------------- the gates


def lower_score(center, radius, drafted) -> np.ndarray:
    """-log p_lo[x], the drafted token's tight InterFuse lower bound (no margin): center, radius [..., V], drafted
    [...] ints -> [...] float32 >= 0 (inf where x is masked out); float64 inside, one log-sum-exp, O(V)."""
    c, r = np.broadcast_arrays(np.asarray(center, dtype=np.float64), np.asarray(radius, dtype=np.float64))
    r = np.maximum(r, 0.0)
    x = np.broadcast_to(np.asarray(drafted, dtype=np.int64), c.shape[:-1])[..., None]
    with np.errstate(invalid="ignore"):
        log_lo_x = np.take_along_axis(c - r, x, axis=-1)[..., 0]
        hi = c + r
        np.put_along_axis(hi, x, -np.inf, axis=-1)
        z = log_lo_x - _logsumexp(hi)[..., 0]  # log lo_x - log sum_{j != x} hi_j
        score = np.maximum(-z, 0.0) + np.log1p(np.exp(-np.abs(z)))  # -log sigmoid(z)
    return np.where(np.isfinite(log_lo_x), score, np.inf).astype(np.float32)


def entropy_score(probs) -> np.ndarray:
    """probs [..., V] -> Shannon entropy / log V in [0, 1], [...] float32 (0 log 0 = 0; 0 when V == 1)."""
    p = _f32(probs)
    V = p.shape[-1]
    if V < 2:
        return np.zeros(p.shape[:-1], dtype=np.float32)
    return np.clip(_entr_sum(p) / math.log(V), 0.0, 1.0).astype(np.float32)


def softmax_score(probs) -> np.ndarray:
    """probs [..., V] -> 1 - max p, [...] float32."""
    return np.float32(1.0) - _f32(probs).max(axis=-1)


def topk_score(center, radius, topk: int = 200, margin: float = 0.0) -> np.ndarray:
    """Discrete solution-set uncertainty over the k largest centers (`gating.topk_score`): [..., V] -> [...] float32,
    (n_feasible - 1 + Omega_k / (1 + Omega_k)) / k. Token i is a feasible winner iff p_hi_i >= p_lo_j for every j,
    tested here as p_hi_i >= max_j p_lo_j: the same set in O(k) rather than torch's O(k^2) comparison."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk!r}")
    center, radius = np.broadcast_arrays(_f32(center), _f32(radius))
    k = min(int(topk), center.shape[-1])
    idx = _top_indices(center, k)
    p_lo, p_hi = inter_fuse(np.take_along_axis(center, idx, axis=-1), np.take_along_axis(radius, idx, axis=-1),
                            margin=margin)
    n_feasible = (p_hi >= p_lo.max(axis=-1, keepdims=True)).sum(axis=-1).astype(np.float32)
    omega = _sum32(p_hi - p_lo)
    frac = omega / (np.float32(1.0) + omega)
    return ((n_feasible - np.float32(1.0) + frac) / np.float32(k)).astype(np.float32)


def _need(kind: str, **inputs) -> None:
    missing = [name for name, value in inputs.items() if value is None]
    if missing:
        raise ValueError(f"gate {kind!r} needs {', '.join(missing)}")


def gate_score(kind: str, *, center=None, radius=None, probs=None, u: float | None = None,
               topk: int = 200, margin: float = 0.0, drafted: int | None = None) -> float:
    """The gate's score of one position (escalate when score > tau), as `ciar.collab.gating.gate_scores` row by row.

    center, radius: [V] the guided logit box; probs: [V] the draft distribution (q_used); drafted: the drawn token
    ("lower"); u: the "random" gate's uniform (`uniform(seed, GATE_STREAM, position)`), its score.
    Unknown kind or a missing input -> ValueError naming it."""
    if kind == "interval":
        _need(kind, center=center, radius=radius)
        return float(interval_uncertainty(center, radius, margin=margin))
    if kind == "lower":
        _need(kind, center=center, radius=radius, drafted=drafted)
        return float(lower_score(center, radius, drafted))
    if kind == "entropy":
        _need(kind, probs=probs)
        return float(entropy_score(probs))
    if kind == "softmax":
        _need(kind, probs=probs)
        return float(softmax_score(probs))
    if kind == "random":
        _need(kind, u=u)
        return float(u)
    if kind == "topk":
        _need(kind, center=center, radius=radius)
        return float(topk_score(center, radius, topk=topk, margin=margin))
    raise ValueError(f"unknown gate kind {kind!r}; expected one of {GATES}")
