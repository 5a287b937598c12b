"""The GPU suite: what the verifier engine costs on a real accelerator, in one short call (issue 37, item 5).

    python -m benchmarks.gpu --out benchmarks/results/DATE-gpu          # one GPU: about 3-5 minutes on an H100
    python -m benchmarks.gpu --tiny --out /tmp/gpu-tiny                  # the same code at small shapes, CPU (tests)
    python -m benchmarks.gpu --out DIR --sections env,capacity_measured --capacity-loads 256 --capacity-window 30,30
        # one load with a longer window (the default 4 + 12 s holds part of the start-up wave: 2026-11-29c)

Needs only what the lent GPU machines hold (torch, numpy, transformers, safetensors, pillow, scipy, pyyaml, tqdm,
psutil; no Ray, no pydantic, no install of this project: `client/` is put on the path; no weight files: every model
is built in memory with RANDOM weights at the real shapes, so the times are real and the outputs are noise). Each
section is timed on its own and written to `gpu.json` as soon as it ends (a run cut short keeps what it measured),
then `gpu.md` summarises:

  env        the device, torch / transformers versions, free memory
  roofline   measured copy bandwidth (a 1 GiB device-to-device copy) and bf16 matmul throughput (8192^3): the bounds
             the steps below are held against, beside the capacity model's datasheet figures
  xl_steps   LlamaGen-XL (36 layers x 1280, `ciar.models.gpt` "GPT-XL", 256 image tokens, 120 caption positions) in
             bf16: the verifier's cached forward (`GPT.forward_cached` + the logits of every fed position, the engine's
             call) for a 5-position span at image position 248 and a one-token decode, at 1 / 8 / 32 / 64 rows; eager
             and, on CUDA, replayed from a CUDA graph captured at that shape; each against its bandwidth bound
             (weights + the KV it reads, at the measured bandwidth)
  graphs     the check that makes the graph numbers trustworthy: 24 greedy decode steps of 8 rows, eager (the engine's
             dynamic key length) vs graph replays (a fixed key length, later keys masked): the tokens, and the largest
             logit difference at equal shapes
  t5         flan-t5-xl's encoder (24 x 2048, bf16) over 120 positions: 1 and 16 captions
  hf_llama   Hugging Face's LlamaForCausalLM at GPT-XL's shape (bf16): one-token decode at batch 1 and 16 after a
             376-position prefill, its dynamic cache (eager) and its static cache; ours at the same batch beside it
  engine     `ciar.engine.verifier.CloudVerifier` on the XL model: 16 sessions' spans verified one session at a time
             vs all 16 in one step (spans/s); the engine's own batching
  capacity_measured  phones per accelerator with the real engine (`benchmarks.engine_capacity`): a Verifier's
             engine on its own thread at XL shapes as the GPU configuration serves it (the fused step, the
             overlap; each method's last load again without it) under trace-driven phones (benchmarks/traces),
             CIAR and cloud-only, images/s and latency per load, phones at the p99 SLO, the capacity model's
             prediction beside every point (its default overhead; refit on the served path with host time; each step
             priced as the served engine runs it: `served_costs`), and 8 steps of each load's warm-up under
             torch.profiler (`StepProfile`: wall and kernel ms per step, the largest kernels)
  capacity_parallel  the same for the parallel-decoding phones: SJD and CIAR with Jacobi windows (their traces
             in benchmarks/traces; no model beside them: it decodes one token a forward)
  slot_attention  attention read in place by slot (`ciar.models.slot_attention`, a Triton kernel) vs the gathered
             keys and mask it replaces: its difference from the reference, its invariances, the served step at 2-128
             CFG rows both ways, and a loaded step (60 sessions' spans beside 4 prefills) as two bucketed forwards vs
             the one dynamic forward it was
  fused_step the fused static step (w1/w3 as one GEMM, each block compiled inside the graphs) vs the plain one:
             ms at 2-128 CFG rows, start-up (captures, compilations), kernels per eager step, float32 tokens
  served_steps  the step the Verifier serves (the runner's static buckets, CUDA graphs on CUDA, inputs and logits
             included) at 2-128 CFG rows, a one-token decode and a span, against its bandwidth bound
  engine_graphs  the engine's model runner (`ciar.engine.runner`) on the XL model: dynamic eager steps, static
             (bucketed) eager steps and static steps replayed from CUDA graphs on the same seeded sessions: replies
             compared, spans/s (all sessions in one step, one at a time), graphs captured and capture time, and
             after a warm-up round each step split into forward, judge (`ciar.engine.judge`) and host milliseconds
  compiled_judge  the judge compiled (`Judge(compiled=True)`) vs eager on one verifier, graphs captured: the
             compilations at start-up, spans/s at 16 and 64 sessions, each step's forward / judge / host ms, the
             replies compared
  overlap    the engine's overlap (a step's decisions read after the next forward is launched) against the engine
             without it, 64 sessions on one verifier with graphs: a cloud prefix (one-token decodes), then rounds of
             spans with bursts; replies compared, tokens and spans per second, ms per step, the accelerator's busy
             share (its kernels' union over the window, torch.profiler) and the synchronising calls per step
  packed_step  span-wide served steps with few fed positions (one-token decodes beside spans: up to the saturated
             CIAR step's 50 + 12), packed (projections on the fed tokens only) vs plain, each plain and fused: ms,
             the logits' difference and argmax agreement
  memory     the KV cache sized from the GPU's memory (`max_sessions="auto"`), allocated, and the largest steps the
             scheduler allows run beside it: sessions, GiB, the peak
  capacity   the forward costs in the form `ciar.capacity.gpu_model.forward_s` reads (bandwidth, peak FLOP/s,
             per-forward overhead fitted from the xl_steps, eager and graphs), so the capacity plan can be re-run from
             measured costs instead of datasheet ones

They run in the order of `--sections` (env, compiled_judge, engine_graphs, served_steps, roofline,
capacity_measured (whose refit model reads the three before it), fused_step, capacity_parallel, capacity_process,
overlap, packed_step, engine_process, slot_attention, xl_steps, ...: the most needed first; sections not started
within `--budget-s` are skipped).

The aim (issue 37): a one-token XL step within 2x of the bandwidth bound at 1-8 rows with graphs. `xl_steps` and
`graphs` measure the forward alone; `engine_graphs` the engine's runner, which pads steps to buckets and replays them
from CUDA graphs on CUDA (not run on a GPU before this suite's first lent run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:  # the device side's package (numpy only); on a bare GPU machine it is not installed, only checked out
    import ciar_device  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(REPO, "device"))

SPAN = 5  # positions a span verify feeds: the committed-but-unfed token and 4 drafts
IMAGE_POS = 248  # image position of the span / decode (near the end of a 256-token image: the longest keys)
ROWS = (1, 8, 32, 64)
TINY = dict(n_layer=2, dim=64, n_head=4, vocab_size=64, caption_dim=32, cls_token_num=8, block_size=64)
TINY_ROWS = (1, 4)
TINY_POS = 40


@contextlib.contextmanager
def _variant(name: str, cuda: bool):
    """torch's defaults ("default"), or one suspect of non-repeatability switched: bf16 GEMMs' reduced-precision
    reductions off, cuDNN's attention backend off (CUDA), torch's deterministic algorithms on; restored after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction, torch.are_deterministic_algorithms_enabled()
    try:
        if name == "no_reduced_precision_reduction":
            m.allow_bf16_reduced_precision_reduction = False
        if name == "deterministic_algorithms":
            torch.use_deterministic_algorithms(True, warn_only=True)
        if name == "no_cudnn_attention" and cuda:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                yield
        else:
            yield
    finally:
        m.allow_bf16_reduced_precision_reduction = saved[0]
        torch.use_deterministic_algorithms(saved[1])


