"""What sharing a process costs the verifier's engine: its steps on the engine thread under a replica's event loop,
and in a process of its own, beside the same steps driven directly, in one run (the forward stubbed, as
`benchmarks.engine_host` does).

    python -m benchmarks.engine_thread --out benchmarks/results/DATE/engine_thread
    python -m benchmarks.engine_thread --tiny --out /tmp/et       # seconds: the code path, no measurement

A Verifier replica runs its engine on a thread (`ciar.engine.core.EngineThread`) and its event loop beside it: the
loop checks each call's token, builds its work (`CloudVerifier.verify_work`: the structure checks) and hands results
back, while the engine thread steps. Both are Python in one interpreter, so they share one GIL. On an H200
(2026-11-28c-gpu, `capacity_measured`) the saturated CIAR step's host time grew with the phones in the process
(8.8 ms at 256, 13.3 ms at 512) with 64 works a step either way; this measures, on whatever box runs it, how much
of a step is that sharing, and what the engine core in a process of its own (`ciar.engine.process`) gives back:

  direct    the sessions' VERIFYs with no loop and no thread: before each step the sessions answered in the last one
            send their next VERIFY (built outside the timed step), then `engine.step` is timed
  threaded  `phones` sessions, each an asyncio task on the loop that sends a VERIFY (a 4-token span, uniform draft
            distributions, no burst) through a `VerifierService` as soon as its last was answered; the engine on
            its thread, `max_works` works a step; per step, the wall time of `engine.step` (its forward and head
            stubbed: host time); again with the interpreter's switch interval at `--switch-ms`
  process   the same phones through an `EngineProcess`: the core (the same stubbed verifier, built there) steps in
            its own process; per step, the time the core measured around `engine.step`

Reported per phones count: median ms per step and works per step each way, verifies per second, and the ratios
threaded / direct and process / direct (ms per step) and process / threaded (verifies per second). The ratios are
the result (times are this box's; on a 2-core box the process way has one core for the phones and one for the
core, which the other ways share). Denormal numbers are flushed to zero in every way (`--denormals` keeps them), as
`benchmarks.engine_host` does and for its reason: the stub's guided logits make float32 denormals, which the real
models' never do and which cost a CPU ~x10 in their softmax (figures before 2026-11-29b kept them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from benchmarks.engine_host import SHAPES, SPAN, stubbed_verifier


SECRET, DEVICE = "bench-secret", "bench"


def core(vocab: int, sessions: int, max_works: int, seed: int = 0, flush_denormal: bool = False):
    """`benchmarks.engine_host`'s verifier with its forward and head stubbed, `sessions` opened (s0, s1, ...); a
    session near its image's end starts it again when its next VERIFY is built, so phones can verify for ever. The
    process way's core builds it too (`CoreSpec.factory`: with `flush_denormal`, that process flushes denormals)."""
    if flush_denormal:
        import torch

        torch.set_flush_denormal(True)
    v, _, _ = stubbed_verifier(vocab, sessions, max_works, 2 * max_works * (SPAN + 1), seed)
    build = v.verify_work

    def verify_work(request):
        s = v.sessions[request.session_id]
        if len(s.tokens) > v.config.block_size - 2 * (SPAN + 1):  # near the image's end: start it again
            s.tokens[:] = s.tokens[:1]
        return build(request)

    v.verify_work = verify_work
    return v


def _requests(vocab: int, seed: int = 1):
    """-> request(i): phone i's next VERIFY (a 4-token span of random drafts, uniform draft distributions)."""
    import torch

    from ciar_device.wire import VerifyRequest

    q = torch.full((SPAN, vocab), 1.0 / vocab, dtype=torch.float16)
    g = torch.Generator().manual_seed(seed)
    return lambda i: VerifyRequest(f"s{i}", torch.zeros(0, dtype=torch.long),
                                   torch.randint(0, vocab, (SPAN,), generator=g), q, burst=0)


def _timed_steps(v) -> list:
    """Wrap `engine.step`: -> the list it appends (seconds, works in the step) to."""
    steps, real = [], v.engine.step

    def step():
        t0 = time.perf_counter()
        out = real()
        steps.append((time.perf_counter() - t0, v.engine.step_log[-1]["works"] if v.engine.step_log else 0))
        return out

    v.engine.step = step
    return steps


