"""The one edge between the services and the verifier pool: both callers of the Verifier deployment, the simulated
phones (`RayCloudClient`, synchronous, from a Device's worker thread) and the device socket (`RayVerifierBackend`,
awaited on the Ingress's loop), route, bound and classify their calls here.

- Routing: every call of a session goes to the replica that holds it (`route`: `handle.options(session_id=...)`,
  Ray's consistent-hash router as `services.routing` fixes it); a cost hint goes to any replica.
- Deadlines: every call waits at most its limit; past it the call is cancelled on the verifier too (Serve cancels
  the replica's coroutine, which withdraws its work: `ciar.engine.service`) and `CloudTimeoutError` is raised
  (`result_within`, `within`).
- What a failure means: the replica is gone (`replica_lost`: the rule `services.errors.REPLICA_LOST` names), the
  verifier lost the session (`session_lost`), a forward failed and nothing was kept (`forward_fault`). The simulated
  phones retry a lost replica and a failed forward (`RayCloudClient._retry`) and resume a lost session
  (`ciar.sim.recovery.RecoveringClient`); a real device is told by its ERROR frame (`services.errors`), and
  retries as its frame's semantics say.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import torch

from ciar.collab.protocol import (CloudTimeoutError, CloudUnreachableError, ForwardFault, InjectedFeatures, OpenReply,
                                  OpenRequest, SessionLostError, VerifyReply, VerifyRequest)
from services.errors import replica_lost


_FAST_TENSORS = False


def fast_tensors() -> None:
    """This process's Ray calls carry CPU tensors as dtype, shape and bytes (`ciar.engine.codec`)
    instead of torch's pickle, whose storage protocol costs ~200 us to write and ~250 us to read a VERIFY's three
    small tensors, on the event loop of the replica that reads them. Called once per process by what sends tensors
    over handles: the Verifier replicas (replies), the simulated phones (`RayCloudClient`) and the device socket
    (`RayVerifierBackend`). A receiver needs nothing: the function that rebuilds a tensor travels with it by name."""
    global _FAST_TENSORS
    import ray

    if not _FAST_TENSORS and ray.is_initialized():  # (a client over a test double of the handle: nothing to do)
        from ciar.engine.codec import tensor_from_bytes, tensor_to_bytes

        ray.util.register_serializer(torch.Tensor, serializer=tensor_to_bytes, deserializer=tensor_from_bytes)
        _FAST_TENSORS = True


def route(handle, session_id: str):
    """The handle that reaches the replica holding `session_id`."""
    return handle.options(session_id=session_id)


def session_lost(exc: BaseException) -> bool:
    return isinstance(exc, SessionLostError) or isinstance(getattr(exc, "cause", None), SessionLostError)


def forward_fault(exc: BaseException) -> ForwardFault | None:
    """The verifier's `ForwardFault` behind `exc` (raised here, or the cause Ray keeps), else None."""
    for e in (exc, getattr(exc, "cause", None)):
        if isinstance(e, ForwardFault):
            return e
    return None


def result_within(response, limit_s: float, what: str):
    """A DeploymentResponse's result, waited for synchronously at most `limit_s` seconds; past it the call is
    cancelled and `CloudTimeoutError` naming `what` raised."""
    if limit_s <= 0:
        response.cancel()
        raise CloudTimeoutError("the request's deadline has passed (request_timeout_s)")
    try:
        return response.result(timeout_s=limit_s)
    except TimeoutError:  # (Ray's GetTimeoutError is one too)
        response.cancel()  # no late execution: the verifier withdraws the work
        raise CloudTimeoutError(f"the verifier did not answer {what} within {limit_s:.3g} s") from None


