"""The verifier engine's host time per step, the forward stubbed: this checkout beside an earlier one, in one run.

    git worktree add /tmp/ciar-before <rev>            # the engine to compare with (any checkout of this project)
    python -m benchmarks.engine_host --before /tmp/ciar-before --out benchmarks/results/DATE/engine_host
    python -m benchmarks.engine_host --tiny --out /tmp/eh   # seconds: one small size, this checkout alone

What a step costs besides its forward: everything the engine does on the host (admission, scheduling, building the
inputs, handing outputs to the works, the judge and sampler, applying the verdicts) and, on a CPU, the judge's and
sampler's own arithmetic. The model's forward and head are replaced by stubs that cost nothing
(`GPT.forward_cached` returns its input; `GPT.logits` returns a view of a pool of random logits), so the step time
is host time. Every checkout runs the same workload through its own `CloudVerifier` and `StepEngine` (public calls
only, present in both): `--sessions` open sessions (CFG: two rows each), then rounds in which every session sends one
VERIFY (3 locally accepted tokens + a 4-token span, uniform float16 draft distributions, cloud burst 2) and the
engine steps until they are all answered: one span step, then burst steps for the spans it rejected. Every spans and
bursts of a round share steps. Each checkout runs in a process of its own, one torch thread, the checkouts
interleaved over `--reps` repetitions so both see the same box. Reported per (vocabulary, sessions): milliseconds per
step and per round (medians over the measured rounds), steps per round, and the ratio before / after. Times are this
box's; the ratios are the result (the docstring of each results file says which box). Where a checkout has the
judge's arithmetic as functions (`_time_the_judges_maths`), their time is measured apart (`engine_maths.md`: per
round, the judge's maths and the rest), which on a CPU is arithmetic a GPU runs on the device.

Each checkout also counts its operations (`count_ops`, `engine_ops.md`): the aten operations of one round's steps,
views and no-op conversions left out, and of those the ones an accelerator would queue (made after the step's
inputs went to the device), in a round as above and in a staggered one whose second step mixes burst tokens and
spans. On this CPU they all run on the host; on an accelerator the queued ones are an eager step's kernel launches,
which set its pace when the rows are few.

Denormal numbers are flushed to zero in both checkouts' processes (`torch.set_flush_denormal`; `--denormals` keeps
them). The stub's logits, guided, span ~130 nats in a row (the shipped world's real ones stayed under 87 in every
row of the image measured, 2026-11-29b), so their softmax makes float32 denormals, which this CPU computes some ×10
slower (an 80 x 1,024 softmax: 0.64 ms against 0.06 ms flushed); a cost of the stub, not of the engine, that the
real workload does not pay and that weighed on both checkouts alike (figures before 2026-11-29b kept it).

A checkout whose engine processes keep the C allocator's freed blocks (`ciar.engine.heap.keep_freed_memory`, from
2026-11-29f on) has them kept in its child too, as served; `--plain-allocator` adds this checkout with the allocator
as it comes (`plainalloc`), so that the setting's share of a change is measured apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

SPAN, CATCH_UP, BURST = 4, 3, 2
# (vocabulary, image tokens, caption positions, sampling): the shipped world's shapes and LlamaGen-XL's
SHAPES = {1024: dict(block=144, cls=16, cfg_scale=4.0, top_k=0),
          16384: dict(block=256, cls=120, cfg_scale=7.5, top_k=1000)}


def stubbed_verifier(vocab: int, sessions: int, max_works: int, pool_rows: int, seed: int = 0):
    """A one-layer CloudVerifier at SHAPES[vocab] whose forward and head cost nothing (STUBS: the forward returns its
    input; the head a view of a pool of `pool_rows` + 512 sharp random logits, rotating through it), `sessions`
    sessions opened, at most `max_works` works a step. -> (verifier, the stubs' state: {"forward_s": seconds spent
    in them}, the generator that made the pool and the captions)."""
    import torch

    try:
        from ciar.engine.scheduler import SchedulerConfig
        from ciar.engine.verifier import CloudVerifier
    except ImportError:  # a checkout from before the engine had a package of its own
        from ciar.collab.scheduler import SchedulerConfig
        from ciar.collab.verifier import CloudVerifier
    from ciar.decoding.sampling import SamplingParams
    from ciar.models.gpt import GPTConfig, build_gpt
    from ciar_device.wire import OpenRequest

    torch.set_num_threads(1)
    shape = SHAPES[vocab]
    cfg = GPTConfig(dim=64, n_layer=1, n_head=2, vocab_size=vocab, cls_token_num=shape["cls"],
                    block_size=shape["block"], caption_dim=32, token_dropout_p=0.0, resid_dropout_p=0.0,
                    ffn_dropout_p=0.0)
    torch.manual_seed(seed)
    cloud = build_gpt(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(pool_rows + 512, vocab, generator=g) * 4.0  # sharp: spans get rejected, bursts follow
    state = {"at": 0, "forward_s": 0.0}

    def forward_stub(cache, h, *args, **kwargs):  # STUB: the forward costs nothing; its output is its input
        return h

    def logits_stub(picked):  # STUB: the head returns a view of the pool, rotating through it
        t0 = time.perf_counter()
        at = state["at"] = (state["at"] + 37) % 512
        out = pool[at:at + picked.shape[0]]
        state["forward_s"] += time.perf_counter() - t0
        return out

    cloud.forward_cached = forward_stub
    cloud.logits = logits_stub
    v = CloudVerifier(cloud, None, max_sessions=sessions,
                      scheduler=SchedulerConfig(token_budget=1 << 20, max_works=max_works, prefill_chunk=1 << 12),
                      static=False)
    sampling = SamplingParams(cfg_scale=shape["cfg_scale"], top_k=shape["top_k"])
    emb = torch.randn(sessions, shape["cls"], 32, generator=g)
    v.open_batch([OpenRequest(f"s{i}", "", i, sampling, 1, want_caption=False) for i in range(sessions)],
                 caption_emb=emb)
    return v, state, g


def _verify(v, i: int, vocab: int, g, q) -> None:
    """Session i's VERIFY of a round (the workload's: CATCH_UP random catch-up tokens, SPAN random drafts sent with
    the uniform distributions `q`, a burst of BURST), submitted."""
    import torch

    from ciar_device.wire import VerifyRequest

    v.submit_verify(VerifyRequest(f"s{i}", torch.randint(0, vocab, (CATCH_UP,), generator=g),
                                  torch.randint(0, vocab, (SPAN,), generator=g), q, burst=BURST))


def measure(vocab: int, sessions: int, rounds: int, seed: int = 0, max_works: int | None = None,
            freeze: bool = False, compiled: bool = False, keep_memory: bool = True) -> dict:
    """In this process, with whatever `ciar` it imports: the workload above -> per-step and per-round times (medians,
    and the steps' mean, p99 and longest), and the collector's pauses in the measured rounds (gen-2 ones apart).
    `max_works`: works a step takes (default: every session's, 2 x sessions); fewer leave the rest in flight.
    `freeze`: the heap frozen once the verifier is built, as an engine's process does (`ciar.engine.heap.freeze`:
    one full collection, then `gc.freeze`). `compiled`: the judge compiled (`Judge(compiled=True)`, its
    compilations made by `Judge.warm` before the first round). `keep_memory`: the C allocator keeps freed blocks, as
    the engine's processes have it (`ciar.engine.heap.keep_freed_memory`, in a checkout that has it)."""
    import torch

    kept = False
    if keep_memory:
        try:
            from ciar.engine.heap import keep_freed_memory
        except ImportError:  # a checkout whose serving processes left the allocator as it was
            pass
        else:
            kept = keep_freed_memory(log=lambda *a: None)

    v, state, g = stubbed_verifier(vocab, sessions, max_works or 2 * sessions, sessions * 2 * (SPAN + 1), seed)
    q = torch.full((SPAN, vocab), 1.0 / vocab, dtype=torch.float16)
    if compiled:
        from ciar.decoding.sampling import SamplingParams
        from ciar.engine.judge import Judge

        v.judge = Judge(v.cloud, compiled=True)
        v.judge.warm(SamplingParams(cfg_scale=SHAPES[vocab]["cfg_scale"], top_k=SHAPES[vocab]["top_k"]), SPAN)
    maths = _time_the_judges_maths(v.judge)
    if freeze:
        gc.collect()
        gc.freeze()
    pauses: list[tuple[int, float]] = []  # (generation, ms) of each collection in the measured rounds
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and measuring:
            pauses.append((info["generation"], 1e3 * (time.perf_counter() - started[0])))

    measuring = False
    gc.callbacks.append(on_gc)
    per_step, per_round, steps_per_round, maths_per_round = [], [], [], []
    for r in range(rounds + 1):  # the first round warms up
        measuring = r > 0
        for i in range(sessions):
            _verify(v, i, vocab, g, q)
        steps, round_s = [], 0.0
        if maths is not None:
            maths["s"] = 0.0
        while v.engine.busy:
            state["forward_s"] = 0.0
            t0 = time.perf_counter()
            v.engine.step()
            dt = time.perf_counter() - t0 - state["forward_s"]
            steps.append(dt)
            round_s += dt
        if r:
            per_step += steps
            per_round.append(round_s)
            steps_per_round.append(len(steps))
            if maths is not None:
                maths_per_round.append(maths["s"])
    gc.callbacks.remove(on_gc)
    t0 = time.perf_counter()
    gc.collect()  # what a full collection in this process costs now (a gen-2 pause)
    full_collect_ms = 1e3 * (time.perf_counter() - t0)
    objects = len(gc.get_objects()) + gc.get_freeze_count()
    if freeze:
        gc.unfreeze()  # (a caller in this process collects as before)
    ops = {}
    if not compiled:  # (not through compiled code: the dispatch mode would be traced)
        ops = count_ops(vocab, sessions, seed)
        ops.update({f"staggered_{k}": x for k, x in count_ops(vocab, sessions, seed, staggered=True).items()})
    ordered = sorted(per_step)
    full = [ms for gen, ms in pauses if gen == 2]
    return {"vocab": vocab, "sessions": sessions, "rounds": rounds, "heap_frozen": freeze, "memory_kept": kept,
            "step_ms": 1e3 * statistics.median(per_step), "round_ms": 1e3 * statistics.median(per_round),
            "steps_per_round": statistics.mean(steps_per_round),
            "maths_ms": 1e3 * statistics.median(maths_per_round) if maths_per_round else None,
            "span_step_ms": 1e3 * statistics.median(per_step[::max(1, round(statistics.mean(steps_per_round)))]),
            "mean_step_ms": 1e3 * statistics.mean(per_step),
            "p99_step_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_step_ms": 1e3 * ordered[-1], "steps": len(per_step),
            "gc_pauses": len(pauses), "gc_pause_ms": sum(ms for _, ms in pauses),
            "gen2_pauses": len(full), "gen2_max_ms": max(full, default=0.0), "full_collect_ms": full_collect_ms,
            "heap_objects": objects, **ops}


# what `count_ops` leaves out: views, aliases and metadata (no data moves), tensors made from host lists, host reads
_NOT_COUNTED = frozenset({"view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "expand",
                          "as_strided", "alias", "t", "transpose", "permute", "split", "unbind", "detach", "detach_",
                          "lift_fresh", "resolve_conj", "resolve_neg", "is_nonzero", "item", "_local_scalar_dense",
                          "result_type"})


def count_ops(vocab: int, sessions: int, seed: int = 0, staggered: bool = False) -> dict:
    """The workload's operations, counted: a fresh verifier, one warm-up round, then one round whose steps run under
    a dispatch mode that counts the aten operations they make (`_NOT_COUNTED` left out, and an out-of-place
    operation that returns its input: a conversion or `contiguous` with nothing to do; in-place ones count).
    `staggered`: in the counted round the second half of the sessions sends its VERIFYs one step after the first, so
    that the round's second step holds the first half's burst tokens beside the second half's spans, as a served
    step mixes them. -> {"ops_per_round", "ops_per_step": [the round's steps'], "device_ops_per_round",
    "device_ops_per_step"}.

    On a CPU every operation runs on the host. On an accelerator the operations on device tensors are the step's
    kernel launches: the `device_` counts are the operations made between a step's host inputs going to the device
    (`HostPack.send`) and the next host read or host packing (`HostRead.values`, a new `HostPack`), what an
    accelerator would queue (on this CPU's dynamic forward path they include its packed index, built there on the
    host). None for a checkout whose steps send nothing that way (the engine before issue 48). The same in any
    checkout: its own engine, this workload."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    phase = {"device": False, "sends": 0}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = self.device = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name in _NOT_COUNTED or (first is not None and out is first and not name.endswith("_")):
                return out  # (an in-place operation returns its input too: it counts)
            self.n += 1
            self.device += phase["device"]
            return out

    try:
        from ciar.engine import transfer
    except ImportError:  # a checkout without the step's transfers: no device phase to tell apart
        transfer = None
    undo = []
    if transfer is not None:
        def mark(cls, name, device: bool, after: bool):
            orig = getattr(cls, name)

            def call(self, *args, **kwargs):
                if not after:
                    phase["device"] = device
                out = orig(self, *args, **kwargs)
                if after:
                    phase["device"] = device
                    phase["sends"] += 1
                return out

            setattr(cls, name, call)
            undo.append((cls, name, orig))

        mark(transfer.HostPack, "send", True, after=True)
        mark(transfer.HostPack, "__init__", False, after=False)
        mark(transfer.HostRead, "values", False, after=False)

    v, _, g = stubbed_verifier(vocab, sessions, 2 * sessions, sessions * 2 * (SPAN + 1), seed)
    q = torch.full((SPAN, vocab), 1.0 / vocab, dtype=torch.float16)
    per_step, on_device = [], []
    try:
        for r in range(2):  # the first round warms up
            later = list(range(sessions // 2, sessions)) if staggered and r else []
            for i in range(sessions):
                if i not in later:
                    _verify(v, i, vocab, g, q)
            while v.engine.busy:
                if not r:
                    v.engine.step()
                    continue
                phase["device"] = False
                with Count() as c:
                    v.engine.step()
                per_step.append(c.n)
                on_device.append(c.device)
                for i in later:  # (after the round's first step)
                    _verify(v, i, vocab, g, q)
                later = []
    finally:
        for cls, name, orig in undo:
            setattr(cls, name, orig)
    device = phase["sends"] > 0  # (a checkout whose steps send nothing that way: no device phase to tell apart)
    return {"ops_per_round": sum(per_step), "ops_per_step": per_step,
            "device_ops_per_round": sum(on_device) if device else None,
            "device_ops_per_step": on_device if device else None}


# the operation counts each run reports, per tree and size (`_step_kinds`)
OPS_KEYS = ("ops_per_round", "device_ops_per_round", "device_span_step", "device_burst_step", "device_mixed_step")


def _step_kinds(r: dict) -> None:
    """A run's operation counts by step: the counted round's span step, its burst steps' median and the staggered
    round's second step (the first half's burst tokens beside the second half's spans); None where not counted."""
    steps, staggered = r.get("device_ops_per_step"), r.get("staggered_device_ops_per_step")
    r["device_span_step"] = steps[0] if steps else None
    r["device_burst_step"] = statistics.median(steps[1:]) if steps and len(steps) > 1 else None
    r["device_mixed_step"] = staggered[1] if staggered and len(staggered) > 1 else None


def _time_the_judges_maths(judge) -> dict | None:
    """Time the judge's arithmetic (probabilities, draws, acceptance) from now on, by wrapping its functions in this
    process: -> {"s": seconds in them}, None for a checkout that has no such functions (the judge before
    2026-11-29d). On a CPU those calls compute; on a GPU they would only queue. The eager judge's functions:
    `ciar.engine.judge._step_math` (every row's probabilities and every uniform of a step, in one pass),
    `_draws_from_probs` and `_spans_from_probs` (from 2026-11-29i), or `_draw_math` and `_span_math` (before). A
    compiled judge's own functions are wrapped on the judge (the wrapper stays outside the compiled code, and the
    module's functions its compiled code calls are left as they are)."""
    try:
        import ciar.engine.judge as module
    except ImportError:
        return None
    eager = [n for n in ("_step_math", "_draws_from_probs", "_spans_from_probs") if callable(getattr(module, n, None))]
    per_path = [n for n in ("_draw_math", "_span_math") if callable(getattr(module, n, None))]
    if not eager and not per_path:
        return None
    spent = {"s": 0.0}

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0
        return call

    compiled = getattr(judge, "compiled", False)
    # the eager path looks its functions up at each call (a checkout with `_step_math` calls `_draw_math` and
    # `_span_math` only compiled)
    for name in (per_path if not eager else [] if compiled else eager):
        setattr(module, name, timed(getattr(module, name)))
    if compiled:
        for name in per_path:
            setattr(judge, name, timed(getattr(judge, name)))
    return spent


def _child(tree: str, vocab: int, sessions: int, rounds: int, denormals: bool = False, freeze: bool = False,
           compiled: bool = False, keep_memory: bool = True) -> dict:
    """One measurement in a fresh process importing `ciar` from `tree` (this file loaded by its path), with the
    CPU's denormal numbers flushed to zero unless `denormals` (see the module docstring), its heap frozen or not, its
    judge compiled or not, its allocator keeping freed blocks (where the tree's engine processes do) or not."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "device")]), OMP_NUM_THREADS="1")
    code = ("import importlib.util, json, sys, torch; sys.path[:0] = [sys.argv[2], sys.argv[2] + '/device']; "
            f"torch.set_flush_denormal({not denormals}); "
            "spec = importlib.util.spec_from_file_location('engine_host', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); import ciar; "
            f"r = m.measure(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), freeze={freeze}, "
            f"compiled={compiled}, keep_memory={keep_memory}); "
            "r['ciar'] = ciar.__file__; "
            "print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, os.path.abspath(__file__), tree, str(vocab), str(sessions),
                          str(rounds)], env=env, cwd="/", capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{tree}: the measurement failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["ciar"].startswith(os.path.join(tree, "ciar")):
        raise RuntimeError(f"{tree}: the child imported ciar from {r['ciar']}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for engine_host.json and engine_host.md")
    ap.add_argument("--before", help="a checkout of an earlier engine to run beside this one")
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 16384], choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="16 sessions, vocabulary 1024, 2 rounds, 1 rep")
    ap.add_argument("--denormals", action="store_true",
                    help="keep the CPU's denormal arithmetic (default: flushed to zero; see the module docstring)")
    ap.add_argument("--heap", action="store_true",
                    help="also run this checkout with its heap frozen (`ciar.engine.heap`): the steps' tails side "
                         "by side (engine_heap.md)")
    ap.add_argument("--compiled-judge", action="store_true",
                    help="also run this checkout with its judge compiled (`Judge(compiled=True)`)")
    ap.add_argument("--plain-allocator", action="store_true",
                    help="also run this checkout with glibc's allocator as it comes (`plainalloc`: freed blocks not "
                         "kept, `ciar.engine.heap.keep_freed_memory` not called)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.sessions, args.vocab, args.rounds, args.reps = [16], [1024], 2, 1
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"after": here}
    if args.before:
        if not os.path.isdir(os.path.join(args.before, "ciar")):
            ap.error(f"--before {args.before}: not a checkout of this project (no ciar/ folder)")
        trees = {"before": os.path.abspath(args.before), "after": here}
    if args.heap:
        trees["frozen"] = here  # this checkout again, its heap frozen
    if args.compiled_judge:
        trees["compiled"] = here  # this checkout again, its judge compiled
    if args.plain_allocator:
        trees["plainalloc"] = here  # this checkout again, the C allocator as it comes
    runs = []
    for vocab in args.vocab:
        for sessions in args.sessions:
            for rep in range(args.reps):
                for name, tree in trees.items():  # interleaved: both see the same box
                    r = _child(tree, vocab, sessions, args.rounds, args.denormals, freeze=name == "frozen",
                               compiled=name == "compiled", keep_memory=name != "plainalloc")
                    _step_kinds(r)
                    r.update(tree=name, rep=rep)
                    runs.append(r)
                    print(f"{name:6s} V={vocab:5d} sessions={sessions:3d} rep {rep}: {r['step_ms']:7.2f} ms/step, "
                          f"{r['round_ms']:8.2f} ms/round, {r['steps_per_round']:.2f} steps/round", flush=True)
    rows = []
    for vocab in args.vocab:
        for sessions in args.sessions:
            def med(name, key):
                xs = [r[key] for r in runs if r["tree"] == name and r["vocab"] == vocab and r["sessions"] == sessions
                      and r.get(key) is not None]  # (maths_ms: None in a checkout without the functions timed)
                return statistics.median(xs) if xs else None

            row = {"vocab": vocab, "sessions": sessions}
            for name in trees:
                for key in ("step_ms", "round_ms", "steps_per_round"):
                    row[f"{name}_{key}"] = med(name, key)
                for key in ("mean_step_ms", "p99_step_ms", "max_step_ms", "gen2_pauses", "gen2_max_ms",
                            "full_collect_ms", "maths_ms", *OPS_KEYS):
                    row[f"{name}_{key}"] = med(name, key)
            if "before" in trees:
                row["step_ratio"] = row["before_step_ms"] / row["after_step_ms"]
                row["round_ratio"] = row["before_round_ms"] / row["after_round_ms"]
                if "compiled" in trees:
                    row["compiled_step_ratio"] = row["before_step_ms"] / row["compiled_step_ms"]
                    row["compiled_round_ratio"] = row["before_round_ms"] / row["compiled_round_ms"]
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_host.json"), "w") as f:
        json.dump({"command": "python -m benchmarks.engine_host " + " ".join(argv or sys.argv[1:]),
                   "denormals_flushed": not args.denormals, "trees": trees, "rows": rows, "runs": runs}, f, indent=1)
    lines = ["| vocabulary | sessions | " + " | ".join(
        f"{n} ms/step | {n} ms/round | {n} steps/round" for n in trees) +
        (" | step ×less | round ×less |" if "before" in trees else " |") +
        (" compiled step ×less | compiled round ×less |" if {"before", "compiled"} <= set(trees) else ""),
        "|---|---|" + "---|---|---|" * len(trees) + ("---|---|" if "before" in trees else "") +
        ("---|---|" if {"before", "compiled"} <= set(trees) else "")]
    for r in rows:
        cells = [str(r["vocab"]), str(r["sessions"])]
        for n in trees:
            cells += [f"{r[f'{n}_step_ms']:.2f}", f"{r[f'{n}_round_ms']:.1f}", f"{r[f'{n}_steps_per_round']:.2f}"]
        if "before" in trees:
            cells += [f"×{r['step_ratio']:.1f}", f"×{r['round_ratio']:.1f}"]
        if "compiled_step_ratio" in r:
            cells += [f"×{r['compiled_step_ratio']:.1f}", f"×{r['compiled_round_ratio']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    with open(os.path.join(args.out, "engine_host.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    split = [n for n in trees if all(r.get(f"{n}_maths_ms") is not None for r in rows)]
    if split:  # where the round goes: the judge's arithmetic (on a GPU, the device's) and the rest (the host's)
        maths = ["| vocabulary | sessions | " + " | ".join(
            f"{n} ms/round | {n} judge maths ms/round | {n} rest ms/round" for n in split) + " |",
            "|---|---|" + "---|---|---|" * len(split)]
        for r in rows:
            cells = [str(r["vocab"]), str(r["sessions"])]
            for n in split:
                cells += [f"{r[f'{n}_round_ms']:.1f}", f"{r[f'{n}_maths_ms']:.1f}",
                          f"{r[f'{n}_round_ms'] - r[f'{n}_maths_ms']:.1f}"]
            maths.append("| " + " | ".join(cells) + " |")
        with open(os.path.join(args.out, "engine_maths.md"), "w") as f:
            f.write("\n".join(maths) + "\n")
        print("\n".join(maths))
    counted = [n for n in trees if all(r.get(f"{n}_ops_per_round") is not None for r in rows)]
    if counted:  # operations a step (`count_ops`): what an eager step launches on an accelerator, counted here
        both = {"before", "after"} <= set(counted)
        ops = ["| vocabulary | sessions | " + " | ".join(
            f"{n} device ops: span / burst / mixed step, a round | {n} all ops a round" for n in counted) +
            (" | all ops ×fewer | device ops ×fewer |" if both else " |"),
            "|---|---|" + "---|---|" * len(counted) + ("---|---|" if both else "")]

        def cell(x) -> str:
            return "–" if x is None else f"{x:g}"

        for r in rows:
            cells = [str(r["vocab"]), str(r["sessions"])]
            for n in counted:
                cells += [" / ".join(cell(r[f"{n}_{k}"]) for k in ("device_span_step", "device_burst_step",
                                                                     "device_mixed_step")) +
                          f", {cell(r[f'{n}_device_ops_per_round'])}", cell(r[f"{n}_ops_per_round"])]
            if both:
                cells.append(f"×{r['before_ops_per_round'] / r['after_ops_per_round']:.1f}")
                dev = (r["before_device_ops_per_round"], r["after_device_ops_per_round"])
                cells.append("–" if None in dev else f"×{dev[0] / dev[1]:.2f}")
            ops.append("| " + " | ".join(cells) + " |")
        with open(os.path.join(args.out, "engine_ops.md"), "w") as f:
            f.write("\n".join(ops) + "\n")
        print("\n".join(ops))
    if args.heap:  # the tails: each cell the median over the repetitions
        heap = ["| vocabulary | sessions | " + " | ".join(
            f"{n} mean ms | {n} p99 ms | {n} max ms | {n} gen-2 pauses | {n} longest gen-2 ms | {n} full collection ms"
            for n in trees) + " |",
            "|---|---|" + "---|---|---|---|---|---|" * len(trees)]
        for r in rows:
            cells = [str(r["vocab"]), str(r["sessions"])]
            for n in trees:
                cells += [f"{r[f'{n}_mean_step_ms']:.2f}", f"{r[f'{n}_p99_step_ms']:.2f}",
                          f"{r[f'{n}_max_step_ms']:.1f}", f"{r[f'{n}_gen2_pauses']:g}",
                          f"{r[f'{n}_gen2_max_ms']:.1f}", f"{r[f'{n}_full_collect_ms']:.1f}"]
            heap.append("| " + " | ".join(cells) + " |")
        with open(os.path.join(args.out, "engine_heap.md"), "w") as f:
            f.write("\n".join(heap) + "\n")
        print("\n".join(heap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
