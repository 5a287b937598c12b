"""One table from an error to a status (services.errors), read by the HTTP API and the device socket: both sides'
real error mappers, for every error type in the table."""

import json
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from ciar.collab.defaults import UncalibratedError
from ciar.collab.protocol import (CapacityError, CloudTimeoutError, CloudUnreachableError, ForwardFault,
                                  SessionConflictError, SessionError, SessionLostError, SessionTokenError)
from ciar.text import CaptionTooLongError
from ciar_device.wire import OPEN, VERIFY
from services import errors
from services.app import Ingress
from services.device_endpoint import DeviceEndpoint
from services.device_retry import JobKillsDevicesError


def _instances():
    """An error of every class the table names (and one it does not), as the services meet them."""
    return {
        "JobKillsDevicesError": JobKillsDevicesError("two phones died under this job"),
        "SessionTokenError": SessionTokenError("bad token"),
        "SessionConflictError": SessionConflictError("session 'd1/s' is already open with another request"),
        "ActorDiedError": ActorDiedError(), "ActorUnavailableError": ActorUnavailableError("gone", b"1" * 16),
        "RayActorError": RayActorError(),
        "SessionLostError": SessionLostError("unknown session 'd1/s'", "d1/s"),
        "CaptionTooLongError": CaptionTooLongError("the prompt has 130 tokens, over 120"),
        "UncalibratedError": UncalibratedError("no calibrated tau for gate entropy"),
        "BackPressureError": BackPressureError(num_queued_requests=9, max_queued_requests=8),
        "ForwardFault": ForwardFault("the cloud forward failed (OutOfMemoryError): send the request again"),
        "CapacityError": CapacityError("no free KV-cache slot"),
        "CloudTimeoutError": CloudTimeoutError("the verifier did not answer a verify within 60 s"),
        "CloudUnreachableError": CloudUnreachableError("no verifier replica answered"),
        "SessionError": SessionError("drafts must be token ids"), "ValueError": ValueError("bad frame"),
        "TimeoutError": TimeoutError(),
        "KeyError": KeyError("a bug"),
    }


class _Metrics:  # (a stand-in for the Ingress's Prometheus metrics: what it was told)
    def __init__(self):
        self.requests, self.errors = [], []

    def request(self, method, code):
        self.requests.append(code)

    def error(self, kind):
        self.errors.append(kind)


def _http(e):
    """The Ingress's own mapper (services.app), on a stand-in for the deployment's state."""
    ingress = SimpleNamespace(metrics=_Metrics(), timeout_s=600.0, retry_after_s=2)
    r = Ingress.func_or_class._failure(ingress, SimpleNamespace(method="ciar"), e)
    body = json.loads(r.body)["error"]
    return r.status_code, body, r.headers.get("retry-after"), ingress.metrics


def _socket(e, ftype):
    endpoint = DeviceEndpoint(backend=None, key_digests=[])
    f = endpoint._failure(e, "d1", "s", ftype)
    return f.status, f.field, f.retry_after_s, str(f)


def test_every_error_the_table_names_has_an_instance_here():
    named = {n for r in errors.RULES for n in r.names}
    assert named <= set(_instances()), named - set(_instances())


@pytest.mark.parametrize("name", sorted(_instances()))
def test_the_api_and_the_socket_answer_each_error_by_the_table(name):
    e = _instances()[name]
    status, body, retry_after, metrics = _http(e)
    rule = errors.answer(e, errors.HTTP)
    assert (status, body["type"], body["field"], retry_after is not None) == \
        (rule.status, rule.kind, rule.field, rule.retry)
    assert metrics.requests == [status] and metrics.errors == ([rule.kind] if status >= 500 else [])
    srule = errors.answer(e, errors.SOCKET)
    for ftype in (OPEN, VERIFY):
        sstatus, field, retry_s, message = _socket(e, ftype)
        unknown = ftype == VERIFY and srule.verify_status is not None  # a VERIFY whose effect is unknown: 410
        assert sstatus == (srule.verify_status if unknown else srule.status)
        assert field == (srule.field or "") and (retry_s > 0) == (srule.retry and not unknown)
        assert "d1/" not in message  # the device's own session id, never the scoped one
    if errors.HTTP in srule.sides and errors.SOCKET in rule.sides:  # an error both sides meet: the same answer
        assert srule is rule and status == _socket(e, OPEN)[0]


def test_a_row_for_both_sides_is_answered_alike_and_the_contract_lists_every_http_row():
    from services.openapi import GENERATION_RESPONSES

    both = [r for r in errors.RULES if set(r.sides) == set(errors.BOTH)]
    assert {n for r in both for n in r.names} >= {"ForwardFault", "CapacityError", "BackPressureError",
                                                  "CloudTimeoutError", "CaptionTooLongError"}
    for r in errors.RULES + (errors.INTERNAL,):
        if errors.HTTP in r.sides:
            assert f"{r.kind}: {r.when}" in GENERATION_RESPONSES[r.status]["description"], r


def test_the_replica_lost_rule_is_the_tables():
    """Both callers of the verifier (the simulated phones' retries, the socket's answers) decide "the replica is
    gone" by one rule (services.verifier_client.replica_lost: the table's REPLICA_LOST row)."""
    from services import verifier_client

    for name, e in _instances().items():
        assert verifier_client.replica_lost(e) == (name in errors.REPLICA_LOST), name
