"""The CIAR Ray Serve application: HTTP ingress -> simulated device fleet -> verifier pool (docs/architecture.md §4).

    serve run serve_config.yaml          # or: make serve
    curl -s localhost:8000/healthz
    curl -s -X POST localhost:8000/v1/images/generations -H 'authorization: Bearer ciar-dev-key' \
         -H 'content-type: application/json' \
         -d '{"prompt": "a large red circle at the center on a black background", "seed": 0, "method": "ciar",
              "network": "5g", "response_format": "png"}' -o red.png

The API follows OpenAI's Images API (`openai.OpenAI(base_url="http://HOST:8000/v1", api_key=KEY)
.images.generate(prompt=..., model="ciar", n=2, size="48x48")` works on the shipped world) and documents itself: /openapi.json (typed
request, answers and every error status with its body), /docs. GET / is the playground page (services/playground.html).

Deployments (thin; all generation logic lives in `ciar/`):
  Ingress   FastAPI: API keys, pydantic validation (4xx naming the field), 503 + Retry-After on overload,
            JSON / PNG / tokens responses, server-sent events with progress and previews, Prometheus metrics,
            GET /v1/models, the playground page and its browser runtime (services.web)
  Device    one replica = one simulated phone (services.device)
  Verifier  cloud model replicas with session-affine routing and cross-session span batching (services.verifier)

`build_app(args)` is the pure builder `serve_config.yaml` points at; `args` is `services.schemas.AppConfig`.
"""

# No `from __future__ import annotations` in this module: FastAPI must see the request model class itself.
import asyncio
import base64
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import time
import uuid

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from ciar.collab.knobs import check_method_overrides
from ciar.collab.names import METHODS
from services import errors, web
from services.device import Device
from services.device_endpoint import DeviceEndpoint
from services.device_retry import LostPhones
from services.metrics import IngressMetrics
from services.schemas import (SIMULATION_PARAMS, AppConfig, ErrorResponse, GenerationJob, GenerationOutput,
                              GenerationRequest, ImagesResponse, ModelCard, ModelList, ProgressEvent, key_digest)
from services.routing import ROUTER_CLASS
from services.verifier import Verifier
from services.verifier_client import RayVerifierBackend, within

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 16 * 1024
SESSION_SECRET_ENV = "CIAR_SESSION_SECRET"

PLAYGROUND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "playground.html")

# /openapi.json and /docs are the ingress's own routes (below): the schema names the served world's size and alias
api = FastAPI(title="CIAR image generation", version="1", openapi_url=None, docs_url=None, redoc_url=None,
              description="Text-to-image with collaborative decoding between simulated devices and a cloud model "
              "(CIAR). OpenAI Images API compatible (POST /v1/images/generations, GET /v1/models). Every error "
              "answers an ErrorResponse body naming the field at fault.")


def _error(description: str, headers: dict | None = None) -> dict:
    out = {"model": ErrorResponse, "description": description}
    if headers:
        out["headers"] = headers
    return out


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
AUTH_ERROR = _error("missing or invalid API key", {"WWW-Authenticate": {"description": "Bearer",
                                                                        "schema": {"type": "string"}}})
# one server-sent event as parsed from the stream (OpenAPI 3.1: the schema of text/event-stream is per event)
SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": ["progress", "result", "error"]},
    "data": {"type": "string", "contentMediaType": "application/json", "description": "progress: a ProgressEvent "
             "(preview_png as preview_b64); result: an ImagesResponse (every image with `who`); error: an "
             "ErrorResponse with `status`"}}}
