"""Capacity of one verifier replica: how many phones it serves at a latency SLO, with CIAR and with cloud-only.

    python -m loadtests.capacity --out runs/capacity [--slo-p99-s 5] [--phones 1,2,4,8,16,32] [--duration 20]
        [--traces 12] [--network 5g] [--world FILE | --weights DIR] [--verifier-autoscaling JSON]
    python -m loadtests.capacity --out DIR --cost-model gpu:h100,a100,l4 [--traces-dir DIR]   # a MODEL, no GPU

1. Record (in this process, no Ray): the world's cloud and device generate `--traces` images with CIAR (the
   device file's calibrated defaults: gate, tau, burst) and `--traces` with cloud-only, through
   `ciar.capacity.trace.TracingClient`: every request as sent, every reply, the device compute between them.
2. Serve: ONE `Verifier` replica (the application's deployment alone, its session-affine router), started as
   `benchmarks.serving` starts it, with the engine settings of `serve_config.yaml` unless overridden.
3. Ramp: at each load L of `--phones`, L trace-driven phones run at once for `--duration` seconds, each replaying
   recorded images back to back under fresh session ids through the deployment handle (the same protocol and
   calls as the Device deployment): the recorded device compute is slept, and each message waits for its simulated
   up/down transfer (`ciar.sim.network`, one seeded link per phone). CIAR first, then cloud-only, at the same
   L on the same replica. A method stops ramping once its p99 passes twice the SLO.
   With `--verifier-replicas N` or `--verifier-autoscaling JSON` the pool has several replicas (or scales with
   the load); a session the consistent-hash ring moves to another replica is re-created from its history there
   (`resumes` per point), as a device does, and its replies still equal the recording.
4. Report `OUT/capacity.json` and `OUT/capacity.png`: per point images/s, image latency p50/p95/p99, verifier
   forwards per image, the batch-size histogram, cloud token positions per image by kind (spans, one-token
   decodes, resumed histories; prefill excluded), replay mismatches; and the headline: the largest load whose p99
   holds the SLO per method, **phones per replica at the SLO, CIAR / cloud-only**, with the cloud positions and
   sequential cloud passes per image of each method; and a measured cost model of one verifier forward (time =
   a + b rows + c positions, least squares over a grid of batch shapes) with each method's modelled verifier
   milliseconds per image at 1, 4, 16 and 64 sessions per forward: a fixed per-forward cost (memory-bound, a GPU)
   rewards CIAR's fewer passes, a per-position cost (compute-bound, this CPU) its equal positions.

`--cost-model gpu:NAMES` replaces steps 2-4 by a model (`ciar.capacity.gpu_model`, nothing runs on a GPU): the same
recorded phones replayed in simulated time against one modelled replica at LlamaGen-XL's shapes, each forward
priced max(bytes / bandwidth, flops / peak) + overhead from the named GPUs' datasheet figures; it writes
`OUT/gpu_capacity.json` and `.md`: phones per replica at the SLO for CIAR and cloud-only and cloud forward-seconds
per image, per GPU, every figure labelled as modelled. `--traces-dir DIR` keeps the recorded phones (DIR/ciar.pt,
DIR/cloud.pt: read when there, written after recording otherwise) and the settings they were recorded with
(DIR/traces.json: --traces, --seed, the world, the overload factor); other settings are refused.

Every phone starts at once and keeps its session count constant; images that finish inside the measuring window
(after `--warmup`) count, whenever they started; phones drain their last image afterwards. With `--images N` the
window lasts `--duration` seconds and then until every phone has N images in it (finished or failed), however
long an image takes on this machine: what a point reports is then counted, not cut off by the clock (a window of
3 s held no image at all on a loaded 2-core box). What is measured is the replica: the phones cost the driver a
sleep and a message per exchange. `padding` is the share of the forwards'
padded positions (rows x width) that held no real token: the price of one dense ragged batch per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np
import torch

from ciar.capacity.gpu_model import GPUS, phones_at_slo
from ciar.results import SettingsMismatch, claim_settings

METHODS = ("ciar", "cloud")
OVERLOAD = "ciar overload"  # --overload: CIAR phones that raise tau while their verifier is past a limit
RAISED = "ciar raised"  # ... the recorded images they make then (CIAR at tau x the factor)


def record(args) -> dict[str, list]:
    """Record `args.traces` sessions per method with the world's models, in this process; with `args.traces_dir`,
    read them from DIR/METHOD.pt when there, and write a new recording there."""
    from ciar.sim.decoder import method_config
    from ciar.capacity.trace import load_traces
    from ciar.training.calibration import val_prompts
    from ciar.world import load_world
    from ciar.world_spec import world_from_args

    folder = getattr(args, "traces_dir", None)
    overload = parse_overload(getattr(args, "overload", None))
    kinds = METHODS + ((RAISED,) if overload else ())
    if folder:  # the recordings there must be of this run's prompts, seeds and world (they were read whatever)
        claim_settings(os.path.join(folder, "traces.json"),
                       {"traces": args.traces, "seed": args.seed, "world": str(world_from_args(args)),
                        "overload_factor": overload[1] if overload else None},
                       f"--traces-dir {folder}", "give another --traces-dir, or remove that folder")
    if folder and all(os.path.isfile(os.path.join(folder, f"{m}.pt")) for m in kinds):
        return {m: load_traces(os.path.join(folder, f"{m}.pt")) for m in kinds}
    torch.set_num_threads(args.threads)
    world = load_world(world_from_args(args))
    prompts = val_prompts(args.traces, seed=args.seed)  # val captions: never the held-out evaluation ones
    out = {}
    # CIAR at its calibrated point (a replayed phone cannot re-decide as an adaptive device would)
    ciar = method_config("ciar", network="none", policy="fixed").resolve(world.device_model.ciar_defaults)
    configs = {"ciar": ciar, "cloud": method_config("cloud", network="none")}
    if overload:
        configs[RAISED] = method_config("ciar", network="none", policy="fixed", tau=ciar.tau * overload[1])
    return record_configs(world, configs, prompts, args.seed, folder)


def record_configs(world, configs: dict, prompts: list[str], seed: int, folder: str | None = None) -> dict[str, list]:
    """One recording per named decoder config (`CollabConfig`): each prompt decoded once (seeds seed, seed + 1,
    ...) through a `TracingClient` over an in-process verifier; saved to FOLDER/NAME.pt when `folder` is given."""
    from ciar.capacity.trace import TracingClient, save_traces
    from ciar.engine.verifier import CloudVerifier, InProcessCloud
    from ciar.sim.decoder import CollabDecoder

    out = {}
    for method, config in configs.items():
        verifier = CloudVerifier(world.cloud, world.text, max_sessions=2, projector=world.projector,
                                 codebook=world.codebook)
        rec = TracingClient(InProcessCloud(verifier))
        dec = CollabDecoder(world.device_model, rec, config, world.sampling)
        for i, prompt in enumerate(prompts):
            dec.generate(prompt, seed=seed + i, session_id=f"{method}-{i}")
        out[method] = rec.sessions
        print(f"recorded {len(rec.sessions)} {method} sessions: {np.mean([1 + len(t.steps) for t in rec.sessions]):.1f}"
              f" cloud requests per image")
        if folder:
            os.makedirs(folder, exist_ok=True)
            save_traces(rec.sessions, os.path.join(folder, f"{method}.pt"))
    return out


def forward_cost(world, reps: int = 5) -> dict:
    """A measured cost model of one verifier forward: time against batch rows R and token positions R x W (rows of
    W tokens at mid-image, keys read from the cache), least squares t = a + b R + c R W. -> coefficients (ms), fit,
    points."""
    from ciar.engine.verifier import CloudVerifier

    cloud = world.cloud
    c = cloud.config
    grid = [(r, w) for r in (2, 8, 32, 64) for w in (1, 4, 16) if r * w <= 1024]
    v = CloudVerifier(cloud, None, max_sessions=32)
    start = c.cls_token_num + c.block_size // 2
    points = []
    with torch.no_grad():
        for r, w in grid:
            h = cloud.tok_embeddings(torch.randint(0, c.vocab_size, (r, w), generator=torch.Generator().manual_seed(r)))
            pos = torch.arange(start, start + w).expand(r, w)
            slots = torch.arange(r)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                cloud.logits(cloud.forward_cached(v.cache, h, pos, slots, kv_len=start + w)[:, -1])
                times.append(time.perf_counter() - t0)
            points.append({"rows": r, "width": w, "ms": 1e3 * float(np.median(times[1:]))})
    x = np.array([[1.0, p["rows"], p["rows"] * p["width"]] for p in points])
    y = np.array([p["ms"] for p in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    r2 = 1.0 - float(((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    return {"a_ms_per_forward": float(coef[0]), "b_ms_per_row": float(coef[1]), "c_ms_per_position": float(coef[2]),
            "r2": r2, "points": points, "context": start}


def image_cost_ms(model: dict, passes: float, positions: float, batch: int, rows_per_session: int = 2) -> float:
    """Verifier milliseconds one image costs at `batch` sessions per forward under the cost model: each of its
    passes pays a 1/batch share of the fixed cost and its rows; each of its positions its rows' position cost."""
    return passes * (model["a_ms_per_forward"] / batch + rows_per_session * model["b_ms_per_row"]) + \
        rows_per_session * positions * model["c_ms_per_position"]


