"""The HTTP API's OpenAPI contract (GET /openapi.json, browsable at GET /docs): the document's title and description,
the answers each route documents (every error status with its ErrorResponse body, what it means, its headers) and
`openapi_schema`, the document itself with the served world's sizes and model names.

    api = FastAPI(title=TITLE, version=VERSION, description=DESCRIPTION, ...)     # services.app
    @api.post("/v1/images/generations", responses=GENERATION_RESPONSES, openapi_extra=GENERATION_EXTRA)
    doc = openapi_schema(api, world, max_images=4)                                 # what /openapi.json answers

A generation's failures are described from the table that maps them to a status (`services.errors.described`), so
the contract lists every error the handler can answer (`tests/services/test_errors.py` checks it).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse

from services import errors
from services.schemas import SIMULATION_PARAMS, ErrorResponse, GenerationRequest, ImagesResponse, accepted_models

TITLE = "CIAR image generation"
VERSION = "1"
DESCRIPTION = ("Text-to-image with collaborative decoding between simulated devices and a cloud model (CIAR). OpenAI "
               "Images API compatible (POST /v1/images/generations, GET /v1/models). Every error answers an "
               "ErrorResponse body naming the field at fault.")


def error_doc(description: str, headers: dict | None = None) -> dict:
    """One documented error answer: an ErrorResponse body, what it means, and its headers."""
    out = {"model": ErrorResponse, "description": description}
    if headers:
        out["headers"] = headers
    return out


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
AUTH_ERROR = error_doc("missing or invalid API key", {"WWW-Authenticate": {"description": "Bearer",
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
    400: error_doc("a request the schema admits but this deployment cannot serve: body not JSON, response_format "
                   "url, size other than the world's, unknown model, n over max_images"),
    401: AUTH_ERROR,
    413: error_doc("request body over 16 KiB"),
    422: error_doc("a field out of range, of the wrong type or unknown (error.field names it), or `method` given with "
                   "a `model` that names a method (the schema's `not`), or n > 1 with png or stream (its `allOf`); "
                   "also params that make no valid method config (e.g. cloud with prefix_rate < 1), and the "
                   "simulation params params.device_slowdown / params.link_drop_after / params.device_exit_after "
                   "where the deployment does not allow them. While generating (error.type: when): "
                   + errors.described(422)),
    500: error_doc("error.type: when. " + errors.described(500)),
    503: error_doc("the cluster is starting (error.type starting: no Device or Verifier replica can take work yet); "
                   "while generating (error.type: when): " + errors.described(503)
                   + ". Retry after Retry-After seconds", RETRY_AFTER),
    504: error_doc("error.type: when. " + errors.described(504) + "; retry after Retry-After seconds", RETRY_AFTER),
}
BEARER = [{"bearerAuth": []}]
# the handler reads the raw body (to answer 401 / 413 / 400 before parsing): the document states it
GENERATION_EXTRA = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/GenerationRequest"}}}}, "security": BEARER}
HEALTHZ_RESPONSES = {200: {"content": {"application/json": {"example": {"status": "ok"}}}},
                     503: error_doc("not ready: a Device or Verifier replica cannot take work yet (the cluster is "
                                    "starting, or the verifier pool is down)", RETRY_AFTER)}
MODELS_RESPONSES = {401: AUTH_ERROR, 503: error_doc("no device answered", RETRY_AFTER)}
MODELS_EXTRA = {"security": BEARER}


def openapi_schema(app: FastAPI, world: dict | None = None, max_images: int | None = None,
                   allow_simulation_params: bool = False) -> dict:
    """The OpenAPI document of `app`'s routes: FastAPI's, plus the request body schema (the handler reads the raw
    body, to answer 401 / 413 / 400 before parsing) and the bearer scheme; with the served `world`
    (Device.world_info) and the deployment's `max_images`, `size` and `model` list the accepted values and `n` its
    maximum."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = doc.setdefault("components", {})
    body = GenerationRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.setdefault("schemas", {}).update(body.pop("$defs", {}))
    comps["schemas"]["GenerationRequest"] = body
    comps["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    props = body["properties"]
    if world is not None:
        props["size"] = {**props["size"], "anyOf": [{"type": "string", "enum": [world["size"], "auto"]},
                                                    {"type": "null"}]}
        props["model"] = {**props["model"], "anyOf": [{"type": "string", "enum": list(accepted_models(world))},
                                                      {"type": "null"}]}
    if max_images is not None:
        props["n"] = {**props["n"], "maximum": max_images}
    if not allow_simulation_params:  # the deployment refuses them (422): the contract does not offer them
        params = comps["schemas"].get("MethodParams", {}).get("properties", {})
        for name in SIMULATION_PARAMS:
            params.pop(name, None)
    return doc


def docs_page(app: FastAPI) -> HTMLResponse:
    """GET /docs: Swagger UI over GET /openapi.json."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")
