"""A MODEL of one verifier replica on a GPU (nothing here runs on a GPU): the time of each engine forward at
LlamaGen-XL's shapes from published hardware figures (or measured ones: `benchmarks.gpu`'s capacity section), and
recorded phones replayed against it in simulated time, scheduled by the engine's own scheduler.

    gpu = GPUS["h100"]
    shapes = ModelShapes.llamagen_xl()
    forward_s(gpu, shapes, [(2, 1, 200)] * 64)       # one step: 64 sessions x 2 CFG rows, one position each
    simulate(traces, gpu, shapes, phones=32, network="5g", duration_s=60)   # one load point, like loadtests.capacity

**The cost of one forward** (a roofline with a floor):

    t = max(bytes / bandwidth, flops / peak) + overhead
    bytes = 2 x (weights a forward reads) + sum over rows of 2 x n_layer x 2 x kv_dim x (keys the row reads)
    flops = 2 x (those weights) x positions + sum over rows of 4 x n_layer x dim x width x keys

bf16 weights and KV cache (2 bytes). The weights a forward reads are the transformer blocks, the final norm and the
output head (the token embedding is a row lookup, the caption MLP runs once per open: both left out); LlamaGen-XL:
752 M of its 777 M parameters, 1.50 GB. Each row reads its own session's keys (its piece's last position + 1), as a
ragged attention kernel does; the head's FLOPs are counted at every position (an upper bound: the engine computes
logits only where a work wants them; it is 3 % of the per-position FLOPs). A step that admits new opens also pays
their caption encoding: flan-t5-xl's encoder weights read once and 2 x its parameters x 120 positions FLOPs per
caption, plus one `overhead`. `overhead` is a fixed per-forward cost for kernel launches and the host loop: the
default, 3 ms, is an assumption for the eager PyTorch engine (about 20 kernels per block x 36 blocks at ~4 us each);
CUDA graphs would bring it to tens of microseconds. Achieved bandwidth and FLOP rates are taken at their published
peaks (real kernels reach roughly 70-90 % of them), so the model is optimistic there.

**A step as the served engine runs it** (`Engine(costs=ServedCosts(...))`, fitted on a GPU run by
`benchmarks.engine_capacity.served_costs`): instead of one ragged roofline forward, the step's narrow and wide pieces
each a forward padded to the static path's buckets, priced from the forwards a GPU timed, plus the judge's and the
host's time once a step. On an H200, at saturation, the roofline + 3 ms predicted x4.5 (CIAR) and x1.9 (cloud-only)
the images/s the engine served; this pricing x1.06 and x1.20, or x0.78 and x0.65 with the judge time another
process measured (benchmarks/results/2026-11-29c).

**Hardware figures** (`GPUS`; dense bf16 tensor-core peak, i.e. half the "with sparsity" figure the sheets headline):
- H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS bf16. NVIDIA H100 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h100/ (1,979 TFLOPS bf16 with sparsity).
- A100 80 GB SXM: 2,039 GB/s HBM2e, 312 TFLOPS bf16. NVIDIA A100 Tensor Core GPU datasheet,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  (624 TFLOPS bf16 with sparsity).
- L4 24 GB: 300 GB/s GDDR6, 121 TFLOPS bf16. NVIDIA L4 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/l4/ (242 TFLOPS bf16 with sparsity).

**The replica** (`ReplicaModel`, `simulate`): the replicas' own scheduler (`ciar.engine.scheduler.Scheduler`: the
same queues, policy and step accounting the verifier's engine runs) over modelled works (`ModelledWork`: the pieces a
real open or verification feeds, without their tokens), each step priced by a modelled runner (`ModelledRunner`:
`forward_s` of the scheduled pieces, + `encode_s` for the opens it starts) instead of run by the model runner; each
work two rows (CFG). A step starts as soon as the previous one ended and work is queued (the 5 ms batch wait of the
live config is not modelled). `tests/capacity/test_gpu_model.py` replays recorded sessions through the real verifier
and through this model and checks that both schedule the same pieces, step by step. KV-cache slots are limited by the GPU's memory
(after the GPT's and T5's weights and a 10 % reserve, each session holding 2 rows x (caption + image + 16) positions);
an open without a free slot waits for one. Forwards per request follow the engine: an open is its prefill chunks
and prefix_len - 1 decodes; a verification one feed of the committed-but-unfed token, the catch-up and the span
(chunked if long), then a decode per burst token (and one more when the burst stopped early on entropy).

**The phones** are the recorded traces `loadtests.capacity` replays (`ciar.capacity.trace.SessionTrace`): their
device compute (measured on the box that recorded them) and message bytes, over one seeded
`ciar.sim.network.NetworkModel` link per phone, in simulated time. The traces come from the world they were
recorded with (the shipped scenes world: 144 image tokens, its device's acceptance pattern); their positions are
priced at the model's shapes (caption positions of the model, image positions as recorded). A 256-token XL image
would take about 256/144 of the per-image figures if CIAR's pattern held at that size (not measured).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ciar.engine.scheduler import DECODE, KINDS, PREFILL, SPAN, Request, Scheduled, Scheduler, SchedulerConfig

BYTES = 2  # bfloat16 weights and KV cache


@dataclass(frozen=True)
class GPU:
    """Published figures of one accelerator (see the module docstring for the datasheets)."""

    name: str
    bandwidth: float  # memory bandwidth, bytes / s
    peak_flops: float  # dense bf16 tensor-core peak, FLOP / s
    memory: float  # bytes of device memory
    source: str  # the datasheet


GPUS: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM5 80GB", 3.35e12, 989e12, 80e9,
                "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"),
    "a100": GPU("NVIDIA A100 80GB SXM", 2.039e12, 312e12, 80e9,
                "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
                "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "l4": GPU("NVIDIA L4 24GB", 300e9, 121e12, 24e9,
              "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/"),
}



def measured_gpu(suite: dict, path: str = "graph") -> tuple[GPU, float]:
    """The GPU `benchmarks.gpu` measured (its result JSON, `suite`): the measured copy bandwidth and matmul rate as
    a `GPU`, its total memory, and the per-forward overhead fitted for `path` ("graph" or "eager") -> (gpu,
    overhead_s). The capacity plan then runs from measured costs (`loadtests.capacity --gpu-costs FILE`)."""
    sections = suite.get("sections", {})
    cap, env = sections.get("capacity") or {}, sections.get("env") or {}
    if not cap or "bandwidth" not in cap:
        raise ValueError("the suite's result has no capacity section (was it cut short, or run with --tiny?)")
    key = f"overhead_s_{path}"
    if key not in cap:
        raise ValueError(f"the suite's capacity section has no {key} (paths measured: "
                         f"{[k.removeprefix('overhead_s_') for k in cap if k.startswith('overhead_s_') and 'range' not in k]})")
    memory = float(env.get("gpu_memory_gib") or 0) * 2**30
    name = f"{env.get('gpu') or 'measured'} (measured, {path})"
    return GPU(name, float(cap["bandwidth"]), float(cap["peak_flops"]), memory,
               f"benchmarks.gpu, measured on {env.get('gpu')} (torch {env.get('torch')})"), float(cap[key])


# flan-t5-xl's encoder (its config.json): what the verifier runs once per new caption
FLAN_T5_XL = dict(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                  relative_attention_max_distance=128, is_encoder_decoder=True, tie_word_embeddings=False,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, layer_norm_epsilon=1e-6,
                  model_type="t5")


def t5_encoder_params(cfg: dict = FLAN_T5_XL) -> int:
    """Parameters of a gated T5 encoder: per block q, k, v, o, two input and one output feed-forward matrices and
    two norms; the shared embedding, the relative-position bias table and the final norm."""
    inner = cfg["num_heads"] * cfg["d_kv"]
    d = cfg["d_model"]
    block = 4 * d * inner + 3 * d * cfg["d_ff"] + 2 * d
    return cfg["num_layers"] * block + cfg["vocab_size"] * d + cfg["relative_attention_num_buckets"] * \
        cfg["num_heads"] + d


@dataclass(frozen=True)
class ModelShapes:
    """What the cost model needs of the verifier's models."""

    dim: int
    n_layer: int
    kv_dim: int  # kv_heads x head_dim
    ffn_hidden: int
    vocab_size: int
    cls_token_num: int  # caption positions
    block_size: int  # image tokens
    text_params: int = 0  # caption encoder parameters (0: no encoding cost)
    text_positions: int = 0

    @staticmethod
    def from_config(cfg, text_params: int = 0, text_positions: int | None = None) -> "ModelShapes":
        """From a `ciar.models.gpt.GPTConfig`."""
        return ModelShapes(cfg.dim, cfg.n_layer, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size,
                           cfg.cls_token_num, cfg.block_size, text_params,
                           cfg.cls_token_num if text_positions is None else text_positions)

    @staticmethod
    def llamagen_xl(image_size: int = 256) -> "ModelShapes":
        """LlamaGen's t2i GPT-XL (`ciar.models.gpt.GPT_CONFIGS["GPT-XL"]`) with flan-t5-xl captions (120 tokens):
        Stage I at 256 px (16 x 16 tokens, the default), Stage II at 512 px (32 x 32 = 1,024 tokens)."""
        from ciar.models.gpt import gpt_config

        grid = image_size // 16
        return ModelShapes.from_config(gpt_config("GPT-XL", block_size=grid * grid), t5_encoder_params())

    @property
    def weight_params(self) -> int:
        """Parameters one forward reads: per block wq, wo (dim x dim), wk, wv (dim x kv_dim), w1, w3, w2
        (dim x ffn_hidden) and two norms; the final norm; the output head."""
        d = self.dim
        block = 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_hidden + 2 * d
        return self.n_layer * block + d + self.vocab_size * d

    def session_bytes(self) -> int:
        """KV cache of one session: two rows (CFG) x every layer's keys and values over the cache length."""
        return 2 * self.n_layer * 2 * self.kv_dim * (self.cls_token_num + self.block_size + 16) * BYTES


