"""The ingress's view of the deployments behind it (services.app): the served world, as a Device replica reports it,
and whether an image can be served now (GET /healthz; until the cluster has been ready once, every generation
request is answered 503 `starting` with Retry-After).

    ready = Readiness(device_handle, verifier_handle, timeout_s=300.0)     # in the replica's event loop
    world = await ready.world()          # {"id": ..., "size": "48x48", "model_dir": ...} (Device.world_info)
    missing = await ready.missing()      # [] when ready, else ["device"] and / or ["verifier"]
    ready.started                        # ready once already

(`make serve`'s watcher, which polls /healthz from outside, is services.ready.)
"""

from __future__ import annotations

import asyncio
import math
import time

from ray.serve.handle import DeploymentHandle

from services.verifier_client import within


class Readiness:
    """A Device replica's world, asked once in the background (a device serves one call at a time, so the first
    answer may wait for a generation) and again after a failed ask; a Verifier replica's answer, asked at most one
    probe at a time and trusted READY_TTL_S."""

    READY_TTL_S = 2.0  # a Verifier replica's answer counts as "ready" this long
    READY_TIMEOUT_S = 2.0  # a readiness probe waits at most this long

    def __init__(self, device: DeploymentHandle, verifier: DeploymentHandle | None, timeout_s: float):
        self.device = device
        self.verifier = verifier
        self.timeout_s = timeout_s  # what `world` waits at most (the request's deadline)
        # the last time a Verifier replica answered, the probe in flight, and whether the cluster has been ready once
        self._verifier_seen = -math.inf
        self._probe: asyncio.Task | None = None
        self.started = False
        self._world_task = asyncio.ensure_future(self._ask_world())  # the served world (alias, size)

    async def _ask_world(self) -> dict:
        info = await self.device.info.remote()
        return info["world"]

    def _world_ask(self) -> asyncio.Task:
        """The ask for the served world in flight or answered; a failed one is asked again."""
        if self._world_task.done() and self._world_task.exception() is not None:
            self._world_task = asyncio.ensure_future(self._ask_world())
        return self._world_task

    async def world(self) -> dict:
        """The served world (Device.world_info); asked again if the first ask failed."""
        return await asyncio.wait_for(asyncio.shield(self._world_ask()), timeout=self.timeout_s)

    async def _probe_verifier(self) -> bool:
        try:  # (past its time the probe is cancelled: none is left waiting in the router for a replica)
            await within(self.verifier.ready.remote(), self.READY_TIMEOUT_S, "a readiness probe")
        except Exception:  # noqa: BLE001 - not ready (starting, gone, or too slow to answer)
            return False
        self._verifier_seen = time.monotonic()
        return True

    async def missing(self) -> list[str]:
        """What the cluster lacks to serve an image ([] when ready): a Device replica that has answered (the served
        world), and a Verifier replica that answered within READY_TTL_S (asked again, at most one probe at a time,
        waiting at most READY_TIMEOUT_S)."""
        missing = []
        ask = self._world_ask()
        if not ask.done():
            try:
                await asyncio.wait_for(asyncio.shield(ask), self.READY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - no device answered yet
                pass
        if not ask.done() or ask.exception() is not None:
            missing.append("device")
        if self.verifier is not None and time.monotonic() - self._verifier_seen > self.READY_TTL_S:
            if self._probe is None or self._probe.done():
                self._probe = asyncio.ensure_future(self._probe_verifier())
            if not await asyncio.shield(self._probe):
                missing.append("verifier")
        if not missing:
            self.started = True
        return missing
