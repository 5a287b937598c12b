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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WEIGHTS_DIR = os.path.join(REPO_ROOT, "weights", "scenes-v2")
WEIGHTS_ENV = "CIAR_WEIGHTS"
# used when the cloud file carries no sampling defaults
FALLBACK_SAMPLING = SamplingParams(cfg_scale=3.0, temperature=1.0, top_k=0, top_p=1.0)


@dataclass
class World:
    vq: VQModel  # image tokenizer (eval mode, float32)
    cloud: GPT  # cloud text-to-image GPT (eval mode, float32)
    text: TextEncoder  # caption encoder, max_length = cloud.config.cls_token_num
    weights_dir: str  # absolute path of the folder the weights came from
    sampling: SamplingParams  # the world's default sampling settings
    device_model: "DeviceModel | None" = None  # CIAR device model (device.safetensors), if shipped
    projector: "IntervalProjector | None" = None  # interval-feature projector (projector.safetensors), if shipped

    @property
    def codebook(self) -> torch.Tensor:
        """Raw codebook vectors [V, D] of the tokenizer (LANTERN's neighbour sets)."""
        return self.vq.quantize.embedding.weight.detach()

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device


def default_weights_dir() -> str:
    """$CIAR_WEIGHTS if set, else this repo's `weights/scenes-v2` (independent of the working directory)."""
    return os.path.abspath(os.environ.get(WEIGHTS_ENV) or DEFAULT_WEIGHTS_DIR)


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


