"""The verifier's engine core on its own thread vs on the replica's event loop, side by side (issue 37, item 1).

    python -m benchmarks.engine --out benchmarks/results/DATE/engine.json [--devices 16] [--seconds 8] [--reps 3]

The calls the Verifier deployment serves (`ciar.engine.service.VerifierService`, the shipped world's cloud model,
`torch.set_num_threads(1)` as a replica), driven in one asyncio loop the way a replica's loop is:
  load     `--devices` simulated devices, each as fast as it can: OPEN (the calibrated 6 % prefix), then VERIFYs of
           3 locally accepted tokens + a 2-token span (random drafts, uniform draft distributions) until the image's
           144 tokens, CLOSE, again: a saturated engine
  probe    every 10 ms, from another thread (as Serve hands the replica's loop a request), a control call (in turn:
           a CLOSE of a session that is not held, `cost_hint`, `ready`) and its latency, the wait for the loop
           included: how long a platform's health check, a device's close, a WELCOME's hint wait
Each mode runs idle (the probe alone) and loaded, `--reps` times, the modes interleaved (loop, thread, loop, ...) so
both see the same box. Reported: control-call latency p50 / p99 idle and loaded, spans verified per second, and the
ratios. Times are this box's (busy-box figures when anything else runs); the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import time

import torch

MODES = ("loop", "thread")  # AsyncStepper on the caller's loop (before) / EngineThread (after)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)]


async def _run(world, mode: str, devices: int, seconds: float, seed: int) -> dict:
    from ciar.sim.runtime import make_verifier
    from ciar.engine.service import VerifierService, session_token
    from ciar.decoding.sampling import SamplingParams
    from ciar_device.wire import OpenRequest, VerifyRequest

    core = make_verifier(world, max_sessions=max(devices, 1), projector=False)
    service = VerifierService(core, "bench-secret", 0.005, engine_thread=(mode == "thread"))
    n_tokens, vocab = core.config.block_size, core.vocab_size
    sampling = SamplingParams(cfg_scale=world.sampling.cfg_scale if world.sampling else 4.0)
    prefix = math.ceil(0.06 * n_tokens)
    stop = asyncio.Event()
    spans = [0]
    gen = torch.Generator().manual_seed(seed)

    async def device(i: int) -> None:
        image = 0
        while not stop.is_set():
            sid, dev = f"d{i}-{image}", f"dev{i}"
            image += 1
            req = OpenRequest(sid, "a large red circle at the center on a black background", i * 1000 + image,
                              sampling, prefix, want_caption=False)
            reply, token = await service.open(req, session_id=sid, device_id=dev)
            done = len(reply.prefix_tokens)
            while done < n_tokens - 8 and not stop.is_set():
                new = torch.randint(0, vocab, (3,), generator=gen)
                drafts = torch.randint(0, vocab, (2,), generator=gen)
                q = torch.full((2, vocab), 1.0 / vocab, dtype=torch.float16)
                rep = await service.verify(VerifyRequest(sid, new, drafts, q), session_id=sid, device_id=dev,
                                           token=token)
                spans[0] += 1
                done += 3 + rep.num_accepted + 1
            await service.close(session_id=sid, device_id=dev, token=token)

    loop = asyncio.get_running_loop()

    def probe(latencies: dict, halt) -> None:
        """From another thread, as Serve hands a replica's loop a request: submit the call to the loop, wait for
        its answer. The latency includes the wait for the loop to be free (what a step on the loop costs)."""
        ghost = "not-held"
        token = session_token("bench-secret", ghost, "prober")
        calls = {"close": lambda: service.close(session_id=ghost, device_id="prober", token=token),
                 "cost_hint": service.cost_hint, "ready": service.ready}
        i = 0
        while not halt.is_set():
            name = list(calls)[i % len(calls)]
            i += 1
            t = time.perf_counter()
            asyncio.run_coroutine_threadsafe(calls[name](), loop).result(timeout=60)
            latencies.setdefault(name, []).append(1000 * (time.perf_counter() - t))
            time.sleep(0.01)

    out = {}
    for phase in ("idle", "loaded"):
        stop.clear()
        spans[0] = 0
        latencies: dict[str, list[float]] = {}
        halt = threading.Event()
        prober = threading.Thread(target=probe, args=(latencies, halt), daemon=True)
        prober.start()
        tasks = []
        if phase == "loaded":
            tasks += [asyncio.ensure_future(device(i)) for i in range(devices)]
        await asyncio.sleep(1.0 if phase == "loaded" else 0.0)  # warm-up: sessions open, the engine saturates
        spans[0] = 0
        latencies.clear()
        steps0 = core.engine.steps
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        n_spans, n_steps = spans[0], core.engine.steps - steps0
        halt.set()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(prober.join, 10)
        every = [x for v in latencies.values() for x in v]
        out[phase] = {"control_ms_p50": _pct(every, 0.5), "control_ms_p99": _pct(every, 0.99),
                      "control_ms_max": max(every) if every else None, "probes": len(every),
                      "by_call_p50": {k: _pct(v, 0.5) for k, v in latencies.items()},
                      "spans_per_s": n_spans / elapsed if phase == "loaded" else None,
                      "works_per_forward": n_spans / n_steps if phase == "loaded" and n_steps else None,
                      "forwards_per_s": n_steps / elapsed}
    service.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON path (the Markdown is written beside it)")
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default=None, help="a world folder (default: the shipped one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from ciar.world import load_world

    world = load_world(args.weights)
    runs = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            r = asyncio.run(_run(world, mode, args.devices, args.seconds, seed=rep))
            runs[mode].append(r)
            print(json.dumps({"rep": rep, "mode": mode, **{p: {k: (round(v, 2) if isinstance(v, float) else v)
                                                               for k, v in r[p].items() if k != "by_call_p50"}
                                                           for p in r}}), flush=True)

    def med(mode, phase, key):
        xs = [r[phase][key] for r in runs[mode] if r[phase][key] is not None]
        return sorted(xs)[len(xs) // 2] if xs else None

    summary = {m: {"idle_p50_ms": med(m, "idle", "control_ms_p50"), "idle_p99_ms": med(m, "idle", "control_ms_p99"),
                   "loaded_p50_ms": med(m, "loaded", "control_ms_p50"),
                   "loaded_p99_ms": med(m, "loaded", "control_ms_p99"),
                   "spans_per_s": med(m, "loaded", "spans_per_s")} for m in MODES}
    ratio = {"loaded_p99_loop_over_thread": summary["loop"]["loaded_p99_ms"] / summary["thread"]["loaded_p99_ms"],
             "spans_per_s_thread_over_loop": summary["thread"]["spans_per_s"] / summary["loop"]["spans_per_s"]}
    result = {"command": "python -m benchmarks.engine " + " ".join(argv if argv is not None else sys.argv[1:]),
              "devices": args.devices, "seconds": args.seconds, "reps": args.reps, "control_latency_ms": summary,
              "ratios": ratio, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    md = ["# The verifier's engine core: its own thread vs the replica's event loop", "",
          f"`{result['command']}` ({args.devices} saturating devices, {args.seconds:g} s per phase, {args.reps} "
          "reps, modes interleaved; medians over the reps)", "",
          "| engine | control p50 idle | p99 idle | control p50 loaded | p99 loaded | spans/s loaded |",
          "|---|---|---|---|---|---|"]
    for m, label in (("loop", "on the event loop (before: `AsyncStepper`)"),
                     ("thread", "its own thread (`EngineThread`)")):
        s = summary[m]
        md.append(f"| {label} | {s['idle_p50_ms']:.2f} ms | {s['idle_p99_ms']:.2f} ms | {s['loaded_p50_ms']:.2f} ms | "
                  f"{s['loaded_p99_ms']:.2f} ms | {s['spans_per_s']:.1f} |")
    md += ["", f"Loaded control-call p99: loop / thread = ×{ratio['loaded_p99_loop_over_thread']:.1f}; spans/s: "
           f"thread / loop = ×{ratio['spans_per_s_thread_over_loop']:.2f}.", ""]
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
