"""Simulated devices: each replica of the `Device` deployment is one phone (a Ray actor with a fractional CPU)
running the device model and the CIAR loop of `ciar.sim.decoder`, on its own link profile, talking to the
verifier pool through `services.verifier_client.RayCloudClient` (the Ray implementation of
`ciar.collab.protocol.CloudClient`).

Simulated time is spent for real (`DeviceLiveConfig.realtime`): each message waits for its uplink before it
reaches the verifier and for its downlink after the reply, and device compute is stretched by the slowdown
factor; the same times are accounted in the stats. A device generates one image at a time
(`max_ongoing_requests: 1`); the fleet's queue is bounded (`max_queued_requests`), beyond it the ingress answers
503 with Retry-After.

Failures: a verifier replica that died or lost the session makes `verify` raise SessionLostError; the
`RecoveringClient` around this client re-sends the session's history (`resume`) and retries, so the image is
still exact (position-keyed randomness on the cloud). When no replica answers within the retry budget (~70 s) the
client raises CloudUnreachableError: mid-generation the device finishes the image alone (stats.degraded), before
the open the request fails with 503. A simulated link outage (`params.link_drop_after`) takes the same path. Every
call to the verifier has a deadline (`verifier_call_timeout_s`, and the request's own, `request_timeout_s`): past it
the call is cancelled and the cloud counts as unreachable (`CloudTimeoutError`), so a generation never waits forever
and leaves nothing holding a verifier slot. A simulated poison job (`params.device_exit_after`) ends the phone's
process mid-image (`os._exit`), as an input that exhausts its memory would: the ingress's rule for a job whose phones
die under it is tested with it (services.device_retry).
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import threading
import time

import torch
from ray import serve

from ciar.engine import heap
from ciar.sim.decoder import CollabConfig, CollabDecoder, method_config, shared_knobs
from ciar.sim.recovery import RecoveringClient
from ciar.sim.runtime import device_runtime
from ciar.models.vq import tensor_to_images
from ciar.world import load_device_side
from services.config import DeviceLiveConfig
from services.schemas import CollabOverrides, GenerationJob, GenerationOutput, ProgressEvent
from services.verifier_client import RayCloudClient, session_lost


def exiting_at(tokens: int, on_progress=None):
    """`on_progress` (or none) behind a check that ends this process (os._exit, no clean-up: as a worker killed for
    its memory) once the image has `tokens` decided tokens: the simulation param `device_exit_after`."""
    def check(done: list[int], stats) -> None:
        if len(done) >= tokens:
            exit_now(f"the image has {len(done)} tokens")
        if on_progress is not None:
            on_progress(done, stats)

    return check


def exit_now(why: str) -> None:
    """The simulated poison job's end of this phone: its process exits at once (os._exit), as a killed one."""
    logging.getLogger("ray.serve").error("simulation (params.device_exit_after): %s; this phone's process exits now",
                                         why)
    os._exit(1)


def png_bytes(image) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


