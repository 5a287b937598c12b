"""A bounded soak: mixed traffic against a cluster it starts, sampled every minute, with a slope per series.

    python -m loadtests.soak --minutes 30 --out runs/soak                      # the issue-40 soak
    python -m loadtests.soak --minutes 2 --sample-s 15 --warmup-min 0.5 --out runs/soak-short
    python -m loadtests.soak --replot --out runs/soak                           # soak.png again from soak.json

It starts the cluster as `loadtests.reliability` does (serve_config.yaml with `--set` overrides applied, a Ray
instance of its own on loopback; it stops only what it started) and, for --minutes, runs a steady mix:

http        --http-workers threads, one request at a time each (0..--think-s between): in every 8 requests 4 plain
            (JSON, tokens or b64_json), 3 streamed and read to the `result` event, 1 streamed and disconnected after
            its first progress event; methods ciar / cloud / eagle / lantern, links 5g / wifi / 4g. The simulated
            phones (Device replicas) serve them.
devices     --device-clients threads, each a real device: the torch-free `ciar_device` loop (onnxruntime, one
            thread) over its own WebSocket to the device endpoint, images one after another. Every --cut-every-th
            image (at the calibrated point, `policy: fixed`, so that it verifies) has its socket cut without a
            closing handshake after its first verification: the client finds out at its next exchange, reconnects
            and, at its next VERIFY, resumes the session from its history (RESUME); the image must finish, not
            degraded (a cut that only the image's CLOSE finds has nothing to resume: counted apart).
reconfigure once, at half time: the Device deployment's user_config changes (preview_every 24 -> 36) by a
            redeploy of the same application (Serve calls `reconfigure`; no replica may restart: every replica's
            PID is compared before and after).

Nothing is lost: every HTTP answer must be a 200 (there is no deliberate overload here, so a 503 counts as lost
too), every stream must end in `result` (the early disconnects must have started with a 200), every device image
must finish, not degraded, and every cut image must have resumed. No new request starts after --minutes; the
requests underway finish (each bounded by its timeout) within --drain-s, else they count as lost.

Every --sample-s (60) seconds from the traffic's start, and once at its end, it samples:

  processes   per Serve process, by PID from the GCS actor table (`ray._private.state.actors()`, ALIVE actors of
              the classes ServeReplica:ciar:{Verifier,Device,Ingress}, ProxyActor, ServeController; this needs no
              dashboard): RSS and USS (psutil; USS reads /proc/PID/smaps) and open file descriptors (/proc/PID/fd)
  verifier    open sessions and free KV slots (`Verifier.stats()`)
  devices     what the phones hold between images, summed over the replicas that answered `Device.state()` within
              20 s (a phone serves one call at a time, so a busy one answers after its image): session_tokens,
              batch_size_records, tracked_sessions
  object store  Ray's plasma store as its raylet reports it (`FormatGlobalMemoryInfo`, what `ray memory
              --stats-only` prints): bytes used and objects
  outcomes    the outcome counts so far (the plot's throughput)

After the traffic: the requests underway finish, then the run waits the verifier's idle timeout (x1.6 + 1 s) and
samples once more ("settled"): no verifier session and no device state may be left.

Slopes. Each series' samples after --warmup-min minutes get a least-squares line (y per minute), its standard
error from the residuals, and the means of the first and second half. A series GROWS when its slope is above zero by
more than --z standard errors AND its fitted growth over the measured span exceeds the series' floor (RSS / USS
4 MB, file descriptors 2, sessions and device state 1, object store 4 MiB / 20 objects): significant and material.
`drift` is significant but under the floor (reported, not failing); `flat` is within the noise; `settling` grows
over the whole span but not over its later half alone (a level reached after a warm-up; reported, not failing).

OUT/soak.json holds every sample, fit and count; OUT/soak.png plots the series (the fitted lines, the warm-up
shaded, the reconfiguration marked). The exit code is 0 only when nothing was lost, no replica restarted, the
reconfiguration happened in place, nothing was left after the idle timeout and no series grows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import sys
import threading
import time
from collections import Counter

from loadtests.run import (REPO, Cluster, apply_overrides, client_key, free_port, load_app_config, serve_actors,
                           use_weights)

PROMPTS = ("a small red circle at the top on a gray background",
           "a large blue square at the center on a black background",
           "a green triangle at the bottom left and a yellow circle at the top right on a white background",
           "a medium purple star at the left on a gray background")
METHODS = ("ciar", "cloud", "eagle", "lantern")
NETWORKS = ("5g", "wifi", "4g")
HTTP_CYCLE = ("plain", "stream", "plain", "stream", "plain", "stream_cut", "plain", "stream")
DEVICE_KEY = "ciar-dev-device-key"
RECONFIG = {"preview_every": 36}  # the live change made once, at half time (serve_config.yaml has 24)

# growth that matters over the measured span, per unit (a series' name starts with its unit)
FLOORS = {"rss_mb": 4.0, "uss_mb": 4.0, "fds": 2.0, "sessions": 1.0, "device_state": 1.0, "store_mb": 4.0,
          "store_objects": 20.0, "free_slots": 1.0}
UNITS = {"rss_mb": "MB", "uss_mb": "MB", "fds": "fds", "sessions": "sessions", "device_state": "entries",
         "store_mb": "MiB", "store_objects": "objects", "free_slots": "slots"}


# ---------------------------------------------------------------------------------------------------- the maths
def fit_slope(ts: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b t: slope b (per unit of t), its standard error from the residuals (None with fewer
    than 3 points), the intercept, the mean, and the means of the first and second half (by sample order)."""
    n = len(ts)
    if n != len(ys):
        raise ValueError(f"{n} times but {len(ys)} values")
    if n < 2:
        return {"n": n, "slope": None, "se": None, "intercept": None, "mean": ys[0] if ys else None,
                "span": 0.0, "first_half_mean": None, "second_half_mean": None}
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        raise ValueError("all samples at the same time")
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx
    a = my - b * mt
    se = None
    if n > 2:
        rss = sum((y - a - b * t) ** 2 for t, y in zip(ts, ys))
        se = math.sqrt(rss / (n - 2) / sxx)
    h = n // 2
    return {"n": n, "slope": b, "se": se, "intercept": a, "mean": my, "span": max(ts) - min(ts),
            "first_half_mean": sum(ys[:h]) / h, "second_half_mean": sum(ys[n - h:]) / h}


