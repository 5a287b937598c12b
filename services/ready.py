"""`make serve`'s readiness watcher: started beside `serve run serve_config.yaml`, it says once when the cluster can
serve, or which deployment failed to start and why, then exits.

    python -m services.ready --config serve_config.yaml      # (the Makefile's serve target starts it)

It polls Serve's status (the dashboard's REST API, `GET /api/serve/applications/`, as `serve status` reads it) and
the application's readiness check (`GET /healthz`, services.app) every `--every` seconds. When every deployment is
HEALTHY and /healthz answers 200 it prints one block: the playground's URL, the API and device endpoints, the
development keys the config accepts (`ciar-dev-key`, `ciar-dev-device-key`, recognised by their SHA-256 digests in
the config) and the README's first request. When Serve reports a deployment (or the application) failed to deploy,
or nothing is ready after `--timeout` seconds, it prints one line that says what and why, and exits 1 (`serve run`
keeps running; Ctrl-C stops it). Without the dashboard, /healthz alone decides. The dashboard of a cluster with Ray's
token authentication (a local one `serve run` starts has it) is asked with the cluster's token, found where Ray's own
CLI finds it ($RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) and sent to the dashboard alone.
Standard library only: it starts in a fraction of a second and takes nothing from the cluster's CPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

STATUS_PATH = "/api/serve/applications/"
# the development keys of serve_config.yaml (it holds their digests only: Serve logs builder args)
DEV_API_KEY = "ciar-dev-key"
DEV_DEVICE_KEY = "ciar-dev-device-key"
FAILED = ("DEPLOY_FAILED", "UNHEALTHY")
# the README's first request (README.md, Quick start; a test keeps the two the same)
PROMPT_BODY = ('{"prompt": "a large red circle at the center on a black background", "seed": 0, "method": "ciar",\n'
               '          "network": "5g", "response_format": "png"}')


def first_curl(port: int, key: str) -> str:
    """The README's first request (a PNG of the default world) against this port with this key."""
    return (f"curl -s -X POST localhost:{port}/v1/images/generations -H 'Authorization: Bearer {key}' \\\n"
            "     -H 'content-type: application/json' -o red.png \\\n"
            f"     -d '{PROMPT_BODY}'")


def _read_config(path: str) -> dict:
    import yaml  # (PyYAML: a dependency of Ray, present wherever `serve run` is)

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def served(config: dict) -> dict:
    """What the block shows of a Serve config: the HTTP port, and the development keys its first application
    accepts (None where it does not: another key is configured, or keys come from the environment)."""
    port = int((config.get("http_options") or {}).get("port", 8000))
    args = (config.get("applications") or [{}])[0].get("args") or {}

    def accepted(key: str, plain: str, digests: str) -> str | None:
        ok = key in (args.get(plain) or []) or \
            hashlib.sha256(key.encode()).hexdigest() in (args.get(digests) or [])
        return key if ok else None

    return {"port": port, "api_key": accepted(DEV_API_KEY, "api_keys", "api_key_sha256"),
            "device_key": accepted(DEV_DEVICE_KEY, "device_keys", "device_key_sha256")}


def banner(config: dict, waited_s: float) -> str:
    """The block printed once the cluster can serve."""
    s = served(config)
    port, host = s["port"], f"localhost:{s['port']}"
    api_key = s["api_key"] or "$KEY"
    rule = "=" * 100
    lines = [rule, f"CIAR is ready after {waited_s:.0f} s: every deployment is up and /healthz answers 200.",
             f"  playground   http://{host}/",
             f"  API          http://{host}/v1/images/generations   (OpenAI Images API; /openapi.json, /docs)",
             f"  devices      ws://{host}/v1/device/sessions   (device model: http://{host}/v1/device/model)",
             f"  API key      {s['api_key'] or 'not the development key: one of yours ($CIAR_API_KEYS)'}",
             f"  device key   {s['device_key'] or 'not the development key: one of yours ($CIAR_DEVICE_KEYS)'}",
             "  try it:", *("    " + ln for ln in first_curl(port, api_key).splitlines()), rule]
    return "\n".join(lines)


def _last_line(message: str) -> str:
    """The gist of a Serve status message: its last non-empty line (a traceback's exception)."""
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no reason given"


def failure(status: dict) -> str | None:
    """The failure line for Serve's status (the REST API's JSON), or None while nothing has failed: the first
    deployment whose status is DEPLOY_FAILED or UNHEALTHY, else an application that failed to deploy (its builder
    raised, before any deployment existed)."""
    for name, app in (status.get("applications") or {}).items():
        for dep_name, dep in (app.get("deployments") or {}).items():
            if dep.get("status") in FAILED:
                return f"deployment {dep_name} of application {name} failed to start ({dep['status']}): " \
                       f"{_last_line(dep.get('message', ''))}"
        if app.get("status") in FAILED:
            return f"application {name} failed to deploy ({app['status']}): {_last_line(app.get('message', ''))}"
    return None


