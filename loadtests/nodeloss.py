"""Node loss under load: a multi-node Ray cluster on this machine loses, without warning, the node holding a
verifier replica, then the node holding simulated phones, while images are in flight.

    python -m loadtests.nodeloss --out runs/nodeloss                      # the shipped world, both losses
    python -m loadtests.reliability --scenarios nodeloss --out runs/rel   # the same, as a reliability scenario
    python -m loadtests.nodeloss --weights W --http 8 --streams 2 --sockets 0 --lose verifier

The cluster (`ray.cluster_utils.Cluster`: every node a raylet of its own, in processes of its own, on this machine)
is laid out as KubeRay's manifests lay it out (cluster/rayservice.yaml): the head holds Serve's controller, the
proxy and the ingress (`ingress_resources: {ciar_ingress: 1}`, which only the head declares), two verifier nodes
(`ciar_verifier: 1` each, one Verifier replica on each) and two device nodes (`ciar_device: D` each, the phones
spread over them). A node is lost by `Cluster.remove_node(node, allow_graceful=False)`: its raylet, object store
and every worker on it killed at once, as a reclaimed spot instance or a kernel panic would. After `--replace-after`
seconds a new node with the same resources joins (KubeRay's replacement pod) and Serve places the missing replicas
on it.

One workload, run undisturbed first and then once per lost node: W plain HTTP generations (`response_format:
tokens`; ciar / eagle / lantern / cloud, CIAR at its fixed point, as `loadtests.reliability`'s kill scenario), S
streamed ones read to their end, and K real devices over the WebSocket device endpoint (threads of this process,
each the torch-free loop `ciar_device.loop.generate` on the exported ONNX model, policy fixed, images one after
another; skipped with --sockets 0 or when the world has no export). The node is removed at `--at` of the
undisturbed run's wall time. Reported per loss: attempted, succeeded, lost (anything but a 200 / a finished
device image), bit-identical to the undisturbed run, device retries (the ingress runs a job again when its phone
is lost: `services.app.Ingress._on_device`), verifier resumes (a phone or a real device re-sends the session's
history to a surviving replica), the time until the lost replicas were noticed, and until the pool was whole
again (every deployment HEALTHY with its target replicas RUNNING, one of them on the replacement node).

Exit code 0 only when nothing was lost and everything that completed equals the undisturbed run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from loadtests.plan import percentile
from loadtests.jobs import DEFAULT_SETS, Client, make_jobs
from loadtests.run import (REPO, apply_overrides, client_key, free_port, load_app_config, serve_actors,
                           use_weights, wait_healthy)

APP = "ciar"
LOSSES = ("verifier", "device")
SOCKET_PROMPTS = ("a large yellow circle at the center on a black background",
                  "a small blue triangle at the bottom right on a white background",
                  "a medium red square at the top left on a gray background")


# ------------------------------------------------------------------------------------------------------- the cluster
class NodeCluster:
    """A head and four worker nodes on this machine, Serve and the application on them; stopped only by this
    process (`stop`)."""

    def __init__(self, app: dict, devices_per_node: int, port: int):
        self.app, self.devices_per_node, self.port = app, devices_per_node, port
        self.url = f"http://127.0.0.1:{port}"
        self.cluster = None
        self.nodes: dict[str, list] = {"verifier": [], "device": []}
        self.added: list[dict] = []

    def _add(self, kind: str):
        res = {"verifier": {"ciar_verifier": 1}, "device": {"ciar_device": self.devices_per_node}}[kind]
        # CPUs: what the node's replicas ask for, so nothing else (the ingress) fits there
        cpus = {"verifier": 1, "device": max(1, round(self.devices_per_node * self.app["args"]["device_num_cpus"]))}
        node = self.cluster.add_node(num_cpus=cpus[kind], resources=res)
        self.nodes[kind].append(node)
        return node

    def start(self) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from services.deploy import OFFLINE_ONE_THREAD_ENV, deploy_config, patient_serve_env

        patient_serve_env()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "resources": {"ciar_ingress": 1}})
        for kind in ("verifier", "verifier", "device", "device"):
            self._add(kind)
        self.cluster.wait_for_nodes()
        env = {"env_vars": {**OFFLINE_ONE_THREAD_ENV["env_vars"], **(self.app["runtime_env"].get("env_vars") or {})}}
        ray.init(address=self.cluster.address, log_to_driver=False, runtime_env=env)
        # one proxy, on the head: every node of this cluster shares the machine's ports
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.port})
        deploy_config(self.app["args"], import_path=self.app["import_path"], name=APP,
                      runtime_env=self.app["runtime_env"], user_configs=self.app["user_configs"])
        wait_healthy(self.url)

    def lose(self, kind: str, index: int = 0) -> str:
        """Remove the `kind` node at `index` without warning; -> its node id."""
        node = self.nodes[kind].pop(index)
        self.cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def replace(self, kind: str) -> str:
        node = self._add(kind)
        self.cluster.wait_for_nodes()
        return node.node_id

    def stop(self) -> None:
        import ray
        from ray import serve

        if self.cluster is None:
            return
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            self.cluster = None


def placement() -> dict[str, list[str]]:
    """deployment -> the node ids of its live replicas."""
    out: dict[str, list[str]] = {}
    for a in serve_actors():
        dep = a["ActorClassName"].rsplit(":", 1)[-1]
        out.setdefault(dep, []).append((a.get("Address") or {}).get("NodeID"))
    return out


def pool_state() -> dict:
    """Each deployment's status and its RUNNING replicas (serve.status)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return {}
    return {name: {"status": str(getattr(d.status, "value", d.status)),
                   "running": int(d.replica_states.get("RUNNING", 0))} for name, d in app.deployments.items()}


