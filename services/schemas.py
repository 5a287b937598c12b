"""Pydantic models of the HTTP API and of the application config (validated with errors that name the field).

    GenerationRequest   body of POST /v1/images/generations (OpenAI's Images API fields + CIAR's own)
    ImagesResponse      its JSON answer (ImageData per image, ImageStats); ErrorResponse: every error's body
    ModelList           GET /v1/models
    MethodParams        the request's `params`: its collaborative knobs (CollabOverrides) and sampling knobs
                        (SamplingOverrides) in one object
    GenerationJob / GenerationOutput / ProgressEvent
                        what the ingress and a Device replica pass each other (typed, as Ray Serve LLM passes
                        pydantic requests between its deployments; the job's knobs as CollabOverrides)
    AppConfig           the builder's args in serve_config.yaml (deployment sizes, API keys, weights)
    DeviceLiveConfig    `user_config` of the Device deployment (tau, span, prefix rate, slowdown): live via reconfigure
    VerifierLiveConfig  `user_config` of the Verifier deployment (batch size, batch wait, idle timeout): live

The collaborative knobs are declared once, in `ciar.collab.knobs` (type, range, default, description, who may set
them); `knob_field` turns one into a pydantic field, so MethodParams, CollabOverrides and DeviceLiveConfig state the
same ranges as `CollabConfig.validate` checks.
"""

# No `from __future__ import annotations`: FastAPI and pydantic must see the classes themselves.
import hashlib
import math
import os
import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, create_model, field_validator,
                      model_validator)

from ciar.collab.knobs import KNOBS, LIVE_KNOBS, REQUEST_KNOBS, SIMULATION_KNOBS, Knob
from ciar.collab.names import METHODS, NETWORKS

MAX_PROMPT_CHARS = 400
# not blank: one character that is white space neither to Python (str.isspace) nor to JSON Schema's ECMA-262 regexes
PROMPT_PATTERN = r"[^\s\x1c-\x1f\x85\ufeff]"
MAX_IMAGES_LIMIT = 64  # `n` can never exceed this; AppConfig.max_images is the deployment's own cap (<= this)
RESPONSE_FORMATS = ("b64_json", "png", "tokens")  # "url" is refused with a 400 that says why
QUALITIES = ("auto", "standard", "hd", "low", "medium", "high", "xhigh", "max")  # OpenAI's: accepted, ignored
STYLES = ("vivid", "natural")  # OpenAI's values: accepted, ignored
API_KEYS_ENV = "CIAR_API_KEYS"
DEVICE_KEYS_ENV = "CIAR_DEVICE_KEYS"
SIMULATION_NOTE = "simulation (only where the deployment sets allow_simulation_params, else 422): "