def forward_s(gpu: GPU, shapes: ModelShapes, pieces: list[tuple[int, int, int]], overhead_s: float = 3e-3) -> float:
    """Modelled seconds of one forward over `pieces`, each (rows, width, keys): `rows` batch rows feeding `width`
    positions each and reading `keys` cached keys (the piece's last position + 1)."""
    positions = sum(r * w for r, w, _ in pieces)
    kv_read = sum(r * k for r, _, k in pieces)
    attention = sum(r * w * k for r, w, k in pieces)
    nbytes = BYTES * shapes.weight_params + BYTES * 2 * shapes.n_layer * shapes.kv_dim * kv_read
    flops = 2 * shapes.weight_params * positions + 4 * shapes.n_layer * shapes.dim * attention
    return max(nbytes / gpu.bandwidth, flops / gpu.peak_flops) + overhead_s


def overhead_gaps(gpu: GPU, shapes: ModelShapes, steps: list[dict], ms_key: str) -> list[float]:
    """Measured minus modelled seconds of each timed step (dicts with "rows", "width", "keys" and `ms_key`, its
    milliseconds; steps without it are left out), sorted: what a per-forward overhead is fitted on (its median)."""
    return sorted(s[ms_key] / 1000 - forward_s(gpu, shapes, [(s["rows"], s["width"], s["keys"])], overhead_s=0.0)
                  for s in steps if ms_key in s)


