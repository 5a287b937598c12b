"""The verifier as a service: the calls every transport makes, with ownership, awaited on an event loop.

    service = VerifierService(CloudVerifier(world.cloud, world.text, max_sessions=64), secret)
    reply, token = await service.open(request, session_id=sid, device_id=dev)     # prefill + prefix tokens
    reply = await service.verify(request, session_id=sid, device_id=dev, token=token)
    reply = await service.resume(request, history, injected, session_id=sid, device_id=dev, token=token)
    await service.close(session_id=sid, device_id=dev, token=token)

The Verifier deployment (`services.verifier`) serves these calls to the cluster's devices and to the device endpoint
through Ray handles; `services.testing.InProcessBackend` serves them to the endpoint in one process (socket tests,
fuzz runs), so both run this code. Every call queues a work on the verifier's step engine and awaits it; the engine
steps on its own thread (`ciar.engine.core.EngineThread`), so a close, a cost hint or a readiness probe is
answered while a forward runs.

Ownership. The session token binds a session to the device that opened it: any replica holding the application's
secret checks it without shared state. VERIFY, RESUME and CLOSE need it (SessionTokenError otherwise). It carries
the id of the secret that made it, so that a secret's rotation does not fail the devices' images: `session_token`.

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

import functools
import hashlib
import hmac

from ciar.engine import heap
from ciar.engine.core import AsyncStepper, EngineThread
from ciar.collab.protocol import SessionError, SessionLostError, SessionTokenError

TOKEN_BYTES = 32  # the wire's token32 (`ciar_device.wire.TOKEN_BYTES`): devices keep a token as opaque bytes


def key_id(secret: str) -> bytes:
    """The 4-byte id of a session secret (the first bytes of every token it makes). Public: it says which secret made
    a token, nothing that helps forge one (a token's MAC already lets a weak secret be guessed offline)."""
    return hashlib.sha256(b"ciar-session-key|" + secret.encode()).digest()[:4]


def _binding(kid: bytes, session_id: str, device_id: str) -> bytes:
    return hashlib.sha256(b"ciar-session-bind|" + kid + f"{session_id}|{device_id}".encode()).digest()[:4]


@functools.lru_cache(maxsize=1 << 16)  # (checked on every VERIFY of a session: its HMAC made once, not ~4 us a call)
def session_token(secret: str, session_id: str, device_id: str) -> str:
    """The token the verifier issues at OPEN and checks on every later call (hex, 32 bytes on the wire):

        key id (4 bytes)   which secret made it: `key_id(secret)`
        binding (4 bytes)  SHA-256(key id | session | device)[:4]: no secret; says the token was made for this
                           session and device (a random, zeroed or another session's token fails it)
        MAC (24 bytes)     HMAC-SHA256(secret, key id | session | device)[:24]: the proof; 192 bits

    Why a key id (issue 40, item 5, "the RESUME 403"): the secret can change under a device. Without
    $CIAR_SESSION_SECRET, `services.config` derives it from the API keys and the world, so a redeploy that changes the
    keys changes it (an operator rotating $CIAR_SESSION_SECRET does too); Serve replaces the Verifier replicas (new
    init args), their sessions are gone, and a device resumes on a new replica with the token the old secret made.
    An HMAC alone cannot tell that token from a forgery, and the 403 failed the device's image. With the key id a
    replica tells "made by my secret" (checked: a wrong MAC is a forgery, 403) from "made by another secret for
    this very session and device" (not checkable here; `VerifierService.check` says what happens then)."""
    kid = key_id(secret)
    mac = hmac.new(secret.encode(), kid + f"{session_id}|{device_id}".encode(), hashlib.sha256).digest()
    return (kid + _binding(kid, session_id, device_id) + mac[:TOKEN_BYTES - 8]).hex()


def _token_bytes(token: str) -> bytes | None:
    try:
        raw = bytes.fromhex(token or "")
    except ValueError:
        return None
    return raw if len(raw) == TOKEN_BYTES else None


class EngineStalledError(RuntimeError):
    """A step of the engine has run past its limit: the replica is unhealthy."""


class VerifierService:
    def __init__(self, core, secret: str, batch_wait_s: float = 0.0, on_step=None, engine_thread: bool = True,
                 stepper=None):
        """`core`: a `ciar.engine.verifier.CloudVerifier`; `secret`: signs session tokens; `batch_wait_s`: an idle
        engine waits this long for company; `on_step(engine, finished)`: called after every step (metrics; on the
        engine's thread). `engine_thread`: the engine steps on its own thread (`ciar.engine.core.EngineThread`),
        and the caller's event loop only submits and awaits; False: it steps on the caller's loop
        (`AsyncStepper`, the engine before issue 37: every call waits for the forward in progress). `stepper`: a
        driver made by the caller instead (the engine's own process: `ciar.engine.process`)."""
        self.core = core
        self.secret = secret
        self.key_id = key_id(secret)
        self._adopted: dict[str, tuple[str, object]] = {}  # session id -> (another secret's token, its Session)
        if stepper is None:
            stepper = EngineThread(core.engine, batch_wait_s, on_step) if engine_thread else \
                AsyncStepper(core.engine, batch_wait_s, on_step)
        self.stepper = stepper
        self.opened = self.resumed = 0

    @property
    def num_sessions(self) -> int:
        return self.core.num_sessions

    def configure(self, scheduler=None, idle_timeout_s: float | None = None, slot_wait_s: float | None = None,
                  batch_wait_s: float | None = None) -> None:
        """Live settings, applied on the engine's side between steps like every change to what it owns:
        `scheduler` (a `SchedulerConfig`: works a step, token budget), the sessions' idle timeout, how long an
        open waits for a slot, and how long an idle engine waits for company. None: left as it is."""
        if scheduler is not None:
            self.stepper.call(setattr, self.core.engine, "config", scheduler)
        if idle_timeout_s is not None:
            self.stepper.call(setattr, self.core.table, "idle_timeout_s", idle_timeout_s)
        if slot_wait_s is not None:
            self.stepper.call(setattr, self.core, "slot_wait_s", slot_wait_s)
        if batch_wait_s is not None:
            self.stepper.wait_s = batch_wait_s

    async def stats(self) -> dict:
        """The engine's counters (`CloudVerifier.stats`), the calls served, how long the step running now has run,
        and the collector of the process the engine steps in (`ciar.engine.heap`)."""
        return {**self.core.stats(), "opened": self.opened, "resumed": self.resumed,
                "step_running_s": self.stepper.stalled_s(), "heap": heap.stats()}

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

    def _mine(self, session_id: str, device_id: str, token: str) -> bool:
        """True: a valid token of this secret. False: a token another secret made for this session and device (its
        key id is not ours, its binding is right). SessionTokenError otherwise: a forged token with our key id, a
        random or malformed one, another session's or another device's."""
        raw = _token_bytes(token)
        if raw is not None and raw[:4] == self.key_id:
            if hmac.compare_digest(bytes.fromhex(session_token(self.secret, session_id, device_id)), raw):
                return True
        elif raw is not None and hmac.compare_digest(_binding(raw[:4], session_id, device_id), raw[4:8]):
            return False
        raise SessionTokenError(f"session {session_id!r} belongs to another device (bad session token)")

    def _held_by(self, session_id: str, token: str) -> bool:
        """Whether this verifier holds the session that a RESUME with `token` (another secret's) re-created."""
        entry = self._adopted.get(session_id)
        if entry is None:
            return False
        if self.core.table.sessions.get(session_id) is not entry[1]:  # closed, evicted or replaced since
            self._adopted.pop(session_id, None)
            return False
        return hmac.compare_digest(entry[0], token)

    def _adopt(self, session_id: str, token: str) -> None:
        s = self.core.table.sessions.get(session_id)
        if s is not None:
            self._adopted[session_id] = (token, s)
        if len(self._adopted) > 2 * self.core.table.max_sessions:  # forget the sessions gone since
            for sid, (_, held) in list(self._adopted.items()):
                if self.core.table.sessions.get(sid) is not held:
                    del self._adopted[sid]

    def check(self, session_id: str, device_id: str, token: str) -> None:
        """A VERIFY's or CLOSE's token. This secret's: checked (SessionTokenError, 403 on the socket, when wrong).
        Another secret's, made for this session and device (a rotated secret: the device opened the session before
        a redeploy): this verifier cannot check it, so it acts as if it did not hold the session
        (SessionLostError, 410: the device resumes), unless a RESUME with that very token re-created the session
        here (`resume`), which then goes on under it.

        Why a RESUME with a token this verifier cannot check is accepted (and a VERIFY is not, before it): a RESUME
        re-creates the session from the caller's own committed history, replacing whatever copy was held, so
        accepting it gives the caller nothing but its own session back; what keeps one device off another's
        sessions is the device endpoint, which scopes every session id by the authenticated device id
        (`<device>/<session>`), so a device can only name its own sessions whatever token it sends; the other
        callers (the simulated phones, `services.device`, through the Verifier's handle) are the application's own
        code. The binding still refuses a random, zeroed or another session's token (403), as before. The other
        design, a fresh token in the RESUME's reply, needs every client (Python, browser, phones, load tests) to
        store it; with adoption no client changes and the wire stays as it is: a device keeps the token it has, and
        each new verifier it resumes on adopts it (one RESUME per move, which a new replica costs anyway: it does
        not hold the session)."""
        if not self._mine(session_id, device_id, token) and not self._held_by(session_id, token):
            raise SessionLostError(f"session {session_id!r} is not held under this session token (it was issued "
                                   "under another session secret): resume it from its history", session_id)

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
        return await self.stepper.run(self.verify_work(request, session_id=session_id, device_id=device_id,
                                                       token=token))

    def verify_work(self, request, *, session_id: str, device_id: str, token: str):
        """A VERIFY's work, its token and session checked, not queued (`verify` runs it; the engine's process
        queues it with a callback instead: `ciar.engine.process`)."""
        self.check(session_id, device_id, token)
        self._same(request, session_id)
        return self.core.verify_work(request)

    async def resume(self, request, history, injected=None, *, session_id: str, device_id: str, token: str):
        """A token of another secret (for this session and device) is accepted and adopted: `check` says why."""
        mine = self._mine(session_id, device_id, token)
        self._same(request, session_id)
        reply = await self.stepper.run(self.core.resume_work(request, history, injected, owner=device_id))
        if not mine:
            self._adopt(session_id, token)
        self.resumed += 1
        return reply

    async def close(self, *, session_id: str, device_id: str, token: str) -> None:
        """Answered at once: the session is closed before the engine's next step, after anything sent before it.
        With another secret's token for a session this verifier did not re-create under it: nothing held under
        that token, nothing to close (a copy this verifier holds otherwise is left to its idle timeout)."""
        try:
            self.check(session_id, device_id, token)
        except SessionLostError:
            return
        self._adopted.pop(session_id, None)
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
