"""Session-affine routing to the Verifier pool: Ray's consistent-hash router, with the fix this cluster needs.

    request_router_config=RequestRouterConfig(request_router_class="services.routing.SessionAffinityRouter",
                                              request_router_kwargs={"num_fallback_replicas": 0})

Every call to the Verifier deployment goes through `handle.options(session_id=...)`, and Ray Serve's experimental
`ConsistentHashRouter` sends it to the replica whose ring position owns that session (strict: no fallback replica),
which is where the session's KV-cache slots are.

The defect this class fixes (Ray 2.60, found as issue 36's start-up hang). A handle call made while a replica serves a
request inherits that request's `internal_request_id` (`ray.serve._private.default_impl.get_request_metadata`), so
the calls one Device replica makes for one image — cost hint, open, verify, ..., close — all share one id. Ray's
request router indexes pending requests by that id and skips a second pending request with an id already indexed
(`_add_pending_request_to_indices`, "retry path"); a routing task then fulfils "the pending request matching its
metadata's id". The base router's routing task keeps routing until its *own* request is done; the consistent-hash
router's loop stops after one fulfilment, assuming it was its own. With two calls of one parent request pending at
once — a `cost_hint(...).result(timeout_s=5)` that timed out while no Verifier replica was up (a timeout does not
cancel the request), then the `open` — the first routing task fulfilled the hint and dropped the id from the index;
the second found a replica for the open, looked the id up, found nothing, and returned: the open was in no queue any
more and waited forever. The device endpoint (every frame of a connection shares the WebSocket's id) can have the
same two-pending-requests shape whenever replicas are briefly unavailable.

The fix: each routing task remembers the pending request it popped, and a replica it finds fulfils exactly that
request. Nothing else of the consistent-hash policy changes (same ring, same hash, same vnodes: routers on other
processes, including unpatched ones, agree on every session's replica). Tested against a real Serve application in
`tests/services/test_routing.py` (the start-up hang reproduced with the plain router, gone with this one).
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

logger = logging.getLogger("ray.serve")
ROUTER_CLASS = f"{__name__}.SessionAffinityRouter"


class SessionAffinityRouter(ConsistentHashRouter):
    """`ConsistentHashRouter` whose routing tasks fulfil the request they route (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # routing task -> the pending request it popped (weak: a finished task drops its entry)
        self._routed_by_task: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _get_next_pending_request_to_route(self):
        pending = super()._get_next_pending_request_to_route()
        task = asyncio.current_task()
        if task is not None:
            if pending is None:
                self._routed_by_task.pop(task, None)
            else:
                self._routed_by_task[task] = pending
        return pending

    def _fulfill_next_pending_request(self, replica, request_metadata=None):
        task = asyncio.current_task()
        pending = self._routed_by_task.pop(task, None) if task is not None else None
        if pending is None or pending.future.done():  # not a routing task of ours: Ray's lookup by id
            return super()._fulfill_next_pending_request(replica, request_metadata)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        internal_id = pending.metadata.internal_request_id
        if self._pending_requests_by_id.get(internal_id) is pending:  # a sibling with the same id keeps its entry
            self._remove_pending_request_from_indices(pending)