GENERATION_RESPONSES = {
    200: {"model": ImagesResponse, "description": "the images: JSON (b64_json / tokens), the PNG itself "
          "(response_format png; header X-CIAR-Degraded), or with stream: server-sent events `progress` "
          "(tokens_done, tokens_total, cloud_requests, cloud_tokens, preview_b64), then `result` (this JSON, every "
          "image with `who`) or `error` (an ErrorResponse with `status`)",
          "content": {"image/png": {"schema": {"type": "string", "format": "binary"}},
                      "text/event-stream": {"schema": SSE_EVENT}}},
    400: _error("a request the schema admits but this deployment cannot serve: body not JSON, response_format url, "
                "size other than the world's, unknown model, n over max_images"),
    401: AUTH_ERROR,
    413: _error("request body over 16 KiB"),
    422: _error("a field out of range, of the wrong type or unknown (error.field names it), or `method` given with a "
                "`model` that names a method (the schema's `not`), or n > 1 with png or stream (its `allOf`); also "
                "params that make no valid method config (e.g. cloud with prefix_rate < 1), and the simulation params "
                "params.device_slowdown / params.link_drop_after / params.device_exit_after where the deployment does "
                "not allow them. While generating (error.type: when): " + errors.described(422)),
    500: _error("error.type: when. " + errors.described(500)),
    503: _error("the cluster is starting (error.type starting: no Device or Verifier replica can take work yet); "
                "while generating (error.type: when): " + errors.described(503) + ". Retry after Retry-After seconds",
                RETRY_AFTER),
    504: _error("error.type: when. " + errors.described(504) + "; retry after Retry-After seconds", RETRY_AFTER),
}
GENERATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/GenerationRequest"}}}}}
BEARER = [{"bearerAuth": []}]


