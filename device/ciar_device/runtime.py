"""The exported device model and VQ decoder on onnxruntime (numpy only: no torch, no ciar).

    rt = DeviceRuntime("weights/scenes-v2/onnx")          # written by `python -m pipelines.export_onnx`
    step = rt.start(caption_emb, caption_mask, rows=2)     # [L, caption_dim] f16/f32, [L] bool; rows 2 = CFG
    step.center, step.radius, step.hidden                  # [rows, V], [rows, V], [rows, dim] for image token 0
    step = rt.feed([17], 0)                                # image token 0 -> the box for image token 1
    rt.rollback(3)                                         # keep image tokens [0, 3); feed from index 3 next
    image = ImageDecoder("weights/scenes-v2/onnx").decode(tokens)   # [N] ids -> uint8 [H, W, 3]

The runtime interface of the device loop (`ciar_device.loop`), which `ciar.collab.device.TorchRuntime` implements
on the torch model: `start` prefills the caption (row 1 of a CFG pair takes the unconditional caption, mask kept),
`feed(tokens, start)` feeds image tokens (every row gets the same ids; only the last fed position's output comes
back), `rollback(length)` rolls the cache back to `length` image tokens, `step_seconds(rows)` times one step;
`vocab_size`, `num_tokens`, `dim`. The KV cache is two fixed-size arrays [n_layer, rows, n_head, max_seq, head_dim] passed through the step
graph; a query only sees keys at positions up to its own, so rollback just moves a pointer (`length`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class Step:
    """The device's output for the last fed position (it predicts the next image token)."""

    center: np.ndarray  # [rows, V] float32 Inter-Head center logits
    radius: np.ndarray  # [rows, V] float32, >= 0
    hidden: np.ndarray  # [rows, dim] float32 final hidden state (input of the cloud's interval projector)
    heads: tuple[np.ndarray, np.ndarray] | None = None  # per-head (centers, radii) [H, rows, V]: voting devices only


def read_manifest(model_dir: str) -> dict:
    """The export's manifest.json; ValueError for another format version."""
    path = os.path.join(model_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: export the model with `python -m pipelines.export_onnx`")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {manifest.get('format_version')!r}, this runtime reads "
                         f"{FORMAT_VERSION}: re-export the model")
    return manifest


def _session(model_dir: str, manifest: dict, key: str, threads: int, providers):
    import onnxruntime as ort  # here, not at import: the torch runtime shares this module's Step and checks

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, int(threads))
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    path = os.path.join(model_dir, manifest["graphs"][key]["file"])
    return ort.InferenceSession(path, sess_options=opts, providers=providers or ["CPUExecutionProvider"])