async def _phones(service, phones: int, request, seconds: float, warmup_s: float, counts, steps: list):
    """`phones` asyncio tasks on this loop, each sending its next VERIFY through `service` (a VerifierService or an
    EngineProcess: the token checked, the work built and queued, the reply awaited) as soon as its last was
    answered. -> (verifies per second over the measured window, the steps `steps` got meanwhile)."""
    from ciar.engine.service import session_token

    stop, done = [False], [0]

    async def phone(i: int):
        sid = f"s{i}"
        token = session_token(SECRET, sid, DEVICE)
        while not stop[0]:
            await service.verify(request(i), session_id=sid, device_id=DEVICE, token=token)
            done[0] += 1

    async def window(seconds_: float, count: int | None):
        if count is None:
            await asyncio.sleep(seconds_)
            return
        target = done[0] + count
        while done[0] < target:
            await asyncio.sleep(0.001)

    tasks = [asyncio.create_task(phone(i)) for i in range(phones)]
    await window(warmup_s, counts and counts[0])
    steps.clear()
    d0, t0 = done[0], time.perf_counter()
    await window(seconds, counts and counts[1])
    rate = (done[0] - d0) / (time.perf_counter() - t0)
    measured = list(steps)
    stop[0] = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return rate, measured


def threaded(vocab: int, phones: int, max_works: int, seconds: float, warmup_s: float,
             switch_s: float | None = None, counts: tuple[int, int] | None = None) -> dict:
    """The replica's engine thread (`VerifierService`). `counts` (warm-up verifies, measured verifies): windows
    counted in answers instead of seconds."""
    from ciar.engine.service import VerifierService

    v = core(vocab, phones, max_works)
    steps = _timed_steps(v)
    service = VerifierService(v, SECRET, batch_wait_s=0.0)
    before = sys.getswitchinterval()
    if switch_s:
        sys.setswitchinterval(switch_s)
    try:
        rate, measured = asyncio.run(_phones(service, phones, _requests(vocab), seconds, warmup_s, counts, steps))
    finally:
        sys.setswitchinterval(before)
        service.shutdown()
    return _summary(measured, rate)


def process(vocab: int, phones: int, max_works: int, seconds: float, warmup_s: float,
            counts: tuple[int, int] | None = None, flush_denormal: bool = False) -> dict:
    """The engine core in a process of its own (`ciar.engine.process.EngineProcess`): the phones on this loop, the
    core (the same stubbed verifier, built there) stepping there; each step's time as the core measured it."""
    from ciar.engine.process import CoreSpec, EngineProcess

    steps: list = []
    spec = CoreSpec(factory="benchmarks.engine_thread:core",
                    factory_kwargs={"vocab": vocab, "sessions": phones, "max_works": max_works,
                                    "flush_denormal": flush_denormal})
    engine = EngineProcess(spec, SECRET, batch_wait_s=0.0,
                           on_step=lambda works, spans, sec: steps.append((sec, works)))
    try:
        rate, measured = asyncio.run(_phones(engine, phones, _requests(vocab), seconds, warmup_s, counts, steps))
    finally:
        engine.shutdown()
    return _summary(measured, rate)


def direct(vocab: int, phones: int, max_works: int, seconds: float, warmup_s: float,
           counts: tuple[int, int] | None = None) -> dict:
    v = core(vocab, phones, max_works)
    request = _requests(vocab)
    steps = _timed_steps(v)
    idle = list(range(phones))
    works: dict[int, object] = {}
    done, d0, t0 = 0, None, None
    warm_until = time.perf_counter() + warmup_s
    while True:
        now = time.perf_counter()
        if d0 is None and (now >= warm_until if counts is None else done >= counts[0]):
            steps.clear()
            d0, t0 = done, now
        if d0 is not None and (now >= t0 + seconds if counts is None else done >= d0 + counts[1]):
            break
        for i in idle:
            works[i] = v.engine.submit(v.verify_work(request(i)))
        idle = []
        v.engine.step()
        for i, w in list(works.items()):
            if w.done:
                if w.error is not None:
                    raise w.error
                done += 1
                idle.append(i)
                del works[i]
    return _summary(list(steps), (done - d0) / (time.perf_counter() - t0))


def _summary(steps: list, rate: float) -> dict:
    busy = [(t, n) for t, n in steps if n]
    return {"steps": len(busy), "step_ms": round(1e3 * statistics.median(t for t, _ in busy), 3),
            "works_per_step": round(statistics.mean(n for _, n in busy), 1), "verifies_per_s": round(rate, 1)}


