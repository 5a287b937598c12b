"""The CIAR Ray Serve application: HTTP ingress -> simulated device fleet -> verifier pool (docs/architecture.md §4).

    serve run serve_config.yaml          # or: make serve
    curl -s localhost:8000/healthz
    curl -s -X POST localhost:8000/v1/images/generations -H 'authorization: Bearer ciar-dev-key' \
         -H 'content-type: application/json' \
         -d '{"prompt": "a large red circle at the center on a black background", "seed": 0, "method": "ciar",
              "network": "5g", "response_format": "png"}' -o red.png

The API follows OpenAI's Images API (`openai.OpenAI(base_url="http://HOST:8000/v1", api_key=KEY)
.images.generate(prompt=..., model="ciar", n=2, size="48x48")` works on the shipped world) and documents itself:
/openapi.json (typed request, answers and every error status with its body), /docs. GET / is the playground page
(services/playground.html).

Deployments (thin; all generation logic lives in `ciar/`):
  Ingress   FastAPI: API keys, pydantic validation (4xx naming the field), 503 + Retry-After on overload,
            JSON / PNG / tokens responses, server-sent events with progress and previews, Prometheus metrics,
            GET /v1/models, the playground page and its browser runtime
  Device    one replica = one simulated phone (services.device)
  Verifier  cloud model replicas with session-affine routing and cross-session span batching (services.verifier)

The Ingress is its routes and the checks a request meets on this deployment (keys, readiness, the served world);
what it answers lives beside it: the OpenAPI contract (services.openapi), error bodies, the images and the event
stream (services.answers), the static files (services.web).

`build_app(args)` is the pure builder `serve_config.yaml` points at; `args` is `services.config.AppConfig`.
"""

# No `from __future__ import annotations` in this module: FastAPI must see the request model class itself.
import asyncio
import hmac
import json
import logging
import uuid

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from ciar.collab.knobs import check_method_overrides
from ciar.engine import heap
from services import answers, web
from services.answers import error_body
from services.config import AppConfig, DeviceEndpointConfig, key_digest
from services.device import Device
from services.device_endpoint import DeviceEndpoint
from services.device_retry import LostPhones
from services.metrics import IngressMetrics
from services.openapi import (DESCRIPTION, GENERATION_EXTRA, GENERATION_RESPONSES, HEALTHZ_RESPONSES, MODELS_EXTRA,
                              MODELS_RESPONSES, TITLE, VERSION, docs_page, openapi_schema)
from services.readiness import Readiness
from services.routing import ROUTER_CLASS
from services.schemas import (SIMULATION_PARAMS, GenerationJob, GenerationOutput, GenerationRequest, ModelCard,
                              ModelList, accepted_models)
from services.verifier import Verifier
from services.verifier_client import RayVerifierBackend

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 16 * 1024

# /openapi.json and /docs are the ingress's own routes (below): the schema names the served world's size and alias
api = FastAPI(title=TITLE, version=VERSION, description=DESCRIPTION, openapi_url=None, docs_url=None,
              redoc_url=None)
api.add_exception_handler(RequestValidationError, answers.validation_error)  # 422 naming the field (400: not JSON)