MIN_POINTS = 5  # fewer samples than this say nothing (3 integer points can sit on a line exactly: se 0)


def classify(fit: dict, floor: float, z: float = 3.0) -> str:
    """growing / falling: the slope differs from 0 by more than z standard errors and its growth over the span is
    above `floor`; drift: significant but under the floor; flat: within the noise; unknown: fewer than MIN_POINTS
    samples."""
    b, se = fit.get("slope"), fit.get("se")
    if b is None or se is None or fit.get("n", 0) < MIN_POINTS:
        return "unknown"
    significant = abs(b) > z * se
    material = abs(b) * fit["span"] > floor
    if not significant:
        return "flat"
    if not material:
        return "drift"
    return "growing" if b > 0 else "falling"


def unit_of(name: str) -> str:
    return name.split(":", 1)[0]


def judge(ts: list[float], ys: list[float], floor: float, z: float = 3.0) -> dict:
    """The fit over all the points and over their later half (>= MIN_POINTS points), and the class: the whole
    span's, except `settling` where the whole span grows but the later half alone is flat or drifts (a level reached
    after a warm-up, not a leak: a leak keeps growing)."""
    fit = fit_slope(ts, ys) if len(ts) >= 2 else fit_slope([], [])
    cls = classify(fit, floor, z)
    h = len(ts) // 2
    late = fit_slope(ts[h:], ys[h:]) if len(ts) - h >= MIN_POINTS else None
    late_cls = classify(late, floor, z) if late is not None else None
    if cls == "growing" and late_cls in ("flat", "drift", "falling"):
        cls = "settling"
    return {**fit, "late_slope": late["slope"] if late else None, "late_se": late["se"] if late else None,
            "late_class": late_cls, "class": cls}


