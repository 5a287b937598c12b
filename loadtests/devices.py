"""Real devices under load: N OS processes, each the torch-free CIAR loop over a real WebSocket to the cluster.

    python -m loadtests.run --users 2 --duration 60 --device-clients 4 --out runs/load    # beside Locust's users
    python -m loadtests.devices --url ws://127.0.0.1:8000 --clients 4 --duration 60 --out runs/devices   # a running
                                                                                         # cluster (make serve)
    python -m loadtests.devices --worker runs/devices/clients/plan-0.json     # one client (the parent starts these)

Each client is its own OS process (`--worker PLAN`): a `ciar_device.runtime.DeviceRuntime` (onnxruntime, one
thread), one `ciar_device.connection.DeviceConnection` (one WebSocket, the device key) and
`ciar_device.loop.generate`, images one after another. Client c's j-th image is scene `c * images + j` of the
held-out split (`ciar.data.scenes`, seed --seed) with image seed `seed * 1000003 + index` (benchmarks.collab's
rule), so every image of a run has its own prompt; the parent picks them (the clients import no torch). The device
model is the one the server serves (`ciar_device.fetch`, once, by the parent) unless --model-dir names an export.
Bounded in count and time: a client stops after `images` images or at the deadline (it starts no image after it;
one underway finishes, each reply bounded by --reply-timeout); the parent waits until the deadline plus --grace,
then stops the clients still running, each by its own PID (SIGTERM to the process group it was started in, then
SIGKILL). A client writes one JSON line per image as soon as it ends (`clients/client-C.jsonl`), so a stopped
client's finished images count:

    client, image, index, seed, session_id, ok, error, t_start (unix s), latency_s (wall of `generate`: the open,
    every verify, the close), stats (the loop's: device_s, cloud_s, comm_s, cloud_requests, bytes, ...),
    exchanges [{kind, up, down, s (send -> reply, client clock), cloud_s, batch_size}], reconnects, resumes

The summary (`summarise`; `loadtests.run` puts it under `device_clients`):

    devices, images, failures, images_per_s (finished images / (last end - first start)), latency_ms {p50, p95,
    p99, mean, max}; per_image means (device_s, cloud_s, wire_s, exchanges, bytes, cloud requests, call rate);
    model {profile: predicted_s p50 / mean, link_s split into rtt_s and bandwidth_s, measured / predicted};
    messages {kind: count, bytes up / down with the WebSocket and frame headers, rtt_ms, cloud_ms and
    rtt - cloud_ms p50 / mean}; batch_size_seen (VERIFY replies' batch sizes: real devices among simulated ones)

What the network model is compared with, and why so. The simulated fleet prices an image as device compute +
the cloud compute its replies report (`cloud_s`) + per exchange `ciar.sim.network`'s link time for the
message bytes (per transmission RTT + bytes * 8 / bandwidth, up and down). `model` applies that price to the
real images: the measured device_s, every exchange's real frame sizes and reported cloud_s. On loopback the link
costs ~nothing, so measured vs the `none` profile (an ideal link) is the meaningful comparison: the difference
(`loopback_gap_s`) is what the model never prices, the serving path itself (codec, WebSocket, Serve's proxy ->
ingress -> verifier handle hops, the verifier's queueing and batch wait); measured vs 5g / 4g / wifi only says how
large the modelled link is next to that overhead (an image on a real link would take about measured + link).
Why no `tc tbf` namespace: tbf shapes bandwidth only, and `netem` (delay) is not in this kernel; for these
message sizes the model's link time is almost all RTT (`bandwidth_share`, from the real bytes: 1.5 % on 5g,
4.3 % on 4g in benchmarks/results/2026-11-25d, i.e. ~40 ms of a 2.6 s image on 4g), so a bandwidth limit would
test a term below the run-to-run noise of a shared 2-core box, and the RTT that dominates cannot be emulated
without a delay queue.

Protocol overhead per message: `codec_bench` times `wire.encode_frame` / `decode_frame` on frames a client really
sent and received (client 0 keeps up to --sample-frames per type): the device's side (numpy) and the server's
(torch arrays, SamplingParams, as services.device_endpoint decodes); `framing` counts the 8-byte frame header and
the WebSocket header (2-14 bytes, masked uplink) against the body. `rtt - cloud` is the client's round trip minus
the cloud compute the reply reports: the WebSocket, Serve's proxy and handle hops, the codec, and the verifier's
queueing. The reply carries no wall time of the verifier's own, so `transport` splits it with Serve's metric
`serve_deployment_processing_latency_ms` of the Verifier (a replica's wall time per call, its wait for the engine
included) under the label Serve gives the WebSocket's calls: the application's route prefix ("/" in Ray 2.60; the
simulated devices' calls carry "/v1/images/generations"). Per exchange, in means: client round trip = cloud compute
+ verifier queueing (its wall time - cloud) + transport (round trip - its wall time). The split is only reported
when that label's call count equals the clients' exchanges (it is a mean over calls, not per message).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from ciar_device import wire
from ciar_device.connection import ConnectionRefused, DeviceConnection
from loadtests.plan import mean as _mean
from loadtests.plan import percentile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_KEY = "ciar-dev-device-key"  # the development device key serve_config.yaml accepts (by its digest)
SEED_STRIDE = 1000003  # benchmarks.collab: prompt i of seed s is made with seed s * 1000003 + i
PROFILES = ("none", "5g", "wifi", "4g")
REQUEST_KINDS = ("OPEN", "VERIFY", "RESUME", "CLOSE")


# ---------------------------------------------------------------------------------------------------- one client
class _Tap:
    """A WebSocket that keeps a copy of the frames it carries (up to `per_type` of each type)."""

    def __init__(self, ws, keep: dict[int, list[bytes]], per_type: int):
        self._ws, self._keep, self._per_type = ws, keep, per_type

    def _copy(self, data) -> None:
        if isinstance(data, (bytes, bytearray)) and len(data) >= wire.HEADER_BYTES:
            kept = self._keep.setdefault(data[3], [])
            if len(kept) < self._per_type:
                kept.append(bytes(data))

    def send(self, data):
        self._copy(data)
        return self._ws.send(data)

    def recv(self, *args, **kwargs):
        data = self._ws.recv(*args, **kwargs)
        self._copy(data)
        return data

    def __getattr__(self, name):
        return getattr(self._ws, name)


class RecordingConnection(DeviceConnection):
    """A DeviceConnection that also records, per exchange, what the reply reports (cloud_s, batch_size) beside the
    connection's own `exchanges` (kind, bytes, seconds), and keeps sample frames when `sample_frames` > 0."""

    def __init__(self, *args, sample_frames: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies: list[dict] = []  # one per entry of self.exchanges
        self.frames: dict[int, list[bytes]] = {}
        self.sample_frames = sample_frames

    def connect(self) -> None:
        fresh = self.ws is None
        super().connect()
        if fresh and self.sample_frames and self.ws is not None:
            self.ws = _Tap(self.ws, self.frames, self.sample_frames)

    def _exchange(self, ftype: int, body, token: bytes = b""):
        seen, frame = len(self.exchanges), None
        try:
            frame = super()._exchange(ftype, body, token)
            return frame
        finally:
            if len(self.exchanges) > seen:  # a reply came (an ERROR raises after it was logged)
                b = frame.body if frame is not None else None
                self.replies.append({"reply": frame.name if frame is not None else "ERROR",
                                     "cloud_s": getattr(b, "cloud_s", None),
                                     "batch_size": getattr(b, "batch_size", None)})


def exchange_rows(conn: RecordingConnection, start: int) -> list[dict]:
    """The connection's exchanges from index `start` with what their replies reported."""
    return [{"kind": e.kind, "up": e.up_bytes, "down": e.down_bytes, "s": e.seconds, **r}
            for e, r in zip(conn.exchanges[start:], conn.replies[start:])]


def run_worker(plan: dict) -> int:
    """One client process: the plan's images until done or past the deadline; one JSON line per image. -> 0, or 2
    when the server refused the device for good."""
    from ciar_device.loop import generate
    from ciar_device.policy import CostObserver
    from ciar_device.runtime import DeviceRuntime

    rt = DeviceRuntime(plan["model_dir"], threads=1)
    # one device: the adaptive policy's estimates kept across its images (the first primed from the WELCOME)
    observer = CostObserver(rates=(rt.manifest.get("ciar_defaults") or {}).get("policy_rates"))
    conn = RecordingConnection(plan["url"], plan["key"], rt.vocab_size, timeout_s=plan["reply_timeout_s"],
                               sample_frames=plan.get("sample_frames", 0))
    rc = 0
    with open(plan["records"], "a") as out:
        for j, item in enumerate(plan["prompts"]):
            if time.time() >= plan["deadline"]:
                break
            seen, r0, s0 = len(conn.exchanges), conn.reconnects, conn.resumes
            rec = {"client": plan["client"], "image": j, "index": item["index"], "seed": item["seed"],
                   "session_id": f"{plan['tag']}-c{plan['client']}-{j}", "t_start": time.time()}
            t0 = time.perf_counter()
            try:
                res = generate(rt, conn, item["prompt"], item["seed"], session_id=rec["session_id"],
                               observer=observer)
                rec.update(ok=True, error=None, stats=res.stats)
            except Exception as e:  # noqa: BLE001 - recorded by type; a refusal ends the client
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}", stats=None)
                if isinstance(e, ConnectionRefused):
                    rc = 2
            rec["latency_s"] = time.perf_counter() - t0
            rec.update(exchanges=exchange_rows(conn, seen), reconnects=conn.reconnects - r0, resumes=conn.resumes - s0)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            if rc:
                break
    conn.disconnect()
    if conn.frames and plan.get("frames"):
        with open(plan["frames"], "w") as f:
            json.dump({wire.TYPE_NAMES.get(t, str(t)): [base64.b64encode(b).decode() for b in fs]
                       for t, fs in conn.frames.items()}, f)
    return rc


