"""Capacity measured: phones per accelerator with the real verifier engine, and the capacity model beside it.

    python -m benchmarks.gpu --sections env,roofline,served_steps,capacity_measured --out DIR   # on a GPU
    python -m benchmarks.engine_capacity --record benchmarks/traces     # re-record the carried phones (CPU, ~30 s)
    python -m benchmarks.engine_capacity --refit RUN/gpu.json [--costs-from A/gpu.json B/gpu.json] [--out DIR]
        # the capacity model beside a GPU run's measured capacity, on any machine (`predict`, `refit_run`)

The GPU suite's `capacity_measured` section (issue 48, item 5). What runs is what a Verifier replica runs: a
`CloudVerifier` (the KV cache sized from the accelerator's memory, static buckets, every CUDA graph captured at
start-up, serve_config.gpu.yaml's scheduler: 64 works, 16,384 positions, 120-position prefill chunks) stepped by its own
`EngineThread` (3 ms batch wait; the process's heap frozen once it is built, as the replica's is: `ciar.engine.heap`,
undone after the section), at LlamaGen-XL's shapes with RANDOM weights (the suite builds no checkpoint) and a random
interval projector of the XL width. The phones are trace-driven (`ciar.capacity.trace.replay_session`): sessions
recorded on a CPU with the shipped scenes world (`benchmarks/traces/`, CIAR at its calibrated point and cloud-only, 12
images each, 144 image tokens), replayed back to back with their recorded device compute slept and every message over a
seeded simulated link. Random weights would decide other tokens and end the recorded course, so the recorded decisions
are given (`ciar.capacity.trace.RecordedVerdicts`): the judge's own batched pass still runs on every step's real logits
(what a step costs), then its outcome is replaced by the recorded one. The draft distributions are padded with zeros
from the scenes world's 1,024 codes to the model's vocabulary (what an XL device would send: [k, 16384] float16 per
span); the messages' simulated bytes are counted at that width.

Not in the measured replica: the caption encoder (captions arrive as random embeddings: flan-t5-xl's encoder would
add one forward per open), session resumes (one replica), the Ingress and the device endpoint.

Per load point (phones at once, `warmup_s` then a window of `duration_s`; the images finishing inside it count):
images/s, image latency p50 / p95 / p99, cloud passes and requests per image, engine steps and mean works per step,
pieces per step by kind, forwards per step and their padding (`ModelRunner.positions`), the share of the window the
engine thread spent stepping and each step split into forward, judge and host milliseconds (`StepSplit`: one step in
`SPLIT_EVERY` timed to device syncs), replay mismatches (0: every reply equalled the recording) and errors. On CUDA
the engine serves the fused step, as `serve_config.gpu.yaml` does (`verifier_fused_step`). A method's ramp stops
once its p99 passes twice the SLO. Headline: images/s at saturation (the largest
measured) and phones at the p99 SLO, per method; beside each point the capacity model's prediction for the same
phones, link and window (`ciar.capacity.gpu_model.simulate`: the measured roofline, the same session slots and
scheduler), its steps priced (a) by the roofline with the model's default overhead (3 ms a forward), (b) with that
overhead refit on the served path with host time: the median of the served step minus its modelled forward
(`served_steps`) plus the judge's and the host's milliseconds per step (`engine_graphs`, graphs), and (c) as the
served engine runs a step (`served_costs`: its forwards padded to the buckets and priced from `served_steps`, the
judge and host once a step); measured / predicted per point. `--refit` prices the same from a written result.

The suite's `capacity_process` section runs each method's last load again with the engine core in a process of its
own (`ciar.engine.process`, as `verifier_engine_process` serves it; `measure_process`): the same replica built in
the core (`process_core`: one core replays both methods' recorded verdicts, their seeds `SEED_STRIDE` apart), the
same phones on the suite's loop, each call through the core's socket; images/s and latency beside the thread's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import threading
import time

import numpy as np
import torch

from ciar.engine.scheduler import KINDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(REPO, "benchmarks", "traces")
METHODS = ("ciar", "cloud")
# the parallel-decoding phones (a suite section of their own): cloud-only by speculative Jacobi decoding, and CIAR
# at its calibrated point with its prefix and bursts by windows of JACOBI_WINDOW
PARALLEL_METHODS = ("sjd", "ciar_jacobi")
JACOBI_WINDOW = 16
SLO_P99_S = 5.0  # loadtests.capacity's default image-latency SLO
NETWORK = "5g"
SPLIT_EVERY = 8  # a load's steps: one in this many is timed to device syncs (StepSplit), the rest run as served
PROFILE_STEPS = 8  # a load's steps under torch.profiler, in the middle of its warm-up (StepProfile)
# The engine thread shares the GIL with the phones' loop; at each device sync it lets go, and Python hands it back
# only after the other thread has run its switch interval (5 ms by default). On the H200 a saturated CIAR step's host
# time grew with the phones in the process (8.8 ms at 256, 13.3 at 512; 2026-11-28c-gpu): each method's last load
# runs once more with this interval, to see whether that is the cause
SWITCH_S = 0.0005


def load_traces_dir(folder: str = TRACES, methods: tuple[str, ...] = METHODS) -> dict[str, list]:
    from ciar.capacity.trace import load_traces

    return {m: load_traces(os.path.join(folder, f"{m}.pt")) for m in methods}


def widened(trace, vocab_size: int):
    """The trace as a device of a `vocab_size`-code model would send it: draft distributions padded with zeros
    (the recorded codes keep their probabilities), bytes counted at that width."""
    if vocab_size < trace.vocab_size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than the traces' ({trace.vocab_size})")
    pad = vocab_size - trace.vocab_size

    def wide(r):
        probs = np.asarray(r.draft_probs)
        return dataclasses.replace(r, draft_probs=np.pad(probs, ((0, 0), (0, pad))) if pad else probs)

    return dataclasses.replace(trace, vocab_size=vocab_size,
                               steps=[dataclasses.replace(s, request=wide(s.request)) for s in trace.steps])


def random_caption(verifier):
    """-> caption(request): a seeded random caption embedding [cls, caption_dim] per open (the measured replica
    runs no caption encoder), on the verifier's device and in its dtype."""
    c = verifier.config
    dtype = verifier.cloud.tok_embeddings.weight.dtype

    def caption(request) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(request.seed))
        return torch.randn(c.cls_token_num, c.caption_dim, generator=g).to(verifier.device, dtype)

    return caption