class Runtime:
    """What every runtime of the device loop checks the same way (this one's `DeviceRuntime`, the torch model's
    `ciar.collab.device.TorchRuntime`): the caption, the tokens fed and the rollbacks, against the model's sizes
    (`cls_token_num`, `caption_dim`, `num_tokens`, `vocab_size`) and the image tokens the cache holds (`length`)."""

    rows = 0
    length = 0  # image tokens held in the cache (positions cls_token_num .. cls_token_num + length - 1)
    started = False

    def checked_caption(self, caption_emb, caption_mask, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (caption_emb [L, caption_dim], caption_mask [L]) as arrays; ValueError naming what does not fit."""
        if rows not in (1, 2):
            raise ValueError(f"rows must be 1 (no guidance) or 2 (classifier-free guidance), got {rows!r}")
        emb = np.asarray(caption_emb)
        mask = np.asarray(caption_mask)
        L, D = self.cls_token_num, self.caption_dim
        if emb.shape != (L, D) or mask.shape != (L,):
            raise ValueError(f"expected caption_emb [{L}, {D}] and caption_mask [{L}], got {emb.shape} and "
                             f"{mask.shape}")
        return emb, mask

    def checked_feed(self, tokens, start: int) -> np.ndarray:
        """-> the tokens as int64 [n]; RuntimeError before `start`, ValueError naming what does not fit."""
        if not self.started:
            raise RuntimeError("feed before start: prefill a caption first")
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.shape[0]
        if n == 0:
            raise ValueError("feed needs at least one token")
        if not 0 <= start <= self.length:
            raise ValueError(f"cannot feed at image index {start}: the cache holds {self.length} image tokens")
        if start + n > self.num_tokens:
            raise ValueError(f"feeding {n} tokens at {start} runs past the image's {self.num_tokens} tokens")
        if toks.min() < 0 or toks.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return toks

    def rollback(self, length: int) -> None:
        """Keep image tokens [0, length) in the cache (the next feed starts at most at `length`)."""
        length = int(length)
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} image tokens: the cache holds {self.length}")
        self.length = length


class DeviceRuntime(Runtime):
    """One generation at a time: the device model's prefill and step graphs and the session's KV cache."""

    def __init__(self, model_dir: str, threads: int = 1, providers: list[str] | None = None):
        self.manifest = read_manifest(model_dir)
        m = self.manifest
        self._prefill = _session(model_dir, m, "device_prefill", threads, providers)
        self._step = _session(model_dir, m, "device_step", threads, providers)
        self.vocab_size, self.num_tokens = int(m["vocab_size"]), int(m["num_tokens"])
        self.cls_token_num, self.caption_dim = int(m["cls_token_num"]), int(m["caption_dim"])
        self.dim = int(m["dim"])  # the hidden state's width (the projector's input)
        self._k = self._v = self._mask = None

    def start(self, caption_emb: np.ndarray, caption_mask: np.ndarray, rows: int) -> Step:
        """Reset the cache and prefill the caption: caption_emb [L, caption_dim] (float16 or float32, left-padded),
        caption_mask [L] bool (True on real tokens); rows 1 (no guidance) or 2 (row 1 unconditional).
        -> Step for image token 0."""
        emb, mask = self.checked_caption(caption_emb, caption_mask, rows)
        L, D = self.cls_token_num, self.caption_dim
        emb = np.ascontiguousarray(np.broadcast_to(emb.astype(np.float32), (rows, L, D)))
        mask = np.ascontiguousarray(np.broadcast_to(mask.astype(bool), (rows, L)))
        drop = np.array([False, True][:rows])
        center, radius, hidden, self._k, self._v = self._prefill.run(
            None, {"caption_emb": emb, "caption_mask": mask, "drop": drop})
        self._mask, self.rows, self.length, self.started = mask, rows, 0, True
        return Step(center, radius, hidden)

    def feed(self, tokens, start: int) -> Step:
        """Feed image tokens at image indices start .. start + len(tokens) - 1 (the same ids on every row; `start` at
        most the tokens the cache holds) -> Step of the last one (it predicts image token start + len(tokens))."""
        start = int(start)
        toks = self.checked_feed(tokens, start)
        n = toks.shape[0]
        center, radius, hidden, self._k, self._v = self._step.run(None, {
            "tokens": np.ascontiguousarray(np.broadcast_to(toks, (self.rows, n))),
            "start": np.array(start, dtype=np.int64), "caption_mask": self._mask,
            "k_cache": self._k, "v_cache": self._v})
        self.length = start + n
        return Step(center, radius, hidden)

    def step_seconds(self, rows: int = 1, repeats: int = 3) -> float:
        """Seconds of one step (one token fed), the median of `repeats` after a warm-up, on a caption of zeros: what
        the device knows of its own step before its first image (the adaptive policy's prior,
        `ciar_device.policy.CostObserver.prime`). Leaves the cache empty (`start` comes next)."""
        L, D = self.cls_token_num, self.caption_dim
        self.start(np.zeros((L, D), np.float32), np.ones(L, bool), rows)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            self.feed([0], 0)
            times.append(time.perf_counter() - t)
        self.rollback(0)
        return statistics.median(times[1:])


class ImageDecoder:
    """The VQ decoder: image token ids -> an RGB image."""

    def __init__(self, model_dir: str, threads: int = 1, providers: list[str] | None = None):
        self.manifest = read_manifest(model_dir)
        self._session = _session(model_dir, self.manifest, "vq_decoder", threads, providers)
        self.num_tokens, self.vocab_size = int(self.manifest["num_tokens"]), int(self.manifest["vocab_size"])

    def decode(self, tokens) -> np.ndarray:
        """[N] ids (N = num_tokens, row-major over the grid) -> uint8 [H, W, 3]."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} tokens, got {toks.shape[0]}")
        if toks.min() < 0 or toks.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return self._session.run(None, {"tokens": toks[None]})[0]
