"""The default world: shipped tokenizer + cloud model + caption encoder, loaded in one call.

    world = load_default_world()                       # weights/scenes-v2 of this repo, or $CIAR_WEIGHTS
    world = load_default_world("path/to/weights", device="cuda")
    cap = world.text.encode(["a small red circle at the top on a gray background"])

A weights folder holds `tokenizer.safetensors` (kind "vq") and `cloud.safetensors` (kind "gpt"), both written by
`ciar.models.checkpoint.save_model` with their config in the metadata, and optionally the CIAR device model
`device.safetensors` and the interval-feature projector `projector.safetensors` (loaded when present). The cloud file's `extra["sampling"]`
(a dict of `SamplingParams` fields), when present, gives the world's default sampling settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from ciar.decoding.sampling import LLAMAGEN_T2I_DEFAULTS, SamplingParams
from ciar.models.checkpoint import load_strict, read_model_file
from ciar.models.gpt import GPT, GPTConfig
from ciar.models.vq import VQ_IGNORED_KEY_PREFIXES, VQConfig, VQModel
from ciar.text import TextEncoder
from ciar.world_spec import (DEFAULT_WEIGHTS_DIR, WEIGHTS_ENV, AnoleWorldSpec, LlamaGenWorldSpec,  # noqa: F401
                             ScenesWorldSpec, WorldSpecError, default_weights_dir,
                             read_world)  # (re-exported: one home)

# used when the cloud file carries no sampling defaults
FALLBACK_SAMPLING = SamplingParams(cfg_scale=3.0, temperature=1.0, top_k=0, top_p=1.0)


@dataclass
class World:
    vq: VQModel  # image tokenizer (eval mode, float32)
    cloud: GPT  # cloud text-to-image GPT (eval mode; float32, or a LlamaGen world's gpt_dtype)
    text: TextEncoder  # caption encoder, max_length = cloud.config.cls_token_num
    weights_dir: str  # absolute path of the folder the weights came from
    sampling: SamplingParams  # the world's default sampling settings
    device_model: "DeviceModel | None" = None  # CIAR device model (device.safetensors), if shipped
    projector: "IntervalProjector | None" = None  # interval-feature projector (projector.safetensors), if shipped
    cloud_file: str | None = None  # the file the cloud GPT came from (names caches of its samples)
    device_file: str | None = None  # the file the device model came from

    @property
    def codebook(self) -> torch.Tensor:
        """Raw codebook vectors [V, D] of the tokenizer (LANTERN's neighbour sets)."""
        return self.vq.quantize.embedding.weight.detach()

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device


def _read(weights_dir: str, name: str, kind: str):
    path = os.path.join(weights_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing weight file {name} in {weights_dir} (set --weights or ${WEIGHTS_ENV} "
                                f"to a folder holding tokenizer.safetensors and cloud.safetensors)")
    state, found, config, extra = read_model_file(path)
    if found != kind:
        raise ValueError(f"{path}: expected a {kind!r} weight file, found kind {found!r}")
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, config, extra


def sampling_from_extra(extra: dict, source: str = "cloud.safetensors") -> SamplingParams:
    """`extra["sampling"]` of a cloud weight file -> SamplingParams (FALLBACK_SAMPLING when absent)."""
    given = extra.get("sampling")
    if given is None:
        return FALLBACK_SAMPLING
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{source}: unknown sampling fields {unknown}; known: {sorted(known)}")
    try:
        return SamplingParams(**given)
    except ValueError as e:
        raise ValueError(f"{source}: bad sampling defaults: {e}") from None


def load_default_world(weights_dir: str | None = None, device: str | torch.device = "cpu",
                       device_file: str | None = None, projector_file: str | None = None) -> World:
    """Load tokenizer, cloud model and text encoder from `weights_dir` (default: `default_weights_dir()`), and the
    device model / projector when present (`device_file` / `projector_file`: another file than the folder's).

    Raises FileNotFoundError naming the missing file, or CheckpointMismatchError if a file does not fit its model.
    """
    weights_dir = os.path.abspath(weights_dir) if weights_dir else default_weights_dir()
    if not os.path.isdir(weights_dir):
        raise FileNotFoundError(f"weights folder not found: {weights_dir} (pass another folder or set ${WEIGHTS_ENV})")
    device = torch.device(device)

    state, config, _ = _read(weights_dir, "tokenizer.safetensors", "vq")
    vq = VQModel(VQConfig.from_dict(config))
    load_strict(vq, state, ignore_prefixes=VQ_IGNORED_KEY_PREFIXES, what="tokenizer (tokenizer.safetensors)")

    state, config, extra = _read(weights_dir, "cloud.safetensors", "gpt")
    cloud = GPT(GPTConfig.from_dict(config))
    load_strict(cloud, state, what="cloud model (cloud.safetensors)")

    text = TextEncoder(max_length=cloud.config.cls_token_num, device=device)
    if cloud.config.model_type == "t2i" and text.dim != cloud.config.caption_dim:
        raise ValueError(f"the text encoder gives {text.dim}-d embeddings but the cloud model expects "
                         f"caption_dim={cloud.config.caption_dim}")
    device_model = projector = None
    device_file = device_file or os.path.join(weights_dir, "device.safetensors")
    projector_file = projector_file or os.path.join(weights_dir, "projector.safetensors")
    if os.path.isfile(device_file):
        from ciar.collab.device import DeviceModel

        device_model = DeviceModel.load(device_file, device=device)
    if os.path.isfile(projector_file):
        from ciar.collab.projector import IntervalProjector

        projector = IntervalProjector.load(projector_file, device=device)
    return World(vq=vq.to(device).eval(), cloud=cloud.to(device).eval(), text=text, weights_dir=weights_dir,
                 sampling=sampling_from_extra(extra), device_model=device_model, projector=projector,
                 cloud_file=os.path.join(weights_dir, "cloud.safetensors"),
                 device_file=device_file if device_model is not None else None)


def load_world(source=None, device: str | torch.device = "cpu", need_device: bool = False,
               need_text: bool = False) -> World:
    """Load the world a description names (`ciar.world_spec.read_world`: a YAML / JSON file, a dict, a parsed spec,
    or None for the shipped scenes world). `need_device`: refuse a world without a CIAR device model; `need_text`:
    refuse a LlamaGen world that cannot encode new captions (no `text_encoder`). Every named file is checked first."""
    spec = read_world(source, need_device=need_device, need_text=need_text)
    if isinstance(spec, ScenesWorldSpec):
        return load_default_world(spec.weights_dir(), device=device,
                                  device_file=spec.file("device.safetensors", spec.device_checkpoint),
                                  projector_file=spec.file("projector.safetensors", spec.projector_checkpoint))
    if isinstance(spec, AnoleWorldSpec):
        return load_anole_world(spec, device=device)
    return load_llamagen_world(spec, device=device)


def load_world_cloud(source=None, device: str | torch.device = "cpu") -> tuple[GPT, str]:
    """Only the cloud GPT of a world (a throughput benchmark needs nothing else) -> (GPT in eval mode, its file)."""
    from ciar.models.gpt import load_llamagen_gpt

    spec = read_world(source)
    if isinstance(spec, ScenesWorldSpec):
        state, config, _ = _read(spec.weights_dir(), "cloud.safetensors", "gpt")
        cloud = GPT(GPTConfig.from_dict(config))
        load_strict(cloud, state, what="cloud model (cloud.safetensors)")
        path = os.path.join(spec.weights_dir(), "cloud.safetensors")
    elif isinstance(spec, AnoleWorldSpec):
        cloud, path = _anole_cloud(spec), anole_weights_file(spec)
    else:
        path = spec.path(spec.gpt_checkpoint)
        cloud = load_llamagen_gpt(path, spec.gpt_config, image_size=spec.image_size, downsample=spec.downsample,
                                  dtype=_gpt_dtype(spec), **spec.gpt_overrides)
    return cloud.to(torch.device(device)).eval(), path


def load_llamagen_world(spec, device: str | torch.device = "cpu", text: bool = True) -> World:
    """The real-model path: a LlamaGen text-to-image GPT and VQ tokenizer from local checkpoint files, a runtime T5
    caption encoder (`text_encoder`, `ciar.t5.T5CaptionEncoder`) or precomputed T5 features (`t5_embeddings`:
    `world.text` is then a `PrecomputedCaptions` to fill), and the CIAR device model (and projector) trained for that
    GPT. `spec`: a `LlamaGenWorldSpec`, or its dict (the evaluation's flat `--model-config` too). Raises
    WorldSpecError naming a missing file or a mismatch (vocabulary, grid, caption width), CheckpointMismatchError
    naming mismatched keys. `text=False` skips the caption encoder (a trainer that reads cached captions)."""
    from ciar.models.gpt import load_llamagen_gpt
    from ciar.text import PrecomputedCaptions

    if not isinstance(spec, LlamaGenWorldSpec):
        spec = read_world({"kind": "llamagen", **spec} if isinstance(spec, dict) and "kind" not in spec else spec)
        if not isinstance(spec, LlamaGenWorldSpec):
            raise WorldSpecError(f"expected a LlamaGen world, got {spec.describe()}")
    device = torch.device(device)
    cloud = load_llamagen_gpt(spec.path(spec.gpt_checkpoint), spec.gpt_config, image_size=spec.image_size,
                              downsample=spec.downsample, dtype=_gpt_dtype(spec), **spec.gpt_overrides)
    vq = _llamagen_vq(spec, cloud.config)
    device_model = projector = None
    if spec.device_checkpoint:
        device_model = _llamagen_device(spec, cloud.config, device)
    if spec.projector_checkpoint:
        from ciar.collab.projector import IntervalProjector

        projector = IntervalProjector.load(spec.path(spec.projector_checkpoint), device=device)
    caption_dim, positions = cloud.config.caption_dim, cloud.config.cls_token_num
    if text and spec.text_encoder:
        from ciar.t5 import T5CaptionEncoder

        enc = T5CaptionEncoder(spec.path(spec.text_encoder), max_length=spec.text_max_length or positions,
                               device=device, dtype=spec.text_dtype)
        if enc.dim != caption_dim:
            raise WorldSpecError(f"text_encoder: {spec.text_encoder} gives {enc.dim}-d caption embeddings but the "
                                 f"GPT's caption projector takes caption_dim={caption_dim}")
        if enc.max_length > positions:
            raise WorldSpecError(f"text_max_length: {enc.max_length} tokens > the GPT's {positions} caption positions")
    else:
        enc = PrecomputedCaptions(positions, caption_dim)
    return World(vq=vq.to(device).eval(), cloud=cloud.to(device).eval(), text=enc,
                 weights_dir=os.path.dirname(spec.path(spec.gpt_checkpoint)), sampling=llamagen_sampling(spec),
                 device_model=device_model, projector=projector, cloud_file=spec.path(spec.gpt_checkpoint),
                 device_file=spec.device_file())


def _gpt_dtype(spec) -> torch.dtype:
    """The cloud GPT's dtype the world gives (`gpt_dtype`): `load_llamagen_gpt` casts each weight to it as it reads
    the checkpoint, so a bfloat16 world never holds the float32 weights."""
    from ciar.t5 import DTYPES

    return DTYPES[spec.gpt_dtype]


def llamagen_sampling(spec) -> SamplingParams:
    """LlamaGen's t2i defaults (7.5 / 1.0 / 1000 / 1.0) with the world file's `sampling` on top (validated)."""
    try:
        return replace(LLAMAGEN_T2I_DEFAULTS, **spec.sampling.given())
    except ValueError as e:
        raise WorldSpecError(f"sampling: {e}") from None


def _llamagen_vq(spec, gpt_cfg: GPTConfig) -> VQModel:
    from ciar.models.vq import load_llamagen_vq

    vq = load_llamagen_vq(spec.path(spec.vq_checkpoint), spec.vq_config,
                          **{"image_size": spec.image_size, **spec.vq_overrides})
    if vq.config.codebook_size != gpt_cfg.vocab_size:
        raise WorldSpecError(f"vq_checkpoint: the tokenizer has {vq.config.codebook_size} codes but the GPT predicts "
                             f"{gpt_cfg.vocab_size}")
    grid = vq.config.image_size // vq.config.downsample
    if grid * grid != gpt_cfg.block_size:
        raise WorldSpecError(f"vq_checkpoint: the tokenizer's {grid}x{grid} grid at {vq.config.image_size}px does not "
                             f"fit the GPT's {gpt_cfg.block_size} image tokens (image_size / downsample)")
    return vq


def _llamagen_device(spec, gpt_cfg: GPTConfig, device) -> "DeviceModel":
    from ciar.collab.device import DeviceModel

    dm = DeviceModel.load(spec.path(spec.device_checkpoint), device=device)
    dc = dm.config
    if (dc.vocab_size, dc.block_size, dc.cls_token_num, dc.caption_dim) != \
            (gpt_cfg.vocab_size, gpt_cfg.block_size, gpt_cfg.cls_token_num, gpt_cfg.caption_dim):
        raise WorldSpecError(
            f"device_checkpoint: {spec.device_checkpoint}: the device model (vocab {dc.vocab_size}, {dc.block_size} "
            f"tokens, {dc.cls_token_num} x {dc.caption_dim} caption) does not fit the GPT (vocab {gpt_cfg.vocab_size}, "
            f"{gpt_cfg.block_size} tokens, {gpt_cfg.cls_token_num} x {gpt_cfg.caption_dim} caption)")
    return dm


# ---------------------------------------------------------------------------------------------------- Anole worlds
def load_anole_world(spec, device: str | torch.device = "cpu", text: bool = True) -> World:
    """An Anole (Chameleon) world: the decoder from its transformers folder (`ciar.models.chameleon.load_chameleon`,
    in `gpt_dtype`, image-code space), Chameleon's VQGAN (`load_chameleon_vq`), the prompt encoder over the folder's
    tokenizer.json (`ciar.text.ChameleonPromptEncoder`: captions are token ids) and the CIAR device model (a
    `ChameleonTrunk`) and projector. `spec`: an AnoleWorldSpec or its dict. Every config and shape is checked first
    (`AnoleWorldSpec.check`: the vocabulary map's image codes against the VQGAN's codebook, its resolution against
    image_size, the token grid against the decoder's positions, the device file's header against the decoder);
    then the small files load, the decoder last (each file strictly: CheckpointMismatchError names the keys).
    `text=False` skips the prompt encoder."""
    from ciar.text import ChameleonPromptEncoder

    if not isinstance(spec, AnoleWorldSpec):
        spec = read_world({"kind": "anole", **spec} if isinstance(spec, dict) and "kind" not in spec else spec)
        if not isinstance(spec, AnoleWorldSpec):
            raise WorldSpecError(f"expected an Anole world, got {spec.describe()}")
    device = torch.device(device)
    vq = _anole_vq(spec)
    device_model = projector = None
    if spec.device_checkpoint:
        from ciar.collab.device import DeviceModel

        device_model = DeviceModel.load(spec.device_file(), device=device)
    if spec.projector_checkpoint:
        from ciar.collab.projector import IntervalProjector

        projector = IntervalProjector.load(spec.path(spec.projector_checkpoint), device=device)
    cloud = _anole_cloud(spec).to(device).eval()
    enc = ChameleonPromptEncoder(spec.tokenizer_file(), cloud, device=device) if text else None
    return World(vq=vq.to(device).eval(), cloud=cloud, text=enc, weights_dir=spec.path(spec.model),
                 sampling=anole_sampling(spec), device_model=device_model, projector=projector,
                 cloud_file=anole_weights_file(spec), device_file=spec.device_file())


def _anole_cloud(spec):
    from ciar.models.chameleon import load_chameleon

    cfg = spec.gpt_cfg()
    return load_chameleon(spec.path(spec.model), cls_token_num=cfg.cls_token_num, block_size=cfg.block_size,
                          dtype=_gpt_dtype(spec))


def _anole_vq(spec):
    from ciar.models.chameleon_vq import load_chameleon_vq

    return load_chameleon_vq(spec.path(spec.vq_checkpoint), spec.path(spec.vq_yaml))


def anole_weights_file(spec) -> str:
    """The decoder's first weight file (names the caches of its samples, as a LlamaGen world's checkpoint does)."""
    return spec.weight_files()[0]


def anole_sampling(spec) -> SamplingParams:
    """Anole's sampling (cfg 3.0, temperature 0.7, top-p 0.9, no top-k: `ciar.world_spec.ANOLE_SAMPLING`) with
    the world file's `sampling` on top (validated)."""
    from ciar.world_spec import ANOLE_SAMPLING

    try:
        return SamplingParams(**{**ANOLE_SAMPLING, **spec.sampling.given()})
    except ValueError as e:
        raise WorldSpecError(f"sampling: {e}") from None


@dataclass
class DeviceSide:
    """What a device needs (no cloud model, no caption encoder): the CIAR device model, the tokenizer's decoder
    and the world's sampling defaults."""

    vq: VQModel
    device_model: "DeviceModel"
    sampling: SamplingParams
    num_tokens: int  # image tokens per image
    weights_dir: str
    device_file: str  # the device model's file


def load_device_side(world=None, device: str | torch.device = "cpu") -> DeviceSide:
    """Load only the device half of a world (a simulated phone in the Serve cluster): the device model, the VQ
    decoder and the sampling defaults. `world`: anything `ciar.world_spec.read_world` takes (a weights folder too)."""
    from ciar.collab.device import DeviceModel
    from ciar.models.checkpoint import read_model_metadata

    spec = read_world(world, need_device=True)
    device = torch.device(device)
    if isinstance(spec, ScenesWorldSpec):
        weights_dir = spec.weights_dir()
        state, config, _ = _read(weights_dir, "tokenizer.safetensors", "vq")
        vq = VQModel(VQConfig.from_dict(config))
        load_strict(vq, state, ignore_prefixes=VQ_IGNORED_KEY_PREFIXES, what="tokenizer (tokenizer.safetensors)")
        device_model = DeviceModel.load(spec.device_file(), device=device)
        _, _, extra = read_model_metadata(os.path.join(weights_dir, "cloud.safetensors"))
        sampling = sampling_from_extra(extra)
    elif isinstance(spec, AnoleWorldSpec):
        vq = _anole_vq(spec)
        device_model = DeviceModel.load(spec.device_file(), device=device)
        sampling, weights_dir = anole_sampling(spec), os.path.dirname(spec.device_file())
    else:
        gpt_cfg = spec.gpt_cfg()
        vq = _llamagen_vq(spec, gpt_cfg)
        device_model = _llamagen_device(spec, gpt_cfg, device)
        sampling, weights_dir = llamagen_sampling(spec), os.path.dirname(spec.path(spec.device_checkpoint))
    return DeviceSide(vq=vq.to(device).eval(), device_model=device_model, sampling=sampling,
                      num_tokens=device_model.config.block_size, weights_dir=weights_dir,
                      device_file=spec.device_file())
