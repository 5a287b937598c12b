"""The device model: the cloud's architecture cut to 1 (or 2/3/5) layers, with the Inter-Head as its output.

    device = DeviceModel.from_cloud(world.cloud, DeviceConfig(n_layer=1))       # layer-dropped initialisation
    out = device(tokens[:, :-1], cap.emb, cap.mask)                              # training: DeviceOutput [B, N, V]
    cache = device.new_cache(2)
    out = device.prefill(cache, cond, mask, drop)                                # first image token
    out = device.decode(cache, tok, pos, kv_len=pos + 1)                          # next token(s)

The device drafts from the Inter-Head's center logits `c` (docs/architecture.md §7); the radius `r` gives the logit
box `[c - r, c + r]` that InterFuse turns into a probability interval. The trunk is `ciar.models.gpt.GPT` built
with `lm_head=False` (same keys as the cloud under `gpt.`), so every cached-decoding facility of the cloud —
per-row positions, slots, rollback by position — is the device's too.

A Chameleon / Anole cloud (`ciar.models.chameleon.ChameleonGPT`) gets a `ChameleonTrunk`: its first layers and
norm, its image rows as the token table and the Inter-Head over the image codes (8192 for Anole), conditioned on the
prompt's embeddings [cls, dim] (`device_caption`: what the verifier sends a device as its caption for such a world).

Files: `device.safetensors` (kind "ciar_device"), config = {"gpt": GPTConfig dict (a ChameleonConfig dict, `arch`
"chameleon", for a Chameleon trunk), "device": DeviceConfig dict}.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn as nn

from ciar.collab.defaults import CIARDefaults
from ciar.collab.interval import InterHead
from ciar.models.chameleon import ChameleonConfig, ChameleonGPT, ChameleonTrunk
from ciar.models.checkpoint import load_strict, read_model_file, save_model
from ciar.models.gpt import GPT, GPTConfig
from ciar.models.kv_cache import KVCache
from ciar_device.runtime import Runtime, Step

DEVICE_KIND = "ciar_device"
DEVICE_DEPTHS = (1, 2, 3, 5)  # the paper's device depths (Table 6)


@dataclass
class DeviceConfig:
    n_layer: int = 1  # transformer layers of the device trunk
    num_heads: int = 1  # Inter-Heads (1..5), combined by `combine`
    combine: str = "ensemble"  # "ensemble" (average) or "voting" (majority of the heads' gate decisions)
    max_radius: float = 8.0  # clamp of the radius logits

    def __post_init__(self):
        if not 1 <= int(self.n_layer) <= 64:
            raise ValueError(f"n_layer must be in [1, 64], got {self.n_layer}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "DeviceConfig":
        return DeviceConfig(**d)


@dataclass
class DeviceOutput:
    center: torch.Tensor  # [..., V] float32, the heads' mean center logits (what the device drafts from)
    radius: torch.Tensor  # [..., V] float32, >= 0
    hidden: torch.Tensor  # [..., dim] final hidden states (input of the interval-feature projector)
    heads: tuple[torch.Tensor, torch.Tensor] | None = None  # per-head (centers, radii) [H, ..., V] if asked


def trunk_config(d: dict) -> GPTConfig:
    """A device file's trunk config dict -> GPTConfig, or ChameleonConfig when its `arch` is "chameleon"."""
    return ChameleonConfig.from_dict(d) if d.get("arch") == "chameleon" else GPTConfig.from_dict(d)


@torch.no_grad()
def device_caption(cloud: GPT, cond: torch.Tensor) -> torch.Tensor:
    """The caption a device model conditions on, for the cloud's condition `cond` [..., L(, D)]: a float caption
    (T5 / MiniLM embeddings) is itself; token ids (a Chameleon / Anole world's prompt) become the cloud's embeddings
    of them [..., L, dim] float32 (`ChameleonGPT.prompt_embeddings`), what a `ChameleonTrunk` takes. The verifier
    sends this (as float16) when an OPEN asks for the caption; the trainers give it to the device model."""
    if cond.is_floating_point():
        return cond
    if not isinstance(cloud, ChameleonGPT):
        raise TypeError(f"integer captions need a Chameleon cloud, got {type(cloud).__name__}")
    return cloud.prompt_embeddings(cond).float()


