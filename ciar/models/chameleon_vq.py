"""Chameleon's / Anole's image tokenizer: a taming-transformers VQGAN (f16, 8192 codes of dim 256, 512 px -> 32x32).

transformers ships only its encoder (`ChameleonVQVAE`); the decoder that turns tokens back into pixels lives in
Chameleon's own `chameleon/inference/vqgan.py` (a copy of taming-transformers' `VQModel`). This module is our own
implementation of that model: the module layout and parameter names are taming's, so the released
`tokenizer/vqgan.ckpt` (a PyTorch Lightning checkpoint, weights under "state_dict") with its `tokenizer/vqgan.yaml`
loads strictly through `load_chameleon_vq`. Building blocks that are the same architecture as LlamaGen's VQ
(resnet, attention, down/upsampling, nearest-code quantiser) come from `ciar.models.vq`.

    vq = load_chameleon_vq("tokenizer/vqgan.ckpt", "tokenizer/vqgan.yaml")
    quant, codes = vq.encode(images)            # images [B, 3, 512, 512] in [-1, 1] -> codes [B, 32, 32] int64
    images = vq.decode_code(codes.flatten(1))   # [B, 1024] (raster order) -> [B, 3, 512, 512], roughly [-1, 1]

Chameleon's pre-processing (`image_tokenizer.py`): RGBA blended onto white, shorter side resized to 512 (Lanczos),
centre crop 512x512, `x / 255 * 2 - 1`; post-processing: clamp to [-1, 1], `(x + 1) / 2 * 255` truncated to uint8
(`tensor_to_images_chameleon`; `ciar.models.vq.tensor_to_images` rounds instead).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.models.vq import AttnBlock, Downsample, ResnetBlock, Upsample, VectorQuantizer


class ChameleonVQConfigError(ValueError):
    """A VQGAN config field is missing, of the wrong type, or describes an architecture this module does not build."""


@dataclass
class ChameleonVQConfig:
    """taming's `ddconfig` plus the codebook (`n_embed` codes of `embed_dim`); defaults are Chameleon's / Anole's."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = ()  # attention inside the down/up levels at these resolutions (mid: always)
    z_channels: int = 256
    resolution: int = 512
    in_channels: int = 3
    out_ch: int = 3
    n_embed: int = 8192
    embed_dim: int = 256
    dropout: float = 0.0
    tanh_out: bool = False

    def __post_init__(self):
        self.ch_mult = tuple(self.ch_mult)
        self.attn_resolutions = tuple(self.attn_resolutions)
        self.validate()

    def validate(self) -> None:
        def bad(field, why):
            raise ChameleonVQConfigError(f"VQGAN config field {field!r}: {why} (got {getattr(self, field)!r})")

        for f in ("ch", "num_res_blocks", "z_channels", "resolution", "in_channels", "out_ch", "n_embed", "embed_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f, "must be a positive integer")
        if not self.ch_mult or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.ch_mult):
            bad("ch_mult", "must be a non-empty list of positive integers")
        if any(isinstance(r, bool) or not isinstance(r, int) for r in self.attn_resolutions):
            bad("attn_resolutions", "must be a list of integers")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            bad("dropout", "must be a number in [0, 1)")
        if not isinstance(self.tanh_out, bool):
            bad("tanh_out", "must be true or false")
        # taming's GroupNorm has 32 groups at every width (ciar.models.vq's falls back to 1 group otherwise)
        if self.ch % 32 or any(self.ch * m % 32 for m in self.ch_mult):
            bad("ch", f"ch and ch * each ch_mult {list(self.ch_mult)} must be multiples of 32 (GroupNorm's 32 groups)")
        if self.resolution % self.downsample:
            bad("resolution", f"must be a multiple of the downsampling factor {self.downsample}")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def grid_size(self) -> int:
        return self.resolution // self.downsample

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"], d["attn_resolutions"] = list(self.ch_mult), list(self.attn_resolutions)
        return d

    @staticmethod
    def from_dict(d: dict) -> "ChameleonVQConfig":
        unknown = sorted(set(d) - set(ChameleonVQConfig.__dataclass_fields__))
        if unknown:
            raise ChameleonVQConfigError(f"unknown VQGAN config fields: {unknown}")
        return ChameleonVQConfig(**d)

    @staticmethod
    def from_yaml_dict(doc: dict, where: str = "vqgan.yaml") -> "ChameleonVQConfig":
        """The config of a taming `VQModel` yaml (Chameleon's `tokenizer/vqgan.yaml`), as `yaml.safe_load` reads it:

            model: {target: taming.models.vqgan.VQModel,
                    params: {n_embed, embed_dim, ddconfig: {double_z, z_channels, resolution, in_channels, out_ch,
                                                            ch, ch_mult, num_res_blocks, attn_resolutions, dropout},
                             lossconfig: ..., ckpt_path: ..., ...}}

        Training-only fields are ignored (`_YAML_IGNORED_PARAMS`); a field that would change the architecture in a
        way this module does not build, or that it does not know, is an error naming it."""

        def need(d, key, path):
            if not isinstance(d, dict):
                raise ChameleonVQConfigError(f"{where}: {path or 'the document'} must be a mapping, "
                                             f"got {type(d).__name__}")
            if key not in d:
                raise ChameleonVQConfigError(f"{where}: missing field {(path + '.' if path else '') + key!r} "
                                             f"(present: {sorted(map(str, d))})")
            return d[key]

        model = need(doc, "model", "")
        target = model.get("target") if isinstance(model, dict) else None
        if target is not None and str(target).rsplit(".", 1)[-1] != "VQModel":
            raise ChameleonVQConfigError(f"{where}: field 'model.target' is {target!r}; only taming's VQModel "
                                         f"(nearest-code quantiser) is supported")
        params = need(model, "params", "model")
        dd = need(params, "ddconfig", "model.params")
        if not isinstance(dd, dict):
            raise ChameleonVQConfigError(f"{where}: 'model.params.ddconfig' must be a mapping")
        allowed = {"n_embed", "embed_dim", "ddconfig", *_YAML_IGNORED_PARAMS, *_YAML_NONE_PARAMS}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ChameleonVQConfigError(f"{where}: unknown fields in 'model.params': {unknown}")
        for key in _YAML_NONE_PARAMS:
            if params.get(key) is not None:
                raise ChameleonVQConfigError(f"{where}: field 'model.params.{key}' = {params[key]!r} is not supported "
                                             f"(only null / absent)")
        for key, want in _DDCONFIG_FIXED.items():
            if key in dd and dd[key] != want:
                raise ChameleonVQConfigError(f"{where}: field 'model.params.ddconfig.{key}' = {dd[key]!r} is not "
                                             f"supported (only {want!r})")
        known = set(ChameleonVQConfig.__dataclass_fields__) - {"n_embed", "embed_dim"}
        unknown = sorted(set(dd) - known - set(_DDCONFIG_FIXED))
        if unknown:
            raise ChameleonVQConfigError(f"{where}: unknown fields in 'model.params.ddconfig': {unknown}")
        fields = {k: need(dd, k, "model.params.ddconfig") for k in _DDCONFIG_REQUIRED}
        fields.update({k: dd[k] for k in ("dropout", "tanh_out") if k in dd})
        for key in ("ch_mult", "attn_resolutions"):
            if not isinstance(fields[key], (list, tuple)):
                raise ChameleonVQConfigError(f"{where}: field 'model.params.ddconfig.{key}' must be a list")
        try:
            return ChameleonVQConfig(n_embed=need(params, "n_embed", "model.params"),
                                     embed_dim=need(params, "embed_dim", "model.params"), **fields)
        except ChameleonVQConfigError as e:
            raise ChameleonVQConfigError(f"{where}: {e}") from None


