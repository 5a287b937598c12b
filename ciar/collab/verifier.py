"""The cloud side of CIAR: one cloud model, one KV-cache slot pair per live session, batched work.

    verifier = CloudVerifier(world.cloud, world.text, max_sessions=64, projector=projector, codebook=codebook)
    replies = verifier.open_batch([OpenRequest(...), ...])       # prefill + prefix tokens, all sessions at once
    replies = verifier.verify_batch([VerifyRequest(...), ...])   # catch-up + spans of many sessions, ONE forward
    replies = verifier.resume_batch([OpenRequest(...)], [history])  # re-create lost sessions from the device's tokens
    verifier.close("session-id")
    verifier.evict_idle(300.0)                                   # close sessions idle for 5 minutes
    client = InProcessCloud(verifier)                            # the CloudClient protocol by direct calls

Cache invariant per session (CFG: a cond slot and an uncond slot with the same tokens): the session's committed
image tokens t_0..t_{c-1} are in `tokens`; the cache holds the condition and t_0..t_{c-2} ("fed" = c - 1); the
last committed token is fed by the next forward. A verification with m new tokens and k drafts feeds
t_{fed}..t_{c+m-1}, x_1..x_k in one ragged batch (per-row positions), reads the target distributions p_1..p_{k+1}
at the positions of t_{c+m-1}, x_1..x_k, judges the span with the session's acceptance rule and its own
generator, commits the accepted drafts plus the next token, and rolls the cache back to the accepted prefix
(pointer move; stale entries are invisible and overwritten). Padding of the ragged batch writes only past each
row's committed content (clamped to a scratch position inside the cache's slack).

Randomness: each session owns a `torch.Generator`. Its prefix tokens (open) are drawn from the sequential stream
seeded with the OpenRequest's `seed`, exactly as `ciar.decoding.generate.generate_cloud` draws them. Before each
verification the generator is re-seeded with `position_seed(seed, c)`, c = the session's committed-token count
before that verification (a splitmix64 mix, see `position_seed`), and the acceptance rule then draws in its fixed
order. So a verification's draws depend only on (seed, position, inputs): a session's tokens do not depend on which
sessions share its batches, nor on whether its cache was rebuilt in between.

Recovery: a verify that names an unknown session (never opened, closed, evicted, or lost with its replica) raises
`SessionLostError`; the client then calls `resume_batch` with the session's OpenRequest, the device's committed
tokens and the interval features injected with them (`InjectedFeatures`), which rebuilds exactly the state of the
invariant above (prefill + one ragged feed of history[:-1], projected features added at the same positions as the
original verifications added them), and re-sends the verify (`ciar.collab.recovery.RecoveringClient`). With
position-keyed randomness the resumed session continues with the same tokens as an uninterrupted one (same inputs
and draws; the rebuilt cache equals the original up to floating-point summation order, like any difference in
batching).

Slots: `max_sessions` sessions (2 cache slots each with CFG, 1 without). Every open/resume/verify stamps the
session's `last_used` (time.monotonic); `evict_idle(s)` closes sessions idle for at least s seconds, and with
`idle_timeout_s` set, an open/resume that finds too few free slots first evicts such idle sessions (least recently
used first) before raising `CapacityError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ciar.collab.acceptance import CascadeConfig, LanternConfig, NeighborTable, verify_span
from ciar.collab.gating import entropy_score
from ciar.collab.projector import IntervalProjector
from ciar.collab.protocol import (InjectedFeatures, OpenReply, OpenRequest, RuleConfig, VerifyReply, VerifyRequest,
                                  draft_distribution)
from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample
from ciar.models.gpt import GPT
from ciar.text import TextEncoder

_MASK64 = (1 << 64) - 1


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


def _splitmix64(x: int) -> int:
    """One splitmix64 step (Steele et al. 2014): x -> a well-mixed 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The acceptance generator's seed for the verification of a session (`seed`) at committed-token count
    `position`: splitmix64(splitmix64(seed mod 2**64) XOR position) >> 1, in [0, 2**63). Fixed forever: changing
    it changes every CIAR/speculative output for a given seed."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(position) & _MASK64)) >> 1