def encode_s(gpu: GPU, shapes: ModelShapes, captions: int, overhead_s: float = 3e-3) -> float:
    """Modelled seconds to encode `captions` new captions together (0 when there are none or no encoder)."""
    if not captions or not shapes.text_params:
        return 0.0
    flops = 2 * shapes.text_params * shapes.text_positions * captions
    return max(BYTES * shapes.text_params / gpu.bandwidth, flops / gpu.peak_flops) + overhead_s


def session_slots(gpu: GPU, shapes: ModelShapes, reserve: float = 0.1) -> int:
    """KV-cache sessions that fit beside the GPT's and the caption encoder's weights."""
    weights = BYTES * (shapes.weight_params + shapes.vocab_size * shapes.dim + shapes.text_params)
    return max(0, int((gpu.memory * (1 - reserve) - weights) // shapes.session_bytes()))


# ---------------------------------------------------------------------------------------------------- the replica
class ModelledWork(Request):
    """One request in flight on the modelled replica: the positions it feeds, piece by piece, as the real work
    (`ciar.engine.works.OpenWork` / `VerifyWork`) feeds them: a feed (prefill or span, chunkable), then one-token
    decodes (prefix or burst tokens)."""

    def __init__(self, kind: int, start: int, feed: int, decodes: int, decode_start: int, on_done, rows: int,
                 opening: bool = False):
        self.seq, self.done, self.rows, self.session_id = 0, False, rows, ""
        self._kind = kind
        self.start = start  # absolute position of the feed's next position
        self.feed = feed  # positions left in the feed
        self.decodes = decodes  # one-token forwards after the feed
        self.decode_start = decode_start  # absolute position of the first of them
        self.on_done = on_done
        self.opening = opening  # an open whose caption is not encoded yet
        self.forwards = 0

    def kind(self) -> int:
        return self._kind if self.feed else DECODE

    def pending(self) -> int:
        return self.feed if self.feed else int(self.decodes > 0)

    def position(self) -> int:
        return self.start if self.feed else self.decode_start

    def advance(self, n: int) -> None:
        """Its piece of `n` positions was fed."""
        self.forwards += 1
        if self.feed:
            self.start += n
            self.feed -= n
        else:
            self.decodes -= 1
            self.decode_start += 1
        self.done = not self.feed and self.decodes <= 0


@dataclass(frozen=True)
class ServedCosts:
    """A step priced as the served engine runs it, from a GPU run's measurements (`benchmarks.engine_capacity.
    served_costs`), instead of one ragged roofline forward: the step's narrow pieces (decodes, spans) in one forward
    and its wide ones (prefill and history chunks) in another, each padded as the static path pads it (rows up to a
    row bucket, width up to a width bucket: `ciar.engine.runner.padded_shape`) and costing `forward_a_s` +
    `forward_b_s` x its padded positions; each step adds `step_a_s` + `step_b_s` x its works for the judge and the
    host."""

    forward_a_s: float
    forward_b_s: float  # per padded position (rows x width)
    step_a_s: float
    step_b_s: float = 0.0  # per work
    source: str = ""

    def step_s(self, batch: list[Scheduled]) -> float:
        from ciar.engine.runner import ModelRunner, padded_shape

        t = self.step_a_s + self.step_b_s * len(batch)
        for group in ModelRunner.groups(batch):  # the runner's forwards: narrow pieces, then wide ones
            rows, width = sum(batch[i].rows for i in group), max(batch[i].n for i in group)
            rows, width = padded_shape(rows, width) or (rows, width)  # beyond every bucket: run as it is
            t += self.forward_a_s + self.forward_b_s * rows * width
        return t


class ModelledRunner:
    """The model runner's place in the modelled replica: a scheduled batch -> its modelled seconds (one roofline
    forward + the overhead; with `costs`, as the served engine runs it: `ServedCosts`)."""

    def __init__(self, gpu: GPU, shapes: ModelShapes, overhead_s: float, costs: ServedCosts | None = None):
        self.gpu, self.shapes, self.overhead_s, self.costs = gpu, shapes, overhead_s, costs

    def cost(self, batch: list[Scheduled], captions: int = 0) -> float:
        step = self.costs.step_s(batch) if self.costs is not None else \
            forward_s(self.gpu, self.shapes, [(p.rows, p.n, p.keys) for p in batch], self.overhead_s)
        return step + encode_s(self.gpu, self.shapes, captions, self.overhead_s)


class Sim:
    """A discrete-event clock: `at(t, fn)` runs fn at simulated time t (ties in order of scheduling)."""

    def __init__(self):
        self.now = 0.0
        self._q: list = []
        self._n = itertools.count()

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._q, (t, next(self._n), fn))

    def run(self, until: float) -> None:
        while self._q and self._q[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._q)
            fn()
        self.now = until


@dataclass(frozen=True)
class Engine:
    """The replica's `ciar.engine.scheduler.SchedulerConfig` (serve_config.yaml's Verifier: 64 works, 1024
    positions), the modelled per-forward overhead and the rows per session."""

    token_budget: int = 1024
    max_works: int = 64
    prefill_chunk: int = 64
    overhead_s: float = 3e-3
    rows: int = 2  # CFG: a conditional and an unconditional row per session
    costs: ServedCosts | None = None  # steps priced as the served engine runs them (measured), not by the roofline

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.token_budget, self.max_works, self.prefill_chunk)


