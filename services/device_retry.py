"""The ingress's rule for a simulated phone lost under a job, one module for the plain and the streamed path.

    phones = LostPhones(on_lost=lambda: errors.inc(tags={"kind": "device_lost"}))   # one per ingress replica
    tries = phones.attempts(job)
    while True:
        try:
            out = await device.generate.remote(tries.current)
        except Exception as e:
            await tries.lost(e)        # re-raises what is not a lost phone, or the last try; else waits, next try
            continue
        tries.stamp(out.stats)         # stats["device_retries"]
        return out

A phone (a Device replica) holds nothing a request cannot remake: the image is a function of the request and its
seed, so a job whose phone died runs again from its start on a live one, under a new session id. Only the death of
the replica itself is retried (Ray's actor errors), never an error its method raised. A job under which a second
phone's own process died is given up (`JobKillsDevicesError`: the likely cause is the request itself); phones lost
with their node, killed by `ray.kill`, or found dead by a call routed to them before Serve noticed are not counted.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict

from services.schemas import GenerationJob

logger = logging.getLogger("ray.serve")

# tries of one image when its simulated phone is lost under it (`JobAttempts`), waiting 0.5, 1, 2, 4 s between
# (Serve's routers learn of the dead replicas meanwhile; with none left, the call waits for a new one): a lost node
# may take several phones at once, and a retry may be routed to another of them before Serve has noticed
DEVICE_ATTEMPTS = 5
DEVICE_RETRY_BACKOFF_S = 0.5
# phones whose own process died under one job before it is given up (500, JobKillsDevicesError): a phone dies under a
# job now and then (and the job deserves another); a second that dies under the same job points at the job itself
# (an input that exhausts a device's memory), which would otherwise take DEVICE_ATTEMPTS phones with it
JOB_DEVICE_DEATHS = 2
# Ray's death cause of an actor whose worker process died (on a live node); a lost node's reads "its node has died",
# and a phone lost with its node is never blamed on the job (the call found it gone, or its node went under it)
WORKER_DIED = "its worker process has died"
DEAD_PHONES_KEPT = 1024  # the dead phones an ingress remembers (`LostPhones`)


def device_backoff_s(attempt: int) -> float:
    return DEVICE_RETRY_BACKOFF_S * 2 ** min(attempt, 3)


def device_lost(e: BaseException) -> bool:
    """The Device replica itself is gone (its worker process or its node died: the actor errors a handle raises),
    as opposed to an error raised by the device's method, which Ray wraps in RayTaskError (a subclass of both)."""
    from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError

    return isinstance(e, (RayActorError, NodeDiedError, WorkerCrashedError)) and not isinstance(e, RayTaskError)


def process_died(e: BaseException) -> bool:
    """The lost phone's own worker process died (Ray's death cause says so), its node alive: the kind of death a job
    can cause. Not a lost node, a phone killed by `ray.kill`, nor one Ray could not yet say why it is unreachable."""
    from ray.exceptions import ActorDiedError

    return device_lost(e) and isinstance(e, ActorDiedError) and WORKER_DIED in str(e)


def _death_detail(e: BaseException) -> str:
    """What a phone's death cause says, short: its pid and the first sentence of Ray's worker exit detail."""
    text = str(e)
    pid = re.search(r"\bpid: (\d+)", text)
    said = text.split(WORKER_DIED, 1)[-1].strip(" .\n").split(". ")[0]
    return f"{'pid ' + pid.group(1) + ': ' if pid else ''}{WORKER_DIED}: {said}"[:240]


class JobKillsDevicesError(RuntimeError):
    """The simulated phones of one job died under it JOB_DEVICE_DEATHS times: most likely the job kills them."""


def retried(job: GenerationJob, attempt: int) -> GenerationJob:
    """The job again under a session id of its own (the lost attempt's verifier session may still be open)."""
    return job.model_copy(update={"session_id": f"{job.session_id}-r{attempt}"})


class LostPhones:
    """What one ingress knows of the phones lost under its jobs: the ones it saw die (the latest DEAD_PHONES_KEPT
    Ray actor ids: a call routed to one of them before the router learnt of its death finds it dead, which that
    job is not to blame for), and `on_lost()`, called for every loss (a metric)."""

    def __init__(self, on_lost=None):
        self.dead: OrderedDict[str, None] = OrderedDict()
        self.on_lost = on_lost or (lambda: None)

    def attempts(self, job: GenerationJob) -> "JobAttempts":
        return JobAttempts(self, job)


class JobAttempts:
    """One job's tries on simulated phones (module docstring): `current` is the job to send now, `lost(e)` decides
    after a try failed with `e`, `stamp(stats)` records the retries in the answer's stats."""

    def __init__(self, phones: LostPhones, job: GenerationJob):
        self.phones, self.job = phones, job
        self.attempt = 0
        self.deaths: list[str] = []  # what each phone whose own process died under this job died of

    @property
    def current(self) -> GenerationJob:
        return self.job if self.attempt == 0 else retried(self.job, self.attempt)

    async def lost(self, e: BaseException) -> None:
        """After a failed try: re-raise `e` when it is not a lost phone or this was the last try; raise
        JobKillsDevicesError when it was the JOB_DEVICE_DEATHS-th phone whose own process died under the job;
        else wait the backoff and move on to the next try."""
        if not device_lost(e) or self.attempt + 1 == DEVICE_ATTEMPTS:
            raise e
        self.count(e)
        await asyncio.sleep(device_backoff_s(self.attempt))
        self.attempt += 1

    def count(self, e: BaseException) -> None:
        """A lost phone (`device_lost(e)`) counted against the job when its own process died and no earlier job saw
        it dead; JobKillsDevicesError at the JOB_DEVICE_DEATHS-th such death."""
        self.phones.on_lost()
        job, dead = self.job, self.phones.dead
        phone = getattr(e, "actor_id", None)
        if process_died(e) and (phone is None or phone not in dead):
            self.deaths.append(_death_detail(e))
        if phone is not None:
            dead[phone] = None
            while len(dead) > DEAD_PHONES_KEPT:
                dead.popitem(last=False)
        if len(self.deaths) >= JOB_DEVICE_DEATHS:
            logger.error("job %s: %d simulated devices died under it (%s); the job itself is the likely cause: not "
                         "run again", job.session_id, len(self.deaths), "; ".join(self.deaths))
            raise JobKillsDevicesError(
                f"the job killed {len(self.deaths)} simulated devices: each one's process died while it ran the job "
                f"({'; '.join(self.deaths)}); the likely cause is the request itself (e.g. an input that exhausts "
                "a device's memory), so it is not run again") from e
        logger.warning("job %s: its simulated device was lost (%s); running it again on another (attempt %d of %d)",
                       job.session_id, type(e).__name__, self.attempt + 2, DEVICE_ATTEMPTS)

    def stamp(self, stats: dict) -> None:
        if self.attempt:
            stats["device_retries"] = self.attempt
