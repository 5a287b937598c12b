"""The ingress's rule for a simulated phone lost under a job (`services.device_retry`: `device_lost`, `retried`,
`device_backoff_s`, `process_died`, `JobAttempts`): only the death of the Device replica itself is retried,
never an error its method raised; a job under which two phones' own processes died is given up. The retry itself runs
for real in tests/services/test_multinode.py (a device node removed under load) and test_device_deaths.py (a phone
killed under a job, a job that kills its phones)."""

import pytest

pytest.importorskip("ray")

from ray.core.generated.common_pb2 import ActorDiedErrorContext  # noqa: E402
from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, RayTaskError  # noqa: E402

from services.device_retry import (DEVICE_ATTEMPTS, JOB_DEVICE_DEATHS, JobKillsDevicesError,  # noqa: E402
                                  LostPhones, device_backoff_s, device_lost, process_died, retried)
from services.schemas import GenerationJob  # noqa: E402

JOB = GenerationJob(session_id="abc", prompt="a red circle", seed=7, method="ciar", network="4g")


def _died(phone: int, why: str) -> ActorDiedError:
    """What a handle raises for a phone (a Device replica's actor) that died of `why` (Ray's death causes)."""
    return ActorDiedError(ActorDiedErrorContext(error_message=why, actor_id=bytes([phone]) * 16, pid=1000 + phone,
                                                class_name="ServeReplica:ciar:Device"))


def _process(phone: int) -> ActorDiedError:
    return _died(phone, "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
                 "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file.")


def _node(phone: int) -> ActorDiedError:
    return _died(phone, "The actor died because its node has died. Node Id: 0123\n\tthe actor's node was "
                 "terminated unexpectedly: health check failed")


class _Ingress:
    """One ingress's lost phones, and a job's tries counted through them (`JobAttempts.count`, the decision
    `JobAttempts.lost` takes after its backoff check); `jobs` the tries of each job by a name."""

    def __init__(self):
        self.losses = 0
        self.phones = LostPhones(on_lost=self._counted)
        self.jobs: dict[str, object] = {}

    def _counted(self) -> None:
        self.losses += 1

    def lost(self, e: BaseException, job: str = "job", attempt: int = 0) -> list[str]:
        tries = self.jobs.setdefault(job, self.phones.attempts(JOB))
        tries.attempt = attempt
        tries.count(e)
        return tries.deaths


def _raised_in_a_method(exc: BaseException) -> BaseException:
    """What a handle raises when the replica's method raised `exc`: a RayTaskError that is also exc's class."""
    try:
        raise exc
    except type(exc) as e:
        return RayTaskError("generate", "Traceback: ...", e).as_instanceof_cause()


def test_a_dead_or_unreachable_replica_is_a_lost_device():
    assert device_lost(ActorDiedError())
    assert device_lost(ActorUnavailableError("the node is gone", b"\x00" * 16))
    assert device_lost(NodeDiedError("node lost"))


def test_errors_raised_by_the_devices_method_are_not_retried():
    assert not device_lost(ValueError("bad"))
    assert not device_lost(_raised_in_a_method(ValueError("bad")))
    # the device's own call to a dead verifier raised ActorDiedError inside generate: the phone lives, not a loss
    died_inside = _raised_in_a_method(ActorDiedError())
    assert isinstance(died_inside, ActorDiedError) and not device_lost(died_inside)


def test_a_retried_job_is_the_same_image_under_a_new_session_id():
    job = JOB
    again = [retried(job, a) for a in range(1, DEVICE_ATTEMPTS)]
    assert len({j.session_id for j in again} | {job.session_id}) == DEVICE_ATTEMPTS
    for j in again:
        assert j.model_dump(exclude={"session_id"}) == job.model_dump(exclude={"session_id"})


def test_the_backoff_doubles_and_is_capped():
    waits = [device_backoff_s(a) for a in range(DEVICE_ATTEMPTS - 1)]
    assert waits == sorted(waits) and waits[0] > 0 and device_backoff_s(100) == max(waits)


def test_only_a_phone_whose_own_process_died_counts_against_the_job():
    assert process_died(_process(1))
    for e in (_node(1), ActorDiedError(), ActorUnavailableError("the node is gone", b"\x00" * 16),
              NodeDiedError("node lost"), _died(1, "The actor is dead because it was killed by `ray.kill`.")):
        assert device_lost(e) and not process_died(e), e
    assert not process_died(_raised_in_a_method(_process(1)))  # the phone's call to a dead verifier


def test_one_phone_dying_under_a_job_runs_it_again():
    ingress = _Ingress()
    deaths = ingress.lost(_process(1))  # no error: the job runs again
    assert len(deaths) == 1 and "pid 1001" in deaths[0] and "worker process has died" in deaths[0]
    assert ingress.losses == 1


def test_a_job_is_given_up_when_the_second_phone_dies_under_it():
    ingress = _Ingress()
    ingress.lost(_process(1))
    with pytest.raises(JobKillsDevicesError) as caught:
        ingress.lost(_process(2), attempt=1)
    assert JOB_DEVICE_DEATHS == 2 < DEVICE_ATTEMPTS
    message = str(caught.value)
    assert "killed 2 simulated devices" in message and "likely cause is the request itself" in message
    assert "pid 1001" in message and "pid 1002" in message  # what each phone died of


def test_phones_lost_with_their_node_or_found_dead_are_not_blamed_on_the_job():
    """A lost node takes several phones: a retry may reach another of them before Serve has noticed. Neither that
    nor a phone another job saw die counts; the job keeps its DEVICE_ATTEMPTS tries."""
    ingress = _Ingress()
    ingress.lost(_node(1))
    ingress.lost(_node(2), attempt=1)
    assert ingress.lost(ActorUnavailableError("unreachable", bytes([3]) * 16), attempt=2) == []
    assert len(ingress.lost(_process(4), job="other")) == 1  # another job's phone
    assert ingress.lost(_process(4), attempt=3) == []  # routed to it after its death: not this job's doing
    assert ingress.losses == 5


def test_a_job_s_tries_re_raise_what_is_not_a_lost_phone_and_stamp_their_retries():
    import asyncio

    from services import device_retry

    tries = LostPhones().attempts(JOB)
    with pytest.raises(ValueError):
        asyncio.run(tries.lost(ValueError("the method raised")))
    assert tries.current is JOB and tries.attempt == 0
    waits = []

    async def no_wait(s):
        waits.append(s)

    real, device_retry.asyncio.sleep = device_retry.asyncio.sleep, no_wait
    try:
        asyncio.run(tries.lost(_node(1)))
    finally:
        device_retry.asyncio.sleep = real
    assert tries.attempt == 1 and tries.current.session_id == retried(JOB, 1).session_id and waits == [
        device_backoff_s(0)]
    stats = {}
    tries.stamp(stats)
    assert stats == {"device_retries": 1}
    tries.attempt = DEVICE_ATTEMPTS - 1  # the last try: a lost phone is raised
    with pytest.raises(type(_node(2))):
        asyncio.run(tries.lost(_node(2)))