@dataclass
class _Session:
    slots: list[int]  # [cond] or [cond, uncond]
    tokens: list[int]  # committed image tokens
    sampling: SamplingParams
    rule: RuleConfig
    generator: torch.Generator
    first_logits: torch.Tensor | None  # [rows, V] prefill logits, kept while no token is committed
    seed: int = 0  # the OpenRequest's seed (prefix stream; position-keyed acceptance seeds)
    last_used: float = 0.0  # time.monotonic() of the last open/resume/verify


class CloudVerifier:
    def __init__(self, cloud: GPT, text: TextEncoder | None, max_sessions: int = 16,
                 projector: IntervalProjector | None = None, codebook: torch.Tensor | None = None,
                 idle_timeout_s: float | None = None):
        """`idle_timeout_s`: when an open/resume lacks free slots, sessions idle for at least this long are
        evicted first (None: never evict on demand; `evict_idle` can still be called)."""
        self.cloud = cloud.eval()
        self.text = text
        self.config = cloud.config
        self.vocab_size = cloud.config.vocab_size
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.cache = cloud.new_cache(2 * max_sessions)
        self.free_slots = list(range(2 * max_sessions))
        self.sessions: dict[str, _Session] = {}
        self.projector = projector.eval() if projector is not None else None
        self.codebook = codebook  # [V, D] raw codebook vectors, for LANTERN's neighbour sets
        self._neighbors: dict[int, NeighborTable] = {}
        self.scratch_pos = self.cache.max_seq - 1  # padding of ragged batches lands here (beyond any sequence)

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def free_slot_count(self) -> int:
        return len(self.free_slots)

    # ------------------------------------------------------------------ sessions
    def _neighbor_table(self, k: int) -> NeighborTable:
        if self.codebook is None:
            raise SessionError("the LANTERN rule needs the tokenizer's codebook; this verifier was built without it")
        k = min(k, self.vocab_size)
        if k not in self._neighbors:
            self._neighbors[k] = NeighborTable.from_codebook(self.codebook, k).to(self.device)
        return self._neighbors[k]

    def close(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is not None:
            self.cache.reset(s.slots)
            self.free_slots.extend(s.slots)

    def evict_idle(self, max_idle_s: float) -> list[str]:
        """Close the sessions idle (no open/resume/verify) for at least `max_idle_s` seconds; -> their ids."""
        now = time.monotonic()
        gone = [sid for sid, s in self.sessions.items() if now - s.last_used >= max_idle_s]
        for sid in gone:
            self.close(sid)
        return gone

    def _reserve(self, need: int) -> None:
        """Make sure `need` slots are free: evict idle sessions (least recently used first, only those idle for at
        least `idle_timeout_s`, only as many as needed), else raise CapacityError."""
        if need > len(self.free_slots) and self.idle_timeout_s is not None:
            now = time.monotonic()
            idle = sorted((s.last_used, sid) for sid, s in self.sessions.items()
                          if now - s.last_used >= self.idle_timeout_s)
            for _, sid in idle:
                if need <= len(self.free_slots):
                    break
                self.close(sid)
        if need > len(self.free_slots):
            raise CapacityError(f"verifier full: {len(self.sessions)} sessions open, {len(self.free_slots)} free "
                                f"slots, this batch needs {need}")

    def _session(self, session_id: str) -> _Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionLostError(f"unknown session {session_id!r} (never opened, closed, or evicted)",
                                   session_id) from None

    def _start_sessions(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None,
                        caption_mask: torch.Tensor | None):
        """Common part of open and resume (requests already validated, slots reserved): create the sessions, encode
        the captions unless given, prefill. -> (sessions, rows_of, slot tensor, prefill logits [rows, V],
        caption_emb, caption_mask)."""
        if caption_emb is None:
            cap = self.text.encode([r.prompt for r in requests])
            caption_emb, caption_mask = cap.emb, cap.mask
        emb = caption_emb.to(self.device, self.cloud.tok_embeddings.weight.dtype)
        mask = caption_mask.to(self.device) if caption_mask is not None else None

        # rows: one per (session, cfg branch); drop marks unconditional rows
        row_src, drop, slots = [], [], []
        now = time.monotonic()
        for i, r in enumerate(requests):
            s_slots = [self.free_slots.pop(0) for _ in range(2 if r.sampling.uses_cfg else 1)]
            self.sessions[r.session_id] = _Session(s_slots, [], r.sampling, r.rule,
                                                   torch.Generator(device="cpu").manual_seed(int(r.seed)), None,
                                                   seed=int(r.seed), last_used=now)
            for j, slot in enumerate(s_slots):
                row_src.append(i)
                drop.append(j == 1)
                slots.append(slot)
        idx = torch.tensor(row_src, device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        drop_t = torch.tensor(drop, device=self.device)
        logits = self.cloud.prefill(self.cache, emb[idx], None if mask is None else mask[idx], drop_t, slot_t)
        sessions = [self.sessions[r.session_id] for r in requests]
        return sessions, self._rows_of(sessions), slot_t, logits, caption_emb, caption_mask

    def _check_open(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None) -> None:
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one batch")
        if self.text is None and caption_emb is None:
            raise SessionError("this verifier has no text encoder: pass caption embeddings")
        for r in requests:
            r.sampling.validate()

    def _open_reply(self, r: OpenRequest, i: int, tokens: list[int], caption_emb: torch.Tensor,
                    caption_mask: torch.Tensor | None, seconds: float, passes: int) -> OpenReply:
        return OpenReply(
            r.session_id, torch.tensor(tokens, dtype=torch.long),
            caption_emb[i].detach().to("cpu", torch.float16) if r.want_caption else None,
            (caption_mask[i].detach().cpu() if caption_mask is not None
             else torch.ones(caption_emb.shape[1], dtype=torch.bool)) if r.want_caption else None,
            seconds, passes, self.vocab_size)

    # ------------------------------------------------------------------ open: caption + prefix tokens
    @torch.no_grad()
    def open_batch(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None = None,
                   caption_mask: torch.Tensor | None = None) -> list[OpenReply]:
        """Start sessions: encode captions (or take `caption_emb` [B, L, D] / `caption_mask` [B, L]), prefill, and
        let the cloud generate each session's `prefix_len` tokens (one batched step per token)."""
        t0 = time.perf_counter()
        c = self.config
        for r in requests:
            if r.session_id in self.sessions:
                raise SessionError(f"session {r.session_id!r} is already open")
            if not 0 <= r.prefix_len <= c.block_size:
                raise SessionError(f"prefix_len must be in [0, {c.block_size}], got {r.prefix_len}")
        self._check_open(requests, caption_emb)
        self._reserve(sum(2 if r.sampling.uses_cfg else 1 for r in requests))
        sessions, rows_of, slot_t, logits, caption_emb, caption_mask = self._start_sessions(
            requests, caption_emb, caption_mask)

        steps = max((r.prefix_len for r in requests), default=0)
        for i, s in enumerate(sessions):
            if requests[i].prefix_len == 0:
                s.first_logits = logits[rows_of[i]].clone()
        step_in = torch.zeros(len(slot_t), 1, dtype=torch.long, device=self.device)
        passes = 1
        for t in range(steps):
            for i, s in enumerate(sessions):
                if t < requests[i].prefix_len:
                    tok = self._sample(s, logits[rows_of[i]])
                    s.tokens.append(tok)
                    step_in[rows_of[i], 0] = tok
            if t == steps - 1:
                break
            pos = c.cls_token_num + t
            logits = self.cloud.decode(self.cache, step_in, torch.tensor([pos], device=self.device), slot_t,
                                       kv_len=pos + 1)[:, -1]
            passes += 1
        for s in sessions:
            self.cache.set_length(s.slots, c.cls_token_num + max(len(s.tokens) - 1, 0))
        seconds = time.perf_counter() - t0
        return [self._open_reply(r, i, sessions[i].tokens, caption_emb, caption_mask, seconds,
                                 passes if r.prefix_len else 1) for i, r in enumerate(requests)]

    # ------------------------------------------------------------------ resume: rebuild from the device's history
    @torch.no_grad()
    def resume_batch(self, requests: list[OpenRequest], histories: list[torch.Tensor],
                     caption_emb: torch.Tensor | None = None, caption_mask: torch.Tensor | None = None,
                     injected: list[InjectedFeatures | None] | None = None) -> list[OpenReply]:
        """Re-create sessions from the device's committed tokens `histories[i]` ([c_i] int64, c_i may be 0): encode
        the captions (or take `caption_emb` / `caption_mask` as `open_batch`), prefill, feed history[:-1] in one
        ragged forward (with `injected[i]`'s projected interval features added where the original verifications
        added them), and leave each session exactly as the cache invariant says after c_i committed tokens (the
        prefill logits kept when c_i = 0). `prefix_len` is ignored (no tokens are generated); a session id that is
        still open (a stale copy) is closed first. -> OpenReplies with empty `prefix_tokens`, the caption only if
        `want_caption`, and `forward_passes` = the session's sequential forwards (prefill, + 1 if c_i >= 2)."""
        t0 = time.perf_counter()
        c = self.config
        if len(histories) != len(requests):
            raise SessionError(f"{len(requests)} requests but {len(histories)} histories")
        injected = list(injected) if injected is not None else [None] * len(requests)
        if len(injected) != len(requests):
            raise SessionError(f"{len(requests)} requests but {len(injected)} injected-feature entries")
        hist: list[list[int]] = []
        for r, h, inj in zip(requests, histories, injected):
            h = torch.as_tensor(h)
            if h.dim() != 1 or (h.numel() and h.is_floating_point()):
                raise SessionError(f"session {r.session_id!r}: history must be a 1-D tensor of token ids")
            if h.numel() > c.block_size:
                raise SessionError(f"session {r.session_id!r}: history of {h.numel()} tokens exceeds the "
                                   f"{c.block_size} image tokens")
            if h.numel() and (int(h.min()) < 0 or int(h.max()) >= self.vocab_size):
                raise SessionError(f"token ids must be in [0, {self.vocab_size})")
            hist.append(h.long().tolist())
            if inj is not None:
                n = int(inj.positions.numel())
                if inj.device_hidden.shape[0] != n or inj.features.shape[0] != n:
                    raise SessionError(f"session {r.session_id!r}: injected features need one row per position")
                if n and (int(inj.positions.min()) < 0 or int(inj.positions.max()) >= h.numel() - 1):
                    raise SessionError(f"session {r.session_id!r}: injected positions must index history[:-1]")
        self._check_open(requests, caption_emb)
        for r in requests:  # stale copies of the same sessions
            self.close(r.session_id)
        self._reserve(sum(2 if r.sampling.uses_cfg else 1 for r in requests))
        sessions, rows_of, _, logits, caption_emb, caption_mask = self._start_sessions(
            requests, caption_emb, caption_mask)

        for i, s in enumerate(sessions):
            s.tokens = list(hist[i])
            if not hist[i]:
                s.first_logits = logits[rows_of[i]].clone()
        extras = None
        if self.projector is not None and any(inj is not None and inj.positions.numel() for inj in injected):
            extras = [(inj.positions.long(), self.projector(inj.device_hidden.to(self.device),
                                                            inj.features.to(self.device)))
                      if inj is not None and inj.positions.numel() else None for inj in injected]
        self._ragged_decode(sessions, [h[:-1] for h in hist], [0] * len(sessions), rows_of, extras)
        for s in sessions:
            self.cache.set_length(s.slots, c.cls_token_num + max(len(s.tokens) - 1, 0))
        seconds = time.perf_counter() - t0
        return [self._open_reply(r, i, [], caption_emb, caption_mask, seconds, 1 + int(len(hist[i]) >= 2))
                for i, r in enumerate(requests)]

    def _rows_of(self, sessions: list[_Session], by_slot: bool = False) -> list[list[int]]:
        """Batch rows of each session (one per CFG branch), consecutive per session: in session order, or with
        `by_slot` in cache-slot order, so sessions on neighbouring slots share one zero-copy key read in the
        forward (`ciar.models.gpt.kv_runs`)."""
        order = range(len(sessions))
        if by_slot:
            order = sorted(order, key=lambda i: sessions[i].slots[0])
        rows: list[list[int]] = [[] for _ in sessions]
        n = 0
        for i in order:
            rows[i] = list(range(n, n + len(sessions[i].slots)))
            n += len(sessions[i].slots)
        return rows

    def _probs(self, s: _Session, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows(1|2), ..., V] of one session -> post-guidance probs [..., V]."""
        if len(s.slots) == 2:
            return logits_to_probs(logits[0], s.sampling, uncond_logits=logits[1])
        return logits_to_probs(logits[0], s.sampling)

    def _sample(self, s: _Session, logits: torch.Tensor) -> int:
        return int(sample(self._probs(s, logits).unsqueeze(0), s.generator)[0])

    def _ragged_decode(self, sessions: list[_Session], feeds: list[list[int]], starts: list[int],
                       rows_of: list[list[int]], extras: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None):
        """ONE forward over a ragged batch: row per (session, cfg branch), session i's tokens `feeds[i]` at image
        positions starts[i].., padding at the scratch position. `extras[i]` = (feed indices [m], [m, dim]) adds
        embeddings to those feed entries (interval-feature injection). Does not touch `cache.lengths`.
        -> (logits [rows, width, V], hidden [rows, width, dim]), or (None, None) when every feed is empty."""
        c = self.config
        n_rows = sum(len(r) for r in rows_of)
        width = max((len(f) for f in feeds), default=0)
        if not width:
            return None, None
        tok = torch.zeros(n_rows, width, dtype=torch.long)
        pos = torch.full((n_rows, width), self.scratch_pos, dtype=torch.long)
        slots = torch.zeros(n_rows, dtype=torch.long)
        extra = None
        if extras is not None and any(e is not None for e in extras):
            extra = torch.zeros(n_rows, width, c.dim, device=self.device)
        for i, s in enumerate(sessions):
            f = feeds[i]
            for j, row in enumerate(rows_of[i]):
                tok[row, :len(f)] = torch.tensor(f, dtype=torch.long)
                pos[row, :len(f)] = torch.arange(c.cls_token_num + starts[i], c.cls_token_num + starts[i] + len(f))
                slots[row] = s.slots[j]
            if extra is not None and extras[i] is not None:
                idx, add = extras[i]
                for row in rows_of[i]:
                    extra[row, idx.to(self.device)] = add.to(extra.dtype)
        # keys up to the furthest REAL position: padding queries (at the scratch position, past kv_len) then see
        # every valid key of their row, so their softmax stays finite, and nobody reads the scratch entries
        kv_len = max(c.cls_token_num + st + len(f) for st, f in zip(starts, feeds) if f)
        return self.cloud.decode(self.cache, tok.to(self.device), pos.to(self.device), slots.to(self.device),
                                 extra_emb=extra, kv_len=kv_len, return_hidden=True)

    # ------------------------------------------------------------------ verify: catch-up + span, batched
    @torch.no_grad()
    def verify_batch(self, requests: list[VerifyRequest]) -> list[VerifyReply]:
        t0 = time.perf_counter()
        c = self.config
        sessions = [self._session(r.session_id) for r in requests]
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one verification batch")
        feeds, starts = [], []
        for r, s in zip(requests, sessions):
            k, m = int(r.draft_tokens.numel()), int(r.new_tokens.numel())
            if r.draft_probs.shape[0] != k or (k and r.draft_probs.shape[-1] != self.vocab_size):
                raise SessionError(f"draft_probs must be [{k}, {self.vocab_size}], got {tuple(r.draft_probs.shape)}")
            if isinstance(r.burst, bool) or not isinstance(r.burst, int) or r.burst < 0:
                raise SessionError(f"burst must be an integer >= 0, got {r.burst!r}")
            if not 0.0 <= float(r.burst_entropy) <= 1.0:
                raise SessionError(f"burst_entropy must be in [0, 1], got {r.burst_entropy!r}")
            if len(s.tokens) + m + k > c.block_size:
                raise SessionError(f"session {r.session_id!r}: {len(s.tokens)} committed + {m} new + {k} drafts "
                                   f"exceeds the {c.block_size} image tokens")
            for t in (r.new_tokens, r.draft_tokens):
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
                    raise SessionError(f"token ids must be in [0, {self.vocab_size})")
            fed = max(len(s.tokens) - 1, 0)
            feed = s.tokens[fed:] + r.new_tokens.tolist() + r.draft_tokens.tolist()
            feeds.append(feed)
            starts.append(fed)

        # one ragged forward; the new tokens' projected interval features are added to their embeddings
        rows_of = self._rows_of(sessions, by_slot=True)
        extras = None
        if self.projector is not None and any(r.device_hidden is not None for r in requests):
            extras = []
            for i, (r, s) in enumerate(zip(requests, sessions)):
                if r.device_hidden is not None and r.new_tokens.numel():
                    off = len(s.tokens) - starts[i]  # new tokens follow the committed-but-unfed ones
                    add = self.projector(r.device_hidden.to(self.device), r.features.to(self.device))  # [m, dim]
                    extras.append((torch.arange(off, off + int(r.new_tokens.numel())), add))
                else:
                    extras.append(None)
        logits, hidden = self._ragged_decode(sessions, feeds, starts, rows_of, extras)  # [rows, width, V|dim]

        replies = []
        now = time.monotonic()
        for i, (r, s) in enumerate(zip(requests, sessions)):
            k, m = int(r.draft_tokens.numel()), int(r.new_tokens.numel())
            c_new = len(s.tokens) + m  # committed count once the new tokens are in
            # target distribution j (j = 0..k) sits at the output after feeding token c_new - 1 + j
            first = c_new - 1 - starts[i]
            rows = rows_of[i]
            if c_new == 0:  # nothing committed: p_1 comes from the prefill
                tgt_logits = torch.cat([s.first_logits.unsqueeze(1), logits[rows, :k]], dim=1) if k \
                    else s.first_logits.unsqueeze(1)
                tgt_hidden = None
            else:
                tgt_logits = logits[rows, first:first + k + 1]  # [rows, k+1, V]
                tgt_hidden = hidden[rows[0], first:first + k + 1]
            p = self._probs(s, tgt_logits)  # [k+1, V]
            s.generator.manual_seed(position_seed(s.seed, len(s.tokens)))  # draws keyed by (seed, position)
            out = self._judge(s, r, p, tgt_hidden)
            n, z = int(out.num_accepted[0]), int(out.next_token[0])
            s.tokens.extend(r.new_tokens.tolist() + r.draft_tokens[:n].tolist() + [z])
            s.first_logits = None
            s.last_used = now
            self.cache.set_length(s.slots, c.cls_token_num + len(s.tokens) - 1)
            replies.append((r.session_id, n, z, bool(out.recovered[0])))
        bursts, steps = self._burst(requests, sessions, [rec for *_, rec in replies])
        seconds = time.perf_counter() - t0
        return [VerifyReply(sid, n, z, rec, seconds, len(requests), forward_passes=1 + st,
                            burst_tokens=torch.tensor(b, dtype=torch.long) if b else None, vocab_size=self.vocab_size)
                for (sid, n, z, rec), b, st in zip(replies, bursts, steps)]

    def _burst(self, requests: list[VerifyRequest], sessions: list[_Session], recovered: list[bool]
               ) -> tuple[list[list[int]], int]:
        """Cloud burst: after a rejection (the reply's next token was recovered), the session's cloud keeps sampling
        up to `request.burst` tokens itself, one batched step for every bursting session of this batch per token,
        stopping a session early when its next distribution's normalised entropy falls to `burst_entropy` or below
        (the device can take over there) or at the last image token. Draws continue the session's generator after
        the acceptance rule's, so they depend only on (seed, position, inputs). Leaves the cache invariant intact
        (the last burst token committed, not fed). -> (burst tokens per request, burst forwards per request)."""
        c = self.config
        out: list[list[int]] = [[] for _ in requests]
        steps = [0] * len(requests)
        live = [i for i, (r, s, rec) in enumerate(zip(requests, sessions, recovered))
                if rec and r.burst > 0 and len(s.tokens) < c.block_size]
        while live:
            sub = [sessions[i] for i in live]
            rows_of = self._rows_of(sub, by_slot=True)
            logits, _ = self._ragged_decode(sub, [[s.tokens[-1]] for s in sub], [len(s.tokens) - 1 for s in sub],
                                            rows_of)
            still = []
            for j, i in enumerate(live):
                s, r = sessions[i], requests[i]
                steps[i] += 1
                p = self._probs(s, logits[rows_of[j], -1])  # [V]
                if r.burst_entropy > 0 and float(entropy_score(p.unsqueeze(0))[0]) <= r.burst_entropy:
                    continue  # confident cloud: hand back to the device (this step's forward is spent)
                s.tokens.append(int(sample(p.unsqueeze(0), s.generator)[0]))
                out[i].append(s.tokens[-1])
                self.cache.set_length(s.slots, c.cls_token_num + len(s.tokens) - 1)
                if len(out[i]) < r.burst and len(s.tokens) < c.block_size:
                    still.append(i)
            live = still
        return out, steps

    def _judge(self, s: _Session, r: VerifyRequest, p: torch.Tensor, tgt_hidden: torch.Tensor | None):
        k = int(r.draft_tokens.numel())
        rule = s.rule
        kwargs = {}
        if rule.rule == "lantern":
            kwargs["neighbors"] = self._neighbor_table(rule.lantern_k)
            kwargs["lantern"] = LanternConfig(k=rule.lantern_k, delta=rule.lantern_delta)
        elif rule.rule == "cascade":
            kwargs["cascade"] = CascadeConfig(threshold=rule.cascade_threshold)
            kwargs["target_hidden"] = None if tgt_hidden is None else tgt_hidden.unsqueeze(0)
            kwargs["token_embeddings"] = self.cloud.output.weight
        q = draft_distribution(r.draft_probs.to(self.device)).reshape(1, k, -1) if k else \
            torch.zeros(1, 0, self.vocab_size, device=self.device)
        return verify_span(rule.rule, r.draft_tokens.to(self.device).reshape(1, k), q, p.unsqueeze(0),
                           s.generator, **kwargs)


class InProcessCloud:
    """`CloudClient` over a `CloudVerifier` in the same process (one request per call, no real network: the
    decoder charges the network model for the bytes)."""

    def __init__(self, verifier: CloudVerifier):
        self.verifier = verifier
        self.vocab_size = verifier.vocab_size

    def open(self, request: OpenRequest) -> OpenReply:
        return self.verifier.open_batch([request])[0]

    def verify(self, request: VerifyRequest) -> VerifyReply:
        return self.verifier.verify_batch([request])[0]

    def resume(self, request: OpenRequest, history: torch.Tensor,
               injected: InjectedFeatures | None = None) -> OpenReply:
        return self.verifier.resume_batch([request], [history], injected=[injected])[0]

    def close(self, session_id: str) -> None:
        self.verifier.close(session_id)
