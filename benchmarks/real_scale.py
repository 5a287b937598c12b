"""LlamaGen-XL at its real sizes on this machine: random weights in the real layouts, loaded and run end to end.

    python -m benchmarks.real_scale --out DIR --results benchmarks/results/DATE/real_scale.json [--threads 1]
        [--images cloud,ciar] [--steps measure,images,serve,collab] [--gpt-dtype float32|bfloat16] [--prompt TEXT]
        [--keep] [--sizes real|real-512|tiny|tiny-1024|anole-7b|anole-tiny] [--rows 1,8,32]

`--sizes real` is LlamaGen-XL Stage I (`t2i_XL_stage1_256.pt`, 256 px, 16 x 16 = 256 image tokens), `real-512`
Stage II (`t2i_XL_stage2_512.pt`, the same GPT-XL at 512 px, 32 x 32 = 1,024 image tokens; run it with
`--steps measure`: a whole image takes hours on a CPU); `tiny` / `tiny-1024` the same steps on tiny widths at 4 x 4
and 32 x 32 tokens (the tests).

1. Write (into DIR, ~6.5 GB) RANDOM weights in the real formats and sizes, with `ciar.testing`'s writers: LlamaGen's
   t2i GPT-XL checkpoint (`{"model": state_dict}` .pt, float32 as LlamaGen releases it, 775 M parameters, 16 x 16
   tokens at 256 px, 32 x 32 at 512 px), the VQ-16 tokenizer .pt, a CIAR device model made from the GPT's first
   layer, and a T5 encoder folder with flan-t5-xl's config in bfloat16 (`save_pretrained`; the tokenizer is a
   word-level stand-in with T5's special tokens: flan-t5's sentencepiece file is not here, and the encoder always
   runs over its 120 padded positions, so the timing does not depend on it); and `DIR/world.yaml`, a LlamaGen
   world naming them (as `worlds/llamagen-xl-stage1.yaml` / `-stage2.yaml`, text_dtype bfloat16; the GPT's
   `gpt_dtype` is `--gpt-dtype`).
2. Measure, in a fresh process (its peak RSS is the replica's): `ciar.world.load_world` (GPT + VQ + T5 + device
   model) time and peak RSS; T5 encode time per caption; one verifier forward (`GPT.forward_cached`, the engine's
   call) over 1 / 8 / 32 rows (`--rows`) of a 5-position span (4 drafts + the committed token) at mid-image and at
   7/8 of the image (position 344 at Stage I, 1,016 at Stage II), logits included; the cloud's sampled step (one
   token, 2 CFG rows) at both; one VQ decode of a whole image (what each streamed preview costs too); the device
   model's one-token step (`DeviceModel.decode`, 2 CFG rows, last position only); the KV cache one session holds on
   the verifier (2 CFG rows, allocated up front for every `verifier_max_sessions` slot) and what
   `serve_config.gpu.yaml`'s `verifier_max_sessions` allocates at that size. Without a model: the forwards the
   verifier's scheduler takes to feed an open's caption and a resume of a whole image (caption + history) under
   the default `SchedulerConfig` and the Verifier configs of serve_config.yaml / serve_config.gpu.yaml, alone and
   beside 8 / 32 sessions verifying spans (`scheduler_plan`).
3. One image per method (`--images`, default cloud-only and CIAR) through `python -m ciar.generate --world
   DIR/world.yaml`, each in its own process: wall time, peak RSS, its stats. CIAR's knobs are given (the random
   device model is not calibrated): gate `lower`, tau 0.5, span 4, burst 2.
4. The same images through the real Serve application (`services.app:build_app`, CPU, `num_gpus: 0`: one Verifier
   replica with `--threads` torch threads, one Device replica, the Ingress), POST /v1/images/generations per
   method: deploy time (the replicas load the world), each request's seconds and stats, and each replica's peak
   RSS (its process sampled every second).
5. `benchmarks.collab` on 4 prompts (`CAPTIONS`, as a COCO-format captions file; `CALIBRATION` after them, the
   prompts it may calibrate on, unused with the knobs given), cloud-only and CIAR (the knobs above), in its own
   process.

A step that fails is recorded with its error (`broke`) and the others still run.

`--sizes anole-7b` is an Anole world (worlds/anole-7b.yaml) at Anole-7b's shapes, `anole-tiny` the same at tiny ones
(the test); only `--steps measure` (the default there: a whole image is 1,024 steps of a 7B decoder, hours on this
CPU; other steps are refused), rows 1 and 8, the decoder in bfloat16 unless `--gpt-dtype` says otherwise.
Step 1 writes (`ciar.testing.write_sharded_random_anole_files`, ~14 GB, tensor by tensor: memory of one tensor, not
the model) the transformers folder as `save_pretrained` shards Chameleon-7B (config.json with the 7B defaults and a
vocabulary map of 8,192 IMGIMG image tokens, three bfloat16 `model-0000K-of-00003.safetensors` with
`model.safetensors.index.json`, every key of `ChameleonForConditionalGeneration` including the VQ encoder the world
ignores, a BPE stand-in tokenizer.json), the taming VQGAN (ckpt + yaml, Chameleon's config) and a 1-layer device
model from the decoder's first layer. Step 2 measures as above, except: the prompt is tokenized (no text encoder);
the VQ decode and the device step come first, then the device model and the VQGAN are dropped (room for the 8-row
KV caches on this shared box) before the forwards, at positions 640 and 1,024 (128 prompt positions + 512 / 896);
a forward whose KV cache would leave the machine less than 1 GiB is not run (reported); the measuring process
waits for the memory its files need before it loads them, and sets its `oom_score_adj` to 1000.

Writes `--results` (JSON) and its Markdown beside it. The weights are random: the images are noise and the CIAR
acceptance rates mean nothing; the shapes, memory and times are those of the real models on this CPU, in the
dtypes the world file gives (T5 in bfloat16, the GPT in `--gpt-dtype`). DIR is removed
afterwards unless `--keep`. `--sizes tiny` runs the same steps on small shapes (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from benchmarks.collab import write_results  # imported now: a long run must not pick up code edited meanwhile

CAPTIONS = ["A red double-decker bus parked on a city street next to a tall building.",
            "Two dogs playing with a frisbee on a sunny beach.",
            "A bowl of pasta and a glass of wine on a wooden kitchen table.",
            "A man rides a surfboard on a large wave near the beach."]
CALIBRATION = ["A giraffe standing next to a tall tree.", "A laptop on a desk near a window.",
               "Children flying kites in a park.", "A white plate with a sandwich on a table."]
SPAN_WIDTH = 5  # 4 drafts + the committed-but-unfed token
CIAR_KNOBS = ["--gate", "lower", "--tau", "0.5", "--span", "4", "--burst", "2"]
# the files' shapes: LlamaGen-XL at 256 px with flan-t5-xl (the registry's GPT-XL and VQ-16), or tiny ones for tests
_TINY_GPT = dict(n_layer=2, dim=64, n_head=4, caption_dim=32, cls_token_num=32, vocab_size=64)
_TINY_VQ = dict(ch=16, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=1, z_channels=16, codebook_size=64)
SIZES = {
    # Stage I: t2i_XL_stage1_256.pt, 16 x 16 = 256 image tokens (worlds/llamagen-xl-stage1.yaml)
    "real": {"gpt_overrides": {}, "vq_overrides": {}, "image_size": 256, "t5": "flan-t5-xl"},
    # Stage II: t2i_XL_stage2_512.pt, the same GPT-XL at 512 px, 32 x 32 = 1,024 image tokens
    # (worlds/llamagen-xl-stage2.yaml)
    "real-512": {"gpt_overrides": {}, "vq_overrides": {}, "image_size": 512, "t5": "flan-t5-xl"},
    "tiny": {"gpt_overrides": _TINY_GPT, "vq_overrides": _TINY_VQ, "image_size": 64, "t5": None},
    # tiny widths at Stage II's token count (32 x 32 = 1,024 image tokens, 512 px images)
    "tiny-1024": {"gpt_overrides": _TINY_GPT, "vq_overrides": _TINY_VQ, "image_size": 512, "t5": None},
    # Anole-7b (worlds/anole-7b.yaml): Chameleon-7B's decoder in bfloat16 shards, its VQGAN (512 px, 32 x 32 = 1,024
    # image tokens of 8,192 codes), 128 prompt positions (ciar.testing.ANOLE_7B_SHAPES); measure only
    "anole-7b": {"kind": "anole", "shapes": "ANOLE_7B_SHAPES", "rows": "1,8"},
    # the same files at tiny shapes (ciar.testing.ANOLE_TINY_SHAPES: 4 x 4 image tokens at 32 px; the tests)
    "anole-tiny": {"kind": "anole", "shapes": "ANOLE_TINY_SHAPES", "rows": "1,8"},
}
ANOLE_STEPS = ("measure",)  # a whole Anole image is 1,024 steps of a 7B decoder: hours on this CPU


def checkpoint_name(image_size: int) -> str:
    """LlamaGen's name for its t2i GPT-XL checkpoint at this resolution (Stage I at 256 px, Stage II at 512)."""
    return "t2i_XL_stage2_512.pt" if image_size >= 512 else "t2i_XL_stage1_256.pt"