# the yaml's ddconfig fields every taming VQModel config carries, and those with the one value we build
_DDCONFIG_REQUIRED = ("ch", "ch_mult", "num_res_blocks", "attn_resolutions", "z_channels", "resolution", "in_channels",
                      "out_ch")
_DDCONFIG_FIXED = {"double_z": False, "resamp_with_conv": True, "give_pre_end": False, "use_linear_attn": False,
                   "attn_type": "vanilla"}
# model.params fields of a taming VQModel that only matter for training / logging
_YAML_IGNORED_PARAMS = {"lossconfig", "ckpt_path", "ignore_keys", "image_key", "monitor", "scheduler_config",
                        "lr_g_factor", "sane_index_shape", "base_learning_rate"}
_YAML_NONE_PARAMS = ("remap", "colorize_nlabels")  # would add buffers / change code indices

CHAMELEON_VQ = ChameleonVQConfig()  # Chameleon-7B/30B's and Anole-7B's tokenizer


# ---------------------------------------------------------------------------------------------------- model
def _stage(cin: int, cout: int, n_blocks: int, attn: bool, dropout: float) -> nn.Module:
    """One resolution level in taming's layout: `block.{i}` resnets, `attn.{i}` after each when `attn`."""
    stage = nn.Module()
    stage.block, stage.attn = nn.ModuleList(), nn.ModuleList()
    for _ in range(n_blocks):
        stage.block.append(ResnetBlock(cin, cout, dropout))
        cin = cout
        if attn:
            stage.attn.append(AttnBlock(cout))
    return stage


