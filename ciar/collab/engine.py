"""Step-level batching for the cloud verifier: every cloud forward takes whatever work is ready.

    verifier = CloudVerifier(world.cloud, world.text, max_sessions=64)
    work = verifier.submit_open(OpenRequest(...))      # or submit_verify / submit_resume: queued, returns at once
    while verifier.engine.busy:
        verifier.engine.step()                         # ONE forward over a ragged batch of pieces of many works
    work.result                                        # OpenReply / VerifyReply, or work.error

(`CloudVerifier.open_batch` / `verify_batch` / `resume_batch` are exactly this: submit, step until done.)

A *work* is one request in flight; each step it contributes at most one *piece*, the positions it feeds in that
forward:
  span     a verification's feed (the committed-but-unfed token, the locally accepted tokens, the drafts); the
           span is judged in the step that feeds its last position, all spans of a step in one batched judge
  decode   one token: a prefix (cloud-only) token, or a cloud-burst token after a rejection
  history  a resumed session's committed tokens
  prefill  the condition positions of an open or a resume
Long feeds (prefill, history, a long catch-up) are cut into chunks; a piece's positions continue where the work's
previous piece ended, so chunking changes no result beyond floating-point summation order.

Policy (`SchedulerConfig`): each step admits the queued works (captions of all new opens encoded together, slots
reserved), then takes spans first (a phone is waiting on each), then one-token decodes, then history and prefill
chunks, FIFO within a class, until the step holds `max_works` works or its padded size (batch rows x width; a row
per session and CFG branch) would pass `token_budget`; a chunkable piece shrinks to fit. A span therefore waits
behind at most one step of bounded size, and a cloud-only image advances one token per step next to everything
else instead of holding the replica for its whole image (static batching did that).

Determinism: a session's draws come from its own generator (prefix tokens from the stream seeded at open,
verifications re-seeded by position, `ciar.collab.verifier.position_seed`), and the batched judge draws each row
from its own generator, so which works share a step changes no draw; only the logits' floating-point summation
order depends on the batch shape, as with any batching.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

SPAN, DECODE, HISTORY, PREFILL = 0, 1, 2, 3  # priority classes, in scheduling order
logger = logging.getLogger("ray.serve")  # the replica's log (the engine runs in the Verifier deployment)
PACK_BELOW = 0.8  # a step whose real positions are below this share of its padded ones runs packed
KINDS = ("span", "decode", "history", "prefill")


@dataclass
class SchedulerConfig:
    """token_budget: padded positions (batch rows x width) per forward; max_works: works per forward (1 = no
    batching); prefill_chunk: the longest piece (prefill, history, catch-up) a work feeds in a step it shares."""

    token_budget: int = 1024
    max_works: int = 64
    prefill_chunk: int = 64

    def __post_init__(self):
        for name in ("token_budget", "max_works", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass
class Piece:
    """What one work feeds in one forward: `n` positions from absolute sequence position `start`, either condition
    embeddings (`emb` [rows, n, dim]) or image tokens (`tokens`, plus `extra` [n, dim] added to their embeddings
    for the interval features). `want`: indices within the piece whose logits the work needs back."""

    work: "Work"
    start: int
    n: int
    tokens: list[int] | None = None
    emb: torch.Tensor | None = None
    extra: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (index in piece, [dim] add)
    want: list[int] = field(default_factory=list)
    kind: int = SPAN  # the work's class when the piece was picked (set by the engine)


class Work:
    """One request in flight. Subclasses (in `ciar.collab.verifier`) implement `admit`, `kind`, `next_piece` and
    `take`; the engine calls them and records the work's forwards and compute seconds."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.seq = 0  # arrival order (set by the engine)
        self.passes = 0  # forwards this work took part in
        self.seconds = 0.0  # compute time of those steps (the whole step, as a reply's cloud_s always was)
        self.created = time.perf_counter()  # submission
        self.started: float | None = None  # the start of its first step: queue_s = started - created
        self.batch_size = 0  # works in the last forward this work took part in
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.on_done = None  # callback(work), called once when it finishes (result or error)
        self.loop = None  # the asyncio loop its caller awaits it on (`EngineThread`), if any

    # --- subclass interface
    def admit(self) -> None:
        """Validate against the live session state, take slots, set up the feed (raise to fail the work)."""

    def kind(self) -> int:
        raise NotImplementedError

    def next_piece(self, limit: int) -> Piece | None:
        """The next piece, at most `limit` positions if chunkable (a one-token or span piece may exceed it only
        when it is the step's first)."""
        raise NotImplementedError

    def take(self, piece: Piece, logits: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """Logits [rows, len(want), V] and first-row hidden states [len(want), dim] of the piece's wanted
        positions; may finish the work or leave it waiting for the step's judge."""
        raise NotImplementedError

    @property
    def rows(self) -> int:
        raise NotImplementedError

    # --- completion
    def finish(self, result=None, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.done, self.result, self.error = True, result, error
        session = getattr(self, "s", None)  # the session it held (verifier works): free for its next request
        if session is not None and getattr(session, "work", None) is self:
            session.work = None
        if self.on_done is not None:
            self.on_done(self)


class StepEngine:
    """The verifier's scheduler: a queue of works, one forward per `step`."""

    def __init__(self, verifier, config: SchedulerConfig | None = None):
        self.v = verifier
        self.config = config or SchedulerConfig()
        self.inbox: list[Work] = []
        self.active: list[Work] = []
        self._seq = 0
        self.steps = 0
        self.step_log: list[dict] = []  # last steps: {"works", "rows", "width", "kinds"}, bounded
        self.kind_positions = [0, 0, 0, 0]  # fed positions per class since start (cost accounting)
        self.real_positions = 0  # fed positions x rows (CFG branches), summed over forwards
        self.padded_positions = 0  # rows x width of every forward (what the dense ragged batch computes)

    @property
    def busy(self) -> bool:
        return bool(self.inbox or self.active)

    def submit(self, work: Work) -> Work:
        self._seq += 1
        work.seq = self._seq
        self.inbox.append(work)
        return work

    def works_of(self, session_id: str) -> list[Work]:
        return [w for w in self.inbox + self.active if w.session_id == session_id and not w.done]

    def cancel(self, session_id: str, error: BaseException) -> None:
        """Fail the works of a session that was closed or evicted under them."""
        for w in self.works_of(session_id):
            w.finish(error=error)
        self.inbox = [w for w in self.inbox if not w.done]
        self.active = [w for w in self.active if not w.done]

    def withdraw(self, work: Work) -> None:
        """Its caller went away: a queued work is dropped before it runs; an admitted one is told (`abandon`: an open
        or resume fails and frees the session it was building; a verification runs to its end)."""
        if work.done:
            return
        if work in self.inbox:
            self.inbox.remove(work)
            work.finish(error=RuntimeError(f"session {work.session_id!r}: the caller went away"))
            return
        abandon = getattr(work, "abandon", None)
        if abandon is not None:
            abandon()

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued and running work (the step itself raised: a bug or a lost accelerator)."""
        for w in self.inbox + self.active:
            w.finish(error=error)
        self.inbox, self.active = [], []

    def run(self, works: list[Work]) -> None:
        """Step until every work in `works` is done (the synchronous batch API)."""
        while not all(w.done for w in works):
            self.step()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()  # as CollabDecoder._generate: no autograd bookkeeping on the small per-step ops
    def step(self) -> list[Work]:
        """Admit queued works, run ONE forward over the pieces the policy picks, hand results back, judge the
        spans that completed. -> the works finished in this step."""
        t0 = time.perf_counter()
        self._admit()
        pieces = self._select()
        if pieces:
            try:
                outs = self._forward(pieces)
                dt = time.perf_counter() - t0
                for p in pieces:  # before `take`: a work that finishes now reports this step in its reply
                    if p.work.started is None:
                        p.work.started = t0
                    p.work.passes += 1
                    p.work.seconds += dt
                    p.work.batch_size = len(pieces)
                for p, (logits, hidden) in zip(pieces, outs):
                    p.work.take(p, logits, hidden)
            except Exception as e:  # noqa: BLE001 - a failed forward fails its works, never the engine
                for p in pieces:
                    p.work.finish(error=e)
            for p in pieces:
                self.kind_positions[p.kind] += p.n
            rows = sum(len(p.work.slots) for p in pieces)
            self.real_positions += sum(len(p.work.slots) * p.n for p in pieces)
            self.padded_positions += rows * max(p.n for p in pieces)
            self.steps += 1
            self.step_log.append({"works": len(pieces), "rows": rows,
                                  "width": max(p.n for p in pieces), "kinds": [KINDS[p.kind] for p in pieces]})
            del self.step_log[:-256]
        self.v.judge_ready(self.active)  # every span whose feed is complete (some need no forward at all)
        finished = [w for w in self.active if w.done]
        self.active = [w for w in self.active if not w.done]
        return finished

    def _admit(self) -> None:
        new, self.inbox = self.inbox, []
        try:
            self.v.admit_works(new)  # each admitted or finished with its error
        except BaseException as e:  # admission itself broke: these works are in no queue, fail them here
            for w in new:
                if not w.done:
                    w.finish(error=e)
            raise
        self.active.extend(w for w in new if not w.done)

    def _select(self) -> list[Piece]:
        cfg = self.config
        order = [w for w in sorted((w for w in self.active if not w.done), key=lambda w: (w.kind(), w.seq))
                 if w.next_piece(cfg.token_budget) is not None][:cfg.max_works]
        pieces: list[Piece] = []
        rows = width = 0
        for w in order:  # the first work feeds all it can (up to the budget), the others chunks
            limit = cfg.prefill_chunk if pieces else max(1, cfg.token_budget // w.rows)
            piece = w.next_piece(limit)
            new_rows, new_width = rows + w.rows, max(width, piece.n)
            if pieces and new_rows * new_width > cfg.token_budget:
                fit = min(cfg.token_budget // new_rows, piece.n)  # shrink the chunk to the step's budget
                if fit < 1:
                    continue
                piece = w.next_piece(fit)
                new_width = max(width, piece.n)
            piece.kind = w.kind()
            pieces.append(piece)
            rows, width = new_rows, new_width
        return pieces

    def _forward(self, pieces: list[Piece]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """One cached forward over the pieces: a row per (work, CFG branch), rows in cache-slot order (so sessions
        on neighbouring slots share one zero-copy key read, `ciar.models.gpt.kv_runs`), padding at the scratch
        position. Logits only where a work wants them. -> per piece (logits [rows, want, V], hidden [want, dim])."""
        v = self.v
        cloud, dev = v.cloud, v.device
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].work.slots[0])
        row0, n_rows = {}, 0
        for i in order:
            row0[i] = n_rows
            n_rows += pieces[i].work.rows
        width = max(p.n for p in pieces)
        tok = torch.zeros(n_rows, width, dtype=torch.long)
        pos = torch.full((n_rows, width), v.scratch_pos, dtype=torch.long)
        slots = torch.zeros(n_rows, dtype=torch.long)
        for i, p in enumerate(pieces):
            for j, slot in enumerate(p.work.slots):
                r = row0[i] + j
                slots[r] = slot
                pos[r, :p.n] = torch.arange(p.start, p.start + p.n)
                if p.tokens is not None:
                    tok[r, :p.n] = torch.tensor(p.tokens, dtype=torch.long)
        h = cloud.tok_embeddings(tok.to(dev))
        for i, p in enumerate(pieces):
            rs = slice(row0[i], row0[i] + p.work.rows)
            if p.emb is not None:
                h[rs, :p.n] = p.emb.to(h.dtype)
            for idx, add in p.extra:
                h[rs, idx] = h[rs, idx] + add.to(dev, h.dtype)
        # keys up to the furthest REAL position: padding queries (at the scratch position, past kv_len) then see
        # every valid key of their row, so their softmax stays finite, and nobody reads the scratch entries
        kv_len = max(p.start + p.n for p in pieces)
        packed = None  # a ragged step: projections and feed-forward on the real tokens only (GPT.forward_cached)
        if sum(p.work.rows * p.n for p in pieces) < PACK_BELOW * n_rows * width:
            packed = torch.cat([torch.arange(row0[i] + j, row0[i] + j + 1) * width + torch.arange(p.n)
                                for i, p in enumerate(pieces) for j in range(p.work.rows)]).to(dev)
        hid = cloud.forward_cached(v.cache, h, pos.to(dev), slots.to(dev), kv_len=kv_len, packed=packed)
        sel_rows, sel_cols, spans = [], [], []
        for i, p in enumerate(pieces):
            start = len(sel_rows)
            for j in range(p.work.rows):
                sel_rows.extend([row0[i] + j] * len(p.want))
                sel_cols.extend(p.want)
            spans.append((start, len(p.want)))
        outs = []
        if sel_rows:
            picked = hid[torch.tensor(sel_rows, device=dev), torch.tensor(sel_cols, device=dev)]  # [S, dim]
            logits = cloud.logits(picked)
        for i, ((start, n_want), p) in enumerate(zip(spans, pieces)):
            if not n_want:
                outs.append((None, None))
                continue
            rows = p.work.rows
            lg = logits[start:start + rows * n_want].view(rows, n_want, -1)
            outs.append((lg, picked[start:start + n_want]))
        return outs


class _Driver:
    """What drives a `StepEngine` for asyncio callers (`AsyncStepper` on the caller's loop, `EngineThread` on its own
    thread): `run` queues a work, awaits it and withdraws it when the caller goes away, the same for both; `call`,
    `_resolver` and `_kick` are where they differ."""

    engine: StepEngine

    def call(self, fn, *args) -> None:
        raise NotImplementedError

    def _resolver(self, loop, fut):
        """The work's `on_done`: resolves `fut` (on `loop`) with the finished work."""
        raise NotImplementedError

    def _kick(self, loop) -> None:
        """Make sure something steps the engine."""

    async def settled(self) -> None:
        """Returns once every command made before it (`call`: a close, a withdrawal) has been applied."""

    async def run(self, work: Work):
        """The work's result (or its error, raised). A work built but not queued (`CloudVerifier.open_work` /
        `verify_work` / `resume_work`) is queued on the engine's side; cancelling the caller withdraws the work
        (`StepEngine.withdraw`)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        work.on_done = self._resolver(loop, fut)
        work.loop = loop
        if work.done:
            fut.set_result(work)
        elif work.seq == 0:
            self.call(self.engine.submit, work)
        self._kick(loop)
        try:
            w = await fut
        except asyncio.CancelledError:  # the caller went away (a cancelled handle call, a cut socket)
            self.call(self.engine.withdraw, work)
            raise
        if w.error is not None:
            raise w.error
        return w.result


class AsyncStepper(_Driver):
    """Drive a `StepEngine` from an asyncio event loop (an in-process load test; the Verifier before issue 37):
    `await stepper.run(verifier.verify_work(request))` waits for a work and returns its result; one task steps the
    engine while anything is queued, yielding to the loop between forwards so that requests arriving meanwhile join
    the next step. An idle engine first waits `wait_s` for company. `on_step(engine, finished)` is called after
    every step (metrics)."""

    def __init__(self, engine: StepEngine, wait_s: float = 0.0, on_step=None):
        self.engine, self.wait_s, self.on_step = engine, wait_s, on_step
        self._task = None

    def call(self, fn, *args) -> None:
        """fn(*args) now (the engine lives on this loop's thread): the interface `EngineThread.call` offers."""
        fn(*args)

    def _resolver(self, loop, fut):
        return lambda w: fut.done() or fut.set_result(w)

    def _kick(self, loop) -> None:
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())

    def stop(self) -> None:
        """Nothing to stop: the stepping task ends when the engine is idle."""

    async def _loop(self) -> None:
        engine = self.engine
        if self.wait_s > 0:
            await asyncio.sleep(self.wait_s)
        while engine.busy:
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - every waiting caller gets the error; the loop ends cleanly
                engine.fail_all(e)
                raise
            if self.on_step is not None:
                self.on_step(engine, finished)
            await asyncio.sleep(0)


class EngineThread(_Driver):
    """Run a `StepEngine` on its own thread, the verifier's engine core (`ciar.collab.service.VerifierService`;
    docs/architecture.md §6): the replica's event loop only submits works and awaits them, so a control call (a
    close, stats, a cost hint, a readiness probe) is answered while a forward runs instead of after it.

        core = EngineThread(verifier.engine, wait_s=0.005)
        reply = await core.run(verifier.verify_work(request))   # from any asyncio loop: queued on the engine thread
        core.call(verifier.close, "session-id")                 # fn(*args) on the engine thread, before its next step

    One owner: the engine thread alone touches the engine, the session table and the cache. Every change from
    outside is a command (`call`), applied in the order it was made, between steps; a work's result comes back to
    its caller's loop (`call_soon_threadsafe`). What other threads read without a command (the verifier's counters,
    its cost estimates, the number of open sessions) are single values the engine thread replaces, read as they
    stand. An idle engine sleeps on a condition; the first work after idleness waits `wait_s` for company, as
    `AsyncStepper` does. A step that raises fails its works (`StepEngine.fail_all`) and the thread goes on."""

    def __init__(self, engine: StepEngine, wait_s: float = 0.0, on_step=None, name: str = "ciar-engine"):
        self.engine, self.wait_s, self.on_step = engine, wait_s, on_step
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.steps_failed = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def call(self, fn, *args) -> None:
        """fn(*args) on the engine thread before its next step, in call order; returns at once."""
        with self._wake:
            self._commands.append((fn, args))
            self._wake.notify()

    def _resolver(self, loop, fut):
        def settle(w):
            if not fut.done():
                fut.set_result(w)

        def done(w):  # on the engine thread
            try:
                loop.call_soon_threadsafe(settle, w)
            except RuntimeError:  # the caller's loop is closed: nobody waits any more
                pass

        return done

    async def settled(self) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.call(loop.call_soon_threadsafe, lambda: fut.done() or fut.set_result(None))
        await fut

    async def run(self, work: Work):
        if work.seq != 0:
            raise ValueError("EngineThread.run takes a work that is not queued yet (its owner queues it)")
        return await super().run(work)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _apply(self) -> None:
        with self._wake:
            commands = list(self._commands)
            self._commands.clear()
        for fn, args in commands:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a failed command (a bug) must not stop the engine
                logger.exception("engine command %s failed", getattr(fn, "__name__", fn))

    def _main(self) -> None:
        engine = self.engine
        answered = False  # the last step's callers have had their turn (`_let_callers_answer`)
        while True:
            with self._wake:
                while not self._commands and not engine.busy and not self._stopped:
                    self._wake.wait()
                    answered = False  # idle for real: the next arrival waits for company
                if self._stopped:
                    return
            idle = not engine.busy
            self._apply()
            if idle and engine.busy and self.wait_s > 0 and not answered:
                time.sleep(self.wait_s)  # company: what arrives meanwhile joins the first step
                self._apply()
            if not engine.busy:
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - every waiting caller gets the error; the engine goes on
                self.steps_failed += 1
                engine.fail_all(e)
                continue
            if self.on_step is not None:
                try:
                    self.on_step(engine, finished)
                except Exception:  # noqa: BLE001 - metrics must not stop the engine
                    logger.exception("on_step failed")
            answered = self._let_callers_answer(finished)

    def _let_callers_answer(self, finished: list[Work]) -> bool:
        """After a step that finished works, wait (at most `wait_s`) until their callers' loops have run what the
        results woke up, so that the requests those callers send next (a device's next VERIFY) join the next step,
        as they do when the engine steps on the loop itself. One loop turn: the results' callbacks, then the tasks
        they resume, then the marker."""
        loops = {w.loop for w in finished} - {None}
        if not loops or self.wait_s <= 0:
            return False
        turned = threading.Event()
        pending = [len(loops)]

        def mark():
            pending[0] -= 1
            if pending[0] == 0:
                turned.set()

        for loop in loops:
            try:  # two hops: the resumed tasks run in the loop turn after the callbacks that resumed them
                loop.call_soon_threadsafe(loop.call_soon, mark)
            except RuntimeError:  # a closed loop answers nothing
                mark()
        turned.wait(self.wait_s)
        return True
