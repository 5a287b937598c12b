"""Deploy the application from a config, as `serve deploy serve_config.yaml` does, from Python (tests, benchmarks).

    deploy_config({"api_keys": [...], "devices": 8}, user_configs={"Device": {"tau": 0.2}})
    deploy_config(args, import_path="services.app:build_verifier_app", name="bench", route_prefix=None,
                  user_configs={"Verifier": {"max_batch_size": 1}})

Why not `serve.run(build_app(...))`: an application built in the driver gets a new random code version on every
`serve.run`, so every re-run restarts its replicas. A config deploy keeps the code version as long as the import
path, runtime env and builder `args` stay the same, and then a change of a deployment's `user_config` (the
config's `deployments: [{name, user_config}]`) only calls `reconfigure` on the running replicas — the live-knob
path of production. (Changing `args` re-builds the application and restarts its replicas.)
"""

from __future__ import annotations

import os
import time

from ray import serve


# a loaded 2-core box can miss Serve's 5 s proxy readiness check; short graceful shutdowns for local clusters
PATIENT_SERVE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                     "RAY_SERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S": "1"}


def patient_serve_env() -> None:
    """Set PATIENT_SERVE_ENV (where not set already) before `ray.init` starts a local cluster: Serve's controller
    inherits the driver's environment."""
    for var, value in PATIENT_SERVE_ENV.items():
        os.environ.setdefault(var, value)


OFFLINE_ONE_THREAD_ENV = {"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}}


def deploy_config(args: dict, import_path: str = "services.app:build_app", name: str = "ciar",
                  route_prefix: str | None = "/", timeout_s: float = 300.0, runtime_env: dict | None = None,
                  user_configs: dict[str, dict] | None = None) -> None:
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    client = serve_start()
    app = {"name": name, "import_path": import_path, "args": args, "runtime_env": runtime_env or {}}
    if route_prefix is not None:
        app["route_prefix"] = route_prefix
    if user_configs:
        app["deployments"] = [{"name": n, "user_config": c} for n, c in user_configs.items()]
    since = time.time()
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))
    wait_running(name, timeout_s, since)


class DeployFailed(RuntimeError):
    """The application failed to deploy; the message is one line naming the deployment and the error its replicas
    raised (`failure_line`)."""


def _state(x) -> str:
    return str(getattr(x, "value", x))  # (Serve's status enums print as "ApplicationStatus.RUNNING")


def failure_line(name: str, status) -> str:
    """The one line `make serve`'s watcher prints for a failed application (`services.ready.failure`), from
    `serve.status()`'s entry for it: the failed deployment and the last line of its message, i.e. the exception
    its replicas' constructor raised (a missing file, a bad setting). Serve's own application message names only
    the deployments ("Failed to update the deployments ['Device']")."""
    from services.ready import failure

    deployments = {d: {"status": _state(s.status), "message": s.message or ""}
                   for d, s in (status.deployments or {}).items()}
    app = {"status": _state(status.status), "message": status.message or "", "deployments": deployments}
    return failure({"applications": {name: app}}) or f"application {name} failed to deploy: {status.message}"


def wait_running(name: str, timeout_s: float = 300.0, since: float = 0.0) -> None:
    """Wait until application `name` was (re)deployed after `since` (a Unix time) and is RUNNING."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        apps = serve.status().applications
        status = apps.get(name)
        if status is not None:
            state = str(status.status)
            if state.endswith("RUNNING") and status.last_deployed_time_s >= since - 1.0:
                return
            if state.endswith("DEPLOY_FAILED"):
                raise DeployFailed(failure_line(name, status))
        time.sleep(0.5)
    raise TimeoutError(f"application {name!r} not running after {timeout_s} s: {status}")