class ReplicaModel:
    """One replica in simulated time: requests queue as modelled works on the engine's scheduler, each step runs the
    pieces it schedules for `ModelledRunner.cost` seconds. Opens take a KV-cache slot (session) or wait, FIFO."""

    def __init__(self, sim: Sim, gpu: GPU, shapes: ModelShapes, slots: int, engine: Engine = Engine()):
        self.sim, self.shapes, self.slots, self.engine = sim, shapes, slots, engine
        self.scheduler = Scheduler(engine.scheduler)
        self.runner = ModelledRunner(gpu, shapes, engine.overhead_s, engine.costs)
        self.waiting: list[ModelledWork] = []  # opens without a free slot, FIFO
        self.sessions = 0
        self.running = False
        self.busy_s = 0.0
        self.batch_hist: dict[int, int] = {}
        self.pieces = [0] * len(KINDS)  # pieces run per class (`ciar.engine.scheduler.KINDS`), since start

    forwards = property(lambda self: self.scheduler.steps)
    real_positions = property(lambda self: self.scheduler.real_positions)
    padded_positions = property(lambda self: self.scheduler.padded_positions)

    def open(self, prefix_len: int, on_done) -> None:
        c = self.shapes.cls_token_num
        w = ModelledWork(PREFILL, 0, c, max(prefix_len - 1, 0), c, on_done, self.engine.rows, opening=True)
        if self.sessions < self.slots:
            self.sessions += 1
            self._add(w)
        else:
            self.waiting.append(w)

    def verify(self, start: int, feed: int, decodes: int, decode_start: int, on_done) -> None:
        """Image positions: the feed's first, its length, then `decodes` one-token forwards from `decode_start`."""
        c = self.shapes.cls_token_num
        self._add(ModelledWork(SPAN, c + start, feed, decodes, c + decode_start, on_done, self.engine.rows))

    def close(self) -> None:
        self.sessions -= 1
        if self.waiting and self.sessions < self.slots:
            self.sessions += 1
            self._add(self.waiting.pop(0))

    def _add(self, w: ModelledWork) -> None:
        if not w.feed and w.decodes <= 0:  # nothing to feed (a verification with an empty feed and no burst)
            self.sim.at(self.sim.now, lambda: w.on_done(0))
            return
        self.scheduler.submit(w)
        if not self.running:
            self.running = True
            self.sim.at(self.sim.now, self._step)

    def _step(self) -> None:
        self.scheduler.start(self.scheduler.take_waiting())  # admitted: its slot was taken by `open`
        batch = self.scheduler.schedule()
        if not batch:
            self.running = False
            return
        opening = [p.request for p in batch if p.request.opening]
        for w in opening:
            w.opening = False
        dt = self.runner.cost(batch, len(opening))
        self.busy_s += dt
        self.scheduler.record(batch)
        self.batch_hist[len(batch)] = self.batch_hist.get(len(batch), 0) + 1
        for p in batch:
            self.pieces[p.kind] += 1
        self.sim.at(self.sim.now + dt, lambda: self._finish(batch))

    def _finish(self, batch: list[Scheduled]) -> None:
        for p in batch:
            p.request.advance(p.n)
        for w in self.scheduler.retire():
            w.on_done(w.forwards)
        self._step()


