"""The cloud side of CIAR: one cloud model, one KV-cache slot pair per live session, batched work.

    verifier = CloudVerifier(world.cloud, world.text, max_sessions=64, projector=projector, codebook=codebook)
    replies = verifier.open_batch([OpenRequest(...), ...])       # prefill + prefix tokens, all sessions at once
    replies = verifier.verify_batch([VerifyRequest(...), ...])   # catch-up + spans of many sessions, ONE forward
    verifier.close("session-id")
    client = InProcessCloud(verifier)                            # the CloudClient protocol by direct calls

Cache invariant per session (CFG: a cond slot and an uncond slot with the same tokens): the session's committed
image tokens t_0..t_{c-1} are in `tokens`; the cache holds the condition and t_0..t_{c-2} ("fed" = c - 1); the
last committed token is fed by the next forward. A verification with m new tokens and k drafts feeds
t_{fed}..t_{c+m-1}, x_1..x_k in one ragged batch (per-row positions), reads the target distributions p_1..p_{k+1}
at the positions of t_{c+m-1}, x_1..x_k, judges the span with the session's acceptance rule and its own
generator, commits the accepted drafts plus the next token, and rolls the cache back to the accepted prefix
(pointer move; stale entries are invisible and overwritten). Padding of the ragged batch writes only past each
row's committed content (clamped to a scratch position inside the cache's slack).

Randomness: each session owns a `torch.Generator` seeded from its OpenRequest, used for its prefix tokens and its
acceptance draws in a fixed order, so a session's tokens do not depend on which sessions share its batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ciar.collab.acceptance import CascadeConfig, LanternConfig, NeighborTable, verify_span
from ciar.collab.projector import IntervalProjector
from ciar.collab.protocol import OpenReply, OpenRequest, RuleConfig, VerifyReply, VerifyRequest
from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample
from ciar.models.gpt import GPT
from ciar.text import TextEncoder


class SessionError(ValueError):
    """A request names an unknown session, or does not fit the session's state (a client bug, reported as 4xx)."""


class CapacityError(RuntimeError):
    """No free cache slot for a new session."""


@dataclass
class _Session:
    slots: list[int]  # [cond] or [cond, uncond]
    tokens: list[int]  # committed image tokens
    sampling: SamplingParams
    rule: RuleConfig
    generator: torch.Generator
    first_logits: torch.Tensor | None  # [rows, V] prefill logits, kept while no token is committed


