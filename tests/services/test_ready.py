"""`make serve`'s readiness watcher (services.ready), without Serve: the block it prints once the cluster can serve,
the one line it prints when a deployment fails to start, its timeout, and the watcher itself against a stand-in HTTP
server for Serve's REST API and /healthz. The Makefile starts it beside `serve run` and stops it by PID."""

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from services.ready import STATUS_PATH, banner, failure, first_curl, served, watch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def config():
    with open(os.path.join(REPO, "serve_config.yaml")) as f:
        return yaml.safe_load(f)


def app_status(app="RUNNING", message="", **deployments) -> dict:
    """Serve's REST API answer (`GET /api/serve/applications/`, ServeInstanceDetails) for one application."""
    deps = {name: {"name": name, "status": st if isinstance(st, str) else st[0],
                   "message": "" if isinstance(st, str) else st[1]} for name, st in deployments.items()}
    return {"applications": {"ciar": {"name": "ciar", "status": app, "message": message, "deployments": deps}}}


STARTING = app_status("DEPLOYING", Ingress="UPDATING", Device="UPDATING", Verifier="UPDATING")
UP = app_status(Ingress="HEALTHY", Device="HEALTHY", Verifier="HEALTHY")
TRACEBACK = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
             "initial health check failing. See controller logs for details. Error:\nTraceback (most recent call "
             "last):\n  File \"services/verifier.py\", line 40, in __init__\n\nFileNotFoundError: "
             "weights/missing/cloud.safetensors\n")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def run_watch(config, statuses, healths, timeout_s=600.0):
    """watch() over scripted answers (the last one repeats); -> (exit code, what it printed, polls made)."""
    out, clock, polls = io.StringIO(), Clock(), {"n": 0}

    def get_status():
        polls["n"] += 1
        return statuses[min(polls["n"], len(statuses)) - 1]

    def get_health():
        return healths[min(polls["n"], len(healths)) - 1]

    code = watch(config, get_status, get_health, out=out, timeout_s=timeout_s, every_s=2.0, clock=clock,
                 sleep=clock.sleep)
    return code, out.getvalue(), polls["n"]


def test_the_block_names_the_urls_the_development_keys_and_the_first_request(config):
    text = banner(config, 73.4)
    for line in ("http://localhost:8000/", "http://localhost:8000/v1/images/generations",
                 "ws://localhost:8000/v1/device/sessions", "API key      ciar-dev-key",
                 "device key   ciar-dev-device-key", "after 73 s"):
        assert line in text, line
    assert first_curl(8000, "ciar-dev-key") in "\n".join(ln[4:] for ln in text.splitlines())


def test_the_block_shows_the_readmes_first_request():
    """The first curl of the README (its quick start) is the block's, verbatim."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    start = readme.index("\ncurl ") + 1
    command = readme[start:readme.index("\n```", start)]
    assert command == first_curl(8000, "ciar-dev-key")


def test_development_keys_are_shown_only_where_the_config_accepts_them(config):
    s = served(config)
    assert s == {"port": 8000, "api_key": "ciar-dev-key", "device_key": "ciar-dev-device-key"}
    other = json.loads(json.dumps(config))
    args = other["applications"][0]["args"]
    args["api_key_sha256"] = [hashlib.sha256(b"a-production-key-123").hexdigest()]
    args.pop("device_key_sha256")
    other["http_options"]["port"] = 9000
    assert served(other) == {"port": 9000, "api_key": None, "device_key": None}
    text = banner(other, 1.0)
    assert "ciar-dev" not in text and "not the development key" in text and "localhost:9000" in text
    assert "Bearer $KEY" in text


def test_a_deployment_that_fails_to_start_is_named_with_its_reason():
    status = app_status("DEPLOY_FAILED", "Deploying app 'ciar' failed", Ingress="HEALTHY", Device="HEALTHY",
                        Verifier=("DEPLOY_FAILED", TRACEBACK))
    assert failure(status) == ("deployment Verifier of application ciar failed to start (DEPLOY_FAILED): "
                               "FileNotFoundError: weights/missing/cloud.safetensors")
    assert failure(STARTING) is None and failure(UP) is None and failure({}) is None


def test_an_application_whose_builder_failed_is_named_with_its_reason():
    status = app_status("DEPLOY_FAILED", "Traceback (most recent call last):\n ...\nValueError: no API keys "
                        "configured: set api_key_sha256 (or api_keys) in serve_config.yaml or $CIAR_API_KEYS")
    assert failure(status) == ("application ciar failed to deploy (DEPLOY_FAILED): ValueError: no API keys "
                               "configured: set api_key_sha256 (or api_keys) in serve_config.yaml or $CIAR_API_KEYS")


def test_the_block_is_printed_once_when_every_deployment_is_up_and_healthz_answers_200(config):
    # deploying; then all HEALTHY while /healthz still answers 503 (no verifier answered yet); then 200
    code, printed, polls = run_watch(config, [{}, STARTING, STARTING, UP, UP, UP], [None, 503, 503, 503, 503, 200])
    assert code == 0 and polls == 6
    assert printed.count("CIAR is ready") == 1 and printed.endswith("=" * 100 + "\n")
    assert "after 10 s" in printed  # five polls 2 s apart


def test_healthz_alone_is_not_ready_while_a_deployment_is_not_up(config):
    """/healthz may answer 200 while a deployment is still updating (another Device replica starting): not yet."""
    half = app_status("RUNNING", Ingress="HEALTHY", Device="UPSCALING", Verifier="HEALTHY")
    code, printed, polls = run_watch(config, [half, half, UP], [200])
    assert code == 0 and polls == 3 and printed.count("CIAR is ready") == 1


def test_a_failure_at_start_up_is_one_line_and_no_block(config):
    failed = app_status("DEPLOYING", Ingress="HEALTHY", Device=("DEPLOY_FAILED", TRACEBACK), Verifier="UPDATING")
    code, printed, _ = run_watch(config, [STARTING, failed], [None])
    assert code == 1 and "CIAR is ready" not in printed
    assert printed.count("\n") == 1 and printed.startswith("make serve: deployment Device of application ciar failed")
    assert "FileNotFoundError: weights/missing/cloud.safetensors" in printed


def test_nothing_ready_in_time_is_one_line_with_the_last_state(config):
    code, printed, polls = run_watch(config, [STARTING], [None], timeout_s=30.0)
    assert code == 1 and printed.count("\n") == 1 and polls == 17
    assert printed.startswith("make serve: not ready after 30 s (ciar DEPLOYING: Ingress UPDATING")


def test_a_deployment_that_cannot_be_scheduled_is_said_with_what_serve_says(config):
    """Replicas waiting for resources no node has (a GPU on a CPU box) are no failure to Serve: the timeout's line
    carries Serve's message, which names the resources."""
    waiting = app_status("DEPLOYING", Ingress="HEALTHY", Device="HEALTHY", Verifier=(
        "UPDATING", "Deployment 'Verifier' in application 'ciar' has 1 replicas that have taken more than 30s to be "
        "scheduled. Resources required for each replica: {\"CPU\": 1.0, \"GPU\": 1.0}, total resources available: "
        "{\"CPU\": 1.2}."))
    code, printed, _ = run_watch(config, [waiting], [503], timeout_s=100.0)
    assert code == 1 and printed.count("\n") == 1
    assert printed.startswith("make serve: not ready after 100 s (ciar DEPLOYING: Ingress HEALTHY, Device HEALTHY, "
                              "Verifier UPDATING (Deployment 'Verifier'")
    assert '{"CPU": 1.0, "GPU": 1.0}, total resources available: {"CPU": 1.2}.)' in printed


