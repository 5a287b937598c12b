"""Verifier throughput with cross-device span batching vs the same replica forced to batch size 1.

    python -m benchmarks.serving --out serving.json [--sessions 16] [--span 4] [--duration 20] [--weights DIR]
        [--verifier-cpus 2 --verifier-threads 2]
    python -m benchmarks.serving --offline --out verifier_core.json [--sessions 16] [--rounds 40]

Starts Ray Serve in-process with the `Verifier` deployment alone (one replica, the shipped world unless
--weights; session-affine router, as in the application), and drives `--sessions` concurrent device sessions
from the driver: each opens a session (prefix of `--prefix` cloud tokens), then sends verify requests of
`--span` draft tokens back to back (each next request after the previous reply, as a device does) until its
image is full, then opens a new session. Draft tokens are drawn uniformly with a uniform draft distribution, so
the verifier does the full work of a verification (catch-up + span forward with CFG rows, exact acceptance);
what is measured is the verifier's capacity, not a device model.

Two phases on the SAME replica, side by side in one run: batched (`max_batch_size = --sessions`,
`batch_wait_timeout_s = --batch-wait`) and unbatched (`max_batch_size = 1`, switched live with reconfigure).
Each phase warms up for `--warmup` seconds, then counts replies for `--duration` seconds. Output JSON:
  {"batched_spans_per_s", "unbatched_spans_per_s", "ratio", "latency_ms": {"p50", "p99"}, ...}
with the per-span latency percentiles of the batched phase (request sent -> reply received, at that load) and
the replica's batch-size histogram of each phase.

`--offline`: the verifier's core (`ciar.engine.verifier.CloudVerifier`, what the replica wraps) in this process,
no Ray: the same sessions and spans, in rounds that alternate one batched `verify_batch` of all sessions with
the same number of one-session calls, so both see the same cache lengths and machine state. It measures what
batching buys in compute, without Serve's per-request cost and without a load generator sharing the cores.
`--compare-gather` adds a third batched call per round with the keys copied out of the cache per layer (what the
forward did before it read consecutive slots as views), for the ratio of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from unittest import mock

import torch

PROMPTS = ["a small red circle at the top left on a white background",
           "a large blue square at the center on a black background",
           "a green triangle at the bottom on a gray background and a yellow circle at the top"]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


async def _session_loop(h, idx: int, args, vocab: int, n_tokens: int, sampling, stop: dict, out: dict) -> None:
    from ciar.collab.protocol import OpenRequest, VerifyRequest

    gen = torch.Generator().manual_seed(1000 + idx)
    run = 0
    q = torch.full((args.span, vocab), 1.0 / vocab, dtype=torch.float16)
    empty = torch.zeros(0, dtype=torch.long)
    while not stop["done"]:
        sid = f"bench-{args.tag}-{idx}-{run}"
        run += 1
        reply, token = await h.options(session_id=sid).open.remote(OpenRequest(sid, PROMPTS[idx % len(PROMPTS)], idx, sampling, args.prefix,
                                                       want_caption=False), session_id=sid, device_id=f"dev{idx}")
        committed = args.prefix
        try:
            while not stop["done"] and committed + args.span <= n_tokens:
                drafts = torch.randint(0, vocab, (args.span,), generator=gen)
                t0 = time.perf_counter()
                rep = await h.options(session_id=sid).verify.remote(VerifyRequest(sid, empty, drafts, q), session_id=sid,
                                            device_id=f"dev{idx}", token=token)
                dt = time.perf_counter() - t0
                committed += rep.num_accepted + 1
                if stop["measuring"]:
                    out["spans"] += 1
                    out["latency"].append(dt)
        finally:
            await h.options(session_id=sid).close.remote(session_id=sid, device_id=f"dev{idx}", token=token)


async def _phase(h, args, vocab: int, n_tokens: int, sampling) -> dict:
    stop = {"done": False, "measuring": False}
    out = {"spans": 0, "latency": []}
    tasks = [asyncio.ensure_future(_session_loop(h, i, args, vocab, n_tokens, sampling, stop, out))
             for i in range(args.sessions)]
    await asyncio.sleep(args.warmup)
    base = await h.stats.remote()
    stop["measuring"] = True
    t0 = time.perf_counter()
    await asyncio.sleep(args.duration)
    stop["measuring"] = False
    seconds = time.perf_counter() - t0
    after = await h.stats.remote()
    stop["done"] = True
    await asyncio.gather(*tasks)
    hist = {k: v - base["batch_size_hist"].get(k, 0) for k, v in after["batch_size_hist"].items()}
    hist = {k: v for k, v in hist.items() if v}
    forwards = sum(hist.values())
    return {"spans_per_s": out["spans"] / seconds, "spans": out["spans"], "seconds": seconds,
            "latency_ms": {"p50": 1e3 * percentile(out["latency"], 50), "p99": 1e3 * percentile(out["latency"], 99)},
            "batch_size_hist": hist,
            "mean_batch_size": sum(int(k) * v for k, v in hist.items()) / forwards if forwards else None}


def offline(args, weights: str) -> dict:
    """Batched vs one-at-a-time verification on the in-process CloudVerifier, interleaved round by round."""
    from ciar.collab.protocol import OpenRequest, VerifyRequest
    from ciar.engine.verifier import CloudVerifier
    from ciar.world import load_default_world

    torch.set_num_threads(args.verifier_threads)
    world = load_default_world(weights)
    verifier = CloudVerifier(world.cloud, world.text, max_sessions=args.sessions + 2, projector=world.projector)
    vocab, n_tokens = world.cloud.config.vocab_size, world.cloud.config.block_size
    q = torch.full((args.span, vocab), 1.0 / vocab)
    empty = torch.zeros(0, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    ids = [f"bench-{i}" for i in range(args.sessions)]

    def reopen():
        for sid in ids:
            if sid in verifier.sessions:
                verifier.close(sid)
        verifier.open_batch([OpenRequest(sid, PROMPTS[i % len(PROMPTS)], i, world.sampling, args.prefix,
                                         want_caption=False) for i, sid in enumerate(ids)])

    def requests():
        return [VerifyRequest(sid, empty, torch.randint(0, vocab, (args.span,), generator=gen), q) for sid in ids]

    def gathered(slots, batch):  # the forward's key read without zero-copy runs: one gathered copy per layer
        return None if slots is not None else [(0, 0, batch)]

    times = {"batched": [], "unbatched": [], "batched_gather": []}
    spans = 3 if args.compare_gather else 2
    reopen()
    for r in range(args.rounds + 1):  # round 0 warms up
        if not all(len(verifier.sessions[sid].tokens) + spans * (args.span + 1) <= n_tokens for sid in ids):
            reopen()
        t0 = time.perf_counter()
        verifier.verify_batch(requests())
        t1 = time.perf_counter()
        for req in requests():
            verifier.verify_batch([req])
        t2 = time.perf_counter()
        if args.compare_gather:
            with mock.patch("ciar.models.gpt.kv_runs", gathered):
                verifier.verify_batch(requests())
        t3 = time.perf_counter()
        if r:
            times["batched"].append(t1 - t0)
            times["unbatched"].append(t2 - t1)
            if args.compare_gather:
                times["batched_gather"].append(t3 - t2)
    n = args.sessions

    def spans_per_s(key: str) -> float:
        return n * args.rounds / sum(times[key])

    batched, unbatched = spans_per_s("batched"), spans_per_s("unbatched")
    return {
        "mode": "offline",
        "batched_spans_per_s": batched, "unbatched_spans_per_s": unbatched, "ratio": batched / unbatched,
        "latency_ms": {"p50": 1e3 * percentile(times["batched"], 50), "p99": 1e3 * percentile(times["batched"], 99)},
        "unbatched_latency_ms": {"p50": 1e3 * percentile(times["unbatched"], 50) / n,
                                 "p99": 1e3 * percentile(times["unbatched"], 99) / n},
        "note": "latency_ms: one batched verify_batch of all sessions (every span's latency); unbatched: mean "
                "per single-session call within a round",
        **({"batched_gather_spans_per_s": spans_per_s("batched_gather"),
            "runs_vs_gather": sum(times["batched_gather"]) / sum(times["batched"])} if args.compare_gather else {}),
        "setup": {"sessions": n, "span": args.span, "prefix": args.prefix, "rounds": args.rounds, "weights": weights,
                  "cfg_scale": world.sampling.cfg_scale, "torch_threads": args.verifier_threads,
                  "device": str(verifier.device)},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default=None, help="weights folder (default: the shipped weights/scenes-v2)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--span", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=9)
    ap.add_argument("--batch-wait", type=float, default=0.005)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--verifier-cpus", type=float, default=1.0)
    ap.add_argument("--verifier-threads", type=int, default=1, help="torch threads of the verifier replica")
    ap.add_argument("--tag", default="s")
    ap.add_argument("--offline", action="store_true",
                    help="measure the verifier core in this process (no Ray Serve), batched vs one at a time")
    ap.add_argument("--rounds", type=int, default=40, help="--offline: measured rounds (each: 1 batched + N single)")
    ap.add_argument("--compare-gather", action="store_true",
                    help="--offline: also time each round's batch with the keys gathered per layer (the forward "
                         "without zero-copy slot runs), side by side")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.span < 1 or args.duration <= 0 or args.rounds < 1:
        ap.error("--sessions, --span and --rounds must be >= 1 and --duration > 0")
    if args.offline:
        from ciar.world import default_weights_dir

        result = offline(args, os.path.abspath(args.weights) if args.weights else default_weights_dir())
        return _save(result, args.out, ("batched_spans_per_s", "unbatched_spans_per_s", "ratio",
                                        "batched_gather_spans_per_s", "runs_vs_gather"))

    import ray
    from ray import serve

    from ciar.models.checkpoint import read_model_metadata
    from ciar.world import default_weights_dir, sampling_from_extra
    from services.deploy import deploy_config, patient_serve_env

    weights = os.path.abspath(args.weights) if args.weights else default_weights_dir()
    _, cfg, extra = read_model_metadata(os.path.join(weights, "cloud.safetensors"))
    sampling = sampling_from_extra(extra)
    vocab, n_tokens = int(cfg["vocab_size"]), int(cfg["block_size"])

    patient_serve_env()
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8765})

        def deploy(batch: int):  # a config deploy: a user_config change reconfigures the same replica
            deploy_config({"weights_dir": weights, "verifier_num_cpus": args.verifier_cpus,
                           "verifier_threads": args.verifier_threads, "verifier_max_sessions": args.sessions + 2},
                          import_path="services.app:build_verifier_app", name="bench", route_prefix=None,
                          user_configs={"Verifier": {"max_batch_size": batch, "batch_wait_timeout_s": args.batch_wait,
                                                     "idle_timeout_s": 600}})
            return serve.get_deployment_handle("Verifier", app_name="bench")

        h = deploy(args.sessions)
        rid = h.stats.remote().result()["replica_id"]
        batched = asyncio.run(_phase(h, args, vocab, n_tokens, sampling))
        h = deploy(1)  # same replica, reconfigured live (user_config only)
        info = h.stats.remote().result()
        if info["replica_id"] != rid or info["live"]["max_batch_size"] != 1:
            raise RuntimeError(f"reconfigure did not apply to the same replica: {info}")
        args.tag = "u"
        unbatched = asyncio.run(_phase(h, args, vocab, n_tokens, sampling))
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {
        "batched_spans_per_s": batched["spans_per_s"],
        "unbatched_spans_per_s": unbatched["spans_per_s"],
        "ratio": batched["spans_per_s"] / unbatched["spans_per_s"] if unbatched["spans_per_s"] else None,
        "latency_ms": batched["latency_ms"],
        "unbatched_latency_ms": unbatched["latency_ms"],
        "batched": batched, "unbatched": unbatched,
        "setup": {"sessions": args.sessions, "span": args.span, "prefix": args.prefix, "batch_wait_s": args.batch_wait,
                  "duration_s": args.duration, "warmup_s": args.warmup, "weights": weights,
                  "cfg_scale": sampling.cfg_scale, "verifier_cpus": args.verifier_cpus,
                  "torch_threads": args.verifier_threads,
                  "device": "cuda" if torch.cuda.is_available() else "cpu"},
    }
    return _save(result, args.out, ("batched_spans_per_s", "unbatched_spans_per_s", "ratio", "latency_ms"))


def _save(result: dict, path: str, shown: tuple[str, ...]) -> dict:
    """Write the result JSON to `path` and print its headline fields."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in shown if k in result}, indent=2))
    return result


if __name__ == "__main__":
    main()
