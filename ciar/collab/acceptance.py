"""Acceptance rules for speculative / collaborative decoding of image tokens.

A drafter proposes K tokens x_0..x_{K-1} with draft distributions q_0..q_{K-1}; the cloud computes target
distributions p_0..p_K (one more than drafted: the bonus position). Both are post-guidance probability vectors
(`ciar.decoding.sampling.logits_to_probs`). `verify_span` decides how many drafts to keep and the next token:

  exact    standard speculative sampling (lossless: the output follows p exactly);
  lantern  LANTERN's relaxed acceptance: up to delta of p's mass on x's nearest codebook neighbours counts for x;
  greedy   keep drafts while they equal argmax p; the next token is an argmax too (deterministic);
  cascade  CASCADE-style: a draft that the exact test rejects is kept when it is semantically interchangeable
           with the drawn replacement (cosine of output-embedding rows), or when consecutive target hidden states
           converge (cosine of h_j and h_{j+1});
  gsd      GSD's grouped acceptance (So et al., "Grouped Speculative Decoding for Autoregressive Image Generation",
           ICCV 2025; the rule read from the authors' code, github.com/junhyukso/GSD, not copied): the draft x is
           tested as a group G(x) of visually valid tokens, min(1, p(G) / q(G)); G(x) holds the tokens ranked within
           `ranks` of x in p whose probability is within `prob_gap` of p(x) and whose input embeddings are within
           squared distance `distance` of x's (the authors' 7, 0.15 and 0.5; a session's `RuleConfig.gsd_*`). A
           rejection draws from the exact rule's residual. Lossy, like lantern and cascade.

Randomness: every draw is a uniform the caller passes (`SpanDraws`): `accept[b, j]` for the test of draft j and
`next[b, j]` for the token drawn at span index j (the recovered token at the first rejection, the bonus after a
fully kept span, CASCADE's replacement of a rejected draft), by inverse CDF (`ciar.decoding.sampling.sample_at`).
The verifier keys them by (seed, image position, stream) (`SpanDraws.counter`), so a row's verdict depends on its
own inputs alone, whatever shares its batch, and the whole batch is judged in one pass of tensor operations.

    draws = SpanDraws.counter(seeds, positions, k)            # or SpanDraws.from_generator(g, B, K)
    out = verify_span("exact", drafts, q, p, draws)          # drafts [B, K], q [B, K, V], p [B, K+1, V]
    n, z = out.num_accepted, out.next_token                   # keep drafts[b, :n[b]], then append z[b]

    table = NeighborTable.from_codebook(codebook, k=1000).to(p.device)
    out = verify_span("lantern", drafts, q, p, draws, neighbors=table, lantern=LanternConfig(delta=0.15))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ciar.decoding.sampling import counter_uniform, keyed_uniform, sample_at
from ciar_device.maths import ACCEPT_STREAM, NEXT_STREAM

RULES = ("exact", "lantern", "greedy", "cascade", "gsd")

# A residual max(0, p - q) with total mass at or below this is treated as empty (float32 round-off of two
# distributions that agree); the next token is then drawn from p instead.
RESIDUAL_EPS = 1e-6

# Elements of the [rows, V, D] difference tensor built per chunk in `NeighborTable.from_codebook`.
_CHUNK_ELEMS = 1 << 24


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class LanternConfig:
    """LANTERN relaxation: consider the draft's `k` nearest codebook neighbours, move at most `delta` of p's mass
    (total variation) from them onto the draft."""

    k: int = 1000
    delta: float = 0.15

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"LanternConfig.k must be an integer >= 1, got {self.k!r}")
        if not 0.0 <= _finite("LanternConfig.delta", self.delta) <= 1.0:
            raise ValueError(f"LanternConfig.delta must be in [0, 1], got {self.delta!r}")


@dataclass
class CascadeConfig:
    """CASCADE-style relaxation: `threshold` in [-1, 1] on cos(E[x], E[y]) of draft x and replacement y (1 relaxes
    only for parallel rows); `seq_threshold` in [-1, 1] (None disables) on cos(h_j, h_{j+1}) of consecutive target
    hidden states."""

    threshold: float = 0.9
    seq_threshold: float | None = None

    def __post_init__(self):
        if not -1.0 <= _finite("CascadeConfig.threshold", self.threshold) <= 1.0:
            raise ValueError(f"CascadeConfig.threshold must be in [-1, 1], got {self.threshold!r}")
        if self.seq_threshold is not None and not -1.0 <= _finite("CascadeConfig.seq_threshold",
                                                                  self.seq_threshold) <= 1.0:
            raise ValueError(f"CascadeConfig.seq_threshold must be in [-1, 1] or None, got {self.seq_threshold!r}")


@dataclass
class GsdConfig:
    """GSD's dynamic group of a draft x: the tokens ranked within `ranks` of x in the target p (each side), whose
    p is within `prob_gap` of p(x) and whose input embeddings are within squared L2 `distance` of x's."""

    ranks: int = 7
    prob_gap: float = 0.15
    distance: float = 0.5

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 0:
            raise ValueError(f"GsdConfig.ranks must be an integer >= 0, got {self.ranks!r}")
        if _finite("GsdConfig.prob_gap", self.prob_gap) < 0 or _finite("GsdConfig.distance", self.distance) < 0:
            raise ValueError(f"GsdConfig.prob_gap and distance must be >= 0, got {self.prob_gap}, {self.distance}")