class StandIn(BaseHTTPRequestHandler):
    """Serve's REST API and the application's /healthz, answering what the test sets."""

    answers: dict = {}
    token: str | None = None  # the REST API answers 401 without it (Ray's token authentication)
    seen: list = []  # (path, Authorization header) of every request

    def do_GET(self):  # noqa: N802
        auth = self.headers.get("Authorization")
        self.seen.append((self.path, auth))
        code, body = self.answers.get(self.path, (404, {}))
        if self.path == STATUS_PATH and self.token and auth != f"Bearer {self.token}":
            code, body = 401, {"error": "Unauthorized: Missing authentication token"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    yield server
    server.shutdown()
    server.server_close()


def _watcher(url: str, dashboard: str, timeout_s: float = 60.0, token: str | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["RAY_AUTH_TOKEN_PATH"] = os.devnull  # not the machine's own Ray token
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "services.ready", "--config", "serve_config.yaml", "--url", url,
                           "--dashboard", dashboard, "--every", "0.1", "--timeout", str(timeout_s)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_the_watcher_prints_the_block_and_exits(stand_in):
    url = f"http://127.0.0.1:{stand_in.server_port}"
    StandIn.answers, StandIn.token = {STATUS_PATH: (200, UP), "/healthz": (200, {"status": "ok"})}, "cluster-tok"
    StandIn.seen = []
    r = _watcher(url, url, token="cluster-tok")  # a dashboard with token authentication, as `serve run`'s
    assert r.returncode == 0, r.stderr
    assert (STATUS_PATH, "Bearer cluster-tok") in StandIn.seen and ("/healthz", None) in StandIn.seen
    assert all(auth is None for path, auth in StandIn.seen if path != STATUS_PATH)  # the token: the dashboard's
    assert r.stdout.count("CIAR is ready") == 1 and "ciar-dev-key" in r.stdout


def test_the_watcher_names_the_failed_deployment_and_exits(stand_in):
    url = f"http://127.0.0.1:{stand_in.server_port}"
    StandIn.token, StandIn.seen = "cluster-token-123", []
    StandIn.answers = {STATUS_PATH: (200, app_status("DEPLOYING", Ingress="UPDATING",
                                                      Verifier=("UNHEALTHY", "replica died\nRuntimeError: boom"))),
                       "/healthz": (503, {"status": "starting"})}
    r = _watcher(url, url, token="cluster-token-123")
    assert r.returncode == 1 and r.stdout == ("make serve: deployment Verifier of application ciar failed to start "
                                              "(UNHEALTHY): RuntimeError: boom  (serve run keeps running: Ctrl-C "
                                              "stops it)\n"), r.stdout


def test_without_a_dashboard_healthz_decides(stand_in):
    url = f"http://127.0.0.1:{stand_in.server_port}"
    StandIn.answers, StandIn.token = {"/healthz": (200, {"status": "ok"})}, None  # the REST API's path: 404
    r = _watcher(url, "http://127.0.0.1:9")  # nothing listens on the discard port
    assert r.returncode == 0 and r.stdout.count("CIAR is ready") == 1, (r.stdout, r.stderr)


def test_the_makefile_starts_the_watcher_beside_serve_and_stops_it_by_pid():
    with open(os.path.join(REPO, "Makefile")) as f:
        text = f.read()
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    assert "-m services.ready --config serve_config.yaml --parent $$$$ & ready=$$!;" in recipe
    assert "trap 'kill $$ready 2>/dev/null' EXIT;" in recipe
    assert recipe.rstrip().endswith("serve run serve_config.yaml")  # serve in the foreground: Ctrl-C reaches it
