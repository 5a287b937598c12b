"""Head-node failure with GCS fault tolerance, as KubeRay deploys it, on one machine: the head's GCS killed and
restarted under load, once backed by a real Redis and once without (the control).

    make redis                                              # Debian's redis-server, when it is not on PATH
    python -m loadtests.headloss --out runs/headloss        # the FT run, then the control run
    python -m loadtests.headloss --out DIR --no-control --warmup 10 --outage 8 --after 15 --devices 2
    python -m loadtests.headloss --out DIR --runs control --control-reconnect-timeout 60   # no Redis, GCS back in time

Each run (`ft`, then `control`) starts, in process groups of its own and on loopback:

1. (ft only) `redis-server` on a free 127.0.0.1 port with a random password, an append-only file in a temporary
   folder of its own (as cluster/redis.yaml runs it);
2. a Ray head by `ray start --head` (not blocking: see below), for the ft run with Ray's GCS fault-tolerance settings,
   what KubeRay's `gcsFaultToleranceOptions` sets on a head pod: `RAY_REDIS_ADDRESS=127.0.0.1:PORT`,
   `--redis-password`, `RAY_external_storage_namespace` (a namespace of its own per run). Token authentication is on
   (`RAY_AUTH_MODE=token`, a random `RAY_AUTH_TOKEN` for every process of the run). `RAY_gcs_rpc_server_reconnect_
   timeout_s` is how long the raylet and every worker wait for a lost GCS before they exit: --reconnect-timeout for
   the ft run (Ray's default, 60 s: KubeRay's head; its workers get 600), --control-reconnect-timeout for the control
   (shorter than the outage: without Redis the processes exit once it has passed, as KubeRay documents);
3. the Serve application as `loadtests.run`'s Cluster deploys it (serve_config.yaml with --set overrides; Serve's
   proxy on a free 127.0.0.1 port), and a Ray observer process that asks `ray.nodes()`, `serve.status()` and the
   replica actors' names every --probe-interval seconds (a process of its own: a driver exits when its GCS is gone
   past its reconnect timeout, and aborts when a restarted GCS without Redis refuses its cluster id);
4. steady load: --concurrency clients, each sending one request after another (/v1/images/generations,
   response_format "tokens", every other one streamed, CIAR at its fixed point: `loadtests.jobs.make_jobs`), with
   --warmup seconds before the kill, --outage seconds with the GCS down (SIGKILL to `gcs_server`), then the GCS
   started again from the command line, environment and folder it ran with (read from /proc before the kill; on a
   bare machine nothing restarts it: on Kubernetes, KubeRay restarts the head pod), and --after seconds of load
   once `ray.nodes()` answers again (or once --recovery-timeout has passed without it).

Why not `ray start --block`: a blocking `ray start` watches its children and, when one of them exits (the killed GCS),
stops the whole head (raylet, Serve controller, proxy, replicas): the head pod's behaviour on Kubernetes (KubeRay then
restarts the pod). On one machine the replicas live on the head, so that would take them too; here only the GCS goes,
and the raylet, the Serve controller, the proxy and the replicas stay, as a worker pod's do when the head pod goes.

Then every job the ft run sent is sent again on the recovered cluster, undisturbed, and each run's images are compared
with those (the same job makes the same tokens: CIAR's fixed point, seeds in the jobs). Everything a run started is
stopped by PID: Redis and the observer by their own, the Ray processes by a mark in their environment
(CIAR_HEADLOSS_RUN=<random>, inherited from `ray start` by the GCS, the raylet and every worker; `ray stop` would
stop other users' clusters too).

`OUT/headloss.json`: per run the request table (attempted / succeeded / failed and latency p50 / p99, also per method:
before the kill, in flight while the GCS was down, sent while it was down, sent after its restart), images identical
to the undisturbed ones, the timeline (kill, restart, when `ray.nodes()` / `serve.status()` answered again, when the
raylet exited), the probes in flight during the outage, whether the Serve application kept its replicas or was
deployed again, the Ray processes' CPU before / during / after, Redis' keys and memory, log lines (OUT/<run>/logs:
the logs without Ray's periodic dumps), every request (OUT/<run>/requests.jsonl) and probe (OUT/<run>/probes.jsonl).
The exit code is 0 only when the ft run lost nothing: every request answered 200 with the undisturbed run's tokens,
requests completed while the GCS was down, the cluster recovered with the same replicas and runs a new task; 130
when interrupted (Ctrl-C or SIGTERM, after stopping what it started).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from loadtests.plan import percentile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP_NAME = "ciar"
MARK = "CIAR_HEADLOSS_RUN"  # in the environment of every process a run starts (found again by it, stopped by PID)
MAX_JOBS = 4096
PHASES = ("before", "during", "after")


# ------------------------------------------------------------------------------------------------ pure helpers
def phase_of(rec: dict, t_kill: float, t_restart: float) -> str:
    """`before`: ended before the kill; `during`: in flight at some moment while the GCS was down (started before the
    restart and not ended before the kill); `after`: started after the restart."""
    if rec["end"] < t_kill:
        return "before"
    if rec["start"] < t_restart:
        return "during"
    return "after"


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def tally(records: list[dict]) -> dict:
    ok = [r for r in records if r["code"] == 200]
    lat = [r["end"] - r["start"] for r in ok]
    errors: dict[str, int] = {}
    for r in records:
        if r["code"] != 200:
            k = f"{r['code']}: {(r.get('error') or '')[:80]}"
            errors[k] = errors.get(k, 0) + 1
    methods = sorted({r.get("method") for r in ok if r.get("method")})
    return {"attempted": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
            "streamed": sum(r["kind"] == "stream" for r in records),
            "latency_ms": {"p50": _ms(percentile(lat, 50)), "p99": _ms(percentile(lat, 99)),
                           "max": _ms(max(lat, default=None))},
            # methods differ by x3-x4 in latency here: compare phases method by method
            "p50_ms_by_method": {m: _ms(percentile([r["end"] - r["start"] for r in ok if r.get("method") == m], 50))
                                 for m in methods},
            "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:8])}


def phase_table(records: list[dict], t_kill: float, t_restart: float) -> dict:
    """{phase: tally} over PHASES, plus `all`, and the requests that ended while the GCS was down."""
    out = {p: tally([r for r in records if phase_of(r, t_kill, t_restart) == p]) for p in PHASES}
    out["all"] = tally(records)
    # `during` is length-biased (a long request is likelier to overlap the outage): those sent while it was down
    out["started_while_down"] = tally([r for r in records if t_kill <= r["start"] < t_restart])
    out["completed_while_down"] = sum(1 for r in records if r["code"] == 200 and t_kill <= r["end"] < t_restart)
    return out


def compare_tokens(records: list[dict], reference: dict[int, list]) -> dict:
    """Succeeded requests against the undisturbed run's tokens of the same job (by job index)."""
    ok = [r for r in records if r["code"] == 200]
    have = [r for r in ok if r["job"] in reference]
    differ = sorted(r["job"] for r in have if r.get("tokens") != reference[r["job"]])
    return {"succeeded": len(ok), "compared": len(have), "identical": len(have) - len(differ),
            "differing_jobs": differ[:20], "without_reference": len(ok) - len(have)}