def _compiled_graphs() -> int:
    """Graphs `torch.compile` has compiled in this process so far (torch._dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def busy_share(intervals: list[tuple[float, float]]) -> float | None:
    """The share of the window from the first interval's start to the last one's end that some interval covers
    (kernels that overlap or touch counted once), or None without intervals."""
    busy, end, first = 0.0, None, None
    for a, b in sorted(intervals):
        first = a if first is None else first
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    window = (end - first) if intervals else 0
    return round(busy / window, 3) if window else None


def _cfg_pieces(rows: int, start: int, width: int, tokens: list[list[int]] | None = None) -> list:
    """`rows` // 2 CFG sessions on the slot pairs (2i, 2i + 1), each feeding `width` positions from `start`
    (`tokens[i]`, default zeros) and wanting every one: the runner's pieces of a served step."""
    from ciar.engine.runner import Piece

    return [Piece([2 * i, 2 * i + 1], start, width, tokens=tokens[i] if tokens else [0] * width,
                  want=list(range(width))) for i in range(rows // 2)]


def _random_cache(cache, seed: int, device, slots: int | None = None) -> None:
    """Every layer's keys and values filled with seeded float32 normals (cast to the cache's dtype), a layer's keys
    then its values: the same earlier positions for every path a section compares. `slots`: only the first ones
    (caches of different sizes, e.g. a static runner's spare slot, then get the same keys there)."""
    g = torch.Generator(device=device).manual_seed(seed)
    for k, v in zip(cache.k, cache.v):
        k, v = k[:slots], v[:slots]
        k.copy_(torch.randn(k.shape, generator=g, device=device, dtype=torch.float32).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g, device=device, dtype=torch.float32).to(v.dtype))


class Suite:
    def __init__(self, out: str, tiny: bool, budget_s: float):
        self.out, self.tiny, self.budget_s = out, tiny, budget_s
        # the measured-phones sections' loads and (warm-up, window) seconds on a GPU (--capacity-loads / -window; on
        # the CPU, --tiny, each point counts images instead). Every phone starts at once: a window short against
        # the images' latency holds part of the start-up wave (in the model: +9-12 % CIAR images/s at 256-512
        # phones with 4 + 12 s; benchmarks/results/2026-11-29c)
        self.capacity_loads, self.capacity_window = [16, 64, 256, 512], (4.0, 12.0)
        self.t0 = time.monotonic()
        self.dev = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.result: dict = {"command": " ".join(["python -m benchmarks.gpu"] + sys.argv[1:]), "tiny": tiny,
                             "sections": {}}
        self._gpt = None
        self.bandwidth = self.flops = None  # measured by `roofline` (asked for again where it did not run)
        os.makedirs(out, exist_ok=True)

    # ------------------------------------------------------------------ plumbing
    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def release(self) -> None:
        """Give the allocator's cached blocks back (between sections that each need much of the memory); a verifier
        and its engine refer to each other, so their KV cache goes only with a collection of the cycle."""
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def time_ms(self, fn, reps: int = 20, warmup: int = 3) -> float:
        """Median milliseconds of fn() (synchronised)."""
        if self.tiny:
            reps, warmup = 3, 1
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        times.sort()
        return 1000 * times[len(times) // 2]

    def section(self, name: str, fn) -> None:
        left = self.budget_s - (time.monotonic() - self.t0)
        if left <= 0:
            self.result["sections"][name] = {"skipped": f"the {self.budget_s:g} s budget was spent"}
        else:
            t = time.monotonic()
            try:
                out = fn()
                out["seconds"] = round(time.monotonic() - t, 2)
            except Exception as e:  # noqa: BLE001 - one broken section does not lose the others
                out = {"broke": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                       "seconds": round(time.monotonic() - t, 2)}
            self.result["sections"][name] = out
            print(f"[{time.monotonic() - self.t0:6.1f} s] {name}: " +
                  (out.get("broke") or json.dumps({k: v for k, v in out.items() if not isinstance(v, (dict, list))})),
                  flush=True)
        self.write()

    def write(self) -> None:
        with open(os.path.join(self.out, "gpu.json"), "w") as f:
            json.dump(self.result, f, indent=1)
        with open(os.path.join(self.out, "gpu.md"), "w") as f:
            f.write(markdown(self.result))

    # ------------------------------------------------------------------ models
    def gpt(self):
        """The XL GPT (tiny: a small one), random weights, built on the device in its dtype."""
        if self._gpt is None:
            from benchmarks.engine_capacity import xl_model

            # (its head random too: with training's zero head the graph-vs-eager token check would be empty)
            self._gpt = xl_model(self.dev, self.dtype, **(TINY if self.tiny else {}))
        return self._gpt

    def capacity_gpt(self):
        """The model `capacity_measured` serves: the XL GPT; tiny: the tiny one widened to the carried traces'
        vocabulary (1,024 codes) and image length (144 tokens)."""
        from benchmarks.engine_capacity import capacity_model

        return self.gpt() if not self.tiny else capacity_model(tiny=True)

    def weight_bytes(self, model) -> int:
        """Bytes one forward reads of the weights (every parameter but the token embedding, which is gathered)."""
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "tok_embeddings" not in n)

    # ------------------------------------------------------------------ sections
    def env(self) -> dict:
        out = {"device": str(self.dev), "torch": torch.__version__, "python": platform.python_version(),
               "dtype": str(self.dtype).replace("torch.", ""),
               "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled()}
        try:
            import transformers

            out["transformers"] = transformers.__version__
        except ImportError:
            out["transformers"] = None
        if self.dev.type == "cuda":
            p = torch.cuda.get_device_properties(self.dev)
            free, total = torch.cuda.mem_get_info()
            out.update(gpu=p.name, gpu_memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                       sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                       cuda=torch.version.cuda)
        else:
            out["gpu"] = None
        return out

    def roofline(self) -> dict:
        n = (1 << 20) if self.tiny else (1 << 29)  # elements: 2 MiB (tiny) / 1 GiB in bf16
        x = torch.empty(n, dtype=self.dtype, device=self.dev)
        y = torch.empty_like(x)
        ms = self.time_ms(lambda: y.copy_(x), reps=10)
        bandwidth = 2 * x.numel() * x.element_size() / (ms / 1000)  # read + write
        del x, y
        m = 256 if self.tiny else 8192
        a = torch.randn(m, m, dtype=self.dtype, device=self.dev)
        b = torch.randn(m, m, dtype=self.dtype, device=self.dev)
        ms_mm = self.time_ms(lambda: a @ b, reps=10)
        flops = 2 * m ** 3 / (ms_mm / 1000)
        self.bandwidth, self.flops = bandwidth, flops
        from ciar.capacity.gpu_model import GPUS

        return {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1),
                "datasheet_h100": {"bandwidth_gb_s": GPUS["h100"].bandwidth / 1e9,
                                   "tflops": GPUS["h100"].peak_flops / 1e12}}

    def _step_fn(self, model, cache, rows: int, width: int, pos0: int, kv_len: int):
        """The engine's call for `rows` rows feeding `width` positions from absolute position pos0: embeddings of
        fixed tokens, `forward_cached` with per-row positions on the device (no host sync), the logits of every fed
        position. -> (fn, static input tensors) where fn() returns the logits."""
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.dev)
        pos = (pos0 + torch.arange(width, device=self.dev)).expand(rows, width).contiguous()

        def fn():
            h = model.forward_cached(cache, model.tok_embeddings(tokens), pos, None, kv_len=kv_len)
            return model.logits(h)

        return fn, tokens, pos

    def _graph(self, fn):
        """fn captured in a CUDA graph (after a warm-up on a side stream) -> (replay, static output)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        return g.replay, out

    @torch.inference_mode()
    def xl_steps(self) -> dict:
        return self._steps(self.gpt(), TINY_POS if self.tiny else IMAGE_POS, TINY_ROWS if self.tiny else ROWS)

    def _steps(self, model, image_pos: int, rows_list) -> dict:
        """One-token decode and SPAN-position span steps of `model` at image position `image_pos`, eager and (CUDA)
        replayed from a graph, each against its bandwidth bound."""
        if self.bandwidth is None:
            self.roofline()
        c = model.config
        wbytes = self.weight_bytes(model)
        kv_row_bytes = 2 * c.n_layer * c.kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8  # per key
        out = {"config": {"n_layer": c.n_layer, "dim": c.dim, "n_head": c.n_head, "vocab_size": c.vocab_size,
                          "cls_token_num": c.cls_token_num, "block_size": c.block_size},
               "weight_bytes": wbytes, "image_position": image_pos, "steps": []}
        for kind, width in (("decode", 1), ("span", SPAN)):
            for rows in rows_list:
                pos0 = c.cls_token_num + image_pos
                kv_len = pos0 + width
                cache = model.new_cache(rows)
                fn, _, _ = self._step_fn(model, cache, rows, width, pos0, kv_len)
                eager = self.time_ms(fn)
                bound = 1000 * (wbytes + rows * kv_len * kv_row_bytes) / self.bandwidth
                row = {"kind": kind, "rows": rows, "width": width, "keys": kv_len, "eager_ms": round(eager, 3),
                       "bound_ms": round(bound, 3), "eager_over_bound": round(eager / bound, 2)}
                if self.dev.type == "cuda":
                    replay, _ = self._graph(fn)
                    graph = self.time_ms(replay)
                    row.update(graph_ms=round(graph, 3), graph_over_bound=round(graph / bound, 2),
                               eager_over_graph=round(eager / graph, 2))
                out["steps"].append(row)
                del cache
                self.release()
        return out

    @torch.inference_mode()
    def served_steps(self) -> dict:
        """The step the Verifier serves, timed as it is served: the engine's model runner (`ciar.engine.runner`:
        static buckets, replayed from CUDA graphs on CUDA) running `execute_step` on CFG sessions (two rows each) at
        the buckets a deployment reaches, a one-token decode and a span of SPAN positions, inputs built and logits
        gathered included, against the bandwidth bound of the same step (the weights once, every real key of every
        row). `xl_steps` times the dynamic path; this is the path the replicas run."""
        from ciar.engine.runner import ModelRunner

        if self.bandwidth is None:
            self.roofline()
        model = self.gpt()
        c = model.config
        wbytes = self.weight_bytes(model)
        kv_row_bytes = 2 * c.n_layer * c.kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8
        image_pos = TINY_POS if self.tiny else IMAGE_POS
        rows_list = (2, 4) if self.tiny else (2, 8, 32, 128)
        out = {"image_position": image_pos, "steps": []}
        for rows in rows_list:
            runner = ModelRunner(model, rows, static=True)
            for kind, width in (("decode", 1), ("span", SPAN)):
                pos0 = c.cls_token_num + image_pos
                pieces = _cfg_pieces(rows, pos0, width)
                bucket = runner.bucket(pieces)
                before = dict(runner.steps)
                served = self.time_ms(lambda: runner.execute_step(pieces))
                path = max(runner.steps, key=lambda k: runner.steps[k] - before[k])
                keys = pos0 + width
                bound = 1000 * (wbytes + rows * keys * kv_row_bytes) / self.bandwidth
                out["steps"].append({"kind": kind, "rows": rows, "width": width, "keys": keys, "bucket": bucket,
                                     "path": path, "served_ms": round(served, 3), "bound_ms": round(bound, 3),
                                     "served_over_bound": round(served / bound, 2)})
            del runner
            self.release()
        return out

    @torch.inference_mode()
    def slot_attention(self) -> dict:
        """Attention read in place by slot (`ciar.models.slot_attention`, a Triton kernel) against what it replaces
        (every row's keys gathered, an additive mask, SDPA): (1) at XL's head shape on a seeded random cache, the
        largest difference from the reference in bf16 and float32, and whether a row's bits are the same alone, in
        a batch and with keys past its own; (2) the served step (static buckets, graphs on CUDA) at 2-128 CFG rows,
        a decode and a span, kernel on and off; (3) a step as the engine makes them under load, spans of 60 CFG
        sessions beside 4 prefills: the runner's two bucketed forwards against the one dynamic forward such a step
        ran before (`ModelRunner.groups`), its time and its logits."""
        from ciar.engine.runner import ModelRunner, Piece
        from ciar.models import slot_attention as sa

        if not (self.dev.type == "cuda" and sa.usable(torch.zeros(1, device=self.dev), 64)) and not self.tiny:
            return {"skipped": "the kernel is not usable here (no Triton?)"}
        model = self.gpt()
        c = model.config
        out: dict = {"kernel_usable": sa.usable(torch.zeros(1, device=self.dev), c.head_dim), "kernel": {}}
        b, t, s, kv_len = (4, 5, 72, 60) if self.tiny else (32, 8, c.cls_token_num + c.block_size + 16,
                                                            c.cls_token_num + IMAGE_POS + 8)
        h, d = c.n_head, c.head_dim
        for dtype in (torch.bfloat16, torch.float32) if self.dev.type == "cuda" else (torch.float32,):
            g = torch.Generator(device=self.dev).manual_seed(0)
            k = torch.randn(2 * b, c.kv_heads, s, d, generator=g, device=self.dev).to(dtype)
            v = torch.randn(2 * b, c.kv_heads, s, d, generator=g, device=self.dev).to(dtype)
            valid = torch.ones(2 * b, s, dtype=torch.bool, device=self.dev)
            valid[:, :7] = False  # caption padding
            slots = torch.randperm(2 * b, generator=torch.Generator().manual_seed(1))[:b].to(self.dev)
            pos = (kv_len - t + torch.arange(t, device=self.dev)).expand(b, t).contiguous()
            q = torch.randn(b, t, h, d, generator=g, device=self.dev).to(dtype)
            if not sa.usable(q, d):
                break
            o = sa.slot_attention(q, k, v, slots, pos, valid, kv_len)
            ref = sa.reference(q.float(), k.float(), v.float(), slots, pos, valid, kv_len)
            out["kernel"][str(dtype).removeprefix("torch.")] = {
                "max_abs_diff": float((o.float() - ref).abs().max()),
                "reference_dtype_max_abs_diff": float((sa.reference(q, k, v, slots, pos, valid, kv_len).float() -
                                                       ref).abs().max()),
                "row_alone_equal": bool(torch.equal(sa.slot_attention(q[3:4], k, v, slots[3:4], pos[3:4], valid,
                                                                      kv_len), o[3:4])),
                "longer_keys_equal": bool(torch.equal(sa.slot_attention(q, k, v, slots, pos, valid, s), o)),
            }
        image_pos = TINY_POS if self.tiny else IMAGE_POS
        pos0 = c.cls_token_num + image_pos
        rows_list = (2, 4) if self.tiny else (2, 8, 32, 128)
        times: dict = {}
        saved = sa.ENABLED
        try:
            for on in (False, True):
                sa.ENABLED = on
                for rows in rows_list:
                    runner = ModelRunner(model, rows, static=True)
                    runner.cache.key_valid[:] = True
                    for kind, width in (("decode", 1), ("span", SPAN)):
                        times[on, rows, kind] = self.time_ms(lambda: runner.execute_step(_cfg_pieces(rows, pos0,
                                                                                                     width)))
                    del runner
                    self.release()
        finally:
            sa.ENABLED = saved
        out["served_steps"] = [{"kind": kind, "rows": rows, "gathered_ms": round(times[False, rows, kind], 3),
                                "in_place_ms": round(times[True, rows, kind], 3),
                                "in_place_over_gathered": round(times[True, rows, kind] / times[False, rows, kind],
                                                                3)}
                               for rows in rows_list for kind in ("decode", "span")]
        # (3) a loaded step: narrow spans of many sessions beside a few prefill chunks
        sessions, opens = (3, 1) if self.tiny else (60, 4)
        g = torch.Generator().manual_seed(2)
        spans = [Piece([2 * i, 2 * i + 1], pos0, SPAN, tokens=torch.randint(0, c.vocab_size, (SPAN,), generator=g)
                       .tolist(), want=list(range(SPAN))) for i in range(sessions)]
        conds = [torch.randn(2, c.cls_token_num, c.dim, generator=g).to(self.dev, self.dtype) for _ in range(opens)]
        mixed: dict = {}
        logits = {}
        for way in ("split", "dynamic"):
            runner = ModelRunner(model, 2 * (sessions + opens), static=way == "split")
            _random_cache(runner.cache, 3, self.dev, slots=2 * (sessions + opens))
            runner.cache.key_valid[:] = True
            prefills = [Piece([2 * (sessions + j), 2 * (sessions + j) + 1], 0, c.cls_token_num, emb=conds[j],
                              want=[c.cls_token_num - 1]) for j in range(opens)]
            step = spans + prefills
            before = dict(runner.steps)
            logits[way] = runner.execute_step(step).logits.float()
            mixed[way] = {"forwards": {k: runner.steps[k] - before[k] for k in before if runner.steps[k] > before[k]},
                          "ms": round(self.time_ms(lambda: runner.execute_step(step)), 3)}
            del runner
            self.release()
        mixed["split_over_dynamic"] = round(mixed["split"]["ms"] / mixed["dynamic"]["ms"], 3)
        mixed["max_abs_logit_diff"] = float((logits["split"] - logits["dynamic"]).abs().max())
        mixed["argmax_equal"] = float((logits["split"].argmax(-1) == logits["dynamic"].argmax(-1)).float().mean())
        out["mixed_step"] = {"sessions": sessions, "prefills": opens, **mixed}
        return out

    @torch.inference_mode()
    def fused_step(self) -> dict:
        """The fused step (`ModelRunner(fused=True)`: the feed-forward's input projections as one GEMM, each block
        compiled by torch.compile inside the CUDA graphs) against the plain static step, both as served (buckets,
        graphs on CUDA): milliseconds at 2-128 CFG rows for a one-token decode and a span, the start-up (captures,
        and the compilations), kernels per eager step (torch.profiler), and in float32 the greedy tokens of both
        over `steps` decode steps and their largest logit difference."""
        from ciar.engine.runner import ModelRunner
        from ciar.models.gpt import fuse_feed_forward

        model = self.gpt()
        c = model.config
        cuda = self.dev.type == "cuda"
        image_pos = TINY_POS if self.tiny else IMAGE_POS
        rows_list = (2, 4) if self.tiny else (2, 8, 32, 128)
        pos0 = c.cls_token_num + image_pos
        out: dict = {"image_position": image_pos, "steps": [], "start_up_s": {}, "kernels_per_eager_step": {}}

        times: dict = {}
        for way in ("static", "fused"):
            t = time.perf_counter()
            runner = ModelRunner(model, max(rows_list), static=True, fused=way == "fused")
            try:
                if cuda:
                    runner.capture(max(rows_list), widths=(1, 8))
                    self.sync()
                out["start_up_s"][way] = round(time.perf_counter() - t, 1)
                for rows in rows_list:
                    for kind, width in (("decode", 1), ("span", SPAN)):
                        times[way, rows, kind] = self.time_ms(
                            lambda: runner.execute_step(_cfg_pieces(rows, pos0, width)))
                out["kernels_per_eager_step"][way] = self._kernels(runner, _cfg_pieces(rows_list[0], pos0, 1))
            finally:
                fuse_feed_forward(model, False)
                del runner
                self.release()
        for rows in rows_list:
            for kind in ("decode", "span"):
                a, b = times["static", rows, kind], times["fused", rows, kind]
                out["steps"].append({"kind": kind, "rows": rows, "static_ms": round(a, 3), "fused_ms": round(b, 3),
                                     "fused_over_static": round(b / a, 3)})
        out["tokens_float32"] = self._fused_tokens(rows_list[0] if self.tiny else 8, 6 if self.tiny else 24)
        return out

    def engine_process(self) -> dict:
        """The engine's host side on this machine's CPU (the forward stubbed: `benchmarks.engine_thread`): the same
        phones through the engine thread (the replica's loop and the engine sharing one interpreter) and through
        the engine core in a process of its own (`ciar.engine.process`, `verifier_engine_process`), beside the steps
        driven directly; ms per step, verifies per second and the ratios. The 2-core box measured the process
        ×1.18-1.25 the thread's verifies/s with its steps at the direct pace (2026-11-29), ×1.07-1.33 with a
        VERIFY's cost cut (2026-11-29b); here it has cores to spare."""
        from benchmarks import engine_thread as et

        loads = [8] if self.tiny else [256, 512]
        works = 4 if self.tiny else 64
        counts = (16, 64) if self.tiny else None  # (the tiny check counts answers: any machine passes it)
        out = {"vocab": 1024, "max_works": works, "rows": []}
        threads = torch.get_num_threads()  # (the stubbed engines run on one; the other sections keep theirs)
        for phones in loads:
            try:
                row = et.compare(1024, phones, works, 3.0, 1.0, counts)
            finally:
                torch.set_num_threads(threads)
            out["rows"].append(row)
            print(f"  engine_process {phones} phones: {json.dumps(row)}", flush=True)
        return out

    @torch.inference_mode()
    def packed_step(self) -> dict:
        """A served span-wide step whose fed positions are few, packed (`ModelRunner(pack=True)`: projections and
        feed-forward on the fed tokens, padded to a token bucket; the attention on the padded layout) against the
        plain static step, plain and fused, as served (graphs on CUDA, captured on first use before the timing):
        the mixes of one-token decodes and SPAN-position spans of CFG sessions a loaded replica steps (the saturated
        CIAR step of 2026-11-28c: 50 decodes and 12 spans), ms each way, the token bucket, and the largest logit
        difference from the plain step with the argmax agreement (bf16: GEMMs of other shapes round otherwise)."""
        from ciar.engine.runner import ModelRunner
        from ciar.models.gpt import fuse_feed_forward

        model = self.gpt()
        c = model.config
        pos0 = c.cls_token_num + (TINY_POS if self.tiny else IMAGE_POS)
        mixes = ((3, 1), (6, 2)) if self.tiny else ((3, 1), (12, 4), (50, 12))  # (decodes, spans)
        g = torch.Generator().manual_seed(5)

        def pieces(decodes: int, spans: int) -> list:
            from ciar.engine.runner import Piece

            widths = [1] * decodes + [SPAN] * spans
            return [Piece([2 * i, 2 * i + 1], pos0, w, tokens=torch.randint(0, c.vocab_size, (w,), generator=g)
                          .tolist(), want=list(range(w))) for i, w in enumerate(widths)]

        steps = {m: pieces(*m) for m in mixes}
        ways = ("plain", "packed", "fused", "fused_packed")
        times, logits, start_up, buckets = {}, {}, {}, {}
        for way in ways:
            t = time.perf_counter()
            runner = ModelRunner(model, 2 * max(d + s for d, s in mixes), static=True, fused="fused" in way,
                                 pack="packed" in way)
            try:
                for m, ps in steps.items():
                    before = runner.positions["packed"]
                    logits[way, m] = runner.execute_step(ps).logits.float().clone()  # (captures, compiles)
                    buckets[way, m] = runner.positions["packed"] - before or None  # the token bucket it ran
                self.sync()
                start_up[way] = round(time.perf_counter() - t, 1)
                for m, ps in steps.items():
                    times[way, m] = self.time_ms(lambda: runner.execute_step(ps))
            finally:
                fuse_feed_forward(model, False)
                del runner
                self.release()
        out: dict = {"image_position": pos0 - c.cls_token_num, "span_positions": SPAN, "first_use_s": start_up,
                     "steps": []}
        for m in mixes:
            d, sp = m
            rows, fed = 2 * (d + sp), 2 * (d + sp * SPAN)
            row = {"decodes": d, "spans": sp, "rows": rows, "fed": fed, "tokens_bucket": buckets["packed", m]}
            for way in ways:
                row[f"{way}_ms"] = round(times[way, m], 3)
            row["packed_over_plain"] = round(times["packed", m] / times["plain", m], 3)
            row["fused_packed_over_fused"] = round(times["fused_packed", m] / times["fused", m], 3)
            for way in ("packed", "fused_packed"):
                ref = logits["fused" if way == "fused_packed" else "plain", m]
                row[f"{way}_max_logit_diff"] = round(float((logits[way, m] - ref).abs().max()), 5)
                row[f"{way}_argmax_equal"] = round(float((logits[way, m].argmax(-1) == ref.argmax(-1)).float()
                                                         .mean()), 4)
            out["steps"].append(row)
        return out

    def _kernels(self, runner, pieces) -> int:
        """Kernels (CUDA) or top-level operators (CPU) of one eager static step of `runner`."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.dev.type == "cuda"
        graphs, runner.graphs = runner.graphs, False
        try:
            runner.execute_step(pieces)
            self.sync()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                runner.execute_step(pieces)
                self.sync()
        finally:
            runner.graphs = graphs
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return sum(1 for e in prof.events() if e.device_type == kind and (cuda or e.cpu_parent is None))

    def _fused_tokens(self, rows: int, steps: int) -> dict:
        """Greedy decoding in float32 through a plain static runner and a fused one from the same random cache:
        the tokens of both, and the largest logit difference at equal inputs."""
        from ciar.engine.runner import ModelRunner
        from ciar.models.gpt import fuse_feed_forward

        saved = self.dtype, self._gpt
        self.dtype, self._gpt = torch.float32, None
        try:
            model = self.gpt()
            c = model.config
            start = c.cls_token_num + (TINY_POS if self.tiny else 200)
            first = torch.randint(0, c.vocab_size, (rows // 2,), generator=torch.Generator().manual_seed(1)).tolist()
            runs, logits = {}, {}
            for way in ("static", "fused"):
                runner = ModelRunner(model, rows, static=True, fused=way == "fused")
                _random_cache(runner.cache, 2, self.dev)  # the same earlier keys for both
                runner.cache.key_valid.fill_(True)
                tok, seqs, lg = list(first), [], []
                try:
                    for i in range(steps):
                        o = runner.execute_step(_cfg_pieces(rows, start + i, 1, [[t] for t in tok]))
                        cond = o.logits.view(rows // 2, 2, -1)[:, 0]
                        lg.append(cond.float())
                        tok = cond.argmax(-1).tolist()
                        seqs.append(tok)
                finally:
                    fuse_feed_forward(model, False)
                runs[way], logits[way] = seqs, lg
                del runner
            same = sum(a == b for ra, rb in zip(runs["static"], runs["fused"]) for a, b in zip(ra, rb))
            first_diff = next((i for i, (ra, rb) in enumerate(zip(runs["static"], runs["fused"])) if ra != rb), None)
            gap = max(float((a - b).abs().max()) for a, b in zip(logits["static"][:first_diff or steps],
                                                                 logits["fused"][:first_diff or steps]))
            return {"rows": rows, "steps": steps, "tokens_equal": same, "tokens": steps * (rows // 2),
                    "identical": runs["static"] == runs["fused"], "max_logit_diff_before_any_token_differs": gap}
        finally:
            self.dtype, self._gpt = saved
            self.release()

    @torch.inference_mode()
    def graphs(self) -> dict:
        """Greedy decode, eager at the engine's key length vs graph replays at a fixed one: the same tokens?"""
        model = self.gpt()
        c = model.config
        rows, steps = (2, 6) if self.tiny else (8, 24)
        start = c.cls_token_num + (TINY_POS if self.tiny else 200)
        kv_max = start + steps
        torch.manual_seed(1)
        first = torch.randint(0, c.vocab_size, (rows,), device=self.dev)

        def run(use_graph: bool) -> tuple[list[list[int]], float]:
            cache = model.new_cache(rows)
            _random_cache(cache, 2, self.dev)  # the cache's earlier positions: the same random keys for both runs
            tok = torch.zeros(rows, 1, dtype=torch.long, device=self.dev)
            pos = torch.zeros(rows, 1, dtype=torch.long, device=self.dev)
            tok[:, 0] = first
            if use_graph:
                def fn():
                    return model.logits(model.forward_cached(cache, model.tok_embeddings(tok), pos, None,
                                                             kv_len=kv_max))

                pos.fill_(start)
                replay, logits = self._graph(fn)
            seqs, gaps = [], 0.0
            for i in range(steps):
                pos.fill_(start + i)
                if use_graph:
                    replay()
                    lg = logits
                    same = model.logits(model.forward_cached(cache, model.tok_embeddings(tok), pos, None,
                                                             kv_len=kv_max))  # eager at the graph's shape
                    gaps = max(gaps, float((same.float() - lg.float()).abs().max()))
                else:
                    lg = model.logits(model.forward_cached(cache, model.tok_embeddings(tok), pos, None,
                                                           kv_len=start + i + 1))
                nxt = lg[:, -1].float().argmax(-1)
                seqs.append(nxt.tolist())
                tok[:, 0] = nxt
            return [list(r) for r in zip(*seqs)], gaps

        if self.dev.type != "cuda":
            eager, _ = run(False)
            return {"rows": rows, "steps": steps, "graphs": "no CUDA device: not captured", "eager_tokens": eager}
        eager, _ = run(False)
        graph, gap = run(True)
        same = sum(a == b for ra, rb in zip(eager, graph) for a, b in zip(ra, rb))
        return {"rows": rows, "steps": steps, "tokens_equal": same, "tokens_total": rows * steps,
                "identical": eager == graph, "max_logit_diff_at_equal_shape": gap}

    @torch.inference_mode()
    def t5(self) -> dict:
        from transformers import T5Config, T5EncoderModel

        from ciar.capacity.gpu_model import FLAN_T5_XL

        cfg = dict(FLAN_T5_XL)
        if self.tiny:
            cfg.update(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100)
        torch.manual_seed(0)
        with torch.device(self.dev):
            enc = T5EncoderModel(T5Config(**cfg)).to(self.dtype).eval()
        positions = 16 if self.tiny else 120
        out = {"positions": positions, "params": sum(p.numel() for p in enc.parameters())}
        for n in (1, 16):
            ids = torch.randint(2, cfg["vocab_size"], (n, positions), device=self.dev)
            mask = torch.ones_like(ids)
            out[f"encode_{n}_ms"] = round(self.time_ms(lambda: enc(input_ids=ids, attention_mask=mask)), 3)
        del enc
        return out

    @torch.inference_mode()
    def hf_llama(self) -> dict:
        """HF Llama at GPT-XL's shape: one-token decode after a 376-position prefill, dynamic and static cache."""
        from transformers import LlamaConfig, LlamaForCausalLM

        c = self.gpt().config
        cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden,
                          num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                          num_key_value_heads=c.kv_heads, max_position_embeddings=1024, tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(self.dev):
            hf = LlamaForCausalLM(cfg).to(self.dtype).eval()
        prefix = c.cls_token_num + (TINY_POS if self.tiny else IMAGE_POS)
        out = {"prefix": prefix, "by_batch": {}, "note": "ms per one-token step, positions advancing after a "
               "prefill of `prefix` positions; ours: the same step in xl_steps (its keys: prefix + 1)"}
        steps = 3 if self.tiny else 20
        for batch in (1, 16):
            row = {}
            ids = torch.randint(0, c.vocab_size, (batch, prefix), device=self.dev)
            nxt = torch.zeros(batch, 1, dtype=torch.long, device=self.dev)

            def decode_ms(cache) -> float:
                """Milliseconds per one-token step over `steps` steps after the prefill (positions advance)."""
                hf(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prefix, device=self.dev),
                   use_cache=True)
                hf(input_ids=nxt, past_key_values=cache, cache_position=torch.tensor([prefix], device=self.dev),
                   use_cache=True)  # warm-up step (then overwritten at the same position by the static cache)
                self.sync()
                t = time.perf_counter()
                for i in range(1, steps + 1):
                    hf(input_ids=nxt, past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([prefix + i], device=self.dev))
                self.sync()
                return round(1000 * (time.perf_counter() - t) / steps, 3)

            try:
                from transformers import DynamicCache

                try:
                    dynamic = DynamicCache(config=cfg)
                except TypeError:
                    dynamic = DynamicCache()
                row["dynamic_cache_ms"] = decode_ms(dynamic)
            except Exception as e:  # noqa: BLE001 - the cache API moves between transformers versions
                row["dynamic_cache_ms"] = f"broke: {type(e).__name__}: {e}"
            try:
                from transformers import StaticCache

                try:
                    static = StaticCache(config=cfg, max_batch_size=batch, max_cache_len=prefix + steps + 8,
                                         device=self.dev, dtype=self.dtype)
                except TypeError:
                    static = StaticCache(config=cfg, max_cache_len=prefix + steps + 8)
                row["static_cache_ms"] = decode_ms(static)
            except Exception as e:  # noqa: BLE001
                row["static_cache_ms"] = f"broke: {type(e).__name__}: {e}"
            ours = next((s for s in self.result["sections"].get("xl_steps", {}).get("steps", [])
                         if s["kind"] == "decode" and s["rows"] == batch), None)
            if ours is None:  # tiny rows differ: time ours here at this batch
                model = self.gpt()
                cache = model.new_cache(batch)
                fn, _, _ = self._step_fn(model, cache, batch, 1, prefix, prefix + 1)
                row["ours_eager_ms"] = round(self.time_ms(fn), 3)
            else:
                row["ours_eager_ms"] = ours["eager_ms"]
                if "graph_ms" in ours:
                    row["ours_graph_ms"] = ours["graph_ms"]
            out["by_batch"][str(batch)] = row
        del hf
        self.release()
        return out

    def _span_sessions(self, sessions: int, prefix: int, burst: int = 0):
        """The engine sections' seeded sessions on the suite's GPT: their OPENs (`prefix` cloud tokens each) and
        caption embeddings, and spans(ids) -> a VERIFY of SPAN - 1 random drafts (uniform draft distributions) per
        session id, from a draw stream of its own."""
        from ciar.decoding.sampling import SamplingParams
        from ciar_device.wire import OpenRequest, VerifyRequest

        c = self.gpt().config
        k = SPAN - 1
        sampling = SamplingParams(cfg_scale=4.0)
        emb = torch.randn(sessions, c.cls_token_num, c.caption_dim, generator=torch.Generator().manual_seed(0))
        opens = [OpenRequest(f"s{i}", "", i, sampling, prefix, want_caption=False) for i in range(sessions)]
        g = torch.Generator().manual_seed(3)

        def spans(ids):
            return [VerifyRequest(f"s{i}", torch.zeros(0, dtype=torch.long),
                                  torch.randint(0, c.vocab_size, (k,), generator=g),
                                  torch.full((k, c.vocab_size), 1.0 / c.vocab_size, dtype=torch.float16),
                                  burst=burst) for i in ids]

        return opens, emb, spans

    @torch.inference_mode()
    def engine(self) -> dict:
        """16 sessions' spans through the real verifier: one session per step vs all in one step."""
        from ciar.engine.verifier import CloudVerifier

        sessions = 4 if self.tiny else 16
        v = CloudVerifier(self.gpt(), None, max_sessions=sessions)
        reqs, emb, spans = self._span_sessions(sessions, 8 if self.tiny else 64)
        t = time.perf_counter()
        v.open_batch(reqs, caption_emb=emb)
        self.sync()
        open_s = time.perf_counter() - t
        rounds = 2 if self.tiny else 4
        self.sync()
        t = time.perf_counter()
        n_one = 0
        for _ in range(rounds):
            for i in range(sessions):
                v.verify_batch(spans([i]))
                n_one += 1
        self.sync()
        one_s = time.perf_counter() - t
        t = time.perf_counter()
        n_all = 0
        for _ in range(rounds):
            v.verify_batch(spans(range(sessions)))
            n_all += sessions
        self.sync()
        all_s = time.perf_counter() - t
        return {"sessions": sessions, "open_all_s": round(open_s, 3), "span_drafts": SPAN - 1,
                "spans_per_s_one_at_a_time": round(n_one / one_s, 1),
                "spans_per_s_all_in_one_step": round(n_all / all_s, 1),
                "batching_gain": round((n_all / all_s) / (n_one / one_s), 2)}

    @torch.inference_mode()
    def engine_graphs(self) -> dict:
        """The engine's own runner (`ciar.engine.runner`) on the XL model, three ways on the same seeded sessions
        (opens with prefix tokens, rounds of spans with bursts): dynamic eager steps, static (bucketed) eager steps,
        and static steps replayed from CUDA graphs. Replies (tokens) compared; spans/s with every session in one
        step (the rounds after the first, which warms up: its seconds apart) and with one session at a time."""
        from benchmarks.engine_capacity import StepSplit
        from ciar.engine.verifier import CloudVerifier

        sessions, rounds, prefix = (4, 2, 8) if self.tiny else (16, 4, 64)
        cuda = self.dev.type == "cuda"
        out: dict = {"sessions": sessions, "rounds": rounds, "prefix": prefix, "span_drafts": SPAN - 1}
        replies = {}
        for way in ["dynamic", "static"] + (["graphs"] if cuda else []):
            v = CloudVerifier(self.gpt(), None, max_sessions=sessions, static=(way != "dynamic"))
            if way == "static" and cuda:
                v.runner.graphs = False  # eager static steps on the GPU: what the graphs replay, launched one by one
            if way == "graphs":
                t = time.perf_counter()
                out["graphs_captured"] = v.runner.capture(2 * sessions, widths=(1, 8))
                self.sync()
                out["capture_s"] = round(time.perf_counter() - t, 2)
            reqs, emb, spans = self._span_sessions(sessions, prefix, burst=2)  # the same sessions every way
            got = [r.prefix_tokens.tolist() for r in v.open_batch(reqs, caption_emb=emb)]
            self.sync()
            split = StepSplit(v, self.sync)
            t = time.perf_counter()
            for i in range(rounds):
                if i == 1:  # the first round warms up (with graphs, replays its buckets first): not in the rate
                    self.sync()
                    first_s, t = time.perf_counter() - t, time.perf_counter()
                split.on = i > 0
                got += [(r.num_accepted, r.next_token, r.num_burst) for r in v.verify_batch(spans(range(sessions)))]
            self.sync()
            all_s = time.perf_counter() - t
            split.remove()
            t = time.perf_counter()
            for i in range(sessions):
                got += [(r.num_accepted, r.next_token, r.num_burst) for r in v.verify_batch(spans([i]))]
            self.sync()
            one_s = time.perf_counter() - t
            replies[way] = got
            out[way] = {"spans_per_s_all_in_one_step": round((rounds - 1) * sessions / all_s, 1),
                        "first_round_s": round(first_s, 3),
                        "spans_per_s_one_at_a_time": round(sessions / one_s, 1),
                        "forwards_by_path": dict(v.runner.steps),
                        "ms_per_step_after_warmup": split.report()}
            del v
            self.release()
        for a, b in (("static", "dynamic"), ("graphs", "static"), ("graphs", "dynamic")):
            if a in replies:
                same = sum(x == y for x, y in zip(replies[a], replies[b]))
                out[f"{a}_vs_{b}"] = {"replies_equal": same, "replies": len(replies[a]),
                                      "identical": replies[a] == replies[b]}
        return out

    @torch.inference_mode()
    def compiled_judge(self) -> dict:
        """The judge compiled (`ciar.engine.judge.Judge(compiled=True)`: its draws and exact-rule spans by
        `torch.compile`d functions) against the eager judge on one verifier (static steps, graphs captured once on
        CUDA): the compilations at start-up (`Judge.warm`), then for each way the same seeded sessions at each load
        (opens with a cloud prefix, rounds of spans with bursts): spans/s with every session in one step, each step
        split into forward, judge and host ms after a warm-up round, the compilations the measured rounds still
        made, and the replies compared (its probabilities equal the eager ones to the last bits only)."""
        from benchmarks.engine_capacity import StepSplit
        from ciar.decoding.sampling import SamplingParams
        from ciar.engine.judge import Judge
        from ciar.engine.verifier import CloudVerifier

        loads, rounds, prefix = ((4,), 2, 8) if self.tiny else ((16, 64), 4, 32)
        cuda = self.dev.type == "cuda"
        v = CloudVerifier(self.gpt(), None, max_sessions=max(loads))
        out: dict = {"loads": list(loads), "rounds": rounds, "prefix": prefix, "span_drafts": SPAN - 1}
        if cuda:
            t = time.perf_counter()
            out["graphs_captured"] = v.runner.capture(2 * max(loads), widths=(1, 8))
            self.sync()
            out["capture_s"] = round(time.perf_counter() - t, 2)
        replies: dict = {}
        for way in ("eager", "compiled"):
            v.judge = Judge(v.cloud, compiled=way == "compiled")
            t = time.perf_counter()
            warmed = v.judge.warm(SamplingParams(cfg_scale=4.0), SPAN - 1)  # the sessions' sampling (_span_sessions)
            self.sync()
            res: dict = {"warm_steps": warmed, "warm_s": round(time.perf_counter() - t, 2)}
            for n in loads:
                reqs, emb, spans = self._span_sessions(n, prefix, burst=2)  # the same sessions both ways
                got = [r.prefix_tokens.tolist() for r in v.open_batch(reqs, caption_emb=emb)]
                split = StepSplit(v, self.sync)
                graphs0 = _compiled_graphs()
                self.sync()
                t = time.perf_counter()
                for i in range(rounds):
                    split.on = i > 0  # the first round warms up
                    got += [(r.num_accepted, r.next_token, r.burst_tokens.tolist() if r.num_burst else [])
                            for r in v.verify_batch(spans(range(n)))]
                self.sync()
                wall = time.perf_counter() - t
                split.remove()
                for r in reqs:
                    v.close(r.session_id)
                replies[way, n] = got
                res[f"sessions_{n}"] = {"spans_per_s_all_in_one_step": round(rounds * n / wall, 1),
                                        "compiled_in_rounds": _compiled_graphs() - graphs0,
                                        "ms_per_step_after_warmup": split.report()}
            out[way] = res
        for n in loads:
            a, b = replies["compiled", n], replies["eager", n]
            out[f"sessions_{n}_replies_equal"] = {"equal": sum(x == y for x, y in zip(a, b)), "replies": len(a)}
            e, c = (out[w][f"sessions_{n}"]["ms_per_step_after_warmup"] for w in ("eager", "compiled"))
            if e and c:
                out[f"sessions_{n}_compiled_vs_eager"] = {k: round(c[k] / e[k], 3) for k in ("step", "judge")
                                                          if e[k] > 0}
        del v
        self.release()
        return out

    @torch.inference_mode()
    def overlap(self) -> dict:
        """The engine's overlap (`StepEngine(overlap=True)`: a step's decisions read after the next forward is
        launched) against the engine without it, on one verifier (graphs captured once) and the same seeded load:
        `sessions` sessions opened at once with a cloud prefix (one-token decodes: the cloud-only load), then rounds
        of spans with bursts (the CIAR load). Per way and phase: the replies (compared), tokens and spans per
        second, steps, ms per step, the decodes run ahead; on CUDA the accelerator's busy share (the union of its
        kernels' times over the window from the first kernel to the last, torch.profiler's CUDA activity) and the
        synchronising calls per step (`torch.cuda.set_sync_debug_mode`: every one waits for the accelerator)."""
        from ciar.engine.verifier import CloudVerifier

        sessions, prefix, rounds, burst = (4, 8, 2, 2) if self.tiny else (64, 48, 4, 4)
        cuda = self.dev.type == "cuda"
        v = CloudVerifier(self.gpt(), None, max_sessions=sessions)
        out: dict = {"sessions": sessions, "prefix": prefix, "rounds": rounds, "burst": burst,
                     "span_drafts": SPAN - 1}
        if cuda:
            t = time.perf_counter()
            out["graphs_captured"] = v.runner.capture(2 * sessions, widths=(1, 8))
            self.sync()
            out["capture_s"] = round(time.perf_counter() - t, 2)
        replies = {}

        def load(profiled: bool) -> tuple[dict, list]:
            """The seeded sessions' prefixes, then their rounds of spans, timed per phase; their replies; then
            closed."""
            reqs, emb, spans = self._span_sessions(sessions, prefix, burst=burst)  # the same sessions every time
            res, got = {}, []
            for phase in ("decodes", "spans"):
                steps0, ahead0 = v.engine.steps, dict(v.engine.ahead)

                def run():
                    if phase == "decodes":
                        return [r.prefix_tokens.tolist() for r in v.open_batch(reqs, caption_emb=emb)]
                    return [(r.num_accepted, r.next_token, r.burst_tokens.tolist() if r.num_burst else [])
                            for _ in range(rounds) for r in v.verify_batch(spans(range(sessions)))]

                self.sync()
                t = time.perf_counter()
                if profiled:
                    busy, syncs, kernels, part = self._busy_share(run)
                else:
                    part = run()
                self.sync()
                wall = time.perf_counter() - t
                got += part
                steps = v.engine.steps - steps0
                if profiled:
                    res[phase] = {"busy_share": busy, "kernels_profiled": kernels,
                                  "syncs_per_step": round(syncs / max(steps, 1), 2)}
                else:
                    made = sessions * prefix if phase == "decodes" else rounds * sessions  # tokens, or spans
                    res[phase] = {"s": round(wall, 3), "steps": steps,
                                  "ms_per_step": round(1e3 * wall / max(steps, 1), 2), "per_s": round(made / wall, 1),
                                  "ahead_run": v.engine.ahead["run"] - ahead0["run"],
                                  "ahead_dropped": v.engine.ahead["dropped"] - ahead0["dropped"]}
            for r in reqs:
                v.close(r.session_id)
            return res, got

        for way, overlap in (("warmup", False), ("plain", False), ("overlap", True)):
            v.engine.overlap = overlap
            res, replies[way] = load(False)
            if way == "warmup":
                continue
            out[way] = res
            if cuda:  # again under the profiler and the sync debug mode (their own costs kept out of the timing)
                for phase, extra in load(True)[0].items():
                    res[phase].update(extra)
        out["replies_identical"] = replies["overlap"] == replies["plain"]
        out["replies_equal"] = sum(a == b for a, b in zip(replies["overlap"], replies["plain"]))
        out["replies"] = len(replies["plain"])
        for phase in ("decodes", "spans"):
            out[f"{phase}_overlap_vs_plain"] = round(out["overlap"][phase]["per_s"] / out["plain"][phase]["per_s"], 3)
        del v
        self.release()
        return out

    def _busy_share(self, fn):
        """fn() under torch.profiler (CUDA activity only) and the sync debug mode -> (the accelerator's busy share:
        its kernels' union over the span from the first to the last, the synchronising calls warned of, the kernels
        the profiler saw, fn's result)."""
        import warnings

        from torch.profiler import ProfilerActivity, profile

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    result = fn()
                    self.sync()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        return busy_share(spans), syncs, len(spans), result

    @torch.inference_mode()
    def memory(self) -> dict:
        """The Verifier's start-up on a GPU (serve_config.gpu.yaml's settings): the KV cache sized from the GPU's memory
        (`max_sessions="auto"`) with the XL model loaded and allocated, every CUDA-graph bucket captured, then the
        largest steps the scheduler allows run beside them (the activation profile's promise: no out-of-memory
        error)."""
        from ciar.engine.runner import profile_activations
        from ciar.engine.scheduler import SchedulerConfig
        from ciar.engine.verifier import CloudVerifier

        model = self.gpt()
        sched = SchedulerConfig(token_budget=16384, max_works=64) if not self.tiny else SchedulerConfig(64, 4)
        self.release()
        v = CloudVerifier(model, None, max_sessions="auto", scheduler=sched)  # as the Verifier starts on a GPU
        out = {"plan": v.memory.to_dict(), "scheduler": sched.__dict__}
        if self.dev.type != "cuda":  # (no accelerator: "auto" is a fixed count, and there is nothing to capture)
            return out
        out["sessions"] = v.table.max_sessions
        out["kv_cache_gib"] = round(v.cache.memory_bytes() / 2**30, 2)
        t = time.perf_counter()
        out["graphs_captured"] = v.runner.capture(2 * sched.max_works)  # every bucket, as at start-up
        out["capture_s"] = round(time.perf_counter() - t, 1)
        free, total = torch.cuda.mem_get_info()
        out["free_gib_after_allocation"] = round(free / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
        profile_activations(model, sched.token_budget, 2 * sched.max_works)  # the largest steps, beside the cache
        out["peak_gib_with_largest_steps"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["total_gib"] = round(total / 2**30, 2)
        del v
        self.release()
        return out

    @torch.inference_mode()
    def profile(self) -> dict:
        """Where a one-token XL step's time goes: the kernels of one decode step at 1 and 8 rows, launched eagerly
        and replayed from a CUDA graph (torch.profiler): how many, their GPU time in all, the largest by name. The
        gap between the graph's replay time and its kernels' sum is the launches' cost; the kernels' sum against
        the bandwidth bound is what fusing them could still win. (On the CPU: the operators' own time.)"""
        from torch.profiler import ProfilerActivity, profile

        model = self.gpt()
        c = model.config
        cuda = self.dev.type == "cuda"
        pos0 = c.cls_token_num + (TINY_POS if self.tiny else IMAGE_POS)
        out: dict = {"image_position": pos0 - c.cls_token_num, "by_rows": {}}
        for rows in ((1,) if self.tiny else (1, 8)):
            cache = model.new_cache(rows)
            fn, _, _ = self._step_fn(model, cache, rows, 1, pos0, pos0 + 1)
            ways = {"eager": fn}
            if cuda:
                ways["graph"] = self._graph(fn)[0]
            row = {}
            for way, call in ways.items():
                call()
                self.sync()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    t = time.perf_counter()
                    call()
                    self.sync()
                    wall = time.perf_counter() - t
                kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
                by_name: dict[str, list] = {}
                for e in prof.events():
                    if e.device_type == kind and (cuda or e.cpu_parent is None):
                        n = by_name.setdefault(e.name[:90], [0, 0.0])
                        n[0] += 1
                        n[1] += e.time_range.elapsed_us()
                total_us = sum(v[1] for v in by_name.values())
                top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
                row[way] = {"wall_ms": round(1000 * wall, 3), "kernels": sum(v[0] for v in by_name.values()),
                            "kernel_ms": round(total_us / 1000, 3),
                            "top": [{"name": k, "calls": v[0], "ms": round(v[1] / 1000, 3)} for k, v in top]}
            out["by_rows"][str(rows)] = row
            del cache
            self.release()
        return out

    def fp32(self) -> dict:
        """`graphs` and `engine_graphs` again in float32: in bfloat16 a kernel that sums in another order (a padded
        shape, a graph's fixed key length) moves logits by rounding, and sampled tokens with them; in float32 the
        paths must agree to rounding (a bug in the graph path would not)."""
        if self.dtype == torch.float32:
            return {"skipped": "the suite already runs in float32 here"}
        saved = self.dtype, self._gpt
        self.dtype, self._gpt = torch.float32, None
        self.release()
        try:
            return {"graphs": self.graphs(), "engine_graphs": self.engine_graphs(), "oom": self.oom()}
        finally:
            self.dtype, self._gpt = saved
            self.release()

    @torch.inference_mode()
    def repeat(self) -> dict:
        """Is one forward bit-repeatable on this device? The same cached step (decode at 8 rows, a span at 32 rows,
        a 64-position prefill chunk at 32 rows) run 3 times on the same inputs, logits compared bit for bit, under
        torch's defaults and with each suspect switched off: bf16 GEMMs' reduced-precision reductions, the cuDNN
        attention backend, and with torch's deterministic algorithms on."""
        model = self.gpt()
        c = model.config
        pos0 = c.cls_token_num + (TINY_POS if self.tiny else 100)
        shapes = {"decode_8x1": (8, 1), "span_32x5": (32, 5), "prefill_32x64": (32, 64)}
        if self.tiny:
            shapes = {"decode_2x1": (2, 1), "span_4x5": (4, 5)}

        out: dict = {"cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
        for name in ("default", "no_reduced_precision_reduction", "no_cudnn_attention", "deterministic_algorithms"):
            row = {}
            with _variant(name, self.dev.type == "cuda"):
                for label, (rows, width) in shapes.items():
                    cache = model.new_cache(rows)
                    g = torch.Generator(device=self.dev).manual_seed(5)
                    for k in cache.k:
                        k.copy_(torch.randn(k.shape, generator=g, device=self.dev).to(k.dtype))
                    for v in cache.v:
                        v.copy_(torch.randn(v.shape, generator=g, device=self.dev).to(v.dtype))
                    fn, _, _ = self._step_fn(model, cache, rows, width, pos0, pos0 + width)
                    first = fn().float().clone()
                    diffs = [float((fn().float() - first).abs().max()) for _ in range(2)]
                    row[label] = {"bit_identical": max(diffs) == 0.0, "max_diff": max(diffs)}
                    del cache
            out[name] = row
            self.release()
        return out

    @torch.inference_mode()
    def engine_repeat(self) -> dict:
        """Two fresh verifiers on the same model, the same sessions and spans (`_rounds`, dynamic path): the same
        replies? Under torch's defaults, without bf16 GEMMs' reduced-precision reductions, and with torch's
        deterministic algorithms (CUBLAS_WORKSPACE_CONFIG must be set before the process starts: recorded)."""
        sessions, prefix = (4, 8) if self.tiny else (16, 64)
        out: dict = {"cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "dtype": str(self.dtype)}
        for name in ("default", "no_reduced_precision_reduction", "deterministic_algorithms"):
            with _variant(name, self.dev.type == "cuda"):
                a = self._rounds(sessions, prefix, False)["replies"]
                b = self._rounds(sessions, prefix, False)["replies"]
            out[name] = {"replies_equal": sum(x == y for x, y in zip(a, b)), "replies": len(a)}
        return out

    @torch.inference_mode()
    def engine_bisect(self) -> dict:
        """Where two fresh verifiers' replies part (see `engine_repeat`): every runner step of both recorded (the
        pieces fed: slots, positions, tokens; the logits returned), and the first step whose inputs or outputs
        differ reported, with how much."""
        from ciar.engine.verifier import CloudVerifier

        sessions, prefix = (4, 8) if self.tiny else (16, 64)
        logs = []
        for _ in range(2):
            v = CloudVerifier(self.gpt(), None, max_sessions=sessions, static=False)
            log: list = []
            execute = v.runner.execute_step

            def recorded(pieces, execute=execute, log=log):
                step = execute(pieces)
                outs = step.views
                ins = [(tuple(p.slots), p.start, p.n, tuple(p.tokens or ()), tuple(p.want),
                        None if p.emb is None else float(p.emb.float().abs().sum()),
                        tuple(float(e.float().abs().sum()) for _, e in p.extra)) for p in pieces]
                got = [None if not isinstance(o, tuple) or o[0] is None else o[0].float().cpu() for o in outs]
                log.append((ins, got))
                return step

            v.runner.execute_step = recorded
            reqs, emb, spans = self._span_sessions(sessions, prefix, burst=2)
            v.open_batch(reqs, caption_emb=emb)
            v.verify_batch(spans(range(sessions)))
            logs.append(log)
            del v
            self.release()
        a, b = logs
        out: dict = {"steps": [len(a), len(b)], "first_input_difference": None, "first_output_difference": None,
                     "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled()}
        for i, ((ia, oa), (ib, ob)) in enumerate(zip(a, b)):
            if ia != ib and out["first_input_difference"] is None:
                out["first_input_difference"] = {"step": i, "pieces": len(ia),
                                                 "differing_pieces": sum(x != y for x, y in zip(ia, ib))}
            if out["first_output_difference"] is None:
                diffs = [float((x - y).abs().max()) if x is not None and y is not None and x.shape == y.shape
                         else (0.0 if x is None and y is None else float("inf")) for x, y in zip(oa, ob)]
                if any(d > 0 for d in diffs):
                    out["first_output_difference"] = {"step": i, "inputs_equal": ia == ib, "pieces": len(ia),
                                                      "differing_pieces": sum(d > 0 for d in diffs),
                                                      "max_diff": max(diffs),
                                                      "piece_shapes": [(len(p[0]), p[2]) for p in ia][:8]}
        return out

    @torch.inference_mode()
    def dense_copy(self) -> dict:
        """One-token steps of at most `ciar.models.gpt._DENSE_MAX` rows copy their keys into a dense block before
        the attention on the devices in `_DENSE_DEVICES` (the CPU, where it was measured to help) when the block is
        at most `_DENSE_MAX_BYTES`: the XL decode
        step at 1 / 8 / 32 rows with the copy and without it on this device, eager and (CUDA) replayed from a
        graph."""
        import ciar.models.gpt as gpt

        saved = gpt._DENSE_DEVICES, gpt._DENSE_MAX_BYTES
        out: dict = {"dense_max": gpt._DENSE_MAX, "dense_devices": list(saved[0]), "dense_max_bytes": saved[1]}
        model = self.gpt()
        c = model.config
        pos0 = c.cls_token_num + (TINY_POS if self.tiny else IMAGE_POS)
        try:
            for label, devices in (("copy", (self.dev.type,)), ("no_copy", ())):
                gpt._DENSE_DEVICES, gpt._DENSE_MAX_BYTES = devices, math.inf  # (the copy arm copies every block)
                row = {}
                for rows in (TINY_ROWS if self.tiny else (1, 8, 32)):
                    cache = model.new_cache(rows)
                    fn, _, _ = self._step_fn(model, cache, rows, 1, pos0, pos0 + 1)
                    r = {"eager_ms": round(self.time_ms(fn), 3)}
                    if self.dev.type == "cuda":
                        r["graph_ms"] = round(self.time_ms(self._graph(fn)[0]), 3)
                    row[str(rows)] = r
                    del cache
                    self.release()
                out[label] = row
        finally:
            gpt._DENSE_DEVICES, gpt._DENSE_MAX_BYTES = saved
        return out

    @torch.inference_mode()
    def anole_shape(self) -> dict:
        """The verifier's forward at Anole-7b's shapes (issue 39): `ciar.models.gpt` at Chameleon-7B's decoder
        (32 layers x 4096, 32 heads, FFN 11008, 65,536-token vocabulary), random weights in the suite's dtype, a
        64-token prompt and 1,024 image tokens; decode and span steps near the image's end at 1 / 8 / 32 rows. Not
        Chameleon's module: its per-head q/k norms (a few small kernels a layer) are not in this model."""
        from ciar.models.gpt import build_gpt

        shape = (dict(TINY, block_size=64, vocab_size=128) if self.tiny else
                 dict(n_layer=32, dim=4096, n_head=32, vocab_size=65536, cls_token_num=64, block_size=1024))
        torch.manual_seed(0)
        self.release()
        with torch.device(self.dev):
            model = build_gpt("GPT-XL", **shape)
            torch.nn.init.normal_(model.output.weight, std=0.02)
        model = model.to(self.dtype).eval()
        try:
            out = self._steps(model, shape["block_size"] - 8, TINY_ROWS if self.tiny else (1, 8, 32))
            out["params"] = sum(p.numel() for p in model.parameters())
            return out
        finally:
            del model
            self.release()

    @torch.inference_mode()
    def _rounds(self, sessions: int, prefix: int, static, fill: bool = False) -> dict:
        """Fresh verifier: `sessions` open, two rounds of spans (the second after taking the memory when `fill`)."""
        from ciar.collab.protocol import ForwardFault
        from ciar.engine.verifier import CloudVerifier

        cuda = self.dev.type == "cuda"
        v = CloudVerifier(self.gpt(), None, max_sessions=sessions, static=static)
        reqs, emb, spans = self._span_sessions(sessions, prefix, burst=2)
        got: list = [r.prefix_tokens.tolist() for r in v.open_batch(reqs, caption_emb=emb)]
        first, second = spans(range(sessions)), spans(range(sessions))
        got += [(r.num_accepted, r.next_token) for r in v.verify_batch(first)]
        res: dict = {}
        if fill and cuda:
            self.sync()
            torch.cuda.empty_cache()
            filler = []
            for chunk in (1 << 30, 1 << 26, 1 << 21):  # 1 GiB, then 64 MiB, then 2 MiB pieces until none fits
                while True:
                    try:
                        filler.append(torch.empty(chunk, dtype=torch.uint8, device=self.dev))
                    except torch.OutOfMemoryError:
                        break
            res["free_mib_when_full"] = round(torch.cuda.mem_get_info()[0] / 2**20, 1)
            try:
                v.verify_batch(second)
                res["raised"] = None
            except ForwardFault as e:
                res["raised"] = f"ForwardFault: {e}"
                res["origin"] = type(e.origin).__name__
            except Exception as e:  # noqa: BLE001 - recorded: anything else is what this section looks for
                res["raised"] = f"{type(e).__name__}: {e}"
            del filler
            torch.cuda.empty_cache()
            res["faults"] = dict(v.engine.faults)
            res["open_sessions_after"] = len(v.table)
        got += [(r.num_accepted, r.next_token) for r in v.verify_batch(second)]
        res["replies"] = got
        del v
        self.release()
        return res


    @torch.inference_mode()
    def oom(self) -> dict:
        """A real out-of-memory error inside the verifier's forward (issue 40, item 3): sessions open and verify a
        round; then the accelerator's memory is taken (a filler, as another process or an oversubscribed cache
        would) and the next round's spans are sent: the step must fail those works only with a retryable
        ForwardFault, the verifier keep its sessions, and the same spans sent again once memory is back must give
        the replies of an undisturbed verifier. Run on the dynamic (eager) path and on the default (static, graphs)
        path. On the CPU (tiny) the filler cannot take the memory, so the fault is raised by the allocator hook
        only where CUDA exists: the section then checks the undisturbed replies alone."""
        from ciar.collab.protocol import ForwardFault
        from ciar.engine.verifier import CloudVerifier

        sessions, prefix = (4, 8) if self.tiny else (16, 64)
        cuda = self.dev.type == "cuda"
        out: dict = {"sessions": sessions}

        for name, static in (("dynamic", False), ("default", None)):
            ref = self._rounds(sessions, prefix, static)
            again = self._rounds(sessions, prefix, static)  # is an undisturbed verifier itself repeatable on this device?
            hit = self._rounds(sessions, prefix, static, fill=True)
            out[name] = {k: v for k, v in hit.items() if k != "replies"}
            out[name]["undisturbed_repeatable"] = again["replies"] == ref["replies"]
            out[name]["replies_identical_to_undisturbed"] = hit["replies"] == ref["replies"]
            out[name]["replies_equal"] = sum(a == b for a, b in zip(hit["replies"], ref["replies"]))
            out[name]["replies"] = len(ref["replies"])
        return out

    def capacity_measured(self) -> dict:
        """Phones per accelerator, measured: the real engine on its own thread under trace-driven phones, CIAR and
        cloud-only, with the capacity model's prediction beside every point (`benchmarks.engine_capacity`)."""
        from benchmarks.engine_capacity import METHODS

        return self._measured_phones(METHODS)

    def capacity_process(self) -> dict:
        """`capacity_measured`'s last load of each method again, with the engine core in a process of its own
        (`verifier_engine_process`): images/s and p99 beside the engine thread's at the same load."""
        from benchmarks.engine_capacity import METHODS, measure_process

        measured = self.result["sections"].get("capacity_measured", {}).get("points", {})
        loads = {m: measured[m][-1]["phones"] if measured.get(m) else (3 if self.tiny else self.capacity_loads[-1])
                 for m in METHODS}
        if self.tiny:
            out = measure_process(self, loads, warmup_s=0.0, duration_s=600.0, images=3, network="none")
        else:
            out = measure_process(self, loads, warmup_s=self.capacity_window[0], duration_s=self.capacity_window[1])
        for m, p in out["points"].items():  # beside the thread's
            if measured.get(m):
                thread = measured[m][-1]
                p["thread_images_per_s"], p["thread_latency_s"] = thread["images_per_s"], thread["latency_s"]
                p["process_over_thread_images_per_s"] = p["images_per_s"] / thread["images_per_s"] \
                    if p["images_per_s"] and thread["images_per_s"] else None
        return out

    def capacity_parallel(self) -> dict:
        """`capacity_measured` for the parallel-decoding phones (`benchmarks.engine_capacity.PARALLEL_METHODS`): SJD
        (cloud-only by Jacobi windows) and CIAR with its prefix and bursts by windows, on the same engine."""
        from benchmarks.engine_capacity import PARALLEL_METHODS

        return self._measured_phones(PARALLEL_METHODS)

    def _measured_phones(self, methods: tuple[str, ...]) -> dict:
        from benchmarks.engine_capacity import measure

        if self.tiny:  # a count of images, not a window: the same check on any machine
            return measure(self, loads=[1, 3], warmup_s=0.0, duration_s=600.0, images=3, network="none",
                           methods=methods)
        return measure(self, loads=self.capacity_loads, warmup_s=self.capacity_window[0],
                       duration_s=self.capacity_window[1], methods=methods)

    def capacity(self) -> dict:
        """The forward costs as ciar.capacity.gpu_model.forward_s reads them, with the overhead fitted per path."""
        from ciar.capacity.gpu_model import GPU, ModelShapes, overhead_gaps

        steps = self.result["sections"].get("xl_steps", {}).get("steps", [])
        if not steps:
            raise RuntimeError("no xl_steps to fit")
        shapes = ModelShapes.from_config(self.gpt().config)
        measured = GPU("measured", self.bandwidth, self.flops, 0.0, "benchmarks.gpu roofline")
        out = {"bandwidth": self.bandwidth, "peak_flops": self.flops}
        for path in ("eager", "graph"):
            gaps = overhead_gaps(measured, shapes, steps, f"{path}_ms")  # at the measured roofline
            if gaps:
                out[f"overhead_s_{path}"] = gaps[len(gaps) // 2]
                out[f"overhead_s_{path}_range"] = [gaps[0], gaps[-1]]
        out["how"] = ("ciar.capacity.gpu_model.forward_s(GPU(name, bandwidth, peak_flops, memory, source), shapes, "
                      "pieces, overhead_s): the overhead is the median of measured - modelled over the xl_steps")
        return out


def _steps_table(steps: list[dict]) -> list[str]:
    rows = ["| step | rows | keys | eager | graph | bandwidth bound | eager / bound | graph / bound |",
            "|---|---|---|---|---|---|---|---|"]
    for st in steps:
        rows.append(f"| {st['kind']} ({st['width']} pos) | {st['rows']} | {st['keys']} | {st['eager_ms']} | "
                    f"{st.get('graph_ms', '–')} | {st['bound_ms']} | {st['eager_over_bound']} | "
                    f"{st.get('graph_over_bound', '–')} |")
    return rows


def markdown(result: dict) -> str:
    s = result["sections"]
    env = s.get("env", {})
    lines = [f"# GPU suite: {env.get('gpu') or 'no GPU (' + str(env.get('device')) + ')'}", "",
             f"`{result['command']}`" + (" (tiny shapes: a test of the code, not a measurement)" if result["tiny"]
                                          else ""), ""]
    if env:
        lines += [f"torch {env.get('torch')}, transformers {env.get('transformers')}, dtype {env.get('dtype')}"
                  + (f", CUDA {env.get('cuda')}, {env.get('gpu_memory_gib')} GiB ({env.get('free_gib')} free)"
                     if env.get("gpu") else ""), ""]
    r = s.get("roofline", {})
    if "copy_bandwidth_gb_s" in r:
        lines += [f"Measured: copy bandwidth {r['copy_bandwidth_gb_s']} GB/s, {env.get('dtype')} matmul "
                  f"{r['matmul_tflops']} TFLOP/s "
                  f"(the H100 datasheet: {r['datasheet_h100']['bandwidth_gb_s']:.0f} GB/s, "
                  f"{r['datasheet_h100']['tflops']:.0f} TFLOP/s).", ""]
    for key, title in (("xl_steps", "LlamaGen-XL shapes"), ("anole_shape", "Anole-7b's shapes")):
        steps = s.get(key, {}).get("steps")
        if steps:
            lines += [f"## The verifier's forward at {title} (ms, median)", ""] + _steps_table(steps) + [""]
    for key, title in (("capacity_measured", "phones per accelerator, the real engine (measured)"),
                       ("capacity_parallel", "the parallel-decoding phones, the real engine (measured)")):
        if "points" in s.get(key, {}):
            from benchmarks.engine_capacity import markdown as capacity_table

            lines += [f"## {key}: {title}", ""] + capacity_table(s[key]) + [""]
    for name in ("overlap", "compiled_judge", "packed_step", "engine_process", "capacity_process", "slot_attention",
                 "engine_graphs",
                 "served_steps", "fused_step", "graphs", "fp32", "profile", "oom", "repeat", "engine_repeat",
                 "engine_bisect", "dense_copy", "capacity", "memory", "engine", "t5", "hf_llama"):
        if name in s:
            body = {k: v for k, v in s[name].items() if k != "traceback"}
            lines += [f"## {name}", "", "```json", json.dumps(body, default=str)[:4000], "```", ""]
    broke = [n for n, v in s.items() if "broke" in v]
    if broke:
        lines += [f"Sections that broke: {', '.join(broke)} (their errors are in gpu.json).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (the tests)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="sections not started by then are skipped")
    # the most needed first (a run cut by --budget-s skips the rest): the compiled judge (mended after Inductor broke
    # on it in 2026-11-29-gpu, not rerun since), the engine's steps split into forward, judge and host time, the
    # measured costs the capacity plan reads, phones per GPU as served (about 5 minutes), then what 2026-11-29-gpu
    # measured (the overlap, packed steps, the engine's process), the GPU start-up, comparisons
    ap.add_argument("--sections", default="env,compiled_judge,engine_graphs,served_steps,roofline,capacity_measured,"
                                          "fused_step,capacity_parallel,capacity_process,overlap,packed_step,"
                                          "engine_process,slot_attention,"
                                          "xl_steps,graphs,fp32,profile,capacity,memory,oom,repeat,engine_repeat,"
                                          "engine_bisect,dense_copy,anole_shape,engine,t5,hf_llama")
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="keep cuDNN's attention backend on (before 2026-11-26: not bit-repeatable on an H100 in bf16; "
                         "ciar.models.gpt.repeatable_attention switches it off, as the verifier does)")
    ap.add_argument("--capacity-loads", default="16,64,256,512", metavar="N,N,...",
                    help="capacity_measured / capacity_parallel: phones at each load point")
    ap.add_argument("--capacity-window", default="4,12", metavar="WARMUP_S,WINDOW_S",
                    help="capacity sections: each point's warm-up and measuring window, seconds")
    args = ap.parse_args(argv)
    try:
        loads = [int(x) for x in args.capacity_loads.split(",")]
        window = tuple(float(x) for x in args.capacity_window.split(","))
        if not loads or min(loads) < 1 or len(window) != 2 or min(window) < 0 or window[1] <= 0:
            raise ValueError
    except ValueError:
        ap.error(f"--capacity-loads takes phones > 0 (got {args.capacity_loads!r}) and --capacity-window "
                 f"WARMUP_S,WINDOW_S with a window > 0 (got {args.capacity_window!r})")
    from ciar.models.gpt import repeatable_attention

    if not args.cudnn_attention:
        repeatable_attention("cuda")  # as every verifier does (GPT.new_cache); the flag keeps the old kernels
    suite = Suite(args.out, args.tiny, args.budget_s)
    suite.capacity_loads, suite.capacity_window = loads, window
    if suite.dev.type != "cuda" and not args.tiny:
        print("no CUDA device: run with --tiny for the CPU check of the code, or on a GPU", file=sys.stderr)
        return 2
    with torch.no_grad():  # (not torch.set_grad_enabled(False): the caller's grad mode stays as it was)
        for name in args.sections.split(","):
            suite.section(name, getattr(suite, name))
    broke = [n for n, v in suite.result["sections"].items() if "broke" in v]
    print(f"wrote {args.out}/gpu.json and gpu.md" + (f"; broke: {', '.join(broke)}" if broke else ""))
    return 1 if broke else 0


if __name__ == "__main__":
    raise SystemExit(main())
