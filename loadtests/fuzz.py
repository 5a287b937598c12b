"""Fuzz the HTTP API: random and near-valid JSON bodies (hypothesis), oversized bodies, bad keys; counts answers by
status and checks the logs for keys. With --device-frames, also the device channel (loadtests.device_fuzz).

    python -m loadtests.fuzz --examples 500 --out runs/fuzz            # starts the cluster, as loadtests.run does
    python -m loadtests.fuzz --host http://127.0.0.1:8000 --api-key KEY --examples 200
    python -m loadtests.fuzz --examples 0 --contract-examples 100 --out runs/contract   # the OpenAPI contract only
    python -m loadtests.fuzz --examples 0 --device-frames 2000 --device-timeout 20 --out runs/device-fuzz  # devices

Every answer must be a 2xx, or a 4xx / 503 whose JSON body names the error (`error.message`); a 5xx other than 503
is a failure. Without --host, the devices are reconfigured live to skip simulated waits (valid bodies still
generate for real, just faster), and after the run every Serve log file of the Ray session is searched for the API
key and the bad keys that were sent (they must never be logged). With --contract-examples N, schemathesis also runs
against the app's own /openapi.json with every default check (loadtests.contract; coverage + fuzzing phases, N
examples per operation), the key passed through the environment. Writes OUT/fuzz.json:
  {"requests", "by_status", "five_xx", "five_xx_examples", "unnamed_4xx", "oversized": {...}, "contract": {...},
   "keys_in_logs", "ok"}
The test suite runs the same strategies (`body_strategy`) against a small random world.

The device channel (--device-frames N: about N hypothesis frames, plus the fixed probes of loadtests.device_fuzz:
frame limits, out-of-order frames, wrong / replayed / foreign session tokens, hundreds of sessions, a slow reader,
connection limits) runs against ws://HOST/v1/device/sessions as the device key given first (--device-key; default
the development key ciar-dev-device-key), a second device key being the other device (cross-device probes) and the
witnesses' (`ciar_device.loop.generate` on the exported device model, --onnx-dir, default <weights>/onnx: make it
with `python -m pipelines.export_onnx`). Without --host a second key is made up and accepted by its digest, and the
endpoint's limits are read from the config. Their images during the fuzz must equal the quiet ones; the health
route must answer after it; the logs are also searched for both device keys and every session token seen. The slow
reader sends for --device-slow-reader-s (40 s: behind Serve's proxy its replies sit in the proxy and the socket
buffers, and the proxy's WebSocket keepalive drops it after 20 + 20 s; the endpoint's send timeout does not fire
there, Serve's replica-side send never blocks). Writes
OUT/device_fuzz.json (loadtests.device_fuzz: frames by kind, answers by close code / status, probes, failures,
witnesses, healthy, secrets_in_logs, ok); the exit code is 1 on any failure of either part.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import sys
import time

PROMPTS = ("a small red circle at the top on a gray background", "a red circle", "a large blue square")
ODD_PROMPTS = ("a red \ud800 circle", "a red \x00 circle", "\u200b", "a 😀 circle", " \t\n ")  # lone surrogate, NUL, ...
PARAM_KEYS = ("tau", "span", "prefix_rate", "inter_enhance", "device_slowdown", "link_drop_after", "cfg_scale",
              "temperature", "top_k", "top_p", "bogus")


def body_strategy():
    """Bodies of POST /v1/images/generations: near-valid ones (mostly answered 200) or arbitrary JSON."""
    from hypothesis import strategies as st

    from ciar.collab.names import METHODS

    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=40)
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=3), max_leaves=8)
    params = st.dictionaries(st.sampled_from(PARAM_KEYS), st.integers(-10, 10 ** 7) | st.floats(-1e7, 1e7) | values,
                             max_size=4)
    arbitrary = st.fixed_dictionaries({}, optional={
        "prompt": st.text(max_size=450) | st.sampled_from(PROMPTS + ODD_PROMPTS) | values,
        "seed": st.integers(-3, 2 ** 64) | values,
        "method": st.sampled_from(list(METHODS) + ["x"]) | values,
        "params": params | values,
        "network": st.sampled_from(["5g", "4g", "wifi", "none", "3g"]) | values,
        "response_format": st.sampled_from(["b64_json", "png", "tokens", "gif"]),
        "stream": st.booleans() | values,
    }) | values
    near_valid = st.fixed_dictionaries({"prompt": st.sampled_from(PROMPTS + ODD_PROMPTS)}, optional={
        "seed": st.integers(0, 1000), "method": st.sampled_from(list(METHODS)),
        "network": st.sampled_from(["5g", "4g", "wifi", "none"]), "response_format": st.sampled_from(["tokens", "png"]),
        "params": st.fixed_dictionaries({}, optional={
            "tau": st.floats(0, 1), "span": st.integers(1, 8), "prefix_rate": st.floats(0, 1),
            "link_drop_after": st.integers(0, 40), "cfg_scale": st.floats(1, 5), "temperature": st.floats(0, 2),
            "top_k": st.integers(0, 64), "top_p": st.floats(0.05, 1)}),
    })
    return near_valid | arbitrary


def check_answer(status: int, content_type: str, text: str) -> str | None:
    """None when the answer is acceptable; else what is wrong with it."""
    if status >= 500 and status != 503:
        return f"{status} ({content_type}): {text[:300]}"
    if status >= 400:
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without a JSON error message ({content_type}): {text[:200]}"
        if not message:
            return f"{status} with an empty error message"
    return None


class Fuzzer:
    """Posts bodies and tallies the answers (used by the CLI and by tests/services/test_app.py)."""

    def __init__(self, url: str, key: str, timeout_s: float = 300.0):
        import requests

        self.session = requests.Session()
        self.gen = f"{url.rstrip('/')}/v1/images/generations"
        self.key, self.timeout_s = key, timeout_s
        self.by_status: dict[str, int] = {}
        self.failures: list[dict] = []
        self.requests = 0

    def post_raw(self, data: bytes | str, headers: dict | None = None):
        h = {"Authorization": f"Bearer {self.key}", "content-type": "application/json", **(headers or {})}
        r = self.session.post(self.gen, data=data, headers=h, timeout=self.timeout_s)
        self.requests += 1
        self.by_status[str(r.status_code)] = self.by_status.get(str(r.status_code), 0) + 1
        return r

    def check(self, body) -> None:
        r = self.post_raw(json.dumps(body))
        bad = check_answer(r.status_code, r.headers.get("content-type", ""), r.text)
        if bad:
            self.failures.append({"body": body, "problem": bad})

    def run(self, examples: int, seed: int = 0) -> None:
        from hypothesis import HealthCheck, given, seed as hseed, settings

        @hseed(seed)
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body_strategy())
        def one(body):
            self.check(body)

        one()

    def oversized(self) -> dict:
        """A 1 MB body: refused with 413 from its Content-Length, before the body is read."""
        t0 = time.perf_counter()
        big = self.post_raw(json.dumps({"prompt": "x" * (1 << 20)}))
        big_s = time.perf_counter() - t0
        return {"1MB_status": big.status_code, "1MB_latency_s": round(big_s, 3),
                "ok": big.status_code == 413}

    def bad_keys(self, keys: list[str]) -> dict:
        codes = [self.post_raw(json.dumps({"prompt": PROMPTS[0]}), {"Authorization": f"Bearer {k}"}).status_code
                 for k in keys]
        codes.append(self.post_raw(json.dumps({"prompt": PROMPTS[0]}), {"Authorization": ""}).status_code)
        return {"codes": codes, "ok": set(codes) == {401}}


def secret_counts(log_dir: str, secrets: list[str]) -> list[int]:
    """How many times each secret appears in the Serve / worker log files under log_dir (each file read once)."""
    counts = [0] * len(secrets)
    files = glob.glob(os.path.join(log_dir, "**", "*.log"), recursive=True) + \
        glob.glob(os.path.join(log_dir, "**", "*.out"), recursive=True) + \
        glob.glob(os.path.join(log_dir, "**", "*.err"), recursive=True)
    for f in files:
        try:
            with open(f, errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        for i, s in enumerate(secrets):
            counts[i] += text.count(s)
    return counts


def keys_in_logs(log_dir: str, secrets: list[str]) -> dict[str, int]:
    """How many times each secret appears in the Serve / worker log files under log_dir (must be 0)."""
    return {s[:4] + "…": n for s, n in zip(secrets, secret_counts(log_dir, secrets))}


DEV_DEVICE_KEY = "ciar-dev-device-key"  # the device key serve_config.yaml accepts (by its digest)


def device_target(url: str, keys: list[str], app: dict | None, timeout_s: float, replicas: int = 1):
    """The device endpoint of the cluster at `url` (http://HOST:PORT) as loadtests.device_fuzz sees it; with `app`
    (a cluster this process started) its limits from the config and the verifier's session count."""
    from loadtests.device_fuzz import Target
    from services.config import AppConfig, DeviceEndpointConfig

    lim = AppConfig(**app["args"]).device_endpoint if app is not None else DeviceEndpointConfig()
    sessions = None
    if app is not None:
        from ray import serve

        from loadtests.run import APP_NAME, each_replica

        def sessions():
            h = serve.get_deployment_handle("Verifier", app_name=APP_NAME)
            seen = each_replica(lambda: h.stats.remote().result(timeout_s=timeout_s), "replica_id", replicas)
            return sum(s["sessions"] for s in seen.values())

    return Target("ws" + url.rstrip("/")[len("http"):], (keys[0], keys[1]), health_url=f"{url.rstrip('/')}/healthz",
                  max_connections=lim.max_connections, max_connections_per_device=lim.max_connections_per_device,
                  send_timeout_s=lim.send_timeout_s, timeout_s=timeout_s, verifier_sessions=sessions,
                  server_memory=serving_rss if app is not None else None)


def serving_rss() -> dict:
    """RSS in MB of this process's Serve ingress replicas and HTTP proxies (the Ray workers it started)."""
    import psutil

    out: dict = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name = (proc.cmdline() or [""])[0]
            role = "ingress" if name.startswith("ray::ServeReplica:ciar:Ingress") else \
                "proxy" if name.startswith("ray::ProxyActor") else None
            if role:
                out[f"{role}_mb"] = round(out.get(f"{role}_mb", 0.0) + proc.memory_info().rss / 2**20, 1)
        except psutil.Error:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    from loadtests.run import (REPO, Cluster, apply_overrides, client_key, free_port, load_app_config, use_key,
                               use_weights)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=500)
    p.add_argument("--out", default="runs/fuzz")
    p.add_argument("--host", default=None, help="a running cluster's URL (then nothing is started or stopped)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--weights", default=None, help="weights folder (default: the config's, i.e. the shipped world)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="as in loadtests.run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contract-examples", type=int, default=0,
                   help="schemathesis examples per operation against /openapi.json (0: no contract run)")
    p.add_argument("--contract-max-time", type=float, default=None, help="seconds; stop the contract run after")
    p.add_argument("--device-frames", type=int, default=0,
                   help="fuzz the device channel with about this many hypothesis frames (0: not at all)")
    p.add_argument("--device-key", action="append", default=[], metavar="KEY",
                   help="the fuzzed device's key, then another device's (needed with --host; else made up)")
    p.add_argument("--device-sessions", type=int, default=200, help="OPENs of the many-sessions probe")
    p.add_argument("--device-timeout", type=float, default=30.0, help="seconds: a device probe's bound (a hang)")
    p.add_argument("--device-slow-reader-s", type=float, default=40.0, help="seconds the slow reader sends without "
                   "reading (behind Serve's proxy its unread replies sit in socket buffers and the proxy until the "
                   "proxy's WebSocket keepalive, 20 + 20 s, drops it)")
    p.add_argument("--onnx-dir", default=None, help="the exported device model the witnesses run (default: "
                   "<weights>/onnx, `python -m pipelines.export_onnx`)")
    args = p.parse_args(argv)
    witnesses = None
    if args.device_frames > 0:
        from ciar.world import default_weights_dir
        from loadtests.device_fuzz import onnx_witnesses

        if args.host is not None and len(args.device_key) < 2:
            p.error("--device-frames with --host needs two device keys (--device-key KEY --device-key OTHER_KEY)")
        onnx_dir = args.onnx_dir or os.path.join(os.path.abspath(args.weights or default_weights_dir()), "onnx")
        if not os.path.isfile(os.path.join(onnx_dir, "manifest.json")):
            p.error(f"no exported device model in {onnx_dir} (the witnesses run it): run `python -m "
                    f"pipelines.export_onnx` (--weights for another world) or pass --onnx-dir")
        witnesses = onnx_witnesses(onnx_dir)

    os.makedirs(args.out, exist_ok=True)
    cluster = None
    report: dict = {"examples": args.examples, "seed": args.seed}
    bad_keys = ["wrong-key-0123456789", "ciar-dev-key " * 2, "Bearer"]
    device_keys = list(args.device_key)
    app = None
    try:
        if args.host is None:
            app = apply_overrides(load_app_config(args.config), ["Device.realtime=false"] + args.sets)
            app["args"]["devices"] = args.devices
            if args.weights:
                use_weights(app, args.weights)
            if args.api_key:
                use_key(app, args.api_key)
            key = client_key(app, args.api_key)
            if args.device_frames > 0:  # the fuzzed device and another one, accepted by their digests
                from services.config import key_digest

                device_keys = (device_keys or [DEV_DEVICE_KEY])[:2]
                if len(device_keys) < 2:
                    device_keys.append("fuzz-" + secrets.token_urlsafe(24))
                digests = app["args"].get("device_key_sha256") or []
                app["args"]["device_key_sha256"] = list(dict.fromkeys(digests + [key_digest(k) for k in device_keys]))
            cluster = Cluster(app, free_port(), free_port())
            print(f"starting the cluster ({args.devices} devices, simulated waits off) ...", flush=True)
            cluster.start()
            url = cluster.url
        else:
            url, key = args.host, client_key(None, args.api_key)
        f = Fuzzer(url, key)
        t0 = time.perf_counter()
        if args.contract_examples > 0:
            from loadtests.contract import run_contract

            report["contract"] = run_contract(url, key, args.contract_examples, seed=args.seed,
                                              phases="coverage,fuzzing", max_time_s=args.contract_max_time,
                                              report_dir=args.out)
            report["contract_wall_s"] = round(time.perf_counter() - t0, 1)
            print(report["contract"]["output"][-1500:], flush=True)
            t0 = time.perf_counter()
        if args.examples > 0:
            f.run(args.examples, args.seed)
        report["fuzz_wall_s"] = round(time.perf_counter() - t0, 1)
        report["oversized"] = f.oversized()
        report["bad_keys"] = f.bad_keys(bad_keys)
        report.update({"requests": f.requests, "by_status": dict(sorted(f.by_status.items())),
                       "five_xx": sum(v for k, v in f.by_status.items() if k.startswith("5") and k != "503"),
                       "problems": len(f.failures), "problem_examples": f.failures[:10]})
        device, fuzzer = None, None
        if args.device_frames > 0:
            from loadtests.device_fuzz import DeviceFuzzer
            from services.config import AppConfig

            replicas = AppConfig(**app["args"]).verifier_replicas if app is not None else 1
            target = device_target(url, device_keys, app if cluster is not None else None, args.device_timeout,
                                   replicas)
            print(f"device channel: {args.device_frames} frames and the probes against {target.ws_url} ...",
                  flush=True)
            fuzzer = DeviceFuzzer(target, witnesses, seed=args.seed)
            device = fuzzer.run(args.device_frames, sessions_tried=args.device_sessions,
                                slow_reader_s=args.device_slow_reader_s)
            report["device"] = {"ok": device["ok"], "failure_count": device["failure_count"],
                                "file": os.path.join(args.out, "device_fuzz.json")}
        if cluster is not None:
            import ray

            log_dir = ray._private.worker._global_node.get_logs_dir_path()  # this session's logs
            time.sleep(2.0)  # let the log monitors flush
            report["keys_in_logs"] = keys_in_logs(log_dir, [key] + bad_keys[:1])
            if device is not None:  # device keys by name, session tokens counted together
                found = secret_counts(log_dir, fuzzer.secrets())
                n_keys = len(fuzzer.t.keys)
                device["secrets_in_logs"] = {
                    "device_keys": {k[:4] + "…": n for k, n in zip(fuzzer.t.keys, found[:n_keys])},
                    "session_tokens": {"searched": len(found) - n_keys, "found": sum(1 for n in found[n_keys:] if n)}}
                if any(found):
                    fuzzer.fail("logs", "secrets in logs", f"device keys or session tokens in the logs: "
                                f"{device['secrets_in_logs']}")
                    device.update(failure_count=fuzzer.failure_count, failures=fuzzer.failures, ok=False)
                    report["device"].update(ok=False, failure_count=fuzzer.failure_count)
    finally:
        if cluster is not None:
            cluster.stop()
    if device is not None:
        with open(os.path.join(args.out, "device_fuzz.json"), "w") as fh:
            json.dump(device, fh, indent=2, default=str)
    report["ok"] = (report.get("five_xx") == 0 and report.get("contract", {}).get("ok", True)
                    and report.get("problems") == 0 and report["oversized"]["ok"] and report["bad_keys"]["ok"]
                    and not any((report.get("keys_in_logs") or {}).values())
                    and (report.get("device") or {}).get("ok", True))
    with open(os.path.join(args.out, "fuzz.json"), "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    print(json.dumps({k: v for k, v in report.items() if k != "problem_examples"}, indent=1, default=str))
    if device is not None:
        from loadtests.device_fuzz import summary_lines

        print("\n".join(summary_lines(device)))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
