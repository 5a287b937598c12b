"""Pydantic models of the HTTP API and of what the ingress and a Device replica pass each other (validated with
errors that name the field); the application's config is `services.config`.

    GenerationRequest   body of POST /v1/images/generations (OpenAI's Images API fields + CIAR's own)
    ImagesResponse      its JSON answer (ImageData per image, ImageStats); ErrorResponse: every error's body
    ModelList           GET /v1/models (`accepted_models`: what `model` accepts)
    MethodParams        the request's `params`: its collaborative knobs (CollabOverrides) and sampling knobs
                        (SamplingOverrides) in one object
    GenerationJob / GenerationOutput / ProgressEvent
                        what the ingress and a Device replica pass each other (typed, as Ray Serve LLM passes
                        pydantic requests between its deployments; the job's knobs as CollabOverrides)

The collaborative knobs are declared once, in `ciar.collab.knobs` (type, range, default, description, who may set
them); `knob_field` turns one into a pydantic field, so MethodParams, CollabOverrides and the device fleet's live
defaults (`services.config.DeviceLiveConfig`) state the same ranges as `CollabConfig.validate` checks.
"""

# No `from __future__ import annotations`: FastAPI and pydantic must see the classes themselves.
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, create_model, field_validator

from ciar.collab.knobs import KNOBS, REQUEST_KNOBS, SIMULATION_KNOBS, Knob
from ciar.collab.names import METHODS, NETWORKS

MAX_PROMPT_CHARS = 400
# not blank: one character that is white space neither to Python (str.isspace) nor to JSON Schema's ECMA-262 regexes
PROMPT_PATTERN = r"[^\s\x1c-\x1f\x85\ufeff]"
MAX_IMAGES_LIMIT = 64  # `n` never exceeds this; AppConfig.max_images (services.config): the deployment's cap (<=)
RESPONSE_FORMATS = ("b64_json", "png", "tokens")  # "url" is refused with a 400 that says why
QUALITIES = ("auto", "standard", "hd", "low", "medium", "high", "xhigh", "max")  # OpenAI's: accepted, ignored
STYLES = ("vivid", "natural")  # OpenAI's values: accepted, ignored
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


def accepted_models(world: dict) -> dict[str, str]:
    """Accepted `model` values -> their kind: every method, and the world's alias (`world`: Device.world_info)."""
    return {**{m: "method" for m in METHODS}, world["id"]: "world"}


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