def _integral(v):
    """JSON Schema's integer: 5.0 is one (the request models are otherwise strict: no "5", no true for a number)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Integer = Annotated[int, BeforeValidator(_integral)]
# (not `Integer | None`: a field's range would then reach the JSON schema as "ge" / "le", not minimum / maximum)
OptionalInteger = Annotated[int | None, BeforeValidator(_integral)]


def knob_field(knob: Knob, live: bool = False) -> tuple[Any, Any]:
    """The pydantic field of a knob (`ciar.collab.knobs`): its type, range and description. For a request (default
    None: the fleet's live default applies) or, with `live`, for the device fleet's live defaults (CollabConfig's
    default; None where the device model's calibrated value applies)."""
    default = knob.default if live else None
    if knob.kind is int:
        kind = OptionalInteger if default is None else Integer
    else:
        kind = Literal[knob.choices] if knob.choices else knob.kind
        kind = kind | None if default is None else kind
    note = SIMULATION_NOTE if knob.simulation and not live else ""
    if knob.unset is None:
        unset = ""
    else:
        unset = f"; null: {knob.unset}" if live else f" (unset: the deployment's default, else {knob.unset})"
    return (kind, Field(default, ge=knob.ge, gt=knob.gt, le=knob.le, description=f"{note}{knob.description}{unset}"))


class _Knobs(BaseModel):
    """Knob values as a request gives them: JSON types as the schema states them, unknown keys refused, and None
    for a knob not given."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def given(self) -> dict:
        """The knobs set (not None), by name."""
        return self.model_dump(exclude_none=True)


CollabOverrides = create_model(
    "CollabOverrides", __base__=_Knobs, __module__=__name__,
    __doc__="A request's collaborative knobs (`ciar.collab.knobs`, request=True), validated: what a job carries to "
            "a device, which merges them over its live defaults into one CollabConfig.",
    **{name: knob_field(KNOBS[name]) for name in REQUEST_KNOBS})


class SamplingOverrides(_Knobs):
    """A request's sampling knobs (`ciar.decoding.sampling.SamplingParams`); unset: the world's sampling."""

    cfg_scale: float | None = Field(None, ge=1.0, le=20.0, description="classifier-free guidance scale")
    temperature: float | None = Field(None, ge=0.0, le=5.0, description="0 = greedy")
    top_k: OptionalInteger = Field(None, ge=0, le=1_000_000, description="0 disables top-k")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="1 disables top-p")


class _Params(_Knobs):
    """MethodParams' split into the two typed parts a job carries."""

    def collab(self) -> CollabOverrides:
        """The collaborative knobs, typed (checked already: the same fields)."""
        return CollabOverrides.model_construct(**self.model_dump(include=set(CollabOverrides.model_fields),
                                                                 exclude_none=True))

    def sampling(self) -> SamplingOverrides:
        return SamplingOverrides.model_construct(**self.model_dump(include=set(SamplingOverrides.model_fields),
                                                                   exclude_none=True))


# a simulation param of the service, not a knob of collaborative decoding (ciar.collab.knobs): it acts on the
# simulated phone's process, which the device loop knows nothing of
DEVICE_EXIT_AFTER = (OptionalInteger, Field(
    None, ge=0, le=100_000, description=f"{SIMULATION_NOTE}the simulated phone's process exits (os._exit) once the "
    "image has this many decided tokens (checked after the prefix and at each preview step; 0: before the open), on "
    "every phone the job runs on: a job that kills its device, as an input that exhausts its memory would (the "
    "ingress runs a job again after its phone died once, and answers 500 after the second)"))
SERVICE_SIMULATION_PARAMS = ("device_exit_after",)
# every `params` field that only a deployment with allow_simulation_params accepts (else 422)
SIMULATION_PARAMS = SIMULATION_KNOBS + SERVICE_SIMULATION_PARAMS

MethodParams = create_model(
    "MethodParams", __base__=_Params, __module__=__name__,
    __doc__="Per-request knobs (the request's `params`): the collaborative ones (CollabOverrides), the sampling "
            "ones (SamplingOverrides) and the service's simulation params in one object; None keeps the "
            "deployment's live default (or the world's sampling default).",
    **{name: knob_field(KNOBS[name]) for name in REQUEST_KNOBS},
    **{name: (f.annotation, f) for name, f in SamplingOverrides.model_fields.items()},
    device_exit_after=DEVICE_EXIT_AFTER)


class GenerationRequest(BaseModel):
    """OpenAI's Images API request (`prompt`, `model`, `n`, `size`, `response_format`, `user`, `quality`, `style`)
    plus CIAR's own fields (`method`, `seed`, `params`, `network`, `stream`, `response_format` png | tokens).
    Checks that depend on the deployment (the world's size and alias, the cap on `n`) and combinations the schema
    cannot state are answered 400 naming the field; a value out of the schema's range, 422 naming the field.
    `model` and `method` are two names of one knob: a body where `model` names a method may not give `method` too
    (the schema's `not`; 422 naming both). n > 1 needs a JSON answer without stream (the schema's `allOf` of two
    `not`s; 422 naming `n`)."""

    # strict: JSON types as the schema states them
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "not": {"required": ["model", "method"], "properties": {"model": {"enum": list(METHODS)}}},
        # n > 1 answers JSON: one PNG body or one event stream carries one image (422 naming `n`)
        "allOf": [{"not": {"required": ["n", "response_format"],
                           "properties": {"n": {"minimum": 2}, "response_format": {"const": "png"}}}},
                  {"not": {"required": ["n", "stream"],
                           "properties": {"n": {"minimum": 2}, "stream": {"const": True}}}}]})
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, json_schema_extra={"pattern": PROMPT_PATTERN},
                        description="caption of the image (not blank). A caption with more tokens than the world's "
                        "caption positions (40 MiniLM tokens in the scenes world; 120 flan-t5 tokens after LlamaGen's "
                        "caption cleaning, EOS included, in a LlamaGen world) is answered 422 naming `prompt`, with "
                        "its length and the limit; it is never truncated")
    model: str | None = Field(None, max_length=64, description="OpenAI: a decoding method (instead of `method`, "
                              "never with it) or the world's alias (then `method` applies); GET /v1/models lists "
                              "them; else 400")
    n: Integer = Field(1, ge=1, le=MAX_IMAGES_LIMIT, description="OpenAI: images to generate, 1 to the deployment's "
                   "max_images (else 400); image i uses seed + i and they run on n devices concurrently; "
                   "n > 1 needs a JSON answer (b64_json or tokens) without stream (else 422)")
    size: str | None = Field(None, max_length=32, pattern=r"^([0-9]{1,5}x[0-9]{1,5}|auto)$", description="OpenAI: "
                             "WIDTHxHEIGHT or auto; the world makes one resolution (GET /v1/models), another is a 400")
    quality: Literal[QUALITIES] | None = Field(  # type: ignore[valid-type]
        None, description="OpenAI: accepted and ignored (the world's model has one quality)")
    style: Literal[STYLES] | None = Field(None, description="OpenAI: accepted and ignored")  # type: ignore[valid-type]
    user: str | None = Field(None, max_length=256, description="OpenAI: an id of the end user; accepted, ignored "
                             "and never logged")
    seed: Integer = Field(0, ge=0, le=2**62, description="same prompt + seed -> same image (image i of n: seed + i)")
    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        "ciar", description="decoding method (or `model`: not both)")
    params: MethodParams = Field(default_factory=MethodParams)
    network: Literal[NETWORKS] = Field("5g", description="simulated device link")  # type: ignore[valid-type]
    # "url" parses (the OpenAI client's other value) and is answered 400 saying why; the schema lists what works
    response_format: Literal[RESPONSE_FORMATS + ("url",)] = Field(  # type: ignore[valid-type]
        "b64_json", json_schema_extra={"enum": list(RESPONSE_FORMATS)}, description="b64_json: JSON with the PNG "
        "in base64 (OpenAI); png: the image itself (n = 1); tokens: JSON with the image token ids and, per token, "
        "who decided it (`who`); url is not supported (400)")
    stream: bool = Field(False, description="server-sent events with progress and partial previews (n = 1)")

    @field_validator("method")
    @classmethod
    def _one_name(cls, v: str, info: ValidationInfo) -> str:
        """`method` given while `model` names a method: two names for one knob (the schema's `not` says so)."""
        if info.data.get("model") in METHODS:
            raise ValueError(f"model {info.data['model']!r} names the decoding method already: give `model` or "
                             "`method`, not both")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not re.search(PROMPT_PATTERN, v):
            raise ValueError("prompt must not be blank")
        return v  # (pydantic itself refuses strings with lone surrogates: "string_unicode")


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
        from services.device_endpoint import EndpointLimits

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
    verifier_max_sessions: Annotated[int, Field(ge=1, le=100_000)] | Literal["auto"] = Field(64, description="KV-cache sessions per replica, or "
                                                         "'auto': as many as the GPU's memory holds after loading "
                                                         "(verifier_memory_utilization; on a CPU 'auto' means 64)")
    verifier_cuda_graphs: bool = Field(True, description="on a GPU, pad the verifier's steps to buckets and replay "
                                       "them from CUDA graphs captured at start-up (False: eager steps of the "
                                       "batch's own shape); irrelevant on a CPU")
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


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- API answers
class ImageStats(BaseModel):
    """Per-image figures (`ciar.collab.stats.GenerationStats.to_dict` plus what the device adds); more keys may
    appear (the schema allows them)."""

    model_config = ConfigDict(extra="allow")
    method: str
    network: str
    device_id: str
    total_tokens: int = Field(description="image tokens")
    prefix_tokens: int = Field(description="tokens the cloud made first (prefix injection)")
    cloud_tokens: int = Field(description="tokens the cloud decided (prefix, verified spans, corrections, bursts)")
    device_tokens: int = Field(description="tokens the device accepted locally, without the cloud")
    cloud_requests: int = Field(description="device -> cloud round trips (the open included)")
    verifications: int
    resumes: int = Field(description="sessions re-created on another verifier replica")
    degraded: int = Field(description="1: the cloud became unreachable and the device finished alone")
    cloud_call_rate: float | None = None
    mean_accepted_length: float | None = None
    device_s: float = Field(description="simulated device compute seconds")
    cloud_s: float = Field(description="cloud compute seconds")
    comm_s: float = Field(description="simulated network seconds")
    total_s: float | None = Field(None, description="device + cloud + comm seconds")
    wall_s: float = Field(description="seconds the device replica spent on the image")


