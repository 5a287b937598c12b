"""The cloud side of CIAR: one cloud model, one KV-cache slot pair per live session, batched work.

    verifier = CloudVerifier(world.cloud, world.text, max_sessions=64, projector=projector, codebook=codebook)
    replies = verifier.open_batch([OpenRequest(...), ...])       # prefill + prefix tokens, all sessions at once
    replies = verifier.verify_batch([VerifyRequest(...), ...])   # catch-up + spans of many sessions, ONE forward
    replies = verifier.resume_batch([OpenRequest(...)], [history])  # re-create lost sessions from the device's tokens
    verifier.close("session-id")
    verifier.evict_idle(300.0)                                   # close sessions idle for 5 minutes
    client = InProcessCloud(verifier)                            # the CloudClient protocol by direct calls

    work = verifier.submit_verify(VerifyRequest(...))            # the same work, queued: a server feeds requests as
    verifier.engine.step()                                       # they arrive and steps the engine (one forward each)

Every call runs on the step-level engine (`ciar.engine.core`): a request is a *work* (`ciar.engine.works`: OpenWork,
JacobiWork, VerifyWork, ResumeWork) that feeds one piece per forward (a prefill chunk, a span, one prefix or burst
token, a Jacobi window, a chunk of a resumed history), and each forward carries the pieces of every session that has one
ready, under a token budget; the `*_batch` calls submit their requests and step until they are done. A work's state is
data: after the forward it records where its outputs are (`take`) and, when it needs a decision, says what (`draw`: a
token to sample; `span`: drafts to judge); the step's decisions are made together by the judge (`ciar.engine.judge`:
every row's sampling, every span, every draw in one batched pass, one copy each way) and each work takes its own
(`drawn`, `commit`).

The cache invariant per session (the condition and every committed token but the last) is written in
`ciar.engine.works`; the engine core is the one writer of cache lengths (`Work.kv_state`). This module is the facade
the in-process tools and the Verifier deployment call: it owns the model runner, the session table, the judge and
the engine, admits works (captions encoded, conditions embedded), hands the step's decisions to the works and
applies what finished works leave behind (costs, sessions of no use).

Randomness: every cloud draw is keyed by (the OpenRequest's `seed`, a stream, an image position) (`ciar.engine.judge`:
a token the cloud samples itself at position i, a prefix or burst token, as `ciar.decoding.generate.generate_cloud`
draws it; the acceptance test of the draft at position i; the next token at its position). So a verification's
draws depend only on (seed, position, inputs): a session's tokens do not depend on which sessions share its
batches, nor on whether its cache was rebuilt in between.

Recovery: a verify that names an unknown session (never opened, closed, evicted, or lost with its replica) raises
`SessionLostError`; the client then calls `resume_batch` with the session's OpenRequest, the device's committed
tokens and the interval features injected with them (`InjectedFeatures`), which rebuilds exactly the state of the
invariant above (prefill + one ragged feed of history[:-1], projected features added at the same positions as the
original verifications added them), and re-sends the verify (`ciar.sim.recovery.RecoveringClient`). With
position-keyed randomness the resumed session continues with the same tokens as an uninterrupted one (same inputs
and draws; the rebuilt cache equals the original up to floating-point summation order, like any difference in
batching).

Sessions and slots: `ciar.engine.sessions.SessionTable` (`verifier.table`) holds the open sessions, their cache
slots (2 each with CFG, 1 without, `max_sessions` sessions) and their idle expiry; `close` here also fails a
request still in flight for the session.
"""

from __future__ import annotations

import functools
import time

import torch

from ciar.collab.device import device_caption
from ciar.collab.projector import IntervalProjector
from ciar.collab.protocol import (CapacityError, InjectedFeatures, OpenReply, OpenRequest, SessionError,
                                  SessionLostError, VerifyReply, VerifyRequest)
from ciar.engine.core import KINDS, StepEngine, Work
from ciar.engine.judge import Judge
from ciar.engine.runner import ModelRunner, plan_sessions
from ciar.engine.scheduler import SchedulerConfig
from ciar.engine.transfer import to_device
from ciar.engine.sessions import Session, SessionTable, slots_needed
from ciar.engine.works import JacobiWork, OpenWork, ResumeWork, VerifyWork, WorkContext, check_projector_inputs
from ciar.models.gpt import GPT
from ciar.text import TextEncoder
from ciar_device.policy import CloudStepEstimator, CostHint, Ewma

