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

Every call runs on the step-level engine (`ciar.engine.core`): a request is a *work* (OpenWork, VerifyWork,
ResumeWork below) that feeds one piece per forward (a prefill chunk, a span, one prefix or burst token, a chunk of
a resumed history), and each forward carries the pieces of every session that has one ready, under a token
budget; the `*_batch` calls submit their requests and step until they are done. A work's state is data: after the
forward it records where its outputs are (`take`) and, when it needs a decision, says what (`draw`: a token to
sample; `span`: drafts to judge); the step's decisions are made together by the judge (`ciar.engine.judge`: every
row's sampling, every span, every draw in one batched pass, one copy each way) and each work takes its own
(`drawn`, `commit`).

Cache invariant per session (CFG: a cond slot and an uncond slot with the same tokens): the session's committed
image tokens t_0..t_{c-1} are in `tokens`; the cache holds the condition and t_0..t_{c-2} ("fed" = c - 1); the
last committed token is fed by the next forward. A verification with m new tokens and k drafts feeds
t_{fed}..t_{c+m-1}, x_1..x_k in one ragged batch (per-row positions), reads the target distributions p_1..p_{k+1}
at the positions of t_{c+m-1}, x_1..x_k, judges the span with the session's acceptance rule, commits the accepted
drafts plus the next token, and rolls the cache back to the accepted prefix (pointer move; stale entries are
invisible and overwritten). Padding of the ragged batch writes only past each row's committed content (clamped to a
scratch position inside the cache's slack).

Randomness: every cloud draw is keyed by (the OpenRequest's `seed`, a stream, an image position) (`ciar.engine.judge`:
a token the cloud samples itself at position i, a prefix or burst token, as `ciar.decoding.generate.generate_cloud`
draws it; the acceptance test of the draft at position i; the next token at its position). So a verification's
draws depend only on (seed, position, inputs): a session's tokens do not depend on which sessions share its
batches, nor on whether its cache was rebuilt in between.

Recovery: a verify that names an unknown session (never opened, closed, evicted, or lost with its replica) raises
`SessionLostError`; the client then calls `resume_batch` with the session's OpenRequest, the device's committed
tokens and the interval features injected with them (`InjectedFeatures`), which rebuilds exactly the state of the
invariant above (prefill + one ragged feed of history[:-1], projected features added at the same positions as the
original verifications added them), and re-sends the verify (`ciar.collab.recovery.RecoveringClient`). With
position-keyed randomness the resumed session continues with the same tokens as an uninterrupted one (same inputs
and draws; the rebuilt cache equals the original up to floating-point summation order, like any difference in
batching).