def verify_plan(trace, image_tokens: int) -> list[tuple[int, int, int, int]]:
    """Per recorded verification, what the engine feeds (`ciar.engine.works.VerifyWork`), in image positions:
    (the feed's first position, its length: the committed-but-unfed token + catch-up + span, the one-token
    forwards after it: one per burst token and one more when the burst stopped early on entropy, the first of
    those positions)."""
    out = []
    committed = len(trace.prefix_tokens)
    for step in trace.steps:
        r = step.request
        m, k = len(r.new_tokens), len(r.draft_tokens)
        start = max(committed - 1, 0)
        kept = committed + m + step.num_accepted + 1  # tokens after the verdict
        burst = len(step.burst_tokens)
        decodes = burst
        if step.num_accepted < k and r.burst > 0 and burst < r.burst and kept + burst < image_tokens:
            decodes += 1  # the burst stopped early on entropy: that forward was spent
        out.append((start, committed - start + m + k, decodes, kept - 1))
        committed = kept + burst
    return out


# ---------------------------------------------------------------------------------------------------- the phones
def _reply_bytes(trace, step) -> int:
    from ciar.collab.protocol import VerifyReply

    return VerifyReply("x" * len(trace.open.session_id), step.num_accepted, step.next_token, True, 0.0, 1,
                       burst_tokens=np.asarray(step.burst_tokens, dtype=np.int64),
                       vocab_size=trace.vocab_size).nbytes()


