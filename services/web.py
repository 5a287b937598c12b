"""The browser device: its scripts (web/src, served at /web/device/) and its runtime, onnxruntime-web's installed
files (served at /web/ort/).

    make web                                  # npm ci --prefix web (web/package.json pins the version)
    curl -s localhost:8000/web/ort/           # {"available": true, "version": "1.30.0", "entry": "ort.min.mjs", ...}
    curl -sI localhost:8000/web/ort/ort-wasm-simd-threaded.jsep.wasm
    curl -s localhost:8000/web/device/worker.js  # the page's Web Worker: the CIAR device loop (web/src/loop.js)

Only the files a page loads are served: the ESM entry points (`ort.min.mjs`: WebGPU where the browser has it, else
WebAssembly; `ort.wasm.min.mjs`, `ort.webgpu.min.mjs`) and the WebAssembly builds they import. A name is looked up
in that list, never joined onto a path, so `..`, absolute and encoded names answer 404. Nothing is fetched from the
internet at run time; without `make web` (no node/npm) the status says how to enable the browser device.
"""

import json
import os
import re

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