Sessions and slots: `ciar.engine.sessions.SessionTable` (`verifier.table`) holds the open sessions, their cache
slots (2 each with CFG, 1 without, `max_sessions` sessions) and their idle expiry; `close` here also fails a
request still in flight for the session.
"""

from __future__ import annotations

import time
from dataclasses import astuple, replace

import torch

from ciar.collab.device import device_caption
from ciar.engine.core import StepEngine, Work
from ciar.engine.runner import ModelRunner, Piece, plan_sessions
from ciar.engine.scheduler import DECODE, HISTORY, PREFILL, SPAN, SchedulerConfig
from ciar.collab.projector import IntervalProjector
from ciar.collab.protocol import (CapacityError, InjectedFeatures, OpenReply, OpenRequest, SessionConflictError,
                                  SessionError, SessionLostError, VerifyReply, VerifyRequest, verify_tensors)
from ciar.engine.sessions import Session, SessionTable, slots_needed
from ciar.engine.judge import Draw, Judge, Span
from ciar.models.gpt import GPT
from ciar.text import TextEncoder
from ciar_device.policy import CloudStepEstimator, CostHint, Ewma

class CloudVerifier:
    def __init__(self, cloud: GPT, text: TextEncoder | None, max_sessions: int | str = 16,
                 projector: IntervalProjector | None = None, codebook: torch.Tensor | None = None,
                 idle_timeout_s: float | None = None, scheduler: SchedulerConfig | None = None,
                 memory_utilization: float = 0.9, slot_wait_s: float = 0.0, static: bool | None = None,
                 fused: bool = False):
        """`max_sessions`: KV-cache sessions (2 slots each with CFG), or "auto": as many as the accelerator's memory
        holds after loading, at `memory_utilization` of its total (`ciar.engine.runner.plan_sessions`; the plan is
        `self.memory`). `idle_timeout_s`: when an open/resume lacks free slots, sessions idle for at least this
        long are evicted first (None: never evict on demand; `evict_idle` can still be called). `scheduler`: the
        step engine's token budget and limits (`ciar.engine.scheduler.SchedulerConfig`). `slot_wait_s`: how long a
        queued open or resume waits for a slot before it is refused (`open_work`; 0: refused at once). `static`:
        the model runner pads steps to buckets and, on CUDA, replays them from CUDA graphs (default: on CUDA;
        `ciar.engine.runner`); `fused`: its static steps fused (`ciar.engine.runner.ModelRunner`)."""
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
        self.runner = ModelRunner(cloud, 2 * max_sessions, static=static, fused=fused)  # the model, its KV cache
        self.cache = self.runner.cache
        self.table = SessionTable(self.cache, max_sessions, idle_timeout_s)
        self.projector = projector.eval() if projector is not None else None
        self.judge = Judge(cloud, codebook)
        self.engine = StepEngine(self.runner, scheduler, admit=self.admit_works, decide=self.decide,
                                 retired=self.retired)
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
        wait) feed the running estimates `cost_hint` reports."""
        for w in works:
            cost = w.cost
            if cost is not None and w.error is None:
                seconds, passes, verify, queue_s = cost
                self.reply_costs.observe(seconds, passes, verify=verify)
                if verify:
                    self.reply_queue.update(queue_s)

    def cost_hint(self) -> CostHint | None:
        """The verifier's recent span forward, sampled step and queue wait, as its replies reported them (a running
        mean over every device's replies: `ciar_device.policy.CloudStepEstimator`), for a device that has not
        drafted yet (WELCOME, `CloudClient.cost_hint`); None before its first verify reply or long open."""
        hint = self.reply_costs.hint(self.reply_queue.value)
        return hint if hint.span_s is not None or hint.step_s is not None else None

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
        send again after a lost reply (`ciar.collab.service`)."""
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
        return self._waits_for_a_slot(OpenWork(self, request, caption_emb, caption_mask, owner))

    def _waits_for_a_slot(self, work: "OpenWork") -> "OpenWork":
        """A queued open or resume that finds every KV-cache slot taken waits up to `slot_wait_s` for one (in
        arrival order, taken as closes and evictions free them), then is refused with a CapacityError (503 +
        Retry-After at the API; the device retries): the cache is never over-committed. The engine's owner steps it
        (`EngineThread` wakes at the deadline); the synchronous `*_batch` calls refuse at once."""
        if self.slot_wait_s > 0:
            work.deadline = work.created + self.slot_wait_s
        return work

    def verify_work(self, request: VerifyRequest) -> "VerifyWork":
        return VerifyWork(self, request)

    def resume_work(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None = None,
                    caption_emb: torch.Tensor | None = None, caption_mask: torch.Tensor | None = None,
                    owner: str = "") -> "ResumeWork":
        return self._waits_for_a_slot(ResumeWork(self, request, history, injected, caption_emb, caption_mask, owner))

    def decide(self, works: list, step_logits: torch.Tensor | None, on_bad) -> None:
        """Engine hook, once per step: the tokens the works' decodes draw and the verdicts on the spans whose feed is
        complete, all in one `Judge.decide` (one copy to the accelerator, one back); `on_bad` first fails the works
        whose logits in this step were not finite; then each work takes its decision."""
        draws = [w for w in works if not w.done and w.draw_from is not None]
        spans = [w for w in works if isinstance(w, VerifyWork) and not w.done and w.phase == "judge"]
        if not draws and not spans and step_logits is None:
            return
        for w in draws + spans:
            w.deciding = True  # if the pass raises, the engine fails these works (and clears the marks)
        decided = self.judge.decide([w.draw() for w in draws], [w.span() for w in spans], step_logits)
        for w in draws + spans:
            w.deciding = False
        on_bad(decided.bad)
        for w, token, stop in zip(draws, decided.tokens, decided.stops):
            if not w.done:
                self._apply(w, w.drawn, token, stop)
        for i, w in enumerate(spans):
            if w.done:
                continue
            if i in decided.errors:
                w.finish(error=decided.errors[i])
                continue
            n, z, rec = decided.verdicts[i]
            self._apply(w, w.commit, n, z, rec, len(spans))

    @staticmethod
    def _apply(w: Work, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one work's bad result fails that work only
            w.finish(error=e)

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
                if isinstance(w, ResumeWork):
                    self.close(w.session_id)  # a stale copy of the same session
                w.admit()
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
        cond = self.runner.condition(torch.stack([e.to(self.device, self.runner.dtype) if e.is_floating_point()
                                                  else e.to(self.device) for e in embs]), torch.tensor(drops))
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
        works = [ResumeWork(self, r, h, inj, *_caption(caption_emb, caption_mask, i))
                 for i, (r, h, inj) in enumerate(zip(requests, histories, injected))]
        for r in requests:  # stale copies of the same sessions
            self.close(r.session_id)
        self.table.reserve(sum(slots_needed(r) for r in requests))
        return self._run([self.engine.submit(w) for w in works])

    def verify_batch(self, requests: list[VerifyRequest]) -> list[VerifyReply]:
        """Catch-up + span of many sessions: one forward (when the engine's budget holds them all), one judge."""
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one verification batch")
        works = [VerifyWork(self, r) for r in requests]
        for w in works:
            w.check_state()  # all or nothing: raise before anything is queued
        return self._run([self.engine.submit(w) for w in works])

    def _check_batch(self, requests: list[OpenRequest], caption_emb: torch.Tensor | None) -> None:
        if len({r.session_id for r in requests}) != len(requests):
            raise SessionError("duplicate session ids in one batch")
        if caption_emb is not None and caption_emb.shape[0] != len(requests):
            raise SessionError(f"{len(requests)} requests but {caption_emb.shape[0]} caption embeddings")


def _caption(emb: torch.Tensor | None, mask: torch.Tensor | None, i: int):
    return (None if emb is None else emb[i], None if mask is None else mask[i])


# ---------------------------------------------------------------------- the verifier's works (ciar.engine.core)
class OpenWork(Work):
    """An open: prefill chunks, then `prefix_len` tokens sampled one decode step at a time (a cloud-only image is
    an open with prefix_len = N)."""

    REPEATABLE = True  # the same OPEN sent again is answered as this one was (a resume replaces its session instead)

    def __init__(self, v: CloudVerifier, request: OpenRequest, caption_emb=None, caption_mask=None, owner: str = ""):
        super().__init__(request.session_id)
        self.v, self.request, self.owner = v, request, owner
        self.caption_emb, self.caption_mask = caption_emb, caption_mask
        self.leader: OpenWork | None = None  # a repeated OPEN waits for the first one (then finishes with it)
        self.followers: list[OpenWork] = []  # repeated OPENs waiting for this one
        self.abandoned = False  # its caller went away while repeated OPENs still wait for it
        self.encode_s = 0.0  # its share of the caption encoding (CloudVerifier._start)
        c = v.config
        if v.text is None and caption_emb is None:
            raise SessionError("this verifier has no text encoder: pass caption embeddings")
        if not 0 <= request.prefix_len <= c.block_size:
            raise SessionError(f"prefix_len must be in [0, {c.block_size}], got {request.prefix_len}")
        request.sampling.validate()
        self.s: Session | None = None
        self.cond: torch.Tensor | None = None  # [rows, cls, dim] embedded condition
        self.cond_pos = 0  # condition positions fed

    @property
    def slots(self) -> list[int]:
        return self.s.slots

    @property
    def rows(self) -> int:
        return len(self.s.slots)

    def admit(self) -> None:
        held = self.v.table.sessions.get(self.session_id)
        if held is not None and self.REPEATABLE:
            self.repeat(held)
            return
        self.s = self.v.table.open(self.request)
        self.s.work = self
        self.s.owner = self.owner
        self.s.open_request = self.request if self.REPEATABLE else None

    def repeat(self, held: Session) -> None:
        """An OPEN of a session this verifier holds: the same device's same OPEN (its reply was lost) is answered as
        the first was; anything else is a conflict."""
        sid = self.session_id
        if held.owner != self.owner or held.open_request != self.request:
            raise SessionConflictError(f"session {sid!r} is already open with another request")
        first = held.work
        if isinstance(first, OpenWork) and first.REPEATABLE and not first.done:
            self.leader = first  # the first OPEN is still building the session: finish with it
            first.followers.append(self)
        elif held.open_reply is not None:
            held.last_used = time.monotonic()
            self.finish(held.open_reply)
        else:
            raise SessionConflictError(f"session {sid!r} is already open and has moved on since its OPEN: RESUME it "
                                       "from its history")

    def pending(self) -> int:
        if self.leader is not None:
            return 0  # a repeated OPEN feeds nothing
        cls = self.v.config.cls_token_num
        return cls - self.cond_pos if self.cond_pos < cls else 1

    def position(self) -> int:
        cls = self.v.config.cls_token_num
        return self.cond_pos if self.cond_pos < cls else cls + len(self.s.tokens) - 1

    def abandon(self) -> None:
        """Its caller went away: a repeated OPEN stops waiting; a first OPEN that nobody else waits for fails and
        frees the session it was building."""
        if self.leader is not None:
            leader = self.leader
            if self in leader.followers:
                leader.followers.remove(self)
            self.finish(error=SessionError(f"session {self.session_id!r}: the caller went away"))
            if leader.abandoned and not leader.followers:
                leader.abandon()
        elif self.followers:
            self.abandoned = True
        else:
            self.finish(error=SessionError(f"session {self.session_id!r}: the caller went away"))

    def finish(self, result=None, error: BaseException | None = None) -> None:
        if error is not None and not self.done and self.s is not None and self.s.live:
            self.drop_session = True  # a half-built session is of no use: the verifier frees its slots
        was_done = self.done
        super().finish(result, error)
        if not was_done:
            followers, self.followers = self.followers, []
            for f in followers:  # repeated OPENs answer what the first answered
                f.finish(result, error)

    def kind(self) -> int:
        return PREFILL if self.cond_pos < self.v.config.cls_token_num else DECODE

    def piece(self, n: int) -> Piece:
        cls = self.v.config.cls_token_num
        if self.cond_pos < cls:  # a prefill chunk
            return Piece(self.slots, self.cond_pos, n, emb=self.cond[:, self.cond_pos:self.cond_pos + n],
                         want=[n - 1] if self.cond_pos + n == cls else [])
        return Piece(self.slots, cls + len(self.s.tokens) - 1, 1, tokens=[self.s.tokens[-1]], want=[0])

    def take(self, piece: Piece, out) -> None:
        if piece.emb is not None:
            self.cond_pos += piece.n
            if self.cond_pos < self.v.config.cls_token_num:
                return
            self.cond = None
            if self.request.prefix_len == 0:  # the first image token's logits are kept for the first verification
                self.s.first_logits = out.logits[:, 0].clone()
                self.complete()
                return
        self.draw_from = out  # the step's decisions draw the next prefix token from it (`drawn`)

    def draw(self) -> Draw:
        """The prefix token to draw at image position len(tokens), from the cloud's stream."""
        return Draw(self.draw_from, self.s.sampling, self.s.seed, len(self.s.tokens))

    def drawn(self, token: int, stop: bool) -> None:
        self.draw_from = None
        self.s.tokens.append(token)
        if len(self.s.tokens) >= self.request.prefix_len:
            self.complete()

    def reply_tokens(self) -> list[int]:
        return self.s.tokens

    def kv_state(self):
        s = self.s
        if s is None or self.leader is not None or not s.live:
            return None
        cls = self.v.config.cls_token_num
        return s.slots, self.cond_pos if self.cond_pos < cls else cls + max(len(s.tokens) - 1, 0)

    def complete(self) -> None:
        self.s.work = None
        self.s.last_used = time.monotonic()
        r = self.request
        tokens = self.reply_tokens()
        emb, mask = self.caption_emb, self.caption_mask
        self.cost = (self.seconds, self.passes, False, None)  # the verifier's estimates read it (observe_costs)
        # the wait before its first forward, less its caption's encoding (in cloud_s)
        started = self.started if self.started is not None else time.perf_counter()
        queue_s = max(0.0, started - self.created - self.encode_s)
        self.finish(OpenReply(
            r.session_id, torch.tensor(tokens, dtype=torch.long),
            # what the device conditions on: the caption embeddings, or a Chameleon prompt's embeddings (never its
            # ids as float16, which would round ids above 2048)
            device_caption(self.v.cloud, emb).detach().to("cpu", torch.float16) if r.want_caption else None,
            (mask.detach().cpu() if mask is not None else torch.ones(emb.shape[0], dtype=torch.bool))
            if r.want_caption else None, self.seconds, self.passes, self.v.vocab_size, queue_s))
        if self.REPEATABLE:
            self.s.open_reply = self.result  # until the session moves on: a repeated OPEN is answered with it


class ResumeWork(OpenWork):
    """A resume: prefill chunks, then the history's committed tokens (all but the last) fed in chunks with their
    injected interval features; nothing is sampled."""

    REPEATABLE = False

    def __init__(self, v: CloudVerifier, request: OpenRequest, history, injected: InjectedFeatures | None,
                 caption_emb=None, caption_mask=None, owner: str = ""):
        c = v.config
        h = torch.as_tensor(history)
        if h.dim() != 1 or (h.numel() and h.is_floating_point()):
            raise SessionError(f"session {request.session_id!r}: history must be a 1-D tensor of token ids")
        if h.numel() > c.block_size:
            raise SessionError(f"session {request.session_id!r}: history of {h.numel()} tokens exceeds the "
                               f"{c.block_size} image tokens")
        if h.numel() and (int(h.min()) < 0 or int(h.max()) >= v.vocab_size):
            raise SessionError(f"token ids must be in [0, {v.vocab_size})")
        if injected is not None:
            n = int(injected.positions.numel())
            check_projector_inputs(v, injected.device_hidden, injected.features, n,
                                   f"session {request.session_id!r}: injected", required=True)
            if n and (int(injected.positions.min()) < 0 or int(injected.positions.max()) >= h.numel() - 1):
                raise SessionError(f"session {request.session_id!r}: injected positions must index history[:-1]")
        super().__init__(v, replace(request, prefix_len=0), caption_emb, caption_mask, owner)
        self.history = h.long().tolist()
        self.injected = injected
        self.extras: dict[int, torch.Tensor] = {}
        self.fed = 0  # history tokens fed

    def admit(self) -> None:
        super().admit()  # (the verifier closed a stale copy of the same session first: `admit_works`)
        self.s.tokens = list(self.history)
        inj = self.injected
        if self.v.projector is not None and inj is not None and inj.positions.numel():
            add = self.v.projector(inj.device_hidden.to(self.v.device), inj.features.to(self.v.device))
            self.extras = {int(p): add[i] for i, p in enumerate(inj.positions.tolist())}

    def kind(self) -> int:
        return PREFILL if self.cond_pos < self.v.config.cls_token_num else HISTORY

    def reply_tokens(self) -> list[int]:
        return []  # a resume generates nothing

    def pending(self) -> int:
        if self.cond_pos < self.v.config.cls_token_num:
            return super().pending()
        return len(self.history) - 1 - self.fed

    def position(self) -> int:
        cls = self.v.config.cls_token_num
        return self.cond_pos if self.cond_pos < cls else cls + self.fed

    def piece(self, n: int) -> Piece:
        if self.cond_pos < self.v.config.cls_token_num:
            return super().piece(n)
        a = self.fed
        return Piece(self.slots, self.v.config.cls_token_num + a, n, tokens=self.history[a:a + n],
                     extra=[(i - a, self.extras[i]) for i in range(a, a + n) if i in self.extras])

    def kv_state(self):
        s = self.s
        if s is None or not s.live:
            return None
        cls = self.v.config.cls_token_num
        return s.slots, self.cond_pos if self.cond_pos < cls else cls + self.fed

    def take(self, piece: Piece, out) -> None:
        if piece.emb is not None:
            self.cond_pos += piece.n
            if self.cond_pos < self.v.config.cls_token_num:
                return
            self.cond = None
            if not self.history:
                self.s.first_logits = out.logits[:, 0].clone()
        else:
            self.fed += piece.n
        if self.fed >= len(self.history) - 1:
            self.complete()


def check_projector_inputs(v: "CloudVerifier", hidden, features, rows: int, what: str,
                           required: bool = False) -> None:
    """Interval features sent to the verifier: both arrays (or, unless `required`, neither), one row per token, the
    projector's widths (a malformed pair is refused with a SessionError before any session state changes)."""
    if (hidden is None) != (features is None):
        raise SessionError(f"{what}: device_hidden and features go together (one without the other)")
    if hidden is None:
        if required:
            raise SessionError(f"{what}: device_hidden and features are missing")
        return
    if hidden.dim() != 2 or features.dim() != 2 or hidden.shape[0] != rows or features.shape[0] != rows:
        raise SessionError(f"{what}: device_hidden and features need one row per token ({rows}), got "
                           f"{tuple(hidden.shape)} and {tuple(features.shape)}")
    if v.projector is not None:
        c = v.projector.config
        if hidden.shape[1] != c.device_dim or features.shape[1] != c.feature_dim:
            raise SessionError(f"{what}: device_hidden must be [{rows}, {c.device_dim}] and features "
                               f"[{rows}, {c.feature_dim}], got {tuple(hidden.shape)} and {tuple(features.shape)}")


class VerifyWork(Work):
    """A verification: its feed (committed-but-unfed token, new tokens, drafts) in one piece or chunks, one judge
    (batched with the step's other spans), then cloud-burst tokens one decode step at a time."""

    def __init__(self, v: CloudVerifier, r: VerifyRequest):
        super().__init__(r.session_id)
        r = verify_tensors(r)
        self.v, self.request = v, r
        k, m = int(r.draft_tokens.numel()), int(r.new_tokens.numel())
        if r.draft_probs.shape[0] != k or (k and r.draft_probs.shape[-1] != v.vocab_size):
            raise SessionError(f"draft_probs must be [{k}, {v.vocab_size}], got {tuple(r.draft_probs.shape)}")
        if isinstance(r.burst, bool) or not isinstance(r.burst, int) or r.burst < 0:
            raise SessionError(f"burst must be an integer >= 0, got {r.burst!r}")
        if not 0.0 <= float(r.burst_entropy) <= 1.0:
            raise SessionError(f"burst_entropy must be in [0, 1], got {r.burst_entropy!r}")
        for t in (r.new_tokens, r.draft_tokens):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= v.vocab_size):
                raise SessionError(f"token ids must be in [0, {v.vocab_size})")
        if m or r.device_hidden is not None or r.features is not None:
            check_projector_inputs(v, r.device_hidden, r.features, m, f"session {r.session_id!r}")
        self.k, self.m = k, m
        self.s: Session | None = None
        self.phase = "feed"  # feed -> judge -> (burst) -> done
        self.got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # targets fed in earlier pieces, by index
        self.targets = None  # a PieceOutput: where all targets are when one piece fed them (the usual case)
        self.burst_tokens: list[int] = []
        self.outcome: tuple[int, int, bool, int] | None = None

    @property
    def slots(self) -> list[int]:
        return self.s.slots

    @property
    def rows(self) -> int:
        return len(self.s.slots)

    def check_state(self) -> Session:
        s = self.v.table.get(self.session_id)
        if s.work is not None:
            raise SessionError(f"session {self.session_id!r} has a request in flight")
        if len(s.tokens) + self.m + self.k > self.v.config.block_size:
            raise SessionError(f"session {self.session_id!r}: {len(s.tokens)} committed + {self.m} new + {self.k} "
                               f"drafts exceeds the {self.v.config.block_size} image tokens")
        return s

    def admit(self) -> None:
        s = self.s = self.check_state()
        s.work = self
        s.open_reply = None  # the session moves on: its OPEN is no longer repeatable
        r, v = self.request, self.v
        self.start = max(len(s.tokens) - 1, 0)  # image index of the feed's first token
        self.feed = s.tokens[self.start:] + r.new_tokens.tolist() + r.draft_tokens.tolist()
        self.c_new = len(s.tokens) + self.m
        first = self.c_new - 1 - self.start  # target j sits at the output after feed entry first + j
        self.want = [first + j for j in range(self.k + 1)]
        self.extras: dict[int, torch.Tensor] = {}
        if v.projector is not None and r.device_hidden is not None and self.m:
            add = v.projector(r.device_hidden.to(v.device), r.features.to(v.device))  # [m, dim]
            off = len(s.tokens) - self.start  # new tokens follow the committed-but-unfed ones
            self.extras = {off + i: add[i] for i in range(self.m)}
        self.fed = 0
        if not self.feed:
            self.phase = "judge"

    def kind(self) -> int:
        return DECODE if self.phase == "burst" else SPAN

    def pending(self) -> int:
        if self.phase == "burst":
            return 1
        return len(self.feed) - self.fed if self.phase == "feed" else 0

    def position(self) -> int:
        cls = self.v.config.cls_token_num
        return cls + len(self.s.tokens) - 1 if self.phase == "burst" else cls + self.start + self.fed

    def piece(self, n: int) -> Piece:
        cls = self.v.config.cls_token_num
        if self.phase == "burst":
            return Piece(self.slots, cls + len(self.s.tokens) - 1, 1, tokens=[self.s.tokens[-1]], want=[0])
        a = self.fed
        return Piece(self.slots, cls + self.start + a, n, tokens=self.feed[a:a + n],
                     extra=[(i - a, self.extras[i]) for i in range(a, a + n) if i in self.extras],
                     want=[i - a for i in self.want if a <= i < a + n])

    def kv_state(self):
        s = self.s
        if s is None or not s.live:
            return None
        return s.slots, self.v.config.cls_token_num + max(len(s.tokens) - 1, 0)

    def take(self, piece: Piece, out) -> None:
        if self.phase == "burst":
            self.draw_from = out  # the step's decisions draw the burst token from it (`drawn`)
            return
        if len(piece.want) == len(self.want):  # every target in this piece (the usual case): where they are
            self.targets = out
        elif piece.want:
            logits, hidden = out.logits, out.hidden
            for j, i in enumerate(piece.want):
                self.got[piece.start - self.v.config.cls_token_num - self.start + i] = (logits[:, j], hidden[j])
        self.fed += piece.n
        if self.fed >= len(self.feed):
            self.phase = "judge"

    def fault(self, error: BaseException) -> None:
        """Its forward failed. Before its verdict the session is as before the request (its tokens and cache lengths
        are only set by `commit`): the verify fails with the retryable `error` and may be sent again as it is. After
        the verdict (a burst step failed) the session has moved past what the device knows: it is closed, and the
        device resumes it from its history (`SessionLostError`), as after a lost replica."""
        if self.outcome is None:
            self.finish(error=error)
            return
        self.drop_session = True  # the verifier closes it when this work leaves the engine
        lost = SessionLostError(f"session {self.session_id!r} was dropped: a cloud burst step failed after its "
                                f"verdict ({error}); resume it from its history", self.session_id)
        lost.origin = error  # (not chained as __cause__: the transports unwrap causes and must find this one)
        self.finish(error=lost)

    def target_logits(self):
        """The distributions the drafts and the next token are judged by: the piece's outputs when one piece held
        them all (`PieceOutput`), else [rows, k+1, V] gathered from the pieces that fed them."""
        if self.targets is not None:
            return self.targets
        return torch.stack([self.s.first_logits if i < 0 else self.got[i][0] for i in self.want], dim=1)

    def target_hidden(self) -> torch.Tensor | None:
        if self.targets is not None:
            return self.targets.hidden
        if any(i < 0 for i in self.want):
            return None
        return torch.stack([self.got[i][1] for i in self.want])

    def span(self) -> Span:
        """What the step's judge needs: the targets, the drafts as sent, the session's sampling and rule, and the
        first draft's image position (the committed count after the catch-up)."""
        s, r = self.s, self.request
        return Span(self.target_logits(), r.draft_tokens, r.draft_probs, s.sampling, s.rule, s.seed, self.c_new,
                    self.target_hidden() if s.rule.rule == "cascade" else None)

    def draw(self) -> Draw:
        """The burst token to draw at image position len(tokens), with the request's entropy stop."""
        return Draw(self.draw_from, self.s.sampling, self.s.seed, len(self.s.tokens),
                    float(self.request.burst_entropy))

    def commit(self, n: int, z: int, recovered: bool, judged: int) -> None:
        """Apply the judge's verdict (n drafts kept, next token z); burst on after a rejection, else reply."""
        s, r, c = self.s, self.request, self.v.config
        s.tokens.extend(r.new_tokens.tolist() + r.draft_tokens[:n].tolist() + [z])
        s.first_logits = None
        self.got, self.targets = {}, None
        self.outcome = (n, z, recovered, judged)
        if recovered and r.burst > 0 and len(s.tokens) < c.block_size:
            self.phase = "burst"
        else:
            self.complete()

    def drawn(self, token: int, stop: bool) -> None:
        """Cloud burst: after a rejection the session's cloud samples up to `burst` more tokens itself, stopping
        early when its next distribution's normalised entropy falls to `burst_entropy` or below (`stop`: the device
        can take over there; that step's forward is spent) or at the last image token. Each token is drawn at its
        image position from the cloud's stream (`ciar.engine.judge`), as a prefix token there would be."""
        s, r, c = self.s, self.request, self.v.config
        self.draw_from = None
        if stop:
            self.complete()
            return
        s.tokens.append(token)
        self.burst_tokens.append(token)
        if len(self.burst_tokens) >= r.burst or len(s.tokens) >= c.block_size:
            self.complete()

    def complete(self) -> None:
        self.s.work = None
        self.s.last_used = time.monotonic()
        n, z, rec, judged = self.outcome
        b = self.burst_tokens
        queue_s = max(0.0, (self.started if self.started is not None else time.perf_counter()) - self.created)
        self.cost = (self.seconds, max(self.passes, 1), True, queue_s)  # read by the verifier (observe_costs)
        self.finish(VerifyReply(self.session_id, n, z, rec, self.seconds, judged, forward_passes=max(self.passes, 1),
                                burst_tokens=torch.tensor(b, dtype=torch.long) if b else None,
                                vocab_size=self.v.vocab_size, queue_s=queue_s))


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