def load_default_world(weights_dir: str | None = None, device: str | torch.device = "cpu") -> World:
    """Load tokenizer, cloud model and text encoder from `weights_dir` (default: `default_weights_dir()`).

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
    if os.path.isfile(os.path.join(weights_dir, "device.safetensors")):
        from ciar.collab.device import DeviceModel

        device_model = DeviceModel.load(os.path.join(weights_dir, "device.safetensors"), device=device)
    if os.path.isfile(os.path.join(weights_dir, "projector.safetensors")):
        from ciar.collab.projector import IntervalProjector

        projector = IntervalProjector.load(os.path.join(weights_dir, "projector.safetensors"), device=device)
    return World(vq=vq.to(device).eval(), cloud=cloud.to(device).eval(), text=text, weights_dir=weights_dir,
                 sampling=sampling_from_extra(extra), device_model=device_model, projector=projector)


LLAMAGEN_FILE_KEYS = ("gpt_checkpoint", "vq_checkpoint", "device_checkpoint", "projector_checkpoint")


def load_llamagen_world(files: dict, device: str | torch.device = "cpu") -> World:
    """The real-model path: a LlamaGen text-to-image GPT and VQ tokenizer from local checkpoint files, plus a CIAR
    device model (and optionally a projector) trained for that GPT. `files` (e.g. `--model-config` of
    `pipelines.evaluate`):

        gpt_checkpoint   LlamaGen t2i checkpoint (.pt / .safetensors), gpt_config "GPT-XL" (registry name),
                         image_size 256 (or 512), gpt_overrides {...} (config fields, for non-registry sizes)
        vq_checkpoint    LlamaGen vq_ds16_t2i.pt, vq_config "VQ-16", vq_overrides {...}
        device_checkpoint   a ciar device model (`DeviceModel.save`) for this GPT (same vocabulary and grid)
        projector_checkpoint  optional interval-feature projector
        cfg_scale, temperature, top_k, top_p   sampling (default: LlamaGen's 7.5 / 1.0 / 1000 / 1.0)

    Captions come precomputed (T5): `world.text` is a `PrecomputedCaptions` to fill. Raises FileNotFoundError naming
    a missing file and CheckpointMismatchError naming mismatched keys."""
    from ciar.models.gpt import load_llamagen_gpt
    from ciar.models.vq import load_llamagen_vq
    from ciar.text import PrecomputedCaptions

    for key in LLAMAGEN_FILE_KEYS:
        if key in files and not os.path.isfile(files[key]):
            raise FileNotFoundError(f"{key}: file not found: {files[key]}")
    for key in ("gpt_checkpoint", "vq_checkpoint"):
        if key not in files:
            raise ValueError(f"the LlamaGen world needs {key}")
    device = torch.device(device)
    image_size = int(files.get("image_size", 256))
    cloud = load_llamagen_gpt(files["gpt_checkpoint"], files.get("gpt_config", "GPT-XL"), image_size=image_size,
                              **files.get("gpt_overrides", {}))
    vq = load_llamagen_vq(files["vq_checkpoint"], files.get("vq_config", "VQ-16"),
                          **{"image_size": image_size, **files.get("vq_overrides", {})})
    if vq.config.codebook_size != cloud.config.vocab_size:
        raise ValueError(f"the tokenizer has {vq.config.codebook_size} codes but the GPT predicts "
                         f"{cloud.config.vocab_size}")
    device_model = projector = None
    if files.get("device_checkpoint"):
        from ciar.collab.device import DeviceModel

        device_model = DeviceModel.load(files["device_checkpoint"], device=device)
        dc, cc = device_model.config, cloud.config
        if (dc.vocab_size, dc.block_size, dc.cls_token_num) != (cc.vocab_size, cc.block_size, cc.cls_token_num):
            raise ValueError(f"{files['device_checkpoint']}: the device model (vocab {dc.vocab_size}, "
                             f"{dc.block_size} tokens, {dc.cls_token_num} caption positions) does not fit the GPT "
                             f"(vocab {cc.vocab_size}, {cc.block_size} tokens, {cc.cls_token_num} caption positions)")
    if files.get("projector_checkpoint"):
        from ciar.collab.projector import IntervalProjector

        projector = IntervalProjector.load(files["projector_checkpoint"], device=device)
    given = {k: files[k] for k in ("cfg_scale", "temperature", "top_k", "top_p") if k in files}
    sampling = replace(LLAMAGEN_T2I_DEFAULTS, **given)  # validated on construction
    text = PrecomputedCaptions(cloud.config.cls_token_num, cloud.config.caption_dim)
    return World(vq=vq.to(device).eval(), cloud=cloud.to(device).eval(), text=text,
                 weights_dir=os.path.dirname(os.path.abspath(files["gpt_checkpoint"])), sampling=sampling,
                 device_model=device_model, projector=projector)


@dataclass
class DeviceSide:
    """What a device needs (no cloud model, no caption encoder): the CIAR device model, the tokenizer's decoder
    and the world's sampling defaults."""

    vq: VQModel
    device_model: "DeviceModel"
    sampling: SamplingParams
    num_tokens: int  # image tokens per image
    weights_dir: str


def load_device_side(weights_dir: str | None = None, device: str | torch.device = "cpu") -> DeviceSide:
    """Load only the device half of a world (a simulated phone in the Serve cluster)."""
    from ciar.collab.device import DeviceModel
    from ciar.models.checkpoint import read_model_metadata

    weights_dir = os.path.abspath(weights_dir) if weights_dir else default_weights_dir()
    path = os.path.join(weights_dir, "device.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing weight file device.safetensors in {weights_dir} (train one with "
                                f"`python -m pipelines.train_device`)")
    state, config, _ = _read(weights_dir, "tokenizer.safetensors", "vq")
    vq = VQModel(VQConfig.from_dict(config))
    load_strict(vq, state, ignore_prefixes=VQ_IGNORED_KEY_PREFIXES, what="tokenizer (tokenizer.safetensors)")
    device = torch.device(device)
    device_model = DeviceModel.load(path, device=device)
    _, _, extra = read_model_metadata(os.path.join(weights_dir, "cloud.safetensors"))
    return DeviceSide(vq=vq.to(device).eval(), device_model=device_model, sampling=sampling_from_extra(extra),
                      num_tokens=device_model.config.block_size, weights_dir=weights_dir)