__all__ = ["CloudVerifier", "InProcessCloud", "JacobiWork", "OpenWork", "ResumeWork", "VerifyWork",
           "check_projector_inputs"]


class CloudVerifier:
    def __init__(self, cloud: GPT, text: TextEncoder | None, max_sessions: int | str = 16,
                 projector: IntervalProjector | None = None, codebook: torch.Tensor | None = None,
                 idle_timeout_s: float | None = None, scheduler: SchedulerConfig | None = None,
                 memory_utilization: float = 0.9, slot_wait_s: float = 0.0, static: bool | None = None,
                 fused: bool = False, overlap: bool = False, pack: bool = False, compiled_judge: bool = False):
        """`max_sessions`: KV-cache sessions (2 slots each with CFG), or "auto": as many as the accelerator's memory
        holds after loading, at `memory_utilization` of its total (`ciar.engine.runner.plan_sessions`; the plan is
        `self.memory`). `idle_timeout_s`: when an open/resume lacks free slots, sessions idle for at least this
        long are evicted first (None: never evict on demand; `evict_idle` can still be called). `scheduler`: the
        step engine's token budget and limits (`ciar.engine.scheduler.SchedulerConfig`). `slot_wait_s`: how long a
        queued open or resume waits for a slot before it is refused (`open_work`; 0: refused at once). `static`:
        the model runner pads steps to buckets and, on CUDA, replays them from CUDA graphs (default: on CUDA;
        `ciar.engine.runner`); `fused`: its static steps fused, `pack`: its span-wide static steps with few fed
        positions packed (`ciar.engine.runner.ModelRunner`); `overlap`: the engine reads a step's decisions after
        launching the next step's forward (`ciar.engine.core.StepEngine.step`; the same tokens, a gain only where an
        accelerator runs the forward); `compiled_judge`: the judge's arithmetic compiled (`ciar.engine.judge.Judge`:
        fewer operations a step, probabilities equal to the last bits only)."""
        self.cloud = cloud.eval()
        self.text = text
        self.config = cloud.config
        self.vocab_size = cloud.config.vocab_size
        scheduler = scheduler or SchedulerConfig()
        self.memory = None
        if max_sessions == "auto":
            graphs = static is not False and self.cloud.tok_embeddings.weight.device.type == "cuda"
            self.memory = plan_sessions(cloud, scheduler.token_budget, 2 * scheduler.max_works, memory_utilization,
                                        graphs=graphs)
            max_sessions = self.memory.sessions
        elif isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1 or 'auto', got {max_sessions!r}")
        self.slot_wait_s = float(slot_wait_s)
        self.runner = ModelRunner(cloud, 2 * max_sessions, static=static, fused=fused, pack=pack)  # model, KV cache
        self.cache = self.runner.cache
        self.table = SessionTable(self.cache, max_sessions, idle_timeout_s)
        self.projector = projector.eval() if projector is not None else None
        self.judge = Judge(cloud, codebook, compiled=compiled_judge)
        # what the works read besides their requests and sessions (`ciar.engine.works`): never the verifier itself
        self.ctx = WorkContext(cloud.config.cls_token_num, cloud.config.block_size, self.vocab_size, self.device,
                               self.projector, functools.partial(device_caption, self.cloud),
                               encodes_captions=text is not None)
        self.engine = StepEngine(self.runner, scheduler, admit=self.admit_works, decide=self.decide,
                                 retired=self.retired, overlap=overlap)
        # what its replies told the devices, over all of them: the hint a device's first image starts from
        self.reply_costs = CloudStepEstimator()
        self.reply_queue = Ewma(0.2)

    def retired(self, works: list) -> None:
        """Engine hook: works that left the engine (finished). A session one of them left of no use
        (`Work.drop_session`) is closed; their replies' costs feed the estimates (`observe_costs`)."""
        for w in works:
            s = getattr(w, "s", None)
            if w.drop_session and s is not None and self.table.sessions.get(w.session_id) is s:
                self.close(w.session_id, cancel=False)
        self.observe_costs(works)

    def observe_costs(self, works: list) -> None:
        """The replies finished works gave (`Work.cost`: compute seconds, forwards, whether a verification, queue
        wait, tokens the cloud made itself) feed the running estimates `cost_hint` reports."""
        for w in works:
            cost = w.cost
            if cost is not None and w.error is None:
                seconds, passes, verify, queue_s, tokens = cost
                self.reply_costs.observe(seconds, passes, verify=verify, tokens=tokens)
                if verify:
                    self.reply_queue.update(queue_s)

    def cost_hint(self) -> CostHint | None:
        """The verifier's recent span forward, sampled step and queue wait, as its replies reported them (a running
        mean over every device's replies: `ciar_device.policy.CloudStepEstimator`), for a device that has not
        drafted yet (WELCOME, `CloudClient.cost_hint`); None before its first verify reply or long open."""
        hint = self.reply_costs.hint(self.reply_queue.value)
        return hint if hint.span_s is not None or hint.step_s is not None else None

    def stats(self) -> dict:
        """What the engine has done and holds, as plain values (the Verifier deployment's `stats`, in-process or
        from the engine's own process: `ciar.engine.process`)."""
        engine, runner = self.engine, self.runner
        return {"sessions": self.num_sessions, "free_slots": self.free_slot_count, "busy": engine.busy,
                "max_sessions": self.table.max_sessions, "forwards": engine.steps,
                "positions_by_kind": dict(zip(KINDS, engine.kind_positions)),
                "real_positions": engine.real_positions, "padded_positions": engine.padded_positions,
                "forwards_by_path": dict(runner.steps), "forward_faults": dict(engine.faults),
                "overlap": engine.overlap, "decodes_run_ahead": dict(engine.ahead), "packed_step": runner.pack,
                "compiled_judge": self.judge.compiled,
                "packed_tokens": runner.positions["packed"],
                "memory": self.memory.to_dict() if self.memory is not None else None}

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device

    @property
    def sessions(self) -> dict[str, Session]:
        """The open sessions by id (`table.sessions`)."""
        return self.table.sessions

    @property
    def num_sessions(self) -> int:
        return len(self.table)

    @property
    def free_slot_count(self) -> int:
        return len(self.table.free_slots)

    # ------------------------------------------------------------------ sessions
    def close(self, session_id: str, cancel: bool = True) -> None:
        """Free a session's slots; a request of it still in flight fails with SessionLostError."""
        s = self.table.pop(session_id)
        if s is not None:
            if cancel and s.work is not None:
                self.engine.cancel(session_id, SessionLostError(f"session {session_id!r} was closed while a "
                                                                f"request was in flight", session_id))
            self.table.free(s)
            self.engine.unpark()  # works waiting for a slot try again

    def evict_idle(self, max_idle_s: float) -> list[str]:
        """Close the sessions idle (no open/resume/verify) for at least `max_idle_s` seconds; -> their ids."""
        evicted = self.table.evict_idle(max_idle_s)
        if evicted:
            self.engine.unpark()
        return evicted

    # ------------------------------------------------------------------ submitting work (step-level engine)
    def submit_open(self, request: OpenRequest, caption_emb: torch.Tensor | None = None,
                    caption_mask: torch.Tensor | None = None, owner: str = "") -> "OpenWork":
        """Queue an open (caption + `prefix_len` cloud tokens); `caption_emb` [L, D] / `caption_mask` [L] skip the
        text encoder. Structural errors raise here; state errors (no slot, a conflicting session) fail the work.
        `owner`: the calling device. The same OPEN repeated by its owner while the session has not moved on is
        answered as the first was (its reply, or the first's result when it is still in flight): OPEN is safe to
        send again after a lost reply (`ciar.engine.service`)."""
        return self.engine.submit(self.open_work(request, caption_emb, caption_mask, owner))

    def submit_verify(self, request: VerifyRequest) -> "VerifyWork":
        return self.engine.submit(self.verify_work(request))

    def submit_resume(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None = None,
                      caption_emb: torch.Tensor | None = None, caption_mask: torch.Tensor | None = None,
                      owner: str = "") -> "ResumeWork":
        return self.engine.submit(self.resume_work(request, history, injected, caption_emb, caption_mask, owner))

    # the same works, built but not queued: whoever owns the engine queues them (`ciar.engine.core.EngineThread`
    # takes them over to its thread; building checks their structure on the caller's side)
    def open_work(self, request: OpenRequest, caption_emb: torch.Tensor | None = None,
                  caption_mask: torch.Tensor | None = None, owner: str = "") -> "OpenWork":
        jacobi = request.jacobi_window > 0 and request.prefix_len > 0  # the prefix by Jacobi windows (SJD)
        return self._waits_for_a_slot((JacobiWork if jacobi else OpenWork)(self.ctx, request, caption_emb,
                                                                            caption_mask, owner))

    def _waits_for_a_slot(self, work: "OpenWork") -> "OpenWork":
        """A queued open or resume that finds every KV-cache slot taken waits up to `slot_wait_s` for one (in
        arrival order, taken as closes and evictions free them), then is refused with a CapacityError (503 +
        Retry-After at the API; the device retries): the cache is never over-committed. The engine's owner steps it
        (`EngineThread` wakes at the deadline); the synchronous `*_batch` calls refuse at once."""
        if self.slot_wait_s > 0:
            work.deadline = work.created + self.slot_wait_s
        return work

    def verify_work(self, request: VerifyRequest) -> "VerifyWork":
        return VerifyWork(self.ctx, request)

    def resume_work(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None = None,
                    caption_emb: torch.Tensor | None = None, caption_mask: torch.Tensor | None = None,
                    owner: str = "") -> "ResumeWork":
        return self._waits_for_a_slot(ResumeWork(self.ctx, request, history, injected, caption_emb, caption_mask,
                                                 owner))

    def decide(self, works: list, step_logits: torch.Tensor | None) -> "Decisions | None":
        """Engine hook, once per step: the tokens the works' decodes draw and the verdicts on the spans whose feed is
        complete, all in one `Judge.launch` (one copy to the accelerator, one back, not waited for). -> `Decisions`
        (None when there is nothing to decide): the engine applies them (`Decisions.apply`) at once, or, with
        overlap, after it has launched the next step's forward."""
        draws = [w for w in works if not w.done and w.draw_from is not None]
        spans = [w for w in works if isinstance(w, (VerifyWork, JacobiWork)) and not w.done and w.phase == "judge"]
        if not draws and not spans and step_logits is None:
            return None
        for w in draws + spans:
            w.deciding = True  # if the pass raises, the engine fails these works (and clears the marks)
        deciding = self.judge.launch([w.draw() for w in draws], [w.span() for w in spans], step_logits)
        return Decisions(draws, spans, deciding)

    def _run(self, works: list) -> list:
        """Step the engine until `works` are done; -> their results, or raise the first error (in request order)."""
        self.engine.run(works)
        for w in works:
            if w.error is not None:
                raise w.error
        return [w.result for w in works]

    def admit_works(self, works: list) -> None:
        """Engine hook: admit newly queued works in arrival order (each admitted, or finished with its error);
        the captions of all admitted opens and resumes are encoded in one call and their conditions embedded
        in one."""
        starting = []
        for w in works:
            if w.done:  # cancelled while queued (its session was replaced by a resume admitted before it)
                continue
            try:
                self._admit(w)
            except CapacityError as e:
                if w.deadline is not None and time.perf_counter() < w.deadline:
                    w.parked = True  # wait for a slot (the engine parks it; a close or its deadline brings it back)
                    continue
                w.finish(error=CapacityError(f"{e}; waited {time.perf_counter() - w.created:.1f} s for a slot"
                                             if w.deadline is not None else str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - one work's bad input fails that work only, never the step
                if getattr(w, "s", None) is not None and w.s.work is w:
                    w.s.work = None  # its session takes the next request (a resume, or a corrected verify)
                w.finish(error=e if isinstance(e, (SessionError, CapacityError, ValueError)) else
                         SessionError(f"session {w.session_id!r}: request refused ({type(e).__name__}: {e})"))
                continue
            if isinstance(w, OpenWork) and not w.done and w.leader is None:  # (a repeated OPEN has no start)
                starting.append(w)
        if starting:
            self._start(starting)

    def _admit(self, w: Work) -> None:
        """A work's session, found (a verification) or opened (an open, a resume: the table's slots), handed to the
        work (`admit(session)`); an OPEN of a session already held is answered as its first was (`repeat`)."""
        if not isinstance(w, OpenWork):
            w.admit(self.table.get(w.session_id))
            return
        held = self.table.sessions.get(w.session_id)
        if held is not None and w.REPEATABLE:
            w.repeat(held)
            return
        if isinstance(w, ResumeWork):
            self.close(w.session_id)  # a stale copy of the same session
        w.admit(self.table.open(w.request))

    def _start(self, works: list["OpenWork"]) -> None:
        """Create the sessions of admitted opens/resumes: encode captions (those not given), mark caption
        padding in the cache, embed the condition rows (cond, and uncond with CFG)."""
        for w in works:  # each caption alone: its embedding does not depend on the captions admitted with it
            if w.caption_emb is not None:
                continue
            t0 = time.perf_counter()
            try:
                cap = self.text.encode([w.request.prompt])
            except ValueError as e:  # e.g. CaptionTooLongError: the caller maps it to a 4xx
                w.finish(error=e)  # (its half-built session is dropped: `OpenWork.finish`)
                continue
            w.caption_emb, w.caption_mask = cap.emb[0], (cap.mask[0] if cap.mask is not None else None)
            w.encode_s = time.perf_counter() - t0  # cloud compute its reply reports (cloud_s), not queue wait
            w.seconds += w.encode_s
        works = [w for w in works if not w.done]
        if not works:
            return
        embs, drops = [], []
        for w in works:
            for j, slot in enumerate(w.slots):
                embs.append(w.caption_emb)
                drops.append(j == 1)
                self.runner.mark_caption(slot, w.caption_mask, uncond=j == 1)
        # float captions in the model's dtype; token ids (a Chameleon prompt) as they are
        cond = self.runner.condition(torch.stack([to_device(e, self.device, self.runner.dtype
                                                            if e.is_floating_point() else None) for e in embs]),
                                     torch.tensor(drops))
        row = 0
        for w in works:
            w.cond = cond[row:row + w.rows]
            row += w.rows

    # ------------------------------------------------------------------ the batch API (submit, step until done)
    def open_batch(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None = None,
                   caption_mask: torch.Tensor | None = None) -> list[OpenReply]:
        """Start sessions: encode captions (or take `caption_emb` [B, L, D] / `caption_mask` [B, L]), prefill, and
        let the cloud generate each session's `prefix_len` tokens. All or nothing: a bad request or too few free
        slots raises before any session is created."""
        self._check_batch(requests, caption_emb)
        for r in requests:
            self.table.check_new(r.session_id)
        self.table.reserve(sum(slots_needed(r) for r in requests))
        return self._run([self.submit_open(r, *_caption(caption_emb, caption_mask, i))
                          for i, r in enumerate(requests)])

    def resume_batch(self, requests: list[OpenRequest], histories: list[torch.Tensor],
                     caption_emb: torch.Tensor | None = None, caption_mask: torch.Tensor | None = None,
                     injected: list[InjectedFeatures | None] | None = None) -> list[OpenReply]:
        """Re-create sessions from the device's committed tokens `histories[i]` ([c_i] int64, c_i may be 0): encode
        the captions (or take `caption_emb` / `caption_mask` as `open_batch`), prefill, feed history[:-1] (with
        `injected[i]`'s projected interval features added where the original verifications added them), and leave
        each session exactly as the cache invariant says after c_i committed tokens (the prefill logits kept when
        c_i = 0). `prefix_len` is ignored (no tokens are generated); a session id that is still open (a stale copy)
        is closed first. -> OpenReplies with empty `prefix_tokens`, the caption only if `want_caption`, and
        `forward_passes` = the session's forwards (prefill, + 1 if c_i >= 2, when nothing is chunked)."""
        if len(histories) != len(requests):
            raise SessionError(f"{len(requests)} requests but {len(histories)} histories")
        injected = list(injected) if injected is not None else [None] * len(requests)
        if len(injected) != len(requests):
            raise SessionError(f"{len(requests)} requests but {len(injected)} injected-feature entries")
        self._check_batch(requests, caption_emb)
        works = [ResumeWork(self.ctx, r, h, inj, *_caption(caption_emb, caption_mask, i))
                 for i, (r, h, inj) in enumerate(zip(requests, histories, injected))]
        for r in requests:  # stale copies of the same sessions
            self.close(r.session_id)
        self.table.reserve(sum(slots_needed(r) for r in requests))
        return self._run([self.engine.submit(w) for w in works])

    def verify_batch(self, requests: list[VerifyRequest]) -> list[VerifyReply]:
        """Catch-up + span of many sessions: one forward (when the engine's budget holds them all), one judge."""
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one verification batch")
        works = [VerifyWork(self.ctx, r) for r in requests]
        for w in works:
            w.check_state(self.table.get(w.session_id))  # all or nothing: raise before anything is queued
        return self._run([self.engine.submit(w) for w in works])

    def _check_batch(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None) -> None:
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one batch")
        if caption_emb is not None and caption_emb.shape[0] != len(requests):
            raise SessionError(f"{len(requests)} requests but {caption_emb.shape[0]} caption embeddings")


class Decisions:
    """One step's decisions on the accelerator (`CloudVerifier.decide`), for the engine core: `works` waits for
    them, `ahead()` names the decodes that may run before they are read, `apply(on_bad)` reads them (the step's one
    host read) and hands each work its own."""

    def __init__(self, draws: list, spans: list, deciding):
        self.draws, self.spans, self.deciding = draws, spans, deciding
        self.works = draws + spans

    def ahead(self) -> list[tuple]:
        """(work, position, token_from, offset_from) for each decode that may run before these decisions are read:
        a draw's whose work goes on after it (`Work.after_draw`), fed the drawn token; and the first burst decode of
        a verification whose verdict may start a burst one token a forward (`VerifyWork.after_verdict`), fed the
        verdict's next token at the position past the drafts it keeps (dropped if no burst follows)."""
        out = []
        for i, w in enumerate(self.draws):
            at = None if w.done else w.after_draw()
            if at is not None:
                out.append((w, at, (self.deciding.tokens, i), None))
        for i, w in enumerate(self.spans):
            at = None if w.done or i not in self.deciding.verdicts else w.after_verdict()
            if at is not None:
                kept, nxt, j = self.deciding.verdicts[i]
                out.append((w, at, (nxt, j), (kept, j, w.k)))
        return out

    def apply(self, on_bad) -> None:
        """Read the decisions; `on_bad` first fails the works whose logits in their step were not finite; then each
        work takes its decision."""
        decided = self.deciding.collect()
        for w in self.works:
            w.deciding = False
        on_bad(decided.bad)
        for w, token, stop in zip(self.draws, decided.tokens, decided.stops):
            if not w.done:
                _apply(w, w.drawn, token, stop)
        for i, w in enumerate(self.spans):
            if w.done:
                continue
            if i in decided.errors:
                w.finish(error=decided.errors[i])
                continue
            n, z, rec = decided.verdicts[i]
            judged = len(self.spans)
            if isinstance(w, JacobiWork):
                _apply(w, w.commit, n, z, rec, judged, decided.redrafts.get(i))
            else:
                _apply(w, w.commit, n, z, rec, judged, decided.redrafts.get(i), decided.span_stops.get(i, -1))


def _apply(w: Work, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - one work's bad result fails that work only
        w.finish(error=e)


def _caption(emb: torch.Tensor | None, mask: torch.Tensor | None, i: int):
    return (None if emb is None else emb[i], None if mask is None else mask[i])


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

    def cost_hint(self) -> CostHint | None:
        return self.verifier.cost_hint()

    def resume(self, request: OpenRequest, history: torch.Tensor,
               injected: InjectedFeatures | None = None) -> OpenReply:
        return self.verifier.resume_batch([request], [history], injected=[injected])[0]

    def close(self, session_id: str) -> None:
        self.verifier.close(session_id)
