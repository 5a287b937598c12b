"""What the ingress answers (services.app): error bodies, a generation's images, and a streamed generation's events.

    error_body(422, "params.tau: ...", field="params")     # every 4xx / 5xx: an ErrorResponse naming the field
    invalid_request(exc.errors())                           # pydantic's errors -> 400 (not JSON) or 422
    failure(exc, retry_after_s, timeout_s)                  # a generation's failure -> (its rule, its answer)
    render(req, jobs, outs)                                 # the images: JSON (b64_json / tokens) or the PNG itself
    stream(req, job, device, phones, ...)                   # server-sent events: progress, then result or error

A failure is answered by the one table both the API and the device socket read (`services.errors`). JSON has no
NaN or Infinity: the stats' non-finite floats are sent as null (`json_safe`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
from typing import Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from services import errors
from services.device_retry import LostPhones
from services.schemas import GenerationJob, GenerationOutput, GenerationRequest, ProgressEvent

logger = logging.getLogger("ray.serve")


def error_body(status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "field": field, "message": message}}, status_code=status)


def invalid_request(errs: list[dict]) -> JSONResponse:
    """A body pydantic refused (its `errors()`) -> 400 when it is not JSON, else 422 naming the first field at
    fault, with every error in the message."""
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_body(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                          field="body", kind="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                       for e in errs)
    return error_body(422, detail, field=field)


async def validation_error(request, exc) -> JSONResponse:
    """FastAPI's RequestValidationError handler: `invalid_request`."""
    return invalid_request(exc.errors())


def failure(e: BaseException, retry_after_s: int, timeout_s: float) -> tuple[errors.Rule, JSONResponse]:
    """A generation's failure -> its rule and its answer (with Retry-After where the rule says so); an internal
    error is logged with its traceback."""
    rule = errors.answer(e, errors.HTTP)
    cause = errors.root_cause(e)
    if rule is errors.INTERNAL:
        logger.exception("generation failed: %s", type(e).__name__)
    text = rule.text(errors.HTTP, cause=e if rule.top else cause, name=type(cause).__name__, timeout=timeout_s)
    r = error_body(rule.status, text, field=rule.field, kind=rule.kind)
    if rule.retry:
        r.headers["Retry-After"] = str(retry_after_s)
    return rule, r


def json_safe(obj):
    """Non-finite floats -> None, recursively (JSON has no NaN / Infinity; Starlette refuses them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def render(req: GenerationRequest, jobs: list[GenerationJob], outs: list[GenerationOutput]) -> Response:
    """A plain (not streamed) generation's answer: the PNG itself (response_format png, n = 1) or the JSON body."""
    if req.response_format == "png":  # n = 1 (the ingress refuses more)
        return Response(outs[0].png, media_type="image/png",
                        headers={"X-CIAR-Degraded": str(int(bool(outs[0].stats.get("degraded"))))})
    # serialised here, inside the handler's error mapping (not by FastAPI after it returns)
    return JSONResponse(images_body(req, jobs, outs))


def images_body(req: GenerationRequest, jobs: list[GenerationJob], outs: list[GenerationOutput],
                who: bool = False) -> dict:
    """The ImagesResponse body: per image its seed and stats, and tokens + who (tokens) or b64_json; `who`: the
    per-token map with any format (the stream's result)."""
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


def sse(event: str, data: dict) -> str:
    """One server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def stream(req: GenerationRequest, job: GenerationJob, device, phones: LostPhones, timeout_s: float,
           observe: Callable, fail: Callable) -> StreamingResponse:
    """A streamed generation's answer: `events` as text/event-stream."""
    return StreamingResponse(events(req, job, device, phones, timeout_s, observe, fail),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def events(req: GenerationRequest, job: GenerationJob, device, phones: LostPhones, timeout_s: float,
                 observe: Callable, fail: Callable):
    """Server-sent events: `progress` (tokens done, a partial preview as base64 PNG), then `result` (the same body
    as a non-streaming JSON answer, with the per-token map `who` whatever the format) or `error`. `device`: the
    Device deployment's handle; a phone lost under the job is replaced as a plain request's is (`phones`);
    `observe(req, [stats], 200)` counts the answered image, `fail(req, exc)` answers a failure (its body is the
    error event)."""
    gen = None
    try:
        deadline = time.monotonic() + timeout_s  # the request's deadline holds for the stream too
        sent = -1  # tokens_done of the last progress event sent
        tries = phones.attempts(job)
        gen = device.options(stream=True).generate_stream.remote(tries.current)
        while True:
            try:
                ev = await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            except Exception as e:  # noqa: BLE001 - a lost phone: as a plain request's, the job runs again elsewhere
                await tries.lost(e)
                # the same image again from its start: the progress already sent is not repeated
                gen = device.options(stream=True).generate_stream.remote(tries.current)
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
                observe(req, [ev.stats], 200)
                yield sse("result", images_body(req, [job], [ev], who=True))
    except Exception as e:  # noqa: BLE001 - reported in the stream (headers are already sent)
        if gen is not None:
            gen.cancel()  # past the deadline: the device's generation is cancelled, as a plain request's is
        resp = fail(req, e)
        yield sse("error", {"status": resp.status_code, **json.loads(resp.body)})
