"""What a client is answered when serving it fails: one table from an error to a status, read by the HTTP API
(`services.app`: a generation's failure -> an ErrorResponse, its OpenAPI contract) and by the device socket
(`services.device_endpoint`: a verifier call's failure -> an ERROR frame).

    rule = answer(exc, side="http")                     # or side="socket", frame=VERIFY
    rule.status, rule.kind, rule.field, rule.retry      # 503, "overloaded", None, True (Retry-After)

An error is matched by its class (or a base class) name, on the exception raised and on the replica-side exception
behind it (Ray keeps it as `.cause`: `root_cause`), the table's rows in order, the first that holds for the side
wins. Where both sides can meet an error they answer the same status (`tests/services/test_errors.py` checks every
row); a row for one side only is an error the other cannot meet (a socket's session token; a generation's
deadline). A socket's VERIFY whose effect is unknown (its call timed out, or its replica was lost) is answered
`verify_status` (410: resume the session, then send it again) where other frames, safe to send again as they are,
are answered 503 (docs/architecture.md §5, "Retry semantics").
"""

from __future__ import annotations

from dataclasses import dataclass

HTTP, SOCKET = "http", "socket"
BOTH = (HTTP, SOCKET)
REPLICA_LOST = ("ActorDiedError", "ActorUnavailableError", "RayActorError")  # Ray: the replica is gone


@dataclass(frozen=True)
class Rule:
    """One row: errors named `names` (classes or base classes) -> `status`, `kind` (the HTTP body's error.type),
    `field` (the request field at fault), `retry` (Retry-After), the side(s) it answers for, and when it happens
    (the OpenAPI contract's words). `message`: the answer's text ({cause}: the error's own text, {sid}: the
    session, {timeout}: the request's deadline, {name}: the error's class); `top`: match the raised exception only,
    not the cause behind it."""

    names: tuple[str, ...]
    status: int
    kind: str
    when: str
    field: str | None = None
    retry: bool = False
    sides: tuple[str, ...] = BOTH
    message: str = "{cause}"
    http_message: str | None = None  # the HTTP side's text where it says more than the socket's
    verify_status: int | None = None  # a socket VERIFY's status instead (its effect unknown)
    verify_message: str | None = None
    top: bool = False

    def text(self, side: str, verify: bool = False, **values) -> str:
        template = self.verify_message if verify and self.verify_message else \
            self.http_message if side == HTTP and self.http_message else self.message
        return template.format(**values)


RULES: tuple[Rule, ...] = (
    Rule(("JobKillsDevicesError",), 500, "killed_devices", "the job's simulated phones died under it twice: the "
         "likely cause is the request itself, which is not run again", sides=(HTTP,), top=True),
    Rule(("SessionTokenError",), 403, "forbidden", "a frame carries another session's token", field="token",
         sides=(SOCKET,), message="invalid session token for this session"),
    Rule(("SessionConflictError",), 409, "conflict", "an OPEN of a session held with another request",
         field="session_id", sides=(SOCKET,)),
    Rule(REPLICA_LOST, 503, "unavailable", "the verifier replica holding the session was lost", retry=True,
         sides=(SOCKET,), message="the verifier replica holding this session was lost: send it again",
         verify_status=410, verify_message="session {sid!r} is not held by the verifier: resume it from its history",
         top=True),
    Rule(("SessionLostError",), 410, "session_lost", "the verifier does not hold the session", sides=(SOCKET,),
         message="session {sid!r} is not held by the verifier: resume it from its history"),
    Rule(("CaptionTooLongError",), 422, "invalid_request", "a prompt over the caption encoder's token budget",
         field="prompt"),
    Rule(("UncalibratedError",), 422, "invalid_request", "a gate with no calibrated threshold and no params.tau",
         field="params.tau", sides=(HTTP,)),
    Rule(("BackPressureError",), 503, "overloaded", "every device busy and the queue full", retry=True,
         message="no free verifier capacity: retry later",
         http_message="all simulated devices are busy and the queue is full; retry later"),
    Rule(("ForwardFault",), 503, "overloaded", "a cloud forward failed (out of memory): nothing is kept of it",
         retry=True, http_message="a cloud forward failed ({cause}); nothing is kept of it: retry later"),
    Rule(("CapacityError",), 503, "overloaded", "no free verifier KV-cache slot", retry=True,
         message="no free verifier capacity: retry later",
         http_message="the verifier pool has no free KV-cache slot; retry later"),
    Rule(("CloudTimeoutError",), 503, "unavailable", "a call to the verifier past verifier_call_timeout_s or the "
         "request's deadline", retry=True, message="{cause}: send it again",
         http_message="the cloud is unreachable before the image could start: {cause}", verify_status=410,
         verify_message="{cause}: the session's state is unknown; resume it from its history"),
    Rule(("CloudUnreachableError",), 503, "unavailable", "the cloud unreachable before the image could start",
         retry=True, message="{cause}: send it again",
         http_message="the cloud is unreachable before the image could start: {cause}"),
    Rule(("SessionError", "ValueError"), 400, "invalid_request", "a frame the verifier refuses", sides=(SOCKET,)),
    Rule(("TimeoutError",), 504, "timeout", "the generation did not finish within request_timeout_s (the "
         "deadline every call to the verifier keeps too): nothing is kept of it", retry=True, sides=(HTTP,),
         message="generation did not finish within {timeout:g} s (request_timeout_s); nothing is kept of it: retry "
                 "after Retry-After seconds", top=True),
)
INTERNAL = Rule((), 500, "internal", "internal error (logged)", message="internal error ({name})",
                http_message="generation failed: {name}")


def root_cause(exc: BaseException) -> BaseException:
    """The replica-side exception behind a Ray error (Ray wraps it and keeps it as `.cause`)."""
    seen = exc
    for _ in range(4):
        nxt = getattr(seen, "cause", None) or seen.__cause__
        if nxt is None or nxt is seen:
            break
        seen = nxt
    return seen


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def replica_lost(exc: BaseException) -> bool:
    """True for errors meaning the verifier replica is gone (died / unreachable), not a bad request: the
    REPLICA_LOST row's names, on the raised exception."""
    return bool(_names(exc).intersection(REPLICA_LOST))


def answer(exc: BaseException, side: str) -> Rule:
    """The first row for `side` whose names the raised exception (or, unless the row is `top`, the cause behind it)
    carries; INTERNAL when none does."""
    top, cause = _names(exc), _names(root_cause(exc))
    for rule in RULES:
        if side in rule.sides and (top if rule.top else top | cause).intersection(rule.names):
            return rule
    return INTERNAL


def described(status: int, side: str = HTTP) -> str:
    """The contract's words for `status` on `side`: each row's kind and when it happens."""
    return "; ".join(f"{r.kind}: {r.when}" for r in RULES + (INTERNAL,) if r.status == status and side in r.sides)