class StepSplit:
    """Where an engine's steps' time goes: the forwards (`runner.execute_step`), the judge and sampler
    (`judge.launch`: its device work; the host read after it is then instant) and the rest (the host: admission,
    scheduling, inputs, applying the decisions), each timed to a device sync (`sync`; the forward's and the judge's
    calls are wrapped, a step is `engine.step`). Measures only while `on`, and then one step in `every`: the syncs
    cost what the judge's launch would have overlapped with the forward, so a load whose throughput is measured too
    samples its steps (the 2026-11-28c H200 run timed every step of the window and made 26-29 % fewer images/s than
    the run before it)."""

    def __init__(self, v, sync, every: int = 1):
        self.v, self.sync, self.on, self.every = v, sync, False, every
        self.t = {"step": [], "forward": [], "judge": []}
        self._seen, self._timing, self.total = 0, False, 0.0  # total: every measured-window step, unsynced
        self.real = (v.runner.execute_step, v.judge.launch, v.engine.step)
        v.runner.execute_step = self._wrap("forward", self.real[0])
        v.judge.launch = self._wrap("judge", self.real[1])
        v.engine.step = self._wrap("step", self.real[2])

    def _wrap(self, name, fn):
        def timed(*a, **k):
            if name == "step" and self.on:
                self._timing = self._seen % self.every == 0
                self._seen += 1
                t0 = time.perf_counter()
                try:
                    return self._timed(name, fn, *a, **k) if self._timing else fn(*a, **k)
                finally:
                    self.total += time.perf_counter() - t0
                    self._timing = False
            return self._timed(name, fn, *a, **k) if self._timing else fn(*a, **k)
        return timed

    def _timed(self, name, fn, *a, **k):
        self.sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.sync()
            self.t[name].append(time.perf_counter() - t0)

    def remove(self) -> None:
        self.v.runner.execute_step, self.v.judge.launch, self.v.engine.step = self.real
        self.on = False

    @property
    def seconds(self) -> float:
        """Seconds spent inside the steps taken while `on` (every one, sampled or not)."""
        return self.total

    def report(self) -> dict:
        steps = len(self.t["step"])
        if not steps:
            return {}
        per = {k: 1e3 * sum(v) / steps for k, v in self.t.items()}
        return {"steps": steps, "step": round(per["step"], 3), "forward": round(per["forward"], 3),
                "judge": round(per["judge"], 3),
                "host": round(per["step"] - per["forward"] - per["judge"], 3),
                "accelerator_busy_upper_bound": round((per["forward"] + per["judge"]) / per["step"], 3),
                # the mean of a few timed steps moves with any one slow step: the same engine_graphs judge's mean
                # read 1.9, 2.3 and 7.9 ms in three H200 processes (2026-11-28c); the medians beside it
                "median": {k: round(1e3 * float(np.median(v)), 3) for k, v in self.t.items() if v}}


STEP_MARK = "ciar.engine.step"  # StepProfile's range around each profiled step


def device_sync(v) -> None:
    """Wait for what verifier `v` queued on its accelerator (nothing to wait for on a CPU)."""
    if v.device.type == "cuda":
        torch.cuda.synchronize()


def _add(table: dict, name: str, us: float) -> None:
    n = table.setdefault(name[:80].replace("|", "/"), [0, 0.0])  # (a markdown cell)
    n[0] += 1
    n[1] += us


class StepProfile:
    """torch.profiler over `steps` consecutive engine steps of a load, from the first step that starts `after_s`
    after the load's first step (on the engine's own thread: `engine.step` is wrapped, as `StepSplit` wraps it):
    each step's wall time (to a device sync), its kernels' time on the accelerator (on a CPU: the top-level
    operators' time, every thread's) and the largest of them by name, per step: what a loaded step's judge and
    host time are made of (on the 2026-11-29 H200 a saturated CIAR step took 36 ms, 5.6 of them judge and 13.7
    host). The profiler's own costs are in the wall time; the point's measured window (after its warm-up) is not
    profiled when `after_s` and the steps end within the warm-up."""

    def __init__(self, v, steps: int = PROFILE_STEPS, after_s: float = 0.0, top: int = 12):
        self.v, self.top, self.after_s = v, top, after_s
        self.prof, self.left, self.wall, self.done, self.at = None, steps, 0.0, 0, None
        self.lock = threading.Lock()  # (the engine's thread profiles; the point's ends it, maybe mid-step)
        self.real = v.engine.step
        v.engine.step = self._step

    def _step(self, *a, **k):
        from torch.profiler import ProfilerActivity, profile

        if self.at is None:
            self.at = time.monotonic() + self.after_s  # (the first step: the point has started)
        with self.lock:
            if self.prof is None and self.left and time.monotonic() >= self.at:
                cuda = self.v.device.type == "cuda"
                self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
                self.prof.__enter__()
            profiled = self.prof is not None and self.left > 0
        if not profiled:
            return self.real(*a, **k)
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(STEP_MARK):  # (the step's own operators are its children)
                return self.real(*a, **k)
        finally:
            device_sync(self.v)
            with self.lock:
                if self.left > 0:  # (not ended by `remove` meanwhile)
                    self.wall += time.perf_counter() - t0
                    self.done += 1
                    self.left -= 1
                    if not self.left:
                        self.prof.__exit__(None, None, None)

    def remove(self) -> dict:
        """Unwrap the engine's step and summarise -> {} when no step was profiled."""
        self.v.engine.step = self.real
        with self.lock:
            if self.prof is None:
                return {}
            if self.left:  # (the point ended first)
                self.left = 0
                self.prof.__exit__(None, None, None)
        cuda = self.v.device.type == "cuda"
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        by_name: dict[str, list] = {}  # the accelerator's kernels (on a CPU: the top-level operators)
        host: dict[str, list] = {}  # the host side: the operators the step called itself, inclusive of theirs
        marks = 0.0
        for e in self.prof.events():
            top_level = e.cpu_parent is None or e.cpu_parent.name == STEP_MARK  # (on a CPU: the operators' own)
            if e.device_type == kind and e.name != STEP_MARK and (cuda or top_level):
                _add(by_name, e.name, e.time_range.elapsed_us())
            if e.name == STEP_MARK:
                marks += e.cpu_time_total
            elif e.cpu_parent is not None and e.cpu_parent.name == STEP_MARK:
                _add(host, e.name, e.cpu_time_total)
        per = max(self.done, 1)

        def top(table: dict) -> list:
            return [{"name": n, "per_step": round(c / per, 2), "ms_per_step": round(us / 1e3 / per, 3)}
                    for n, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:self.top]]

        in_ops = sum(x[1] for x in host.values())
        return {"steps": self.done, "wall_ms_per_step": round(1e3 * self.wall / per, 3),
                "what": "kernels" if cuda else "top-level operators",
                "per_step": round(sum(x[0] for x in by_name.values()) / per, 1),
                "busy_ms_per_step": round(sum(x[1] for x in by_name.values()) / 1e3 / per, 3), "top": top(by_name),
                # the step's host time: in the operators it called (each with what they called), and the rest
                # (Python: the engine's own bookkeeping, the judge's packing, waits outside an operator)
                "host_ops_ms_per_step": round(in_ops / 1e3 / per, 3),
                "host_python_ms_per_step": round((marks - in_ops) / 1e3 / per, 3), "host_top": top(host)}