def buckets(records: list[dict], t0: float, width: float, until: float, origin: float | None = None) -> list[dict]:
    """Per `width`-second bucket from t0 to `until`: requests that ended OK / failed in it, in flight at its start;
    `t`: the bucket's start in seconds from `origin` (default t0)."""
    origin = t0 if origin is None else origin
    rows = []
    n = max(1, math.ceil((until - t0) / width))
    for i in range(n):
        a, b = t0 + i * width, t0 + (i + 1) * width
        rows.append({"t": round(a - origin, 1),
                     "ok": sum(1 for r in records if r["code"] == 200 and a <= r["end"] < b),
                     "failed": sum(1 for r in records if r["code"] != 200 and a <= r["end"] < b),
                     "in_flight": sum(1 for r in records if r["start"] <= a < r["end"])})
    return rows


def first_ok(probes: list[dict], kind: str, after: float, pred=None) -> dict | None:
    """The first probe of `kind` that answered (ok) at or after `after` (its end time), and satisfies pred."""
    for p in sorted((p for p in probes if p.get("probe") == kind), key=lambda p: p["t"]):
        if p["t"] >= after and p.get("ok") and (pred is None or pred(p)):
            return p
    return None


def last_ok(probes: list[dict], kind: str, before: float) -> dict | None:
    got = [p for p in probes if p.get("probe") == kind and p.get("ok") and p["t"] < before]
    return max(got, key=lambda p: p["t"]) if got else None


def answered_between(probes: list[dict], kind: str, a: float, b: float) -> dict:
    """Probes of `kind` that ended in [a, b): how many answered, how many failed (a probe that hangs ends later)."""
    got = [p for p in probes if p.get("probe") == kind and a <= p["t"] < b]
    return {"answered": sum(1 for p in got if p.get("ok")), "failed": sum(1 for p in got if not p.get("ok")),
            "errors": sorted({(p.get("error") or "")[:100] for p in got if not p.get("ok")})[:4]}


def spanning(probes: list[dict], kind: str, a: float, b: float, limit: int = 6) -> list[dict]:
    """Probes of `kind` in flight at some moment of [a, b) (started before b, ended at or after a): when each
    started and ended, in seconds from a, and whether it answered."""
    got = sorted((p for p in probes if p.get("probe") == kind and "t0" in p and p["t0"] < b and p["t"] >= a),
                 key=lambda p: p["t0"])
    return [{"start_s": round(p["t0"] - a, 2), "end_s": round(p["t"] - a, 2), "ok": bool(p.get("ok")),
             **({} if p.get("ok") else {"error": (p.get("error") or "")[:100]})} for p in got[:limit]]


def cpu_rate(samples: list[tuple[float, dict]], a: float, b: float, top: int = 6) -> dict:
    """CPU cores the sampled processes used over [a, b): samples are (time, {pid: (name, cpu seconds)}); each pair
    of consecutive samples inside the window adds the CPU time of the processes present in both. -> {cores, by
    process name (the largest `top`)}."""
    pairs = [(s0, s1) for s0, s1 in zip(samples, samples[1:]) if a <= s0[0] and s1[0] <= b]
    span = sum(s1[0] - s0[0] for s0, s1 in pairs)
    if span <= 0:
        return {"cores": None, "by_name": {}}
    by: dict[str, float] = {}
    for (_, p0), (_, p1) in pairs:
        for pid, (name, cpu) in p1.items():
            if pid in p0:
                by[name] = by.get(name, 0.0) + max(0.0, cpu - p0[pid][1])
    total = sum(by.values())
    return {"cores": round(total / span, 3),
            "by_name": {k: round(v / span, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]}}