def analyse(samples: list[dict], warmup_min: float, z: float = 3.0) -> dict:
    """Per series (name -> [(t_min, value)]): `judge` over the samples at or after the warm-up."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, v in s["series"].items():
            if v is not None:
                series.setdefault(name, []).append((s["t_min"], float(v)))
    out = {}
    for name, pts in sorted(series.items()):
        kept = [(t, y) for t, y in pts if t >= warmup_min - 1e-9]
        floor = FLOORS.get(unit_of(name), 1.0)
        fit = judge([t for t, _ in kept], [y for _, y in kept], floor, z)
        out[name] = {**{k: (round(v, 6) if isinstance(v, float) else v) for k, v in fit.items()},
                     "unit": UNITS.get(unit_of(name), ""), "floor": floor}
    return out


# ---------------------------------------------------------------------------------------------------- sampling
def serve_processes() -> dict[str, dict]:
    """ALIVE Serve actors (replicas, proxies, the controller): {actor name: {class, pid}}."""
    return {a.get("Name") or a["ActorID"]: {"class": a["ActorClassName"], "pid": int(a.get("Pid") or 0)}
            for a in serve_actors(system=True)}


class Labels:
    """Stable short labels for Serve processes: Verifier, Device-1.., Ingress, proxy, controller (by actor name)."""

    def __init__(self):
        self.of: dict[str, str] = {}

    def label(self, name: str, cls: str) -> str:
        if name not in self.of:
            base = ("proxy" if cls == "ProxyActor" else "controller" if cls == "ServeController"
                    else cls.rsplit(":", 1)[-1])
            if base == "Device":
                base = f"Device-{sum(1 for v in self.of.values() if v.startswith('Device-')) + 1}"
            elif base in self.of.values():
                base = f"{base}-{sum(1 for v in self.of.values() if v.startswith(base)) + 1}"
            self.of[name] = base
        return self.of[name]


def process_figures(pid: int) -> dict:
    import psutil

    try:
        p = psutil.Process(pid)
        mem = p.memory_full_info()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"pid": pid, "rss_mb": round(mem.rss / 2**20, 2), "uss_mb": round(mem.uss / 2**20, 2), "fds": fds}
    except (psutil.Error, OSError) as e:
        return {"pid": pid, "error": type(e).__name__}


def object_store() -> dict:
    """Ray's plasma store, as the raylet reports it (`ray memory --stats-only`): MiB used, objects."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address), timeout_seconds=30)
    st = reply.store_stats
    return {"store_mb": round(st.object_store_bytes_used / 2**20, 3), "store_objects": int(st.num_local_objects),
            "store_avail_mb": round(st.object_store_bytes_avail / 2**20, 1)}


def device_state(devices: int, budget_s: float = 20.0) -> dict:
    """`Device.state()` of as many phones as answer within budget_s (a busy phone answers after its image)."""
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    from ray import serve

    h = serve.get_deployment_handle("Device", app_name="ciar")
    seen: dict = {}
    deadline = time.monotonic() + budget_s
    with ThreadPoolExecutor(1) as pool:
        while len(seen) < devices and time.monotonic() < deadline:
            fut = pool.submit(lambda: h.state.remote().result(timeout_s=max(1.0, deadline - time.monotonic())))
            try:
                s = fut.result(timeout=max(1.0, deadline - time.monotonic()) + 2)
            except (FutureTimeout, Exception):  # noqa: BLE001 - a phone busy past the budget
                break
            seen[s["device_id"]] = s
    keys = ("session_tokens", "batch_size_records", "tracked_sessions")
    return {"seen": len(seen), "busy": sum(bool(s["busy"]) for s in seen.values()),
            **{k: sum(s[k] for s in seen.values()) for k in keys}}


def verifier_stats() -> dict:
    from ray import serve

    v = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result(timeout_s=60)
    return {"sessions": v["sessions"], "free_slots": v["free_slots"], "replica_id": v["replica_id"]}


def take_sample(t_min: float, labels: Labels, devices: int, tally: "Tally") -> dict:
    s: dict = {"t_min": round(t_min, 3), "time": time.time(), "procs": {}, "series": {}}
    for name, p in sorted(serve_processes().items()):
        lab = labels.label(name, p["class"])
        fig = process_figures(p["pid"])
        s["procs"][lab] = fig
        for k in ("rss_mb", "uss_mb", "fds"):
            s["series"][f"{k}:{lab}"] = fig.get(k)
    for what, call in (("verifier", verifier_stats), ("object_store", object_store),
                       ("devices", lambda: device_state(devices))):
        try:
            s[what] = call()
        except Exception as e:  # noqa: BLE001 - a sample that failed is recorded, not fatal
            s[what] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    v, o, d = s["verifier"], s["object_store"], s["devices"]
    s["series"].update({"sessions:verifier": v.get("sessions"), "free_slots:verifier": v.get("free_slots"),
                        "store_mb:plasma": o.get("store_mb"), "store_objects:plasma": o.get("store_objects")})
    if d.get("seen") == devices:  # a sum over some phones only is not comparable with the others
        for k in ("session_tokens", "batch_size_records", "tracked_sessions"):
            s["series"][f"device_state:{k}"] = d[k]
    s["outcomes"] = tally.snapshot()
    return s