def all_up(status: dict) -> bool:
    """Every application RUNNING and every deployment of it HEALTHY (and at least one of each)."""
    apps = status.get("applications") or {}
    return bool(apps) and all(a.get("status") == "RUNNING" and a.get("deployments") and
                              all(d.get("status") == "HEALTHY" for d in a["deployments"].values())
                              for a in apps.values())


def ray_token() -> str | None:
    """The Ray cluster's authentication token where Ray's CLI looks for it, else None (no token authentication)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def progress(status: dict) -> str:
    """Where the start-up is, in one line: each application's and deployment's status, with what Serve says of a
    deployment that is not HEALTHY (e.g. replicas that cannot be scheduled: the resources they need)."""
    def deployment(name: str, d: dict) -> str:
        if d.get("status") == "HEALTHY" or not d.get("message"):
            return f"{name} {d.get('status')}"
        return f"{name} {d.get('status')} ({_last_line(d['message'])[:500]})"

    apps = (status or {}).get("applications") or {}
    return "; ".join(f"{n} {a.get('status')}: " + ", ".join(deployment(d, v) for d, v in
                                                            (a.get("deployments") or {}).items())
                     for n, a in apps.items()) or "no application deployed yet"


def _get(url: str, timeout_s: float = 5.0, token: str | None = None) -> tuple[int | None, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):  # nothing listens yet, or the connection dropped
        return None, b""


def watch(config: dict, get_status: Callable[[], dict | None], get_health: Callable[[], int | None],
          out=sys.stdout, timeout_s: float = 1200.0, every_s: float = 2.0, clock=time.monotonic, sleep=time.sleep,
          alive: Callable[[], bool] = lambda: True) -> int:
    """Poll until the cluster can serve (print the block, 0) or a deployment failed, nothing was ready in
    `timeout_s` or `alive()` turned false (print one line, 1). `get_status`: Serve's status, None when it cannot be
    read (no dashboard: /healthz alone decides); `get_health`: /healthz's HTTP status, None without an answer."""
    t0 = clock()
    last = "nothing answered yet"
    while True:
        status = get_status()
        if status is not None:
            failed = failure(status)
            if failed is not None:
                print(f"make serve: {failed}  (serve run keeps running: Ctrl-C stops it)", file=out, flush=True)
                return 1
        code = get_health()
        up = status is None or all_up(status)
        if up and code == 200:
            print(banner(config, clock() - t0), file=out, flush=True)
            return 0
        if not up:
            last = progress(status)
        elif code is not None:
            last = f"/healthz answers {code}"
        if clock() - t0 > timeout_s:
            print(f"make serve: not ready after {timeout_s:.0f} s ({last})", file=out, flush=True)
            return 1
        if not alive():
            return 1  # serve run has ended: its own log says why
        sleep(every_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--dashboard", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                    help="Ray's dashboard (Serve's REST API), as `serve status --address`")
    ap.add_argument("--url", default=None, help="the application's HTTP address (default: localhost and the "
                    "config's http_options.port)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds before it says the cluster is not ready")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between polls")
    ap.add_argument("--parent", type=int, default=None, help="stop when this process (the Makefile's shell) is gone")
    args = ap.parse_args(argv)
    config = _read_config(args.config)
    url = (args.url or f"http://127.0.0.1:{served(config)['port']}").rstrip("/")
    dashboard = args.dashboard.rstrip("/")
    reachable = {"dashboard": None}  # whether the dashboard has answered once (else: /healthz alone)

    token = ray_token()

    def get_status() -> dict | None:
        code, body = _get(dashboard + STATUS_PATH, token=token)
        if code == 200:
            reachable["dashboard"] = True
            try:
                return json.loads(body)
            except ValueError:
                return {}
        # before the dashboard is up, nothing is ready: wait for it, unless /healthz answers without it
        return {} if reachable["dashboard"] is not False else None

    def get_health() -> int | None:
        code, _ = _get(url + "/healthz", timeout_s=10.0)
        if code == 200 and not reachable["dashboard"]:
            reachable["dashboard"] = False  # serving without a readable dashboard: /healthz decides from now on
        return code

    def alive() -> bool:
        if args.parent is None:
            return True
        try:
            os.kill(args.parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    try:
        return watch(config, get_status, get_health, timeout_s=args.timeout, every_s=args.every, alive=alive)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