class HandleClient:
    """Replay client over the Verifier deployment: the edge the device socket calls it through
    (`services.verifier_client.RayVerifierBackend`: routed by session, every call bounded by `call_timeout_s`), with
    this phone's id and its sessions' tokens."""

    def __init__(self, handle, device_id: str, call_timeout_s: float = 600.0):
        from services.verifier_client import RayVerifierBackend

        self.backend, self.device_id, self.tokens = RayVerifierBackend(handle, call_timeout_s), device_id, {}

    async def open(self, request):
        sid = request.session_id
        reply, self.tokens[sid] = await self.backend.open(request, session_id=sid, device_id=self.device_id)
        return reply

    async def verify(self, request):
        sid = request.session_id
        return await self.backend.verify(request, session_id=sid, device_id=self.device_id, token=self.tokens[sid])

    async def resume(self, request, history, injected=None):
        sid = request.session_id
        return await self.backend.resume(request, history, injected, session_id=sid, device_id=self.device_id,
                                         token=self.tokens[sid])

    async def close(self, session_id: str) -> None:
        await self.backend.close(session_id=session_id, device_id=self.device_id,
                                 token=self.tokens.pop(session_id, ""))


def _lost(exc: BaseException) -> bool:
    """The verifier lost the session: it answers SessionLostError, or its replica is gone (as the Device sees it)."""
    from services.verifier_client import replica_lost, session_lost

    return session_lost(exc) or replica_lost(exc)


