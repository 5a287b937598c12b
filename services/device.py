"""Simulated devices: each replica of the `Device` deployment is one phone (a Ray actor with a fractional CPU)
running the device model and the CIAR loop of `ciar.collab.decoder`, on its own link profile, talking to the
verifier pool through `RayCloudClient` (the Ray implementation of `ciar.collab.protocol.CloudClient`).

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
from collections.abc import Callable

import torch
from ray import serve

from ciar.collab.decoder import CollabConfig, CollabDecoder, method_config, shared_knobs
from ciar.collab.protocol import (CloudTimeoutError, CloudUnreachableError, ForwardFault, InjectedFeatures, OpenReply,
                                  OpenRequest, SessionLostError, VerifyReply, VerifyRequest)
from ciar.collab.recovery import RecoveringClient
from ciar.collab.runtime import device_runtime
from ciar.models.vq import tensor_to_images
from ciar.world import load_device_side
from services.schemas import CollabOverrides, DeviceLiveConfig, GenerationJob, GenerationOutput, ProgressEvent


def is_replica_loss(exc: BaseException) -> bool:
    """True for errors meaning the verifier replica is gone (died / unreachable), not a bad request."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def is_session_lost(exc: BaseException) -> bool:
    return isinstance(exc, SessionLostError) or isinstance(getattr(exc, "cause", None), SessionLostError)


def forward_fault(exc: BaseException) -> ForwardFault | None:
    """The verifier's `ForwardFault` behind `exc` (raised here, or the cause Ray keeps), else None."""
    for e in (exc, getattr(exc, "cause", None)):
        if isinstance(e, ForwardFault):
            return e
    return None


class RayCloudClient:
    """`CloudClient` over the Verifier deployment handle. Synchronous: call it from a worker thread, not from the
    replica's event loop. Every call is routed by its session (`handle.options(session_id=...)`, Ray's consistent-hash
    router as `services.routing` fixes it) and carries `session_id=`, this device's id and the session token
    (ownership). A dead replica during verify becomes SessionLostError (the recovering wrapper re-creates the
    session elsewhere); open and resume retry a dead replica with backoff.

    Deadlines. Every call waits at most `call_timeout_s`, and never past `deadline` (time.monotonic(); the request's
    end-to-end deadline, set per image by the Device). A call past its deadline is cancelled (Serve cancels it on
    the replica, which withdraws its work: `ciar.collab.service`) and raises `CloudTimeoutError`: before the open the
    request fails with a retryable 503, mid-image the device finishes the image alone (degraded), and a cost hint is
    given up. The close that ends every image waits up to 5 s even past the deadline (it frees the session's slots;
    the verifier's idle timeout frees them otherwise). Nothing waits forever."""

    HINT_TIMEOUT_S = 5.0  # a hint is worth little: the first image drafts at the calibrated point without one
    CLOSE_TIMEOUT_S = 5.0  # best effort, even past the request's deadline: the verifier frees idle sessions itself

    def __init__(self, handle, device_id: str, vocab_size: int, retries: int = 40, backoff_s: float = 0.1,
                 sleep: Callable[[float], None] = time.sleep, call_timeout_s: float = 60.0):
        self.handle = handle
        self.device_id = device_id
        self.vocab_size = vocab_size
        self.retries, self.backoff_s, self.sleep = retries, backoff_s, sleep
        self.call_timeout_s = call_timeout_s
        self.deadline: float | None = None  # time.monotonic() past which no call waits (the request's)
        self.tokens: dict[str, str] = {}  # session id -> session token
        self.batch_sizes: dict[str, list[int]] = {}  # session id -> verifier batch size of each of its verifies

    def _limit(self, cap: float | None = None, cleanup: bool = False) -> float:
        """Seconds the next call may wait: its own cap, the call timeout, what is left of the deadline (a cleanup
        call, the close, is not held to the deadline: it frees the session's slots)."""
        limit = min(self.call_timeout_s, cap if cap is not None else math.inf)
        if self.deadline is not None and not cleanup:
            limit = min(limit, self.deadline - time.monotonic())
        if limit <= 0:
            raise CloudTimeoutError("the request's deadline has passed (request_timeout_s)")
        return limit

    def _call(self, what: str, response, cap: float | None = None, cleanup: bool = False):
        """The result of a DeploymentResponse within the call's deadline; past it the call is cancelled."""
        try:
            limit = self._limit(cap, cleanup)
        except CloudTimeoutError:
            response.cancel()
            raise
        try:
            return response.result(timeout_s=limit)
        except TimeoutError:  # (Ray's GetTimeoutError is one too)
            response.cancel()  # no late execution: the verifier withdraws the work
            raise CloudTimeoutError(f"the verifier did not answer {what} within {limit:.3g} s") from None

    def _to(self, session_id: str):
        return self.handle.options(session_id=session_id)

    def _retry(self, call):
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as e:  # noqa: BLE001
                if not is_replica_loss(e) and forward_fault(e) is None:
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
            if is_replica_loss(e):
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
        self.ray_client = RayCloudClient(verifier, self.device_id, self.side.device_model.config.vocab_size,
                                         call_timeout_s=call_timeout_s)
        self.client = RecoveringClient(self.ray_client, is_lost=is_session_lost)
        self._busy = threading.Lock()  # a phone makes one image at a time
        self.observers: dict = {}  # its running cost estimates per link, kept across its images (adaptive policy)

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
                       "device_slowdown": cfg.device_slowdown, "realtime": self.live.realtime},
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
                "tracked_sessions": self.client.open_sessions, "rss_mb": psutil.Process().memory_info().rss / 2**20}


def _node_id() -> str:
    """The Ray node this replica runs on (where placement put it: custom resources, GPUs)."""
    import ray

    return ray.get_runtime_context().get_node_id()
