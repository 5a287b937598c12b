"""Verifier deployment: the cloud model, one KV-cache slot pair per live session, spans of many sessions per forward.

Thin over `ciar.collab.verifier.CloudVerifier`:
  open(request, session_id=, device_id=)            -> (OpenReply, session token)   batched (serve.batch)
  verify(request, session_id=, device_id=, token=)  -> VerifyReply                  batched: ONE forward per batch
  resume(request, history, injected, session_id=, ...) -> OpenReply                 re-create a lost session
  close(session_id=, device_id=, token=)
  stats()                                           -> sessions, slots, batch-size histogram of this replica

Affinity: every call carries `session_id=` as a keyword argument, which `services.routing.SessionAffinityRouter`
hashes to the replica holding that session's cache. A replica that lost the session (restart, idle eviction,
re-routing after a replica died) answers `SessionLostError`, and the device re-sends its history (`resume`).

Ownership: the session token is HMAC(app secret, session id | device id), so any replica of the pool can check
that a call comes from the device that opened the session, without shared state; another device (or a device
without the token) gets a PermissionError.

Batching runs on the replica's event loop (one batch at a time, so the cache needs no lock); the batch size and
the wait for more spans are live settings (`user_config` -> `reconfigure`). The verify batch size of every
forward is recorded (Prometheus histogram `ciar_verifier_batch_size` and `stats()`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import Counter

import psutil
import torch
from ray import serve

from ciar.collab.protocol import InjectedFeatures, OpenReply, OpenRequest, VerifyReply, VerifyRequest
from ciar.collab.verifier import CloudVerifier, SessionError
from ciar.world import load_world
from services.schemas import VerifierLiveConfig


def session_token(secret: str, session_id: str, device_id: str) -> str:
    return hmac.new(secret.encode(), f"{session_id}|{device_id}".encode(), hashlib.sha256).hexdigest()


class Verifier:
    def __init__(self, world: dict | str | None, max_sessions: int, secret: str, live: dict | None = None,
                 threads: int = 1):
        """`world`: the served world (`ciar.world_spec`; the builder passes it validated, as a dict); the GPT, the
        caption encoder (MiniLM, or the LlamaGen world's T5 on the replica's GPU) and the projector load here."""
        torch.set_num_threads(threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        world = load_world(world, device=device)
        self.live = VerifierLiveConfig(**(live or {}))
        self.core = CloudVerifier(world.cloud, world.text, max_sessions=max_sessions, projector=world.projector,
                                  codebook=world.codebook, idle_timeout_s=self.live.idle_timeout_s)
        self.vocab_size = self.core.vocab_size
        self._secret = secret
        self.batch_hist: Counter[int] = Counter()  # verify batch size -> forwards
        self.spans_verified = 0
        self.opened = self.resumed = 0
        self._evictor: asyncio.Task | None = None
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (unit use)
            self.replica_id = "local"
        self._metrics()

    def _metrics(self) -> None:
        from ray.serve import metrics

        self.m_batch = metrics.Histogram("ciar_verifier_batch_size", description="spans verified per cloud forward",
                                         boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.m_spans = metrics.Counter("ciar_verifier_spans_total", description="spans verified")
        self.m_sessions = metrics.Gauge("ciar_verifier_sessions", description="open sessions (KV-cache slots)")
        self.m_resumes = metrics.Counter("ciar_verifier_resumes_total", description="sessions re-created")

    def reconfigure(self, config: dict) -> None:
        self.live = VerifierLiveConfig(**(config or {}))  # raises a ValidationError naming the field
        self._verify_many.set_max_batch_size(self.live.max_batch_size)
        self._verify_many.set_batch_wait_timeout_s(self.live.batch_wait_timeout_s)
        self._open_many.set_max_batch_size(self.live.max_batch_size)
        self._open_many.set_batch_wait_timeout_s(self.live.batch_wait_timeout_s)
        self.core.idle_timeout_s = self.live.idle_timeout_s

    # ------------------------------------------------------------------ housekeeping
    def _ensure_evictor(self) -> None:
        if self._evictor is None or self._evictor.done():
            self._evictor = asyncio.get_running_loop().create_task(self._evict_loop())

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, min(10.0, self.live.idle_timeout_s / 4)))
            self.core.evict_idle(self.live.idle_timeout_s)
            self.m_sessions.set(self.core.num_sessions)

    def _check(self, session_id: str, device_id: str, token: str) -> None:
        if not hmac.compare_digest(session_token(self._secret, session_id, device_id), token or ""):
            raise PermissionError(f"session {session_id!r} belongs to another device (bad session token)")

    @staticmethod
    def _raise(out):
        if isinstance(out, BaseException):
            raise out
        return out

    # ------------------------------------------------------------------ batched work
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _open_many(self, requests: list[OpenRequest]) -> list:
        return _per_item(self.core.open_batch, requests)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _verify_many(self, requests: list[VerifyRequest]) -> list:
        out = _per_item(self.core.verify_batch, requests)
        done = [r for r in out if isinstance(r, VerifyReply)]
        if done:
            size = done[0].batch_size
            self.batch_hist[size] += 1
            self.spans_verified += len(done)
            self.m_batch.observe(size)
            self.m_spans.inc(len(done))
        return out

    # ------------------------------------------------------------------ API (called through handles)
    async def open(self, request: OpenRequest, *, session_id: str, device_id: str) -> tuple[OpenReply, str]:
        self._ensure_evictor()
        if request.session_id != session_id:
            raise SessionError("session_id keyword and request.session_id differ")
        reply = self._raise(await self._open_many(request))
        self.opened += 1
        self.m_sessions.set(self.core.num_sessions)
        return reply, session_token(self._secret, session_id, device_id)

    async def verify(self, request: VerifyRequest, *, session_id: str, device_id: str, token: str) -> VerifyReply:
        self._check(session_id, device_id, token)
        if request.session_id != session_id:
            raise SessionError("session_id keyword and request.session_id differ")
        return self._raise(await self._verify_many(request))

    async def resume(self, request: OpenRequest, history: torch.Tensor, injected: InjectedFeatures | None = None, *,
                     session_id: str, device_id: str, token: str) -> OpenReply:
        self._ensure_evictor()
        self._check(session_id, device_id, token)
        if request.session_id != session_id:
            raise SessionError("session_id keyword and request.session_id differ")
        reply = self.core.resume_batch([request], [history], injected=[injected])[0]
        self.resumed += 1
        self.m_resumes.inc()
        self.m_sessions.set(self.core.num_sessions)
        return reply

    async def close(self, *, session_id: str, device_id: str, token: str) -> None:
        self._check(session_id, device_id, token)
        self.core.close(session_id)
        self.m_sessions.set(self.core.num_sessions)

    async def stats(self) -> dict:
        return {"replica_id": self.replica_id, "sessions": self.core.num_sessions,
                "free_slots": self.core.free_slot_count, "spans_verified": self.spans_verified,
                "opened": self.opened, "resumed": self.resumed,
                "batch_size_hist": {str(k): v for k, v in sorted(self.batch_hist.items())},
                "live": self.live.model_dump(), "rss_mb": psutil.Process().memory_info().rss / 2**20,
                "time": time.time()}


def _per_item(fn, requests: list) -> list:
    """Run `fn(requests)` as one batch; if the batch is refused (a client error in one item, raised before any state
    changes), run the items one by one so that only the bad ones fail. -> replies or exceptions, in order."""
    try:
        return fn(requests)
    except (SessionError, ValueError, RuntimeError) as e:
        if len(requests) == 1:
            return [e]
    return [_exc(fn, r) for r in requests]


def _exc(fn, request):
    try:
        return fn([request])[0]
    except Exception as e:  # noqa: BLE001 - handed back to the caller of this item
        return e