async def replica_stats(handle, replicas: int, timeout_s: float = 300.0) -> dict:
    """The Verifier replicas' stats summed (calls without a session reach any replica: ask until each answered).
    A replica that does not answer one within `timeout_s` (a hung replica: its event loop blocked) fails the run
    with that said, where an unbounded wait held the whole run."""
    from services.verifier_client import CloudTimeoutError, within

    seen: dict = {}
    for _ in range(8 * max(1, replicas)):
        try:
            st = await within(handle.stats.remote(), timeout_s, "stats()")
        except CloudTimeoutError as e:
            raise RuntimeError(f"{e} (replicas that answered: {sorted(seen) or 'none'}): a Verifier replica is "
                               "hung, not loaded") from None
        seen[st["replica_id"]] = st
        if len(seen) >= replicas:
            break
    total = {"replicas": sorted(seen), "forwards": 0, "real_positions": 0, "padded_positions": 0, "resumed": 0,
             "positions_by_kind": {}, "batch_size_hist": {}}
    for st in seen.values():
        for k in ("forwards", "real_positions", "padded_positions", "resumed"):
            total[k] += st[k]
        for field in ("positions_by_kind", "batch_size_hist"):
            for k, v in st[field].items():
                total[field][k] = total[field].get(k, 0) + v
    return total


def running_replicas(app: str = "capacity") -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["Verifier"]
    return int(status.replica_states.get("RUNNING", 0))


def parse_overload(spec: str | None) -> tuple[float, float] | None:
    """--overload "LIMIT_S:FACTOR" (graceful degradation: the verifier seconds per exchange past which a phone's
    next image runs at tau x FACTOR) -> (limit, factor), None when not given."""
    if not spec:
        return None
    try:
        limit, factor = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--overload must be LIMIT_S:FACTOR (e.g. 0.05:1.4), got {spec!r}") from None
    if not (limit > 0 and factor >= 1):
        raise ValueError(f"--overload needs LIMIT_S > 0 and FACTOR >= 1, got {spec!r}")
    return limit, factor