class EngineProbe:
    """What a load point reads of an engine in this process (its scheduler's and runner's counters, `StepSplit`)."""

    def __init__(self, client):
        self.v, self.core = client.verifier, client.stepper

    def start(self) -> None:
        sched, runner = self.v.engine.scheduler, self.v.runner
        self.base = (sched.steps, sched.real_positions, sched.padded_positions, runner.positions["fed"],
                     runner.positions["computed"], sum(runner.steps.values()))
        self.stepping = StepSplit(self.v, lambda: device_sync(self.v), every=SPLIT_EVERY)
        self.stepping.on = True

    def stop(self, seconds: float) -> dict:
        self.stepping.remove()
        sched, runner, base = self.v.engine.scheduler, self.v.runner, self.base
        steps = sched.steps - base[0]
        real, padded = sched.real_positions - base[1], sched.padded_positions - base[2]
        fed, computed = runner.positions["fed"] - base[3], runner.positions["computed"] - base[4]
        forwards = sum(runner.steps.values()) - base[5]
        log = sched.step_log[-min(steps, len(sched.step_log)):] if steps else []
        kinds = {k: float(np.mean([s["kinds"].count(k) for s in log])) for k in KINDS} if log else None
        return {
            "steps": steps, "steps_per_s": steps / seconds if seconds else None,
            "mean_works_per_step": float(np.mean([s["works"] for s in log])) if log else None,
            "mean_rows_per_step": float(np.mean([s["rows"] for s in log])) if log else None,
            # of the positions the forwards computed, the share that was padding (rows and widths up to the
            # buckets); `padding_one_width`: had every step been one forward padded to its widest piece
            "padding": 1.0 - fed / computed if computed else None,
            "padding_one_width": 1.0 - real / padded if padded else None,
            "forwards_per_step": forwards / steps if steps else None,
            "pieces_per_step": kinds,  # (the scheduler's last STEP_LOG steps of the window)
            "ms_per_step": self.stepping.report(),  # forward, judge and host, each timed to a device sync
            "engine_stepping": self.stepping.seconds / seconds if seconds else None}

    async def close_all(self) -> None:
        v = self.v
        self.core.call(lambda: [v.close(sid) for sid in list(v.sessions)])  # the cancelled phones', on its thread
        await self.core.settled()


class ProcessProbe:
    """What a load point reads of an engine in its own process: the steps it reported (`EngineProcess.on_step`:
    works, seconds around `engine.step`, as the core measured them)."""

    def __init__(self, client):
        self.client, self.on, self.steps = client, False, []
        client.engine.on_step = lambda works, spans, sec: self.on and self.steps.append((works, sec))

    def start(self) -> None:
        self.steps.clear()
        self.on = True

    def stop(self, seconds: float) -> dict:
        self.on = False
        busy = [(n, sec) for n, sec in self.steps if n]
        return {"steps": len(busy), "steps_per_s": len(busy) / seconds if seconds else None,
                "mean_works_per_step": float(np.mean([n for n, _ in busy])) if busy else None,
                "ms_per_step": {"step": round(1e3 * float(np.median([sec for _, sec in busy])), 3)} if busy else None,
                "engine_stepping": sum(sec for _, sec in busy) / seconds if seconds else None}

    async def close_all(self) -> None:
        for sid in list(self.client.tokens):
            await self.client.close(sid)


class ProcessClient:
    """The replay interface (open / verify / resume / close) over an `EngineProcess`, as a device's calls reach a
    Verifier replica: each session's token kept from its open."""

    DEVICE = "capacity-phone"

    def __init__(self, engine):
        self.engine, self.tokens = engine, {}

    async def open(self, request):
        reply, self.tokens[request.session_id] = await self.engine.open(request, session_id=request.session_id,
                                                                        device_id=self.DEVICE)
        return reply

    async def verify(self, request):
        return await self.engine.verify(request, session_id=request.session_id, device_id=self.DEVICE,
                                        token=self.tokens[request.session_id])

    async def resume(self, request, history, injected=None):
        return await self.engine.resume(request, history, injected, session_id=request.session_id,
                                        device_id=self.DEVICE, token=self.tokens[request.session_id])

    async def close(self, session_id: str) -> None:
        token = self.tokens.pop(session_id, None)
        if token is not None:
            await self.engine.close(session_id=session_id, device_id=self.DEVICE, token=token)


