"""The device model as a server serves it: download once, verify, cache.

    model_dir = fetch_model("ws://localhost:8000", key="ciar-dev-device-key")   # -> a cached export folder
    runtime = DeviceRuntime(model_dir)

`GET /v1/device/model` (a device key as Bearer) answers the export's manifest (`pipelines.export_onnx`): the graphs
with their sha256 and size, the calibrated CIAR defaults, the sampling settings. Each graph comes from
`GET /v1/device/model/<file>` and is checked against its sha256 before it is kept. The cache folder is named by the
manifest's own hash (`~/.cache/ciar-device/<hash>/`, or `$CIAR_DEVICE_CACHE`), so a re-exported model is fetched
again and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request

MANIFEST = "manifest.json"


def http_base(server: str) -> str:
    """ws://host:port[/path] -> http://host:port (wss -> https); http(s) URLs are kept."""
    u = urllib.parse.urlsplit(server if "://" in server else "ws://" + server)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return f"{scheme}://{u.netloc}"


def _get(url: str, key: str, timeout_s: float) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - the user's own server
            return r.read()
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except Exception:  # noqa: BLE001
            message = e.reason
        raise RuntimeError(f"{url}: {e.code} {message}") from None
    except urllib.error.URLError as e:
        raise ConnectionError(f"cannot reach {url}: {e.reason}") from None


def fetch_model(server: str, key: str, cache_dir: str | None = None, timeout_s: float = 120.0) -> str:
    """Download (or find in the cache) the device model `server` serves; -> the folder holding it."""
    base = http_base(server)
    raw = _get(f"{base}/v1/device/model", key, timeout_s)
    manifest = json.loads(raw)
    root = cache_dir or os.environ.get("CIAR_DEVICE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                               "ciar-device")
    folder = os.path.join(root, hashlib.sha256(raw).hexdigest()[:16])
    os.makedirs(folder, exist_ok=True)
    for graph in manifest["graphs"].values():
        path = os.path.join(folder, os.path.basename(graph["file"]))
        if os.path.isfile(path) and sha256_file(path) == graph["sha256"]:
            continue
        data = _get(f"{base}/v1/device/model/{urllib.parse.quote(graph['file'])}", key, timeout_s)
        if hashlib.sha256(data).hexdigest() != graph["sha256"] or len(data) != graph["bytes"]:
            raise RuntimeError(f"{graph['file']}: the download does not match the manifest's sha256")
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)
    with open(os.path.join(folder, MANIFEST), "wb") as f:
        f.write(raw)
    return folder


def sha256_file(path: str) -> str:
    """The SHA-256 hex digest of a file (read in 1 MiB chunks): what an export's manifest records for its files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