class PoolWatch:
    """Samples the pool every `every_s` seconds from the loss on: when it was first seen short of replicas
    (noticed), and when it was whole again (every deployment HEALTHY with its target replicas RUNNING, and the
    cluster's live replicas the target's, none on `lost_nodes`: until a lost node's replicas are marked dead, Serve
    may still count them, so a pool whose lost verifier was replaced looked whole while a lost device node's phones
    were still counted; seen once under `make test`'s load, the phones not yet on the replacement node)."""

    def __init__(self, target: dict[str, int], every_s: float = 0.5, timeout_s: float = 300.0,
                 lost_nodes: tuple = ()):
        self.target, self.every_s, self.timeout_s, self.lost_nodes = target, every_s, timeout_s, set(lost_nodes)
        self.samples: list[dict] = []
        self.t0 = 0.0
        self.noticed_s = self.whole_s = None
        self._th: threading.Thread | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        while time.perf_counter() - self.t0 < self.timeout_s:
            t = round(time.perf_counter() - self.t0, 2)
            try:
                st = pool_state()
            except Exception as e:  # noqa: BLE001 - the controller may be busy: a gap in the samples
                self.samples.append({"t": t, "error": type(e).__name__})
                time.sleep(self.every_s)
                continue
            self.samples.append({"t": t, **{k: f"{v['status']}:{v['running']}" for k, v in st.items()}})
            whole = all(st.get(k, {}).get("running") == n and st[k]["status"] == "HEALTHY"
                        for k, n in self.target.items())
            if not whole and self.noticed_s is None:
                self.noticed_s = t
            if whole and self.lost_nodes:  # and so says the cluster: the target's live replicas, none on a lost node
                try:
                    live = placement()
                    whole = all(len(live.get(d, [])) == n for d, n in self.target.items()) and \
                        not any(node in self.lost_nodes for nodes in live.values() for node in nodes)
                except Exception:  # noqa: BLE001 - the actor table may be busy: not whole yet, look again
                    whole = False
            if whole and self.noticed_s is not None:
                self.whole_s = t
                return
            time.sleep(self.every_s)

    def join(self) -> None:
        if self._th is not None:
            self._th.join()


# ------------------------------------------------------------------------------------------------------ the workload
def socket_images(url: str, key: str, model_dir: str, clients: int, images: int, seed: int) -> list[dict]:
    """`clients` real devices (threads), each `images` images one after another over one WebSocket."""
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate
    from ciar_device.runtime import DeviceRuntime

    ws = url.replace("http://", "ws://")

    def one_client(c: int) -> list[dict]:
        rt = DeviceRuntime(model_dir, threads=1)
        conn = DeviceConnection(ws, key, rt.vocab_size, timeout_s=300.0, retries=40, backoff_s=0.25)
        out = []
        for j in range(images):
            s = seed * 7919 + 101 * c + j
            rec = {"client": c, "image": j, "seed": s, "prompt": SOCKET_PROMPTS[(c + j) % len(SOCKET_PROMPTS)]}
            r0, t0 = conn.resumes, time.perf_counter()
            try:  # a session id of its own per run: sessions outlive connections
                res = generate(rt, conn, rec["prompt"], s, policy="fixed",
                               session_id=f"nl{os.getpid()}-{time.monotonic_ns()}-{c}-{j}")
                rec.update(ok=True, tokens=res.tokens.tolist(), degraded=bool(res.stats.get("degraded")))
            except Exception as e:  # noqa: BLE001 - recorded
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rec.update(resumes=conn.resumes - r0, latency_s=time.perf_counter() - t0)
            out.append(rec)
        conn.disconnect()
        return out

    with ThreadPoolExecutor(max(1, clients)) as pool:
        return [r for rs in pool.map(one_client, range(clients)) for r in rs]


