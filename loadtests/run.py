"""Run a Locust load test against the CIAR Serve application and write a summary.

    python -m loadtests.run --users 32 --duration 60 --scenario ramp --out runs/load [--weights DIR] [--devices N]
    python -m loadtests.run --users 8 --duration 30 --host http://127.0.0.1:8000     # a cluster that already runs

Without --host it starts the cluster itself, in this process, as `serve run serve_config.yaml` would: a local Ray
instance of its own, Serve's HTTP proxy on a free port of 127.0.0.1, and the application deployed from the
config (`--config`, default serve_config.yaml: its builder args, runtime env and the deployments' user_configs),
with --devices / --weights / --api-key and any `--set` applied on top:

    --set Device.tau=0.05 --set Verifier.batch_wait_timeout_s=0.02 --set args.device_max_queued_requests=8

Then Locust runs headless in its own process group (loadtests/locustfile.py; CSV and HTML report in --out), the
Verifier replicas' batch-size histograms and the application's Prometheus counters are read, the cluster it started
(only that) is shut down, and `OUT/summary.json` is written:

    requests, failures, failure_ratio, requests_per_s, images_per_s, latency_ms {p50, p95, p99, mean, max},
    cloud_calls_per_image (from the responses' stats; `cloud_calls_per_image_metrics` from ciar_cloud_calls_total /
    ciar_requests_total{code=200}), verifier {batch_size_hist, mean_batch_size, ...}, responses {per method, ...},
    slo {ok, reasons, ...}, exit_code

Real devices beside the simulated ones: `--device-clients N` starts N device-client processes
(`loadtests.devices`: the torch-free CIAR loop over the WebSocket device endpoint, held-out prompts, at most
--device-images images each, no image started after --duration) against the same cluster while Locust runs, and
adds a `device_clients` section: images, images/s, latency p50 / p99 on real sockets, the network model's price of
the same messages (--device-network for the headline), per-message overhead (codec times on real frames, framing
bytes, round trip minus reported cloud time, the Verifier's handling time from Serve's metrics) and the batch sizes
the real devices' verifications shared (the `verifier` histogram holds real and simulated works together).

    python -m loadtests.run --users 2 --duration 60 --device-clients 4 --out runs/device-load

The exit code is Locust's, i.e. the SLO gate's (0 passed, 1 failed), or 1 when a device client's image failed;
124 when Locust had to be stopped. Other files in --out: locust_stats.csv (+ _failures, _exceptions,
_stats_history), report.html, locust.log, responses.jsonl (one line per response), slo.json, clients/ (the device
clients' plans, logs and per-image records).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import yaml

from loadtests.devices import DEVICE_KEY, ClientsConfig, DeviceClients, codec_bench
from loadtests.devices import print_summary as print_device_summary
from loadtests.devices import report as device_report
from loadtests.plan import (SCENARIOS, csv_totals, figures, hist_mean, merge_hists, read_locust_stats,
                            summarise_responses)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCUSTFILE = os.path.join(REPO, "loadtests", "locustfile.py")
APP_NAME = "ciar"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_app_config(path: str, app_name: str = APP_NAME) -> dict:
    """The application entry of a Serve config file: {"args", "runtime_env", "user_configs"}."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    apps = cfg.get("applications") or []
    app = next((a for a in apps if a.get("name") == app_name), apps[0] if apps else None)
    if app is None:
        raise ValueError(f"{path}: no application")
    return {"args": dict(app.get("args") or {}), "runtime_env": dict(app.get("runtime_env") or {}),
            "user_configs": {d["name"]: dict(d.get("user_config") or {}) for d in app.get("deployments") or []},
            "import_path": app.get("import_path", "services.app:build_app")}


