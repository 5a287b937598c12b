"""services.verifier_client.RayCloudClient's deadlines, with a FAKE Verifier handle (unit tests of the client's own logic;
the real handle, router and replicas are exercised by tests/services/test_app.py, test_routing.py and
loadtests.coldstart): no call waits past its deadline or the request's, a call past it is cancelled (no late
execution on the verifier), and what the device loop sees is CloudTimeoutError (an unreachable cloud)."""

import time

import pytest

from ciar.collab.protocol import CloudTimeoutError, CloudUnreachableError


class FakeResponse:
    """A DeploymentResponse that answers after `delay_s` (never when None); records the timeout it was asked with
    and whether it was cancelled."""

    def __init__(self, value, delay_s):
        self.value, self.delay_s = value, delay_s
        self.cancelled, self.asked_timeout = False, None

    def result(self, timeout_s=None):
        self.asked_timeout = timeout_s
        if isinstance(self.value, BaseException):
            raise self.value
        if self.delay_s is None or (timeout_s is not None and self.delay_s > timeout_s):
            time.sleep(min(timeout_s or 0.0, 0.01))
            raise TimeoutError("Timed out resolving to ObjectRef.")
        return self.value

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """The Verifier deployment's handle, faked: each method answers what `answers[name]` says."""

    def __init__(self, **answers):
        self.answers, self.calls = answers, []

    def options(self, **kw):
        return self

    def __getattr__(self, name):
        handle = self

        class Method:
            def remote(self, *args, **kwargs):
                value, delay = handle.answers[name]
                resp = FakeResponse(value, delay)
                handle.calls.append((name, resp))
                return resp

        return Method()


def _client(handle, **kw):
    from services.verifier_client import RayCloudClient

    return RayCloudClient(handle, "dev-1", vocab_size=64, sleep=lambda s: None, **kw)


def _open_request(sid="s1"):
    from ciar.decoding.sampling import SamplingParams
    from ciar_device.wire import OpenRequest

    return OpenRequest(sid, "a red circle", 1, SamplingParams(), 2)


def test_an_open_past_the_call_timeout_is_cancelled_and_reported_unreachable():
    handle = FakeHandle(open=(None, None))  # never answers (no replica)
    client = _client(handle, call_timeout_s=0.5)
    with pytest.raises(CloudTimeoutError) as e:
        client.open(_open_request())
    assert isinstance(e.value, CloudUnreachableError)  # the ingress answers it 503 + Retry-After
    (name, resp), = handle.calls
    assert name == "open" and resp.cancelled and resp.asked_timeout == pytest.approx(0.5)
    assert "s1" not in client.tokens


def test_no_call_waits_past_the_requests_deadline():
    handle = FakeHandle(verify=(None, None), cost_hint=(None, None), close=(None, None))
    client = _client(handle, call_timeout_s=60.0)
    client.deadline = time.monotonic() + 0.3
    assert client.cost_hint() is None  # a hint is given up (5 s at most, here the deadline's 0.3 s)
    assert handle.calls[-1][1].asked_timeout <= 0.3 and handle.calls[-1][1].cancelled
    from ciar.collab.protocol import VerifyRequest

    with pytest.raises(CloudTimeoutError):
        client.verify(VerifyRequest("s1", None, None, None))
    assert handle.calls[-1][1].asked_timeout <= 0.3 and handle.calls[-1][1].cancelled
    client.deadline = time.monotonic() - 1.0  # past: nothing waits at all, and what was sent is cancelled ...
    with pytest.raises(CloudTimeoutError, match="deadline"):
        client.verify(VerifyRequest("s1", None, None, None))
    assert handle.calls[-1][1].cancelled and handle.calls[-1][1].asked_timeout is None
    client.close("s1")  # ... except the close, which frees the session's slots: up to 5 s, then given up quietly
    assert handle.calls[-1][1].asked_timeout == pytest.approx(5.0) and handle.calls[-1][1].cancelled


def test_replica_loss_retries_stop_at_the_deadline():
    from ray.exceptions import ActorDiedError

    handle = FakeHandle(open=(ActorDiedError(), 0.0))  # every replica it reaches is gone
    client = _client(handle)
    sleeps = []
    client.sleep = lambda s: (sleeps.append(s), time.sleep(s))
    client.deadline = time.monotonic() + 0.5
    with pytest.raises(CloudTimeoutError, match="deadline"):
        client.open(_open_request())
    assert 0 < sum(sleeps) <= 0.5  # it stopped retrying at the deadline instead of spending its ~70 s budget


def test_a_prompt_answer_is_returned_with_the_call_timeout_asked():
    handle = FakeHandle(cost_hint=("hint", 0.0))
    client = _client(handle, call_timeout_s=7.0)
    assert client.cost_hint() == "hint"
    assert handle.calls[0][1].asked_timeout == pytest.approx(5.0) and not handle.calls[0][1].cancelled
