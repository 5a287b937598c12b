"""Session affinity for the verifier pool: a Ray Serve custom request router.

A session's KV cache lives on one verifier replica, so every call of that session (open, verify, resume, close)
must reach the same replica. `SessionAffinityRouter` picks, for a request carrying `session_id=` as a keyword
argument, the replica with the highest rendezvous hash of (session id, replica id) — highest-random-weight
hashing: stateless (every router in every process agrees without coordination), and when a replica is added or
removed only the sessions of that replica move. A moved session finds no cache on its new replica and is
re-created from the device's token history (`ciar.collab.recovery`), so losing a replica costs a re-prefill,
never a failed request. Requests without a session id (health checks, stats) go to the least-loaded replica of
two random choices, like Serve's default router.

Used by `services.verifier.Verifier` through
`request_router_config=RequestRouterConfig(request_router_class="services.routing:SessionAffinityRouter")`.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rendezvous_rank(session_id: str, replica_ids: list[str]) -> list[str]:
    """Replica ids ordered by highest-random-weight hash for this session (first = owner)."""
    def weight(rid: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{session_id}|{rid}".encode(), digest_size=8).digest(), "big")

    return sorted(replica_ids, key=weight, reverse=True)


def session_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    sid = pending_request.kwargs.get("session_id")
    return sid if isinstance(sid, str) and sid else None


class SessionAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        sid = session_of(pending_request)
        if sid is None:
            pick = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            return [pick]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        owner = rendezvous_rank(sid, list(by_id))[0]
        # strict affinity: wait for the owner rather than spill over (a spill would cost a re-prefill)
        return [[by_id[owner]]]