class Phone:
    """One trace-driven phone: replays recorded images back to back (trace k + n x phones, as loadtests.capacity)
    over its own seeded link, sleeping the recorded device compute, against the modelled replica."""

    def __init__(self, k: int, phones: int, traces: list, plans: list, replica: ReplicaModel, sim: Sim,
                 network: str, on_image, device_scale: float = 1.0, limit: int | None = None):
        from ciar.sim.network import NetworkModel

        self.k, self.phones, self.traces, self.plans = k, phones, traces, plans
        self.replica, self.sim, self.on_image, self.device_scale = replica, sim, on_image, device_scale
        self.net = NetworkModel(network, seed=1000 * phones + k) if network != "none" else None
        self.n, self.limit = 0, limit  # images started; stop after `limit` (None: until the clock stops)

    def link(self, nbytes: int) -> float:
        return self.net.transmit(nbytes)[0] if self.net is not None else 0.0

    def start(self) -> None:
        i = (self.k + self.n * self.phones) % len(self.traces)
        self.n += 1
        trace, plan, t0, passes = self.traces[i], self.plans[i], self.sim.now, [0]

        def opened(forwards: int) -> None:
            passes[0] += forwards
            self.sim.at(self.sim.now + self.link(trace.open_bytes[1]), lambda: exchange(0))

        def exchange(j: int) -> None:
            if j == len(trace.steps):
                self.sim.at(self.sim.now + trace.tail_device_s * self.device_scale, finish)
                return
            step = trace.steps[j]

            def replied(forwards: int) -> None:
                passes[0] += forwards
                self.sim.at(self.sim.now + self.link(_reply_bytes(trace, step)), lambda: exchange(j + 1))

            t = self.sim.now + step.device_s * self.device_scale + self.link(step.request.nbytes(trace.vocab_size))
            self.sim.at(t, lambda: self.replica.verify(*plan[j], replied))

        def finish() -> None:
            self.replica.close()
            self.on_image(self.sim.now - t0, passes[0], len(trace.steps) + 1)
            if self.limit is None or self.n < self.limit:
                self.start()

        self.sim.at(t0 + self.link(trace.open_bytes[0]), lambda: self.replica.open(trace.open.prefix_len, opened))


def simulate(traces: list, image_tokens: int, gpu: GPU, shapes: ModelShapes, phones: int, network: str = "5g",
             duration_s: float = 60.0, warmup_s: float = 10.0, engine: Engine = Engine(),
             max_sessions: int | None = None, device_scale: float = 1.0) -> dict:
    """One load point: `phones` phones at once for `warmup_s` + `duration_s` simulated seconds; images finishing
    inside the window count (as `loadtests.capacity`'s points). `image_tokens`: of the world the traces were
    recorded with. -> the point's figures (all modelled)."""
    plans = [verify_plan(t, image_tokens) for t in traces]
    sim = Sim()
    slots = session_slots(gpu, shapes)
    if max_sessions is not None:
        slots = min(slots, max_sessions)
    replica = ReplicaModel(sim, gpu, shapes, slots, engine)
    done: list[tuple[float, int, int]] = []
    window = {"on": False}

    def on_image(latency: float, passes: int, requests: int) -> None:
        if window["on"]:
            done.append((latency, passes, requests))

    for k in range(phones):
        Phone(k, phones, traces, plans, replica, sim, network, on_image, device_scale).start()
    sim.run(warmup_s)
    window["on"] = True
    base = (replica.busy_s, replica.forwards, replica.real_positions, replica.padded_positions,
            dict(replica.batch_hist), list(replica.pieces))
    sim.run(warmup_s + duration_s)
    images = len(done)
    lat = [d[0] for d in done]
    hist = {b: n - base[4].get(b, 0) for b, n in replica.batch_hist.items() if n - base[4].get(b, 0)}
    padded = replica.padded_positions - base[3]
    return {
        "phones": phones, "images": images, "images_per_s": images / duration_s,
        "latency_s": {q: float(np.percentile(lat, int(q[1:]))) if lat else None for q in ("p50", "p95", "p99")},
        "cloud_busy_s_per_image": (replica.busy_s - base[0]) / images if images else None,
        "utilisation": (replica.busy_s - base[0]) / duration_s,
        "verifier_forwards_per_image": (replica.forwards - base[1]) / images if images else None,
        "cloud_passes_per_image": float(np.mean([d[1] for d in done])) if done else None,
        "cloud_requests_per_image": float(np.mean([d[2] for d in done])) if done else None,
        "mean_batch_size": sum(b * n for b, n in hist.items()) / sum(hist.values()) if hist else None,
        "padding": 1.0 - (replica.real_positions - base[2]) / padded if padded else None,
        "session_slots": slots, "opens_waiting_at_end": len(replica.waiting),
        # as benchmarks.engine_capacity reports the engine's steps: steps a second, pieces a step per class
        "steps_per_s": (replica.forwards - base[1]) / duration_s,
        "pieces_per_step": {k: (n - base[5][i]) / (replica.forwards - base[1]) for i, (k, n) in
                            enumerate(zip(KINDS, replica.pieces))} if replica.forwards > base[1] else None,
    }


