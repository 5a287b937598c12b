"""The application's config: the builder's args (`AppConfig`, serve_config.yaml -> services.app:build_app) and the
live settings of its deployments (Serve `user_config` -> `reconfigure`), validated with errors that name the field.

    AppConfig             deployment sizes and placement, API and device keys, the world served, deadlines
    DeviceLiveConfig      `user_config` of the Device deployment (tau, span, prefix rate, slowdown): live
    VerifierLiveConfig    `user_config` of the Verifier deployment (batch size, batch wait, idle timeout): live
    DeviceEndpointConfig  limits of the device endpoint (`AppConfig.device_endpoint`)

The keys and the session secret can come from the environment ($CIAR_API_KEYS, $CIAR_DEVICE_KEYS,
$CIAR_SESSION_SECRET: a cluster's Secret). The HTTP API's models are `services.schemas`; the device fleet's live
knobs are declared in `ciar.collab.knobs` and made fields by `services.schemas.knob_field`, as the API's are.
"""

# No `from __future__ import annotations`: pydantic must see the classes themselves.
import hashlib
import json
import math
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ciar.collab.knobs import KNOBS, LIVE_KNOBS
from services.schemas import MAX_IMAGES_LIMIT, knob_field

API_KEYS_ENV = "CIAR_API_KEYS"
DEVICE_KEYS_ENV = "CIAR_DEVICE_KEYS"
SESSION_SECRET_ENV = "CIAR_SESSION_SECRET"


# streamed previews per image at most: a preview decodes the whole image (the VQ decoder), so a fixed token cadence
# made 4x the previews at 4x the pixels on LlamaGen Stage II's 512 px, 1,024-token images (16x the decoding)
MAX_PREVIEWS = 16