class ObservingClient(HandleClient):
    """A replay client that keeps, as a device does (`ciar_device.policy.CostObserver.verifier`), a running
    estimate of the verifier's seconds per verify exchange (queue wait + its forwards, from the replies)."""

    def __init__(self, handle, device_id: str):
        from ciar_device.policy import Ewma

        super().__init__(handle, device_id)
        self.verifier = Ewma()

    async def verify(self, request):
        reply = await super().verify(request)
        self.verifier.update(reply.queue_s + reply.cloud_s)
        return reply


async def _point(handle, traces: list, phones: int, args, tag: str, raised: list | None = None) -> dict:
    """One load: `phones` phones replaying `traces` back to back. With `raised` (graceful degradation, --overload),
    a phone whose verifier estimate is past the limit replays its next image from `raised` (CIAR at the raised
    tau) instead; `overloaded_share` counts those images."""
    from ciar.sim.network import NetworkModel
    from ciar.capacity.trace import replay_session

    state = {"measuring": False, "stop": False}
    done: list = []
    degraded: list[bool] = []  # per counted image: made at the raised tau
    later: list[bool] = []  # per counted image: not its phone's first (only a later one can see an estimate)
    past_first: set[int] = set()  # phones with a counted image after their first
    counted = [0] * phones  # images each phone finished or failed inside the window
    errors: list[str] = []
    limit = parse_overload(args.overload)[0] if raised else None

    async def phone(k: int) -> None:
        client = ObservingClient(handle, f"{tag}-phone{k}")
        net = NetworkModel(args.network, seed=1000 * phones + k) if args.network != "none" else None
        n = 0
        while not state["stop"]:
            busy = client.verifier.value
            over = raised is not None and busy is not None and busy > limit
            pool = raised if over else traces
            trace = pool[(k + n * phones) % len(pool)]
            try:
                r = await replay_session(trace, client, f"{tag}-{phones}-{k}-{n}", net, is_lost=_lost)
            except Exception as e:  # noqa: BLE001 - counted, the phone goes on
                errors.append(f"{type(e).__name__}: {e}"[:200])
                r = None
            if state["measuring"]:  # finished inside the window (at full load since warm-up)
                counted[k] += 1
                if r is not None:
                    done.append(r)
                    degraded.append(over)
                    later.append(n > 0)
                    if n > 0:
                        past_first.add(k)
            n += 1

    tasks = [asyncio.ensure_future(phone(k)) for k in range(phones)]
    await asyncio.sleep(args.warmup)
    base = await replica_stats(handle, running_replicas())
    state["measuring"] = True
    t0 = time.perf_counter()
    replicas_seen = [running_replicas()]
    while time.perf_counter() - t0 < args.duration:
        await asyncio.sleep(min(1.0, args.duration - (time.perf_counter() - t0)))
        replicas_seen.append(running_replicas())
    while min(counted) < args.images:  # --images: a count, not the clock, ends the window (a failed image counts)
        for _ in range(10):  # (the replicas read once a second, as above: it blocks the phones' event loop)
            if min(counted) >= args.images:
                break
            await asyncio.sleep(0.1)
        replicas_seen.append(running_replicas())
    state["measuring"] = False
    seconds = time.perf_counter() - t0
    after = await replica_stats(handle, max(replicas_seen[-1], len(base["replicas"])))
    state["stop"] = True
    await asyncio.gather(*tasks)
    lat = [r.latency_s for r in done]
    hist = {k: v - base["batch_size_hist"].get(k, 0) for k, v in after["batch_size_hist"].items()}
    hist = {k: v for k, v in hist.items() if v}
    forwards = after["forwards"] - base["forwards"]
    images = len(done)
    pos = {k: (after["positions_by_kind"][k] - base["positions_by_kind"].get(k, 0)) / images if images else None
           for k in after["positions_by_kind"]}
    padded = after["padded_positions"] - base["padded_positions"]
    real = after["real_positions"] - base["real_positions"]
    return {
        "phones": phones, "images": images, "replicas": {"min": min(replicas_seen), "max": max(replicas_seen)},
        "resumes": sum(r.resumes for r in done), "seconds": seconds, "images_per_s": images / seconds,
        "latency_s": {q: float(np.percentile(lat, int(q[1:]))) if lat else None for q in ("p50", "p95", "p99")},
        "verifier_forwards_per_image": forwards / images if images else None,
        "cloud_passes_per_image": float(np.mean([r.forward_passes for r in done])) if done else None,
        "cloud_requests_per_image": float(np.mean([r.exchanges for r in done])) if done else None,
        "cloud_positions_per_image": pos,
        "batch_size_hist": hist,
        "mean_batch_size": sum(int(k) * v for k, v in hist.items()) / sum(hist.values()) if hist else None,
        "padding": 1.0 - real / padded if padded else None,
        "mismatches": sum(r.mismatches for r in done), "errors": len(errors), "error_samples": errors[:3],
        "overloaded_share": sum(degraded) / len(degraded) if raised is not None and degraded else None,
        "overloaded_images": sum(degraded) if raised is not None else None,
        "images_per_phone": {"min": min(counted), "max": max(counted)},
        "later_images": sum(later), "phones_past_first": len(past_first),
    }