def image_forward_s(trace, image_tokens: int, gpu: GPU, shapes: ModelShapes, engine: Engine = Engine()
                    ) -> tuple[float, int]:
    """Modelled verifier seconds and forwards of one recorded image alone on the replica (no other session, no
    network, no device time): its cloud forward-seconds per image at batch 1."""
    sim = Sim()
    replica = ReplicaModel(sim, gpu, shapes, 1, engine)
    Phone(0, 1, [trace], [verify_plan(trace, image_tokens)], replica, sim, "none", lambda *a: None, device_scale=0.0,
          limit=1).start()
    sim.run(math.inf)
    return replica.busy_s, replica.forwards


# ---------------------------------------------------------------------------------------------------- the plan
def phones_at_slo(points: list[dict], slo: float) -> int:
    """The largest load whose images' p99 latency holds the SLO without errors (0: none)."""
    ok = [p["phones"] for p in points if p["images"] and p["latency_s"]["p99"] is not None
          and p["latency_s"]["p99"] <= slo and not p.get("errors")]
    return max(ok) if ok else 0


def plan(traces: dict[str, list], gpus: list[str], loads: list[int], slo_s: float, network: str = "5g",
         duration_s: float = 60.0, warmup_s: float = 10.0, engine: Engine = Engine(),
         shapes: ModelShapes | None = None, extra_gpus: dict[str, GPU] | None = None) -> dict:
    """The GPU capacity plan: per GPU and method (`traces`: method -> recorded sessions), the load ramp (stopping a
    method once its p99 passes twice the SLO), phones per replica at the p99 SLO, and cloud forward-seconds per
    image alone and at the SLO load. Every figure is modelled."""
    shapes = shapes or ModelShapes.llamagen_xl()
    image_tokens = max(t.open.prefix_len for t in traces["cloud"])  # a cloud-only open asks for every token
    out = {"model": "GPU cost model (modelled, not measured): t = max(bytes / bandwidth, flops / peak) + overhead "
                    "per forward; ciar/capacity/gpu_model.py",
           "shapes": {**shapes.__dict__, "weight_params": shapes.weight_params, "session_bytes": shapes.session_bytes()},
           "engine": dataclasses.asdict(engine), "slo_p99_s": slo_s, "network": network, "duration_s": duration_s,
           "warmup_s": warmup_s, "recorded_image_tokens": image_tokens,
           "recorded_images": {m: len(t) for m, t in traces.items()}, "gpus": {}}
    table = {**GPUS, **(extra_gpus or {})}
    for name in gpus:
        gpu = table[name]
        res = {"gpu": gpu.__dict__, "session_slots": session_slots(gpu, shapes), "points": {}, "phones_at_slo": {},
               "cloud_forward_s_per_image_alone": {}, "cloud_forwards_per_image_alone": {},
               "cloud_busy_s_per_image_at_slo": {}}
        for method, tr in traces.items():
            alone = [image_forward_s(t, image_tokens, gpu, shapes, engine) for t in tr]
            res["cloud_forward_s_per_image_alone"][method] = float(np.mean([a[0] for a in alone]))
            res["cloud_forwards_per_image_alone"][method] = float(np.mean([a[1] for a in alone]))
            points = []
            for load in loads:
                p = simulate(tr, image_tokens, gpu, shapes, load, network, duration_s, warmup_s, engine)
                points.append(p)
                print(f"{name} {method} {load} phones: p99 {p['latency_s']['p99']} s, "
                      f"{p['images_per_s']:.2f} images/s, batch {p['mean_batch_size']}", flush=True)
                if p["latency_s"]["p99"] is None or p["latency_s"]["p99"] > 2 * slo_s:
                    break
            res["points"][method] = points
            res["phones_at_slo"][method] = best = phones_at_slo(points, slo_s)
            at = next((p for p in points if p["phones"] == best), None)
            res["cloud_busy_s_per_image_at_slo"][method] = at and at["cloud_busy_s_per_image"]
        ph = res["phones_at_slo"]
        res["ratio"] = ph["ciar"] / ph["cloud"] if ph.get("cloud") else None
        # the SLO held at the largest load tried: the capacity is at least that
        res["at_least"] = {m: bool(ph[m]) and ph[m] == max(loads) for m in ph}
        out["gpus"][name] = res
    return out