def compare(vocab: int, phones: int, max_works: int, seconds: float, warmup_s: float,
            counts: tuple[int, int] | None = None, reps: int = 1, switch_s: float | None = None,
            flush_denormal: bool = True) -> dict:
    """Every way at one phones count, `reps` times interleaved (every way sees the same box), medians, and the
    ratios: threaded / direct and process / direct (ms per step), process / threaded (verifies per second); with
    `switch_s`, the threaded way again at that switch interval (switch / threaded). `flush_denormal`: every way
    with denormals flushed (this thread, and the threads it starts, for its duration; the core process)."""
    import torch

    torch.set_flush_denormal(flush_denormal)
    try:
        return _compare(vocab, phones, max_works, seconds, warmup_s, counts, reps, switch_s, flush_denormal)
    finally:
        torch.set_flush_denormal(False)  # (the default: a caller in this process goes on as before)


def _compare(vocab, phones, max_works, seconds, warmup_s, counts, reps, switch_s, flush_denormal) -> dict:
    row = {"phones": phones, "max_works": max_works, "reps": reps, "denormals_flushed": flush_denormal}
    ways = {"direct": lambda: direct(vocab, phones, max_works, seconds, warmup_s, counts),
            "threaded": lambda: threaded(vocab, phones, max_works, seconds, warmup_s, counts=counts)}
    if switch_s:
        ways["threaded_switch"] = lambda: threaded(vocab, phones, max_works, seconds, warmup_s, switch_s, counts)
    ways["process"] = lambda: process(vocab, phones, max_works, seconds, warmup_s, counts, flush_denormal)
    runs: dict[str, list] = {way: [] for way in ways}
    for _ in range(reps):
        for way, run in ways.items():
            runs[way].append(run())
    for way, rs in runs.items():
        row[way] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}  # (an even count: a mean)
        if reps > 1:
            row[f"{way}_reps"] = rs
    row["threaded_over_direct"] = round(row["threaded"]["step_ms"] / row["direct"]["step_ms"], 2)
    row["process_over_direct"] = round(row["process"]["step_ms"] / row["direct"]["step_ms"], 2)
    if switch_s:
        row["switch_over_threaded"] = round(row["threaded_switch"]["step_ms"] / row["threaded"]["step_ms"], 2)
    row["process_over_threaded_verifies"] = round(row["process"]["verifies_per_s"] /
                                                  row["threaded"]["verifies_per_s"], 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for engine_thread.json and engine_thread.md")
    ap.add_argument("--phones", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--max-works", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024, choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--switch-ms", type=float, default=0.5)
    ap.add_argument("--verifies", type=int, nargs=2, metavar=("WARMUP", "MEASURED"),
                    help="windows counted in answered verifies instead of seconds")
    ap.add_argument("--reps", type=int, default=1, help="each way this many times, interleaved; medians reported")
    ap.add_argument("--tiny", action="store_true", help="8 phones, 4 works a step, 16 + 64 verifies each way")
    ap.add_argument("--denormals", action="store_true",
                    help="keep the CPU's denormal arithmetic (default: flushed to zero; see the module docstring)")
    args = ap.parse_args(argv)
    if args.tiny:  # (counted, not timed: the same check on any machine)
        args.phones, args.max_works, args.verifies = [8], 4, (16, 64)
    counts = tuple(args.verifies) if args.verifies else None
    rows = []
    for phones in args.phones:
        row = compare(args.vocab, phones, args.max_works, args.seconds, args.warmup_s, counts, args.reps,
                      args.switch_ms / 1000, flush_denormal=not args.denormals)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_thread.json"), "w") as f:
        json.dump({"command": "python -m benchmarks.engine_thread " + " ".join(argv or sys.argv[1:]),
                   "switch_ms": args.switch_ms, "vocab": args.vocab, "rows": rows}, f, indent=1)
    lines = [f"The forward stubbed; vocabulary {args.vocab}; {args.max_works} works a step at most; median ms per "
             f"step of the steps that held works; switch interval {args.switch_ms:g} ms in the last columns; "
             f"medians of {args.reps} interleaved repetitions.", "",
             "| phones | direct ms/step | works/step | threaded ms/step | works/step | process ms/step | works/step | "
             "verifies/s direct | threaded | process | step: threaded / direct | process / direct | "
             "verifies/s: process / threaded | switch ms/step | switch / threaded |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, t, p, s = r["direct"], r["threaded"], r["process"], r["threaded_switch"]
        lines.append(f"| {r['phones']} | {d['step_ms']} | {d['works_per_step']} | {t['step_ms']} | "
                     f"{t['works_per_step']} | {p['step_ms']} | {p['works_per_step']} | {d['verifies_per_s']} | "
                     f"{t['verifies_per_s']} | {p['verifies_per_s']} | ×{r['threaded_over_direct']} | "
                     f"×{r['process_over_direct']} | ×{r['process_over_threaded_verifies']} | {s['step_ms']} | "
                     f"×{r['switch_over_threaded']} |")
    with open(os.path.join(args.out, "engine_thread.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