class NeighborTable:
    """For each codebook token its nearest *other* tokens: `indices` [V, k] int64, sorted by increasing L2
    distance of the raw codebook vectors, ties broken by lower index."""

    def __init__(self, indices: torch.Tensor):
        if indices.dim() != 2:
            raise ValueError(f"NeighborTable.indices must be [V, k], got shape {tuple(indices.shape)}")
        self.indices = indices.long()

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.indices.shape[0])

    def to(self, device: torch.device | str) -> "NeighborTable":
        return NeighborTable(self.indices.to(device))

    @classmethod
    def from_codebook(cls, codebook: torch.Tensor, k: int) -> "NeighborTable":
        """codebook [V, D] -> table with min(k, V-1) neighbours per token (computed on the codebook's device).

        Squared distances are computed in float32 from explicit differences, a chunk of rows at a time (never a
        V x V x D tensor). Ordering uses an exact integer key (float bits of the distance, then the index), so
        ties are broken by index regardless of the top-k kernel.
        """
        if codebook.dim() != 2:
            raise ValueError(f"codebook must be [V, D], got shape {tuple(codebook.shape)}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        cb = codebook.detach().float()
        vocab, dim = cb.shape
        k = min(k, vocab - 1)
        if k <= 0:
            return cls(torch.zeros(vocab, 0, dtype=torch.long, device=cb.device))
        chunk = max(1, _CHUNK_ELEMS // max(1, vocab * dim))
        index = torch.arange(vocab, device=cb.device)
        never = torch.iinfo(torch.int64).max
        out = []
        for start in range(0, vocab, chunk):
            rows = cb[start:start + chunk]  # [c, D]
            d2 = (rows[:, None, :] - cb[None, :, :]).pow(2).sum(-1)  # [c, V], >= 0
            # non-negative float32 bit patterns order like the floats; index in the low bits breaks ties
            key = d2.view(torch.int32).long() * vocab + index  # [c, V]
            own = index[start:start + rows.shape[0]]
            key[torch.arange(rows.shape[0], device=cb.device), own] = never  # exclude self
            out.append(torch.topk(key, k, dim=1, largest=False, sorted=True).values % vocab)
        return cls(torch.cat(out, dim=0))


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor  # [B] int64, drafts kept (0..span_len[b])
    next_token: torch.Tensor  # [B] int64, recovered (after a rejection) or bonus (after a full accept) token
    recovered: torch.Tensor  # [B] bool, True when next_token replaces a rejected draft


def _ratio_accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """u [B, K] in [0, 1), p_x, q_x [B, K] -> accept [B, K]: u < min(1, p/q), with p/q = inf if q = 0 < p and 0 if
    p = q = 0."""
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny),
                        torch.where(p_x > 0, torch.full_like(p_x, math.inf), torch.zeros_like(p_x)))
    return u < ratio  # (= u < min(1, ratio): every u is below 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [..., V] -> normalise(max(0, p - q)) [..., V]; p itself where that residual has (numerically) no mass."""
    res = (p - q).clamp_min(0.0)
    mass = res.sum(-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, res / mass.clamp_min(RESIDUAL_EPS), p)


