"""The ingress's rule for a simulated phone lost under a job (services.app: `device_lost`, `retried`,
`device_backoff_s`): only the death of the Device replica itself is retried, never an error its method raised.
The retry itself runs for real in tests/services/test_multinode.py (a device node removed under load)."""

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, RayTaskError  # noqa: E402

from services.app import DEVICE_ATTEMPTS, device_backoff_s, device_lost, retried  # noqa: E402
from services.schemas import GenerationJob  # noqa: E402


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
    job = GenerationJob(session_id="abc", prompt="a red circle", seed=7, method="ciar", network="4g")
    again = [retried(job, a) for a in range(1, DEVICE_ATTEMPTS)]
    assert len({j.session_id for j in again} | {job.session_id}) == DEVICE_ATTEMPTS
    for j in again:
        assert j.model_dump(exclude={"session_id"}) == job.model_dump(exclude={"session_id"})


def test_the_backoff_doubles_and_is_capped():
    waits = [device_backoff_s(a) for a in range(DEVICE_ATTEMPTS - 1)]
    assert waits == sorted(waits) and waits[0] > 0 and device_backoff_s(100) == max(waits)
