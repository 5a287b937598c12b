"""The verifier's model runner: a scheduled batch of pieces in, the cloud GPT's logits and hidden states out.

    runner = ModelRunner(cloud, slots=2 * max_sessions)       # owns the KV cache
    cond = runner.condition(caption_emb, drop)                # embedded condition rows of new sessions
    runner.mark_caption(slot, caption_mask)                   # caption padding is invisible to that slot's queries
    outs = runner.execute([Piece(slots=[4, 5], start=130, n=5, tokens=[...], want=[2, 3, 4]), ...])
    logits, hidden = outs[0]                                  # [rows, len(want), V], [len(want), dim]

The runner knows pieces, slots and tensors; nothing of sessions, works or the schedule (`ciar.collab.engine` pairs
its outputs with the works that asked). One `execute` is one forward: a row per (piece, slot) in cache-slot order
(so sessions on neighbouring slots share one zero-copy key read, `ciar.models.gpt.kv_runs`), positions padded to the
batch's width at the scratch position (inside the cache's slack, past every sequence), the inputs built from a few
index tensors per batch (not row by row), logits computed only where a piece wants them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ciar.models.gpt import GPT

PACK_BELOW = 0.8  # a step whose real positions are below this share of its padded ones runs packed


@dataclass
class Piece:
    """What one work feeds in one forward: `n` positions from absolute sequence position `start` in cache `slots`
    (a row each: the CFG branches), either condition embeddings (`emb` [rows, n, dim]) or image tokens (`tokens`,
    plus `extra` [(index in piece, [dim])] added to their embeddings for the interval features). `want`: indices
    within the piece whose logits the work needs back."""

    slots: list[int]
    start: int
    n: int
    tokens: list[int] | None = None
    emb: torch.Tensor | None = None
    extra: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    want: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.slots)


class ModelRunner:
    """The cloud GPT and its KV cache, driven one batch of pieces at a time."""

    def __init__(self, cloud: GPT, slots: int):
        self.cloud = cloud.eval()
        self.cache = cloud.new_cache(slots)
        self.scratch_pos = self.cache.max_seq - 1  # padding of ragged batches lands here (beyond any sequence)

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.cloud.tok_embeddings.weight.dtype

    def condition(self, caption_emb: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """Caption embeddings [N, L, D] (a row per slot), `drop` [N] bool (the CFG branch without the caption) ->
        the condition rows [N, cls, dim] a prefill feeds."""
        return self.cloud.embed_condition(caption_emb.to(self.device, self.dtype), drop.to(self.device))

    def mark_caption(self, slot: int, mask: torch.Tensor | None) -> None:
        """Keys a new session's slot may read: its caption's real positions (`mask` [L], t2i) and every image
        position; everything when `mask` is None."""
        c, kv = self.cloud.config, self.cache.key_valid
        if mask is not None and c.model_type == "t2i":
            kv[slot, :c.cls_token_num] = mask.to(self.device)
            kv[slot, c.cls_token_num:] = True
        else:
            kv[slot] = True

    def execute(self, pieces: list[Piece]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """ONE cached forward over `pieces`. -> per piece (logits [rows, len(want), V], hidden [len(want), dim]),
        or (None, None) where it wants nothing."""
        cloud, dev = self.cloud, self.device
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].slots[0])  # rows in cache-slot order
        row0 = [0] * len(pieces)
        r = 0
        for i in order:
            row0[i] = r
            r += pieces[i].rows
        n_rows, width = r, max(p.n for p in pieces)
        by_row = [i for i in order for _ in pieces[i].slots]  # the piece of every row
        slots = torch.tensor([s for i in order for s in pieces[i].slots], dtype=torch.long)
        starts = torch.tensor([pieces[i].start for i in by_row], dtype=torch.long)
        lens = torch.tensor([pieces[i].n for i in by_row], dtype=torch.long)
        cols = torch.arange(width)
        real = cols[None, :] < lens[:, None]  # [rows, width]: the fed positions, the rest is padding
        pos = torch.where(real, starts[:, None] + cols[None, :], self.scratch_pos)
        tok = torch.zeros(n_rows, width, dtype=torch.long)
        fed = torch.tensor([pieces[i].tokens is not None for i in by_row])
        if bool(fed.any()):  # every token row's tokens, row-major (CFG rows repeat their piece's tokens)
            tok[real & fed[:, None]] = torch.tensor([t for i in by_row if pieces[i].tokens is not None
                                                     for t in pieces[i].tokens], dtype=torch.long)
        h = cloud.tok_embeddings(tok.to(dev))
        add_rows, add_cols, adds = [], [], []
        for i, p in enumerate(pieces):
            if p.emb is not None:  # condition rows (prefill chunks): a piece's rows at once
                h[row0[i]:row0[i] + p.rows, :p.n] = p.emb.to(h.dtype)
            for idx, add in p.extra:  # interval features, added at their positions in every row of the piece
                add_rows.extend(range(row0[i], row0[i] + p.rows))
                add_cols.extend([idx] * p.rows)
                adds.extend([add] * p.rows)
        if adds:
            ar, ac = torch.tensor(add_rows, device=dev), torch.tensor(add_cols, device=dev)
            h[ar, ac] = h[ar, ac] + torch.stack(adds).to(dev, h.dtype)
        # keys up to the furthest REAL position: padding queries (at the scratch position, past kv_len) then see
        # every valid key of their row, so their softmax stays finite, and nobody reads the scratch entries
        kv_len = max(p.start + p.n for p in pieces)
        packed = None  # a ragged step: projections and feed-forward on the real tokens only (GPT.forward_cached)
        if sum(p.rows * p.n for p in pieces) < PACK_BELOW * n_rows * width:
            packed = torch.cat([((row0[i] + torch.arange(p.rows)[:, None]) * width + torch.arange(p.n)[None, :])
                                .flatten() for i, p in enumerate(pieces)]).to(dev)
        hid = cloud.forward_cached(self.cache, h, pos.to(dev), slots.to(dev), kv_len=kv_len, packed=packed)
        return self._outputs(pieces, row0, hid)

    def _outputs(self, pieces: list[Piece], row0: list[int], hid: torch.Tensor):
        """Logits at the wanted positions only (one head matmul for the whole batch), split per piece."""
        sel_rows, sel_cols, spans = [], [], []
        for i, p in enumerate(pieces):
            spans.append((len(sel_rows), len(p.want)))
            for j in range(p.rows):
                sel_rows.extend([row0[i] + j] * len(p.want))
                sel_cols.extend(p.want)
        outs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        if not sel_rows:
            return [(None, None)] * len(pieces)
        dev = hid.device
        picked = hid[torch.tensor(sel_rows, device=dev), torch.tensor(sel_cols, device=dev)]  # [S, dim]
        logits = self.cloud.logits(picked)
        for (start, n_want), p in zip(spans, pieces):
            if not n_want:
                outs.append((None, None))
                continue
            outs.append((logits[start:start + p.rows * n_want].view(p.rows, n_want, -1), picked[start:start + n_want]))
        return outs