def _lantern_target(p_x: torch.Tensor, p: torch.Tensor, drafts: torch.Tensor, neighbors: NeighborTable,
                    cfg: LanternConfig) -> torch.Tensor:
    """p_x [B, K], p [B, K, V], drafts [B, K] -> p~(x) [B, K]: p(x) plus the largest prefix sum of p over x's
    neighbours (distance order) that is <= delta."""
    kk = min(cfg.k, neighbors.k)
    if kk == 0 or cfg.delta == 0.0:
        return p_x
    nbr = neighbors.indices[:, :kk].to(drafts.device)[drafts]  # [B, K, kk]
    prefix = torch.cumsum(p.gather(-1, nbr), dim=-1)  # [B, K, kk], non-decreasing
    moved = torch.where(prefix <= cfg.delta, prefix, torch.zeros_like(prefix)).amax(-1)  # [B, K]
    return p_x + moved


def _gsd_group(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, embeddings: torch.Tensor,
               cfg: GsdConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q [B, K, V], drafts [B, K], embeddings [V, D] -> (p(G), q(G)) [B, K]: the mass of each draft's GSD group
    (x itself always belongs to it) under the target and under the draft."""
    v = p.shape[-1]
    order = p.argsort(dim=-1, descending=True, stable=True)  # [B, K, V]: tokens by decreasing p (ties: by token id)
    rank = order.argsort(dim=-1).gather(-1, drafts[..., None])  # [B, K, 1]: x's place in it
    at = rank + torch.arange(-cfg.ranks, cfg.ranks + 1, device=p.device)  # [B, K, 2r + 1]
    inside = (at >= 0) & (at < v)
    tokens = order.gather(-1, at.clamp(0, v - 1))
    p_t, q_t = p.gather(-1, tokens), q.gather(-1, tokens)
    p_x = p.gather(-1, drafts[..., None])
    e = embeddings.detach().to(p.device).float()
    near = (e[tokens] - e[drafts][..., None, :]).pow(2).sum(-1) < cfg.distance
    group = inside & (((p_t - p_x).abs() < cfg.prob_gap) & near | (tokens == drafts[..., None]))
    return (p_t * group).sum(-1), (q_t * group).sum(-1)


def _check(rule, draft_tokens, draft_probs, target_probs, draws, span_len, neighbors, lantern, cascade,
           target_hidden, token_embeddings) -> tuple[int, int, int]:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if draft_tokens.dim() != 2 or draft_tokens.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                                          torch.float64, torch.bool):
        raise ValueError(f"draft_tokens must be an integer tensor [B, K], got {tuple(draft_tokens.shape)} "
                         f"{draft_tokens.dtype}")
    b, k = draft_tokens.shape
    if not isinstance(draws, SpanDraws):
        raise ValueError("draws must be a SpanDraws (SpanDraws.counter for position-keyed draws, "
                         "SpanDraws.from_generator in tests)")
    if tuple(draws.accept.shape) != (b, k) or tuple(draws.next.shape) != (b, k + 1):
        raise ValueError(f"draws must hold accept [B, K] = [{b}, {k}] and next [B, K+1] uniforms, got "
                         f"{tuple(draws.accept.shape)} and {tuple(draws.next.shape)}")
    if target_probs.dim() != 3 or target_probs.shape[0] != b or target_probs.shape[1] != k + 1:
        raise ValueError(f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V], got {tuple(target_probs.shape)}")
    v = target_probs.shape[2]
    if v < 1:
        raise ValueError("the vocabulary must not be empty")
    if tuple(draft_probs.shape) != (b, k, v):
        raise ValueError(f"draft_probs must be [B, K, V] = [{b}, {k}, {v}], got {tuple(draft_probs.shape)}")
    if span_len is not None:
        if span_len.shape != (b,):
            raise ValueError(f"span_len must be [B] = [{b}], got {tuple(span_len.shape)}")
        if b and (int(span_len.min()) < 0 or int(span_len.max()) > k):
            raise ValueError(f"span_len values must be in [0, K] = [0, {k}], got {span_len.tolist()}")
    if b and k and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= v):
        # padding beyond a row's span must still be a valid index (e.g. 0)
        raise ValueError(f"draft_tokens must lie in [0, V) = [0, {v})")
    if rule == "lantern":
        if neighbors is None or lantern is None:
            raise ValueError("the lantern rule needs `neighbors` (NeighborTable) and `lantern` (LanternConfig)")
        if neighbors.vocab_size != v:
            raise ValueError(f"neighbors covers {neighbors.vocab_size} tokens, the distributions {v}")
    if rule == "gsd" and (token_embeddings is None or token_embeddings.dim() != 2 or token_embeddings.shape[0] != v):
        raise ValueError(f"the gsd rule needs `token_embeddings` [V, D] with V = {v} (the cloud's input embeddings)")
    if rule == "cascade":
        if cascade is None or token_embeddings is None:
            raise ValueError("the cascade rule needs `cascade` (CascadeConfig) and `token_embeddings` [V, D]")
        if token_embeddings.dim() != 2 or token_embeddings.shape[0] != v:
            raise ValueError(f"token_embeddings must be [V, D] with V = {v}, got {tuple(token_embeddings.shape)}")
        if target_hidden is not None and (target_hidden.dim() != 3 or target_hidden.shape[:2] != (b, k + 1)):
            raise ValueError(f"target_hidden must be [B, K+1, D] = [{b}, {k + 1}, D], "
                             f"got {tuple(target_hidden.shape)}")
    return b, k, v


@dataclass
class SpanDraws:
    """The uniforms a batch of spans is judged with: `accept` [B, K] (the test of draft j) and `next` [B, K+1] (the
    next token drawn at span index j: recovered at a rejection, bonus after the whole span, CASCADE's replacement at
    a rejected draft). Each is read at most once and never depends on another row."""

    accept: torch.Tensor  # [B, K] float64 in [0, 1)
    next: torch.Tensor  # [B, K+1] float64 in [0, 1)

    @staticmethod
    def keys_at(accept_keys: torch.Tensor, next_keys: torch.Tensor, positions: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a batch of spans draws (`counter`'s layout): row b's stream keys (`ciar.decoding.sampling.stream_key`
        of its seed with ACCEPT_STREAM and NEXT_STREAM, int64 [B]) and first image position -> (keys [B, 2, 1],
        positions [B, 1, K+1]), which broadcast to the [B, 2, K+1] (stream, span index j) grid `keyed_uniform`
        draws over and `from_uniforms` reads (the accept stream's uniform at index k is not read)."""
        at = positions[:, None] + torch.arange(k + 1, device=positions.device)[None, :]  # [B, K+1]
        return torch.stack([accept_keys, next_keys], dim=1)[:, :, None], at[:, None, :]

    @classmethod
    def from_uniforms(cls, u: torch.Tensor, k: int) -> "SpanDraws":
        """u [B, 2, K+1]: `keyed_uniform` over `keys_at`'s grid -> the draws."""
        return cls(u[:, 0, :k], u[:, 1])

    @classmethod
    def keyed(cls, accept_keys: torch.Tensor, next_keys: torch.Tensor, positions: torch.Tensor,
              k: int) -> "SpanDraws":
        """`counter`'s draws from the rows' stream keys: the same uniforms, one splitmix64 on the device each, both
        streams in one `keyed_uniform` call (its ~17 operations once, not twice)."""
        return cls.from_uniforms(keyed_uniform(*cls.keys_at(accept_keys, next_keys, positions, k)), k)

    @classmethod
    def counter(cls, seeds: torch.Tensor, positions: torch.Tensor, k: int) -> "SpanDraws":
        """Position-keyed draws (the verifier's): row b's draft j sits at image position positions[b] + j; its test
        is `counter_uniform(seed, ACCEPT_STREAM, position)`, the next token at position positions[b] + n is drawn
        with `counter_uniform(seed, NEXT_STREAM, position)`. seeds, positions [B] int64 on the data's device."""
        at = positions[:, None] + torch.arange(k + 1, device=positions.device)[None, :]  # [B, K+1]
        s = seeds[:, None]
        return cls(counter_uniform(s, ACCEPT_STREAM, at[:, :k]), counter_uniform(s, NEXT_STREAM, at))

    @classmethod
    def from_generator(cls, generator: torch.Generator, b: int, k: int) -> "SpanDraws":
        """Uniforms from a torch generator (unit tests and simulations): accept first, then next."""
        return cls(torch.rand(b, k, generator=generator, dtype=torch.float64, device=generator.device),
                   torch.rand(b, k + 1, generator=generator, dtype=torch.float64, device=generator.device))


def verify_span(rule: str, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                draws: SpanDraws, span_len: torch.Tensor | None = None, *,
                neighbors: NeighborTable | None = None, lantern: LanternConfig | None = None,
                cascade: CascadeConfig | None = None, target_hidden: torch.Tensor | None = None,
                token_embeddings: torch.Tensor | None = None, gsd: GsdConfig | None = None,
                check: bool = True) -> VerifyOutput:
    """Judge a batch of drafted spans, every row at once (no loop over rows, nothing read on the host).

    draft_tokens [B, K] int64, draft_probs q [B, K, V], target_probs p [B, K+1, V], span_len [B] in [0, K]
    (row b uses drafts [:span_len[b]] and its bonus distribution p[b, span_len[b]]; default K), `draws` the
    uniforms (`SpanDraws`). `neighbors` and `lantern` are needed by "lantern"; `cascade` and `token_embeddings`
    [V, D] (and optionally `target_hidden` [B, K+1, D]) by "cascade"; `token_embeddings` (the cloud's input
    embeddings) and `gsd` (default `GsdConfig()`) by "gsd". `check=False` skips the input checks (which
    read values on the host; the verifier checked them when the requests arrived). Returns `VerifyOutput` with [B]
    tensors on the data's device. See the module docstring for the rules.
    """
    if check:
        b, k, v = _check(rule, draft_tokens, draft_probs, target_probs, draws, span_len, neighbors, lantern,
                         cascade, target_hidden, token_embeddings)
    else:
        b, k = draft_tokens.shape
    device = target_probs.device
    p = target_probs.float()
    q = draft_probs.to(device).float()
    drafts = draft_tokens.to(device).long()
    lengths = (torch.full((b,), k, dtype=torch.long, device=device) if span_len is None
               else span_len.to(device).long())
    in_span = torch.arange(k, device=device)[None, :] < lengths[:, None]  # [B, K]
    rows = torch.arange(b, device=device)
    u_next = draws.next.to(device)

    p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    if rule == "greedy":
        accept = (drafts == p[:, :k].argmax(-1)) & in_span  # argmax: first maximal index
    else:
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
        if rule == "lantern":
            p_x = _lantern_target(p_x, p[:, :k], drafts, neighbors, lantern)
        elif rule == "gsd":
            p_x, q_x = _gsd_group(p[:, :k], q, drafts, token_embeddings, gsd or GsdConfig())
        accept = _ratio_accept(draws.accept.to(device), p_x, q_x) & in_span

    if rule == "cascade" and k:
        # every draft's replacement y_j ~ residual(p_j, q_j) at its own uniform; a rejected draft is kept when y_j is
        # interchangeable with it (or the target's hidden states converge there)
        y = sample_at(_residual(p[:, :k], q).reshape(b * k, -1), u_next[:, :k].reshape(-1)).view(b, k)
        emb = token_embeddings.detach().to(device).float()
        keep = F.cosine_similarity(emb[drafts], emb[y], dim=-1) >= cascade.threshold  # [B, K]
        if cascade.seq_threshold is not None and target_hidden is not None:
            h = target_hidden.detach().to(device).float()
            keep = keep | (F.cosine_similarity(h[:, :-1], h[:, 1:], dim=-1) >= cascade.seq_threshold)
        accept = (accept | keep) & in_span
        n = accept.long().cumprod(-1).sum(-1)
        recovered = n < lengths
        bonus = sample_at(p[rows, n], u_next[rows, n])
        return VerifyOutput(n, torch.where(recovered, y[rows, n.clamp(max=k - 1)], bonus), recovered)

    n = accept.long().cumprod(-1).sum(-1) if k else torch.zeros(b, dtype=torch.long, device=device)  # [B]
    recovered = n < lengths
    p_next = p[rows, n]  # [B, V]: p at the first rejection, or the bonus p_L
    if rule == "greedy":
        return VerifyOutput(n, p_next.argmax(-1), recovered)
    if k:
        q_next = q[rows, n.clamp(max=k - 1)]  # [B, V]
        dist = torch.where(recovered[:, None], _residual(p_next, q_next), p_next)
    else:
        dist = p_next
    return VerifyOutput(n, sample_at(dist, u_next[rows, n]), recovered)