async def within(response, limit_s: float, what: str):
    """A DeploymentResponse's result within `limit_s` seconds. Past it, or when the awaiting task is cancelled (a cut
    socket), the call is cancelled on the verifier too (`DeploymentResponse.cancel`: the replica's coroutine is
    cancelled and withdraws its work); past it, `CloudTimeoutError` naming `what`."""
    async def result():
        return await response

    try:
        return await asyncio.wait_for(result(), limit_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise CloudTimeoutError(f"the verifier did not answer {what} within {limit_s:g} s") from None
    except asyncio.CancelledError:
        response.cancel()
        raise


class RayCloudClient:
    """`CloudClient` over the Verifier deployment handle. Synchronous: call it from a worker thread, not from the
    replica's event loop. Every call is routed by its session (`handle.options(session_id=...)`, Ray's consistent-hash
    router as `services.routing` fixes it) and carries `session_id=`, this device's id and the session token
    (ownership). A dead replica during verify becomes SessionLostError (the recovering wrapper re-creates the
    session elsewhere); open and resume retry a dead replica with backoff.

    Deadlines. Every call waits at most `call_timeout_s`, and never past `deadline` (time.monotonic(); the request's
    end-to-end deadline, set per image by the Device). A call past its deadline is cancelled (Serve cancels it on
    the replica, which withdraws its work: `ciar.engine.service`) and raises `CloudTimeoutError`: before the open the
    request fails with a retryable 503, mid-image the device finishes the image alone (degraded), and a cost hint is
    given up. The close that ends every image waits up to 5 s even past the deadline (it frees the session's slots;
    the verifier's idle timeout frees them otherwise). Nothing waits forever."""

    HINT_TIMEOUT_S = 5.0  # a hint is worth little: the first image drafts at the calibrated point without one
    CLOSE_TIMEOUT_S = 5.0  # best effort, even past the request's deadline: the verifier frees idle sessions itself

    def __init__(self, handle, device_id: str, vocab_size: int, retries: int = 40, backoff_s: float = 0.1,
                 sleep: Callable[[float], None] = time.sleep, call_timeout_s: float = 60.0):
        fast_tensors()
        self.handle = handle
        self.device_id = device_id
        self.vocab_size = vocab_size
        self.retries, self.backoff_s, self.sleep = retries, backoff_s, sleep
        self.call_timeout_s = call_timeout_s
        self.deadline: float | None = None  # time.monotonic() past which no call waits (the request's)
        self.tokens: dict[str, str] = {}  # session id -> session token
        self.batch_sizes: dict[str, list[int]] = {}  # session id -> verifier batch size of each of its verifies

    def _call(self, what: str, response, cap: float | None = None, cleanup: bool = False):
        """The result of a DeploymentResponse within the call's limit: its own cap, the call timeout, what is left of
        the deadline (a cleanup call, the close, is not held to the deadline: it frees the session's slots)."""
        limit = min(self.call_timeout_s, cap if cap is not None else math.inf)
        if self.deadline is not None and not cleanup:
            limit = min(limit, self.deadline - time.monotonic())
        return result_within(response, limit, what)

    def _to(self, session_id: str):
        return route(self.handle, session_id)

    def _retry(self, call):
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as e:  # noqa: BLE001
                if not replica_lost(e) and forward_fault(e) is None:
                    raise
                if attempt == self.retries:
                    raise CloudUnreachableError(f"no verifier replica answered after {self.retries} retries: "
                                                f"{type(e).__name__}") from e
                pause = min(2.0, self.backoff_s * 2 ** attempt)  # ~70 s in all: a replica restart
                if self.deadline is not None and time.monotonic() + pause >= self.deadline:
                    raise CloudTimeoutError(f"no verifier replica answered before the request's deadline: "
                                            f"{type(e).__name__}") from e
                self.sleep(pause)

    def open(self, request: OpenRequest) -> OpenReply:
        sid = request.session_id
        reply, token = self._retry(lambda: self._call("the open", self._to(sid).open.remote(
            request, session_id=sid, device_id=self.device_id)))
        self.tokens[sid] = token
        self.batch_sizes[sid] = []
        return reply

    def verify(self, request: VerifyRequest) -> VerifyReply:
        sid = request.session_id
        try:
            reply = self._call("a verify", self._to(sid).verify.remote(request, session_id=sid,
                                                                        device_id=self.device_id,
                                                                        token=self.tokens.get(sid, "")))
        except Exception as e:  # noqa: BLE001
            if replica_lost(e):
                raise SessionLostError(f"verifier replica of session {sid!r} is gone: {type(e).__name__}") from e
            fault = forward_fault(e)
            if fault is not None:  # the session is as before this verify: RecoveringClient sends it again
                raise fault from e
            raise
        self.batch_sizes.setdefault(sid, []).append(reply.batch_size)
        return reply

    def resume(self, request: OpenRequest, history: torch.Tensor,
               injected: InjectedFeatures | None = None) -> OpenReply:
        sid = request.session_id
        return self._retry(lambda: self._call("a resume", self._to(sid).resume.remote(
            request, history, injected, session_id=sid, device_id=self.device_id, token=self.tokens.get(sid, ""))))

    def cost_hint(self):
        """A Verifier replica's recent figures (`CloudVerifier.cost_hint`), None when none answers in time: a hint."""
        try:
            return self._call("a cost hint", self.handle.cost_hint.remote(), self.HINT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - without a hint the device's first image drafts at the calibrated point
            logging.getLogger("ray.serve").warning("no cost hint from the verifier: %s: %s", type(e).__name__, e)
            return None

    def close(self, session_id: str) -> None:
        token = self.tokens.pop(session_id, "")
        try:
            self._call("a close", self._to(session_id).close.remote(session_id=session_id, device_id=self.device_id,
                                                                    token=token), self.CLOSE_TIMEOUT_S,
                       cleanup=True)
        except Exception:  # noqa: BLE001 - best effort: the replica frees idle slots itself
            pass


class RayVerifierBackend:
    """The Verifier deployment's handle, every call routed by its session (as `RayCloudClient`) and
    bounded by `call_timeout_s` (`within`): past it the call is cancelled and `CloudTimeoutError` raised, which the
    endpoint answers by the frame's retry semantics (`DeviceEndpoint._failure`)."""

    def __init__(self, handle, call_timeout_s: float = 60.0):
        fast_tensors()
        self.handle = handle
        self.call_timeout_s = call_timeout_s

    async def _call(self, what: str, response):
        return await within(response, self.call_timeout_s, what)

    def _to(self, session_id):
        return route(self.handle, session_id)

    async def open(self, request, *, session_id, device_id):
        return await self._call("OPEN", self._to(session_id).open.remote(request, session_id=session_id,
                                                                         device_id=device_id))

    async def verify(self, request, *, session_id, device_id, token):
        return await self._call("VERIFY", self._to(session_id).verify.remote(
            request, session_id=session_id, device_id=device_id, token=token))

    async def resume(self, request, history, injected, *, session_id, device_id, token):
        return await self._call("RESUME", self._to(session_id).resume.remote(
            request, history, injected, session_id=session_id, device_id=device_id, token=token))

    async def close(self, *, session_id, device_id, token):
        return await self._call("CLOSE", self._to(session_id).close.remote(session_id=session_id,
                                                                           device_id=device_id, token=token))

    async def cost_hint(self):
        return await self._call("a cost hint", self.handle.cost_hint.remote())  # any replica's: a hint
