"""Verifier deployment: the cloud model, one KV-cache slot pair per live session, spans of many sessions per forward.

Thin over `ciar.engine.verifier.CloudVerifier` and its step engine (`ciar.engine.core`): every call queues a
work and awaits it; one loop runs the engine a forward at a time, each forward holding whatever is ready (spans,
cloud-only and burst tokens, prefill chunks, resumed histories) of every session on this replica.
  open(request, session_id=, device_id=)            -> (OpenReply, session token)   prefill + prefix tokens
  verify(request, session_id=, device_id=, token=)  -> VerifyReply                  catch-up + span (+ burst)
  resume(request, history, injected, session_id=, ...) -> OpenReply                 re-create a lost session
  close(session_id=, device_id=, token=)
  stats()                                           -> sessions, slots, forwards, batch-size histogram

Affinity: every call is made through `handle.options(session_id=...)`, and Ray's consistent-hash router (strict:
no fallback replica; `services.routing` fixes a defect of it) sends it to the replica holding that session's cache;
the `session_id=` keyword is checked against the request and the session token. A replica that lost the session
(restart, idle eviction, re-routing after a replica died) answers `SessionLostError`, and the device re-sends its
history (`resume`).

Ownership: the session token (`ciar.engine.service.session_token`: key id, binding, HMAC) lets any replica of the pool check
that a call comes from the device that opened the session, without shared state; another device (or a device
without the token) gets a SessionTokenError (403 on the socket). The calls themselves (tokens, an OPEN repeated after a lost reply answered
as the first, the works of callers that went away withdrawn) are `ciar.engine.service.VerifierService`.

The engine steps on its own thread (`ciar.engine.core.EngineThread`, the one owner of the engine, the sessions
and the cache: no lock; a step's size is bounded by the token budget, and what arrives meanwhile joins the next
step); the replica's event loop only submits and awaits, so control calls (close, stats, cost_hint, ready) are
answered while a forward runs. With `verifier_engine_process` the engine core runs in a process of its own
instead (`ciar.engine.process.EngineProcess`: it loads the world and owns the accelerator; this replica passes the
calls to it and takes its metrics from its step reports), so that the engine's host work does not share this
process's interpreter lock. Works per step,
the token budget and the wait for company when the engine is idle are live settings (`user_config` ->
`reconfigure`). The works of every forward are recorded (Prometheus histogram `ciar_verifier_batch_size` and
`stats()`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import psutil
import ray
import torch
from ray import serve

from ciar.collab.protocol import InjectedFeatures, OpenReply, OpenRequest, VerifyReply, VerifyRequest
from ciar.engine import heap
from ciar.engine.process import CoreSpec, EngineProcess, build_verifier, step_counts
from ciar.engine.service import VerifierService
from services.config import VerifierLiveConfig
from services.verifier_client import fast_tensors

logger = logging.getLogger("ray.serve")  # the replica's log


class Verifier:
    def __init__(self, world: dict | str | None, max_sessions: int | str, secret: str, live: dict | None = None,
                 threads: int = 1, memory_utilization: float = 0.9, cuda_graphs: bool = True,
                 fused_step: bool = False, overlap: bool = False, packed_step: bool = False,
                 engine_process: bool = False, compiled_judge: bool = False):
        """`world`: the served world (`ciar.world_spec`; the builder passes it validated, as a dict); the GPT, the
        caption encoder (MiniLM, or the LlamaGen world's T5 on the replica's GPU) and the projector load here, or,
        with `engine_process`, in the engine's own process (`ciar.engine.process`), which then owns the
        accelerator while this replica only passes calls to it."""
        torch.set_num_threads(threads)
        fast_tensors()  # (its replies' tensors)
        self.live = VerifierLiveConfig(**(live or {}))
        spec = CoreSpec(world=world, max_sessions=max_sessions, threads=threads,
                        memory_utilization=memory_utilization, cuda_graphs=cuda_graphs, fused_step=fused_step,
                        overlap=overlap, packed_step=packed_step, compiled_judge=compiled_judge,
                        scheduler=self.live.scheduler(),
                        idle_timeout_s=self.live.idle_timeout_s, slot_wait_s=self.live.slot_wait_s,
                        capture_rows=2 * self.live.max_batch_size)
        self._steps_seen = 0
        # the calls (ownership, repeated OPENs, withdrawn works): the same code serves the endpoint's socket tests
        if engine_process:
            self.service = EngineProcess(spec, secret, self.live.batch_wait_timeout_s, self._count)
            self.vocab_size = self.service.vocab_size
            logger.info("engine core in process %d", self.service.proc.pid)
        else:
            core = build_verifier(spec, log=logger.info)
            self.service = VerifierService(core, secret, self.live.batch_wait_timeout_s, self._on_step)
            self.vocab_size = core.vocab_size
        self.batch_hist: Counter[int] = Counter()  # works per forward -> forwards
        self.spans_verified = 0
        self._evictor: asyncio.Task | None = None
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (unit use)
            self.replica_id = "local"
        else:  # a replica's process serves (`ciar.engine.heap`):
            heap.freeze(log=logger.info)  # its start-up out of the collector's reach
            heap.keep_freed_memory(log=logger.info)  # the steps' host tensors reuse the blocks freed before them
        self._metrics()

    def _metrics(self) -> None:
        from ray.serve import metrics

        self.m_batch = metrics.Histogram("ciar_verifier_batch_size", description="works (spans, decode steps, prefill chunks) per cloud forward",
                                         boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.m_spans = metrics.Counter("ciar_verifier_spans_total", description="spans verified")
        self.m_sessions = metrics.Gauge("ciar_verifier_sessions", description="open sessions (KV-cache slots)")
        self.m_resumes = metrics.Counter("ciar_verifier_resumes_total", description="sessions re-created")

    def reconfigure(self, config: dict) -> None:
        self.live = VerifierLiveConfig(**(config or {}))  # raises a ValidationError naming the field
        # applied on the engine's side between steps, like every change to what it owns
        self.service.configure(self.live.scheduler(), self.live.idle_timeout_s, self.live.slot_wait_s,
                               self.live.batch_wait_timeout_s)

    # ------------------------------------------------------------------ housekeeping
    def _ensure_evictor(self) -> None:
        if self._evictor is None or self._evictor.done():
            self._evictor = asyncio.get_running_loop().create_task(self._evict_loop())

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, min(10.0, self.live.idle_timeout_s / 4)))
            self.service.evict_idle(self.live.idle_timeout_s)
            self.m_sessions.set(self.service.num_sessions)

    # ------------------------------------------------------------------ the step loop
    def _on_step(self, engine, finished) -> None:
        """After each step of the engine thread (on it)."""
        size = engine.step_log[-1]["works"] if engine.step_log and engine.steps != self._steps_seen else 0
        self._steps_seen = engine.steps
        self._count(size, step_counts(finished))

    def _count(self, size: int, spans: int, seconds: float = 0.0) -> None:
        """A step's works (0: it ran no forward) and the verifications it answered (after each step of the engine,
        on its thread, or on the reader thread of its process)."""
        if size:
            self.batch_hist[size] += 1
            self.m_batch.observe(size)
        if spans:
            self.spans_verified += spans
            self.m_spans.inc(spans)

    # ------------------------------------------------------------------ API (called through handles)
    async def open(self, request: OpenRequest, *, session_id: str, device_id: str) -> tuple[OpenReply, str]:
        self._ensure_evictor()
        out = await self.service.open(request, session_id=session_id, device_id=device_id)
        self.m_sessions.set(self.service.num_sessions)
        return out

    async def verify(self, request: VerifyRequest, *, session_id: str, device_id: str, token: str) -> VerifyReply:
        return await self.service.verify(request, session_id=session_id, device_id=device_id, token=token)

    async def resume(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None = None, *,
                     session_id: str, device_id: str, token: str) -> OpenReply:
        self._ensure_evictor()
        reply = await self.service.resume(request, history, injected, session_id=session_id, device_id=device_id,
                                          token=token)
        self.m_resumes.inc()
        self.m_sessions.set(self.service.num_sessions)
        return reply

    async def close(self, *, session_id: str, device_id: str, token: str) -> None:
        await self.service.close(session_id=session_id, device_id=device_id, token=token)
        self.m_sessions.set(self.service.num_sessions)

    async def cost_hint(self):
        """This replica's recent span forward, sampled step and queue wait (`CloudVerifier.cost_hint`): where a
        device's adaptive policy starts before its first image."""
        return await self.service.cost_hint()

    def check_health(self) -> None:
        """Serve's periodic health check: unhealthy when the engine's current forward has run past
        `forward_timeout_s` (a hung kernel), so that Serve replaces the replica; a failed forward is not unhealthy
        (its works got a retryable error and the engine went on: `ciar.engine.core.StepEngine._execute`)."""
        self.service.check_stalled(self.live.forward_timeout_s)

    async def ready(self) -> dict:
        """Answers once this replica can take work: the ingress's readiness (`/healthz`) asks it."""
        return {"replica_id": self.replica_id, **await self.service.ready()}

    async def stats(self) -> dict:
        return {"replica_id": self.replica_id, **await self.service.stats(), "spans_verified": self.spans_verified,
                "batch_size_hist": {str(k): v for k, v in sorted(self.batch_hist.items())},
                "live": self.live.model_dump(), "rss_mb": psutil.Process().memory_info().rss / 2**20,
                "engine_process": getattr(self.service, "proc", None) and self.service.proc.pid,
                "node_id": ray.get_runtime_context().get_node_id(), "time": time.time()}

    def __del__(self):  # the replica going away: stop the engine (its thread, or its process)
        service = getattr(self, "service", None)
        if service is not None:
            service.shutdown()