async def point(client, traces: list, phones: int, warmup_s: float, duration_s: float, network: str = NETWORK,
                images: int | None = None, tag: str = "p", probe=None) -> dict:
    """One load: `phones` phones replaying `traces` back to back (phone k starts at trace k), for `warmup_s` and a
    window that ends after `duration_s` or, with `images`, as soon as that many images finished inside it (a
    count: what a test asks for on any machine; `duration_s` is then a hang guard). Phones still working at its
    end are cancelled (their works withdrawn) and every session left open is closed. `probe`: what reads the
    engine's counters (default: `EngineProbe`, the engine in this process)."""
    from ciar.sim.network import NetworkModel
    from ciar.capacity.trace import replay_session

    probe = probe or EngineProbe(client)
    state = {"measuring": False}
    done, errors = [], []
    enough = asyncio.Event()

    async def phone(k: int) -> None:
        net = NetworkModel(network, seed=1000 * phones + k) if network != "none" else None
        n = 0
        while True:
            trace = traces[(k + n * phones) % len(traces)]
            try:
                r = await replay_session(trace, client, f"{tag}-{phones}-{k}-{n}", net)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - counted, the phone goes on
                errors.append(f"{type(e).__name__}: {e}"[:200])
                r = None
            n += 1
            if r is not None and state["measuring"]:
                done.append(r)
                if images is not None and len(done) >= images:
                    enough.set()

    tasks = [asyncio.ensure_future(phone(k)) for k in range(phones)]
    await asyncio.sleep(warmup_s)
    probe.start()
    state["measuring"] = True
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(enough.wait(), duration_s)
    except asyncio.TimeoutError:
        pass
    seconds = time.perf_counter() - t0
    state["measuring"] = False
    engine = probe.stop(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await probe.close_all()
    lat = [r.latency_s for r in done]
    n_img = len(done)
    return {
        "phones": phones, "images": n_img, "seconds": round(seconds, 2),
        "images_per_s": n_img / seconds if seconds else None,
        "latency_s": {q: float(np.percentile(lat, int(q[1:]))) if lat else None for q in ("p50", "p95", "p99")},
        "cloud_passes_per_image": float(np.mean([r.forward_passes for r in done])) if done else None,
        "cloud_requests_per_image": float(np.mean([r.exchanges for r in done])) if done else None,
        **engine,
        "mismatches": sum(r.mismatches for r in done), "errors": len(errors), "error_samples": errors[:3],
    }


def refit_overhead_s(sections: dict, shapes, gpu) -> dict | None:
    """The per-forward overhead refit on the served path with host time: median(served step - modelled forward)
    over `served_steps`, plus the judge's and the host's ms per step of `engine_graphs` (graphs, else static)."""
    from ciar.capacity.gpu_model import overhead_gaps

    steps = (sections.get("served_steps") or {}).get("steps") or []
    eg = sections.get("engine_graphs") or {}
    split = (eg.get("graphs") or eg.get("static") or {}).get("ms_per_step_after_warmup") or {}
    if not steps or not split:
        return None
    gaps = overhead_gaps(gpu, shapes, steps, "served_ms")
    forward_gap = gaps[len(gaps) // 2]
    host = (split["judge"] + split["host"]) / 1000
    return {"overhead_s": max(0.0, forward_gap) + host, "forward_gap_s": forward_gap, "judge_and_host_s": host}


def served_costs(sections: dict):
    """Step costs of the served engine from a GPU run (`ciar.capacity.gpu_model.ServedCosts`): a forward's
    milliseconds against its padded positions (rows bucket x width bucket), least squares over `served_steps`' timed
    buckets, and the judge's and host's milliseconds per step of `engine_graphs` (graphs, else static; from the
    medians where the run has them: the host as the median step less the median forward and judge). -> ServedCosts,
    or None when a section it needs is missing."""
    from ciar.capacity.gpu_model import ServedCosts

    steps = [s for s in (sections.get("served_steps") or {}).get("steps") or [] if "served_ms" in s and s.get("bucket")]
    eg = sections.get("engine_graphs") or {}
    split = (eg.get("graphs") or eg.get("static") or {}).get("ms_per_step_after_warmup") or {}
    if len(steps) < 2 or "judge" not in split:
        return None
    med = split.get("median") or {}
    if {"step", "forward", "judge"} <= med.keys():  # the medians' judge, and the host as what the step's median leaves
        judge, host = med["judge"], max(0.0, med["step"] - med["forward"] - med["judge"])
    else:
        judge, host = split["judge"], split["host"]
    x = np.array([[1.0, s["bucket"][0] * s["bucket"][1]] for s in steps])
    (a, b), *_ = np.linalg.lstsq(x, np.array([s["served_ms"] / 1e3 for s in steps]), rcond=None)
    return ServedCosts(float(a), float(b), (judge + host) / 1e3, 0.0,
                       f"forwards: served_steps ({len(steps)} buckets); judge + host: engine_graphs "
                       f"({eg.get('sessions')} sessions)")


# the tiny capacity model (the CPU check): the carried traces' vocabulary (1,024 codes) and image length (144 tokens)
TINY_CAPACITY = dict(n_layer=2, dim=64, n_head=4, vocab_size=1024, caption_dim=32, cls_token_num=8, block_size=160)


def xl_model(dev, dtype, **overrides):
    """LlamaGen-XL's GPT (block of 256 image tokens; `overrides`: other shapes) with RANDOM weights, built on `dev`
    in `dtype`. The head starts at zero in training's init: every logit equal would make greedy tokens all 0, so it
    gets random weights as every other layer has."""
    from ciar.models.gpt import build_gpt

    torch.manual_seed(0)
    with torch.device(dev):
        model = build_gpt("GPT-XL", **{"block_size": 256, **overrides})
        torch.nn.init.normal_(model.output.weight, std=0.05)
    return model.to(dtype).eval()


def capacity_model(tiny: bool):
    """The model the measured replica serves: XL on the GPU in bf16; tiny: `TINY_CAPACITY` on the CPU."""
    if tiny:
        return xl_model("cpu", torch.float32, **TINY_CAPACITY)
    return xl_model("cuda", torch.bfloat16)


def replica(model, methods: tuple[str, ...], tiny: bool, max_load: int, seed_stride: int = 0):
    """The measured replica's CloudVerifier over `model` (no caption encoder: `random_caption`), and the methods'
    traces widened to its vocabulary: serve_config.gpu.yaml's scheduler (tiny: a small one), a seeded random interval
    projector of the model's width, the KV cache sized from the accelerator's memory ("auto"; on a CPU
    4 x `max_load` sessions), the fused step and the engine's overlap on CUDA (as serve_config.gpu.yaml's
    `verifier_fused_step` and `verifier_overlap` serve them; a CPU overlaps nothing). `seed_stride`: method i's
    traces get seeds + i x stride (one replica replaying several methods' recorded verdicts: distinct seeds).
    -> (verifier, {method: traces}, image tokens)."""
    from ciar.collab.projector import IntervalProjector, ProjectorConfig
    from ciar.engine.scheduler import SchedulerConfig
    from ciar.engine.verifier import CloudVerifier

    cfg, dev, dtype = model.config, model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    traces = method_traces(methods, cfg.vocab_size, seed_stride)
    image_tokens = max(t.open.prefix_len for tr in traces.values() for t in tr)
    if cfg.block_size < image_tokens + 8:
        raise ValueError(f"the model's {cfg.block_size} image positions do not hold the traces' {image_tokens}")
    step0 = next(s for tr in traces.values() for t in tr for s in t.steps if s.request.device_hidden is not None)
    torch.manual_seed(0)
    projector = IntervalProjector(ProjectorConfig(
        device_dim=step0.request.device_hidden.shape[1], cloud_dim=cfg.dim,
        feature_dim=step0.request.features.shape[1])).to(dev, dtype)
    sched = SchedulerConfig(token_budget=16384, max_works=64, prefill_chunk=120) if not tiny else \
        SchedulerConfig(token_budget=256, max_works=8, prefill_chunk=16)
    v = CloudVerifier(model, None, max_sessions="auto" if dev.type == "cuda" else 4 * max_load,
                      projector=projector, scheduler=sched, slot_wait_s=600.0, fused=dev.type == "cuda",
                      overlap=dev.type == "cuda")
    return v, traces, image_tokens


def method_traces(methods: tuple[str, ...], vocab_size: int, seed_stride: int = 0) -> dict[str, list]:
    """The carried traces of `methods`, widened to `vocab_size`; method i's seeds + i x `seed_stride` (what the
    replica and its phones both read: `replica`, `measure_process`)."""
    loaded = load_traces_dir(methods=methods)
    return {m: [_reseeded(widened(t, vocab_size), i * seed_stride) for t in loaded[m]] for i, m in enumerate(methods)}


def _reseeded(trace, by: int):
    return trace if not by else dataclasses.replace(trace, open=dataclasses.replace(
        trace.open, seed=int(trace.open.seed) + by))


def measure(suite, loads: list[int], warmup_s: float, duration_s: float, images: int | None = None,
            slo_s: float = SLO_P99_S, network: str = NETWORK, methods: tuple[str, ...] = METHODS,
            switch_s: float | None = SWITCH_S, overlap: bool = True) -> dict:
    """The section: build the replica as the GPU configuration serves it (the fused step and the engine's overlap
    on CUDA), ramp each method (then its last load again: with the interpreter's switch interval at `switch_s`, when
    given; when `overlap`, with the overlap switched the other way: off on CUDA, on elsewhere), then the model's
    prediction beside every point (for the methods without Jacobi windows: the model has no Jacobi work)."""
    from ciar.capacity.gpu_model import GPU, ModelShapes, phones_at_slo
    from ciar.capacity.trace import AsyncVerifierClient, RecordedVerdicts
    from ciar.engine import heap
    from ciar.engine.core import EngineThread
    from ciar.models.gpt import fuse_feed_forward

    model = suite.capacity_gpt()
    cfg = model.config
    suite.release()
    t = time.perf_counter()
    v, traces, image_tokens = replica(model, methods, suite.tiny, max(loads))
    sched, fused = v.engine.config, v.runner.fused
    out: dict = {"scheduler": dataclasses.asdict(sched), "sessions": v.table.max_sessions, "fused_step": fused,
                 "overlap_served": v.engine.overlap,
                 "image_tokens": image_tokens, "traces": {m: len(t) for m, t in traces.items()},
                 "network": network, "slo_p99_s": slo_s, "warmup_s": warmup_s, "duration_s": duration_s,
                 "images_per_point": images}
    if suite.dev.type == "cuda":
        out["graphs_captured"] = v.runner.capture(2 * sched.max_works)
        suite.sync()
    out["start_up_s"] = round(time.perf_counter() - t, 1)
    out["heap_frozen"] = heap.freeze(log=lambda *a: None)  # as the Verifier replica does (undone after the section)
    core = EngineThread(v.engine, wait_s=0.003)
    client = AsyncVerifierClient(v, stepper=core, caption=random_caption(v))  # as the Verifier drives its engine
    points: dict[str, list] = {}
    try:
        for method in methods:
            verdicts = RecordedVerdicts(traces[method]).install(v)
            points[method] = []
            for phones in loads:
                profiler = StepProfile(v, after_s=warmup_s / 2)  # (its steps end within the warm-up)
                try:
                    p = asyncio.run(point(client, traces[method], phones, warmup_s, duration_s, network, images,
                                          tag=method))
                finally:
                    p_profile = profiler.remove()
                p["profile"] = p_profile
                points[method].append(p)
                print(f"  capacity_measured {method} {phones} phones: {p['images']} images, "
                      f"{p['images_per_s'] or 0:.2f} images/s, p99 {p['latency_s']['p99']}, "
                      f"{p['mean_works_per_step']} works/step, mismatches {p['mismatches']}", flush=True)
                if p["latency_s"]["p99"] is None or p["latency_s"]["p99"] > 2 * slo_s:
                    break
            last = points[method][-1]
            for name, enter, leave in _again(v, switch_s, overlap):  # the last load again, one change at a time
                enter()
                try:
                    ahead0 = dict(v.engine.ahead)
                    p = asyncio.run(point(client, traces[method], last["phones"], warmup_s, duration_s, network,
                                          images, tag=f"{method}-{name}"))
                finally:
                    leave()
                again = {"phones": last["phones"], "images_per_s": p["images_per_s"],
                         "default_images_per_s": last["images_per_s"], "ms_per_step": p["ms_per_step"],
                         "default_ms_per_step": last["ms_per_step"], "latency_s": p["latency_s"],
                         "default_latency_s": last["latency_s"], "mismatches": p["mismatches"],
                         "errors": p["errors"]}
                if name == "switch_interval":
                    again.update(switch_s=switch_s, default_s=sys.getswitchinterval())  # (restored by `leave`)
                else:
                    again.update(ahead_run=v.engine.ahead["run"] - ahead0["run"],
                                 ahead_dropped=v.engine.ahead["dropped"] - ahead0["dropped"])
                out.setdefault(name, {})[method] = again
                print(f"  capacity_measured {method} {last['phones']} phones, {name}: "
                      f"{p['images_per_s'] or 0:.2f} images/s (default {last['images_per_s'] or 0:.2f})", flush=True)
            verdicts.uninstall(v)
            out.setdefault("verdicts", {})[method] = {"replayed": verdicts.replayed, "changed": verdicts.changed,
                                                      "unrecorded": verdicts.unrecorded}
    finally:
        core.stop()
        out["heap"] = heap.stats()
        heap.unfreeze()  # (the suite's process: its later sections' garbage collected as before)
        if fused:
            fuse_feed_forward(model, False)  # the suite's other sections time the plain model
    max_sessions = v.table.max_sessions
    del core, client, v  # the KV cache (most of the accelerator's memory) goes before the next section
    suite.release()
    out["points"] = points
    out["measured"] = {m: {"phones_at_slo": phones_at_slo(ps, slo_s),
                           "images_per_s_at_saturation": max((p["images_per_s"] or 0 for p in ps), default=0)}
                       for m, ps in points.items()}
    sat = out["measured"]
    if "ciar" in sat and "cloud" in sat:
        out["measured"]["ratio_ciar_over_cloud"] = {
            k: (sat["ciar"][k] / sat["cloud"][k] if sat["cloud"][k] else None)
            for k in ("phones_at_slo", "images_per_s_at_saturation")}

    # --- the model's prediction beside every point
    if suite.bandwidth is None:
        suite.roofline()
    # the model's slots are the replica's (below); the memory figure only must not cap them first
    memory = torch.cuda.mem_get_info()[1] if suite.dev.type == "cuda" else 1e15
    gpu = GPU("measured roofline", suite.bandwidth, suite.flops, memory, "benchmarks.gpu roofline")
    out["model"] = predict(out, traces, image_tokens, gpu, ModelShapes.from_config(cfg), suite.result["sections"])
    return out


def predict(sec: dict, traces: dict[str, list], image_tokens: int, gpu, shapes, sections: dict,
            steady_s: float | None = None) -> dict:
    """The capacity model beside every measured point of a `capacity_measured` section `sec` (same phones, link,
    window, session slots and scheduler; the methods without Jacobi windows: the model has no Jacobi work), priced
    three ways: the default overhead (3 ms a forward); `refit_overhead_s` (served step minus roofline plus the
    judge's and host's ms at 16 sessions, one constant a forward); `served_costs` from `sections` (each forward as
    the served path pads it, and the judge and host of `engine_graphs` once a step). Nothing is taken from this
    section's own steps. `shapes`: the model's (no caption encoder: the measured replica runs none either).
    `steady_s`: the served pricing once more with a warm-up and a window of that many seconds each
    ("served_steady"): what the measured window's length does to a point. Every phone starts at once, and a
    window short against the images' latency holds part of the start-up wave.
    -> {"refit", "served_costs", "overheads_s", "steady_s", "points"}."""
    from ciar.capacity.gpu_model import Engine, simulate

    sched = sec["scheduler"]
    refit = refit_overhead_s(sections, shapes, gpu)
    served = served_costs(sections)
    engines = {"default_3ms": Engine(sched["token_budget"], sched["max_works"], sched["prefill_chunk"], 3e-3)}
    if refit:
        engines["refit_served_path"] = dataclasses.replace(engines["default_3ms"], overhead_s=refit["overhead_s"])
    if served:
        engines["served_costs"] = dataclasses.replace(engines["default_3ms"], overhead_s=0.0, costs=served)
        if steady_s:  # the same pricing, its own warm-up and window
            engines["served_steady"] = engines["served_costs"]
    model = {"refit": refit, "served_costs": served and dataclasses.asdict(served), "steady_s": steady_s,
             "overheads_s": {k: e.overhead_s for k, e in engines.items()}, "points": {}}
    for name, eng in engines.items():
        per = model["points"][name] = {}
        for method, ps in sec["points"].items():
            if any(t.open.jacobi_window for t in traces[method]):
                continue  # (the model decodes an open one token a forward: no prediction is better than that)
            per[method] = []
            for p in ps:
                warmup, window = (steady_s, steady_s) if name == "served_steady" else (sec["warmup_s"], p["seconds"])
                m = simulate(traces[method], image_tokens, gpu, shapes, p["phones"], sec["network"], window, warmup,
                             eng, max_sessions=sec["sessions"])
                per[method].append({
                    "phones": p["phones"], "images_per_s": m["images_per_s"], "p99_s": m["latency_s"]["p99"],
                    "steps_per_s": m["steps_per_s"], "mean_works_per_step": m["mean_batch_size"],
                    "pieces_per_step": m["pieces_per_step"],
                    "measured_over_predicted_images_per_s":
                        p["images_per_s"] / m["images_per_s"] if m["images_per_s"] and p["images_per_s"] else None})
    return model


SEED_STRIDE = 1000  # one core replays every method: method i's traces get seeds + i x this (`replica`)


def process_core(tiny: bool, methods: tuple[str, ...], max_load: int):
    """The engine process's factory (`ciar.engine.process.CoreSpec.factory`): `replica` over `capacity_model`, every
    bucket's graph captured on CUDA, every method's recorded verdicts installed at once (their seeds apart), and the
    random captions given to its opens and resumes (it has no caption encoder)."""
    from ciar.capacity.trace import RecordedVerdicts

    v, traces, _ = replica(capacity_model(tiny), methods, tiny, max_load, seed_stride=SEED_STRIDE)
    if v.device.type == "cuda":
        v.runner.capture(2 * v.engine.config.max_works)
    verdicts = RecordedVerdicts([t for tr in traces.values() for t in tr]).install(v)
    caption, open_work, resume_work, stats = random_caption(v), v.open_work, v.resume_work, v.stats
    v.open_work = lambda request, caption_emb=None, caption_mask=None, owner="": open_work(
        request, caption(request), caption_mask, owner)
    v.resume_work = lambda request, history, injected=None, caption_emb=None, caption_mask=None, owner="": \
        resume_work(request, history, injected, caption(request), caption_mask, owner)
    v.stats = lambda: {**stats(), "verdicts": {"replayed": verdicts.replayed, "changed": verdicts.changed,
                                               "unrecorded": verdicts.unrecorded}}
    return v


def measure_process(suite, loads: dict[str, int], warmup_s: float, duration_s: float, images: int | None = None,
                    network: str = NETWORK, methods: tuple[str, ...] = METHODS) -> dict:
    """The section `capacity_process`: each method's load again (`loads`: capacity_measured's last, by method)
    with the engine core in a process of its own (`ciar.engine.process.EngineProcess`, as
    `verifier_engine_process` serves it): the same replica built there, the same trace-driven phones on this
    process's loop, each call through the core's socket. Per method: images/s, latency, steps and works per step
    (as the core reported them) beside capacity_measured's figures at the same load."""
    from ciar.engine.process import CoreSpec, EngineProcess

    suite.release()  # (the core takes the accelerator's memory: nothing of this process's may hold it)
    t = time.perf_counter()
    spec = CoreSpec(factory="benchmarks.engine_capacity:process_core",
                    factory_kwargs={"tiny": suite.tiny, "methods": tuple(methods), "max_load": max(loads.values())})
    engine = EngineProcess(spec, "capacity-secret", batch_wait_s=0.003)  # (the thread's company wait)
    out: dict = {"start_up_s": round(time.perf_counter() - t, 1), "sessions": engine.info["max_sessions"],
                 "points": {}}
    client = ProcessClient(engine)
    probe = ProcessProbe(client)
    traces = method_traces(tuple(methods), engine.vocab_size, SEED_STRIDE)  # (the seeds the core replays)
    try:
        for method in methods:
            p = asyncio.run(point(client, traces[method], loads[method], warmup_s, duration_s, network, images,
                                  tag=f"{method}-process", probe=probe))
            out["points"][method] = p
            print(f"  capacity_process {method} {loads[method]} phones: {p['images_per_s'] or 0:.2f} images/s, "
                  f"p99 {p['latency_s']['p99']}, {p['mean_works_per_step']} works/step", flush=True)
        out["core"] = {k: v for k, v in asyncio.run(engine.stats()).items()
                       if k in ("verdicts", "forwards", "steps_failed", "core_rss_mb", "forwards_by_path")}
    finally:
        engine.shutdown()
    return out


def markdown(sec: dict) -> list[str]:
    """The section's table for gpu.md."""
    if "points" not in sec:
        return []
    window = (f"until {sec['images_per_point']} images" if sec.get("images_per_point") else
              f"{sec['duration_s']} s") + f" after {sec['warmup_s']} s"
    lines = [f"Sessions (KV slots) {sec['sessions']}, scheduler {sec['scheduler']}, fused step "
             f"{sec.get('fused_step', False)}, overlap {sec.get('overlap_served', False)}, link {sec['network']}, "
             f"window {window}; replayed decisions: {sec.get('verdicts')}.",
             "", "| method | phones | images/s | p50 s | p99 s | passes/image | works/step | steps/s | padding | "
             "step ms: forward / judge / host | engine stepping | mismatches | "
             + " | ".join(f"model {MODELS[k]} images/s" for k in MODELS) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(MODELS)]
    model = sec.get("model", {}).get("points", {})
    for method, ps in sec["points"].items():
        for i, p in enumerate(ps):
            pred = [model.get(k, {}).get(method, [{}] * (i + 1))[i].get("images_per_s") for k in MODELS]
            lat = p["latency_s"]
            lines.append(f"| {method} | {p['phones']} | {_f(p['images_per_s'])} | {_f(lat['p50'])} | "
                         f"{_f(lat['p99'])} | {_f(p['cloud_passes_per_image'])} | {_f(p['mean_works_per_step'])} | "
                         f"{_f(p.get('steps_per_s'))} | {_f(p.get('padding'))} | {_split(p.get('ms_per_step'))} | "
                         f"{_f(p['engine_stepping'])} | "
                         f"{p['mismatches']} | " + " | ".join(_f(x) for x in pred) + " |")
    m = sec.get("measured", {})
    lines += ["", f"Measured: {m}"]
    for name, title in (("switch_interval", "with the interpreter's switch interval shortened "
                                            "(`sys.setswitchinterval`)"),
                        ("overlap", "with the engine's overlap (`StepEngine.overlap`; sampled steps are synced)"),
                        ("no_overlap", "without the engine's overlap (the GPU configuration serves it)")):
        if sec.get(name):
            lines += ["", f"The last load again {title}:", "", "| method | phones | images/s | default's images/s | "
                      "p99 s | default's | step ms: forward / judge / host | default's |",
                      "|---|---|---|---|---|---|---|---|"]
            for method, x in sec[name].items():
                lines.append(f"| {method} | {x['phones']} | {_f(x['images_per_s'])} | "
                             f"{_f(x['default_images_per_s'])} | {_f(x['latency_s']['p99'])} | "
                             f"{_f(x['default_latency_s']['p99'])} | {_split(x['ms_per_step'])} | "
                             f"{_split(x['default_ms_per_step'])} |")
    profiled = [(method, p) for method, ps in sec["points"].items() for p in ps if p.get("profile")]
    if profiled:
        lines += ["", "Each load's steps under torch.profiler in its warm-up (`StepProfile`; the profiler's costs "
                  "included): ms per step, the accelerator's share (its kernels' time; on a CPU the top-level "
                  "operators'), and the largest by name:", "",
                  "| method | phones | steps | wall ms | busy ms | per step | largest: calls, ms per step | "
                  "host ms: in operators / Python | the step's largest operators (inclusive) |",
                  "|---|---|---|---|---|---|---|---|---|"]

        def top(rows: list) -> str:
            return "; ".join(f"{t['name']} {_f(t['per_step'])}, {_f(t['ms_per_step'])}" for t in rows[:5])

        for method, p in profiled:
            pr = p["profile"]
            lines.append(f"| {method} | {p['phones']} | {pr['steps']} | {_f(pr['wall_ms_per_step'])} | "
                         f"{_f(pr['busy_ms_per_step'])} | {_f(pr['per_step'])} {pr['what']} | {top(pr['top'])} | "
                         f"{_f(pr['host_ops_ms_per_step'])} / {_f(pr['host_python_ms_per_step'])} | "
                         f"{top(pr['host_top'])} |")
    return lines


# the capacity model's ways of pricing a step (`predict`), as the tables name them
MODELS = {"default_3ms": "3 ms", "refit_served_path": "refit", "served_costs": "served",
          "served_steady": "served, long window"}


def refit_run(run: str, costs_from: list[str] | None = None, steady_s: float | None = None) -> dict:
    """The capacity model's prediction, every way (`predict`), beside the `capacity_measured` section of a GPU
    suite result `run` (gpu.json), on this machine (nothing runs on a GPU): the steps priced from the sections of
    `costs_from` (gpu.json files, later ones overriding earlier ones: `roofline`, `served_steps`, `engine_graphs`;
    default: `run` itself); `steady_s`: `predict`'s. -> {"run", "costs_from", "gpu", "measured", "model"}."""
    import json

    from ciar.capacity.gpu_model import GPU, ModelShapes
    from ciar.models.gpt import gpt_config

    with open(run) as f:
        suite = json.load(f)
    sec = suite["sections"].get("capacity_measured") or {}
    if "points" not in sec:
        raise ValueError(f"{run} has no measured capacity_measured section")
    sections: dict = {}
    for path in costs_from or [run]:
        with open(path) as f:
            sections.update(json.load(f)["sections"])
    roof = sections.get("roofline") or {}
    if "copy_bandwidth_gb_s" not in roof:
        raise ValueError(f"no roofline section in {costs_from or [run]}: the model's forwards need the measured one")
    env = suite["sections"].get("env") or {}
    gpu = GPU(f"{env.get('gpu', 'the GPU')} (measured roofline)", roof["copy_bandwidth_gb_s"] * 1e9,
              roof["matmul_tflops"] * 1e12, 1e15, "benchmarks.gpu roofline")  # slots: the measured replica's
    cfg = gpt_config("GPT-XL", **{"block_size": 256, **(TINY_CAPACITY if suite.get("tiny") else {})})
    traces = method_traces(tuple(sec["points"]), cfg.vocab_size)
    model = predict(sec, traces, sec["image_tokens"], gpu, ModelShapes.from_config(cfg), sections, steady_s)
    return {"run": run, "costs_from": costs_from or [run], "gpu": dataclasses.asdict(gpu),
            "measured": {m: [{k: p.get(k) for k in ("phones", "images_per_s", "latency_s", "mean_works_per_step",
                                                      "steps_per_s", "pieces_per_step", "engine_stepping",
                                                      "ms_per_step", "cloud_passes_per_image")}
                             for p in ps] for m, ps in sec["points"].items()},
            "model": model}


def refit_markdown(r: dict, command: str) -> str:
    """`refit_run`'s result as a table: measured images/s and each model's, measured / predicted."""
    lines = [f"# The capacity model beside a measured run: {r['run']}", "",
             f"Steps priced from {', '.join(r['costs_from'])} on this machine (nothing ran on a GPU); the measured "
             f"figures are the run's own. GPU: {r['gpu']['name']}.", ""]
    m = r["model"]
    if m.get("refit"):
        f = m["refit"]
        lines.append(f"- refit: {1e3 * f['overhead_s']:.2f} ms a forward (served step minus roofline "
                     f"{1e3 * f['forward_gap_s']:.2f} + judge and host {1e3 * f['judge_and_host_s']:.2f})")
    c = m.get("served_costs")
    if c:
        lines.append(f"- served: a forward {1e3 * c['forward_a_s']:.2f} ms + {1e6 * c['forward_b_s']:.2f} µs per "
                     f"padded position, two forwards when a step has prefill chunks; judge and host "
                     f"{1e3 * c['step_a_s']:.2f} ms a step ({c['source']})")
    if m.get("steady_s"):
        lines.append(f"- served, long window: the same with a {m['steady_s']:g} s warm-up and a {m['steady_s']:g} s "
                     "window (the measured points keep their own); 'measured / predicted' there compares windows "
                     "of different lengths")
    keys = [k for k in MODELS if k in m["points"]]
    lines += ["", "| method | phones | measured images/s | " + " | ".join(
        f"{MODELS[k]}: images/s (measured / predicted)" for k in keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for method, ps in r["measured"].items():
        for i, p in enumerate(ps):
            cells = []
            for k in keys:
                pred = m["points"][k].get(method, [])
                q = pred[i] if i < len(pred) else {}
                ratio = q.get("measured_over_predicted_images_per_s")
                cells.append(f"{_f(q.get('images_per_s'))} ({'–' if ratio is None else f'{ratio:.2f}'})")
            lines.append(f"| {method} | {p['phones']} | {_f(p['images_per_s'])} | " + " | ".join(cells) + " |")
    served = m["points"].get("served_costs")
    if served:  # where the served model's steps differ from the engine's
        lines += ["", "Steps, measured against the served model: steps/s; images a step; works a step; pieces a "
                  "step: decode / span / prefill", "", "| method | phones | measured | served model |",
                  "|---|---|---|---|"]

        def steps(p):
            k = p.get("pieces_per_step") or {}
            per = p["images_per_s"] / p["steps_per_s"] if p.get("steps_per_s") else None
            return (f"{_f(p.get('steps_per_s'))}; {_f(per)}; {_f(p.get('mean_works_per_step'))}; "
                    + " / ".join(_f(k.get(x)) for x in ("decode", "span", "prefill")))

        for method, ps in r["measured"].items():
            for p, q in zip(ps, served.get(method, [])):
                lines.append(f"| {method} | {p['phones']} | {steps(p)} | {steps(q)} |")
    lines += ["", "Command:", "", "    " + command, ""]
    return "\n".join(lines)


def _again(v, switch_s: float | None, overlap: bool):
    """The changes each method's last load is run again with, one at a time: (name, enter, leave). The overlap's
    run switches it the other way from the replica's (served) setting: "no_overlap" where it is on."""
    out = []
    if switch_s:  # the interpreter handing the GIL over sooner (sys.setswitchinterval): is the host time GIL waits?
        default = sys.getswitchinterval()
        out.append(("switch_interval", lambda: sys.setswitchinterval(switch_s), lambda: sys.setswitchinterval(default)))
    if overlap:  # the engine reading a step's decisions after launching the next forward (StepEngine.overlap)
        served = v.engine.overlap
        out.append(("no_overlap" if served else "overlap", lambda: setattr(v.engine, "overlap", not served),
                    lambda: setattr(v.engine, "overlap", served)))
    return out


def _split(ms: dict | None) -> str:
    return f"{ms['step']:.3g}: {ms['forward']:.3g} / {ms['judge']:.3g} / {ms['host']:.3g}" if ms else "–"


def _f(x) -> str:
    return "–" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def record(folder: str, images: int = 12, seed: int = 0) -> None:
    """Record the carried phones with the shipped world (CPU; needs the project installed): CIAR and cloud-only
    (`loadtests.capacity`'s), then the parallel-decoding ones (`PARALLEL_METHODS`: SJD, CIAR with Jacobi windows)."""
    from ciar.sim.decoder import method_config
    from ciar.training.calibration import val_prompts
    from ciar.world import load_world
    from loadtests.capacity import record as record_traces
    from loadtests.capacity import record_configs

    args = argparse.Namespace(traces=images, seed=seed, threads=1, traces_dir=folder, overload=None, world=None,
                              weights=None)
    # record afresh (record() reads a folder that already holds them, if they were made with its settings)
    for path in [os.path.join(folder, f"{m}.pt") for m in METHODS] + [os.path.join(folder, "traces.json")]:
        if os.path.exists(path):
            os.remove(path)
    record_traces(args)
    world = load_world(None)
    ciar = method_config("ciar", network="none", policy="fixed", jacobi_window=JACOBI_WINDOW)
    configs = {"sjd": method_config("sjd", network="none"),
               "ciar_jacobi": ciar.resolve(world.device_model.ciar_defaults)}
    record_configs(world, configs, val_prompts(images, seed=seed), seed, folder)


def main(argv=None) -> int:
    import shlex

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", metavar="DIR", help="record the carried phones into DIR")
    what.add_argument("--refit", metavar="GPU_JSON", help="the capacity model beside the capacity_measured section "
                                                          "of a GPU suite result (nothing runs on a GPU)")
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--costs-from", nargs="+", metavar="GPU_JSON",
                    help="--refit: suite results whose roofline, served_steps and engine_graphs price the steps "
                         "(later files override earlier ones; default: the --refit file)")
    ap.add_argument("--out", help="--refit: write OUT/capacity_refit.json and .md (default: print the table)")
    ap.add_argument("--steady-s", type=float, help="--refit: the served pricing once more with a warm-up and a "
                                                   "window of this many seconds each (what the window's length does)")
    args = ap.parse_args(argv)
    if args.record:
        record(args.record, args.images)
        return 0
    try:
        r = refit_run(args.refit, args.costs_from, args.steady_s)
    except (OSError, ValueError, KeyError) as e:
        print(f"engine_capacity --refit: {e}", file=sys.stderr)
        return 2
    md = refit_markdown(r, "python -m benchmarks.engine_capacity " + " ".join(shlex.quote(a) for a in
                                                                               (argv or sys.argv[1:])))
    if args.out:
        from ciar.results import write_results

        write_results(os.path.join(args.out, "capacity_refit.json"), r, md)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