# ---------------------------------------------------------------------------------------------------- traffic
class Tally:
    """Outcome counts per traffic kind (thread-safe): attempted, ok, degraded, lost, and the first errors."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[str, Counter] = {}
        self.errors: list[str] = []
        self.underway = 0

    def start(self) -> None:
        with self._lock:
            self.underway += 1

    def add(self, kind: str, outcome: str, error: str | None = None, **extra: int) -> None:
        with self._lock:
            self.underway -= 1
            c = self.counts.setdefault(kind, Counter())
            c["attempted"] += 1
            c[outcome] += 1
            for k, v in extra.items():
                c[k] += v
            if error and len(self.errors) < 50:
                self.errors.append(f"{kind}: {error}")

    def snapshot(self) -> dict:
        with self._lock:
            return {k: dict(c) for k, c in self.counts.items()}


def http_body(rng: random.Random, k: int) -> dict:
    method = METHODS[k % len(METHODS)]
    return {"prompt": rng.choice(PROMPTS), "seed": rng.randrange(1 << 20), "method": method,
            "network": rng.choice(NETWORKS), "response_format": rng.choice(("tokens", "b64_json"))}


def http_one(session, url: str, headers: dict, kind: str, body: dict, timeout_s: float) -> tuple[str, str | None]:
    """One request of `kind` (plain / stream / stream_cut) -> (outcome ok / degraded / lost, error)."""
    import requests

    gen = f"{url}/v1/images/generations"
    try:
        if kind == "plain":
            r = session.post(gen, json=body, headers=headers, timeout=timeout_s)
            if r.status_code != 200:
                return "lost", f"{r.status_code} {r.text[:160]}"
            return ("degraded" if r.json()["stats"].get("degraded") else "ok"), None
        with session.post(gen, json={**body, "stream": True}, headers=headers, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                return "lost", f"{r.status_code} {r.text[:160]}"
            event = None
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    event = line[7:].strip()
                elif line.startswith("data: "):
                    if kind == "stream_cut":
                        return "ok", None  # hung up after the first event (the connection closes here)
                    if event == "result":
                        return ("degraded" if json.loads(line[6:])["stats"].get("degraded") else "ok"), None
                    if event == "error":
                        return "lost", f"error event {line[6:160]}"
            return "lost", "stream ended without a result event"
    except requests.RequestException as e:
        return "lost", f"{type(e).__name__}: {str(e)[:160]}"


def http_worker(i: int, url: str, key: str, stop: threading.Event, tally: Tally, think_s: float, seed: int,
                timeout_s: float) -> None:
    import requests

    rng = random.Random(seed * 7919 + i)
    headers = {"Authorization": f"Bearer {key}"}
    k = i  # workers start at different points of the cycle
    with requests.Session() as session:
        while not stop.is_set():
            kind = HTTP_CYCLE[k % len(HTTP_CYCLE)]
            body = http_body(rng, k)
            tally.start()
            outcome, err = http_one(session, url, headers, kind, body, timeout_s)
            tally.add(f"http_{kind}", outcome, err)
            k += 1
            stop.wait(rng.uniform(0, think_s))


def cut_socket(conn) -> bool:
    """Cut a device's socket without a closing handshake, leaving the connection to find out at its next
    exchange (reconnect, then RESUME: the verifier may or may not have kept the session)."""
    ws = conn.ws
    if ws is None:
        return False
    try:
        ws.socket.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True


def device_worker(i: int, ws_url: str, key: str, model_dir: str, stop: threading.Event, tally: Tally,
                  cut_every: int, seed: int, tag: str) -> None:
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate
    from ciar_device.policy import CostObserver
    from ciar_device.runtime import DeviceRuntime

    rt = DeviceRuntime(model_dir, threads=1)
    observer = CostObserver(rates=(rt.manifest.get("ciar_defaults") or {}).get("policy_rates"))
    conn = DeviceConnection(ws_url, key, rt.vocab_size, timeout_s=120.0)
    rng = random.Random(seed * 104729 + i)
    k = 0
    try:
        while not stop.is_set():
            cut = cut_every > 0 and k % cut_every == cut_every - 1
            fired = [False, 0]  # cut, and len(conn.exchanges) when it was
            resumes0 = conn.resumes

            def on_progress(tokens, stats, cut=cut, fired=fired):
                # after the first verification, while tokens remain to decide (a later VERIFY finds the cut)
                if cut and not fired[0] and stats.get("verifications", 0) >= 1 and len(tokens) < rt.num_tokens:
                    fired[0], fired[1] = cut_socket(conn), len(conn.exchanges)

            kind = "device_ws_cut" if cut else "device_ws"
            tally.start()
            try:
                res = generate(rt, conn, rng.choice(PROMPTS), rng.randrange(1 << 20), session_id=f"{tag}-d{i}-{k}",
                               observer=observer, on_progress=on_progress, **({"policy": "fixed"} if cut else {}))
                resumed = conn.resumes - resumes0
                # a cut that only the image's CLOSE found (no VERIFY after it) has nothing to resume
                verified_after = fired[0] and any(e.kind == "VERIFY" for e in conn.exchanges[fired[1]:])
                extra = {"cuts": int(fired[0]), "resumes": resumed,
                         "cut_after_last_verify": int(bool(fired[0] and not verified_after))} if cut else {}
                if res.stats.get("degraded"):
                    tally.add(kind, "degraded", "finished on the device alone", **extra)
                elif cut and verified_after and resumed < 1:
                    tally.add(kind, "lost", "socket cut but the session was not resumed", **extra)
                else:
                    tally.add(kind, "ok", **extra)
            except Exception as e:  # noqa: BLE001 - counted by type
                tally.add(kind, "lost", f"{type(e).__name__}: {str(e)[:160]}")
            k += 1
    finally:
        conn.disconnect()


def served_code() -> dict:
    """Where a Ray worker of this cluster imports the application from (a shared checkout may be edited while a
    run goes on: run a snapshot with PYTHONPATH pointing at it, and this says so)."""
    import ray

    @ray.remote(num_cpus=0)
    def where() -> str:
        import services.app

        return services.app.__file__

    return {"services_app": ray.get(where.remote(), timeout=120), "driver_services_app": __import__(
        "services.app").app.__file__, "pythonpath": os.environ.get("PYTHONPATH")}


def reconfigure(app: dict, labels: Labels, devices: int) -> dict:
    """Change the Device deployment's user_config once (a redeploy of the same application); -> what happened:
    seconds, the replicas' PIDs before and after, the live value each phone reports."""
    from ray import serve

    from loadtests.run import each_replica
    from services.deploy import deploy_config

    before = {n: p["pid"] for n, p in serve_processes().items()}
    t0 = time.monotonic()
    live = {**app["user_configs"], "Device": {**app["user_configs"].get("Device", {}), **RECONFIG}}
    out: dict = {"change": RECONFIG}
    try:
        deploy_config(app["args"], import_path=app["import_path"], name="ciar", runtime_env=app["runtime_env"],
                      user_configs=live)
        out["deploy_s"] = round(time.monotonic() - t0, 1)
        h = serve.get_deployment_handle("Device", app_name="ciar")
        seen = each_replica(lambda: h.info.remote().result(timeout_s=300), "device_id", devices,
                            tries_per_replica=10)
        out["devices_reporting_new_value"] = sum(all(s["live"].get(k) == v for k, v in RECONFIG.items())
                                                 for s in seen.values())
        out["devices_asked"] = len(seen)
    except Exception as e:  # noqa: BLE001 - reported; the run goes on
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    after = {n: p["pid"] for n, p in serve_processes().items()}
    out["restarted"] = sorted(n for n in before if after.get(n) != before[n])
    out["new"] = sorted(n for n in after if n not in before)
    # every phone asked (a phone answers between its images, so not always all of them) reports the new value, and
    # no Serve process has a new PID: Serve called `reconfigure` on the live replicas
    out["in_place"] = ("error" not in out and not out["restarted"] and not out["new"]
                       and out.get("devices_asked", 0) >= 1
                       and out.get("devices_reporting_new_value") == out.get("devices_asked"))
    return out