# ---------------------------------------------------------------------------------------------------- the parent
@dataclass
class ClientsConfig:
    url: str  # ws://HOST:PORT of the device endpoint
    clients: int = 4
    images: int = 64  # per client, at most
    duration_s: float = 60.0  # no image starts after this
    out: str = "runs/devices"
    key: str = DEVICE_KEY
    model_dir: str | None = None  # None: fetched from the server (ciar_device.fetch)
    seed: int = 0
    split: str = "heldout"
    grace_s: float = 60.0  # past the deadline, before the parent stops a client
    reply_timeout_s: float = 60.0
    sample_frames: int = 16  # frames per type client 0 keeps for the codec benchmark


def plan_prompts(clients: int, images: int, seed: int = 0, split: str = "heldout") -> list[list[dict]]:
    """Per client, its images: scene c * images + j of `split` and its seed (distinct across the whole run)."""
    from ciar.data.scenes import scene_at

    return [[{"index": k, "prompt": scene_at(split, k, seed).caption, "seed": seed * SEED_STRIDE + k}
             for k in range(c * images, (c + 1) * images)] for c in range(clients)]


class DeviceClients:
    """The client processes of one run: `start()`, then `wait()`; `stop()` stops the ones still running."""

    def __init__(self, cfg: ClientsConfig):
        if cfg.clients < 1 or cfg.images < 1 or not cfg.duration_s > 0:
            raise ValueError(f"need clients >= 1, images >= 1, duration > 0; got {cfg.clients}, {cfg.images}, "
                             f"{cfg.duration_s}")
        self.cfg = cfg
        self.dir = os.path.join(os.path.abspath(cfg.out), "clients")
        self.procs: list[subprocess.Popen] = []
        self.deadline = 0.0
        self.started_at = 0.0
        self.exit_codes: list[int | None] = []
        self.stopped: list[int] = []  # clients the parent had to stop

    def model_dir(self) -> str:
        if self.cfg.model_dir:
            return os.path.abspath(self.cfg.model_dir)
        from ciar_device.fetch import fetch_model

        return fetch_model(self.cfg.url, self.cfg.key)

    def start(self) -> None:
        cfg = self.cfg
        os.makedirs(self.dir, exist_ok=True)
        for name in os.listdir(self.dir):  # records of an earlier run in the same folder
            if name.endswith((".jsonl", ".json", ".log")):
                os.remove(os.path.join(self.dir, name))
        model_dir = self.model_dir()
        prompts = plan_prompts(cfg.clients, cfg.images, cfg.seed, cfg.split)
        tag = "lt" + uuid.uuid4().hex[:8]  # session ids of this run (sessions outlive connections)
        self.started_at = time.time()
        self.deadline = self.started_at + cfg.duration_s
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for c in range(cfg.clients):
            plan = {"client": c, "url": cfg.url, "key": cfg.key, "model_dir": model_dir, "prompts": prompts[c],
                    "deadline": self.deadline, "reply_timeout_s": cfg.reply_timeout_s, "tag": tag,
                    "records": os.path.join(self.dir, f"client-{c}.jsonl"),
                    "sample_frames": cfg.sample_frames if c == 0 else 0,
                    "frames": os.path.join(self.dir, f"frames-{c}.json")}
            path = os.path.join(self.dir, f"plan-{c}.json")
            with open(path, "w") as f:
                json.dump(plan, f)
            with open(os.path.join(self.dir, f"client-{c}.log"), "w") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "loadtests.devices", "--worker", path],
                                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def wait(self) -> list[int | None]:
        """Wait until every client ended or the deadline + grace passed; stop the rest (by PID). -> exit codes."""
        end = self.deadline + self.cfg.grace_s
        try:
            for c, p in enumerate(self.procs):
                try:
                    p.wait(timeout=max(0.1, end - time.time()))
                except subprocess.TimeoutExpired:
                    print(f"device client {c} still running after the deadline + {self.cfg.grace_s:g} s: stopping it "
                          f"(pid {p.pid})", file=sys.stderr)
                    self._stop(p)
                    self.stopped.append(c)
        finally:
            self.stop()
        self.exit_codes = [p.returncode for p in self.procs]
        return self.exit_codes

    @staticmethod
    def _stop(p: subprocess.Popen) -> None:
        if p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGTERM)  # the group it was started in (start_new_session): its own PID
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        for p in self.procs:
            self._stop(p)

    def records(self) -> list[dict]:
        out = []
        for c in range(len(self.procs)):
            path = os.path.join(self.dir, f"client-{c}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    out += [json.loads(line) for line in f if line.strip()]
        return out

    def frames(self) -> dict[str, list[bytes]]:
        path = os.path.join(self.dir, "frames-0.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return {k: [base64.b64decode(b) for b in v] for k, v in json.load(f).items()}


# ---------------------------------------------------------------------------------------------------- arithmetic
def ws_header_bytes(payload: int, masked: bool) -> int:
    """RFC 6455 frame header: 2 bytes, +2 (payload >= 126) or +8 (>= 65536) for the length, +4 when masked (every
    client -> server frame)."""
    return 2 + (0 if payload < 126 else 2 if payload < 1 << 16 else 8) + (4 if masked else 0)


def link_s(profile: str, up: int, down: int) -> tuple[float, float]:
    """The network model's time for one exchange of `up` + `down` bytes on `profile` (no jitter, no loss): (total,
    the RTT part alone)."""
    from dataclasses import replace

    from ciar.sim.network import NetworkModel, get_profile

    p = get_profile(profile)
    total = NetworkModel(p).round_trip(up, down).total_s
    rtt = NetworkModel(replace(p, bandwidth_mbps=math.inf)).round_trip(up, down).total_s
    return total, rtt


def predict(rec: dict, profile: str) -> dict:
    """The model's price of one finished image: measured device_s + the replies' cloud_s + per exchange the link
    time of its real bytes."""
    links = [link_s(profile, e["up"], e["down"]) for e in rec["exchanges"]]
    link, rtt = sum(t for t, _ in links), sum(r for _, r in links)
    cloud = sum(e["cloud_s"] or 0.0 for e in rec["exchanges"])
    return {"predicted_s": rec["stats"]["device_s"] + cloud + link, "link_s": link, "rtt_s": rtt,
            "bandwidth_s": link - rtt}


def summarise(records: list[dict], network: str = "5g", profiles=PROFILES) -> dict:
    """The device clients' figures (see the module docstring) from their per-image records."""
    ok = [r for r in records if r.get("ok")]
    out: dict = {"devices": len({r["client"] for r in records}), "images": len(ok),
                 "failures": len(records) - len(ok),
                 "errors": sorted({r["error"].split(":")[0] for r in records if not r.get("ok")})}
    if records:
        start = min(r["t_start"] for r in records)
        end = max(r["t_start"] + r["latency_s"] for r in records)
        out["window_s"] = end - start
        out["images_per_s"] = len(ok) / (end - start) if end > start else None
    lat = [1000.0 * r["latency_s"] for r in ok]
    out["latency_ms"] = {"p50": percentile(lat, 50), "p95": percentile(lat, 95), "p99": percentile(lat, 99),
                         "mean": _mean(lat), "max": max(lat, default=None)}
    if not ok:
        return out
    per = []
    for r in ok:
        st, ex = r["stats"], r["exchanges"]
        wire_s = sum(e["s"] for e in ex)
        cloud_s = sum(e["cloud_s"] or 0.0 for e in ex)
        per.append({"latency_s": r["latency_s"], "device_s": st["device_s"], "cloud_s": cloud_s, "wire_s": wire_s,
                    "rtt_minus_cloud_s": wire_s - cloud_s,
                    "client_other_s": r["latency_s"] - st["device_s"] - wire_s,  # loop glue, request encoding
                    "exchanges": len(ex), "bytes_up": sum(e["up"] for e in ex),
                    "bytes_down": sum(e["down"] for e in ex), "cloud_requests": st["cloud_requests"],
                    "cloud_call_rate": st["cloud_call_rate"], "device_ms_per_token": st["device_ms_per_token"],
                    "resumes": r.get("resumes", 0), "reconnects": r.get("reconnects", 0)})
    out["per_image"] = {k: _mean(p[k] for p in per) for k in per[0]}
    measured = _mean(p["latency_s"] for p in per)
    model = {}
    for prof in profiles:
        pr = [predict(r, prof) for r in ok]
        pred = _mean(p["predicted_s"] for p in pr)
        link = _mean(p["link_s"] for p in pr)
        model[prof] = {"predicted_s": {"p50": percentile([p["predicted_s"] for p in pr], 50), "mean": pred},
                       "link_s": link, "rtt_s": _mean(p["rtt_s"] for p in pr),
                       "bandwidth_s": _mean(p["bandwidth_s"] for p in pr),
                       "bandwidth_share": (_mean(p["bandwidth_s"] for p in pr) / link) if link else None,
                       "measured_over_predicted": measured / pred if pred else None}
    out["model"] = model
    out["network"] = network
    if "none" in model:
        out["loopback_gap_s"] = measured - model["none"]["predicted_s"]["mean"]  # what the model never prices
    out["messages"] = message_table(ok)
    hist: dict[int, int] = {}
    for r in ok:
        for e in r["exchanges"]:
            if e["kind"] == "VERIFY" and e.get("batch_size"):
                hist[int(e["batch_size"])] = hist.get(int(e["batch_size"]), 0) + 1
    n = sum(hist.values())
    out["batch_size_seen"] = {"hist": {str(k): hist[k] for k in sorted(hist)},
                              "mean": sum(k * v for k, v in hist.items()) / n if n else None}
    return out


def message_table(records: list[dict]) -> dict:
    """Per request kind: counts, bytes with their headers, round trip, reported cloud time and the rest."""
    table = {}
    for kind in REQUEST_KINDS:
        ex = [e for r in records for e in r["exchanges"] if e["kind"] == kind]
        if not ex:
            continue
        rtt = [1000.0 * e["s"] for e in ex]
        rest = [1000.0 * (e["s"] - (e["cloud_s"] or 0.0)) for e in ex]
        up, down = _mean(e["up"] for e in ex), _mean(e["down"] for e in ex)
        table[kind] = {"count": len(ex), "per_image": len(ex) / len(records),
                       "up_bytes": up, "down_bytes": down, "frame_header_bytes": wire.HEADER_BYTES,
                       "ws_header_up": _mean(ws_header_bytes(e["up"], True) for e in ex),
                       "ws_header_down": _mean(ws_header_bytes(e["down"], False) for e in ex),
                       "framing_share": _mean((2 * wire.HEADER_BYTES + ws_header_bytes(e["up"], True)
                                               + ws_header_bytes(e["down"], False))
                                              / (e["up"] + e["down"] + ws_header_bytes(e["up"], True)
                                                 + ws_header_bytes(e["down"], False)) for e in ex),
                       "rtt_ms": {"p50": percentile(rtt, 50), "p99": percentile(rtt, 99), "mean": _mean(rtt)},
                       "cloud_ms": _mean(1000.0 * (e["cloud_s"] or 0.0) for e in ex),
                       "rtt_minus_cloud_ms": {"p50": percentile(rest, 50), "mean": _mean(rest)}}
    return table


# ---------------------------------------------------------------------------------------------------- codec
def codec_bench(frames: dict[str, list[bytes]], repeat: int = 200, rounds: int = 5) -> dict:
    """Per frame type: the time of `wire.encode_frame` and `decode_frame` per call on the given real frames (the
    best of `rounds` rounds of `repeat` calls per frame, then the mean over frames: a shared box's other work
    inflates means), as the device does it (numpy) and as the server does (torch arrays, SamplingParams; when torch
    is importable), with the frame's header / body bytes. Run it with the cluster stopped."""
    server = None
    try:
        import torch

        from ciar.decoding.sampling import SamplingParams

        server = {"array": torch.from_numpy, "sampling": SamplingParams}
    except ImportError:
        pass

    def per_call(fn) -> float:
        fn()  # warm
        best = math.inf
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(repeat):
                fn()
            best = min(best, (time.perf_counter() - t) / repeat * 1e6)
        return best

    out = {}
    for name, fs in sorted(frames.items()):
        if not fs:
            continue
        row = {"frames": len(fs), "bytes": _mean(len(b) for b in fs), "header_bytes": wire.HEADER_BYTES,
               "body_bytes": _mean(len(b) - wire.HEADER_BYTES for b in fs)}
        decoded = [wire.decode_frame(b) for b in fs]
        row["decode_us"] = _mean(per_call(lambda b=b: wire.decode_frame(b)) for b in fs)
        row["encode_us"] = _mean(per_call(lambda f=f: wire.encode_frame(f)) for f in decoded)
        if server is not None:
            srv = [wire.decode_frame(b, **server) for b in fs]
            row["decode_server_us"] = _mean(per_call(lambda b=b: wire.decode_frame(b, **server)) for b in fs)
            row["encode_server_us"] = _mean(per_call(lambda f=f: wire.encode_frame(f)) for f in srv)
        out[name] = row
    return out


# ---------------------------------------------------------------------------------------------------- server timing
def serve_latency(metrics_text: str, deployment: str = "Verifier") -> dict:
    """Serve's `serve_deployment_processing_latency_ms` of one deployment from Prometheus text: {route: {count,
    mean_ms}} (a replica's wall time per call, queueing inside it included)."""
    import re

    line = re.compile(r"^(\w+)(\{[^}]*\})?\s+(\S+)")
    sums: dict[str, list[float]] = {}
    for text in metrics_text.splitlines():
        m = line.match(text)
        if not m or not m.group(1).endswith(("serve_deployment_processing_latency_ms_sum",
                                             "serve_deployment_processing_latency_ms_count")):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels.get("deployment") != deployment:
            continue
        acc = sums.setdefault(labels.get("route", ""), [0.0, 0.0])
        acc[0 if m.group(1).endswith("_sum") else 1] += float(m.group(3))
    return {route: {"count": int(c), "mean_ms": s / c if c else None} for route, (s, c) in sorted(sums.items())}


def transport_split(records: list[dict], handling: dict, route: str = "/") -> dict:
    """Mean per exchange: the clients' round trip = cloud compute (the replies' cloud_s) + the verifier's queueing
    (its wall time per call from Serve's metric under `route`, minus cloud) + transport (the rest). Only when the
    route's calls are the clients' exchanges (the same count, within 1 %)."""
    ex = [e for r in records for e in r["exchanges"]]
    h = handling.get(route) or {}
    out = {"route": route, "exchanges": len(ex), "verifier_calls": h.get("count")}
    if not ex or not h.get("count") or abs(h["count"] - len(ex)) > 0.01 * len(ex):
        out["note"] = "the verifier's calls under this route are not the clients' exchanges: no split"
        return out
    rtt = _mean(1000.0 * e["s"] for e in ex)
    cloud = _mean(1000.0 * (e["cloud_s"] or 0.0) for e in ex)
    out.update(client_rtt_ms=rtt, cloud_ms=cloud, verifier_wall_ms=h["mean_ms"],
               verifier_queue_ms=h["mean_ms"] - cloud, transport_ms=rtt - h["mean_ms"])
    return out


def run_clients(cfg: ClientsConfig, network: str = "5g", metrics_url: str | None = None) -> dict:
    """Start the clients, wait for them, summarise (with the codec benchmark). -> the `device_clients` section."""
    clients = DeviceClients(cfg)
    clients.start()
    clients.wait()
    return report(clients, network, metrics_url)


def report(clients: DeviceClients, network: str = "5g", metrics_url: str | None = None, route: str = "/",
           codec: bool = True) -> dict:
    """The clients' summary, their codec benchmark (`codec`; loadtests.run adds it once its cluster is down), and
    (with `metrics_url`, Ray's Prometheus endpoint) the Verifier's handling time and the transport split of their
    round trips."""
    records = clients.records()
    out = summarise(records, network)
    out.update(config={k: v for k, v in asdict(clients.cfg).items() if k != "key"},
               exit_codes=clients.exit_codes, stopped_by_parent=clients.stopped, records_dir=clients.dir)
    if codec:
        out["codec"] = codec_bench(clients.frames())
    if metrics_url:
        import urllib.request

        try:
            with urllib.request.urlopen(metrics_url, timeout=10) as r:
                out["verifier_handling"] = serve_latency(r.read().decode())
            out["transport"] = transport_split(records, out["verifier_handling"], route)
        except OSError as e:
            out["verifier_handling"] = {"error": str(e)}
    return out


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_summary(s: dict) -> None:
    lat = s.get("latency_ms") or {}
    print(f"device clients: {s['devices']} devices, {s['images']} images, {s.get('failures', 0)} failures, "
          f"{_fmt(s.get('images_per_s'), 3)} images/s, latency ms p50 {_fmt(lat.get('p50'), 0)} p99 "
          f"{_fmt(lat.get('p99'), 0)}")
    for prof, m in (s.get("model") or {}).items():
        print(f"  model {prof:>4}: predicted {_fmt(m['predicted_s']['mean'], 3)} s/image (link "
              f"{_fmt(m['link_s'], 3)} s, bandwidth share {_fmt(100 * (m['bandwidth_share'] or 0), 1)} %), "
              f"measured / predicted {_fmt(m['measured_over_predicted'], 2)}")
    for kind, m in (s.get("messages") or {}).items():
        print(f"  {kind:>6}: {m['count']} x, {_fmt(m['up_bytes'], 0)} B up / {_fmt(m['down_bytes'], 0)} B down, "
              f"rtt p50 {_fmt(m['rtt_ms']['p50'])} ms, cloud {_fmt(m['cloud_ms'])} ms, rtt - cloud p50 "
              f"{_fmt(m['rtt_minus_cloud_ms']['p50'])} ms")
    t = s.get("transport") or {}
    if "transport_ms" in t:
        print(f"  per exchange: round trip {_fmt(t['client_rtt_ms'])} ms = cloud {_fmt(t['cloud_ms'])} + verifier "
              f"queueing {_fmt(t['verifier_queue_ms'])} + transport {_fmt(t['transport_ms'])} ms")
    b = s.get("batch_size_seen") or {}
    print(f"  verifier batch size seen by the real devices: mean {_fmt(b.get('mean'), 2)} hist {b.get('hist')}")


# ---------------------------------------------------------------------------------------------------- entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", default=None, metavar="PLAN", help="run one client from its plan (internal)")
    p.add_argument("--url", default="ws://127.0.0.1:8000", help="ws://HOST:PORT of a running cluster")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--images", type=int, default=64, help="images per client, at most")
    p.add_argument("--duration", type=float, default=60.0, help="seconds: no image starts after this")
    p.add_argument("--grace", type=float, default=60.0, help="seconds past the deadline before a client is stopped")
    p.add_argument("--key", default=os.environ.get("CIAR_DEVICE_KEY", DEVICE_KEY))
    p.add_argument("--model-dir", default=None, help="the device model's export (default: fetched from the server)")
    p.add_argument("--network", default="5g", help="the profile the model's headline prediction uses")
    p.add_argument("--metrics-url", default=None, help="Ray's Prometheus endpoint (the Verifier's handling time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/devices")
    args = p.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            return run_worker(json.load(f))
    cfg = ClientsConfig(args.url, args.clients, args.images, args.duration, args.out, args.key, args.model_dir,
                        args.seed, grace_s=args.grace)
    s = run_clients(cfg, args.network, args.metrics_url)
    path = os.path.join(os.path.abspath(args.out), "device_clients.json")
    with open(path, "w") as f:
        json.dump(s, f, indent=2)
    print_summary(s)
    print(f"summary: {path}")
    return 0 if s["images"] and not s["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
