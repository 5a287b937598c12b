"""Step-level batching for the cloud verifier: every cloud forward takes whatever work is ready.

    verifier = CloudVerifier(world.cloud, world.text, max_sessions=64)
    work = verifier.submit_open(OpenRequest(...))      # or submit_verify / submit_resume: queued, returns at once
    while verifier.engine.busy:
        verifier.engine.step()                         # ONE forward over a ragged batch of pieces of many works
    work.result                                        # OpenReply / VerifyReply, or work.error

(`CloudVerifier.open_batch` / `verify_batch` / `resume_batch` are exactly this: submit, step until done.)

The engine core (`StepEngine`) joins three parts that do not call each other: the scheduler
(`ciar.engine.scheduler`, pure Python: which works feed how many positions), the model runner
(`ciar.engine.runner`: pieces -> tensors -> logits, static steps and CUDA graphs on CUDA) and the request state (the
verifier's works and sessions, its judge). docs/architecture.md §6.

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

Determinism: every cloud draw is keyed by (seed, stream, image position) and computed for all rows of a step at
once (`ciar.engine.judge`), so which works share a step changes no draw; only the logits' floating-point summation
order depends on the batch shape, as with any batching.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ciar.collab.protocol import ForwardFault
from ciar.engine.runner import NonFiniteLogits, Piece, PieceOutput
from ciar.engine.scheduler import (DECODE, HISTORY, KINDS, PREFILL, SPAN, Request, Scheduled, Scheduler,
                                   SchedulerConfig)

__all__ = ["DECODE", "HISTORY", "KINDS", "PREFILL", "SPAN", "Piece", "SchedulerConfig", "StepEngine", "Work",
           "AsyncStepper", "EngineThread"]
logger = logging.getLogger("ray.serve")  # the replica's log (the engine runs in the Verifier deployment)


class Work(Request):
    """One request in flight: what the scheduler reads (`ciar.engine.scheduler.Request`: `kind`, `pending`,
    `position`, `rows`) and what the engine adds. Subclasses (`ciar.engine.works`) implement those and `admit`,
    `piece` and `take`; the engine calls them and records the work's forwards and compute seconds."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.seq = 0  # arrival order (set by the scheduler)
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
        # an open or resume that finds no free KV-cache slot waits (parked) until `deadline` (perf_counter), then is
        # refused (CapacityError: 503 + Retry-After); None: refused at once (`CloudVerifier.slot_wait_s`)
        self.deadline: float | None = None
        self.parked = False  # set by the admission: no slot yet, park it (the engine clears it)
        self.draw_from: PieceOutput | None = None  # this step's outputs to draw a token from (the decision pass)
        self.deciding = False  # in this step's decision pass (a pass that raises fails these works)
        self.cost: tuple | None = None  # what its reply cost, for the owner's estimates (`retired`), set on success
        # its session is of no use after it (a half-built open, a burst that failed after its verdict): the owner
        # frees it when the work leaves the engine (`retired`); a work never closes a session itself
        self.drop_session = False

    # --- subclass interface
    def admit(self, *state) -> None:
        """Validate against the live state its owner hands it (a verifier's work: its session), set up the feed
        (raise to fail the work)."""

    def piece(self, n: int) -> Piece:
        """Its next `n` positions (n <= pending()) as the model runner's input."""
        raise NotImplementedError

    def take(self, piece: Piece, out: PieceOutput | None) -> None:
        """The piece's outputs (`ciar.engine.runner.PieceOutput`: its rows of the step's logits and hidden states,
        None when it wanted none): record where they are and advance; may finish the work, or leave a decision
        (a token to draw, a span to judge) for the step's decision pass."""
        raise NotImplementedError

    @property
    def rows(self) -> int:
        raise NotImplementedError

    def after_draw(self) -> int | None:
        """A work with a token to draw (`draw_from`): the position of the decode that feeds that token when the work
        goes on after it, else None (the engine's overlap schedules that decode before the draw is read)."""
        return None

    def after_verdict(self) -> int | None:
        """A work with a span to judge: where a decode that may follow its verdict starts, less the drafts the
        verdict keeps (`ciar.engine.works.VerifyWork.after_verdict`), else None."""
        return None

    def kv_state(self) -> tuple[list[int], int] | None:
        """(cache slots, committed length) its session's KV cache holds now, or None when it holds none (the engine
        core writes it after each step: the one writer of cache lengths besides the slots' reset when freed)."""
        return None

    # --- completion
    def fault(self, error: BaseException) -> None:
        """The forward carrying this work failed (a `ForwardFault`): by default the work fails with it (its session
        as before the request; subclasses undo what they changed)."""
        self.finish(error=error)

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
    """The engine core: one `step` = admit what arrived, let the scheduler pick the forward's pieces, run them on the
    model runner, hand the outputs to their works, judge the spans that completed, retire the finished works.

    The three parts meet only here: the scheduler (`ciar.engine.scheduler`, pure Python) decides from request state
    and budgets; the runner (`ciar.engine.runner.ModelRunner`) turns pieces into tensors and returns the step's
    logits and hidden states, read nowhere on the host; the works record where their outputs are. `admit(works)`
    (each admitted, or finished with its error), `decide(running, step logits)` (the step's batched judge and
    sampler, launched: what it returns is applied now, or after the next forward's launch with overlap) and
    `retired(finished works)` (what the owner applies from them: its cost estimates, the sessions they left of no
    use; called for every work once it leaves the engine) are given by the owner of the request state
    (`ciar.engine.verifier.CloudVerifier`)."""

    def __init__(self, runner, config: SchedulerConfig | None = None, admit=None, decide=None, retired=None,
                 overlap: bool = False):
        self.faults: dict[str, int] = {}  # failed forwards by error type, and pieces with non-finite logits
        self.overlap = bool(overlap)  # read a step's decisions after the next step's forward is launched (`step`)
        self._pending: _Pending | None = None  # (overlap) the last step's decisions, launched, not applied
        # (overlap) decodes fed from the device, those of them that followed a verdict, and those dropped (their
        # decision ended the work or started no such decode)
        self.ahead = {"run": 0, "after_verdicts": 0, "dropped": 0}
        self.scheduler = Scheduler(config)
        self.runner = runner
        self._admit_works = admit or (lambda works: [w.admit() for w in works])
        self._decide = decide or (lambda works, logits: None)
        self._retired = retired or (lambda works: None)

    # the scheduler's state, as the engine's callers read it (the config is set live: `Verifier.reconfigure`)
    config = property(lambda self: self.scheduler.config, lambda self, c: setattr(self.scheduler, "config", c))
    steps = property(lambda self: self.scheduler.steps)
    step_log = property(lambda self: self.scheduler.step_log)
    kind_positions = property(lambda self: self.scheduler.kind_positions)
    real_positions = property(lambda self: self.scheduler.real_positions)
    padded_positions = property(lambda self: self.scheduler.padded_positions)
    inbox = property(lambda self: self.scheduler.waiting)
    active = property(lambda self: self.scheduler.running)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy or self._pending is not None

    def submit(self, work: Work) -> Work:
        return self.scheduler.submit(work)

    def works_of(self, session_id: str) -> list[Work]:
        return self.scheduler.of_session(session_id)

    def cancel(self, session_id: str, error: BaseException) -> None:
        """Fail the works of a session that was closed or evicted under them."""
        works = self.works_of(session_id)
        for w in works:
            w.finish(error=error)
        self.scheduler.purge()
        self._retired(works)

    def withdraw(self, work: Work) -> None:
        """Its caller went away: a queued work is dropped before it runs; an admitted one is told (`abandon`: an open
        or resume fails and frees the session it was building; a verification runs to its end)."""
        if work.done:
            return
        if self.scheduler.drop(work):
            work.finish(error=RuntimeError(f"session {work.session_id!r}: the caller went away"))
            self._retired([work])
            return
        abandon = getattr(work, "abandon", None)
        if abandon is not None:
            abandon()

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued and running work (the step itself raised: a bug or a lost accelerator)."""
        works = self.scheduler.all()
        for w in works:
            w.finish(error=error)
        self.scheduler.clear()
        self._pending = None
        self._retired(works)

    def run(self, works: list[Work]) -> None:
        """Step until every work in `works` is done (the synchronous batch API). Works waiting for a slot with nothing
        else to do wait for their deadline (nobody else can close a session meanwhile)."""
        while not all(w.done for w in works):
            self.step()
            if not self.busy and self.scheduler.parked:
                time.sleep(self.parked_timeout() or 0.0)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()  # as CollabDecoder._generate: no autograd bookkeeping on the small per-step ops
    def step(self) -> list[Work]:
        """Admit queued works, run ONE forward over the pieces the scheduler picks, hand results back, decide (draw
        the decodes' tokens, judge the spans that completed). -> the works that left the engine in this step (those
        finished since the last one too).

        With `overlap`, the step's decisions are read in the NEXT step, after its forward is launched: the host
        applies them, retires works, schedules and builds the inputs while the accelerator runs that forward. The
        works waiting for decisions sit that step out, except a decode that goes on (`Work.after_draw`), or the first
        decode of a burst a verdict may start (`Work.after_verdict`): it feeds the token being drawn straight from
        the accelerator (`_Ahead`), and is dropped if the decision ends the work (an entropy stop) or starts no
        burst. Tokens are the same either way (every draw is keyed by its position)."""
        t0 = time.perf_counter()
        finished = self._retire()  # works finished between steps (withdrawn, abandoned): their effects first
        if self.scheduler.parked:
            self.unpark_due()
        self._admit()
        pending, self._pending = self._pending, None
        if pending is None:
            batch = self.scheduler.schedule()
        else:  # the previous step's decisions are not read yet: their works wait, but decodes go on
            waiting = {id(w) for w in pending.decisions.works}
            batch = self.scheduler.schedule([w for w in self.scheduler.running if id(w) not in waiting]
                                            + [_Ahead(*a) for a in pending.decisions.ahead()])
        pieces, step = self._forward(batch) if batch else (None, None)
        dt = time.perf_counter() - t0
        if pending is not None:
            self._apply(pending)  # read while this step's forward runs
        if batch:
            if step is not None:
                self._take(batch, pieces, step, t0, dt)
            self.scheduler.record(batch)
        decided = self._launch(batch, step)
        if decided is not None:
            if self.overlap:
                self._pending = decided
            else:
                self._apply(decided)
        self._record_lengths()
        return finished + self._retire()

    def _retire(self) -> list[Work]:
        """The finished works leave the running set; the owner applies what they leave behind (`retired`)."""
        finished = self.scheduler.retire()
        if finished:
            self._retired(finished)
        return finished

    def _record_lengths(self) -> None:
        """The cache lengths the step left: each running work (finished ones too, until `retire`) says what its
        session holds."""
        cache = self.runner.cache
        for w in self.scheduler.running:
            state = w.kv_state()
            if state is not None:
                cache.set_length(*state)

    def _launch(self, batch: list[Scheduled], step) -> "_Pending | None":
        """The step's decisions in one batched pass (`decide(running works, the step's logits)`: the verifier's
        judge and sampler, one copy to the device, one back), launched: the tokens its decodes draw, the verdicts on
        the spans whose feed is complete (some need no forward at all). A pass that raises (out of memory) fails the
        works it was deciding for."""
        running = [w for w in self.scheduler.running if not w.done]
        try:
            decisions = self._decide(running, None if step is None else step.logits)
        except Exception as e:  # noqa: BLE001 - the decisions' model work failed (out of memory): these works only
            self._fail_deciding(running, e)
            return None
        return None if decisions is None else _Pending(decisions, batch, step)

    def _apply(self, pending: "_Pending") -> None:
        """Read a step's decisions and hand them to their works (`Decisions.apply(on_bad)`). `on_bad(rows)` names
        the rows of that step's logits that were not finite, before anything is applied: their pieces' works fail
        (`Work.fault`) and take no decision. A read that raises fails the works it was deciding for."""
        batch, step = pending.batch, pending.step

        def on_bad(bad_rows: list[bool]) -> None:
            if step is None or not any(bad_rows):
                return
            for p, (a, n) in zip(batch, step.ranges):
                w = _work(p.request)
                if n and any(bad_rows[a:a + n]) and not w.done:
                    self.faults["NonFiniteLogits"] = self.faults.get("NonFiniteLogits", 0) + 1
                    logger.warning("session %s: the forward gave non-finite logits", w.session_id)
                    w.fault(ForwardFault("the cloud forward gave non-finite logits: send the request again",
                                         origin=NonFiniteLogits(f"non-finite logits for session {w.session_id}")))

        try:
            pending.decisions.apply(on_bad)
        except Exception as e:  # noqa: BLE001 - as a failed decision pass
            self._fail_deciding(pending.decisions.works, e)

    def _fail_deciding(self, works: list[Work], e: Exception) -> None:
        deciding = [w for w in works if w.deciding]
        for w in deciding:
            w.deciding = False
        self._fault([w for w in deciding if not w.done], e, "the judge of")

    def _admit(self) -> None:
        new = self.scheduler.take_waiting()
        try:
            self._admit_works(new)  # each admitted, parked (`Work.parked`: no slot yet) or finished with its error
        except Exception as e:  # noqa: BLE001 - the admission's own model work (caption encoding, condition
            # embedding) failed, e.g. out of memory: these works are in no queue; they fail retryably, the rest runs
            self._fault([w for w in new if not w.done], e, "admitting")
            self._retired(new)
            return
        except BaseException as e:  # (an interrupt: these works are in no queue, fail them here)
            for w in new:
                if not w.done:
                    w.finish(error=e)
            self._retired(new)
            raise
        self._retired([w for w in new if w.done])  # finished at admission (refused, or answered at once)
        parked = [w for w in new if w.parked and not w.done]
        for w in parked:
            w.parked = False
        self.scheduler.park(parked)
        self.scheduler.start([w for w in new if not w.done and w not in parked])

    def _fault(self, works: list, e: Exception, what: str) -> None:
        """The model work of a step failed with `e`: its `works` fail with a retryable ForwardFault (each undoing
        what it changed: `Work.fault`), what the step held goes back to the accelerator, the engine goes on."""
        self.faults[type(e).__name__] = self.faults.get(type(e).__name__, 0) + 1
        logger.warning("%s %d works failed (%s: %s); they are answered with a retryable error", what, len(works),
                       type(e).__name__, e)
        if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        fault = ForwardFault(f"the cloud forward failed ({type(e).__name__}): send the request again", origin=e)
        for w in works:
            w.fault(fault)

    # ------------------------------------------------------------------ works waiting for a KV-cache slot
    def unpark(self) -> None:
        """Slots were freed: the parked works try their admission again at the next step (before new arrivals)."""
        self.scheduler.unpark()

    def parked_timeout(self) -> float | None:
        """Seconds until the first parked work's wait for a slot ends (None: nothing parked)."""
        deadlines = [w.deadline for w in self.scheduler.parked]
        return max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None

    def unpark_due(self) -> None:
        """Parked works whose wait has ended go back for one last admission (a slot, or their refusal)."""
        now = time.perf_counter()
        self.scheduler.unpark(lambda w: w.deadline <= now)

    def _forward(self, batch: list[Scheduled]):
        """Launch the batch's forward on the runner (nothing is read on the host). A forward that raises (out of
        memory, a broken kernel) fails the step's works with a `ForwardFault` (retryable; `Work.fault` decides what
        the session keeps) and frees the accelerator's cached blocks; the engine and every other work go on. -> the
        (pieces, the runner's `StepOutput`), or (None, None) when it failed."""
        try:
            pieces = [p.request.piece(p.n) for p in batch]
            return pieces, self.runner.execute_step(pieces)
        except Exception as e:  # noqa: BLE001 - a failed forward fails its works, never the engine
            self._fault([_work(p.request) for p in batch], e, "the forward of")
            return None, None

    def _take(self, batch: list[Scheduled], pieces: list[Piece], out, t0: float, dt: float) -> None:
        """Hand each work its outputs (views of the step's logits) and record the forward; a work that finished
        meanwhile (its previous draw ended it: a decode run ahead) takes nothing."""
        works = [_work(p.request) for p in batch]
        live = [(w, piece, o) for w, piece, o in zip(works, pieces, out.outputs) if not w.done]
        ahead = [p.request for p in batch if isinstance(p.request, _Ahead)]
        if ahead:
            self.ahead["run"] += len(ahead)
            self.ahead["after_verdicts"] += sum(a.offset_from is not None for a in ahead)
            self.ahead["dropped"] += sum(a.done for a in ahead)
        for w, _, _ in live:  # before `take`: a work that finishes now reports this step in its reply
            if w.started is None:
                w.started = t0
            w.passes += 1
            w.seconds += dt
            w.batch_size = len(works)
        for w, piece, o in live:
            try:
                w.take(piece, o)
            except Exception as e:  # noqa: BLE001 - one work's bad result fails that work only
                w.finish(error=e)


@dataclass
class _Pending:
    """A step's decisions, launched and not yet applied, with the batch and output they were made from."""

    decisions: object  # what the owner's `decide` returned: `works`, `ahead()`, `apply(on_bad)`
    batch: list[Scheduled]
    step: object  # the runner's StepOutput, or None


class _Ahead(Request):
    """A work's next one-token decode, scheduled before the decision it follows is read (overlap): at `position`
    (plus, with `offset_from`, a value the device holds: a verification's drafts kept), its token taken on the
    accelerator (`token_from`: the draws' tokens or the verdicts' next tokens, its index). It stands for the work in
    the scheduler and the forward; the work takes the outputs (or nothing, if the decision ended it or started no
    such decode)."""

    def __init__(self, work: Work, position: int, token_from: tuple, offset_from: tuple | None = None):
        self.work, self._position, self.token_from, self.offset_from = work, position, token_from, offset_from
        self.seq, self.session_id = work.seq, work.session_id

    @property
    def done(self) -> bool:
        return self.work.done

    def kind(self) -> int:
        return DECODE

    def pending(self) -> int:
        return 1

    def position(self) -> int:
        return self._position

    @property
    def rows(self) -> int:
        return self.work.rows

    def piece(self, n: int) -> Piece:
        return Piece(self.work.slots, self._position, 1, want=[0], token_from=self.token_from,
                     offset_from=self.offset_from)


def _work(request) -> Work:
    """The work a scheduled request stands for (itself, or the work an `_Ahead` decode runs ahead for)."""
    return request.work if isinstance(request, _Ahead) else request


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

    def stalled_s(self) -> float:
        """0: a step on the caller's loop blocks the loop, so nothing could ask meanwhile."""
        return 0.0

    async def _loop(self) -> None:
        engine = self.engine
        if self.wait_s > 0 and self._waits_for_company():
            await asyncio.sleep(self.wait_s)
        while engine.busy or engine.scheduler.parked:
            if not engine.busy:  # only works waiting for a slot: look again soon (a close unparks them)
                await asyncio.sleep(min(0.01, engine.parked_timeout() or 0.0))
                engine.unpark_due()
                continue
            before = self._stepping()
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - every waiting caller gets the error
                engine.fail_all(e)
                finished = self._step_failed(e)
            await self._stepped(finished, before)
        self._idle()

    # the hooks a driver on another loop overrides (`ciar.engine.process`'s core)
    def _waits_for_company(self) -> bool:
        """Whether the first step after idleness waits `wait_s` for more works."""
        return True

    def _stepping(self):
        """Before a step -> what `_stepped` is handed."""
        return None

    def _step_failed(self, error: Exception) -> list:
        """After a step raised (its works failed) -> the works finished; here the loop ends with the error."""
        raise error

    async def _stepped(self, finished: list, before) -> None:
        """After a step: metrics, then the loop's turn (what arrived meanwhile joins the next step)."""
        if self.on_step is not None:
            self.on_step(self.engine, finished)
        await asyncio.sleep(0)

    def _idle(self) -> None:
        """The engine has nothing left to step."""


class EngineThread(_Driver):
    """Run a `StepEngine` on its own thread, the verifier's engine core (`ciar.engine.service.VerifierService`;
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
        self.step_started: float | None = None  # time.monotonic() of the step running now (the watchdog reads it)
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

    def stalled_s(self) -> float:
        """How long the step running now has run (0 between steps): a forward that hangs (a kernel that never
        returns) shows here, for a watchdog (`VerifierService.check_stalled`, the Verifier's `check_health`)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

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
                    self._wake.wait(engine.parked_timeout())  # a parked work's wait for a slot may end meanwhile
                    engine.unpark_due()
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
            self.step_started = time.monotonic()
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - every waiting caller gets the error; the engine goes on
                self.steps_failed += 1
                engine.fail_all(e)
                continue
            finally:
                self.step_started = None
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