def workload(client: Client, bodies: list[dict], streams: list[dict], concurrency: int, sock: dict | None
             ) -> tuple[dict, float]:
    """Plain HTTP (`concurrency` at a time), streams and real devices, all at once -> results, wall seconds."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(3) as outer:
        f_sock = outer.submit(socket_images, **sock) if sock else None
        f_stream = outer.submit(lambda: list(ThreadPoolExecutor(max(1, len(streams))).map(
            client.stream, streams)) if streams else [])
        with ThreadPoolExecutor(concurrency) as pool:
            http = list(pool.map(client.post, bodies))
        res = {"http": http, "stream": f_stream.result(), "socket": f_sock.result() if f_sock else []}
    return res, time.perf_counter() - t0


def compare(base: dict, hit: dict) -> dict:
    """Per channel: attempted, succeeded, lost, identical to the undisturbed run, retries and resumes."""
    out = {}
    for ch in ("http", "stream", "socket"):
        b, h = base[ch], hit[ch]
        ok = (lambda r: r.get("ok")) if ch == "socket" else (lambda r: r.get("code") == 200)
        same = sum(1 for x, y in zip(b, h) if ok(x) and ok(y) and x.get("tokens") == y.get("tokens"))
        out[ch] = {"attempted": len(h), "succeeded": sum(1 for r in h if ok(r)),
                   "lost": sum(1 for r in h if not ok(r)), "identical": same,
                   "degraded": sum(1 for r in h if r.get("degraded")),
                   "device_retries": sum(r.get("device_retries", 0) or 0 for r in h),
                   "resumes": sum(r.get("resumes", 0) or 0 for r in h),
                   "latency_s": {"p50": percentile([r["latency_s"] for r in h], 50),
                                 "max": max((r["latency_s"] for r in h), default=None)},
                   "errors": sorted({str(r.get("error")) for r in h if not ok(r)})[:8]}
    tot = {k: sum(out[c][k] for c in out) for k in ("attempted", "succeeded", "lost", "identical")}
    return {"channels": out, **tot}


def lose_under_load(cl: NodeCluster, kind: str, client: Client, bodies, streams, concurrency, sock,
                    at_s: float, replace_after_s: float, target: dict[str, int], base: dict) -> dict:
    """The workload with `kind`'s node lost at `at_s` ("verifier", "device", or both at once: "verifier+device")
    and a replacement for each after `replace_after_s` more; compared with the undisturbed results `base`."""
    kinds = kind.split("+")
    events: dict = {}
    # the load runs beside; the cluster is changed from the main thread (Ray's node processes are started with
    # signal handlers, which only the main thread may install)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as bg:
        load = bg.submit(workload, client, bodies, streams, concurrency, sock)
        time.sleep(at_s)
        before = placement()
        lost = [cl.lose(k) for k in kinds]
        events["lost_node"] = ",".join(lost)
        events["lost_at_s"] = round(time.perf_counter() - t0, 2)
        events["replicas_on_lost_node"] = {d: sum(1 for n in ns if n in lost) for d, ns in before.items()}
        watch = PoolWatch(target, lost_nodes=tuple(lost))
        watch.start()
        time.sleep(replace_after_s)
        new = [cl.replace(k) for k in kinds]
        events["replacement_node"] = ",".join(new)
        events["replacement_joined_at_s"] = round(time.perf_counter() - t0, 2)
        hit, wall = load.result()
    watch.join()
    after = placement()
    out = {**compare(base, hit), "wall_s": round(wall, 1), **events,
           "pool_short_noticed_after_s": watch.noticed_s, "pool_whole_after_s": watch.whole_s,
           "replicas_on_replacement": {d: sum(1 for n in ns if n in new) for d, ns in after.items()},
           "placement_after": {d: [n[:8] if n else n for n in ns] for d, ns in after.items()},
           "pool_samples": watch.samples[:: max(1, len(watch.samples) // 40)]}
    out["ok"] = out["lost"] == 0 and out["identical"] == out["succeeded"] == out["attempted"] and \
        watch.whole_s is not None
    return out


# ------------------------------------------------------------------------------------------------------------ main
def run(app: dict, out_dir: str, http: int, streams: int, sockets: int, socket_images_n: int, concurrency: int,
        devices_per_node: int, losses: tuple[str, ...], at: float, replace_after_s: float, seed: int) -> dict:
    args = app["args"]
    args.update(devices=2 * devices_per_node, verifier_replicas=2, verifier_num_cpus=1.0,
                verifier_resources={"ciar_verifier": 1}, device_resources={"ciar_device": 1},
                ingress_resources={"ciar_ingress": 1}, device_num_cpus=args.get("device_num_cpus", 0.25))
    key = client_key(app)
    bodies = make_jobs(http, seed)
    stream_bodies = [{**b, "method": "ciar", "params": {"policy": "fixed"}} for b in make_jobs(streams, seed + 1)]
    report: dict = {"layout": {"head": "controller, proxy, Ingress (ciar_ingress)", "verifier_nodes": 2,
                               "device_nodes": 2, "devices_per_node": devices_per_node},
                    "workload": {"http": http, "streams": streams, "sockets": sockets,
                                 "socket_images_each": socket_images_n, "concurrency": concurrency},
                    "losses": {}}
    cl = NodeCluster(app, devices_per_node, free_port())
    t0 = time.monotonic()
    try:
        print("starting a 5-node cluster ...", flush=True)
        cl.start()
        report["cluster_start_s"] = round(time.monotonic() - t0, 1)
        report["placement"] = {d: sorted(set(ns)) for d, ns in placement().items()}
        client = Client(cl.url, key)
        sock = None
        if sockets:
            from ciar_device.fetch import fetch_model

            from loadtests.devices import DEVICE_KEY

            try:
                model_dir = fetch_model(cl.url, DEVICE_KEY)
                sock = {"url": cl.url, "key": DEVICE_KEY, "model_dir": model_dir, "clients": sockets,
                        "images": socket_images_n, "seed": seed}
            except Exception as e:  # noqa: BLE001 - a world without an export: no real devices, said so
                report["sockets_skipped"] = f"{type(e).__name__}: {e}"
        print("undisturbed run ...", flush=True)
        base, base_wall = workload(client, bodies, stream_bodies, concurrency, sock)
        report["undisturbed"] = {**compare(base, base), "wall_s": round(base_wall, 1)}
        print(json.dumps({"undisturbed": report["undisturbed"]}, indent=1, default=str), flush=True)
        target = {"Verifier": 2, "Device": 2 * devices_per_node, "Ingress": 1}
        for kind in losses:
            print(f"losing a {kind} node at {at:.0%} of {base_wall:.0f} s ...", flush=True)
            r = lose_under_load(cl, kind, client, bodies, stream_bodies, concurrency, sock, at * base_wall,
                                replace_after_s, target, base)
            report["losses"][kind] = r
            print(json.dumps({kind: {k: v for k, v in r.items() if k != "pool_samples"}}, indent=1, default=str),
                  flush=True)
            with open(os.path.join(out_dir, "nodeloss.json"), "w") as f:
                json.dump(report, f, indent=2, default=str)
    finally:
        cl.stop()
    report["ok"] = report.get("undisturbed", {}).get("lost", 1) == 0 and bool(report["losses"]) and \
        all(r["ok"] for r in report["losses"].values())
    report["total_wall_s"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out_dir, "nodeloss.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", type=int, default=24, help="plain HTTP generations per run")
    p.add_argument("--streams", type=int, default=4, help="streamed generations per run")
    p.add_argument("--sockets", type=int, default=2, help="real devices over the WebSocket (0: none)")
    p.add_argument("--socket-images", type=int, default=3, help="images per real device per run")
    p.add_argument("--devices-per-node", type=int, default=4)
    p.add_argument("--lose", default=",".join(LOSSES), help="nodes lost, one run each: verifier,device; "
                   "verifier+device loses both at once")
    p.add_argument("--at", type=float, default=0.3, help="the loss, as a share of the undisturbed wall time")
    p.add_argument("--replace-after", type=float, default=5.0, help="seconds until a replacement node joins")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/nodeloss")
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--weights", default=None)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    add_arguments(p)
    a = p.parse_args(argv)
    losses = tuple(x.strip() for x in a.lose.split(",") if x.strip())
    if not losses or any(set(x.split("+")) - set(LOSSES) for x in losses):
        p.error(f"--lose: one or more of {', '.join(LOSSES)} (a+b: both nodes at once)")
    app = apply_overrides(load_app_config(a.config), list(DEFAULT_SETS) + a.sets)
    if a.weights:
        use_weights(app, a.weights)
    os.makedirs(a.out, exist_ok=True)
    r = run(app, a.out, a.http, a.streams, a.sockets, a.socket_images, a.concurrency, a.devices_per_node, losses,
            a.at, a.replace_after, a.seed)
    print(f"{'PASS' if r['ok'] else 'FAIL'}: {os.path.join(a.out, 'nodeloss.json')}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
