"""Ray Serve application: HTTP ingress + cloud generator over the shipped default world.

    serve run serve_config.yaml          # or: make serve
    curl -s localhost:8000/healthz
    curl -s -X POST localhost:8000/v1/images/generations -H 'content-type: application/json' \
         -d '{"prompt": "a large red circle at the center on a black background", "seed": 0, "response_format": "png"}' \
         -o red.png

This first cut serves cloud-only decoding (`method: "cloud"`); the CIAR device fleet, the span-batching verifier
pool and API keys come with the serving issue. Deployments are thin: all generation logic lives in `ciar/`.
"""


# No `from __future__ import annotations` in this module: FastAPI must see the request model class itself.
import base64
import io
import time
from typing import Literal

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from ciar.decoding.generate import generate_cloud
from ciar.decoding.sampling import SamplingParams
from ciar.models.vq import tensor_to_images
from ciar.text import CaptionTooLongError
from ciar.world import load_default_world

MAX_PROMPT_CHARS = 400


class SamplingOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cfg_scale: float | None = Field(None, ge=1.0, le=20.0, description="classifier-free guidance scale")
    temperature: float | None = Field(None, ge=0.0, le=5.0, description="0 = greedy")
    top_k: int | None = Field(None, ge=0, description="0 disables top-k")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="1 disables top-p")


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="caption of the image")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="same prompt + seed -> same image")
    method: Literal["cloud"] = Field("cloud", description="decoding method")
    params: SamplingOverrides = Field(default_factory=SamplingOverrides)
    response_format: Literal["b64_json", "png", "tokens"] = "b64_json"


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights_dir: str | None = Field(None, description="folder with tokenizer/cloud weights (default: shipped)")
    generator_num_cpus: float = Field(1.0, gt=0)
    generator_num_gpus: float = Field(0.0, ge=0)
    generator_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(4, ge=1)
    max_queued_requests: int = Field(16, ge=1)


@serve.deployment
class CloudGenerator:
    """Holds the cloud model, tokenizer and text encoder; one request = one image."""

    def __init__(self, weights_dir: str | None):
        torch.set_num_threads(1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.world = load_default_world(weights_dir, device=device) if weights_dir else load_default_world(device=device)

    def generate(self, prompt: str, seed: int, overrides: dict) -> dict:
        base = self.world.sampling
        params = SamplingParams(**{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
        t0 = time.perf_counter()
        cap = self.world.text.encode([prompt])
        tokens = generate_cloud(self.world.cloud, cap.emb, cap.mask, params, torch.Generator().manual_seed(seed))
        image = tensor_to_images(self.world.vq.decode_code(tokens))[0].numpy()
        seconds = time.perf_counter() - t0
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        n = tokens.shape[1]
        return {"png": buf.getvalue(), "tokens": tokens[0].tolist(),
                "stats": {"method": "cloud", "tokens_total": n, "cloud_tokens": n, "cloud_call_rate": 1.0,
                          "latency_s": {"cloud": seconds, "device": 0.0, "comm": 0.0, "total": seconds},
                          "sampling": params.__dict__}}


api = FastAPI(title="CIAR image generation")


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, generator: DeploymentHandle):
        self.generator = generator

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @api.post("/v1/images/generations")
    async def generations(self, req: GenerationRequest):
        try:
            out = await self.generator.generate.remote(req.prompt, req.seed, req.params.model_dump())
        except CaptionTooLongError as e:  # raised inside the replica, re-raised here by Ray
            return JSONResponse({"error": {"field": "prompt", "message": str(e)}}, status_code=422)
        except Exception as e:  # noqa: BLE001 - a Ray task error wraps the replica's exception
            cause = getattr(e, "cause", None)
            if isinstance(cause, (CaptionTooLongError, ValueError)):
                return JSONResponse({"error": {"field": "prompt", "message": str(cause)}}, status_code=422)
            raise
        if req.response_format == "png":
            return Response(out["png"], media_type="image/png")
        item = {"tokens": out["tokens"]} if req.response_format == "tokens" else \
            {"b64_json": base64.b64encode(out["png"]).decode()}
        return {"created": int(time.time()), "data": [item], "stats": out["stats"]}


def build_app(args: dict) -> serve.Application:
    """Builder the Serve YAML points at (`import_path: services.app:build_app`)."""
    cfg = AppConfig(**(args or {}))
    generator = CloudGenerator.options(
        num_replicas=cfg.generator_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options={"num_cpus": cfg.generator_num_cpus, "num_gpus": cfg.generator_num_gpus},
    ).bind(cfg.weights_dir)
    return Ingress.options(ray_actor_options={"num_cpus": 0.1}).bind(generator)