def image_positions(point: dict) -> float | None:
    """Cloud image-token positions per image (spans + decodes + histories; the prefill is the same for both)."""
    pos = point["cloud_positions_per_image"]
    if any(pos.get(k) is None for k in ("span", "decode", "history")):
        return None
    return pos["span"] + pos["decode"] + pos["history"]


def summarize(points: dict[str, list[dict]], slo: float, accelerator: str, setup: dict) -> dict:
    def first(pts, fn):
        vals = [fn(p) for p in pts if p["images"]]
        vals = [v for v in vals if v is not None]
        return vals[0] if vals else None

    phones = {m: phones_at_slo(points[m], slo) for m in points}
    return {
        "slo_p99_s": slo,
        "phones_at_slo": phones,
        "ratio": phones["ciar"] / phones["cloud"] if phones["cloud"] else None,
        "cloud_positions_per_image": {m: first(points[m], image_positions) for m in points},
        "cloud_passes_per_image": {m: first(points[m], lambda p: p["cloud_passes_per_image"]) for m in points},
        "cloud_requests_per_image": {m: first(points[m], lambda p: p["cloud_requests_per_image"]) for m in points},
        "accelerator": accelerator,
        "points": [dict(p, method=m) for m in points for p in points[m]],
        "setup": setup,
    }


def verifier_config(args) -> dict:
    """The Verifier's user_config: serve_config.yaml's, a long idle timeout, `--verifier` JSON on top."""
    import yaml

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve_config.yaml")) as f:
        deployments = yaml.safe_load(f)["applications"][0].get("deployments", [])
    live = next((d.get("user_config", {}) for d in deployments if d["name"] == "Verifier"), {})
    return {**live, "idle_timeout_s": 600, **json.loads(args.verifier)}