def _mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 1)


def peak_rss_mb() -> float:
    """This process's peak resident set: Linux's VmHWM (the high-water mark of this process's own memory map, new at
    exec), else ru_maxrss. Not ru_maxrss on Linux: a child's ru_maxrss starts at its parent's peak at the fork (it is
    kept across exec), so a measuring child of a parent that peaked higher reported the parent's figure."""
    peak = _status_mb("VmHWM")
    return peak if peak is not None else round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _status_mb(field: str) -> float | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in MB; None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def write_files(folder: str, sizes: str = "real", gpt_dtype: str = "float32") -> dict:
    """The random files (`SIZES[sizes]`) and the world file naming them -> what was written (paths, MB, seconds)."""
    import torch
    import yaml

    from ciar.capacity.gpu_model import FLAN_T5_XL
    from ciar.testing import make_tiny_t5, write_llamagen_checkpoints

    size = SIZES[sizes]
    if size.get("kind") == "anole":
        return write_anole_files(folder, size, gpt_dtype)
    grid = size["image_size"] // 16
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    gpt, vq, device = write_llamagen_checkpoints(folder, "GPT-XL", grid * grid, size["gpt_overrides"],
                                                 size["image_size"], size["vq_overrides"],
                                                 names=(checkpoint_name(size["image_size"]), "vq_ds16_t2i.pt",
                                                        "device.safetensors"))
    t1 = time.perf_counter()
    t5 = make_tiny_t5(os.path.join(folder, "t5-ckpt", "flan-t5-xl"),
                      config=FLAN_T5_XL if size["t5"] == "flan-t5-xl" else None, dtype=torch.bfloat16)
    t2 = time.perf_counter()
    world = {"kind": "llamagen", "gpt_checkpoint": gpt, "gpt_config": "GPT-XL", "image_size": size["image_size"],
             "vq_checkpoint": vq, "vq_config": "VQ-16", "text_encoder": t5, "text_dtype": "bfloat16",
             "gpt_dtype": gpt_dtype, "device_checkpoint": device,
             "sampling": {"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0}}
    if size["gpt_overrides"]:
        world["gpt_overrides"] = size["gpt_overrides"]
        world["vq_overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in size["vq_overrides"].items()}
    path = os.path.join(folder, "world.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(world, f, sort_keys=False)
    sizes = {name: _mb(os.path.getsize(p)) for name, p in (("gpt", gpt), ("vq", vq), ("device", device))}
    sizes["t5"] = _mb(sum(os.path.getsize(os.path.join(t5, n)) for n in os.listdir(t5)))
    return {"world_file": path, "file_mb": sizes, "write_s": {"gpt_vq_device": t1 - t0, "t5": t2 - t1}}


def write_anole_files(folder: str, size: dict, gpt_dtype: str) -> dict:
    """An Anole world's random files (`ciar.testing.write_sharded_random_anole_files` at `size["shapes"]`: the
    transformers folder's bfloat16 shards written tensor by tensor, the VQGAN, a 1-layer device model from the
    decoder's first layer) and `DIR/world.yaml` naming them (as worlds/anole-7b.yaml, `gpt_dtype` given)."""
    import yaml

    import ciar.testing as testing

    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    fields = testing.write_sharded_random_anole_files(folder, getattr(testing, size["shapes"]))
    t1 = time.perf_counter()
    world = {**fields, "gpt_dtype": gpt_dtype, "sampling": {"cfg_scale": 3.0, "temperature": 0.7, "top_k": 0,
                                                            "top_p": 0.9}}
    path = os.path.join(folder, "world.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(world, f, sort_keys=False)
    model = os.path.join(folder, fields["model"])
    shards = sorted(n for n in os.listdir(model) if n.endswith(".safetensors"))
    sizes = {"decoder": _mb(sum(os.path.getsize(os.path.join(model, n)) for n in shards)),
             "vq": _mb(os.path.getsize(os.path.join(folder, fields["vq_checkpoint"]))),
             "device": _mb(os.path.getsize(os.path.join(folder, fields["device_checkpoint"])))}
    return {"world_file": path, "file_mb": sizes, "decoder_shards": shards, "write_s": {"all": t1 - t0}}


def reused_files(folder: str, sizes: str, gpt_dtype: str) -> dict:
    """`--reuse`: the files already in `folder` (its world.yaml, whose `gpt_dtype` must be `gpt_dtype`) -> what
    write_files reports, with no write time and `reused` true."""
    import yaml

    path = os.path.join(folder, "world.yaml")
    with open(path) as f:
        world = yaml.safe_load(f)
    if world.get("gpt_dtype", "float32") != gpt_dtype:
        raise SystemExit(f"--reuse: {path} has gpt_dtype {world.get('gpt_dtype')}, not {gpt_dtype}")
    files = {}
    for root, _, names in os.walk(folder):
        for n in names:
            if n.endswith((".safetensors", ".pt", ".ckpt")):
                files[os.path.relpath(os.path.join(root, n), folder)] = _mb(os.path.getsize(os.path.join(root, n)))
    return {"world_file": path, "file_mb": files, "write_s": {}, "reused": True, "sizes": sizes}


def _timed_s(fn, reps: int) -> tuple[float, float]:
    """-> (median, fastest) seconds of `reps` calls after a warm-up. On a box shared with other jobs the median
    carries their load, the fastest repetition less of it."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(min(times))


def _median_s(fn, reps: int) -> float:
    return _timed_s(fn, reps)[0]


def forward_contexts(c) -> dict[str, int]:
    """Where the verifier forwards are timed: the span's first position at mid-image (Stage I's figure: 248) and at
    7/8 of the image (Stage II: 1,016, a span near position 1,000)."""
    return {"mid": c.cls_token_num + c.block_size // 2, "late": c.cls_token_num + c.block_size * 7 // 8}


def measure(world_file: str, reps: int, rows_list: tuple[int, ...] = (1, 8, 32)) -> dict:
    """Load the world and time its parts (this process is the replica: its peak RSS is reported).

    An Anole world (a 7B decoder) is measured in another order, for its memory on a shared box: the VQ decode and
    the device step first, then the device model and the VQGAN are dropped (the freed heap handed back to the
    system, `malloc_trim`) before the verifier forwards, whose 8-row KV caches at 7/8 of the image are 4 GiB beside
    the 13 GiB decoder. A Verifier replica (`services.verifier`) loads the whole world, so its resident set is the
    after-load figure plus its sessions' KV caches. This process also offers itself first to the OOM killer
    (`oom_score_adj` 1000): if the box runs out, it is the one to go, not another job's."""
    import gc

    import torch

    from ciar.models.chameleon import ChameleonGPT
    from ciar.world import load_world

    waited = _wait_for_memory(world_file)
    if waited is not None:  # an Anole world on this box: this process, not a neighbour, is the OOM killer's pick
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
    t0 = time.perf_counter()
    world = load_world(world_file, need_device=True, need_text=True)
    out = {"load_s": time.perf_counter() - t0, "peak_rss_after_load_mb": peak_rss_mb()}
    if waited is not None:
        out["waited_for_memory_s"] = waited
    cloud, c = world.cloud, world.cloud.config
    anole = isinstance(cloud, ChameleonGPT)
    vq_cfg = world.vq.config
    out["gpt"] = {"params": sum(p.numel() for p in cloud.parameters()), "dtype": str(cloud.tok_embeddings.weight.dtype),
                  "image_tokens": c.block_size, "grid": c.grid_size, "caption_positions": c.cls_token_num,
                  "image_size": getattr(vq_cfg, "image_size", None) or vq_cfg.resolution}
    if anole:
        out["gpt"].update(arch="chameleon", layers=c.n_layer, dim=c.dim, heads=c.n_head, kv_heads=c.kv_heads,
                          text_vocab=c.text_vocab_size, image_codes=c.vocab_size)
        out["prompt"] = {"encoder": "Chameleon BPE (the folder's tokenizer.json: token ids, no model)",
                         "positions": world.text.max_length}
        out["prompt_encode_s_per_caption"] = float(np.median([_median_s(lambda cap=cap: world.text.encode([cap]), 1)
                                                              for cap in CAPTIONS]))
    else:
        out["t5"] = {"params": sum(p.numel() for p in world.text.model.parameters()), "dtype": str(world.text.dtype),
                     "positions": world.text.max_length}
        out["t5_encode_s_per_caption"] = float(np.median([_median_s(lambda cap=cap: world.text.encode([cap]), 1)
                                                          for cap in CAPTIONS]))
    # what CloudVerifier allocates per session (two rows), up front (its shapes: on the meta device, nothing held)
    session = cloud.new_cache(2, device=torch.device("meta"))
    out["kv_cache_mb_per_session"] = _mb(sum(t.numel() * t.element_size() for t in session.k + session.v))
    out["kv_cache_positions"] = session.max_seq
    del session
    with torch.inference_mode():
        if anole:
            _measure_vq(world, c, out)
            _measure_device(world, c, out)
            world.device_model = world.vq = None  # room for the 8-row KV caches on this box (docstring)
            out["dropped_before_forwards"] = ["device_model", "vq"]
            gc.collect()
            _malloc_trim()
            out["peak_rss_before_forwards_mb"] = peak_rss_mb()
            out["rss_before_forwards_mb"] = rss_now_mb()
        _measure_forwards(cloud, c, reps, rows_list, out, guard=anole)
        if not anole:
            _measure_vq(world, c, out)
            _measure_device(world, c, out)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def rss_now_mb() -> float | None:
    """This process's resident set now (Linux's VmRSS), None elsewhere."""
    return _status_mb("VmRSS")


def _malloc_trim() -> None:
    """Hand glibc's free heap back to the system (a 7B load leaves ~1 GB of freed transients in it)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mem_available_bytes() -> int | None:
    """Linux's MemAvailable (what can be allocated without swapping or the OOM killer), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


MEMORY_MARGIN = 2**30  # bytes left to the machine's other processes beside a guarded KV cache


def _wait_for_memory(world_file: str, timeout_s: float = 900.0, poll_s: float = 10.0) -> float | None:
    """Before an Anole world loads on a shared box: wait (up to `timeout_s`) until the machine's available memory
    holds its weight files (as they load: bfloat16 stays bfloat16) and MEMORY_MARGIN; MemoryError after that.
    -> seconds waited (None: not an Anole world, or no MemAvailable to read)."""
    from ciar.world_spec import AnoleWorldSpec, read_world

    spec = read_world(world_file, check=False)
    if not isinstance(spec, AnoleWorldSpec) or mem_available_bytes() is None:
        return None
    need = sum(os.path.getsize(p) for p in spec.weight_files() + [spec.path(spec.vq_checkpoint), spec.device_file()]
               if p) + MEMORY_MARGIN
    t0 = time.perf_counter()
    while mem_available_bytes() < need:
        if time.perf_counter() - t0 > timeout_s:
            raise MemoryError(f"{need / 2**30:.1f} GiB needed to load the world, "
                              f"{mem_available_bytes() / 2**30:.1f} GiB available after waiting {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.perf_counter() - t0


def _measure_forwards(cloud, c, reps: int, rows_list: tuple[int, ...], out: dict, guard: bool = False) -> None:
    """The verifier forward over `rows_list` rows of a span, and the cloud's sampled step, at mid-image and 7/8.
    `guard` (a 7B decoder on a shared box): a forward whose KV cache would leave less than MEMORY_MARGIN of the
    machine's available memory is not run; `skipped` says which and why."""
    import torch

    for name, start in forward_contexts(c).items():
        forward, fastest = {}, {}
        for rows in rows_list:  # a span (4 drafts + the committed token) in each of `rows` sessions' rows
            if guard:
                probe = cloud.new_cache(rows, max_seq=start + SPAN_WIDTH + 16, device=torch.device("meta"))
                need, free = sum(t.numel() * t.element_size() for t in probe.k + probe.v), mem_available_bytes()
                if free is not None and need + MEMORY_MARGIN > free:
                    out.setdefault("skipped", []).append(
                        f"verifier forward, {rows} rows at {start}: its KV cache is {need / 2**30:.2f} GiB, "
                        f"{free / 2**30:.2f} GiB available (margin {MEMORY_MARGIN / 2**30:.0f} GiB)")
                    continue
            cache = cloud.new_cache(rows, max_seq=start + SPAN_WIDTH + 16)
            cache.key_valid[:] = True
            tokens = torch.randint(0, c.vocab_size, (rows, SPAN_WIDTH),
                                   generator=torch.Generator().manual_seed(rows))
            pos = torch.arange(start, start + SPAN_WIDTH)

            def step():
                cloud.logits(cloud.forward_cached(cache, cloud.tok_embeddings(tokens), pos,
                                                  kv_len=start + SPAN_WIDTH))

            forward[str(rows)], fastest[str(rows)] = _timed_s(step, reps)
            del cache
        key = "verifier_forward_s" if name == "mid" else f"verifier_forward_{name}_s"
        out[key] = {"span_width": SPAN_WIDTH, "context": start, "by_rows": forward, "fastest_by_rows": fastest}
        # the cloud's sampled step there: one token in a session's two CFG rows (cloud-only decoding, bursts)
        cache = cloud.new_cache(2, max_seq=start + 16)
        cache.key_valid[:] = True
        tok = torch.zeros(2, 1, dtype=torch.long)
        at = torch.tensor([start])

        def decode():
            cloud.logits(cloud.forward_cached(cache, cloud.tok_embeddings(tok), at, kv_len=start + 1))

        t, t_fast = _timed_s(decode, reps)
        out.setdefault("cloud_decode_step_s", {})[str(start)] = t
        out.setdefault("cloud_decode_step_fastest_s", {})[str(start)] = t_fast
        del cache


def _measure_vq(world, c, out: dict) -> None:
    """One VQ decode of a whole image (what each streamed preview costs too)."""
    import torch

    codes = getattr(world.vq.config, "codebook_size", None) or world.vq.config.n_embed
    code = torch.randint(0, codes, (1, c.block_size), generator=torch.Generator().manual_seed(0))
    out["vq_decode_s"] = _median_s(lambda: world.vq.decode_code(code), 1)


def _measure_device(world, c, out: dict) -> None:
    """The device model's one-token step (2 CFG rows, last position only) and its KV cache."""
    import torch

    from ciar.collab.device import device_caption

    dm = world.device_model
    cap = world.text.encode([CAPTIONS[0]])
    cache = dm.new_cache(2)
    # a Chameleon trunk conditions on the prompt's embeddings (what the verifier sends a device), LlamaGen's on T5's
    cond, mask, drop = dm.gpt.cfg_condition(device_caption(world.cloud, cap.emb), cap.mask)
    dm.prefill(cache, cond, mask, drop)
    state = {"pos": c.cls_token_num}

    def device_step():
        p = state["pos"]
        dm.decode(cache, torch.zeros(2, 1, dtype=torch.long), torch.tensor([p]), last_only=True)
        state["pos"] = p + 1

    out["device_step_s"], out["device_step_fastest_s"] = _timed_s(device_step, 10)
    out["device"] = {"params": sum(p.numel() for p in dm.parameters()), "layers": dm.config.n_layer,
                     "kv_cache_mb_per_session": _mb(sum(t.numel() * t.element_size() for t in cache.k + cache.v))}


class _Feed:
    """A work that feeds the caption's positions, then (a resume) its history, as the verifier's `OpenWork` /
    `ResumeWork` report themselves to the scheduler (2 rows: the CFG branches)."""

    rows, seq, done = 2, 0, False

    def __init__(self, cls: int, history: int):
        self.cls, self.history, self.cond, self.fed = cls, history, 0, 0

    def kind(self) -> int:
        from ciar.engine.scheduler import HISTORY, PREFILL

        return PREFILL if self.cond < self.cls else HISTORY

    def pending(self) -> int:
        return self.cls - self.cond if self.cond < self.cls else max(0, self.history - 1 - self.fed)

    def position(self) -> int:
        return self.cond if self.cond < self.cls else self.cls + self.fed

    def take(self, n: int) -> None:
        if self.cond < self.cls:
            self.cond += n
        else:
            self.fed += n
        self.done = self.cond >= self.cls and self.fed >= self.history - 1


class _Spans:
    """A session verifying spans (SPAN_WIDTH positions each step, forever): the load a prefill shares steps with."""

    rows, seq, done = 2, 0, False

    def __init__(self, position: int):
        self.at = position

    def kind(self) -> int:
        from ciar.engine.scheduler import SPAN

        return SPAN

    def pending(self) -> int:
        return SPAN_WIDTH

    def position(self) -> int:
        return self.at

    def take(self, n: int) -> None:
        pass


def prefill_steps(cls: int, tokens: int, sched, busy: int = 0) -> dict:
    """Forwards the scheduler (`ciar.engine.scheduler.schedule`, config `sched`) takes to feed an open's caption
    (`cls` positions) and a resume of a whole image (the caption + `tokens` - 1 history positions), alone or beside
    `busy` sessions verifying spans (which go first). -> {what: {"steps", "widest"}}."""
    from ciar.engine.scheduler import Scheduler

    out = {}
    for what, history in (("open", 0), ("resume", tokens)):
        s = Scheduler(sched)
        work = s.submit(_Feed(cls, history))
        others = [s.submit(_Spans(cls + tokens // 2)) for _ in range(busy)]
        s.start(s.take_waiting())
        steps = widest = 0
        while not work.done and steps < 10_000:
            batch = s.schedule()
            for p in batch:
                p.request.take(p.n)
                if p.request is work:
                    widest = max(widest, p.n)
            s.record(batch)
            steps += 1
        out[what] = {"steps": steps, "widest": widest, "positions": cls + max(0, history - 1)}
        del others
    return out


def scheduler_plan(world_file: str) -> dict:
    """How the verifier's scheduler feeds this world's prefills (no model loaded): the default `SchedulerConfig`
    and the Verifier configs of serve_config.yaml (CPU) and serve_config.gpu.yaml, alone and beside 8 / 32 sessions
    verifying spans."""
    import yaml

    from ciar.engine.scheduler import SchedulerConfig
    from ciar.world_spec import read_world

    c = read_world(world_file, check=False).gpt_cfg()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = {"default": SchedulerConfig()}
    for name in ("serve_config.yaml", "serve_config.gpu.yaml"):
        with open(os.path.join(root, name)) as f:
            deployments = yaml.safe_load(f)["applications"][0].get("deployments", [])
        uc = next((d.get("user_config") or {} for d in deployments if d.get("name") == "Verifier"), {})
        configs[name] = SchedulerConfig(**{k: uc[k] for k in ("token_budget", "prefill_chunk") if k in uc},
                                        max_works=uc.get("max_batch_size", SchedulerConfig.max_works))
    out = {"image_tokens": c.block_size, "caption_positions": c.cls_token_num}
    for name, sched in configs.items():
        out[name] = {"token_budget": sched.token_budget, "prefill_chunk": sched.prefill_chunk,
                     "max_works": sched.max_works,
                     "alone": prefill_steps(c.cls_token_num, c.block_size, sched),
                     "beside 8 span sessions": prefill_steps(c.cls_token_num, c.block_size, sched, busy=8),
                     "beside 32 span sessions": prefill_steps(c.cls_token_num, c.block_size, sched, busy=32)}
    return out


def gpu_config_max_sessions() -> int | str:
    """`verifier_max_sessions` of serve_config.gpu.yaml (the KV-cache sessions a GPU replica allocates, or "auto":
    sized from the GPU's memory at start)."""
    import yaml

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve_config.gpu.yaml")) as f:
        n = yaml.safe_load(f)["applications"][0]["args"]["verifier_max_sessions"]
    return n if n == "auto" else int(n)


def run_child(cmd: list[str]) -> dict:
    """Run a command in its own process -> exit status, wall seconds, its peak RSS (MB), the tail of its output."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    lines = output.strip().splitlines()
    return {"rc": p.returncode, "wall_s": time.perf_counter() - t0, "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "output_tail": output[-1500:], "last_line": lines[-1] if lines else ""}


def serve_run(world_file: str, methods: list[str], prompt: str, threads: int, port: int = 8135) -> dict:
    """Step 4: the Serve application on this machine serving the world; one request per method."""
    import hashlib
    import threading

    import psutil
    import ray
    import requests
    from ray import serve

    from services.deploy import deploy_config, patient_serve_env

    key = "real-scale-key"
    peak: dict[str, float] = {}
    done = threading.Event()

    def sample_once() -> None:  # each Serve replica's resident set, its process found by its title
        for proc in psutil.process_iter(["cmdline", "memory_info"]):
            title = " ".join(proc.info["cmdline"] or [])
            if title.startswith("ray::ServeReplica") and proc.info["memory_info"]:
                # "ray::ServeReplica:APP:Verifier.handle_request ...": the deployment, whatever method it runs now
                name = title.split()[0].split(":")[-1].split(".")[0]
                peak[name] = max(peak.get(name, 0.0), _mb(proc.info["memory_info"].rss))

    def sample() -> None:
        while not done.wait(1.0):
            sample_once()

    patient_serve_env()
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                       "OMP_NUM_THREADS": str(threads)}})
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: dict = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        deploy_config({"world": os.path.abspath(world_file), "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
                       "devices": 1, "device_num_cpus": 0.1, "verifier_num_cpus": 1.0, "verifier_threads": threads,
                       "verifier_max_sessions": 4, "ingress_num_cpus": 0.1, "request_timeout_s": 3600.0},
                      user_configs={"Device": {"gate": "lower", "tau": 0.5, "span": 4, "burst": 2, "realtime": False}},
                      timeout_s=1800.0)
        out["deploy_s"] = time.perf_counter() - t0
        for method in methods:
            t0 = time.perf_counter()
            r = requests.post(f"http://127.0.0.1:{port}/v1/images/generations", timeout=3600,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": prompt, "seed": 0, "method": method, "response_format": "tokens"})
            got = {"status": r.status_code, "seconds": time.perf_counter() - t0}
            body = r.json()
            if r.status_code == 200:
                st = body["stats"]
                got["stats"] = {k: st[k] for k in ("total_tokens", "cloud_call_rate", "cloud_requests",
                                                   "cloud_forward_passes", "cloud_s", "device_s", "total_s") if k in st}
            else:
                got["error"] = body
            out[method] = got
            print("serve", method, got, flush=True)
        sample_once()  # every replica at least once, however short the run
    finally:
        done.set()
        serve.shutdown()
        ray.shutdown()
    out["replica_peak_rss_mb"] = peak
    return out


def markdown(r: dict) -> str:
    """The results as a table (only the steps that ran)."""
    anole = SIZES.get(r["sizes"], {}).get("kind") == "anole"
    title = ("Anole-7b (Chameleon-7B's decoder) at real sizes" if r["sizes"] == "anole-7b" else
             f"Anole ({r['sizes']})" if anole else "LlamaGen-XL at real sizes")
    lines = [f"# {title} on this CPU (random weights, real layouts)", "",
             f"Machine: {r['machine']}; torch threads {r['threads']}; sizes {r['sizes']}. Files (MB): "
             f"{r['write']['file_mb']}; "
             + ("reused from an earlier run (--reuse)." if r["write"].get("reused") else
                f"written in {sum(r['write']['write_s'].values()):.0f} s."), "",
             "| figure | value |", "|---|---|"]
    if "measure" in r:
        m = r["measure"]
        if "t5" in m:
            text, what = (f"T5 encoder {m['t5']['params'] / 1e6:.0f} M ({m['t5']['dtype']}, {m['t5']['positions']} "
                          f"positions)"), "GPT + VQ + T5 + device model"
            encode = f"| T5 encode, one caption | {m['t5_encode_s_per_caption']:.2f} s |"
        else:
            g = m["gpt"]
            text, what = (f"{g.get('layers')} layers x {g.get('dim')}, {g.get('heads')} heads, vocabulary "
                          f"{g.get('text_vocab')} of which {g.get('image_codes')} image codes; prompt: "
                          f"{m['prompt']['encoder']}, {m['prompt']['positions']} positions"), \
                "decoder + VQGAN + prompt tokenizer + device model"
            encode = f"| prompt tokenized, one caption | {1e3 * m['prompt_encode_s_per_caption']:.2f} ms |"
        lines += [
            f"| models | {'decoder' if anole else 'GPT'} {m['gpt']['params'] / 1e6:.0f} M parameters "
            f"({m['gpt']['dtype']}), {text}, device model {m['device']['params'] / 1e6:.0f} M "
            f"({m['device']['layers']} layer) |",
            f"| load_world ({what}) | {m['load_s']:.1f} s |",
            f"| peak RSS after loading | {m['peak_rss_after_load_mb']:.0f} MB |",
        ]
        if "peak_rss_before_forwards_mb" in m:
            lines.append(f"| peak RSS after the VQ decode and the device step; RSS once "
                         f"{' and '.join(m['dropped_before_forwards'])} were dropped, before the verifier forwards | "
                         f"{m['peak_rss_before_forwards_mb']:.0f} MB; {m.get('rss_before_forwards_mb') or 0:.0f} MB |")
        lines += [f"| peak RSS of the measuring process | {m['peak_rss_mb']:.0f} MB |", encode]
        for f in [m[k] for k in ("verifier_forward_s", "verifier_forward_late_s") if k in m]:
            fast = f.get("fastest_by_rows", {})
            lines += [f"| verifier forward, {rows} row(s) x {f['span_width']} positions at position {f['context']} | "
                      f"{s:.3f} s{f' (fastest {fast[rows]:.3f})' if rows in fast else ''} |"
                      for rows, s in f["by_rows"].items()]
        fast = m.get("cloud_decode_step_fastest_s", {})
        for at, s in (m.get("cloud_decode_step_s") or {}).items():
            lines.append(f"| cloud sampled step (1 token, 2 CFG rows) at position {at} | {1e3 * s:.1f} ms"
                         f"{f' (fastest {1e3 * fast[at]:.1f})' if at in fast else ''} |")
        if "vq_decode_s" in m:
            lines.append(f"| VQ decode, one {m['gpt'].get('image_size', '?')} px image (also each streamed preview) | "
                         f"{m['vq_decode_s']:.2f} s |")
        lines.append(f"| device step (1 token, 2 CFG rows) | {1e3 * m['device_step_s']:.1f} ms "
                     f"(fastest {1e3 * m['device_step_fastest_s']:.1f}) |")
        if "kv_cache_mb_per_session" in m:
            kv, n = m["kv_cache_mb_per_session"], r["gpu_config_max_sessions"]
            held = (f"serve_config.gpu.yaml's {n} sessions: {kv * n / 1024:.1f} GiB, allocated at start" if n != "auto"
                    else "serve_config.gpu.yaml sizes the sessions from the GPU's memory at start (auto)")
            lines.append(f"| verifier KV cache per session (2 CFG rows, {m['gpt']['dtype']}, "
                         f"{m.get('kv_cache_positions', '?')} positions) | {kv:.0f} MB; {held} |")
        if "kv_cache_mb_per_session" in m.get("device", {}):
            lines.append(f"| device model's KV cache (2 CFG rows, float32) | "
                         f"{m['device']['kv_cache_mb_per_session']:.0f} MB |")
    if "scheduler" in r:
        sc = r["scheduler"]
        for name, v in sc.items():
            if not isinstance(v, dict):
                continue
            cells = "; ".join(f"{load}: open {v[load]['open']['steps']}, resume {v[load]['resume']['steps']} "
                              f"(widest piece {v[load]['resume']['widest']})"
                              for load in ("alone", "beside 8 span sessions", "beside 32 span sessions"))
            lines.append(f"| scheduler `{name}` (budget {v['token_budget']}, chunk {v['prefill_chunk']}): forwards "
                         f"to feed an open ({sc['caption_positions']} positions) / a resume of the whole image "
                         f"({sc['caption_positions'] + sc['image_tokens'] - 1}) | {cells} |")
    for method, img in r.get("images", {}).items():
        st = img.get("stats") or {}
        st = {**st, **(st.get("collab") or {}).get("stats", {})}
        extra = ", ".join(f"{k} {st[k]:.4g}" for k in ("num_tokens", "wall_time_s", "total_time_s", "cloud_call_rate",
                                                       "cloud_requests", "cloud_forward_passes", "cloud_s", "device_s")
                          if k in st)
        lines.append(f"| one image, {method} (`ciar.generate`, own process) | rc {img['rc']}, wall {img['wall_s']:.0f} s, "
                     f"peak RSS {img['peak_rss_mb']:.0f} MB{'; ' + extra if extra else ''} |")
    if "serve" in r:
        sv = r["serve"]
        lines.append(f"| Serve application: deploy (replicas load the world) | {sv['deploy_s']:.0f} s |")
        for method in ("cloud", "ciar"):
            if method in sv:
                got = sv[method]
                lines.append(f"| Serve application, one image, {method} (POST, tokens) | HTTP {got['status']}, "
                             f"{got['seconds']:.0f} s; {got.get('stats') or got.get('error')} |")
        lines.append(f"| Serve replicas' peak RSS (MB) | {sv['replica_peak_rss_mb']} |")
    if "collab" in r:
        c = r["collab"]
        lines.append(f"| benchmarks.collab, 4 prompts, cloud + ciar (own process) | rc {c['rc']}, wall "
                     f"{c['wall_s']:.0f} s, peak RSS {c['peak_rss_mb']:.0f} MB; results {c.get('results')} |")
    if r.get("measure", {}).get("skipped"):
        lines += ["", "Not run (memory): " + "; ".join(r["measure"]["skipped"])]
    lines += ["", "Broke at these sizes: " + ("; ".join(r["broke"]) or "nothing"), "", "Command:", "",
              "    " + r["command"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real_scale", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the random real-size files (~6.5 GB)")
    ap.add_argument("--results", required=True, help="results JSON (its Markdown is written beside it)")
    ap.add_argument("--sizes", default="real", choices=sorted(SIZES), help="the files' shapes (tiny: tests)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per verifier forward")
    ap.add_argument("--rows", default=None, help="batch rows of the timed verifier forwards (default 1,8,32; "
                                                 "Anole sizes 1,8)")
    ap.add_argument("--images", default="cloud,ciar", help="methods to make one image with")
    ap.add_argument("--steps", default=None, help="steps after writing the files (default measure,images,serve,"
                                                  "collab; Anole sizes: measure only)")
    ap.add_argument("--gpt-dtype", default=None, choices=["float32", "bfloat16"],
                    help="the world's gpt_dtype (default float32; Anole sizes bfloat16, as released)")
    ap.add_argument("--prompt", default=CAPTIONS[0])
    ap.add_argument("--keep", action="store_true", help="keep OUT's files")
    ap.add_argument("--reuse", action="store_true",
                    help="measure the files an earlier run left in OUT (--keep, or a run that broke) instead of "
                         "writing them again; the report says so")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child: measure this world file
    args = ap.parse_args(argv)
    anole = SIZES[args.sizes].get("kind") == "anole"
    args.rows = args.rows or SIZES[args.sizes].get("rows", "1,8,32")
    args.gpt_dtype = args.gpt_dtype or ("bfloat16" if anole else "float32")
    args.steps = args.steps or (",".join(ANOLE_STEPS) if anole else "measure,images,serve,collab")
    if anole and set(args.steps.split(",")) - set(ANOLE_STEPS):
        ap.error(f"--sizes {args.sizes}: only --steps {','.join(ANOLE_STEPS)} (asked: {args.steps}); a whole Anole "
                 f"image is 1,024 steps of the 7B decoder, hours on this CPU, and the Serve application and "
                 f"benchmarks.collab do not take Anole worlds here")
    import torch

    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args.measure, args.reps, tuple(int(r) for r in args.rows.split(",")))))
        return 0
    command = "python -m benchmarks.real_scale " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    report = {"command": command, "threads": args.threads, "sizes": args.sizes, "gpt_dtype": args.gpt_dtype,
              "machine": f"{os.cpu_count()} CPU cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, no GPU"}
    if args.reuse:
        report["write"] = reused_files(args.out, args.sizes, args.gpt_dtype)
    else:
        report["write"] = write_files(args.out, args.sizes, args.gpt_dtype)
    report["gpu_config_max_sessions"] = gpu_config_max_sessions()
    report["scheduler"] = scheduler_plan(report["write"]["world_file"])
    world, steps, methods = report["write"]["world_file"], args.steps.split(","), args.images.split(",")
    report["broke"] = []
    if "measure" in steps:
        child = run_child([sys.executable, "-m", "benchmarks.real_scale", "--out", args.out, "--results", args.results,
                           "--measure", world, "--threads", str(args.threads), "--reps", str(args.reps),
                           "--rows", args.rows])
        if child["rc"]:
            report["broke"].append(f"measure: {child['output_tail'][-300:]}")
        else:
            report["measure"] = json.loads(child["last_line"])  # whole: a long report outgrows the tail
    if "images" in steps:
        report["images"] = {}
        for method in methods:
            stats = os.path.join(args.out, f"{method}.json")
            img = run_child([sys.executable, "-m", "ciar.generate", "--world", world, "--prompt", args.prompt,
                             "--method", method, "--seed", "0", "--out", os.path.join(args.out, f"{method}.png"),
                             "--stats", stats, "--threads", str(args.threads)] + (CIAR_KNOBS if method == "ciar" else []))
            if img["rc"]:
                report["broke"].append(f"ciar.generate {method}: {img['output_tail'][-300:]}")
            else:
                with open(stats) as f:
                    img["stats"] = {k: v for k, v in json.load(f).items() if not isinstance(v, list)}
            report["images"][method] = img
            print(method, img["rc"], f"{img['wall_s']:.0f} s", flush=True)
    if "serve" in steps:
        try:
            report["serve"] = serve_run(world, methods, args.prompt, args.threads)
        except Exception as e:  # noqa: BLE001 - recorded: what broke at these sizes
            report["broke"].append(f"serve: {type(e).__name__}: {str(e)[:300]}")
        for method in methods:
            if report.get("serve", {}).get(method, {}).get("status", 200) != 200:
                report["broke"].append(f"serve {method}: {report['serve'][method].get('error')}")
    if "collab" in steps:
        out = os.path.splitext(args.results)[0] + "_collab.json"
        captions = os.path.join(args.out, "captions.json")
        with open(captions, "w") as f:
            rows = CAPTIONS + CALIBRATION
            json.dump({"images": [{"id": i} for i in range(len(rows))],
                       "annotations": [{"id": i, "image_id": i, "caption": c} for i, c in enumerate(rows)]}, f)
        report["collab"] = c = run_child([sys.executable, "-m", "benchmarks.collab", "--world", world, "--captions",
                                          captions, "--methods", "cloud,ciar", "--num-prompts", str(len(CAPTIONS)),
                                          "--calib-prompts", str(len(CALIBRATION)), "--threads", str(args.threads),
                                          "--no-inter-enhance-ablation", "--out", out] + CIAR_KNOBS)
        if c["rc"]:
            report["broke"].append(f"benchmarks.collab: {c['output_tail'][-300:]}")
        else:
            c["results"] = out
    write_results(args.results, report, markdown(report))
    if not args.keep:
        shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