def markdown(result: dict, command: str) -> str:
    """The plan's table (every figure labelled as modelled) and its inputs."""
    sh = result["shapes"]
    measured = any("(measured" in r["gpu"]["name"] for r in result["gpus"].values())
    lines = [
        "# GPU capacity plan for one verifier replica: a MODEL, not a measurement",
        "",
        "No GPU ran this plan" + ("; the rows named 'measured' use a GPU's measured bandwidth, matmul rate and "
                                  "per-forward overhead (benchmarks.gpu, `--gpu-costs`) instead of datasheet figures"
                                  if measured else "") +
        ". Each engine forward is priced by `ciar/capacity/gpu_model.py`: "
        "t = max(bytes / bandwidth, flops / peak) + overhead (bf16 weights and KV cache; overhead "
        f"{1e3 * result['engine']['overhead_s']:.1f} ms per forward, "
        + ("the measured GPU's, applied to every row" if measured else "an assumption for the eager engine")
        + "), and the "
        "recorded CIAR and cloud-only phones of `loadtests.capacity` are replayed against the modelled replica in "
        "simulated time (the engine's own scheduler, its memory-bound KV-cache slots, a seeded "
        f"{result['network']} link per phone, the recorded device compute).",
        "",
        f"Shapes: LlamaGen-XL t2i ({sh['n_layer']} layers, width {sh['dim']}, {sh['cls_token_num']} caption positions, "
        f"{sh['block_size']} image tokens, vocab {sh['vocab_size']}): {sh['weight_params'] / 1e6:.0f} M parameters "
        f"read per forward ({2 * sh['weight_params'] / 1e9:.2f} GB bf16), KV cache {sh['session_bytes'] / 1e6:.0f} MB "
        f"per session (2 CFG rows); flan-t5-xl encoder {sh['text_params'] / 1e6:.0f} M parameters per new caption.",
        "",
        f"Phones: {result['recorded_images']} recorded images of the shipped scenes world "
        f"({result['recorded_image_tokens']} image tokens each: CIAR's acceptance pattern is the scenes device's, "
        f"not measured at XL). SLO: image latency p99 <= {result['slo_p99_s']} s; "
        f"{result['duration_s']:.0f} s window after {result['warmup_s']:.0f} s warm-up per load (simulated time).",
        "",
        "| GPU (datasheet bandwidth, dense bf16 peak) | KV slots | phones at SLO, CIAR (model) | phones at SLO, "
        "cloud-only (model) | CIAR / cloud-only | cloud forward-s per image alone, CIAR / cloud-only (model) | "
        "cloud busy-s per image at the SLO load, CIAR / cloud-only (model) |",
        "|---|---|---|---|---|---|---|",
    ]
    e = result["engine"]
    lines[-3:-3] = [f"Engine: at most {e['max_works']} works and {e['token_budget']} padded positions per forward "
                    f"(`--verifier '{{\"max_batch_size\": N}}'` changes them); ≥: the SLO held at the largest load "
                    "tried.", ""]
    for name, r in result["gpus"].items():
        g = r["gpu"]
        ph, alone, busy = r["phones_at_slo"], r["cloud_forward_s_per_image_alone"], r["cloud_busy_s_per_image_at_slo"]
        ge = {m: "≥ " if r["at_least"][m] else "" for m in ph}

        def s(v):
            return "–" if v is None else f"{v:.3f}"

        lines.append(f"| {g['name']} ({g['bandwidth'] / 1e12:.2f} TB/s, {g['peak_flops'] / 1e12:.0f} TFLOPS) | "
                     f"{r['session_slots']} | {ge['ciar']}{ph['ciar']} | {ge['cloud']}{ph['cloud']} | "
                     f"{ge['ciar']}{'–' if r['ratio'] is None else round(r['ratio'], 2)} | "
                     f"{s(alone['ciar'])} / {s(alone['cloud'])} | "
                     f"{s(busy['ciar'])} / {s(busy['cloud'])} |")
    lines += ["", "Sources of the hardware figures:"]
    lines += [f"- {r['gpu']['name']}: {r['gpu']['source']}" for r in result["gpus"].values()]
    lines += ["", "Per load point (modelled): phones, images/s, latency p50 / p99 (s), mean works per forward, "
                  "cloud busy-s per image:", ""]
    for name, r in result["gpus"].items():
        for method, points in r["points"].items():
            row = "; ".join(f"{p['phones']}: {p['images_per_s']:.2f}/s, {p['latency_s']['p50'] or 0:.2f} / "
                            f"{p['latency_s']['p99'] or 0:.2f}, {p['mean_batch_size'] or 0:.1f}, "
                            f"{p['cloud_busy_s_per_image'] or 0:.3f}" for p in points)
            lines.append(f"- {name} {method}: {row}")
    lines += ["", "Command:", "", "    " + command, ""]
    return "\n".join(lines)
