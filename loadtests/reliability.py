"""Reliability runs against a live cluster: verifier replicas killed under load, device links that drop, overload,
and a leak check over 1,000 requests.

    python -m loadtests.reliability --out runs/reliability                       # every scenario
    python -m loadtests.reliability --scenarios kill,linkdrop --requests 48 --concurrency 8

It starts the cluster as `loadtests.run` does (serve_config.yaml with `--set` overrides applied, a Ray instance of
its own; it stops only what it started), then runs the scenarios in this order:

kill      N requests (methods ciar/eagle/lantern/cloud, networks 5g/4g/wifi, seeds drawn from --seed), C at a time,
          twice: undisturbed, then again while every Verifier replica is killed `--kills` times at even intervals
          (`ray.kill`; Serve starts a new replica, devices re-send their sessions' histories). Reported: attempted,
          succeeded, degraded, lost (anything but a 200), identical (same tokens as the undisturbed run), resumes.
linkdrop  N requests; every other one has its simulated link go down after 2..30 messages (`params.link_drop_after`):
          the device must finish the image alone and mark it degraded. Reported per group: attempted, succeeded,
          degraded, lost.
overload  a burst of B requests at once, far beyond devices + queue: each answer must be a 200 or a 503 with
          Retry-After, and the 503s must come back at once (their latency p50 / max is reported).
leak      devices reconfigured live to skip simulated waits; K verifier sessions opened and abandoned (a device that
          vanished); then M requests in two halves (every 10th streamed and disconnected after its first event,
          every 10th abandoned by a 0.25 s client timeout). Verifier sessions, device state and resident memory
          are read before, between the halves, after, and one idle timeout later, each once the fleet is idle for
          certain (no verifier session held, the abandoned ones evicted; none opened across two snapshots; every
          phone holding nothing): nothing may be left, and the memory growth of each half is reported.

nodeloss  on a cluster of its own (five Ray nodes on this machine): the node holding a verifier replica, then the
          node holding simulated phones, removed without warning under HTTP, streamed and real-socket load, and a
          replacement node added: `loadtests.nodeloss` (its options: --http, --streams, --sockets, ...).

`OUT/reliability.json` holds every figure; the exit code is 0 only when no request was lost, every overload answer
was a 200 or a 503 with Retry-After, and the leak check found nothing left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from loadtests.jobs import DEFAULT_SETS, PROMPTS, Client, make_jobs
from loadtests.plan import percentile
from loadtests.run import (REPO, Cluster, apply_overrides, client_key, each_replica, free_port, load_app_config,
                           use_weights)

def _run_all(client: Client, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(client.post, bodies))
    return out, time.perf_counter() - t0


def _count(results: list[dict]) -> dict:
    ok = [r for r in results if r["code"] == 200]
    return {"attempted": len(results), "succeeded": len(ok), "degraded": sum(r.get("degraded", False) for r in ok),
            "lost": len(results) - len(ok), "errors": sorted({f"{r['code']}: {r.get('error')}" for r in results
                                                               if r["code"] != 200})[:10]}


# ---------------------------------------------------------------------------------------------------------- scenarios
def verifier_actors() -> list:
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if "Verifier" in a["name"]]


def scenario_kill(client: Client, n: int, concurrency: int, kills: int, seed: int) -> dict:
    import ray

    bodies = make_jobs(n, seed)
    base, base_s = _run_all(client, bodies, concurrency)
    done = []

    def killer(stop: threading.Event) -> None:
        for j in range(kills):
            if stop.wait(base_s * (j + 1) / (kills + 1) - (time.perf_counter() - t0)):
                return
            for actor in verifier_actors():
                ray.kill(actor, no_restart=True)
                done.append(round(time.perf_counter() - t0, 2))

    stop = threading.Event()
    t0 = time.perf_counter()
    th = threading.Thread(target=killer, args=(stop,), daemon=True)
    th.start()
    hit, hit_s = _run_all(client, bodies, concurrency)
    stop.set()
    th.join()
    same = sum(1 for a, b in zip(base, hit) if a["code"] == b["code"] == 200 and a["tokens"] == b["tokens"])
    out = {**_count(hit), "identical_to_undisturbed": same, "resumes": sum(r.get("resumes", 0) for r in hit),
           "requests_resumed": sum(1 for r in hit if r.get("resumes")), "kills_at_s": done,
           "undisturbed": _count(base), "undisturbed_wall_s": round(base_s, 1), "wall_s": round(hit_s, 1),
           "latency_s": {"p50": percentile([r["latency_s"] for r in hit], 50),
                         "max": max(r["latency_s"] for r in hit)}}
    out["ok"] = out["lost"] == 0 and out["undisturbed"]["lost"] == 0 and bool(done)
    return out


def scenario_linkdrop(client: Client, n: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    bodies = make_jobs(n, seed + 1, methods=("ciar", "eagle", "lantern"))
    for i, b in enumerate(bodies):
        if i % 2 == 0:
            b["params"] = {"link_drop_after": rng.randint(2, 30)}
    res, wall = _run_all(client, bodies, concurrency)
    drop = [r for i, r in enumerate(res) if i % 2 == 0]
    keep = [r for i, r in enumerate(res) if i % 2 == 1]
    out = {"with_drop": _count(drop), "without_drop": _count(keep), "wall_s": round(wall, 1),
           "complete_images": sum(1 for r in res if r.get("total_tokens") and len(r.get("tokens") or []) ==
                                  r["total_tokens"])}
    out["ok"] = out["with_drop"]["lost"] == 0 and out["without_drop"]["lost"] == 0 and \
        out["with_drop"]["degraded"] > 0 and out["without_drop"]["degraded"] == 0
    return out


def scenario_overload(client: Client, burst: int, seed: int) -> dict:
    bodies = [{**b, "method": "cloud", "network": "4g"} for b in make_jobs(burst, seed + 2)]
    res, wall = _run_all(client, bodies, burst)
    r503 = [r for r in res if r["code"] == 503]
    other = [r for r in res if r["code"] not in (200, 503)]
    out = {"burst": burst, "ok_200": sum(r["code"] == 200 for r in res), "rejected_503": len(r503),
           "other": len(other), "other_codes": sorted({str(r["code"]) for r in other}),
           "retry_after_on_every_503": all(r.get("retry_after") for r in r503),
           "latency_503_s": {"p50": percentile([r["latency_s"] for r in r503], 50),
                             "max": max((r["latency_s"] for r in r503), default=None)},
           "latency_200_s": {"p50": percentile([r["latency_s"] for r in res if r["code"] == 200], 50)},
           "wall_s": round(wall, 1)}
    out["ok"] = not other and bool(r503) and out["retry_after_on_every_503"]
    return out


def fleet_state(devices: int, app: str = "ciar") -> dict:
    """Every Device replica's `state()` (asked until each has answered), then the Verifier replica's stats: its
    sessions and the sessions it has opened and resumed so far (counters: `_idle` compares two snapshots)."""
    from ray import serve

    h = serve.get_deployment_handle("Device", app_name=app)
    seen = each_replica(lambda: h.state.remote().result(timeout_s=120), "device_id", devices, tries_per_replica=12)
    v = serve.get_deployment_handle("Verifier", app_name=app).stats.remote().result(timeout_s=60)
    keys = ("session_tokens", "batch_size_records", "tracked_sessions")
    return {"devices_seen": len(seen), "devices_busy": sum(s["busy"] for s in seen.values()),
            "device_state": {k: sum(s[k] for s in seen.values()) for k in keys},
            "device_rss_mb": round(sum(s["rss_mb"] for s in seen.values()), 1),
            "verifier_sessions": v["sessions"], "verifier_free_slots": v["free_slots"],
            "verifier_opened": v["opened"], "verifier_resumed": v["resumed"],
            "verifier_rss_mb": round(v["rss_mb"], 1), "verifier_replica": v["replica_id"]}


def _idle(prev: dict | None, st: dict, devices: int) -> bool:
    """Whether no phone worked while `st` was read, `prev` the snapshot read just before it. A phone answers
    `state()` only between images (max_ongoing_requests=1), so its answer alone says little: the verifier says it.
    Every image holds a verifier session from its open to its close, so: no session held when `prev` ended and
    when `st` ended, none opened or resumed in between (the same replica's counters), and every phone answered
    `st` holding nothing (`busy`: a job whose caller went away runs on in its thread after its call ended)."""
    if prev is None:
        return False
    return (st["devices_seen"] == devices and st["devices_busy"] == 0 and not any(st["device_state"].values())
            and prev["verifier_sessions"] == st["verifier_sessions"] == 0
            and prev["verifier_replica"] == st["verifier_replica"]
            and (prev["verifier_opened"], prev["verifier_resumed"]) == (st["verifier_opened"], st["verifier_resumed"]))


def _wait_idle(devices: int, timeout_s: float = 300.0, poll_s: float = 1.0, clock=time.monotonic,
               sleep=time.sleep) -> dict:
    """The fleet's state (`fleet_state`) once it is idle for certain (`_idle`: the verifier holds no session, the
    abandoned ones evicted too), else the last one read when `timeout_s` (a hang guard) ran out; with `idle`
    (which of the two), `waited_s` and `snapshots` (how many were read). Called once every request the run sent
    has come back: what still works then is a job whose client went away (a stream cut, a client timeout), and no
    new one starts."""
    t0 = clock()
    prev, reads = None, 0
    while True:
        st = fleet_state(devices)
        reads += 1
        idle = _idle(prev, st, devices)
        if idle or clock() - t0 > timeout_s:
            return {**st, "idle": idle, "waited_s": round(clock() - t0, 1), "snapshots": reads}
        prev = st
        sleep(poll_s)


def scenario_leak(cluster: Cluster, client: Client, requests_n: int, abandoned: int, concurrency: int,
                  seed: int) -> dict:
    from ray import serve

    from ciar.collab.protocol import OpenRequest
    from ciar.decoding.sampling import SamplingParams
    from services.deploy import deploy_config

    app = cluster.app
    devices = int(app["args"].get("devices", 4))
    idle_s = float(app["user_configs"].get("Verifier", {}).get("idle_timeout_s", 60))
    # no simulated waits: as many requests through the fleet as the box can do
    deploy_config(app["args"], import_path=app["import_path"], name="ciar", runtime_env=app["runtime_env"],
                  user_configs={**app["user_configs"], "Device": {**app["user_configs"].get("Device", {}),
                                                                 "realtime": False}})
    bodies = make_jobs(requests_n, seed + 3, methods=("ciar", "cloud", "eagle", "code", "ciar", "lantern"))
    warm = min(50, requests_n // 10)
    _run_all(client, bodies[:warm], concurrency)
    # each snapshot waits until nothing works (a hang guard past the idle timeout: the abandoned sessions go first)
    guard_s = 120.0 + 4 * idle_s
    before = _wait_idle(devices, guard_s)

    v = serve.get_deployment_handle("Verifier", app_name="ciar")
    for i in range(abandoned):  # devices that open a session and vanish: only the idle timeout frees these
        sid = f"abandoned-{i}"
        v.options(session_id=sid).open.remote(OpenRequest(sid, PROMPTS[0], i, SamplingParams(), 0), session_id=sid,
                      device_id="vanished").result(timeout_s=120)
    held = v.stats.remote().result(timeout_s=60)["sessions"]

    def one(i_body):
        i, body = i_body
        if i % 10 == 3:
            return client.stream_and_disconnect(body)
        if i % 10 == 7:
            return {**client.post(body, timeout=0.25), "abandoned": True}
        return client.post(body)

    t0 = time.perf_counter()
    half = warm + (requests_n - warm) // 2
    with ThreadPoolExecutor(concurrency) as pool:  # two halves, memory read between them: growth per half
        res = list(pool.map(one, enumerate(bodies[warm:half], start=warm)))
        middle = _wait_idle(devices, guard_s)
        res += list(pool.map(one, enumerate(bodies[half:], start=half)))
    wall = time.perf_counter() - t0
    after = _wait_idle(devices, guard_s)
    time.sleep(idle_s * 1.6 + 1.0)  # one more idle timeout (the evictor runs every idle/4 s): nothing comes back
    settled = _wait_idle(devices, guard_s)
    plain = [r for r in res if not r.get("disconnected") and not r.get("abandoned")]
    out = {"requests": len(res) + warm, "measured_requests": len(res), "wall_s": round(wall, 1),
           "completed_200": sum(r["code"] == 200 for r in plain), "plain_requests": len(plain),
           "plain_not_200": sum(r["code"] != 200 for r in plain),
           "disconnected": sum(1 for r in res if r.get("disconnected")),
           "abandoned_by_timeout": sum(1 for r in res if r.get("abandoned") and r["code"] is None),
           "abandoned_sessions_opened": abandoned, "verifier_sessions_after_abandoning": held,
           "idle_timeout_s": idle_s,
           "before": before, "middle": middle, "after": after, "after_idle_timeout": settled,
           "rss_growth_mb_per_half": {
               "verifier": [round(middle["verifier_rss_mb"] - before["verifier_rss_mb"], 1),
                            round(after["verifier_rss_mb"] - middle["verifier_rss_mb"], 1)],
               "devices": [round(middle["device_rss_mb"] - before["device_rss_mb"], 1),
                           round(after["device_rss_mb"] - middle["device_rss_mb"], 1)]},
           "verifier_rss_growth_mb": round(settled["verifier_rss_mb"] - before["verifier_rss_mb"], 1),
           "device_rss_growth_mb": round(settled["device_rss_mb"] - before["device_rss_mb"], 1)}
    left = settled["device_state"]
    out["idle_snapshots"] = all(snap["idle"] for snap in (before, middle, after, settled))
    out["ok"] = (held >= abandoned and settled["verifier_sessions"] == 0 and not any(left.values())
                 and out["plain_not_200"] == 0 and out["idle_snapshots"]
                 and settled["verifier_free_slots"] == before["verifier_free_slots"]
                 and settled["verifier_replica"] == before["verifier_replica"])
    return out


# ---------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/reliability")
    p.add_argument("--scenarios", default="kill,linkdrop,overload,leak")
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--weights", default=None)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help=f"as in loadtests.run (applied after the defaults {', '.join(DEFAULT_SETS)})")
    p.add_argument("--requests", type=int, default=48, help="requests of the kill and linkdrop scenarios")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kills", type=int, default=3, help="times the verifier replicas are killed")
    p.add_argument("--burst", type=int, default=96, help="requests of the overload burst")
    p.add_argument("--leak-requests", type=int, default=1000)
    p.add_argument("--abandoned", type=int, default=8, help="verifier sessions opened and never closed")
    p.add_argument("--seed", type=int, default=0)
    from loadtests import nodeloss

    nodeloss.add_arguments(p.add_argument_group("nodeloss"))
    args = p.parse_args(argv)

    known = ("kill", "linkdrop", "overload", "leak", "nodeloss")
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - set(known)
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    config = apply_overrides(load_app_config(args.config), list(DEFAULT_SETS) + args.sets)
    if args.weights:
        use_weights(config, args.weights)
    app = json.loads(json.dumps(config))
    app["args"]["devices"] = args.devices
    key = client_key(app)
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"devices": args.devices, "user_configs": app["user_configs"], "scenarios": {}}
    t0 = time.monotonic()
    if "nodeloss" in scenarios:  # a multi-node cluster of its own, before the others' cluster starts
        scenarios.remove("nodeloss")
        losses = tuple(x.strip() for x in args.lose.split(",") if x.strip())
        os.makedirs(os.path.join(args.out, "nodeloss"), exist_ok=True)
        report["scenarios"]["nodeloss"] = nodeloss.run(
            config, os.path.join(args.out, "nodeloss"), args.http, args.streams, args.sockets, args.socket_images,
            args.concurrency, args.devices_per_node, losses, args.at, args.replace_after, args.seed)
    cluster = Cluster(app, free_port(), free_port())
    try:
        if not scenarios:
            return _finish(report, args.out, t0)
        print(f"starting the cluster ({args.devices} devices) ...", flush=True)
        cluster.start()
        report["cluster_start_s"] = round(time.monotonic() - t0, 1)
        client = Client(cluster.url, key)
        for name in scenarios:
            print(f"scenario {name} ...", flush=True)
            t1 = time.monotonic()
            if name == "kill":
                r = scenario_kill(client, args.requests, args.concurrency, args.kills, args.seed)
            elif name == "linkdrop":
                r = scenario_linkdrop(client, args.requests, args.concurrency, args.seed)
            elif name == "overload":
                r = scenario_overload(client, args.burst, args.seed)
            else:
                r = scenario_leak(cluster, client, args.leak_requests, args.abandoned, args.concurrency, args.seed)
            r["scenario_wall_s"] = round(time.monotonic() - t1, 1)
            report["scenarios"][name] = r
            print(json.dumps({name: r}, indent=1, default=str), flush=True)
            with open(os.path.join(args.out, "reliability.json"), "w") as f:
                json.dump(report, f, indent=2, default=str)
    finally:
        cluster.stop()
    return _finish(report, args.out, t0)


def _finish(report: dict, out: str, t0: float) -> int:
    report["ok"] = all(r.get("ok") for r in report["scenarios"].values())
    report["total_wall_s"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out, "reliability.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"{'PASS' if report['ok'] else 'FAIL'}: {os.path.join(out, 'reliability.json')}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