class Device:
    """One simulated phone. `generate(job: GenerationJob)` -> GenerationOutput (tokens, who decided each, PNG,
    stats); `generate_stream(job)` yields ProgressEvent (with a preview PNG until the last) and finally the
    GenerationOutput. A dict job is validated into a GenerationJob."""

    def __init__(self, world: dict | str | None, verifier, live: dict | None = None, call_timeout_s: float = 60.0,
                 runtime: str = "torch"):
        torch.set_num_threads(1)
        self.side = load_device_side(world)  # the device model and the VQ decoder of the served world
        s = self.side  # what runs the device model (AppConfig.device_runtime): torch, or the export phones run
        self.runtime = device_runtime(runtime, s.device_model, s.weights_dir, s.device_file)
        self.live = DeviceLiveConfig(**(live or {}))
        try:
            self.device_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica
            self.device_id = "local-device"
            in_replica = False
        else:
            in_replica = True
        self.ray_client = RayCloudClient(verifier, self.device_id, self.side.device_model.config.vocab_size,
                                         call_timeout_s=call_timeout_s)
        self.client = RecoveringClient(self.ray_client, is_lost=session_lost)
        self._busy = threading.Lock()  # a phone makes one image at a time
        self.observers: dict = {}  # its running cost estimates per link, kept across its images (adaptive policy)
        if in_replica:  # its start-up out of the collector's reach: no full collection stalls an image midway
            heap.freeze(log=logging.getLogger("ray.serve").info)

    def reconfigure(self, config: dict) -> None:
        self.live = DeviceLiveConfig(**(config or {}))  # raises a ValidationError naming the field

    # ------------------------------------------------------------------ one generation
    def config_for(self, method: str, network: str, overrides: CollabOverrides) -> CollabConfig:
        """The request's config: the method's preset, the fleet's live defaults that the method takes, the request's
        own knobs over them; validated here, once (the decoder does not check it again)."""
        knobs = shared_knobs(method, {"network": network, **self.live.knobs()})
        knobs.update(overrides.given())  # a request's own params apply as given
        return method_config(method, **knobs)

    def _run(self, job: GenerationJob | dict, on_progress=None) -> GenerationOutput:
        import dataclasses

        t0, t_start = time.perf_counter(), time.monotonic()
        job = job if isinstance(job, GenerationJob) else GenerationJob.model_validate(job)
        cfg = self.config_for(job.method, job.network, job.collab)
        sampling = dataclasses.replace(self.side.sampling, **job.sampling.given()).validate()
        decoder = CollabDecoder(self.side.device_model, self.client, cfg, sampling, num_tokens=self.side.num_tokens,
                                wait=time.sleep if self.live.realtime else None,
                                progress_every=self.live.preview_tokens(self.side.num_tokens),
                                observers=self.observers,
                                runtime=self.runtime)
        cfg = decoder.config  # with the device model's calibrated gate / tau / burst filled in
        sid = job.session_id
        if job.device_exit_after is not None:  # a simulated poison job: it kills this phone
            if job.device_exit_after == 0:
                exit_now("before the open")
            on_progress = exiting_at(job.device_exit_after, on_progress)
        with self._busy:
            # the request's end-to-end deadline: no call to the verifier waits past it (RayCloudClient)
            self.ray_client.deadline = t_start + job.timeout_s if job.timeout_s is not None else None
            try:
                result = decoder.generate(job.prompt, job.seed, session_id=sid, trace=True, on_progress=on_progress)
            finally:
                self.ray_client.deadline = None
                sizes = self.ray_client.batch_sizes.pop(sid, [])
        image = self.decode_png(result.tokens)
        stats = result.stats.to_dict()
        stats.update({
            "method": cfg.method, "network": cfg.network, "device_id": self.device_id,
            "verifier_batch_size": {"mean": sum(sizes) / len(sizes) if sizes else None,
                                    "max": max(sizes) if sizes else None, "count": len(sizes)},
            "wall_s": time.perf_counter() - t0,
            "config": {"tau": cfg.tau, "span": cfg.span, "prefix_rate": cfg.prefix_rate, "gate": cfg.gate,
                       "burst": cfg.burst, "policy": cfg.policy,
                       "rule": cfg.rule.rule, "inter_enhance": cfg.inter_enhance,
                       "device_slowdown": cfg.device_slowdown, "realtime": self.live.realtime,
                       "jacobi_window": cfg.jacobi_window},
            "sampling": sampling.to_dict(),
        })
        return GenerationOutput(tokens=result.tokens.tolist(), who=result.trace, png=image, stats=stats)

    def decode_png(self, tokens: torch.Tensor) -> bytes:
        with torch.no_grad():
            img = tensor_to_images(self.side.vq.decode_code(tokens.reshape(1, -1)))[0].numpy()
        return png_bytes(img)

    def _preview(self, tokens: list[int]) -> bytes:
        """A partial image: decided tokens, the rest filled with the last decided token's code (rows appear as the
        image is generated)."""
        n = self.side.num_tokens
        fill = tokens[-1] if tokens else 0
        return self.decode_png(torch.tensor(tokens + [fill] * (n - len(tokens)), dtype=torch.long))

    async def generate(self, job: GenerationJob | dict) -> GenerationOutput:
        return await asyncio.to_thread(self._run, job)

    async def generate_stream(self, job: GenerationJob | dict):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        n = self.side.num_tokens

        def on_progress(tokens: list[int], stats) -> None:
            event = ProgressEvent(tokens_done=len(tokens), tokens_total=n, cloud_requests=stats.cloud_requests,
                                  cloud_tokens=stats.cloud_tokens,
                                  preview_png=self._preview(tokens) if len(tokens) < n else None)
            loop.call_soon_threadsafe(queue.put_nowait, event)

        task = asyncio.ensure_future(asyncio.to_thread(self._run, job, on_progress))
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            yield task.result()  # the GenerationOutput (or the generation's error, raised into the stream)
            return

    async def info(self) -> dict:
        return {"device_id": self.device_id, "live": self.live.model_dump(), "node_id": _node_id(),
                "world": self.world_info()}

    def world_info(self) -> dict:
        """What the API advertises of the served world: an alias (the weights folder's name), the image size
        (token grid x the tokenizer's downsampling) and the number of image tokens."""
        import math
        import os

        grid = math.isqrt(self.side.num_tokens)
        px = grid * self.side.vq.config.downsample
        return {"id": os.path.basename(os.path.normpath(self.side.weights_dir)) or "world",
                "size": f"{px}x{px}", "num_tokens": self.side.num_tokens, "grid": grid,
                # the device model exported for real devices (pipelines.export_onnx), served by the ingress
                "model_dir": os.path.join(os.path.abspath(self.side.weights_dir), "onnx")}

    async def state(self) -> dict:
        """What this phone holds between generations (all 0 when idle; a leak check reads it) and its memory."""
        import psutil

        return {"device_id": self.device_id, "busy": self._busy.locked(),
                "session_tokens": len(self.ray_client.tokens), "batch_size_records": len(self.ray_client.batch_sizes),
                "tracked_sessions": self.client.open_sessions, "rss_mb": psutil.Process().memory_info().rss / 2**20,
                "heap": heap.stats()}


def _node_id() -> str:
    """The Ray node this replica runs on (where placement put it: custom resources, GPUs)."""
    import ray

    return ray.get_runtime_context().get_node_id()