class DeviceModel(nn.Module):
    def __init__(self, gpt_config: GPTConfig, config: DeviceConfig | None = None):
        super().__init__()
        self.device_config = config or DeviceConfig()
        dc = self.device_config
        if isinstance(gpt_config, ChameleonConfig):
            self.gpt = ChameleonTrunk(replace(gpt_config, n_layer=dc.n_layer, lm_head=False,
                                              caption_dim=gpt_config.dim))
        else:
            self.gpt = GPT(replace(gpt_config, n_layer=dc.n_layer, lm_head=False))
        self.inter_head = InterHead(gpt_config.dim, gpt_config.vocab_size, num_heads=dc.num_heads,
                                    combine=dc.combine, max_radius=dc.max_radius)
        self.ciar_defaults: CIARDefaults | None = None  # calibrated gate / tau / burst (`load` reads the file's)
        self.extra: dict = {}  # the file's training facts (`load`)

    @property
    def config(self) -> GPTConfig:
        return self.gpt.config

    @classmethod
    def from_cloud(cls, cloud: GPT, config: DeviceConfig | None = None) -> "DeviceModel":
        """Initialise from the cloud: its embeddings, caption projector, first `n_layer` layers and final norm;
        the Inter-Head centers start as the cloud's output layer (radius starts small)."""
        config = config or DeviceConfig()
        if config.n_layer > cloud.config.n_layer:
            raise ValueError(f"device n_layer {config.n_layer} > cloud n_layer {cloud.config.n_layer}")
        if isinstance(cloud, ChameleonGPT):  # its blocks, image rows and unconditional prompt (ChameleonTrunk)
            dev = cls(cloud.config, config)
            dev.gpt.copy_from(cloud)
            dev.inter_head.init_center_from(cloud.image_head_weight.detach().float())
            return dev.to(cloud.tok_embeddings.weight.device)
        dev = cls(replace(cloud.config, lm_head=True), config)
        own = dev.gpt.state_dict()
        src = {k: v for k, v in cloud.state_dict().items() if k in own}
        dev.gpt.load_state_dict(src, strict=True)
        dev.inter_head.init_center_from(cloud.output.weight.detach())
        return dev.to(cloud.tok_embeddings.weight.device)

    # ------------------------------------------------------------------ heads
    def _out(self, h: torch.Tensor, with_heads: bool) -> DeviceOutput:
        if with_heads or self.device_config.num_heads > 1:
            centers, radii = self.inter_head.forward_heads(h)
            return DeviceOutput(centers.mean(0), radii.mean(0), h, (centers, radii) if with_heads else None)
        center, radius = self.inter_head(h)
        return DeviceOutput(center, radius, h)

    def forward(self, idx: torch.Tensor, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                drop: torch.Tensor | None = None, with_heads: bool = False) -> DeviceOutput:
        """Teacher-forced: idx [B, T] -> DeviceOutput over [B, T + 1, ...] (position j predicts image token j)."""
        _, _, h = self.gpt(idx, cond, cond_mask, drop=drop, return_hidden=True)
        return self._out(h, with_heads)

    # ------------------------------------------------------------------ cached decoding
    def new_cache(self, slots: int, max_seq: int | None = None) -> KVCache:
        return self.gpt.new_cache(slots, max_seq)

    def prefill(self, cache: KVCache, cond, cond_mask=None, drop=None, slots=None,
                with_heads: bool = False) -> DeviceOutput:
        """Write the condition into the cache; -> DeviceOutput [B, ...] for image token 0."""
        _, h = self.gpt.prefill(cache, cond, cond_mask, drop, slots, return_hidden=True)
        return self._out(h, with_heads)

    def decode(self, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor, slots=None,
               kv_len: int | None = None, with_heads: bool = False, last_only: bool = False) -> DeviceOutput:
        """Feed tokens [B, T] at input_pos; -> DeviceOutput [B, T, ...] (entry j predicts the token after j), or
        [B, 1, ...] for the last position only with `last_only` (the head runs on that position alone)."""
        _, h = self.gpt.decode(cache, tokens, input_pos, slots, kv_len=kv_len, return_hidden=True)
        return self._out(h[:, -1:] if last_only else h, with_heads)

    @torch.inference_mode()
    def step_seconds(self, rows: int = 1, repeats: int = 3) -> float:
        """Seconds of one cached decode step over `rows` cache rows (2 under CFG), the median of `repeats` after a
        warm-up, on a condition of zeros: what a device knows of its own step before its first image (the adaptive
        policy's prior, `ciar_device.policy.CostObserver.prime`; its images' own steps, with the gate's maths,
        replace it)."""
        c = self.config
        weight = self.gpt.tok_embeddings.weight
        cache = self.new_cache(rows, c.cls_token_num + 8)
        cond = (torch.zeros(rows, c.cls_token_num, c.caption_dim, dtype=weight.dtype, device=weight.device)
                if c.model_type == "t2i" else torch.zeros(rows, dtype=torch.long, device=weight.device))
        self.prefill(cache, cond)
        token = torch.zeros(rows, 1, dtype=torch.long, device=weight.device)
        pos = torch.tensor([c.cls_token_num], device=weight.device)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            self.decode(cache, token, pos, kv_len=c.cls_token_num + 1, last_only=True, with_heads=True)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    # ------------------------------------------------------------------ files
    def save(self, path: str, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
        cfg = {"gpt": self.config.to_dict(), "device": self.device_config.to_dict()}
        save_model(self, path, cfg, kind=DEVICE_KIND, extra=extra, dtype=dtype)

    @classmethod
    def load(cls, path: str, device: str | torch.device = "cpu") -> "DeviceModel":
        state, kind, cfg, extra = read_model_file(path)
        if kind != DEVICE_KIND:
            raise ValueError(f"{path}: expected a {DEVICE_KIND!r} file, found kind {kind!r}")
        model = cls(trunk_config(cfg["gpt"]), DeviceConfig.from_dict(cfg["device"]))
        load_strict(model, {k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                    what=f"device model ({path})")
        model.ciar_defaults = CIARDefaults.from_extra(extra, source=path)
        model.extra = extra
        return model.to(device).eval()


class TorchRuntime(Runtime):
    """The torch device model behind the device loop's runtime interface (`ciar_device.runtime.Runtime`'s checks,
    `DeviceRuntime`'s calls: `start`, `feed`, `rollback`, `step_seconds`; numpy in and out), one image at a time:
    the cluster's simulated phones run `ciar_device.loop` on it. A voting device's steps carry every head's box
    (`Step.heads`)."""

    def __init__(self, model: DeviceModel):
        self.model = model.eval()
        c = model.config
        self.vocab_size, self.num_tokens, self.dim = c.vocab_size, c.block_size, c.dim
        self.cls_token_num, self.caption_dim = c.cls_token_num, c.caption_dim
        dc = model.device_config
        self.voting = dc.num_heads > 1 and dc.combine == "voting"
        self.cache: KVCache | None = None

    @torch.inference_mode()
    def start(self, caption_emb, caption_mask, rows: int) -> Step:
        """Prefill the caption (caption_emb [L, caption_dim], caption_mask [L] bool) on `rows` rows (2: row 1
        unconditional) in a new cache; -> Step for image token 0."""
        emb, mask = self.checked_caption(caption_emb, caption_mask, rows)
        w = self.model.gpt.tok_embeddings.weight
        emb = torch.from_numpy(np.ascontiguousarray(emb)).to(w.device, w.dtype).unsqueeze(0).expand(rows, -1, -1)
        mask = torch.from_numpy(np.ascontiguousarray(mask, dtype=bool)).to(w.device).unsqueeze(0).expand(rows, -1)
        drop = torch.tensor([False, True], device=w.device) if rows == 2 else None
        self.cache = self.model.new_cache(rows)
        self.rows, self.length, self.started = rows, 0, True
        out = self.model.prefill(self.cache, emb, mask, drop, torch.arange(rows, device=w.device),
                                 with_heads=self.voting)
        return self._step(out)

    @torch.inference_mode()
    def feed(self, tokens, start: int) -> Step:
        """Feed image tokens at image indices start .. (every row the same ids; `start` at most the tokens held)
        -> Step of the last one."""
        start = int(start)
        toks = self.checked_feed(tokens, start)
        w = self.model.gpt.tok_embeddings.weight
        t = torch.from_numpy(toks).to(w.device).unsqueeze(0).expand(self.rows, -1)
        pos0 = self.cls_token_num + start
        pos = torch.arange(pos0, pos0 + len(toks), device=w.device)
        out = self.model.decode(self.cache, t, pos, kv_len=pos0 + len(toks), with_heads=self.voting, last_only=True)
        self.cache.set_length(range(self.rows), pos0 + len(toks))
        self.length = start + len(toks)
        return self._step(out, last=True)

    def rollback(self, length: int) -> None:
        """Keep image tokens [0, length) in the cache."""
        super().rollback(length)
        for r in range(self.rows):
            self.cache.rollback(r, self.cls_token_num + self.length)

    def step_seconds(self, rows: int = 1) -> float:
        return self.model.step_seconds(rows)

    @staticmethod
    def _step(out: DeviceOutput, last: bool = False) -> Step:
        """DeviceOutput ([rows, ...], or [rows, 1, ...] from a feed) -> Step of numpy float32 arrays."""
        pick = (lambda t: t[:, -1]) if last else (lambda t: t)
        heads = None
        if out.heads is not None:
            centers, radii = out.heads  # [H, rows, (1,) V]
            heads = (_np32(centers[:, :, -1] if last else centers), _np32(radii[:, :, -1] if last else radii))
        return Step(_np32(pick(out.center)), _np32(pick(out.radius)), _np32(pick(out.hidden)), heads)


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()