# ---------------------------------------------------------------------------------------------------- the plot
def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, fits, warm = report["samples"], report["fits"], report["warmup_min"]
    ts = [s["t_min"] for s in samples]
    reconf = report.get("reconfiguration", {}).get("at_min")
    panels = [("RSS change since the warm-up (MB), per process", "rss_mb", True),
              ("Open file descriptors, per process", "fds", False),
              ("Open verifier sessions; device state (sum over the phones)", ("sessions", "device_state"), False),
              ("Ray object store (plasma)", ("store_mb", "store_objects"), False)]
    fig, axes = plt.subplots(3, 2, figsize=(15, 13))
    axes = axes.ravel()
    for ax, (title, units, delta) in zip(axes, panels):
        units = (units,) if isinstance(units, str) else units
        shown: list[float] = []  # the values after the warm-up: the axis spans these (the start-up's climb is cut)
        for name in sorted(n for n in fits if unit_of(n) in units):
            ys = [s["series"].get(name) for s in samples]
            pts = [(t, y) for t, y in zip(ts, ys) if y is not None]
            if not pts:
                continue
            f = fits[name]
            base = next((y for t, y in pts if t >= warm - 1e-9), pts[0][1]) if delta else 0.0
            slope = f["slope"]
            lab = f"{name.split(':', 1)[1] if len(units) == 1 else name}: " + (
                f"{slope:+.3g}±{(f['se'] or 0):.2g}/min {f['class']}" if slope is not None else "n/a")
            line, = ax.plot([t for t, _ in pts], [y - base for _, y in pts], marker=".", label=lab)
            shown += [y - base for t, y in pts if t >= warm - 1e-9]
            if slope is not None:
                t0, t1 = max(warm, pts[0][0]), pts[-1][0]
                ax.plot([t0, t1], [f["intercept"] + slope * t0 - base, f["intercept"] + slope * t1 - base],
                        ls="--", color=line.get_color(), lw=1)
        if shown:
            lo, hi = min(shown), max(shown)
            pad = max(0.5, 0.15 * (hi - lo))
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(title + (" (y: after the warm-up)" if delta or "fds" in units else ""), fontsize=10)
        ax.set_xlabel("minutes of traffic")
        ax.legend(fontsize=7, loc="best")
    # throughput per kind per interval
    ax = axes[4]
    kinds = sorted({k for s in samples for k in (s.get("outcomes") or {})})
    for kind in kinds:
        done = [sum(v for o, v in ((s.get("outcomes") or {}).get(kind) or {}).items()
                    if o in ("ok", "degraded", "lost")) for s in samples]
        rate = [(b - a) / max(1e-9, t1 - t0) for a, b, t0, t1 in zip(done, done[1:], ts, ts[1:])]
        ax.plot(ts[1:], rate, marker=".", label=kind)
    ax.set_title("Requests / images finished per minute, by kind", fontsize=10)
    ax.set_xlabel("minutes of traffic")
    ax.legend(fontsize=7)
    ax = axes[5]
    ax.axis("off")
    c = report["counts"]
    rows = [f"{k}: {v.get('attempted', 0)} attempted, {v.get('ok', 0)} ok, {v.get('degraded', 0)} degraded, "
            f"{v.get('lost', 0)} lost" + (f", {v.get('cuts', 0)} cuts, {v.get('resumes', 0)} resumes" if "cuts" in v
                                           else "")
            for k, v in sorted(c.items())]
    grew = [n for n, f in fits.items() if f["class"] == "growing"]
    import textwrap

    text = "\n".join([f"{report['minutes']:g} min, {report['devices']} phones, {report['http_workers']} HTTP "
                      f"workers, {report['device_clients']} real devices", *rows, "",
                      f"growing beyond noise: {', '.join(grew) or 'none'}",
                      *textwrap.wrap(f"verdict: {'PASS' if report['ok'] else 'FAIL: ' + '; '.join(report['reasons'])}",
                                     90)])
    ax.text(0, 1, text, va="top", family="monospace", fontsize=8, wrap=True)
    for ax in axes[:5]:
        ax.axvspan(min(ts) if ts else 0, warm, color="0.9", zorder=0)
        if reconf is not None:
            ax.axvline(reconf, color="red", ls=":", lw=1)
    fig.suptitle("CIAR soak: per-minute samples, least-squares slopes after the warm-up (grey); red: live "
                 "reconfiguration", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- main
def verdict(report: dict) -> list[str]:
    reasons = []
    lost = sum(c.get("lost", 0) + c.get("degraded", 0) for c in report["counts"].values())
    if lost or report["unfinished"]:
        reasons.append(f"{lost} lost or degraded, {report['unfinished']} unfinished")
    if report["restarts"]:
        reasons.append(f"replicas restarted: {', '.join(report['restarts'])}")
    rc = report.get("reconfiguration") or {}
    if not rc.get("in_place"):
        reasons.append(f"reconfiguration not in place: {rc}")
    st = report.get("settled") or {}
    left = {k: v for k, v in {"verifier_sessions": (st.get("verifier") or {}).get("sessions"),
                              **{f"device_{k}": (st.get("devices") or {}).get(k)
                                 for k in ("session_tokens", "batch_size_records", "tracked_sessions")}}.items()
            if v != 0}
    if left:
        reasons.append(f"left after the idle timeout: {left}")
    grew = [n for n, f in report["fits"].items() if f["class"] == "growing"]
    if grew:
        reasons.append(f"growing: {', '.join(grew)}")
    return reasons


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="minutes of traffic (then it stops by itself)")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--devices", type=int, default=None, help="simulated phones (default: the config's)")
    p.add_argument("--weights", default=None)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="as in loadtests.run")
    p.add_argument("--http-workers", type=int, default=2)
    p.add_argument("--device-clients", type=int, default=2)
    p.add_argument("--cut-every", type=int, default=5, help="every n-th real-device image has its socket cut")
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--sample-s", type=float, default=60.0)
    p.add_argument("--warmup-min", type=float, default=1.0)
    p.add_argument("--z", type=float, default=3.0, help="standard errors a slope must clear to be significant")
    p.add_argument("--request-timeout", type=float, default=330.0)
    p.add_argument("--drain-s", type=float, default=360.0)
    p.add_argument("--device-key", default=os.environ.get("CIAR_DEVICE_KEY", DEVICE_KEY))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replot", action="store_true", help="only redraw OUT/soak.png from OUT/soak.json")
    args = p.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "soak.json")) as f:
            plot(json.load(f), os.path.join(args.out, "soak.png"))
        return 0

    app = apply_overrides(load_app_config(args.config), args.sets)
    if args.devices is not None:
        app["args"]["devices"] = args.devices
    if args.weights:
        use_weights(app, args.weights)
    devices = int(app["args"].get("devices", 4))
    key = client_key(app)
    idle_s = float(app["user_configs"].get("Verifier", {}).get("idle_timeout_s", 60))
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"command": "python -m loadtests.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "minutes": args.minutes, "devices": devices, "http_workers": args.http_workers,
                    "device_clients": args.device_clients, "cut_every": args.cut_every, "sample_s": args.sample_s,
                    "warmup_min": args.warmup_min, "z": args.z, "user_configs": app["user_configs"],
                    "floors": FLOORS, "samples": [], "unfinished": 0, "restarts": []}
    json_path, png_path = os.path.join(args.out, "soak.json"), os.path.join(args.out, "soak.png")

    def save():
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    cluster = Cluster(app, free_port(), free_port())
    tally, stop = Tally(), threading.Event()
    labels = Labels()
    t_wall = time.monotonic()
    try:
        print(f"starting the cluster ({devices} phones) ...", flush=True)
        cluster.start()
        report["cluster_start_s"] = round(time.monotonic() - t_wall, 1)
        report["code"] = served_code()
        print(f"serving {report['code']['services_app']}", flush=True)
        ws_url = "ws" + cluster.url[len("http"):]
        model_dir = None
        if args.device_clients:
            from ciar_device.fetch import fetch_model

            model_dir = fetch_model(cluster.url, args.device_key)
        pids0 = {n: p["pid"] for n, p in serve_processes().items()}
        report["processes"] = {n: {**p, "label": labels.label(n, p["class"])} for n, p in serve_processes().items()}
        tag = f"soak{os.getpid()}"
        threads = [threading.Thread(target=http_worker, args=(i, cluster.url, key, stop, tally, args.think_s,
                                                               args.seed, args.request_timeout), daemon=True,
                                    name=f"http-{i}") for i in range(args.http_workers)]
        threads += [threading.Thread(target=device_worker, args=(i, ws_url, args.device_key, model_dir, stop, tally,
                                                                 args.cut_every, args.seed, tag), daemon=True,
                                     name=f"device-{i}") for i in range(args.device_clients)]
        print(f"traffic for {args.minutes:g} min: {args.http_workers} HTTP workers, {args.device_clients} real "
              f"devices (every {args.cut_every}th image cut), samples every {args.sample_s:g} s", flush=True)
        report["samples"].append(take_sample(0.0, labels, devices, tally))
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        for th in threads:
            th.start()

        def reconfigure_midway():  # its own thread: the samples stay on time while the redeploy runs
            if stop.wait(args.minutes * 30):
                return
            at = (time.monotonic() - t0) / 60
            print(f"[{at:5.1f} min] reconfiguring the Device deployment {RECONFIG}", flush=True)
            r = {"at_min": round(at, 2), **reconfigure(app, labels, devices)}
            r["took_s"] = round(time.monotonic() - t0 - at * 60, 1)
            report["reconfiguration"] = r
            print(f"  {r}", flush=True)

        reconf = threading.Thread(target=reconfigure_midway, daemon=True, name="reconfigure")
        reconf.start()
        k = 1
        while True:
            nxt = min(t0 + k * args.sample_s, end)
            time.sleep(max(0.0, nxt - time.monotonic()))
            s = take_sample((time.monotonic() - t0) / 60, labels, devices, tally)
            report["samples"].append(s)
            o = s["outcomes"]
            print(f"[{s['t_min']:5.1f} min] done {sum(c.get('attempted', 0) for c in o.values())}, lost "
                  f"{sum(c.get('lost', 0) for c in o.values())}; verifier sessions "
                  f"{s['verifier'].get('sessions')}; plasma {s['object_store'].get('store_mb')} MiB; RSS "
                  + " ".join(f"{lab} {f.get('rss_mb')}" for lab, f in s["procs"].items()), flush=True)
            save()
            if nxt >= end:
                break
            while t0 + k * args.sample_s <= time.monotonic():
                k += 1
        stop.set()
        print(f"traffic stopped; waiting for {tally.underway} requests underway (at most {args.drain_s:g} s)",
              flush=True)
        drain_end = time.monotonic() + args.drain_s
        for th in threads + [reconf]:
            th.join(timeout=max(0.1, drain_end - time.monotonic()))
        report["unfinished"] = tally.underway
        report["drain_s"] = round(time.monotonic() - end, 1)
        # sessions left by the cut sockets / early disconnects are the verifier's idle timeout's to free
        time.sleep(idle_s * 1.6 + 1.0)
        settled = take_sample((time.monotonic() - t0) / 60, labels, devices, tally)
        report["settled"] = {k: settled[k] for k in ("t_min", "verifier", "devices", "object_store", "procs")}
        after = {n: p["pid"] for n, p in serve_processes().items()}
        report["restarts"] = sorted(labels.of.get(n, n) for n in pids0 if after.get(n) != pids0[n])
    finally:
        stop.set()
        cluster.stop()
    report["counts"] = tally.snapshot()
    report["errors"] = tally.errors
    report["fits"] = analyse(report["samples"], args.warmup_min, args.z)
    report["reasons"] = verdict(report)
    report["ok"] = not report["reasons"]
    report["total_wall_s"] = round(time.monotonic() - t_wall, 1)
    save()
    try:
        plot(report, png_path)
    except Exception as e:  # noqa: BLE001 - the figures are in soak.json either way
        print(f"no plot: {type(e).__name__}: {e}", file=sys.stderr)
    print_summary(report)
    print(f"{'PASS' if report['ok'] else 'FAIL'}: {json_path}")
    return 0 if report["ok"] else 1


def print_summary(report: dict) -> None:
    print("\nseries                                   n   slope/min     se        growth/span  class")
    for name, f in report["fits"].items():
        if f["slope"] is None:
            print(f"{name:40s} {f['n']:3d}   -")
            continue
        print(f"{name:40s} {f['n']:3d} {f['slope']:+10.4f} {(f['se'] or 0):10.4f} {f['slope'] * f['span']:+10.3f} "
              f"{f['unit']:8s} {f['class']}")
    for kind, c in sorted(report["counts"].items()):
        print(f"{kind:18s} {c}")
    if report["reasons"]:
        print("reasons: " + "; ".join(report["reasons"]))


if __name__ == "__main__":
    sys.exit(main())