def openapi_schema(world: dict | None = None, max_images: int | None = None,
                   allow_simulation_params: bool = False) -> dict:
    """The OpenAPI document: FastAPI's, plus the request body schema (the handler reads the raw body, to answer
    401 / 413 / 400 before parsing) and the bearer scheme; with the served `world` (Device.world_info) and the
    deployment's `max_images`, `size` and `model` list the accepted values and `n` its maximum."""
    doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    comps = doc.setdefault("components", {})
    body = GenerationRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.setdefault("schemas", {}).update(body.pop("$defs", {}))
    comps["schemas"]["GenerationRequest"] = body
    comps["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    props = body["properties"]
    if world is not None:
        props["size"] = {**props["size"], "anyOf": [{"type": "string", "enum": [world["size"], "auto"]},
                                                    {"type": "null"}]}
        props["model"] = {**props["model"], "anyOf": [{"type": "string", "enum": list(_models(world))},
                                                      {"type": "null"}]}
    if max_images is not None:
        props["n"] = {**props["n"], "maximum": max_images}
    if not allow_simulation_params:  # the deployment refuses them (422): the contract does not offer them
        params = comps["schemas"].get("MethodParams", {}).get("properties", {})
        for name in SIMULATION_PARAMS:
            params.pop(name, None)
    return doc


@functools.lru_cache(maxsize=1)
def _playground_html() -> str:
    with open(PLAYGROUND, encoding="utf-8") as f:
        return f.read()


def _models(world: dict) -> dict[str, str]:
    """Accepted `model` values -> their kind: every method, and the world's alias."""
    return {**{m: "method" for m in METHODS}, world["id"]: "world"}


def error_body(status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "field": field, "message": message}}, status_code=status)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_body(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                          field="body", kind="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                       for e in errors)
    return error_body(422, detail, field=field)


def json_safe(obj):
    """Non-finite floats -> None, recursively (JSON has no NaN / Infinity; Starlette refuses them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


@serve.deployment
@serve.ingress(api)
class Ingress:
    async def __init__(self, device: DeploymentHandle, key_hashes: list[str], allow_unauthenticated: bool,
                       retry_after_s: int, request_timeout_s: float, max_images: int = 4,
                       verifier: DeploymentHandle | None = None, device_key_hashes: list[str] | None = None,
                       endpoint: dict | None = None, allow_simulation_params: bool = False,
                       verifier_call_timeout_s: float = 60.0):
        self.device = device
        self.verifier = verifier
        # readiness (`readiness`): the last time a Verifier replica answered, the probe in flight, and whether the
        # cluster has been ready once (until then every generation request is answered 503 + Retry-After)
        self._verifier_seen = -math.inf
        self._probe: asyncio.Task | None = None
        self._started = False
        self.allow_simulation_params = allow_simulation_params
        self.max_images = max_images
        # the served world (alias, size) as a device reports it; asked once, in the background (a device serves one
        # call at a time, so the first answer may wait for a generation)
        self._world_task = asyncio.ensure_future(self._ask_world())
        self._openapi: dict | None = None  # the document with the world's sizes and alias, once known
        self.key_hashes = [bytes.fromhex(h) for h in key_hashes]
        self.open = allow_unauthenticated and not key_hashes
        self.retry_after_s = retry_after_s
        self.timeout_s = request_timeout_s
        self.metrics = IngressMetrics()
        self.phones = LostPhones(lambda: self.metrics.error("device_lost"))  # simulated phones lost
        # real devices over the WebSocket endpoint, against the same verifier pool as the simulated devices
        from services.schemas import DeviceEndpointConfig

        self.endpoint = None if verifier is None else DeviceEndpoint(
            RayVerifierBackend(verifier, verifier_call_timeout_s), device_key_hashes or [],
            DeviceEndpointConfig(**(endpoint or {})).limits(retry_after_s),
            observe=self.metrics.device_event)

    # ------------------------------------------------------------------ auth / limits
    def _authorized(self, request: Request) -> bool:
        if self.open:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        digest = bytes.fromhex(key_digest(key.strip()))
        return any(hmac.compare_digest(digest, h) for h in self.key_hashes)

    def _unauthorized(self) -> JSONResponse:
        self.metrics.error("unauthorized")
        r = error_body(401, "missing or invalid API key (Authorization: Bearer <key>)", field="authorization",
                       kind="unauthorized")
        r.headers["WWW-Authenticate"] = "Bearer"
        return r

    def _overloaded(self, message: str, kind: str = "overloaded") -> JSONResponse:
        self.metrics.error(kind)
        r = error_body(503, message, kind=kind)
        r.headers["Retry-After"] = str(self.retry_after_s)
        return r

    async def _ask_world(self) -> dict:
        info = await self.device.info.remote()
        return info["world"]

    async def world(self) -> dict:
        """The served world (Device.world_info); asked again if the first ask failed."""
        if self._world_task.done() and self._world_task.exception() is not None:
            self._world_task = asyncio.ensure_future(self._ask_world())
        return await asyncio.wait_for(asyncio.shield(self._world_task), timeout=self.timeout_s)

    # ------------------------------------------------------------------ readiness
    READY_TTL_S = 2.0  # a Verifier replica's answer counts as "ready" this long
    READY_TIMEOUT_S = 2.0  # a readiness probe waits at most this long

    async def _probe_verifier(self) -> bool:
        try:  # (past its time the probe is cancelled: none is left waiting in the router for a replica)
            await within(self.verifier.ready.remote(), self.READY_TIMEOUT_S, "a readiness probe")
        except Exception:  # noqa: BLE001 - not ready (starting, gone, or too slow to answer)
            return False
        self._verifier_seen = time.monotonic()
        return True

    async def readiness(self) -> list[str]:
        """What the cluster lacks to serve an image ([] when ready): a Device replica that has answered (the served
        world), and a Verifier replica that answered within READY_TTL_S (asked again, at most one probe at a time,
        waiting at most READY_TIMEOUT_S)."""
        missing = []
        if self._world_task.done() and self._world_task.exception() is not None:
            self._world_task = asyncio.ensure_future(self._ask_world())  # the last ask failed: ask again
        if not self._world_task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._world_task), self.READY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - no device answered yet
                pass
        if not self._world_task.done() or self._world_task.exception() is not None:
            missing.append("device")
        if self.verifier is not None and time.monotonic() - self._verifier_seen > self.READY_TTL_S:
            if self._probe is None or self._probe.done():
                self._probe = asyncio.ensure_future(self._probe_verifier())
            if not await asyncio.shield(self._probe):
                missing.append("verifier")
        if not missing:
            self._started = True
        return missing

    def _starting(self, missing: list[str]) -> JSONResponse:
        return self._overloaded(f"the cluster is starting: no {' or '.join(missing)} replica can take work yet; "
                                "retry after Retry-After seconds", kind="starting")

    # ------------------------------------------------------------------ routes
    @api.get("/healthz", responses={200: {"content": {"application/json": {"example": {"status": "ok"}}}},
                                    503: _error("not ready: a Device or Verifier replica cannot take work yet (the "
                                                "cluster is starting, or the verifier pool is down)", RETRY_AFTER)})
    async def healthz(self):
        """Ready when an image can be served now: a Device replica has answered and a Verifier replica answers
        (checked at most every 2 s). Until then 503 with Retry-After, as the generation API answers."""
        missing = await self.readiness()
        if missing:
            r = JSONResponse({"status": "starting" if not self._started else "unavailable", "missing": missing},
                             status_code=503)
            r.headers["Retry-After"] = str(self.retry_after_s)
            return r
        return {"status": "ok"}

    @api.websocket("/v1/device/sessions")
    async def device_sessions(self, ws: WebSocket) -> None:
        """Real devices: the CIAR protocol over a WebSocket (services.device_endpoint, ciar_device.wire)."""
        if self.endpoint is None:
            await ws.close(code=1008, reason="no device endpoint on this deployment")
            return
        if not self._started and (missing := await self.readiness()):  # a device reconnects after the retry time
            await ws.accept()
            from ciar_device import wire

            await ws.close(code=wire.CLOSE_OVERLOADED, reason=f"the cluster is starting (no {' or '.join(missing)}): "
                           f"retry after {self.retry_after_s} s")
            return
        await self.endpoint.serve(ws)

    def _device_refusal(self, request: Request) -> JSONResponse | None:
        """None for a request that carries a device key (Bearer), else the 401 to answer."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if self.endpoint is not None and scheme.lower() == "bearer" and \
                self.endpoint.device_of(key.strip()) is not None:
            return None
        return error_body(401, "a device key is required (Authorization: Bearer <device key>)",
                          field="authorization", kind="unauthorized")

    async def _device_model_dir(self) -> tuple[str | None, dict | None]:
        """The exported device model's folder and manifest (None, None when it was not exported)."""
        world = await self.world()
        path = os.path.join(world["model_dir"], "manifest.json")
        if not os.path.isfile(path):
            return None, None
        with open(path, encoding="utf-8") as f:
            return world["model_dir"], json.load(f)

    @api.get("/v1/device/model", include_in_schema=False)
    async def device_model(self, request: Request):
        """The device model for real devices: the export's manifest (graphs with sha256 and size, the calibrated
        CIAR defaults, sampling, protocol facts). Authorised by a device key (Bearer)."""
        if (refused := self._device_refusal(request)) is not None:
            return refused
        folder, manifest = await self._device_model_dir()
        if manifest is None:
            return error_body(404, "the device model is not exported on this deployment: run "
                              "`python -m pipelines.export_onnx` (make serve does)", kind="not_found")
        return JSONResponse(manifest)

    @api.get("/v1/device/model/{name}", include_in_schema=False)
    async def device_model_file(self, name: str, request: Request):
        """One graph of the manifest (only the files it names)."""
        from fastapi.responses import FileResponse

        if (refused := self._device_refusal(request)) is not None:
            return refused
        folder, manifest = await self._device_model_dir()
        files = {g["file"] for g in (manifest or {}).get("graphs", {}).values()}
        if name not in files:
            return error_body(404, f"no device model file {name!r}", field="name", kind="not_found")
        return FileResponse(os.path.join(folder, name), media_type="application/octet-stream")

    @api.get("/web/ort/", include_in_schema=False)
    async def ort_status(self) -> dict:
        """Whether the browser device can run: onnxruntime-web's version and files, or how to enable it."""
        return web.ort_status()

    @api.get("/web/ort/{name}", include_in_schema=False)
    async def ort_file(self, name: str):
        """onnxruntime-web's installed files (services.web): the page's runtime, never fetched from the internet."""
        from fastapi.responses import FileResponse

        try:
            path, media_type = web.ort_file(name)
        except LookupError as e:
            return error_body(404, str(e), field="name", kind="not_found")
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})

    @api.get("/web/device/{name}", include_in_schema=False)
    async def device_script(self, name: str):
        """The browser device's modules (web/src): the page's Web Worker runs the CIAR loop with them."""
        from fastapi.responses import FileResponse

        try:
            path = web.device_file(name)
        except LookupError as e:
            return error_body(404, str(e), field="name", kind="not_found")
        return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    @api.get("/", include_in_schema=False)
    async def playground(self) -> HTMLResponse:
        """The playground page: one static file, no build step, nothing fetched from the internet."""
        return HTMLResponse(_playground_html())

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        try:
            world = await self.world()
        except Exception:  # noqa: BLE001 - the generic document rather than none (not kept: asked again next time)
            return JSONResponse(openapi_schema(None, self.max_images, self.allow_simulation_params))
        if self._openapi is None:  # built once: the served world does not change under a replica
            self._openapi = openapi_schema(world, self.max_images, self.allow_simulation_params)
        return JSONResponse(self._openapi)

    @api.get("/docs", include_in_schema=False)
    async def docs(self) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{api.title} - docs")

    @api.get("/v1/models", response_model=ModelList, openapi_extra={"security": BEARER},
             responses={401: AUTH_ERROR, 503: _error("no device answered", RETRY_AFTER)})
    async def models(self, request: Request):
        """What `model` accepts (OpenAI's model list): every decoding method, and the world's alias."""
        if not self._authorized(request):
            return self._unauthorized()
        try:
            world = await self.world()
        except Exception as e:  # noqa: BLE001
            return self._overloaded(f"no device answered: {type(e).__name__}", kind="unavailable")
        return ModelList(data=[ModelCard(id=m, kind=kind, sizes=[world["size"]])
                               for m, kind in _models(world).items()])

    @api.post("/v1/images/generations", response_model=None, responses=GENERATION_RESPONSES,
              openapi_extra={**GENERATION_BODY, "security": BEARER})
    async def generations(self, request: Request):
        """Generate images from a caption (OpenAI Images API compatible; CIAR's own fields: GenerationRequest)."""
        try:
            return await self._generations(request)
        except Exception as e:  # noqa: BLE001 - never a bare 500: name the error, log the traceback
            logger.exception("unhandled error in the generations handler")
            self.metrics.error("internal")
            return error_body(500, f"internal error: {type(e).__name__}", kind="internal")

    async def _generations(self, request: Request):
        if not self._authorized(request):
            return self._unauthorized()
        if not self._started and (missing := await self.readiness()):
            return self._starting(missing)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            return error_body(413, f"request body over {MAX_BODY_BYTES} bytes", field="body", kind="too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return error_body(413, f"request body over {MAX_BODY_BYTES} bytes", field="body", kind="too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return error_body(400, f"request body is not valid JSON: {e}", field="body", kind="invalid_json")
        try:
            req = GenerationRequest.model_validate(body)
        except Exception as e:  # pydantic ValidationError
            return await _validation_error(request, RequestValidationError(getattr(e, "errors", lambda: [])()))
        req, refused = await self._resolve(req)
        if refused is not None:
            return refused
        if not self.allow_simulation_params:
            for name in SIMULATION_PARAMS:
                if getattr(req.params, name) is not None:
                    return error_body(422, f"params.{name} is a simulation knob this deployment does not accept "
                                      "(allow_simulation_params)", field=f"params.{name}")
        try:  # each knob's range is the schema's; the method may tie knobs together (cloud: prefix_rate 1). The
            # device checks the whole config once, with its live defaults merged (services.device.Device.config_for)
            check_method_overrides(req.method, req.params.collab().given())
        except ValueError as e:
            return error_body(422, str(e), field="params")
        # the device spends at most the request's deadline on each image (no call to the verifier waits past it)
        jobs = [GenerationJob.of(req, uuid.uuid4().hex, i, timeout_s=self.timeout_s) for i in range(req.n)]
        if req.stream:
            return StreamingResponse(self._events(req, jobs[0]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:  # n images on n devices at once (a device makes one image at a time)
            outs = await asyncio.wait_for(asyncio.gather(*(self._on_device(j) for j in jobs)),
                                          timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP status below
            return self._failure(req, e)
        self._observe(req, [o.stats for o in outs], 200)
        return self._render(req, jobs, outs)

    async def _on_device(self, job: GenerationJob) -> GenerationOutput:
        """One image on a simulated phone; a phone that dies under the job does not lose it: the job runs again
        from its start on a live one (`services.device_retry`: up to DEVICE_ATTEMPTS tries within the request's
        deadline, the same image under a new session id; a job that kills two phones is given up)."""
        tries = self.phones.attempts(job)
        while True:
            try:
                out = await self.device.generate.remote(tries.current)
            except Exception as e:  # noqa: BLE001 - only a lost phone is retried (tries.lost re-raises the rest)
                await tries.lost(e)
                continue
            tries.stamp(out.stats)
            return out

    async def _resolve(self, req: GenerationRequest) -> tuple[GenerationRequest, JSONResponse | None]:
        """The OpenAI fields checked against this deployment: -> (the request with `model` applied, None) or
        (req, a 400 naming the field)."""
        if req.response_format == "url":
            return req, error_body(400, "response_format 'url' is not supported: this server keeps no images to "
                                   "link to; use b64_json (or png / tokens)", field="response_format")
        if req.n > self.max_images:
            return req, error_body(400, f"n must be at most {self.max_images} on this deployment (max_images)",
                                   field="n")
        if req.n > 1 and (req.stream or req.response_format == "png"):  # the schema's allOf says so: 422
            return req, error_body(422, "n > 1 needs a JSON answer without stream (response_format b64_json or "
                                   "tokens)", field="n")
        if req.model is None and req.size is None:
            return req, None
        try:
            world = await self.world()
        except Exception as e:  # noqa: BLE001
            return req, self._overloaded(f"no device answered: {type(e).__name__}", kind="unavailable")
        if req.size not in (None, "auto", world["size"]):
            return req, error_body(400, f"size {req.size!r} is not made by this world; accepted sizes: "
                                   f"{world['size']}", field="size")
        models = _models(world)
        if req.model is not None:
            if req.model not in models:
                return req, error_body(400, f"unknown model {req.model!r}; accepted: {', '.join(models)} "
                                       "(GET /v1/models)", field="model")
            if models[req.model] == "method":  # (then the request has no `method`: GenerationRequest refuses both)
                req = req.model_copy(update={"method": req.model})
        return req, None

    def _failure(self, req: GenerationRequest, e: BaseException) -> JSONResponse:
        """A generation's failure -> its answer, by the one table both the API and the device socket read
        (`services.errors`); 5xx answers count as errors of their kind, internal ones are logged."""
        rule = errors.answer(e, errors.HTTP)
        cause = errors.root_cause(e)
        self.metrics.request(req.method, rule.status)
        if rule.status >= 500:
            self.metrics.error(rule.kind)
        if rule is errors.INTERNAL:
            logger.exception("generation failed: %s", type(e).__name__)
        text = rule.text(errors.HTTP, cause=e if rule.top else cause, name=type(cause).__name__,
                         timeout=self.timeout_s)
        r = error_body(rule.status, text, field=rule.field, kind=rule.kind)
        if rule.retry:
            r.headers["Retry-After"] = str(self.retry_after_s)
        return r

    def _observe(self, req: GenerationRequest, images: list[dict], code: int) -> None:
        """One request answered `code`, with these images' stats."""
        self.metrics.request(req.method, code)
        for stats in images:
            self.metrics.image(req.method, stats)

    def _render(self, req: GenerationRequest, jobs: list[GenerationJob], outs: list[GenerationOutput]):
        if req.response_format == "png":  # n = 1 (_resolve)
            return Response(outs[0].png, media_type="image/png",
                            headers={"X-CIAR-Degraded": str(int(bool(outs[0].stats.get("degraded"))))})
        # serialised here, inside the handler's error mapping (not by FastAPI after it returns)
        return JSONResponse(self._images(req, jobs, outs))

    @staticmethod
    def _images(req: GenerationRequest, jobs: list[GenerationJob], outs: list[GenerationOutput],
                who: bool = False) -> dict:
        """The ImagesResponse body: per image its seed and stats, and tokens + who (tokens) or b64_json; `who`:
        the per-token map with any format (the stream's result)."""
        data = []
        for job, out in zip(jobs, outs):
            item = {"seed": job.seed, "stats": out.stats}
            if req.response_format == "tokens":
                item.update(tokens=out.tokens, who=out.who)
            else:
                item["b64_json"] = base64.b64encode(out.png).decode()
                if who:
                    item["who"] = out.who
            data.append(item)
        return json_safe({"created": int(time.time()), "data": data, "stats": outs[0].stats})

    async def _events(self, req: GenerationRequest, job: GenerationJob):
        """Server-sent events: `progress` (tokens done, a partial preview as base64 PNG), then `result` (the same
        body as a non-streaming JSON answer, with the per-token map `who` whatever the format) or `error`."""
        def sse(event: str, data: dict) -> str:
            return f"event: {event}\ndata: {json.dumps(data)}\n\n"

        gen = None
        try:
            deadline = time.monotonic() + self.timeout_s  # the request's deadline holds for the stream too
            sent = -1  # tokens_done of the last progress event sent
            tries = self.phones.attempts(job)
            gen = self.device.options(stream=True).generate_stream.remote(tries.current)
            while True:
                try:
                    ev = await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - time.monotonic()))
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001 - a lost phone: as _on_device, the job runs again elsewhere
                    await tries.lost(e)
                    # the same image again from its start: the progress already sent is not repeated
                    gen = self.device.options(stream=True).generate_stream.remote(tries.current)
                    continue
                if isinstance(ev, ProgressEvent):
                    if ev.tokens_done <= sent:
                        continue
                    sent = ev.tokens_done
                    data = ev.model_dump(exclude={"preview_png"})
                    if ev.preview_png is not None:
                        data["preview_b64"] = base64.b64encode(ev.preview_png).decode()
                    yield sse("progress", data)
                else:
                    tries.stamp(ev.stats)
                    self._observe(req, [ev.stats], 200)
                    yield sse("result", self._images(req, [job], [ev], who=True))
        except Exception as e:  # noqa: BLE001 - reported in the stream (headers are already sent)
            if gen is not None:
                gen.cancel()  # past the deadline: the device's generation is cancelled, as a plain request's is
            resp = self._failure(req, e)
            yield sse("error", {"status": resp.status_code, **json.loads(resp.body)})


def _session_secret(cfg: AppConfig) -> str:
    """Signs session tokens; shared by the application's verifier replicas and stable across re-deploys of the same
    config (so a user_config change reconfigures replicas instead of restarting them). $CIAR_SESSION_SECRET when set
    (production: from the cluster's Secret); else derived from the plaintext keys ($CIAR_API_KEYS / api_keys), else
    from the key digests, which sit in the config and Serve's logs: fine for a laptop, not for production."""
    material = cfg.all_api_keys() or cfg.key_digests()
    return os.environ.get(SESSION_SECRET_ENV) or hashlib.sha256(
        ("ciar-session|" + "|".join(sorted(material)) + "|" + json.dumps(cfg.world_dict(), sort_keys=True)).encode()
    ).hexdigest()


AUTO_SESSIONS_CEILING = 1024  # the ongoing calls a memory-sized verifier replica is sent at most: 4x this


def _verifier(cfg: AppConfig, secret: str, world: dict):
    scale = {"autoscaling_config": cfg.verifier_autoscaling} if cfg.verifier_autoscaling else \
        {"num_replicas": cfg.verifier_replicas}
    return serve.deployment(Verifier).options(
        name="Verifier",
        **scale,
        # sized by memory at start-up ("auto"): beyond its slots a replica queues, then refuses (CapacityError)
        max_ongoing_requests=max(8, 4 * (AUTO_SESSIONS_CEILING if cfg.verifier_max_sessions == "auto"
                                         else cfg.verifier_max_sessions)),
        user_config=cfg.verifier.model_dump(),
        # Ray's consistent-hash router keyed by the handle's session_id (`handle.options(session_id=...)`), strict:
        # no fallback replica (a spill-over would only cost the session a re-prefill on the wrong replica)
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,  # Ray's ConsistentHashRouter with a fix (services.routing)
            request_router_kwargs={"num_fallback_replicas": 0}),
        ray_actor_options={"num_cpus": cfg.verifier_num_cpus, "num_gpus": cfg.verifier_num_gpus,
                           "resources": cfg.verifier_resources},
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
    ).bind(world, cfg.verifier_max_sessions, secret, threads=cfg.verifier_threads,
           memory_utilization=cfg.verifier_memory_utilization, cuda_graphs=cfg.verifier_cuda_graphs)


def build_app(args: dict | None = None) -> serve.Application:
    """Builder the Serve YAML points at (`import_path: services.app:build_app`)."""
    cfg = AppConfig(**(args or {}))
    key_hashes = cfg.key_digests()
    if not key_hashes and not cfg.allow_unauthenticated:
        raise ValueError("no API keys configured: set api_key_sha256 (or api_keys) in serve_config.yaml or "
                         "$CIAR_API_KEYS (comma-separated), or allow_unauthenticated: true for a private test cluster")
    world = _world(cfg)
    verifier = _verifier(cfg, _session_secret(cfg), world)
    device = serve.deployment(Device).options(
        name="Device",
        num_replicas=cfg.devices,
        max_ongoing_requests=1,
        max_queued_requests=cfg.device_max_queued_requests,
        user_config=cfg.device.model_dump(),
        ray_actor_options={"num_cpus": cfg.device_num_cpus, "resources": cfg.device_resources},
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
    ).bind(world, verifier, call_timeout_s=cfg.verifier_call_timeout_s, runtime=cfg.device_runtime)
    return Ingress.options(
        num_replicas=cfg.ingress_replicas,
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus, "resources": cfg.ingress_resources},
        max_ongoing_requests=cfg.ingress_max_ongoing_requests,
        # the proxy's own overload answer, shaped like ours (503 + Retry-After); the device fleet's queue is reached
        # through a handle, where Serve raises BackPressureError and the ingress answers it (`services.errors`)
        max_queued_requests=cfg.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.retry_after_s),
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
    ).bind(device, key_hashes, cfg.allow_unauthenticated, cfg.retry_after_s, cfg.request_timeout_s,
           max_images=cfg.max_images, verifier=verifier, device_key_hashes=cfg.device_key_digests(),
           endpoint=cfg.device_endpoint.model_dump(), allow_simulation_params=cfg.allow_simulation_params,
           verifier_call_timeout_s=cfg.verifier_call_timeout_s)


def build_verifier_app(args: dict | None = None) -> serve.Application:
    """The verifier pool alone (benchmarks.serving; a cloud-only deployment that devices outside Ray would call)."""
    cfg = AppConfig(**{"allow_unauthenticated": True, **(args or {})})
    return _verifier(cfg, _session_secret(cfg), _world(cfg))


def _world(cfg: AppConfig) -> dict:
    """The served world, validated (every file checked) before any replica starts."""
    try:
        return cfg.world_dict()
    except ValueError as e:
        raise ValueError(f"world: {e}") from None
