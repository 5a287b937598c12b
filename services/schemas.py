"""Pydantic models of the HTTP API and of the application config (validated with errors that name the field).

    GenerationRequest   body of POST /v1/images/generations
    AppConfig           the builder's args in serve_config.yaml (deployment sizes, API keys, weights)
    DeviceLiveConfig    `user_config` of the Device deployment (tau, span, prefix rate, slowdown): live via reconfigure
    VerifierLiveConfig  `user_config` of the Verifier deployment (batch size, batch wait, idle timeout): live
"""

# No `from __future__ import annotations`: FastAPI and pydantic must see the classes themselves.
import hashlib
import math
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ciar.collab.decoder import METHODS

MAX_PROMPT_CHARS = 400
NETWORKS = ("5g", "4g", "wifi", "none")
API_KEYS_ENV = "CIAR_API_KEYS"


class MethodParams(BaseModel):
    """Per-request knobs; None keeps the deployment's live default (or the world's sampling default)."""

    model_config = ConfigDict(extra="forbid")
    tau: float | None = Field(None, ge=0.0, le=1e6, description=(
        "ciar: gate threshold on the gate's own scale (default: the device model's calibrated one)"))
    burst: int | None = Field(None, ge=0, le=256, description=(
        "ciar: cloud burst, tokens the cloud samples itself after a rejection (default: the device model's)"))
    span: int | None = Field(None, ge=1, le=32, description="draft tokens per verification")
    prefix_rate: float | None = Field(None, ge=0.0, le=1.0, description="fraction of tokens the cloud makes first")
    inter_enhance: bool | None = Field(None, description="send interval features with locally accepted tokens")
    device_slowdown: float | None = Field(None, ge=1.0, le=100.0, description="simulated device compute factor")
    cfg_scale: float | None = Field(None, ge=1.0, le=20.0, description="classifier-free guidance scale")
    temperature: float | None = Field(None, ge=0.0, le=5.0, description="0 = greedy")
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="0 disables top-k")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="1 disables top-p")
    link_drop_after: int | None = Field(None, ge=0, le=100_000, description=(
        "simulation: the device's link goes down after this many messages; the device finishes the image alone "
        "and the result is marked degraded (stats.degraded)"))

    def collab_overrides(self) -> dict:
        keys = ("tau", "burst", "span", "prefix_rate", "inter_enhance", "device_slowdown", "link_drop_after")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def sampling_overrides(self) -> dict:
        keys = ("cfg_scale", "temperature", "top_k", "top_p")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="caption of the image")
    seed: int = Field(0, ge=0, le=2**62, description="same prompt + seed -> same image")
    method: Literal[METHODS] = Field("ciar", description="decoding method")  # type: ignore[valid-type]
    params: MethodParams = Field(default_factory=MethodParams)
    network: Literal[NETWORKS] = Field("5g", description="simulated device link")  # type: ignore[valid-type]
    response_format: Literal["b64_json", "png", "tokens"] = "b64_json"
    stream: bool = Field(False, description="server-sent events with progress and partial previews")

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt must not be blank")
        return v  # (pydantic itself refuses strings with lone surrogates: "string_unicode")


class DeviceLiveConfig(BaseModel):
    """Live defaults of the device fleet (Serve `user_config` -> `reconfigure`)."""

    model_config = ConfigDict(extra="forbid")
    tau: float | None = Field(None, ge=0.0, description=(
        "CIAR gate threshold; null: the device model's calibrated one (its file's metadata, pipelines.calibrate)"))
    gate: str | None = Field(None, description="CIAR gate; null: the device model's calibrated gate")
    burst: int | None = Field(None, ge=0, le=256, description="cloud burst g; null: the device model's")
    span: int = Field(4, ge=1, le=32)
    prefix_rate: float = Field(0.06, ge=0.0, le=1.0)
    device_slowdown: float = Field(1.0, ge=1.0, le=100.0, description="simulated device compute factor")
    realtime: bool = Field(True, description="spend simulated network/device time for real (the request waits)")
    preview_every: int = Field(24, ge=1, le=10_000, description="tokens between streamed previews")

    @field_validator("tau")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and math.isnan(v):
            raise ValueError("tau must not be NaN")
        return v

    @field_validator("gate")
    @classmethod
    def _known_gate(cls, v: str | None) -> str | None:
        from ciar.collab.gating import GATES

        if v is not None and v not in GATES:
            raise ValueError(f"gate must be one of {GATES}")
        return v


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

    def scheduler(self):
        from ciar.collab.engine import SchedulerConfig

        return SchedulerConfig(token_budget=self.token_budget, max_works=self.max_batch_size,
                               prefill_chunk=self.prefill_chunk)


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
    device_num_cpus: float = Field(0.2, gt=0.0)
    device_max_queued_requests: int = Field(32, ge=1, description="beyond this, 503 + Retry-After")
    device: DeviceLiveConfig = Field(default_factory=DeviceLiveConfig)
    # verifier pool: cloud model replicas
    verifier_replicas: int = Field(1, ge=1, le=1024)
    verifier_autoscaling: dict | None = Field(None, description="Serve autoscaling_config of the verifier pool")
    verifier_num_cpus: float = Field(1.0, gt=0.0)
    verifier_num_gpus: float = Field(0.0, ge=0.0)
    verifier_threads: int = Field(1, ge=1, le=256, description="torch CPU threads per verifier replica (a CPU "
                                  "replica with N cores: N; irrelevant on a GPU)")
    verifier_max_sessions: int = Field(64, ge=1, le=100_000, description="KV-cache slots (sessions) per replica")
    verifier: VerifierLiveConfig = Field(default_factory=VerifierLiveConfig)
    allow_unauthenticated: bool = Field(False, description="accept requests without a key (only when no keys)")
    ingress_num_cpus: float = Field(0.1, gt=0.0)
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    ingress_max_queued_requests: int = Field(1024, ge=1, description="HTTP requests waiting for the ingress beyond "
                                             "this get 503 + Retry-After from Serve's proxy (BackpressureConfig)")
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0.0)
    retry_after_s: int = Field(2, ge=1, le=3600, description="Retry-After of 503 answers")
    request_timeout_s: float = Field(300.0, gt=0.0)

    def world_dict(self) -> dict:
        """The served world, validated now (every file checked, the missing one named) and handed to the replicas as
        a dict with absolute paths."""
        from ciar.world_spec import read_world, spec_dict, world_source

        return spec_dict(read_world(world_source(self.world, self.weights_dir), need_device=True, need_text=True))

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        for k in v:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise ValueError("api keys must be at least 8 characters with no whitespace")
        return v

    @field_validator("api_key_sha256")
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


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