def app_running(p: dict) -> bool:
    return str(p.get("app", "")).endswith("RUNNING")


# ------------------------------------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked_pids(mark: str) -> list[int]:
    """Every live process whose environment holds MARK=mark (this run's Ray processes), never this one."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            continue
    return out


def alive(pid: int | None) -> bool:
    """The process exists and is not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_pids(pids: list[int], grace_s: float = 10.0) -> dict:
    """SIGTERM each, SIGKILL whatever is left after grace_s. -> counts."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            sent += 1
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    killed = 0
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return {"terminated": sent, "killed": killed}


def resp(sock: socket.socket, *args: str):
    """One Redis command over RESP (no client library needed). -> the reply (str, int, list or None); an error
    reply raises RuntimeError."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    sock.sendall(payload.encode())
    f = sock.makefile("rb")

    def read():
        line = f.readline().rstrip(b"\r\n")
        kind, rest = line[:1], line[1:].decode()
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RuntimeError(rest)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else f.read(n + 2)[:-2].decode(errors="replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [read() for _ in range(n)]
        raise RuntimeError(f"unexpected Redis reply {line[:40]!r}")

    return read()


class Redis:
    """redis-server on a free loopback port with a password, an append-only file in its own folder; its own process
    group; stopped by its PID."""

    def __init__(self, folder: str):
        self.folder, self.port, self.password = folder, free_port(), secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH: `make redis` installs Debian's")
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder, "--appendonly", "yes",
               "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes", "--requirepass", self.password]
        with open(os.path.join(self.folder, "redis.log"), "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.command("PING") == "PONG":
                    return
            except (OSError, RuntimeError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on {self.address} (exit {self.proc.poll()})")
            time.sleep(0.2)

    def command(self, *args: str):
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            resp(s, "AUTH", self.password)
            return resp(s, *args)

    def footprint(self, namespace: str) -> dict:
        """Keys the GCS wrote under its namespace, and Redis' memory."""
        keys = self.command("KEYS", f"RAY{namespace}@*") or []
        info = dict(line.split(":", 1) for line in (self.command("INFO", "memory") or "").splitlines()
                    if ":" in line)
        types = {k: self.command("TYPE", k) for k in keys}
        return {"keys": sorted(keys), "types": types,
                "fields": sum(self.command("HLEN", k) or 0 for k in keys if types[k] == "hash"),
                "used_memory_bytes": int(info.get("used_memory", 0)),
                "aof_bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.folder)
                                 for f in fs if "aof" in f)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pids([self.proc.pid], grace_s=10)
            self.proc.wait(timeout=10)


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """{pid: (its name, user + system CPU seconds so far)} from /proc (processes that are gone are left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            out[pid] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


class CpuSampler:
    """The run's Ray processes' CPU time, every `interval_s` (what a GCS outage costs the processes that stay)."""

    def __init__(self, mark: str, interval_s: float = 1.0):
        self.mark, self.interval_s = mark, interval_s
        self.samples: list[tuple[float, dict]] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.samples.append((time.time(), cpu_seconds(marked_pids(self.mark))))
            self.stop_event.wait(self.interval_s)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)


def _read_proc(pid: int) -> dict:
    """What restarts a process as it was: argv, environment and working folder, from /proc."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return {"argv": argv, "env": env, "cwd": os.readlink(f"/proc/{pid}/cwd")}


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Head:
    """A Ray head started by `ray start --head` in its own process group, every process of it marked."""

    def __init__(self, folder: str, env: dict, num_cpus: int, redis: Redis | None, mark: str):
        self.folder, self.redis, self.mark = folder, redis, mark
        self.port = free_port()
        self.env = {**env, MARK: mark}
        self.num_cpus = num_cpus
        self.start_proc: subprocess.Popen | None = None
        self.gcs_procs: list[subprocess.Popen] = []
        self.gcs_image: dict | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240.0) -> None:
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--port", str(self.port),
               "--num-cpus", str(self.num_cpus), "--temp-dir", self.folder,
               "--include-dashboard", "false", "--dashboard-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()), "--ray-client-server-port", str(free_port()),
               "--metrics-export-port", str(free_port()), "--disable-usage-stats"]
        env = dict(self.env)
        if self.redis is not None:
            env["RAY_REDIS_ADDRESS"] = self.redis.address
            cmd += ["--redis-password", self.redis.password]
        with open(os.path.join(self.folder, "ray-start.log"), "w") as log:
            self.start_proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = self.start_proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0:
            with open(os.path.join(self.folder, "ray-start.log")) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"`ray start --head` failed (exit {rc}):\n{tail}")

    def pids(self) -> list[int]:
        return marked_pids(self.mark)

    def find(self, comm: str) -> int | None:
        got = [p for p in self.pids() if _comm(p) == comm and alive(p)]
        return got[0] if got else None

    def kill_gcs(self) -> int:
        """SIGKILL the GCS, after reading what starts it again."""
        pid = self.find("gcs_server")
        if pid is None:
            raise RuntimeError("no gcs_server process of this run")
        self.gcs_image = _read_proc(pid)
        os.kill(pid, signal.SIGKILL)
        return pid

    def restart_gcs(self) -> int:
        """The GCS again, from the command line, environment and folder it ran with, in a process group of its own
        (what KubeRay's restart of the head pod does for the GCS; the pod's raylet would be new too)."""
        img = self.gcs_image
        proc = subprocess.Popen(img["argv"], env=img["env"], cwd=img["cwd"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        self.gcs_procs.append(proc)
        return proc.pid

    def session_logs(self) -> str | None:
        path = os.path.join(self.folder, "session_latest", "logs")
        return path if os.path.isdir(path) else None

    def stop(self) -> dict:
        pids = self.pids()
        out = stop_pids(pids, grace_s=15)
        # a worker whose raylet died may outlive the first pass: once more for what is left
        left = self.pids()
        if left:
            more = stop_pids(left, grace_s=5)
            out = {k: out[k] + more[k] for k in out}
        for p in [self.start_proc, *self.gcs_procs]:
            if p is not None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        out["left"] = len([p for p in self.pids() if alive(p)])
        return out


# ------------------------------------------------------------------------------------------------ the observer
def observe(address: str, out: str, interval_s: float) -> None:
    """A Ray driver of its own that records, as JSON lines in `out`, each probe's end time `t`, start `t0`, and its
    answer: `nodes` (ray.nodes()), `serve` (serve.status() of the application), `replicas` (the Serve replicas'
    actor names). Each probe runs in a thread of its own, one call at a time: a call that hangs while the GCS is down
    is written when it returns."""
    import ray
    from ray import serve

    lock = threading.Lock()
    f = open(out, "a", buffering=1)

    def emit(**kw):
        with lock:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\n")

    emit(probe="start")
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    emit(probe="connected")

    def nodes():
        n = ray.nodes()
        return {"alive": sum(1 for x in n if x.get("Alive")), "nodes": len(n)}

    def status():
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return {"app": None}
        return {"app": str(app.status), "last_deployed": app.last_deployed_time_s,
                "deployments": {name: {"status": str(d.status),
                                       "replicas": {str(k): v for k, v in d.replica_states.items()}}
                                for name, d in app.deployments.items()}}

    def replicas():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        return {"replicas": sorted(n for n in names if n.startswith("SERVE_REPLICA"))}

    def loop(name, fn):
        while True:
            t0 = time.time()
            try:
                emit(probe=name, t0=t0, ok=True, **fn())
            except Exception as e:  # noqa: BLE001 - recorded: the GCS is down, the controller unreachable, ...
                emit(probe=name, t0=t0, ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            time.sleep(max(0.0, interval_s - (time.time() - t0)))

    threads = [threading.Thread(target=loop, args=(n, fn), daemon=True)
               for n, fn in (("nodes", nodes), ("serve", status), ("replicas", replicas))]
    for th in threads:
        th.start()
    while True:
        time.sleep(3600)


class Observer:
    """The observer process (`--observe`), started again when it exits (a driver aborts when a GCS restarted without
    Redis refuses its cluster id); stopped by its PID."""

    def __init__(self, address: str, path: str, env: dict, interval_s: float, events: list):
        self.address, self.path, self.env, self.interval_s, self.events = address, path, env, interval_s, events
        self.proc: subprocess.Popen | None = None
        self.log = open(path + ".log", "a")
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtests.headloss", "--observe", self.address, "--observe-out", self.path,
             "--probe-interval", str(self.interval_s)], cwd=REPO, env=self.env, stdout=self.log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def check(self) -> None:
        """Started again if it exited (at most every 3 s)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.events.append({"t": time.time(), "event": f"observer exited ({self.proc.returncode}); restarted"})
            time.sleep(3.0)
            self.start()

    def probes(self) -> list[dict]:
        try:
            with open(self.path) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def wait_for(self, kind: str, after: float, pred=None, timeout_s: float = 120.0) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = first_ok(self.probes(), kind, after, pred)
            if p is not None:
                return p
            self.check()
            time.sleep(0.5)
        return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pids([self.proc.pid], grace_s=5)
            self.proc.wait(timeout=5)
        self.log.close()


# ------------------------------------------------------------------------------------------------ the load
class Load:
    """`concurrency` clients, each sending job after job (job i: `jobs[i]`, streamed when i is odd) until stopped;
    after a failed request a client waits `pause_s` (a client that retries, not one that hammers)."""

    def __init__(self, client, jobs: list[dict], concurrency: int, pause_s: float = 0.5, timeout_s: float = 600.0):
        self.client, self.jobs, self.concurrency = client, jobs, concurrency
        self.pause_s, self.timeout_s = pause_s, timeout_s
        self.records: list[dict] = []
        self.stop_event = threading.Event()
        self.next_job = itertools.count()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def one(self, i: int) -> dict:
        body = self.jobs[i % len(self.jobs)]
        kind = "stream" if i % 2 else "plain"
        start = time.time()
        if kind == "stream":
            r = self.client.stream(body, timeout=self.timeout_s)
        else:
            r = self.client.post(body, timeout=self.timeout_s)
        rec = {"job": i, "kind": kind, "method": body["method"], "network": body["network"], "start": start,
               "end": time.time(), "code": r.get("code"), "error": r.get("error"), "tokens": r.get("tokens"),
               "degraded": r.get("degraded"), "resumes": r.get("resumes")}
        return rec

    def worker(self) -> None:
        while not self.stop_event.is_set():
            with self.lock:
                i = next(self.next_job)
            rec = self.one(i)
            with self.lock:
                self.records.append(rec)
            if rec["code"] != 200:
                self.stop_event.wait(self.pause_s)

    def start(self) -> None:
        for _ in range(self.concurrency):
            th = threading.Thread(target=self.worker, daemon=True)
            th.start()
            self.threads.append(th)

    def stop(self, timeout_s: float = 400.0) -> None:
        """No new request; wait for those in flight."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))


def replay(client, jobs: list[dict], indices: list[int], concurrency: int) -> dict[int, list]:
    """The same jobs again (plain or streamed as they were), undisturbed. -> {job index: tokens} of those answered."""
    from concurrent.futures import ThreadPoolExecutor

    load = Load(client, jobs, concurrency)
    with ThreadPoolExecutor(concurrency) as pool:
        recs = list(pool.map(load.one, indices))
    return {r["job"]: r["tokens"] for r in recs if r["code"] == 200}


# ------------------------------------------------------------------------------------------------ one run
def log_events(lines: list[str]) -> list[str]:
    """A Ray log without its periodic dumps: the timestamped lines ("[2026-...") that are not a state dump or an
    event-stats / debug-state header (the dumps' own lines start without a timestamp)."""
    dumps = ("[state-dump]", "Event stats:", "Debug state:")
    return [ln for ln in lines if re.match(r"\[\d{4}-\d\d-\d\d ", ln) and not any(d in ln for d in dumps)]


EVIDENCE = ("Wrong cluster ID", "Failed to connect to GCS", "Check failed", "authentication error", "cluster ID",
            "external Redis", "Redis cluster leader", "Connection to the node was broken", "Raylet is terminated",
            "exited unexpectedly", "Redis is starting", "Ready to accept")


def _copy_logs(head: Head, redis: Redis | None, dest: str, keep: int = 600) -> dict:
    """The GCS', raylet's, monitor's and Redis' logs without their periodic dumps (the first and last `keep` lines
    of each) into dest, and the lines that tell what happened (each message once)."""
    os.makedirs(dest, exist_ok=True)
    src = head.session_logs()
    files = []
    if src:
        files = [os.path.join(src, n) for n in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err",
                                                  "monitor.log")]
    files += [os.path.join(head.folder, "ray-start.log")]
    if redis is not None:
        files.append(os.path.join(redis.folder, "redis.log"))
    evidence: dict[str, list[str]] = {}
    for path in files:
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        name = os.path.basename(path)
        if name.endswith((".out", ".err")):
            lines = log_events(lines)
        if len(lines) > 2 * keep:
            lines = lines[:keep] + [f"... {len(lines) - 2 * keep} lines left out ..."] + lines[-keep:]
        with open(os.path.join(dest, name), "w") as f:
            f.write("\n".join(lines) + "\n")
        hits, seen = [], set()
        for line in lines:
            if not any(k in line for k in EVIDENCE):
                continue
            sig = re.sub(r"[0-9a-f]{16,}|\d+", "#", line.split("] ", 1)[-1])[:90]  # the message, ids and numbers out
            if sig not in seen:
                seen.add(sig)
                hits.append(line[:300])
        if hits:
            evidence[name] = hits[:20]
    return evidence


def run_once(mode: str, app: dict, args, out: str, token: str, jobs: list[dict],
             reference: dict[int, list] | None) -> tuple[dict, dict[int, list] | None]:
    """One run (`ft`: GCS backed by Redis; `control`: without). -> (its report, the undisturbed tokens (ft only))."""
    import ray
    from ray import serve

    from loadtests.jobs import Client
    from loadtests.run import client_key, wait_healthy
    from services.deploy import PATIENT_SERVE_ENV, deploy_config
    from services.config import AppConfig

    run_dir = os.path.join(out, mode)
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("probes.jsonl", "requests.jsonl"):
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    folder = tempfile.mkdtemp(prefix=f"ciar-hl-{mode}-", dir="/tmp")  # short: Ray's socket paths live below it
    mark = secrets.token_hex(8)
    namespace = f"ciar-headloss-{mark}"
    reconnect = args.reconnect_timeout if mode == "ft" else args.control_reconnect_timeout
    cfg = AppConfig(**app["args"])
    need = (cfg.devices * cfg.device_num_cpus + cfg.verifier_replicas * cfg.verifier_num_cpus
            + cfg.ingress_num_cpus + 0.5)
    # every process of the run (the Serve controller and replicas inherit the raylet's environment, not this
    # driver's): token auth with one token, patient Serve checks, one OpenMP thread, the reconnect timeout under
    # test (an integer: Ray parses RAY_<setting> by the setting's type, and "60.0" for an integer setting makes
    # `ray start` die of SIGSEGV with no message); Head adds the run's mark
    env = {**os.environ, **PATIENT_SERVE_ENV, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": token, "RAY_gcs_rpc_server_reconnect_timeout_s": str(int(reconnect))}
    env.pop("RAY_ADDRESS", None)
    if mode == "ft":
        env["RAY_external_storage_namespace"] = namespace
    events: list[dict] = []
    report: dict = {"mode": mode, "redis": mode == "ft", "reconnect_timeout_s": reconnect, "events": events}

    def event(name: str, **kw) -> float:
        t = time.time()
        events.append({"t": t, "event": name, **kw})
        print(f"[{mode}] {time.strftime('%H:%M:%S')} {name} {kw if kw else ''}", flush=True)
        return t

    redis = head = observer = load = sampler = None
    t_run = time.monotonic()
    try:
        if mode == "ft":
            redis = Redis(tempfile.mkdtemp(prefix="ciar-hl-redis-", dir="/tmp"))
            redis.start()
            report["redis_version"] = redis.command("INFO", "server").split("redis_version:")[1].split()[0]
            event("redis up", address=redis.address)
        head = Head(folder, env, max(os.cpu_count() or 2, math.ceil(need)), redis, mark)
        t0 = time.monotonic()
        head.start()
        report["head_start_s"] = round(time.monotonic() - t0, 1)
        event("head up", gcs=head.address, gcs_pid=head.find("gcs_server"), raylet_pid=head.find("raylet"))

        # deploy as loadtests.run's Cluster does, from a driver that disconnects before the GCS is touched
        http_port = free_port()
        url = f"http://127.0.0.1:{http_port}"
        t0 = time.monotonic()
        ray.init(address=head.address, log_to_driver=False, logging_level="ERROR")
        _own_sigterm()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            deploy_config(app["args"], import_path=app["import_path"], name=APP_NAME,
                          runtime_env=app["runtime_env"], user_configs=app["user_configs"])
            wait_healthy(url, timeout_s=180)
        finally:
            ray.shutdown()
            _own_sigterm()
        report["deploy_s"] = round(time.monotonic() - t0, 1)
        event("application up", url=url)

        # the observer: its own driver, a reconnect timeout longer than any outage here (it must see the end)
        obs_env = {**env, "RAY_gcs_rpc_server_reconnect_timeout_s": "3600"}  # unmarked: its CPU is not the run's
        observer = Observer(head.address, os.path.join(run_dir, "probes.jsonl"), obs_env, args.probe_interval,
                            events)
        observer.start()
        t_obs = time.time()
        for kind, pred in (("nodes", None), ("serve", app_running), ("replicas", None)):
            if observer.wait_for(kind, t_obs, pred, timeout_s=120) is None:
                raise RuntimeError(f"the observer's {kind} probe did not answer ({observer.path})")
        event("observer up")

        client = Client(url, client_key(app))
        sampler = CpuSampler(mark)
        sampler.start()
        load = Load(client, jobs, args.concurrency, timeout_s=args.request_timeout)
        load.start()
        event("load started", concurrency=args.concurrency)
        _sleep(args.warmup, observer)
        raylet_pid = head.find("raylet")
        gcs_pid = head.kill_gcs()
        t_kill = event("gcs killed", pid=gcs_pid, signal="SIGKILL")
        raylet_exit = None
        end = time.monotonic() + args.outage
        while time.monotonic() < end:
            if raylet_exit is None and not alive(raylet_pid):
                raylet_exit = event("raylet exited", pid=raylet_pid)
            _sleep(0.25, observer)
        new_pid = head.restart_gcs()
        t_restart = event("gcs restarted", pid=new_pid)
        nodes_back = serve_back = None
        deadline = time.monotonic() + args.recovery_timeout
        while time.monotonic() < deadline and (nodes_back is None or serve_back is None):
            probes = observer.probes()
            if nodes_back is None:
                p = first_ok(probes, "nodes", t_restart, lambda p: p.get("alive", 0) > 0)
                if p is not None:
                    nodes_back = p["t"]
                    event("ray.nodes() answers again", alive=p["alive"], since_restart_s=round(p["t"] - t_restart, 2))
            if serve_back is None:
                p = first_ok(probes, "serve", t_restart, app_running)
                if p is not None:
                    serve_back = p["t"]
                    event("serve.status() RUNNING", since_restart_s=round(p["t"] - t_restart, 2))
            if raylet_exit is None and not alive(raylet_pid):
                raylet_exit = event("raylet exited", pid=raylet_pid)
            _sleep(0.5, observer)
        if nodes_back is None:
            event("no recovery", waited_s=args.recovery_timeout)
        _sleep(args.after, observer)
        if raylet_exit is None and not alive(raylet_pid):
            raylet_exit = event("raylet exited", pid=raylet_pid)
        load.stop(timeout_s=args.request_timeout + 60)
        t_load_end = event("load stopped", requests=len(load.records))
        sampler.stop()

        # after the load: replicas and application state, new work accepted, the undisturbed tokens (ft)
        time.sleep(2 * args.probe_interval + 1)
        probes = observer.probes()
        before_rep = last_ok(probes, "replicas", t_kill)
        after_rep = last_ok(probes, "replicas", time.time() + 1)
        before_app = last_ok(probes, "serve", t_kill)
        after_app = last_ok(probes, "serve", time.time() + 1)
        report["new_task_after_recovery"] = _new_task(head.address, env, timeout_s=60)
        event("new task", **report["new_task_after_recovery"])
        if mode == "ft" and reference is None and nodes_back is not None:
            indices = sorted(r["job"] for r in load.records)
            t0 = time.monotonic()
            reference = replay(client, jobs, indices, args.concurrency)
            report["replay"] = {"jobs": len(indices), "answered": len(reference),
                                "wall_s": round(time.monotonic() - t0, 1)}
            event("undisturbed replay done", **report["replay"])
        if redis is not None:
            try:
                fp = redis.footprint(namespace)
                report["redis_footprint"] = {
                    "namespace": namespace, "keys": len(fp["keys"]), "key_types": fp["types"],
                    "hash_fields": fp["fields"], "used_memory_mb": round(fp["used_memory_bytes"] / 2**20, 2),
                    "aof_kb": round(fp["aof_bytes"] / 1024, 1)}
            except (OSError, RuntimeError) as e:
                report["redis_footprint"] = {"error": f"{type(e).__name__}: {e}"}

        records = sorted(load.records, key=lambda r: r["start"])
        with open(os.path.join(run_dir, "requests.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        rel = lambda t: None if t is None else round(t - t_kill, 2)  # noqa: E731
        report.update({
            "outage_s": round(t_restart - t_kill, 2),
            "requests": phase_table(records, t_kill, t_restart),
            "tokens": compare_tokens(records, reference or {}) if reference else None,
            "recovery": {
                "ray_nodes_back_after_restart_s": None if nodes_back is None else round(nodes_back - t_restart, 2),
                "serve_running_after_restart_s": None if serve_back is None else round(serve_back - t_restart, 2),
                "ray_nodes_back_after_kill_s": rel(nodes_back),
                "raylet_exited_after_kill_s": rel(raylet_exit),
                "nodes_while_down": answered_between(probes, "nodes", t_kill, t_restart),
                "serve_status_while_down": answered_between(probes, "serve", t_kill, t_restart),
                "replica_names_while_down": answered_between(probes, "replicas", t_kill, t_restart),
                "probes_spanning_outage": {k: spanning(probes, k, t_kill, t_restart) for k in
                                           ("nodes", "serve", "replicas")},
            },
            "serve": {
                "app_before": before_app and before_app.get("app"),
                # None when serve.status() has not answered since the restart (after_probe_s: its last answer)
                "app_after": after_app.get("app") if after_app and after_app["t"] > t_restart else None,
                "after_probe_s": rel(after_app and after_app["t"]),
                "deployments_after": after_app and after_app.get("deployments"),
                "redeployed": None if not (before_app and after_app) else
                before_app.get("last_deployed") != after_app.get("last_deployed"),
                "replicas_before": before_rep and before_rep["replicas"],
                "replicas_after": after_rep and after_rep["replicas"],
                "same_replicas": None if not (before_rep and after_rep) else
                before_rep["replicas"] == after_rep["replicas"] and after_rep["t"] > t_restart,
            },
            "timeline": [{"t_s": rel(e["t"]), **{k: v for k, v in e.items() if k != "t"}} for e in events],
            "per_5s": buckets(records, t_kill - 5.0 * math.ceil(args.warmup / 5.0), 5.0, t_load_end, origin=t_kill),
            "observer_starts": observer.starts,
            # CPU cores used by the run's Ray processes (GCS, raylet, Serve controller, proxy, replicas, agents):
            # under the load before the kill, while the GCS was down, after the restart
            "ray_cpu": {"before": cpu_rate(sampler.samples, t_kill - args.warmup, t_kill),
                        "during": cpu_rate(sampler.samples, t_kill, t_restart),
                        "after": cpu_rate(sampler.samples, t_restart, t_load_end)},
        })
    except Exception as e:  # noqa: BLE001 - recorded with what the run had (and everything it started is stopped)
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"[{mode}] failed: {report['error']}", file=sys.stderr, flush=True)
    finally:
        if load is not None:
            load.stop(timeout_s=5)
        if sampler is not None:
            sampler.stop()
        if observer is not None:
            observer.stop()
        if head is not None:
            report["log_evidence"] = _copy_logs(head, redis, os.path.join(run_dir, "logs"))
            report["stopped"] = head.stop()
        if redis is not None:
            redis.stop()
            shutil.rmtree(redis.folder, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        report["wall_s"] = round(time.monotonic() - t_run, 1)
    return report, reference


def _on_term(signum, frame):
    """SIGTERM stops what the run started, as Ctrl-C does (its finally blocks run)."""
    raise KeyboardInterrupt


def _own_sigterm() -> None:
    """A Ray driver installs its own SIGTERM handler (it logs and dies, and nothing the run started would be
    stopped): take it back after ray.init and ray.shutdown."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)


def _sleep(seconds: float, observer: Observer | None) -> None:
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        if observer is not None:
            observer.check()
        time.sleep(min(0.5, left))


def _new_task(address: str, env: dict, timeout_s: float) -> dict:
    """A fresh driver connects and runs a task (a new worker process: needs a GCS that knows the node)."""
    code = ("import ray, sys, time; t=time.time(); ray.init(address=sys.argv[1], log_to_driver=False, "
            "logging_level='ERROR'); f=ray.remote(num_cpus=0)(lambda: 1); "
            "print(ray.get(f.remote(), timeout=float(sys.argv[2]))); print(round(time.time()-t, 2))")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", code, address, str(timeout_s - 10)], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=timeout_s, start_new_session=True)
        ok = p.returncode == 0 and p.stdout.split()[:1] == ["1"]
        return {"ok": ok, "s": round(time.monotonic() - t0, 1),
                **({} if ok else {"error": (p.stderr.strip().splitlines() or [""])[-1][:200]})}
    except subprocess.TimeoutExpired:
        return {"ok": False, "s": round(time.monotonic() - t0, 1), "error": f"no answer in {timeout_s:.0f} s"}


# ------------------------------------------------------------------------------------------------ report
def verdict(ft: dict) -> dict:
    """What must hold for the ft run."""
    req, tok, serve = ft.get("requests") or {}, ft.get("tokens") or {}, ft.get("serve") or {}
    rec = ft.get("recovery") or {}
    checks = {
        "nothing_lost": bool(req) and req["all"]["failed"] == 0 and req["all"]["attempted"] > 0,
        "answered_while_down": bool(req) and req["completed_while_down"] > 0,
        "tokens_identical": bool(tok) and tok["compared"] == tok["succeeded"] and tok["identical"] == tok["compared"],
        "recovered": rec.get("ray_nodes_back_after_restart_s") is not None
        and rec.get("serve_running_after_restart_s") is not None,
        "same_replicas": serve.get("same_replicas") is True and serve.get("redeployed") is False,
        "new_task_after_recovery": bool((ft.get("new_task_after_recovery") or {}).get("ok")),
    }
    return {"ok": all(checks.values()), **checks}


def table(runs: dict) -> str:
    head = ("| run | phase | attempted | succeeded | failed | p50 ms | p99 ms |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = [head]
    for name, r in runs.items():
        for phase in (*PHASES, "started_while_down", "all"):
            t = (r.get("requests") or {}).get(phase)
            if t:
                rows.append(f"| {name} | {phase} | {t['attempted']} | {t['succeeded']} | {t['failed']} | "
                            f"{t['latency_ms']['p50']} | {t['latency_ms']['p99']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/headloss")
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--weights", default=None, help="weights folder (default: the shipped world)")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="as in loadtests.run")
    p.add_argument("--concurrency", type=int, default=3, help="clients sending one request after another")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the GCS is killed")
    p.add_argument("--outage", type=float, default=15.0, help="seconds the GCS stays down")
    p.add_argument("--after", type=float, default=30.0, help="seconds of load once ray.nodes() answers again")
    p.add_argument("--recovery-timeout", type=float, default=90.0,
                   help="seconds after the restart to wait for ray.nodes() / serve.status()")
    p.add_argument("--reconnect-timeout", type=int, default=60,
                   help="RAY_gcs_rpc_server_reconnect_timeout_s of the ft run (Ray's default)")
    p.add_argument("--control-reconnect-timeout", type=int, default=5,
                   help="RAY_gcs_rpc_server_reconnect_timeout_s of the control run (below --outage)")
    p.add_argument("--no-control", action="store_true", help="the ft run only")
    p.add_argument("--runs", default=None, help="the runs, in order: ft, control or ft,control (the default); "
                   "e.g. --runs control --control-reconnect-timeout 60: no Redis, the GCS back within the timeout")
    p.add_argument("--probe-interval", type=float, default=1.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--observe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--observe-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.observe:
        observe(args.observe, args.observe_out, args.probe_interval)
        return 0
    # one token for every process of both runs, set before anything in this process touches Ray (its token loader
    # keeps what it first read)
    token = secrets.token_hex(32)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    if shutil.which("redis-server") is None:
        print("redis-server is not on PATH: run `make redis` (Debian's redis-server)", file=sys.stderr)
        return 2

    from loadtests.jobs import DEFAULT_SETS, make_jobs
    from loadtests.run import apply_overrides, load_app_config, use_weights

    app = apply_overrides(load_app_config(args.config), [*DEFAULT_SETS, *args.sets])
    app["args"]["devices"] = args.devices
    use_weights(app, args.weights or os.environ.get("CIAR_WEIGHTS") or os.path.join(REPO, "weights", "scenes-v2"))
    jobs = make_jobs(MAX_JOBS, args.seed)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    report: dict = {"command": " ".join(["python -m loadtests.headloss", *given]),
                    "machine": {"cpus": os.cpu_count(), "note": "shared with other jobs"},
                    "settings": {k: v for k, v in vars(args).items() if not k.startswith("observe")},
                    "user_configs": app["user_configs"], "devices": args.devices,
                    "device_runtime": app["args"].get("device_runtime"), "runs": {}}
    t0 = time.monotonic()

    def save():
        with open(os.path.join(out, "headloss.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)

    signal.signal(signal.SIGTERM, _on_term)
    reference = None
    modes = [m.strip() for m in args.runs.split(",")] if args.runs else ["ft"] + ([] if args.no_control else
                                                                                 ["control"])
    if not modes or set(modes) - {"ft", "control"}:
        p.error("--runs: ft and/or control")
    for mode in modes:
        try:
            r, reference = run_once(mode, app, args, out, token, jobs, reference)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: what the run started is stopped already (its finally)
            report["interrupted"] = mode
            save()
            print(f"interrupted: {os.path.join(out, 'headloss.json')}", file=sys.stderr)
            return 130
        report["runs"][mode] = r
        save()
    ft = report["runs"].get("ft")
    report["verdict"] = ({"ok": False, "error": "no ft run"} if ft is None else
                         {"ok": False, "error": ft["error"]} if "error" in ft else verdict(ft))
    report["total_wall_s"] = round(time.monotonic() - t0, 1)
    save()
    print("\n" + table(report["runs"]))
    for name, r in report["runs"].items():
        rec = r.get("recovery") or {}
        print(f"{name}: outage {r.get('outage_s')} s; ray.nodes() back {rec.get('ray_nodes_back_after_restart_s')} s "
              f"after the restart; serve RUNNING {rec.get('serve_running_after_restart_s')} s; raylet exited "
              f"{rec.get('raylet_exited_after_kill_s')} s after the kill; tokens {r.get('tokens')}; same replicas "
              f"{(r.get('serve') or {}).get('same_replicas')}")
    print(f"{'PASS' if report['verdict']['ok'] else 'FAIL'} {report['verdict']}: {os.path.join(out, 'headloss.json')}")
    return 0 if report["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