class ImageData(BaseModel):
    """One image (OpenAI's `data[i]`): `b64_json` or `tokens` + `who`, with its seed and stats."""

    b64_json: str | None = Field(None, description="the PNG in base64 (response_format b64_json)")
    tokens: list[int] | None = Field(None, description="image token ids, row-major (response_format tokens)")
    who: list[Literal["cloud", "device"]] | None = Field(None, description="per token, who decided it: cloud "
                                                          "(prefix, verified drafts, corrections, bursts) or device "
                                                          "(accepted locally, never seen by the cloud)")
    seed: int = Field(description="the seed of this image (the request's seed + its index)")
    stats: ImageStats


class ImagesResponse(BaseModel):
    """The JSON answer of POST /v1/images/generations (also the stream's `result` event)."""

    created: int = Field(description="Unix time")
    data: list[ImageData]
    stats: ImageStats = Field(description="the first image's stats (data[0].stats)")


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_request, invalid_json, unauthorized, too_large, overloaded, "
                      "starting, unavailable, timeout, killed_devices, internal")
    field: str | None = Field(None, description="the request field at fault (e.g. prompt, params.tau, size, "
                              "authorization, body)")
    message: str = Field(min_length=1)


class ErrorResponse(BaseModel):
    """The body of every error answer (4xx, 5xx, and the stream's `error` event)."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ciar"
    kind: Literal["method", "world"] = Field(description="method: a decoding method; world: the served world "
                                             "(its default method, ciar, applies)")
    sizes: list[str] = Field(description="the sizes this model makes (`size`)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------ ingress <-> device fleet
class GenerationJob(BaseModel):
    """One image for one device (a Device replica's `generate` / `generate_stream`), validated by the ingress."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    session_id: str = Field(min_length=1)
    prompt: str
    seed: int = Field(ge=0)
    method: Literal[METHODS] = "ciar"  # type: ignore[valid-type]
    network: Literal[NETWORKS] = "5g"  # type: ignore[valid-type]
    collab: CollabOverrides = Field(default_factory=CollabOverrides, description="the request's collaborative "
                                    "knobs; unset: the device fleet's live defaults")
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides, description="the request's sampling "
                                        "knobs; unset: the world's")
    timeout_s: float | None = Field(None, gt=0.0, description="seconds the device may spend on it (the request's "
                                    "deadline, request_timeout_s): no call to the verifier waits past it")
    device_exit_after: OptionalInteger = DEVICE_EXIT_AFTER[1]

    @classmethod
    def of(cls, req: GenerationRequest, session_id: str, index: int = 0,
           timeout_s: float | None = None) -> "GenerationJob":
        """Image `index` of a request: seed + index."""
        return cls(session_id=session_id, prompt=req.prompt, seed=req.seed + index, method=req.method,
                   network=req.network, collab=req.params.collab(), sampling=req.params.sampling(),
                   timeout_s=timeout_s, device_exit_after=req.params.device_exit_after)


class GenerationOutput(BaseModel):
    """What a device answers for one job."""

    tokens: list[int]  # [N] row-major
    who: list[Literal["cloud", "device"]]  # [N] who decided each token
    png: bytes
    stats: dict[str, Any]  # ImageStats' fields (and more)


class ProgressEvent(BaseModel):
    """A streamed step: tokens decided so far and, until the last, a preview PNG (undecided tokens filled)."""

    tokens_done: int
    tokens_total: int
    cloud_requests: int
    cloud_tokens: int
    preview_png: bytes | None = None