def gpu_capacity(traces: dict[str, list], gpus: list[str], loads: list[int], args, argv: list[str]) -> int:
    """`--cost-model gpu:...`: the recorded phones against the modelled GPU replica -> OUT/gpu_capacity.json / .md
    (`argv`: the command's arguments, recorded with the results)."""
    import shlex

    from ciar.capacity.gpu_model import Engine, markdown, plan
    from ciar.results import write_results

    live = verifier_config(args)
    engine = Engine(token_budget=live.get("token_budget", Engine.token_budget),
                    max_works=live.get("max_batch_size", Engine.max_works), overhead_s=args.gpu_overhead_ms / 1e3)
    result = plan(traces, gpus, loads, args.slo_p99_s, args.network, args.duration, args.warmup, engine,
                  extra_gpus=getattr(args, "extra_gpus", None))
    command = "python -m loadtests.capacity " + " ".join(shlex.quote(a) for a in argv)
    result["command"] = command
    write_results(os.path.join(args.out, "gpu_capacity.json"), result, markdown(result, command))
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m, style in zip(METHODS, ("o-", "s--")):
        pts = [p for p in result["points"] if p["method"] == m and p["images"]]
        x = [p["phones"] for p in pts]
        axes[0].plot(x, [p["latency_s"]["p99"] for p in pts], style, label=f"{m} p99")
        axes[0].plot(x, [p["latency_s"]["p50"] for p in pts], style, alpha=0.4, label=f"{m} p50")
        axes[1].plot(x, [p["images_per_s"] for p in pts], style, label=m)
        axes[2].plot(x, [p["mean_batch_size"] for p in pts], style, label=m)
    axes[0].axhline(result["slo_p99_s"], color="k", lw=0.8, ls=":", label="SLO")
    measured = any(p["images"] for p in result["points"] if p["method"] in METHODS)
    for ax, title in zip(axes, ("image latency (s)", "images / s", "works per forward")):
        if measured:
            ax.set_xscale("log", base=2)
        else:  # a log axis without data cannot be drawn: say why the panel is empty
            ax.text(0.5, 0.5, "no image finished inside a measuring window", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8)
        ax.set_xlabel("concurrent phones")
        ax.set_title(title)
        ax.legend(fontsize=8)
    r = result
    fig.suptitle(f"one verifier replica ({r['accelerator']}): phones at p99 <= {r['slo_p99_s']} s: "
                 f"CIAR {r['phones_at_slo']['ciar']}, cloud-only {r['phones_at_slo']['cloud']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from ciar.world_spec import add_world_arguments

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_arguments(ap)
    ap.add_argument("--out", required=True)
    ap.add_argument("--slo-p99-s", type=float, default=5.0, help="image latency SLO (p99, seconds)")
    ap.add_argument("--phones", default="1,2,4,8,16,32", help="loads (concurrent phones), comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="measuring window per load (s)")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--images", type=int, default=0,
                    help="and measure until every phone has this many images in the window (finished or failed): a "
                         "count, whatever this machine's speed (0: the --duration window alone)")
    ap.add_argument("--traces", type=int, default=12, help="recorded images per method")
    ap.add_argument("--network", default="5g")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the recording and of the replica")
    ap.add_argument("--verifier-cpus", type=float, default=1.0)
    ap.add_argument("--verifier", default="{}", help="Verifier user_config as JSON (default: serve_config.yaml's)")
    ap.add_argument("--verifier-replicas", type=int, default=1)
    ap.add_argument("--verifier-autoscaling", default=None,
                    help="Serve autoscaling_config of the Verifier as JSON, e.g. '{\"min_replicas\": 1, "
                         "\"max_replicas\": 2, \"target_ongoing_requests\": 4}': the run then shows replicas "
                         "coming and going under the ramp (sessions moved by the ring are resumed, nothing is lost)")
    ap.add_argument("--cost-model", default="measured",
                    help="'measured': one real Verifier replica on this machine; 'gpu:h100,a100,l4': the GPU MODEL of "
                         "ciar.capacity.gpu_model at LlamaGen-XL shapes, in simulated time (no GPU, no Ray)")
    ap.add_argument("--gpu-overhead-ms", type=float, default=3.0, help="the GPU model's fixed cost per forward")
    ap.add_argument("--gpu-costs", default=None, metavar="GPU_JSON",
                    help="benchmarks.gpu's gpu.json: adds the GPU it measured as 'measured' (--cost-model "
                         "gpu:measured[,h100,...]) with its measured bandwidth, matmul rate and memory, and takes the "
                         "per-forward overhead it fitted (--gpu-path) instead of --gpu-overhead-ms")
    ap.add_argument("--gpu-path", default="graph", choices=("graph", "eager"),
                    help="with --gpu-costs: the measured overhead of CUDA-graph replays or of eager forwards")
    ap.add_argument("--overload", default=None, metavar="LIMIT_S:FACTOR",
                    help="also ramp CIAR phones with graceful degradation: a phone whose estimate of the verifier's "
                         "seconds per exchange is past LIMIT_S makes its next image at tau x FACTOR (recorded too)")
    ap.add_argument("--traces-dir", default=None, help="recorded phones: read from DIR/{ciar,cloud}.pt when there, "
                                                        "else recorded and written there")
    args = ap.parse_args(argv)
    loads = sorted({int(x) for x in args.phones.split(",") if x.strip()})
    if not loads or loads[0] < 1 or args.duration <= 0 or args.traces < 1 or args.images < 0:
        ap.error("--phones must list loads >= 1; --duration > 0; --traces >= 1; --images >= 0")
    gpus = args.cost_model.removeprefix("gpu:").split(",") if args.cost_model.startswith("gpu:") else None
    args.extra_gpus = {}
    if args.gpu_costs:
        from ciar.capacity.gpu_model import measured_gpu

        try:
            with open(args.gpu_costs) as f:
                gpu, overhead = measured_gpu(json.load(f), args.gpu_path)
        except (OSError, ValueError) as e:
            ap.error(f"--gpu-costs {args.gpu_costs}: {e}")
        args.extra_gpus["measured"], args.gpu_overhead_ms = gpu, overhead * 1e3
    if args.cost_model != "measured" and not (gpus and all(g in GPUS or g in args.extra_gpus for g in gpus)):
        ap.error(f"--cost-model is 'measured' or gpu:NAME[,NAME...] with names from {', '.join(GPUS)}")
    try:
        parse_overload(args.overload)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    try:
        traces = record(args)
    except SettingsMismatch as e:  # (--traces-dir recorded with other settings)
        ap.error(str(e))
    if gpus:
        return gpu_capacity(traces, gpus, loads, args, sys.argv[1:] if argv is None else argv)
    from ciar.world import load_world
    from ciar.world_spec import world_from_args as _source

    cost = forward_cost(load_world(_source(args)))
    print(f"forward cost model: a {cost['a_ms_per_forward']:.2f} ms + b {cost['b_ms_per_row']:.3f} ms/row + "
          f"c {cost['c_ms_per_position']:.3f} ms/position (R^2 {cost['r2']:.3f})")

    import ray
    from ray import serve

    from ciar.world_spec import world_from_args
    from services.deploy import deploy_config, patient_serve_env

    live = verifier_config(args)
    patient_serve_env()
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}})
    methods = METHODS + ((OVERLOAD,) if args.overload else ())
    points: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8766})
        world = world_from_args(args)
        scale = {"verifier_autoscaling": json.loads(args.verifier_autoscaling)} if args.verifier_autoscaling else \
            {"verifier_replicas": args.verifier_replicas}
        deploy_config({"world": world, "verifier_num_cpus": args.verifier_cpus, "verifier_threads": args.threads,
                       "verifier_max_sessions": 2 * max(loads) + 4, **scale},
                      import_path="services.app:build_verifier_app", name="capacity", route_prefix=None,
                      user_configs={"Verifier": live})
        handle = serve.get_deployment_handle("Verifier", app_name="capacity")
        live_method = {m: True for m in methods}
        for load in loads:
            for m in methods:
                if not live_method[m]:
                    continue
                p = asyncio.run(_point(handle, traces["ciar" if m == OVERLOAD else m], load, args, m.replace(" ", "-"),
                                       raised=traces[RAISED] if m == OVERLOAD else None))
                points[m].append(p)
                print(json.dumps({"method": m, "phones": load, "images_per_s": round(p["images_per_s"], 3),
                                  "latency_s": p["latency_s"], "mean_batch_size": p["mean_batch_size"],
                                  "mismatches": p["mismatches"], "errors": p["errors"], "resumes": p["resumes"],
                                  "replicas": p["replicas"], "overloaded_share": p["overloaded_share"]}))
                if not p["images"] and not p["errors"]:
                    print(f"{m} at {load} phones: no image finished inside the {args.warmup:g} + {args.duration:g} s "
                          f"window (an image takes longer here): --images N, or a longer --warmup / --duration, "
                          f"measures it",
                          file=sys.stderr)
                if p["latency_s"]["p99"] is None or p["latency_s"]["p99"] > 2 * args.slo_p99_s:
                    live_method[m] = False
    finally:
        serve.shutdown()
        ray.shutdown()
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    result = summarize(points, args.slo_p99_s, accelerator, {
        "loads": loads, "duration_s": args.duration, "warmup_s": args.warmup, "images_per_phone": args.images,
        "traces": args.traces,
        "network": args.network, "verifier_user_config": live, "verifier_cpus": args.verifier_cpus,
        "verifier_replicas": args.verifier_replicas, "verifier_autoscaling": args.verifier_autoscaling and
        json.loads(args.verifier_autoscaling),
        "torch_threads": args.threads, "world": world if isinstance(world, str) or world is None else "inline",
        "recorded_requests_per_image": {m: float(np.mean([1 + len(t.steps) for t in traces[m]])) for m in traces},
        "overload": args.overload,
    })
    result["forward_cost_model"] = cost
    pp, pos = result["cloud_passes_per_image"], result["cloud_positions_per_image"]
    if all(pp[m] is not None and pos[m] is not None for m in METHODS):
        result["modelled_ms_per_image"] = {f"batch_{b}": {m: image_cost_ms(cost, pp[m], pos[m], b) for m in METHODS}
                                           for b in (1, 4, 16, 64)}
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "capacity.png"))
    print(json.dumps({k: result.get(k) for k in ("slo_p99_s", "phones_at_slo", "ratio", "cloud_positions_per_image",
                                                 "cloud_passes_per_image", "modelled_ms_per_image", "accelerator")},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