def _run_stage(stage: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(stage.block):
        h = block(h)
        if len(stage.attn):
            h = stage.attn[i](h)
    return h


def _middle(c: int, dropout: float) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(c, c, dropout), AttnBlock(c), ResnetBlock(c, c, dropout)
    return mid


def _run_middle(mid: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


class TamingEncoder(nn.Module):
    """`encoder.*`: conv_in, down.{level}.{block,attn,downsample}, mid.{block_1,attn_1,block_2}, norm_out, conv_out."""

    def __init__(self, cfg: ChameleonVQConfig):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        cin, res = ch, cfg.resolution
        for level, m in enumerate(mult):
            stage = _stage(cin, ch * m, cfg.num_res_blocks, res in cfg.attn_resolutions, cfg.dropout)
            cin = ch * m
            if level != len(mult) - 1:
                stage.downsample = Downsample(cin)
                res //= 2
            self.down.append(stage)
        self.mid = _middle(cin, cfg.dropout)
        self.norm_out = nn.GroupNorm(32, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.down:
            h = _run_stage(stage, h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        return self.conv_out(F.silu(self.norm_out(_run_middle(self.mid, h))))


class TamingDecoder(nn.Module):
    """`decoder.*`: conv_in, mid, up.{level}.{block,attn,upsample} (indexed by level, run from the lowest
    resolution up; num_res_blocks + 1 resnets each), norm_out, conv_out."""

    def __init__(self, cfg: ChameleonVQConfig):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        cin, res = ch * mult[-1], cfg.grid_size
        self.conv_in = nn.Conv2d(cfg.z_channels, cin, 3, padding=1)
        self.mid = _middle(cin, cfg.dropout)
        stages = []
        for level in reversed(range(len(mult))):
            stage = _stage(cin, ch * mult[level], cfg.num_res_blocks + 1, res in cfg.attn_resolutions, cfg.dropout)
            cin = ch * mult[level]
            if level != 0:
                stage.upsample = Upsample(cin)
                res *= 2
            stages.insert(0, stage)
        self.up = nn.ModuleList(stages)
        self.norm_out = nn.GroupNorm(32, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, cfg.out_ch, 3, padding=1)
        self.tanh_out = cfg.tanh_out

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = _run_middle(self.mid, self.conv_in(z))
        for stage in reversed(self.up):
            h = _run_stage(stage, h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return torch.tanh(h) if self.tanh_out else h


class ChameleonVQModel(nn.Module):
    """The VQGAN with `ciar.models.vq.VQModel`'s API: `encode` -> (quantised latents, codes [B, h, w]),
    `decode_code(codes [B, h*w] or [B, h, w])` -> images."""

    def __init__(self, cfg: ChameleonVQConfig = CHAMELEON_VQ):
        super().__init__()
        self.config = cfg
        self.encoder = TamingEncoder(cfg)
        self.decoder = TamingDecoder(cfg)
        # taming's VectorQuantizer2: plain nearest code by squared distance (no normalisation), beta 0.25
        self.quantize = VectorQuantizer(cfg.n_embed, cfg.embed_dim, 0.25, l2_norm=False)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)

    @property
    def grid_size(self) -> int:
        return self.config.grid_size

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_channels, H, W] in [-1, 1] -> pre-quantisation latents [B, embed_dim, H/16, W/16]."""
        return self.quant_conv(self.encoder(x))

    def encode(self, x: torch.Tensor):
        """x: [B, 3, H, W] in [-1, 1] -> (quantised latents [B, embed_dim, h, w], codes [B, h, w] int64)."""
        z_q, codes, _, _ = self.quantize(self.encode_latents(x))
        return z_q, codes

    def decode(self, z_q: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z_q))

    def decode_code(self, codes: torch.Tensor, grid: int | tuple[int, int] | None = None) -> torch.Tensor:
        """codes: [B, h*w] (raster order) or [B, h, w] -> images [B, out_ch, 16h, 16w] in roughly [-1, 1].
        `grid` ((h, w) or a side) shapes flat codes; default: square."""
        if codes.dim() == 2:
            if grid is None:
                grid = int(round(codes.shape[1] ** 0.5))
            h, w = (grid, grid) if isinstance(grid, int) else grid
            if h * w != codes.shape[1]:
                raise ValueError(f"{codes.shape[1]} codes per image do not fill a {h}x{w} grid")
            codes = codes.reshape(codes.shape[0], h, w)
        elif codes.dim() != 3:
            raise ValueError(f"codes must be [B, h*w] or [B, h, w], got shape {tuple(codes.shape)}")
        return self.decode(self.quantize.lookup(codes.long()))

    def forward(self, x: torch.Tensor):
        z_q, codes, losses, _ = self.quantize(self.encode_latents(x))
        return self.decode(z_q), codes, losses


# ---------------------------------------------------------------------------------------------------- loading
# Lightning checkpoints of taming's VQModel keep the training loss module (LPIPS network, PatchGAN discriminator)
# under "loss."; it is not part of the tokenizer.
CHAMELEON_VQ_IGNORED_KEY_PREFIXES = ("loss.",)


def read_vqgan_yaml(path: str) -> ChameleonVQConfig:
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"VQGAN config (yaml_path) not found: {path}")
    with open(path) as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ChameleonVQConfigError(f"{path}: not valid YAML: {e}") from None
    return ChameleonVQConfig.from_yaml_dict(doc, where=path)


def load_chameleon_vq(ckpt_path: str, yaml_path: str, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> ChameleonVQModel:
    """Load Chameleon's / Anole's `tokenizer/vqgan.ckpt` with its `tokenizer/vqgan.yaml`, strictly.

    Both files are checked first: the yaml's fields (`ChameleonVQConfig.from_yaml_dict`), then every key and shape
    of the checkpoint's "state_dict" against the model built from them (on the meta device), naming every missing,
    unexpected or mis-shaped key (`CheckpointMismatchError`); keys under `CHAMELEON_VQ_IGNORED_KEY_PREFIXES`
    (the Lightning training loss: LPIPS / discriminator) are skipped. Only then are the weights read, one tensor at a
    time, cast to `dtype`. The checkpoint is unpickled with `weights_only=True`: a Lightning file holding Python
    objects beyond tensors and plain containers is refused with the offending global named."""
    import pickle

    from ciar.models.checkpoint import CheckpointMismatchError, load_cast, load_strict, open_checkpoint

    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"VQGAN checkpoint (ckpt_path) not found: {ckpt_path}")
    cfg = read_vqgan_yaml(yaml_path)
    with torch.device("meta"):
        model = ChameleonVQModel(cfg)
    what = f"Chameleon VQGAN of {yaml_path} (checkpoint {ckpt_path})"
    try:
        with open_checkpoint(ckpt_path) as stored:
            if not any(k.startswith(("encoder.", "decoder.")) for k in stored):
                raise CheckpointMismatchError(
                    f"{ckpt_path}: no VQGAN weights (no 'encoder.*' / 'decoder.*' keys); expected a Lightning "
                    f"checkpoint with a 'state_dict' entry or a bare state dict; entries: {sorted(stored)[:20]}")
            load_strict(model, {k: v.placeholder() for k, v in stored.items()},
                        ignore_prefixes=CHAMELEON_VQ_IGNORED_KEY_PREFIXES, what=what)
            load_cast(model, stored, dtype, ignore_prefixes=CHAMELEON_VQ_IGNORED_KEY_PREFIXES, what=what)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported global" in ln), lines[-1] if lines else "")
        raise CheckpointMismatchError(
            f"{ckpt_path}: cannot be read with torch.load(weights_only=True): {why} "
            f"If the file is trusted, extract its weights once: "
            f"torch.save(torch.load(p, weights_only=False)['state_dict'], out)") from None
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------------- transformers
def config_from_hf(hf_config) -> ChameleonVQConfig:
    """Our config for a transformers `ChameleonVQVAEConfig` (its `vq_config`)."""
    if getattr(hf_config, "double_latent", False):
        raise ChameleonVQConfigError("ChameleonVQVAEConfig.double_latent = True is not supported")
    if getattr(hf_config, "attn_type", "vanilla") != "vanilla":
        raise ChameleonVQConfigError(f"ChameleonVQVAEConfig.attn_type = {hf_config.attn_type!r}: only 'vanilla'")
    return ChameleonVQConfig(ch=hf_config.base_channels, ch_mult=tuple(hf_config.channel_multiplier),
                             num_res_blocks=hf_config.num_res_blocks,
                             attn_resolutions=tuple(hf_config.attn_resolutions or ()),
                             z_channels=hf_config.latent_channels, resolution=hf_config.resolution,
                             in_channels=hf_config.in_channels, n_embed=hf_config.num_embeddings,
                             embed_dim=hf_config.embed_dim, dropout=float(hf_config.dropout))


_HF_PREFIXES = ("model.vqmodel.", "vqmodel.")  # ChameleonForConditionalGeneration / ChameleonModel nesting


def from_hf_vqvae_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' `ChameleonVQVAE` state dict (alone, or inside a Chameleon model: the `vqmodel.` entries)
    -> ours. HF kept taming's names (its converter copies `vqgan.ckpt`'s keys, dropping `decoder.*`), so the map is
    the prefix only; the result has no decoder weights (load it with `ignore_prefixes=("decoder.",)`)."""
    nested = any(k.startswith(_HF_PREFIXES) for k in state)
    out = {}
    for k, v in state.items():
        p = next((p for p in _HF_PREFIXES if k.startswith(p)), None)
        if nested and p is None:
            continue  # the language model's weights
        name = k[len(p):] if p else k
        if not name.startswith(("encoder.", "quantize.", "quant_conv.", "post_quant_conv.")):
            raise ValueError(f"not a ChameleonVQVAE weight: {k}")
        out[name] = v
    return out


def tensor_to_images_chameleon(x: torch.Tensor) -> torch.Tensor:
    """float [B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3] as Chameleon's `_pil_from_chw_tensor`: clamp,
    (x + 1) / 2 * 255, truncated (not rounded)."""
    return ((x.clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