def use_weights(app: dict, weights: str) -> None:
    """Serve another weights folder. Its phones run the onnx runtime (serve_config.yaml's `device_runtime`) only
    when the folder has an export (`python -m pipelines.export_onnx --world FOLDER`); otherwise on torch, said so."""
    app["args"]["weights_dir"] = os.path.abspath(weights)
    if app["args"].get("device_runtime") == "onnx" and not os.path.isfile(os.path.join(weights, "onnx",
                                                                                         "manifest.json")):
        app["args"]["device_runtime"] = "torch"
        print(f"{weights} has no onnx export: its simulated phones run the torch runtime", flush=True)


def apply_overrides(app: dict, sets: list[str]) -> dict:
    """`Deployment.key=value` (user_config) or `args.key=value` (builder args); value parsed as YAML."""
    for item in sets:
        target, sep, raw = item.partition("=")
        section, dot, key = target.partition(".")
        if not sep or not dot or not key:
            raise ValueError(f"--set {item!r}: expected Deployment.key=value or args.key=value")
        value = yaml.safe_load(raw)
        if section == "args":
            app["args"][key] = value
        else:
            app["user_configs"].setdefault(section, {})[key] = value
    return app


DEV_KEY = "ciar-dev-key"  # the key serve_config.yaml accepts (by its digest)


def use_key(app: dict, key: str) -> dict:
    """Make `key` the application's only API key, by its digest (Serve logs builder args; the key stays out)."""
    from services.config import key_digest

    app["args"]["api_keys"] = []
    app["args"]["api_key_sha256"] = [key_digest(key)]
    return app


def client_key(app: dict | None, given: str | None = None) -> str:
    """The bearer key a client uses: `given`, else the config's first plaintext key (or $CIAR_API_KEYS'), else
    $CIAR_API_KEY, else the development key."""
    if given:
        return given
    if app is not None:
        from services.config import AppConfig

        keys = AppConfig(**app["args"]).all_api_keys()
        if keys:
            return keys[0]
    return os.environ.get("CIAR_API_KEY", DEV_KEY)


def wait_healthy(url: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"{url}/healthz not answering after {timeout_s} s: {last}")


def serve_actors(system: bool = False) -> list[dict]:
    """The ALIVE Serve replicas (and with `system`, the proxies and the controller) from the GCS's actor table, as it
    gives them (ActorClassName "ServeReplica:<app>:<deployment>", Pid, Address.NodeID, Name): no dashboard needed."""
    from ray._private.state import actors

    return [a for a in actors().values() if a.get("State") == "ALIVE" and (
        (a.get("ActorClassName") or "").startswith("ServeReplica:")
        or (system and a.get("ActorClassName") in ("ProxyActor", "ServeController")))]


def each_replica(call, id_key: str, replicas: int, tries_per_replica: int = 4) -> dict:
    """Calls without a session id reach any replica: `call()` until `replicas` distinct ones have answered (or the
    tries run out). -> {replica id (the answer's `id_key`): its answer}."""
    seen: dict = {}
    for _ in range(max(1, tries_per_replica * replicas)):
        answer = call()
        seen[answer[id_key]] = answer
        if len(seen) >= replicas:
            break
    return seen


