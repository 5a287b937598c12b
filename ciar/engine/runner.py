"""The verifier's model runner: a scheduled batch of pieces in, the cloud GPT's logits and hidden states out.

    runner = ModelRunner(cloud, slots=2 * max_sessions)       # owns the KV cache
    cond = runner.condition(caption_emb, drop)                # embedded condition rows of new sessions
    runner.mark_caption(slot, caption_mask)                   # caption padding is invisible to that slot's queries
    out = runner.execute_step([Piece(slots=[4, 5], start=130, n=5, tokens=[...], want=[2, 3, 4]), ...])
    logits, hidden = out.views[0]                             # [rows, len(want), V], [len(want), dim]

The runner knows pieces, slots and tensors; nothing of sessions, works or the schedule (`ciar.engine.core` pairs
its outputs with the works that asked). One `execute_step` is one forward: a row per (piece, slot) in cache-slot order
(so sessions on neighbouring slots share one zero-copy key read, `ciar.models.gpt.kv_runs`), positions padded to the
batch's width at the scratch position (inside the cache's slack, past every sequence), the inputs built from a few
index tensors per batch (not row by row), logits computed only where a piece wants them.

Two ways to run a step:
  dynamic  the shape the batch has (rows x its widest piece, keys up to its furthest position), ragged steps packed,
           consecutive slots read as views: the fewest operations, decided on the inputs' values on the host. The
           default on a CPU.
  static   the batch padded to a bucket (rows up to a power of two, width up to 1/2/4/8/16, keys up to a quarter of
           the image), padding rows on a spare slot, later keys masked rather than sliced, every row's keys gathered
           (`GPT.forward_cached(static=True)`): one kernel sequence per bucket, so on CUDA each bucket's forward is
           captured once in a CUDA graph and replayed (one launch instead of hundreds; `graphs`). Steps beyond the
           largest bucket (a long prefill chunk) run dynamically. The default on CUDA. On a CPU the same static path
           runs eagerly (`static=True`), and gives the recorded tokens of every method
           (tests/collab/test_decoder.py), which is what makes its GPU replays trustworthy; the replays themselves
           are checked against eager static steps by `benchmarks.gpu` (section `engine_graphs`).
  packed   (an option of static steps, `pack=True`) a span-wide static step whose fed positions are few (one-token
           decodes beside spans: a 1-token row padded to 8) runs its projections and feed-forward on the fed tokens
           only, padded to a token bucket, and its attention on the padded layout (`GPT.forward_cached(packed=...)`,
           as the dynamic path does); each (bucket, token bucket) its own graph.
  fused    (an option of static steps, `fused=True`) the feed-forward's input projections as one GEMM and, on CUDA,
           each block compiled inside the graphs (its elementwise chains fused); timed against the plain static
           step by `benchmarks.gpu` (section `fused_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ciar.engine.transfer import HostPack, to_device
from ciar.models.gpt import GPT, batch_invariant, compiled_block, fuse_feed_forward

PACK_BELOW = 0.8  # a step whose real positions are below this share of its padded ones runs packed
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # static steps' batch rows (padded up to the next)
WIDTH_BUCKETS = (1, 2, 4, 8, 16)  # static steps' positions per row: one-token decodes and spans
WIDE_BUCKETS = (32, 64, 128)  # ... and prefill or history chunks, which run as a forward of their own (`groups`)
PACKED_WIDTHS = (8, 16)  # static steps of these widths may run packed (spans beside one-token decodes)
TOKEN_BUCKETS = tuple(2 ** i for i in range(13))  # a packed static step's fed tokens, padded up to one of these


def padded_shape(rows: int, width: int) -> tuple[int, int] | None:
    """The (rows, width) a static step of `rows` x `width` positions pads to, or None: larger than every bucket (the
    step runs dynamically, as it is)."""
    r = next((b for b in ROW_BUCKETS if b >= rows), None)
    w = next((b for b in WIDTH_BUCKETS + WIDE_BUCKETS if b >= width), None)
    return None if r is None or w is None else (r, w)


def packed_bucket(rows: int, width: int, fed: int) -> int | None:
    """The token bucket a static step of `rows` x `width` positions with `fed` fed ones packs into, or None: not a
    packed width, or too little padding to pay (the bucket not below `PACK_BELOW` of the padded positions)."""
    if width not in PACKED_WIDTHS:
        return None
    n = next((b for b in TOKEN_BUCKETS if b >= fed), None)
    return n if n is not None and n < PACK_BELOW * rows * width else None


class NonFiniteLogits(ArithmeticError):
    """A piece's logits hold a NaN or an infinity (`ModelRunner.execute` returns it in that piece's place: only its
    work fails)."""


@dataclass
class Piece:
    """What one work feeds in one forward: `n` positions from absolute sequence position `start` in cache `slots`
    (a row each: the CFG branches), either condition embeddings (`emb` [rows, n, dim]) or image tokens (`tokens`,
    plus `extra` [(index in piece, [dim])] added to their embeddings for the interval features), or one token whose
    id is on the device (`token_from`: (a tensor of token ids, an index into it): a token the previous step drew,
    fed before the host has read it, `ciar.engine.core`'s overlap), possibly at a position the device knows too
    (`offset_from`: (a tensor, an index, its largest value): the piece starts at `start` + that value, e.g. a
    verification's drafts kept). `want`: indices within the piece whose logits the work needs back."""

    slots: list[int]
    start: int
    n: int
    tokens: list[int] | None = None
    emb: torch.Tensor | None = None
    extra: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    token_from: tuple[torch.Tensor, int] | None = None
    offset_from: tuple[torch.Tensor, int, int] | None = None

    @property
    def keys(self) -> int:
        """The keys its rows may read: its furthest position + 1 (with `offset_from`, at the offset's largest)."""
        return self.start + self.n + (self.offset_from[2] if self.offset_from is not None else 0)

    @property
    def rows(self) -> int:
        return len(self.slots)


@dataclass
class _Graph:
    """One captured static forward: its input buffers (written before each replay) and its output."""

    graph: object
    h: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor
    packed: torch.Tensor | None = None


class ModelRunner:
    """The cloud GPT and its KV cache, driven one batch of pieces at a time."""

    def __init__(self, cloud: GPT, slots: int, static: bool | None = None, graphs: bool | None = None,
                 fused: bool = False, pack: bool = False):
        """`slots`: KV-cache rows (2 per session with CFG). `static`: pad steps to buckets (default: on CUDA);
        `graphs`: replay static steps from CUDA graphs (default: static on CUDA). `fused` (static steps): the
        feed-forward's two input projections as one GEMM (`FeedForward.fuse`, done to `cloud`) and, on CUDA, every
        block compiled (`ciar.models.gpt.compiled_block`: its elementwise chains fused) inside the graphs; on a CPU
        the same code runs eagerly. Off by default until the GPU suite's `fused_step` has measured it. `pack`
        (static steps): span-wide steps with few fed positions run packed (`packed_bucket`); off by default until
        the GPU suite's `packed_step` has measured it."""
        self.cloud = cloud.eval()
        cuda = self.device.type == "cuda"
        self.static = cuda if static is None else bool(static)
        self.graphs = (self.static and cuda) if graphs is None else bool(graphs)
        if self.graphs and not (self.static and cuda):
            raise ValueError("CUDA graphs need a CUDA device and static steps")
        self.pad_slot = slots if self.static else None  # a spare slot for static steps' padding rows
        self.cache = cloud.new_cache(slots + 1 if self.static else slots)
        self.scratch_pos = self.cache.max_seq - 1  # padding of ragged batches lands here (beyond any sequence)
        c = cloud.config
        # keys a static step reads: the caption and a quarter, a half, three quarters or all of the image
        self.kv_buckets = tuple(sorted({c.cls_token_num + math.ceil(c.block_size * q / 4) for q in (1, 2, 3, 4)}))
        self._graphs: dict[tuple[int, int, int, int | None], _Graph] = {}
        self._pool = None
        self.steps = {"dynamic": 0, "static": 0, "graph": 0}  # forwards by path
        # positions fed (rows x piece length) and computed (rows x width of each forward's padded layout, what its
        # attention runs over; a packed forward's projections run on the fed ones only), summed; and the tokens the
        # packed static forwards' projections ran on (their buckets)
        self.positions = {"fed": 0, "computed": 0, "packed": 0}
        self.pack = bool(pack)
        if self.pack and not self.static:
            raise ValueError("packed static steps need static steps (dynamic steps pack on their own)")
        self.fused = bool(fused)
        self.pack_inputs: bool | None = None  # host inputs in one byte buffer (`HostPack`; default: off a CPU)
        self._block = self._packed_block = None  # compiled blocks (fused, on CUDA): unpacked and packed steps
        if self.fused:
            if not self.static:
                raise ValueError("the fused step is a static step")
            fuse_feed_forward(cloud)
            self._block = compiled_block() if cuda else None
            self._packed_block = compiled_block(packed=True) if cuda else None

    def _static_forward(self, h, pos, slots, kv_len, packed=None):
        block = self._block if packed is None else self._packed_block
        return self.cloud.forward_cached(self.cache, h, pos, slots, kv_len=kv_len, static=True, block=block,
                                         packed=packed)

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.cloud.tok_embeddings.weight.dtype

    def condition(self, caption_emb: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """Caption embeddings [N, L, D] (a row per slot), or prompt token ids [N, L] (a Chameleon cloud: moved, never
        cast to the model's dtype), `drop` [N] bool (the CFG branch without the caption) -> the condition rows
        [N, cls, dim] a prefill feeds."""
        cond = to_device(caption_emb, self.device, self.dtype if caption_emb.is_floating_point() else None)
        with batch_invariant(self.device.type == "cpu"):
            return self.cloud.embed_condition(cond, to_device(drop, self.device))

    def mark_caption(self, slot: int, mask: torch.Tensor | None, uncond: bool = False) -> None:
        """Keys a new session's slot may read: its caption's real positions (`mask` [L], t2i) and every image
        position; everything when `mask` is None. `uncond`: the slot is the CFG branch without the caption, whose
        keys a cloud with its own unconditional prompt says (`condition_mask`: Chameleon's `[<s>, <racm3:break>]`);
        a LlamaGen GPT keeps the caption's mask."""
        c, kv = self.cloud.config, self.cache.key_valid
        if uncond and hasattr(self.cloud, "condition_mask"):
            drop = torch.ones(1, dtype=torch.bool, device=self.device)
            mask = self.cloud.condition_mask(None if mask is None else to_device(mask, self.device)[None], drop)[0]
        if mask is not None and c.model_type == "t2i":
            kv[slot, :c.cls_token_num] = to_device(mask, self.device)
            kv[slot, c.cls_token_num:] = True
        else:
            kv[slot] = True

    def execute_step(self, pieces: list[Piece]) -> "StepOutput":
        """The step's cached forward over `pieces`, nothing read on the host: the step's logits and each piece's
        outputs (whether they are finite is the judge's one host read, `ciar.engine.judge`). A static step whose
        pieces are of both kinds, narrow (decodes and spans, up to the widest of WIDTH_BUCKETS) and wide (prefill
        and history chunks), runs one forward per kind (`groups`): padded to one width, a 120-position prefill
        beside 60 one-token decodes made the step 128 x 128 positions, 88 % of them padding, and beyond every
        bucket (an eager forward). Raises what a forward raises (out of memory, a broken kernel): the engine fails
        the step's works (`ForwardFault`)."""
        with batch_invariant(self.device.type == "cpu"):  # a row's logits whatever shares its step (on a CPU)
            parts = []
            for group in (self.groups(pieces) if self.static else [list(range(len(pieces)))]):
                sub = [pieces[i] for i in group]
                row0, hid = self._forward(sub)
                parts.append((group, self._pick(sub, row0, hid)))  # picked before the next forward
            return self._outputs(pieces, parts)

    @staticmethod
    def groups(pieces: list[Piece]) -> list[list[int]]:
        """Indices of the pieces each forward of a static step runs: the narrow pieces, then the wide ones (one
        group when all are of one kind)."""
        narrow = [i for i, p in enumerate(pieces) if p.n <= WIDTH_BUCKETS[-1]]
        wide = [i for i, p in enumerate(pieces) if p.n > WIDTH_BUCKETS[-1]]
        return [g for g in (narrow, wide) if g]

    def _forward(self, pieces: list[Piece]) -> tuple[list[int], torch.Tensor]:
        """One forward over `pieces` -> (first row of each piece, hidden states [rows, width, dim])."""
        bucket = self.bucket(pieces) if self.static else None
        self.positions["fed"] += sum(p.rows * p.n for p in pieces)
        if bucket is not None:
            rows, width, kv_len = bucket
            self.positions["computed"] += rows * width
            tokens = packed_bucket(rows, width, sum(p.rows * p.n for p in pieces)) if self.pack else None
            self.positions["packed"] += tokens or 0
            row0, h, pos, slots, packed = self._inputs(pieces, width, rows, tokens)
            if self.graphs:
                self.steps["graph"] += 1
                g = self._graph(rows, width, kv_len, tokens)
                g.h.copy_(h)
                g.pos.copy_(pos)
                g.slots.copy_(slots)
                if packed is not None:
                    g.packed.copy_(packed)
                g.graph.replay()
                return row0, g.out
            self.steps["static"] += 1
            return row0, self._static_forward(h, pos, slots, kv_len, packed)
        self.steps["dynamic"] += 1
        width = max(p.n for p in pieces)
        row0, h, pos, slots, _ = self._inputs(pieces, width, None)
        n_rows = h.shape[0]
        self.positions["computed"] += n_rows * width
        # keys up to the furthest REAL position: padding queries (at the scratch position, past kv_len) then see
        # every valid key of their row, so their softmax stays finite, and nobody reads the scratch entries
        kv_len = max(p.keys for p in pieces)
        packed = None  # a ragged step: projections and feed-forward on the real tokens only (GPT.forward_cached)
        if sum(p.rows * p.n for p in pieces) < PACK_BELOW * n_rows * width:
            # every piece's fed positions, piece by piece, row by row: flat indices into [rows, width]
            packed = to_device(consecutive([(row0[i] + r) * width for i, p in enumerate(pieces)
                                            for r in range(p.rows)], [p.n for p in pieces for _ in range(p.rows)]),
                               self.device)
        return row0, self.cloud.forward_cached(self.cache, h, pos, slots, kv_len=kv_len, packed=packed)

    def bucket(self, pieces: list[Piece]) -> tuple[int, int, int] | None:
        """The static shape (rows, width, keys) a forward over `pieces` pads to, or None when it is larger than
        every bucket."""
        shape = padded_shape(sum(p.rows for p in pieces), max(p.n for p in pieces))
        keys = max(p.keys for p in pieces)
        k = next((b for b in self.kv_buckets if b >= keys), None)
        return None if shape is None or k is None else (*shape, k)

    def _inputs(self, pieces: list[Piece], width: int, rows: int | None, tokens: int | None = None):
        """The step's inputs: rows in cache-slot order, each `width` positions (padding at the scratch position);
        `rows` > the pieces' rows: padding rows on the spare slot. -> (first row of each piece, embeddings
        [R, width, dim], positions [R, width], slots [R], and with `tokens` the packed index [tokens]: the flat
        indices of the fed positions, then one padding position repeated), on the device. The host's part travels
        in one non-blocking copy (`HostPack`): building a step's inputs never waits for the accelerator."""
        cloud, dev = self.cloud, self.device
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].slots[0])  # rows in cache-slot order
        row0 = [0] * len(pieces)
        r = 0
        for i in order:
            row0[i] = r
            r += pieces[i].rows
        pad = 0 if rows is None else rows - r
        by_row = [i for i in order for _ in pieces[i].slots]  # the piece of every real row
        slots = torch.tensor([s for i in order for s in pieces[i].slots] + [self.pad_slot or 0] * pad,
                             dtype=torch.long)
        starts = torch.tensor([pieces[i].start for i in by_row] + [0] * pad, dtype=torch.long)
        lens = torch.tensor([pieces[i].n for i in by_row] + [0] * pad, dtype=torch.long)
        cols = torch.arange(width)
        real = cols[None, :] < lens[:, None]  # [rows, width]: the fed positions, the rest is padding
        pos = torch.where(real, starts[:, None] + cols[None, :], self.scratch_pos)
        tok = torch.zeros(len(lens), width, dtype=torch.long)
        fed = torch.tensor([pieces[i].tokens is not None for i in by_row] + [False] * pad)
        if bool(fed.any()):  # every token row's tokens, row-major (CFG rows repeat their piece's tokens)
            tok[real & fed[:, None]] = torch.tensor([t for i in by_row if pieces[i].tokens is not None
                                                     for t in pieces[i].tokens], dtype=torch.long)
        pack = HostPack(dev, self.pack_inputs)
        h_tok, h_pos, h_slots = pack.add(tok), pack.add(pos), pack.add(slots)
        h_packed = None
        if tokens is not None:
            flat = real.flatten()
            fed_at = flat.nonzero().flatten()
            spare = int((~flat).nonzero()[0, 0])  # a padding position (there is one: the step is mostly padding)
            h_packed = pack.add(torch.cat([fed_at, torch.full((tokens - len(fed_at),), spare, dtype=torch.long)]))
        # tokens (and position offsets) still on the device, from the step before: one gather per source tensor
        sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        offsets: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        add_rows, add_cols, adds = [], [], []
        for i, p in enumerate(pieces):
            for table, src in ((sources, p.token_from), (offsets, p.offset_from)):
                if src is not None:
                    entry = table.setdefault(id(src[0]), (src[0], [], []))
                    entry[1].extend(range(row0[i], row0[i] + p.rows))
                    entry[2].extend([src[1]] * p.rows)
            for idx, add in p.extra:  # interval features, added at their positions in every row of the piece
                add_rows.extend(range(row0[i], row0[i] + p.rows))
                add_cols.extend([idx] * p.rows)
                adds.extend([add] * p.rows)

        def indices(table):  # -> (source, handle of its rows, handle of its indices) per source
            return [(src, pack.add(torch.tensor(rs, dtype=torch.long)), pack.add(torch.tensor(js, dtype=torch.long)))
                    for src, rs, js in table.values()]

        gathers, shifts = indices(sources), indices(offsets)
        h_add = pack.add(torch.tensor([add_rows, add_cols], dtype=torch.long)) if adds else None
        pack.send()
        tok = pack[h_tok]
        if gathers:
            tok = tok.clone()  # (the sent buffer is left as it came)
            for src, rs, js in gathers:
                tok[pack[rs], 0] = src[pack[js]].to(tok.dtype)
        h = cloud.tok_embeddings(tok)
        pos = pack[h_pos]
        if shifts:  # (one-position pieces: the offset moves their only position)
            pos = pos.clone()
            for src, rs, js in shifts:
                pos[pack[rs], 0] += src[pack[js]].to(pos.dtype)
        for i, p in enumerate(pieces):
            if p.emb is not None:  # condition rows (prefill chunks): a piece's rows at once
                h[row0[i]:row0[i] + p.rows, :p.n] = p.emb.to(h.dtype)
        if adds:
            ar, ac = pack[h_add][0], pack[h_add][1]
            h[ar, ac] = h[ar, ac] + torch.stack(adds).to(dev, h.dtype)
        return row0, h, pos, pack[h_slots], None if h_packed is None else pack[h_packed]

    # ------------------------------------------------------------------ CUDA graphs (run only where CUDA is)
    def _graph(self, rows: int, width: int, kv_len: int, tokens: int | None = None) -> _Graph:
        g = self._graphs.get((rows, width, kv_len, tokens))
        return g if g is not None else self._capture(rows, width, kv_len, tokens)

    @torch.inference_mode()
    def _capture(self, rows: int, width: int, kv_len: int, tokens: int | None = None) -> _Graph:
        """Capture the static forward of one bucket (after two warm-up runs on a side stream, as CUDA graphs need);
        its inputs point at the spare slot's scratch position until a step writes them. All graphs share one
        memory pool: a step's output is read before the next replay."""
        dev = self.device
        c = self.cloud.config
        h = torch.zeros(rows, width, c.dim, dtype=self.dtype, device=dev)
        pos = torch.full((rows, width), self.scratch_pos, dtype=torch.long, device=dev)
        slots = torch.full((rows,), self.pad_slot, dtype=torch.long, device=dev)
        packed = None if tokens is None else torch.full((tokens,), rows * width - 1, dtype=torch.long, device=dev)

        def run():
            return self._static_forward(h, pos, slots, kv_len, packed)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        g = self._graphs[(rows, width, kv_len, tokens)] = _Graph(graph, h, pos, slots, out, packed)
        return g

    def capture(self, max_rows: int, widths=WIDTH_BUCKETS + WIDE_BUCKETS) -> int:
        """Capture every bucket up to `max_rows` rows at start-up (largest first, so the pool is sized once), instead
        of each on its first use. -> graphs captured."""
        if not self.graphs:
            return 0
        rows = [r for r in ROW_BUCKETS if r <= max(1, max_rows)]
        for r in sorted(rows, reverse=True):
            for w in sorted(widths, reverse=True):
                for k in sorted(self.kv_buckets, reverse=True):
                    self._graph(r, w, k)
                    for n in self.token_buckets(r, w):
                        self._graph(r, w, k, n)
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

    def token_buckets(self, rows: int, width: int) -> list[int]:
        """The token buckets a packed static step of `rows` x `width` can take (none when this runner does not pack):
        more fed positions than half the rows (a smaller row bucket would hold the step otherwise), fewer than
        `PACK_BELOW` of the padded ones."""
        if not self.pack:
            return []
        return sorted({n for n in (packed_bucket(rows, width, fed) for fed in range(rows // 2 + 1, rows * width + 1))
                       if n is not None})

    @staticmethod
    def _pick(pieces: list[Piece], row0: list[int], hid: torch.Tensor) -> torch.Tensor | None:
        """The hidden states at the wanted positions of `pieces` [S, dim], piece by piece, CFG branch-major (None
        when none is wanted): gathered at once, so a later forward (a replay sharing the graphs' memory pool) cannot
        overwrite them."""
        sel_rows, sel_cols = [], []
        for i, p in enumerate(pieces):
            for j in range(p.rows):
                sel_rows.extend([row0[i] + j] * len(p.want))
                sel_cols.extend(p.want)
        if not sel_rows:
            return None
        sel = to_device(torch.tensor([sel_rows, sel_cols], dtype=torch.long), hid.device)
        return hid[sel[0], sel[1]]

    def _outputs(self, pieces: list[Piece], parts) -> "StepOutput":
        """Logits at the wanted positions only (one head matmul for the whole step), viewed per piece. `parts`: per
        forward (its pieces' indices, the hidden states picked at their wanted positions)."""
        ranges: list[tuple[int, int]] = [(0, 0)] * len(pieces)
        picked, at = [], 0
        for group, rows in parts:
            for i in group:
                n = pieces[i].rows * len(pieces[i].want)
                ranges[i] = (at, n)
                at += n
            if rows is not None:
                picked.append(rows)
        if not picked:
            return StepOutput(None, None, ranges)
        picked = picked[0] if len(picked) == 1 else torch.cat(picked)
        return StepOutput(self.cloud.logits(picked), picked, ranges, [len(p.want) for p in pieces])


def consecutive(firsts: list[int], counts: int | list[int]) -> torch.Tensor:
    """Indices: `counts` consecutive ones from each of `firsts` (one count for all, or one each), in order ->
    [sum of counts] int64 (host). A handful of operations however many runs: a step's rows and positions."""
    first = torch.tensor(firsts, dtype=torch.long)
    if isinstance(counts, int):
        return (first[:, None] + torch.arange(counts)).reshape(-1)
    n = torch.tensor(counts, dtype=torch.long)
    ends = n.cumsum(0)
    return first.repeat_interleave(n) + torch.arange(int(ends[-1])) - (ends - n).repeat_interleave(n)


class StepOutput:
    """One forward's results: `logits` [S, V] at every wanted position (None when no piece wants any), `hidden`
    [S, dim] (the same rows' final hidden states), and per piece `ranges` (first row in `logits`, rows: its CFG
    branches x its wanted positions, branch-major). `outputs[i]` is piece i's `PieceOutput` (None when it wants
    nothing); `views` the same as (logits [rows, len(want), V], hidden [len(want), dim]) tensors."""

    def __init__(self, logits: torch.Tensor | None, hidden: torch.Tensor | None, ranges: list[tuple[int, int]],
                 wanted: list[int] | None = None):
        self.logits, self.hidden, self.ranges = logits, hidden, ranges
        wanted = wanted or [0] * len(ranges)
        self.outputs = [PieceOutput(self, a, n // w, w) if n else None for (a, n), w in zip(ranges, wanted)]

    @property
    def views(self) -> list:
        return [(o.logits, o.hidden) if o is not None else (None, None) for o in self.outputs]


class PieceOutput:
    """A piece's rows of a `StepOutput`, by position: nothing is sliced until a tensor is asked for (`logits`,
    `hidden`), so a step whose works only need row indices (`row`, the judge's one gather) makes no per-piece views."""

    __slots__ = ("step", "start", "rows", "wanted")

    def __init__(self, step: StepOutput, start: int, rows: int, wanted: int):
        self.step, self.start, self.rows, self.wanted = step, start, rows, wanted

    def row(self, branch: int, j: int) -> int:
        """The row of `step.logits` holding CFG branch `branch`'s logits at wanted position j."""
        return self.start + branch * self.wanted + j

    @property
    def logits(self) -> torch.Tensor:
        """[rows, wanted, V]"""
        return self.step.logits[self.start:self.start + self.rows * self.wanted].view(self.rows, self.wanted, -1)

    @property
    def hidden(self) -> torch.Tensor:
        """[wanted, dim]: the first branch's hidden states"""
        return self.step.hidden[self.start:self.start + self.wanted]


# ---------------------------------------------------------------------------------------------------- memory
AUTO_CPU_SESSIONS = 64  # `max_sessions="auto"` without an accelerator: memory sizing needs one (see plan_sessions)


@dataclass
class MemoryPlan:
    """How many sessions' KV cache an accelerator holds beside the weights and the largest step's activations
    (vLLM's `gpu_memory_utilization` rule): sessions = (total x utilization - in use - activations) // per session."""

    device: str
    total_bytes: int
    in_use_bytes: int  # after loading the models (this process and any other on the device)
    activation_bytes: int  # the peak of the largest forward the scheduler can make, profiled
    utilization: float
    session_bytes: int  # KV cache of one session: its rows (CFG branches) x every layer's keys and values
    sessions: int
    how: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def slot_bytes(cloud: GPT, dtype: torch.dtype | None = None) -> int:
    """Bytes one KV-cache slot (one row) takes: keys and values of every layer over the cache length, and its key
    validity."""
    c = cloud.config
    max_seq = c.seq_len + 16  # GPT.new_cache's length (its slack for padding)
    size = torch.empty((), dtype=dtype or cloud.tok_embeddings.weight.dtype).element_size()
    return 2 * c.n_layer * c.kv_heads * max_seq * c.head_dim * size + max_seq


def sessions_for(budget_bytes: int, session_bytes: int) -> int:
    return max(0, int(budget_bytes // session_bytes))


def plan_sessions(cloud: GPT, token_budget: int, max_rows: int, utilization: float = 0.9,
                  rows_per_session: int = 2, profile: bool = True, graphs: bool = False) -> MemoryPlan:
    """Size the KV cache from the accelerator's memory after loading: `utilization` of its total memory, less what
    is in use and the activation peak of the largest forward the scheduler allows (`token_budget` padded positions,
    at most `max_rows` rows; profiled by running it when `profile`), over one session's KV bytes.

    Only an accelerator is sized this way (its memory belongs to the replica); on a CPU the replica shares the
    host's memory with everything else, so `"auto"` there means AUTO_CPU_SESSIONS sessions (give a count to
    change it). `graphs`: CUDA graphs will be captured, and their memory pool holds about one largest step's
    activations for good, beside the eager steps' own: the activations are counted twice."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization!r}")
    per_session = rows_per_session * slot_bytes(cloud)
    dev = cloud.tok_embeddings.weight.device
    if dev.type != "cuda":
        return MemoryPlan(str(dev), 0, 0, 0, utilization, per_session, AUTO_CPU_SESSIONS,
                          f"no accelerator: {AUTO_CPU_SESSIONS} sessions (memory sizing needs one)")
    torch.cuda.synchronize(dev)
    activations = (profile_activations(cloud, token_budget, max_rows) if profile else 0) * (2 if graphs else 1)
    free, total = torch.cuda.mem_get_info(dev)
    return memory_plan(f"{dev} ({torch.cuda.get_device_name(dev)})", total, total - free, activations, utilization,
                       per_session)


def memory_plan(device: str, total: int, in_use: int, activations: int, utilization: float,
                session_bytes: int) -> MemoryPlan:
    """The sizing rule on given figures: (total x utilization - in use - activations) // session bytes sessions;
    an error naming the figures when not even one fits."""
    sessions = sessions_for(int(total * utilization) - in_use - activations, session_bytes)
    if sessions < 1:
        raise RuntimeError(f"no room for a KV cache on {device}: {total / 2**30:.1f} GiB x utilization "
                           f"{utilization} - {in_use / 2**30:.1f} GiB in use - {activations / 2**30:.2f} GiB "
                           f"activations leaves less than one session ({session_bytes / 2**20:.1f} MiB); raise the "
                           f"memory utilization or lower the token budget")
    return MemoryPlan(device, total, in_use, activations, utilization, session_bytes, sessions,
                      f"({total} x {utilization} - {in_use} in use - {activations} activations) // {session_bytes}")


@torch.inference_mode()
def profile_activations(cloud: GPT, token_budget: int, max_rows: int) -> int:
    """The peak memory (bytes, beyond what was allocated before and the profile's own cache) of the widest and the
    tallest forward the scheduler allows: all `token_budget` positions in one session's rows (a prefill), and
    `max_rows` rows of as many positions each as the budget leaves (a full step of spans)."""
    dev = cloud.tok_embeddings.weight.device
    c = cloud.config
    peak = 0
    for rows, width in ((2, max(1, min(token_budget // 2, c.seq_len))), (max_rows, max(1, token_budget // max_rows))):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        cache = cloud.new_cache(rows)
        own = torch.cuda.memory_allocated(dev) - base
        slots = torch.arange(rows, device=dev)
        rows_idx = torch.randperm(rows, device=dev)  # scattered slots: the gathered (costliest) key read
        pos = (c.seq_len - width + torch.arange(width, device=dev)).clamp_min(0).expand(rows, width)
        h = cloud.tok_embeddings(torch.zeros(rows, width, dtype=torch.long, device=dev))
        hid = cloud.forward_cached(cache, h, pos, slots[rows_idx], kv_len=c.seq_len)
        cloud.logits(hid.reshape(rows * width, -1))
        torch.cuda.synchronize(dev)
        peak = max(peak, torch.cuda.max_memory_allocated(dev) - base - own)
        del cache, h, hid
    torch.cuda.empty_cache()
    return int(peak)