class CloudVerifier:
    def __init__(self, cloud: GPT, text: TextEncoder | None, max_sessions: int = 16,
                 projector: IntervalProjector | None = None, codebook: torch.Tensor | None = None):
        self.cloud = cloud.eval()
        self.text = text
        self.config = cloud.config
        self.vocab_size = cloud.config.vocab_size
        self.max_sessions = max_sessions
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

    def _session(self, session_id: str) -> _Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionError(f"unknown session {session_id!r} (never opened, closed, or evicted)") from None

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
            r.sampling.validate()
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one batch")
        if self.text is None and caption_emb is None:
            raise SessionError("this verifier has no text encoder: pass caption embeddings")
        if caption_emb is None:
            cap = self.text.encode([r.prompt for r in requests])
            caption_emb, caption_mask = cap.emb, cap.mask
        need = sum(2 if r.sampling.uses_cfg else 1 for r in requests)
        if need > len(self.free_slots):
            raise CapacityError(f"verifier full: {len(self.sessions)} sessions open, {len(self.free_slots)} free "
                                f"slots, this batch needs {need}")
        emb = caption_emb.to(self.device, self.cloud.tok_embeddings.weight.dtype)
        mask = caption_mask.to(self.device) if caption_mask is not None else None

        # rows: one per (session, cfg branch); drop marks unconditional rows
        row_src, drop, slots = [], [], []
        for i, r in enumerate(requests):
            s_slots = [self.free_slots.pop(0) for _ in range(2 if r.sampling.uses_cfg else 1)]
            self.sessions[r.session_id] = _Session(s_slots, [], r.sampling, r.rule,
                                                   torch.Generator(device="cpu").manual_seed(int(r.seed)), None)
            for j, slot in enumerate(s_slots):
                row_src.append(i)
                drop.append(j == 1)
                slots.append(slot)
        idx = torch.tensor(row_src, device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        drop_t = torch.tensor(drop, device=self.device)
        logits = self.cloud.prefill(self.cache, emb[idx], None if mask is None else mask[idx], drop_t, slot_t)

        sessions = [self.sessions[r.session_id] for r in requests]
        rows_of = self._rows_of(sessions)
        steps = max((r.prefix_len for r in requests), default=0)
        for i, s in enumerate(sessions):
            if requests[i].prefix_len == 0:
                s.first_logits = logits[rows_of[i]].clone()
        step_in = torch.zeros(len(slots), 1, dtype=torch.long, device=self.device)
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
            for slot in s.slots:
                self.cache.lengths[slot] = c.cls_token_num + max(len(s.tokens) - 1, 0)
        seconds = time.perf_counter() - t0
        out = []
        for i, r in enumerate(requests):
            s = sessions[i]
            out.append(OpenReply(
                r.session_id, torch.tensor(s.tokens, dtype=torch.long),
                caption_emb[i].detach().to("cpu", torch.float16) if r.want_caption else None,
                (caption_mask[i].detach().cpu() if caption_mask is not None
                 else torch.ones(emb.shape[1], dtype=torch.bool)) if r.want_caption else None,
                seconds, passes if r.prefix_len else 1, self.vocab_size))
        return out

    def _rows_of(self, sessions: list[_Session]) -> list[list[int]]:
        rows, n = [], 0
        for s in sessions:
            rows.append(list(range(n, n + len(s.slots))))
            n += len(s.slots)
        return rows

    def _probs(self, s: _Session, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows(1|2), ..., V] of one session -> post-guidance probs [..., V]."""
        if len(s.slots) == 2:
            return logits_to_probs(logits[0], s.sampling, uncond_logits=logits[1])
        return logits_to_probs(logits[0], s.sampling)

    def _sample(self, s: _Session, logits: torch.Tensor) -> int:
        return int(sample(self._probs(s, logits).unsqueeze(0), s.generator)[0])

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

        # one ragged forward: row per (session, cfg branch), per-row positions, padding at the scratch position
        rows_of = self._rows_of(sessions)
        n_rows = rows_of[-1][-1] + 1 if rows_of else 0
        width = max((len(f) for f in feeds), default=0)
        logits = hidden = None
        if width:
            tok = torch.zeros(n_rows, width, dtype=torch.long)
            pos = torch.full((n_rows, width), self.scratch_pos, dtype=torch.long)
            slots = torch.zeros(n_rows, dtype=torch.long)
            extra = None
            if self.projector is not None and any(r.device_hidden is not None for r in requests):
                extra = torch.zeros(n_rows, width, c.dim, device=self.device)
            for i, (r, s) in enumerate(zip(requests, sessions)):
                f = feeds[i]
                for j, row in enumerate(rows_of[i]):
                    tok[row, :len(f)] = torch.tensor(f)
                    pos[row, :len(f)] = torch.arange(c.cls_token_num + starts[i], c.cls_token_num + starts[i] + len(f))
                    slots[row] = s.slots[j]
                if extra is not None and r.device_hidden is not None and r.new_tokens.numel():
                    m = int(r.new_tokens.numel())
                    off = len(s.tokens) - starts[i]  # new tokens follow the committed-but-unfed ones
                    add = self.projector(r.device_hidden.to(self.device), r.features.to(self.device))  # [m, dim]
                    for row in rows_of[i]:
                        extra[row, off:off + m] = add
            kv_len = int(pos.max()) + 1
            logits, hidden = self.cloud.decode(self.cache, tok.to(self.device), pos.to(self.device),
                                               slots.to(self.device), extra_emb=extra, kv_len=kv_len,
                                               return_hidden=True)  # [rows, width, V], [rows, width, dim]

        replies = []
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
            out = self._judge(s, r, p, tgt_hidden)
            n, z = int(out.num_accepted[0]), int(out.next_token[0])
            s.tokens.extend(r.new_tokens.tolist() + r.draft_tokens[:n].tolist() + [z])
            s.first_logits = None
            for slot in s.slots:
                self.cache.lengths[slot] = c.cls_token_num + len(s.tokens) - 1
            replies.append((r.session_id, n, z, bool(out.recovered[0])))
        seconds = time.perf_counter() - t0
        return [VerifyReply(sid, n, z, rec, seconds, len(requests)) for sid, n, z, rec in replies]

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
        q = r.draft_probs.to(self.device, torch.float32).reshape(1, k, -1) if k else \
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

    def close(self, session_id: str) -> None:
        self.verifier.close(session_id)