class Cluster:
    """A local Ray instance + Serve + the application, started by (and only shut down by) this process."""

    def __init__(self, app: dict, port: int, metrics_port: int):
        self.app, self.port, self.metrics_port = app, port, metrics_port
        self.url = f"http://127.0.0.1:{port}"
        self.started = False

    def start(self) -> None:
        import ray
        from ray import serve

        from services.deploy import deploy_config, patient_serve_env
        from services.config import AppConfig

        patient_serve_env()  # the controller inherits this environment
        cfg = AppConfig(**self.app["args"])  # validated here, with the field named, before Ray starts
        need = (cfg.devices * cfg.device_num_cpus + cfg.verifier_replicas * cfg.verifier_num_cpus
                + cfg.ingress_num_cpus + 0.5)
        env_vars = {"OMP_NUM_THREADS": "1", **(self.app["runtime_env"].get("env_vars") or {})}
        ray.init(address="local", num_cpus=max(os.cpu_count() or 2, math.ceil(need)), include_dashboard=False,
                 log_to_driver=False, _metrics_export_port=self.metrics_port,
                 _system_config={"metrics_report_interval_ms": 1000}, runtime_env={"env_vars": env_vars})
        self.started = True
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        deploy_config(self.app["args"], import_path=self.app["import_path"], name=APP_NAME,
                      runtime_env=self.app["runtime_env"], user_configs=self.app["user_configs"])
        wait_healthy(self.url)

    def verifier_stats(self, replicas: int) -> dict | None:
        """Merged `stats()` of the Verifier replicas (calls without a session id go to any replica: ask a few
        times and keep one answer per replica)."""
        from ray import serve

        h = serve.get_deployment_handle("Verifier", app_name=APP_NAME)
        seen = each_replica(lambda: h.stats.remote().result(timeout_s=60), "replica_id", replicas)
        hist = merge_hists([s["batch_size_hist"] for s in seen.values()])
        return {"replicas_seen": len(seen), "batch_size_hist": hist, "mean_batch_size": hist_mean(hist),
                "forward_passes": sum(hist.values()), "spans_verified": sum(s["spans_verified"] for s in seen.values()),
                "sessions_opened": sum(s["opened"] for s in seen.values()),
                "sessions_resumed": sum(s["resumed"] for s in seen.values()),
                "live": next(iter(seen.values()))["live"] if seen else None}

    def metrics(self, want_ok: int, timeout_s: float = 15.0) -> dict | None:
        """Sums of ray_ciar_requests_total{code="200"} and ray_ciar_cloud_calls_total from Ray's Prometheus
        endpoint, waiting (up to timeout_s) until the request counter has caught up with `want_ok`."""
        deadline = time.monotonic() + timeout_s
        out = None
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
                    text = r.read().decode()
                out = {"requests_ok": _metric_sum(text, "ray_ciar_requests_total", {"code": "200"}),
                       "cloud_calls": _metric_sum(text, "ray_ciar_cloud_calls_total")}
            except (urllib.error.URLError, OSError):
                pass
            if (out and out["requests_ok"] >= want_ok) or time.monotonic() > deadline:
                return out
            time.sleep(1.0)

    def stop(self) -> None:
        if not self.started:
            return
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.started = False


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def _metric_sum(text: str, name: str, labels: dict | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total += float(m.group(3))
    return total


def run_locust(url: str, out: str, env: dict, timeout_s: float, stop_timeout_s: float) -> int:
    """Locust headless in a new session (process group); stopped by its own PID/group only. -> its exit code."""
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "--only-summary", "-H", url,
           "--csv", os.path.join(out, "locust"), "--html", os.path.join(out, "report.html"),
           "--stop-timeout", f"{math.ceil(stop_timeout_s)}s", "--loglevel", "INFO"]
    with open(os.path.join(out, "locust.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"locust still running after {timeout_s:.0f} s: stopping it (pid {proc.pid})", file=sys.stderr)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124
        except BaseException:  # Ctrl-C: do not leave Locust behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            raise


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=4, help="peak simulated users")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="steady")
    p.add_argument("--out", default="runs/load")
    p.add_argument("--host", default=None, help="a running cluster's URL (then nothing is started or stopped)")
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--weights", default=None, help="weights folder (default: the config's, i.e. the shipped world)")
    p.add_argument("--devices", type=int, default=None, help="simulated devices (default: the config's)")
    p.add_argument("--api-key", default=None, help="bearer key (default: the config's first key)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a deployment's user_config (Device.tau=0.05) or a builder arg (args.devices=8)")
    p.add_argument("--slo-max-fail", type=float, default=float(os.environ.get("CIAR_SLO_MAX_FAIL", 0.0)))
    p.add_argument("--slo-p99-ms", type=float, default=float(os.environ.get("CIAR_SLO_P99_MS", 120_000)))
    p.add_argument("--think-s", type=float, default=1.0, help="a user waits 0..this between requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds Locust lets users finish their request when the load ends")
    p.add_argument("--device-clients", type=int, default=0, help="real device-client processes beside Locust")
    p.add_argument("--device-images", type=int, default=64, help="images per device client, at most")
    p.add_argument("--device-network", default="5g", help="the network profile of the model's headline prediction")
    p.add_argument("--device-key", default=os.environ.get("CIAR_DEVICE_KEY", DEVICE_KEY))
    p.add_argument("--device-model-dir", default=None,
                   help="the device model's ONNX export (default: downloaded from the cluster, as a device does)")
    p.add_argument("--device-grace", type=float, default=60.0,
                   help="seconds past --duration before a device client still running is stopped")
    args = p.parse_args(argv)
    if not args.duration > 0:
        p.error(f"--duration must be > 0, got {args.duration:g}")
    for flag, value, least in (("--users", args.users, 1), ("--devices", args.devices, 1),
                               ("--device-clients", args.device_clients, 0), ("--device-images", args.device_images, 1),
                               ("--think-s", args.think_s, 0), ("--stop-timeout", args.stop_timeout, 0),
                               ("--device-grace", args.device_grace, 0)):
        if value is not None and value < least:  # before a cluster is started for nothing
            p.error(f"{flag} must be >= {least}, got {value:g}")

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stats_path, slo_path = os.path.join(out, "responses.jsonl"), os.path.join(out, "slo.json")
    for stale in (stats_path, slo_path):
        if os.path.exists(stale):
            os.remove(stale)

    app = apply_overrides(load_app_config(args.config), args.sets)
    if args.devices is not None:
        app["args"]["devices"] = args.devices
    if args.weights is not None:
        use_weights(app, args.weights)
    if args.api_key is not None:
        use_key(app, args.api_key)
    api_key = client_key(app if args.host is None else None, args.api_key)

    cluster = clients = None
    t_start = time.time()
    summary: dict = {"scenario": args.scenario, "users": args.users, "duration_s": args.duration}
    try:
        if args.host is None:
            cluster = Cluster(app, free_port(), free_port())
            print(f"starting the cluster ({app['args'].get('devices')} devices, weights "
                  f"{app['args'].get('weights_dir') or 'shipped'}) ...", flush=True)
            t0 = time.monotonic()
            cluster.start()
            summary["cluster_start_s"] = round(time.monotonic() - t0, 1)
            url = cluster.url
        else:
            url = args.host.rstrip("/")
        if args.device_clients:
            clients = DeviceClients(ClientsConfig(
                "ws" + url[len("http"):], args.device_clients, args.device_images, args.duration, out,
                args.device_key, args.device_model_dir, args.seed, grace_s=args.device_grace))
            print(f"device clients: {args.device_clients} processes, at most {args.device_images} images each",
                  flush=True)
            clients.start()
        env = {**os.environ, "CIAR_SCENARIO": args.scenario, "CIAR_USERS": str(args.users),
               "CIAR_DURATION": str(args.duration), "CIAR_API_KEY": api_key, "CIAR_LOAD_STATS": stats_path,
               "CIAR_SLO_REPORT": slo_path, "CIAR_SLO_MAX_FAIL": str(args.slo_max_fail),
               "CIAR_SLO_P99_MS": str(args.slo_p99_ms), "CIAR_LOAD_SEED": str(args.seed),
               "CIAR_THINK_S": str(args.think_s), "OMP_NUM_THREADS": "1"}
        print(f"locust: {args.scenario}, {args.users} users, {args.duration:g} s against {url}", flush=True)
        t0 = time.monotonic()
        rc = run_locust(url, out, env, timeout_s=args.duration + args.stop_timeout + 120,
                        stop_timeout_s=args.stop_timeout)
        summary["locust_wall_s"] = round(time.monotonic() - t0, 1)
        if clients is not None:
            clients.wait()

        records = _read_jsonl(stats_path)
        responses = summarise_responses(records)
        if cluster is not None:
            from services.config import AppConfig

            cfg = AppConfig(**app["args"])
            summary["verifier"] = cluster.verifier_stats(cfg.verifier_replicas)
            summary["metrics"] = cluster.metrics(want_ok=responses["images"])
        if clients is not None:
            metrics_url = f"http://127.0.0.1:{cluster.metrics_port}/metrics" if cluster is not None else None
            summary["device_clients"] = device_report(clients, args.device_network, metrics_url, codec=False)
    finally:
        if clients is not None:
            clients.stop()
        if cluster is not None:
            cluster.stop()
    if "device_clients" in summary:  # the codec microbenchmark, on the clients' real frames, with the cluster down
        summary["device_clients"]["codec"] = codec_bench(clients.frames())

    csv_path = os.path.join(out, "locust_stats.csv")
    slo = None
    if os.path.exists(slo_path):
        with open(slo_path) as f:
            slo = json.load(f)
    # Locust's final totals (written by the SLO gate); its CSV is the fallback (it misses requests that end while
    # the users stop)
    totals = (slo or {}).pop("totals", None) or (csv_totals(read_locust_stats(csv_path))
                                                 if os.path.exists(csv_path) else {})
    metrics = summary.get("metrics")
    summary.update({
        "host": url, "started_cluster": cluster is not None,
        "devices": app["args"].get("devices") if cluster is not None else None,
        "weights_dir": app["args"].get("weights_dir") if cluster is not None else None,
        **figures(totals),
        "cloud_calls_per_image": responses["cloud_calls_per_image"],
        "cloud_calls_per_image_metrics": (metrics["cloud_calls"] / metrics["requests_ok"]
                                          if metrics and metrics["requests_ok"] else None),
        "responses": responses, "slo": slo, "exit_code": rc, "total_wall_s": round(time.time() - t_start, 1),
        "files": {"csv": csv_path, "html": os.path.join(out, "report.html"), "log": os.path.join(out, "locust.log"),
                  "responses": stats_path},
    })
    dev = summary.get("device_clients")
    if dev is not None and rc == 0 and (dev["failures"] or not dev["images"]):
        rc = summary["exit_code"] = 1
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if dev is not None:
        print_device_summary(dev)
    _print_summary(summary, out)
    return rc


def _fmt(x, nd=2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _print_summary(s: dict, out: str) -> None:
    lat = s.get("latency_ms") or {}
    v = s.get("verifier") or {}
    print(f"\n{s['scenario']}: {s.get('requests', 0)} requests, {s.get('failures', 0)} failures "
          f"({_fmt(s.get('failure_ratio'), 4)}), {_fmt(s.get('requests_per_s'))} req/s, "
          f"{_fmt(s.get('images_per_s'))} images/s")
    print(f"latency ms p50 {_fmt(lat.get('p50'), 0)}  p95 {_fmt(lat.get('p95'), 0)}  p99 {_fmt(lat.get('p99'), 0)}")
    print(f"cloud calls / image {_fmt(s.get('cloud_calls_per_image'))} (metrics: "
          f"{_fmt(s.get('cloud_calls_per_image_metrics'))}); verifier batch size mean "
          f"{_fmt(v.get('mean_batch_size'))} hist {v.get('batch_size_hist')}")
    slo = s.get("slo") or {}
    print(f"SLO {'passed' if slo.get('ok') else 'FAILED ' + '; '.join(slo.get('reasons', []))}; "
          f"exit code {s['exit_code']}; summary: {os.path.join(out, 'summary.json')}")


if __name__ == "__main__":
    from services.deploy import DeployFailed

    try:
        sys.exit(main())
    except DeployFailed as e:  # one line (the failed deployment and its error), not the runner's traceback
        sys.exit(f"error: {e}")
