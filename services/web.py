"""What the ingress serves as files: the playground page (GET /), the browser device (its scripts, web/src, at
/web/device/; its runtime, onnxruntime-web's installed files, at /web/ort/) and the exported device model that real
devices download (/v1/device/model, authorised by a device key in services.app).

    make web                                  # npm ci --prefix web (web/package.json pins the version)
    curl -s localhost:8000/web/ort/           # {"available": true, "version": "1.30.0", "entry": "ort.min.mjs", ...}
    curl -sI localhost:8000/web/ort/ort-wasm-simd-threaded.jsep.wasm
    curl -s localhost:8000/web/device/worker.js  # the page's Web Worker: the CIAR device loop (web/src/loop.js)

Only the files a page loads are served: the ESM entry points (`ort.min.mjs`: WebGPU where the browser has it, else
WebAssembly; `ort.wasm.min.mjs`, `ort.webgpu.min.mjs`) and the WebAssembly builds they import. A name is looked up
in that list, never joined onto a path, so `..`, absolute and encoded names answer 404; the device model's files
are the ones its manifest names. Nothing is fetched from the internet at run time; without `make web` (no
node/npm) the status says how to enable the browser device.
"""

import functools
import json
import os
import re

from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from services.answers import error_body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the page's own modules (plain ES modules, no build step) and the installed package (npm ci --prefix web; tests
# point it at an empty folder)
DEVICE_SRC = os.path.join(ROOT, "web", "src")
ORT_PACKAGE = os.path.join(ROOT, "web", "node_modules", "onnxruntime-web")
ENTRY = "ort.min.mjs"
ENABLE = "the browser device is disabled: run `make web` (needs node and npm) to install onnxruntime-web"
SERVED = re.compile(r"ort(\.wasm|\.webgpu)?\.min\.mjs|ort-wasm-simd-threaded(\.[a-z]+)?\.(mjs|wasm)")
DEVICE_FILE = re.compile(r"[a-z]+\.js")
MEDIA_TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm"}
PLAYGROUND = os.path.join(ROOT, "services", "playground.html")


@functools.lru_cache(maxsize=1)
def playground_html() -> str:
    with open(PLAYGROUND, encoding="utf-8") as f:
        return f.read()


def playground_page() -> HTMLResponse:
    """GET /: the playground page: one static file, no build step, nothing fetched from the internet."""
    return HTMLResponse(playground_html())


def ort_files() -> dict[str, str]:
    """Served name -> its installed path ({} when onnxruntime-web is not installed)."""
    dist = os.path.join(ORT_PACKAGE, "dist")
    if not os.path.isdir(dist):
        return {}
    return {n: os.path.join(dist, n) for n in sorted(os.listdir(dist)) if SERVED.fullmatch(n)}


def ort_status() -> dict:
    """Whether the browser device can run here: the installed version and files, or how to enable it."""
    files = ort_files()
    if ENTRY not in files:
        return {"available": False, "message": ENABLE}
    with open(os.path.join(ORT_PACKAGE, "package.json"), encoding="utf-8") as f:
        version = json.load(f)["version"]
    return {"available": True, "version": version, "entry": ENTRY, "files": sorted(files)}


def ort_file(name: str) -> tuple[str, str]:
    """GET /web/ort/{name}: the installed file's path and media type; LookupError (a 404) saying why not."""
    files = ort_files()
    if not files:
        raise LookupError(ENABLE)
    if name not in files:
        raise LookupError(f"no onnxruntime-web file {name!r} (served: {', '.join(files)})")
    return files[name], MEDIA_TYPES[os.path.splitext(name)[1]]


def device_file(name: str) -> str:
    """GET /web/device/{name}: a module of the browser device (web/src/*.js); LookupError (a 404) otherwise."""
    path = os.path.join(DEVICE_SRC, name)
    if not DEVICE_FILE.fullmatch(name) or not os.path.isfile(path):
        served = sorted(n for n in os.listdir(DEVICE_SRC) if DEVICE_FILE.fullmatch(n))
        raise LookupError(f"no browser device file {name!r} (served: {', '.join(served)})")
    return path


def ort_file_response(name: str) -> Response:
    """GET /web/ort/{name}: the file, cached a day, or a 404 saying why not."""
    try:
        path, media_type = ort_file(name)
    except LookupError as e:
        return error_body(404, str(e), field="name", kind="not_found")
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})


def device_file_response(name: str) -> Response:
    """GET /web/device/{name}: the module (never cached: it changes with the checkout), or a 404 saying why not."""
    try:
        path = device_file(name)
    except LookupError as e:
        return error_body(404, str(e), field="name", kind="not_found")
    return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------------------------- the exported device model
def device_model_dir(world: dict) -> tuple[str | None, dict | None]:
    """The served world's exported device model: its folder and manifest (None, None when it was not exported)."""
    path = os.path.join(world["model_dir"], "manifest.json")
    if not os.path.isfile(path):
        return None, None
    with open(path, encoding="utf-8") as f:
        return world["model_dir"], json.load(f)


def device_model_response(world: dict) -> Response:
    """GET /v1/device/model: the export's manifest (graphs with sha256 and size, the calibrated CIAR defaults,
    sampling, protocol facts), or a 404 saying how to export it."""
    folder, manifest = device_model_dir(world)
    if manifest is None:
        return error_body(404, "the device model is not exported on this deployment: run "
                          "`python -m pipelines.export_onnx` (make serve does)", kind="not_found")
    return JSONResponse(manifest)


def device_model_file_response(world: dict, name: str) -> Response:
    """GET /v1/device/model/{name}: one graph of the manifest (only the files it names), else a 404."""
    folder, manifest = device_model_dir(world)
    files = {g["file"] for g in (manifest or {}).get("graphs", {}).values()}
    if name not in files:
        return error_body(404, f"no device model file {name!r}", field="name", kind="not_found")
    return FileResponse(os.path.join(folder, name), media_type="application/octet-stream")
