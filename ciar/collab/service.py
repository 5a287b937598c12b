"""The verifier as a service: the calls every transport makes, with ownership, awaited on an event loop.

    service = VerifierService(CloudVerifier(world.cloud, world.text, max_sessions=64), secret)
    reply, token = await service.open(request, session_id=sid, device_id=dev)     # prefill + prefix tokens
    reply = await service.verify(request, session_id=sid, device_id=dev, token=token)
    reply = await service.resume(request, history, injected, session_id=sid, device_id=dev, token=token)
    await service.close(session_id=sid, device_id=dev, token=token)

The Verifier deployment (`services.verifier`) serves these calls to the cluster's devices and to the device endpoint
through Ray handles; `services.testing.InProcessBackend` serves them to the endpoint in one process (socket tests,
fuzz runs), so both run this code. Every call queues a work on the verifier's step engine and awaits it; the engine
steps on its own thread (`ciar.collab.engine.EngineThread`), so a close, a cost hint or a readiness probe is
answered while a forward runs.

Ownership. The session token is HMAC(secret, session id | device id): any replica can check that a call comes from the
device that opened the session, without shared state. VERIFY, RESUME and CLOSE need it (SessionTokenError otherwise).

Retries (docs/architecture.md §5, "Retry semantics"). Each call is safe to send again after its reply was lost:
  open    answered as the first was: an OPEN of a session this verifier holds, from the device that opened it, with
          the same request, gets the first OPEN's reply (the very reply: the same prefix tokens and caption, no
          forward), or waits for the first OPEN still in flight; the same id with another request, or a session that
          has moved on since its open (a VERIFY or RESUME came), is refused (`SessionConflictError`, 409 on the
          socket).
  verify  not idempotent by itself; a device whose VERIFY reply was lost RESUMEs first, then re-sends it.
  resume  replaces any copy the verifier holds: sending it twice leaves the same state.
  close   closing a session that is not held does nothing.
A call whose caller went away (a cancelled handle call, a cut socket) withdraws its work: a queued work is dropped
before it runs; an OPEN or RESUME that is building its session fails and frees its slots (a later OPEN starts over);
a VERIFY already admitted runs to the end (the device RESUMEs before it sends again).
"""

from __future__ import annotations

import hashlib
import hmac

from ciar.collab.engine import AsyncStepper, EngineThread
from ciar.collab.protocol import SessionError, SessionTokenError


def session_token(secret: str, session_id: str, device_id: str) -> str:
    """The token the verifier issues at OPEN and checks on every later call: binds a session to its device."""
    return hmac.new(secret.encode(), f"{session_id}|{device_id}".encode(), hashlib.sha256).hexdigest()


class EngineStalledError(RuntimeError):
    """A step of the engine has run past its limit: the replica is unhealthy."""


class VerifierService:
    def __init__(self, core, secret: str, batch_wait_s: float = 0.0, on_step=None, engine_thread: bool = True):
        """`core`: a `ciar.collab.verifier.CloudVerifier`; `secret`: signs session tokens; `batch_wait_s`: an idle
        engine waits this long for company; `on_step(engine, finished)`: called after every step (metrics; on the
        engine's thread). `engine_thread`: the engine steps on its own thread (`ciar.collab.engine.EngineThread`),
        and the caller's event loop only submits and awaits; False: it steps on the caller's loop
        (`AsyncStepper`, the engine before issue 37: every call waits for the forward in progress)."""
        self.core = core
        self.secret = secret
        self.stepper = EngineThread(core.engine, batch_wait_s, on_step) if engine_thread else \
            AsyncStepper(core.engine, batch_wait_s, on_step)
        self.opened = self.resumed = 0

    def check_stalled(self, limit_s: float) -> None:
        """Raise `EngineStalledError` when the engine's current step has run longer than `limit_s` (a forward that
        hangs): the Verifier's `check_health` calls it, so that Serve replaces the replica. Its works' callers give
        up at their own deadlines meanwhile and resume their sessions elsewhere."""
        stalled = self.stepper.stalled_s()
        if stalled > limit_s:
            raise EngineStalledError(f"the verifier's forward has run for {stalled:.0f} s (limit {limit_s:g} s, "
                                     f"forward_timeout_s): the engine is stuck")

    def shutdown(self) -> None:
        """Stop the engine's thread (a replica going away, a test done with it)."""
        self.stepper.stop()

    @property
    def v(self):
        """The CloudVerifier (tests read its sessions)."""
        return self.core

    def check(self, session_id: str, device_id: str, token: str) -> None:
        if not hmac.compare_digest(session_token(self.secret, session_id, device_id), token or ""):
            raise SessionTokenError(f"session {session_id!r} belongs to another device (bad session token)")

    @staticmethod
    def _same(request, session_id: str) -> None:
        if request.session_id != session_id:
            raise SessionError("session_id keyword and request.session_id differ")

    async def open(self, request, *, session_id: str, device_id: str):
        """-> (OpenReply, session token). An OPEN repeated after a lost reply is answered as the first was."""
        self._same(request, session_id)
        reply = await self.stepper.run(self.core.open_work(request, owner=device_id))
        self.opened += 1
        return reply, session_token(self.secret, session_id, device_id)

    async def verify(self, request, *, session_id: str, device_id: str, token: str):
        self.check(session_id, device_id, token)
        self._same(request, session_id)
        return await self.stepper.run(self.core.verify_work(request))

    async def resume(self, request, history, injected=None, *, session_id: str, device_id: str, token: str):
        self.check(session_id, device_id, token)
        self._same(request, session_id)
        reply = await self.stepper.run(self.core.resume_work(request, history, injected, owner=device_id))
        self.resumed += 1
        return reply

    async def close(self, *, session_id: str, device_id: str, token: str) -> None:
        """Answered at once: the session is closed before the engine's next step, after anything sent before it."""
        self.check(session_id, device_id, token)
        self.stepper.call(self.core.close, session_id)

    def evict_idle(self, max_idle_s: float) -> None:
        """Close the sessions idle for at least `max_idle_s` (on the engine's side, like every change)."""
        self.stepper.call(self.core.evict_idle, max_idle_s)

    async def cost_hint(self):
        """The verifier's recent span forward, sampled step and queue wait (`CloudVerifier.cost_hint`)."""
        return self.core.cost_hint()

    async def ready(self) -> dict:
        """Answers as soon as this verifier can take work (readiness probes): its free slots."""
        return {"sessions": self.core.num_sessions, "free_slots": self.core.free_slot_count}