@serve.deployment
@serve.ingress(api)
class Ingress:
    async def __init__(self, device: DeploymentHandle, key_hashes: list[str], allow_unauthenticated: bool,
                       retry_after_s: int, request_timeout_s: float, max_images: int = 4,
                       verifier: DeploymentHandle | None = None, device_key_hashes: list[str] | None = None,
                       endpoint: dict | None = None, allow_simulation_params: bool = False,
                       verifier_call_timeout_s: float = 60.0):
        self.device = device
        # the served world (alias, size) as a device reports it, and whether the cluster can serve (has served) now:
        # until it has been ready once, every generation request is answered 503 + Retry-After
        self.ready = Readiness(device, verifier, request_timeout_s)
        self.allow_simulation_params = allow_simulation_params
        self.max_images = max_images
        self._openapi: dict | None = None  # the document with the world's sizes and alias, once known
        self.key_hashes = [bytes.fromhex(h) for h in key_hashes]
        self.open = allow_unauthenticated and not key_hashes
        self.retry_after_s = retry_after_s
        self.timeout_s = request_timeout_s
        self.metrics = IngressMetrics()
        self.phones = LostPhones(lambda: self.metrics.error("device_lost"))  # simulated phones lost
        # real devices over the WebSocket endpoint, against the same verifier pool as the simulated devices
        self.endpoint = None if verifier is None else DeviceEndpoint(
            RayVerifierBackend(verifier, verifier_call_timeout_s), device_key_hashes or [],
            DeviceEndpointConfig(**(endpoint or {})).limits(retry_after_s),
            observe=self.metrics.device_event)
        heap.freeze(log=logger.info)  # its start-up out of the collector's reach: no full collection stalls requests

    async def heap_stats(self) -> dict:
        """This replica's collector (`ciar.engine.heap.stats`): over its handle only, not a route."""
        return heap.stats()

    # ------------------------------------------------------------------ auth / limits / readiness
    @staticmethod
    def _bearer(request: Request) -> str:
        """The key of an `Authorization: Bearer <key>` header ("" when there is none)."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return key.strip() if scheme.lower() == "bearer" else ""

    def _authorized(self, request: Request) -> bool:
        if self.open:
            return True
        key = self._bearer(request)
        if not key:
            return False
        digest = bytes.fromhex(key_digest(key))
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

    def _starting(self, missing: list[str]) -> JSONResponse:
        return self._overloaded(f"the cluster is starting: no {' or '.join(missing)} replica can take work yet; "
                                "retry after Retry-After seconds", kind="starting")

    # ------------------------------------------------------------------ routes
    @api.get("/healthz", responses=HEALTHZ_RESPONSES)
    async def healthz(self):
        """Ready when an image can be served now: a Device replica has answered and a Verifier replica answers
        (checked at most every 2 s). Until then 503 with Retry-After, as the generation API answers."""
        missing = await self.ready.missing()
        if missing:
            r = JSONResponse({"status": "starting" if not self.ready.started else "unavailable", "missing": missing},
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
        if not self.ready.started and (missing := await self.ready.missing()):  # it reconnects after the retry time
            await ws.accept()
            from ciar_device import wire

            await ws.close(code=wire.CLOSE_OVERLOADED, reason=f"the cluster is starting (no {' or '.join(missing)}): "
                           f"retry after {self.retry_after_s} s")
            return
        await self.endpoint.serve(ws)

    def _device_refusal(self, request: Request) -> JSONResponse | None:
        """None for a request that carries a device key (Bearer), else the 401 to answer."""
        if self.endpoint is not None and self.endpoint.device_of(self._bearer(request)) is not None:
            return None
        return error_body(401, "a device key is required (Authorization: Bearer <device key>)",
                          field="authorization", kind="unauthorized")

    @api.get("/v1/device/model", include_in_schema=False)
    async def device_model(self, request: Request):
        """The device model for real devices: the export's manifest (graphs with sha256 and size, the calibrated
        CIAR defaults, sampling, protocol facts). Authorised by a device key (Bearer)."""
        if (refused := self._device_refusal(request)) is not None:
            return refused
        return web.device_model_response(await self.ready.world())

    @api.get("/v1/device/model/{name}", include_in_schema=False)
    async def device_model_file(self, name: str, request: Request):
        """One graph of the manifest (only the files it names)."""
        if (refused := self._device_refusal(request)) is not None:
            return refused
        return web.device_model_file_response(await self.ready.world(), name)

    @api.get("/web/ort/", include_in_schema=False)
    async def ort_status(self) -> dict:
        """Whether the browser device can run: onnxruntime-web's version and files, or how to enable it."""
        return web.ort_status()

    @api.get("/web/ort/{name}", include_in_schema=False)
    async def ort_file(self, name: str):
        """onnxruntime-web's installed files (services.web): the page's runtime, never fetched from the internet."""
        return web.ort_file_response(name)

    @api.get("/web/device/{name}", include_in_schema=False)
    async def device_script(self, name: str):
        """The browser device's modules (web/src): the page's Web Worker runs the CIAR loop with them."""
        return web.device_file_response(name)

    @api.get("/", include_in_schema=False)
    async def playground(self) -> HTMLResponse:
        """The playground page: one static file, no build step, nothing fetched from the internet."""
        return web.playground_page()

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        try:
            world = await self.ready.world()
        except Exception:  # noqa: BLE001 - the generic document rather than none (not kept: asked again next time)
            return JSONResponse(openapi_schema(api, None, self.max_images, self.allow_simulation_params))
        if self._openapi is None:  # built once: the served world does not change under a replica
            self._openapi = openapi_schema(api, world, self.max_images, self.allow_simulation_params)
        return JSONResponse(self._openapi)

    @api.get("/docs", include_in_schema=False)
    async def docs(self) -> HTMLResponse:
        return docs_page(api)

    @api.get("/v1/models", response_model=ModelList, openapi_extra=MODELS_EXTRA, responses=MODELS_RESPONSES)
    async def models(self, request: Request):
        """What `model` accepts (OpenAI's model list): every decoding method, and the world's alias."""
        if not self._authorized(request):
            return self._unauthorized()
        try:
            world = await self.ready.world()
        except Exception as e:  # noqa: BLE001
            return self._overloaded(f"no device answered: {type(e).__name__}", kind="unavailable")
        return ModelList(data=[ModelCard(id=m, kind=kind, sizes=[world["size"]])
                               for m, kind in accepted_models(world).items()])

    @api.post("/v1/images/generations", response_model=None, responses=GENERATION_RESPONSES,
              openapi_extra=GENERATION_EXTRA)
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
        if not self.ready.started and (missing := await self.ready.missing()):
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
            return answers.invalid_request(getattr(e, "errors", lambda: [])())
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
            return answers.stream(req, jobs[0], self.device, self.phones, self.timeout_s, self._observe,
                                  self._failure)
        try:  # n images on n devices at once (a device makes one image at a time)
            outs = await asyncio.wait_for(asyncio.gather(*(self._on_device(j) for j in jobs)),
                                          timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP status below
            return self._failure(req, e)
        self._observe(req, [o.stats for o in outs], 200)
        return answers.render(req, jobs, outs)

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
            world = await self.ready.world()
        except Exception as e:  # noqa: BLE001
            return req, self._overloaded(f"no device answered: {type(e).__name__}", kind="unavailable")
        if req.size not in (None, "auto", world["size"]):
            return req, error_body(400, f"size {req.size!r} is not made by this world; accepted sizes: "
                                   f"{world['size']}", field="size")
        models = accepted_models(world)
        if req.model is not None:
            if req.model not in models:
                return req, error_body(400, f"unknown model {req.model!r}; accepted: {', '.join(models)} "
                                       "(GET /v1/models)", field="model")
            if models[req.model] == "method":  # (then the request has no `method`: GenerationRequest refuses both)
                req = req.model_copy(update={"method": req.model})
        return req, None

    def _failure(self, req: GenerationRequest, e: BaseException) -> JSONResponse:
        """A generation's failure -> its answer, by the one table both the API and the device socket read
        (`services.answers.failure`); 5xx answers count as errors of their kind, internal ones are logged."""
        rule, r = answers.failure(e, self.retry_after_s, self.timeout_s)
        self.metrics.request(req.method, rule.status)
        if rule.status >= 500:
            self.metrics.error(rule.kind)
        return r

    def _observe(self, req: GenerationRequest, images: list[dict], code: int) -> None:
        """One request answered `code`, with these images' stats."""
        self.metrics.request(req.method, code)
        for stats in images:
            self.metrics.image(req.method, stats)


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
           memory_utilization=cfg.verifier_memory_utilization, cuda_graphs=cfg.verifier_cuda_graphs,
           fused_step=cfg.verifier_fused_step, overlap=cfg.verifier_overlap, packed_step=cfg.verifier_packed_step,
           compiled_judge=cfg.verifier_compiled_judge,
           engine_process=cfg.verifier_engine_process)


def build_app(args: dict | None = None) -> serve.Application:
    """Builder the Serve YAML points at (`import_path: services.app:build_app`)."""
    cfg = AppConfig(**(args or {}))
    key_hashes = cfg.key_digests()
    if not key_hashes and not cfg.allow_unauthenticated:
        raise ValueError("no API keys configured: set api_key_sha256 (or api_keys) in serve_config.yaml or "
                         "$CIAR_API_KEYS (comma-separated), or allow_unauthenticated: true for a private test cluster")
    world = _world(cfg)
    verifier = _verifier(cfg, cfg.session_secret(), world)
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
    return _verifier(cfg, cfg.session_secret(), _world(cfg))


def _world(cfg: AppConfig) -> dict:
    """The served world, validated (every file checked) before any replica starts."""
    try:
        return cfg.world_dict()
    except ValueError as e:
        raise ValueError(f"world: {e}") from None