class _DeviceLive(BaseModel):
    model_config = ConfigDict(extra="forbid")
    realtime: bool = Field(True, description="spend simulated network/device time for real (the request waits)")
    preview_every: int = Field(24, ge=1, le=10_000, description="tokens between streamed previews (at most "
                               f"{MAX_PREVIEWS} previews an image: each is a whole VQ decode, so a larger image "
                               "spaces them further)")

    def preview_tokens(self, num_tokens: int) -> int:
        """Tokens between an image's streamed previews: `preview_every`, or more on a large image (at most
        MAX_PREVIEWS previews an image: 144- and 256-token images keep `preview_every`, Stage II's 1,024 tokens get
        one every 64 when it says 24)."""
        return max(self.preview_every, -(-int(num_tokens) // MAX_PREVIEWS))

    def knobs(self) -> dict:
        """The fleet's collaborative knobs by name (None: the device model's calibrated value applies)."""
        return {name: getattr(self, name) for name in LIVE_KNOBS}


DeviceLiveConfig = create_model(
    "DeviceLiveConfig", __base__=_DeviceLive, __module__=__name__,
    __doc__="Live defaults of the device fleet (Serve `user_config` -> `reconfigure`): the knobs of "
            "`ciar.collab.knobs` with live=True, and how the simulated phones run.",
    **{name: knob_field(KNOBS[name], live=True) for name in LIVE_KNOBS})


class VerifierLiveConfig(BaseModel):
    """Live settings of a verifier replica (Serve `user_config` -> `reconfigure`)."""

    model_config = ConfigDict(extra="forbid")
    max_batch_size: int = Field(16, ge=1, le=1024, description="works (spans, decode steps, prefill chunks) in "
                                "one forward pass, at most (1: no batching)")
    batch_wait_timeout_s: float = Field(0.005, ge=0.0, le=1.0, description="an idle verifier waits this long for "
                                        "more work before its first forward")
    idle_timeout_s: float = Field(60.0, gt=0.0, description="free a session's KV-cache slots after this idle time")
    token_budget: int = Field(1024, ge=1, le=1 << 20, description="padded token positions (batch rows x width) "
                              "per forward, at most (the first work of a step always runs)")
    prefill_chunk: int = Field(64, ge=1, le=4096, description="longest prefill / history / catch-up chunk fed "
                               "next to other work in one forward")
    forward_timeout_s: float = Field(120.0, gt=0.0, le=3600.0, description="a forward running longer than this "
                                     "(a hung kernel) makes the replica report unhealthy (check_health), and Serve "
                                     "replaces it")
    slot_wait_s: float = Field(5.0, ge=0.0, le=600.0, description="an open or resume that finds every KV-cache "
                               "slot taken waits this long for one (in arrival order), then is refused: 503 + "
                               "Retry-After")

    def scheduler(self):
        from ciar.engine.core import SchedulerConfig

        return SchedulerConfig(token_budget=self.token_budget, max_works=self.max_batch_size,
                               prefill_chunk=self.prefill_chunk)


class DeviceEndpointConfig(BaseModel):
    """Limits of the device endpoint (`/v1/device/sessions`, services.device_endpoint)."""

    model_config = ConfigDict(extra="forbid")
    max_frame_bytes: int = Field(8 << 20, ge=1024, le=64 << 20, description="largest frame a device may send; "
                                 "beyond it the connection is closed (1009). A device's largest frame grows with "
                                 "the image (ciar_device.wire.largest_frame_bytes): LlamaGen-XL's 1.6 MB at 256 "
                                 "tokens, 3.6 MB at Stage II's 1,024")
    max_sessions_per_device: int = Field(8, ge=1, le=10_000, description="open sessions per device (429 beyond)")
    messages_per_s: float = Field(200.0, gt=0.0, description="sustained frames per second per connection (429 "
                                  "beyond, with the time to wait)")
    burst: int = Field(400, ge=1, description="frames a connection may send at once before the rate applies")
    idle_timeout_s: float = Field(60.0, gt=0.0, description="close a connection with nothing in flight that sent "
                                  "nothing for this long (1001)")
    session_ttl_s: float = Field(120.0, gt=0.0, description="a session unused this long no longer counts against "
                                 "its device's limit")
    max_connections: int = Field(192, ge=1, description="connections per ingress replica; beyond, new ones are "
                                 "closed with 1013 and a retry-after hint (below ingress_max_ongoing_requests: a "
                                 "connection is one of the ingress's ongoing requests)")
    max_connections_per_device: int = Field(16, ge=1)
    send_timeout_s: float = Field(10.0, gt=0.0, description="a reply not delivered in this time closes the "
                                  "connection (a slow reader, 1008)")

    def limits(self, retry_after_s: float):
        from services.endpoint_limits import EndpointLimits

        return EndpointLimits(**self.model_dump(), retry_after_s=float(retry_after_s))


class AppConfig(BaseModel):
    """Builder args (`serve_config.yaml` -> services.app:build_app)."""

    model_config = ConfigDict(extra="forbid")
    world: str | dict | None = Field(None, description="the world served (ciar.world_spec): a world file (YAML / "
                                     "JSON) or its fields inline, e.g. a LlamaGen world (GPT, VQ, T5 folder, device "
                                     "model); default: the shipped scenes world")
    weights_dir: str | None = Field(None, description="shorthand for a scenes world: a weights folder in the shipped "
                                    "layout (default: weights/scenes-v2)")
    api_keys: list[str] = Field(default_factory=list, description="accepted bearer keys (plus $CIAR_API_KEYS); "
                                "Ray Serve logs builder args when it deploys: prefer api_key_sha256 or the env var")
    api_key_sha256: list[str] = Field(default_factory=list, description="accepted keys by their SHA-256 hex digest "
                                      "(a config that holds no key)")
    # device fleet: each replica is one simulated phone generating one image at a time
    devices: int = Field(4, ge=1, le=1024)
    max_images: int = Field(4, ge=1, le=MAX_IMAGES_LIMIT, description="the most images one request may ask for "
                            "(`n`); each takes a device")
    device_num_cpus: float = Field(0.2, gt=0.0)
    device_runtime: Literal["torch", "onnx"] = Field("torch", description="what runs each simulated phone's "
                                                     "device model: 'torch', or 'onnx', the exported model real "
                                                     "phones run (<weights>/onnx, `make onnx`)")
    device_max_queued_requests: int = Field(32, ge=1, description="beyond this, 503 + Retry-After")
    device: DeviceLiveConfig = Field(default_factory=DeviceLiveConfig)
    device_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per Device "
                                               "replica, e.g. {\"ciar_device\": 1}: places the phones on the nodes "
                                               "that declare them (KubeRay: rayStartParams.resources)")
    # verifier pool: cloud model replicas
    verifier_replicas: int = Field(1, ge=1, le=1024)
    verifier_autoscaling: dict | None = Field(None, description="Serve autoscaling_config of the verifier pool")
    verifier_num_cpus: float = Field(1.0, gt=0.0)
    verifier_num_gpus: float = Field(0.0, ge=0.0)
    verifier_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per "
                                                 "Verifier replica, e.g. {\"ciar_verifier\": 1}: places the verifiers "
                                                 "on the nodes that declare them")
    verifier_threads: int = Field(1, ge=1, le=256, description="torch CPU threads per verifier replica (a CPU "
                                  "replica with N cores: N; irrelevant on a GPU)")
    verifier_max_sessions: Annotated[int, Field(ge=1, le=100_000)] | Literal["auto"] = Field(
        64, description="KV-cache sessions per replica, or 'auto': as many as the GPU's memory holds after loading "
        "(verifier_memory_utilization; on a CPU 'auto' means 64)")
    verifier_cuda_graphs: bool = Field(True, description="on a GPU, pad the verifier's steps to buckets and replay "
                                       "them from CUDA graphs captured at start-up (False: eager steps of the "
                                       "batch's own shape); irrelevant on a CPU")
    verifier_fused_step: bool = Field(False, description="on a GPU with verifier_cuda_graphs, the fused static step "
                                      "(w1/w3 as one GEMM, each block compiled inside the graphs): x0.73-0.94 of "
                                      "the plain step's time on an H200, about a minute more start-up for its "
                                      "compilations; irrelevant on a CPU")
    verifier_packed_step: bool = Field(False, description="on a GPU with verifier_cuda_graphs, span-wide steps "
                                       "whose fed positions are few (one-token decodes beside spans) run their "
                                       "projections and feed-forward on the fed tokens only (the same replies; "
                                       "more graphs captured at start-up). Off: beside the fused step it took "
                                       "x1.14-1.36 the fused step's time on an H200; irrelevant on a CPU")
    verifier_overlap: bool = Field(False, description="the verifier's engine reads a step's decisions after "
                                   "launching the next step's forward, so that the host's work overlaps the "
                                   "accelerator's (the same replies; a burst by Jacobi windows starts a step later). "
                                   "On in serve_config.gpu.yaml (an H200: CIAR x1.12, cloud-only x1.04 images/s "
                                   "at 512 phones); off by default, as on a CPU nothing overlaps")
    verifier_compiled_judge: bool = Field(False, description="the verifier's judge and sampler (every draw and the "
                                          "exact and greedy rules' spans) computed by torch.compile'd functions, "
                                          "compiled at start-up (nothing compiles while serving, whatever "
                                          "sampling requests bring): far fewer operations a step. Their "
                                          "probabilities equal the eager ones to the last bits only, so a rare draw "
                                          "takes the neighbouring token (the same request and seed give the same "
                                          "image on the same setting). Off: on an H200 with torch 2.11 Inductor "
                                          "failed to generate its code (2026-11-29-gpu); the mended one has not "
                                          "run on a GPU")
    verifier_engine_process: bool = Field(False, description="the verifier's engine core runs in a process of its "
                                          "own (ciar.engine.process), which loads the model and owns the "
                                          "accelerator; the replica's process only passes calls to it, so the "
                                          "engine's host work no longer shares one interpreter lock with the "
                                          "replica's (Ray's handle calls, requests, replies). The same replies; "
                                          "off: on an H200 at 512 phones CIAR made 51.2 images/s this way, "
                                          "67.4 with the engine thread")
    verifier_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="with verifier_max_sessions: auto, "
                                               "the share of the GPU's total memory the replica may use (weights, "
                                               "activations and KV cache), as vLLM's gpu_memory_utilization")
    verifier: VerifierLiveConfig = Field(default_factory=VerifierLiveConfig)
    allow_unauthenticated: bool = Field(False, description="accept requests without a key (only when no keys)")
    allow_simulation_params: bool = Field(False, description="accept the simulation params "
                                          "params.device_slowdown, params.link_drop_after and "
                                          "params.device_exit_after in requests (reliability and load runs); off, "
                                          "a request that sets one is answered 422 naming it")
    # real devices: the WebSocket endpoint /v1/device/sessions (services.device_endpoint)
    device_keys: list[str] = Field(default_factory=list, description="accepted device keys (plus "
                                   "$CIAR_DEVICE_KEYS); prefer device_key_sha256 (Serve logs builder args)")
    device_key_sha256: list[str] = Field(default_factory=list, description="accepted device keys by their SHA-256 "
                                         "hex digest")
    device_endpoint: DeviceEndpointConfig = Field(default_factory=DeviceEndpointConfig)
    ingress_replicas: int = Field(1, ge=1, le=64, description="Ingress replicas (HTTP and the device endpoint); "
                                  "more than one, on different nodes, so that a lost node takes only the requests "
                                  "and device sockets its replica held (clients retry; devices reconnect and resume)")
    ingress_num_cpus: float = Field(0.1, gt=0.0)
    ingress_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per "
                                                "Ingress replica, e.g. {\"ciar_ingress\": 1}: keeps the ingress, "
                                                "which holds every HTTP request and device socket, off the nodes "
                                                "a cluster may lose with the phones or verifiers")
    ingress_max_ongoing_requests: int = Field(256, ge=1, description="requests an ingress replica runs at once; "
                                              "each open device connection is one, so this must exceed "
                                              "device_endpoint.max_connections (the rest is HTTP's headroom)")
    ingress_max_queued_requests: int = Field(1024, ge=1, description="HTTP requests waiting for the ingress beyond "
                                             "this get 503 + Retry-After from Serve's proxy (BackpressureConfig)")
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0.0)
    retry_after_s: int = Field(2, ge=1, le=3600, description="Retry-After of 503 answers")
    request_timeout_s: float = Field(300.0, gt=0.0, description="end-to-end deadline of a generation request: past "
                                     "it the API answers 504 with Retry-After, the device gives up its calls to the "
                                     "verifier and frees its session")
    verifier_call_timeout_s: float = Field(60.0, gt=0.0, description="deadline of each call to the Verifier (open, "
                                           "verify, resume; close and cost hints wait at most 5 s): past it the call "
                                           "is cancelled and the cloud counts as unreachable (before the open: 503 "
                                           "with Retry-After; mid-image: the device finishes alone, degraded)")

    @field_validator("device_resources", "verifier_resources", "ingress_resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource: use the *_num_cpus / *_num_gpus fields")
            if not (amount > 0 and math.isfinite(amount)):
                raise ValueError(f"resource {name!r} must be a finite amount > 0, got {amount!r}")
        return v

    def world_dict(self) -> dict:
        """The served world, validated now (every file checked, the missing one named) and handed to the replicas as
        a dict with absolute paths."""
        from ciar.world_spec import read_world, spec_dict, world_source

        return spec_dict(read_world(world_source(self.world, self.weights_dir), need_device=True, need_text=True))

    @model_validator(mode="after")
    def _ingress_holds_the_device_connections(self) -> "AppConfig":
        # behind Serve a WebSocket is an ongoing request of the ingress: at ingress_max_ongoing_requests connections
        # new ones (and every HTTP request) queue in Serve's proxy and the endpoint's 1013 is never reached
        if self.ingress_max_ongoing_requests <= self.device_endpoint.max_connections:
            raise ValueError(f"ingress_max_ongoing_requests ({self.ingress_max_ongoing_requests}) must exceed "
                             f"device_endpoint.max_connections ({self.device_endpoint.max_connections}): each device "
                             "connection holds one of the ingress's ongoing requests")
        return self

    @field_validator("api_keys", "device_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        for k in v:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise ValueError("api keys must be at least 8 characters with no whitespace")
        return v

    @field_validator("api_key_sha256", "device_key_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        for d in v:
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d.lower()):
                raise ValueError(f"api_key_sha256 entries must be 64 hex digits (sha256 of a key), got {d[:12]!r}...")
        return [d.lower() for d in v]

    def all_api_keys(self) -> list[str]:
        """The plaintext keys: the config's and $CIAR_API_KEYS'."""
        env = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        return list(dict.fromkeys(self.api_keys + env))

    def key_digests(self) -> list[str]:
        """SHA-256 hex digests of every accepted key (what the ingress compares against)."""
        return list(dict.fromkeys([key_digest(k) for k in self.all_api_keys()] + self.api_key_sha256))

    def device_key_digests(self) -> list[str]:
        """SHA-256 hex digests of every accepted device key: the config's, its digests and $CIAR_DEVICE_KEYS'."""
        env = [k.strip() for k in os.environ.get(DEVICE_KEYS_ENV, "").split(",") if k.strip()]
        return list(dict.fromkeys([key_digest(k) for k in self.device_keys + env] + self.device_key_sha256))

    def session_secret(self) -> str:
        """Signs session tokens; shared by the application's verifier replicas and stable across re-deploys of the
        same config (so a user_config change reconfigures replicas instead of restarting them). $CIAR_SESSION_SECRET
        when set (production: from the cluster's Secret); else derived from the plaintext keys ($CIAR_API_KEYS /
        api_keys), else from the key digests, which sit in the config and Serve's logs: fine for a laptop, not for
        production."""
        material = self.all_api_keys() or self.key_digests()
        return os.environ.get(SESSION_SECRET_ENV) or hashlib.sha256(
            ("ciar-session|" + "|".join(sorted(material)) + "|" + json.dumps(self.world_dict(), sort_keys=True))
            .encode()).hexdigest()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()

