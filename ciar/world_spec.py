"""One description of a world for every entry point: the embedded scenes world, or a LlamaGen world from local files.

    spec = read_world("worlds/llamagen-xl-stage1.yaml")   # a YAML / JSON file, a dict, or None (the shipped world)
    world = load_world(spec, device="cuda")                # ciar.world.World: GPT, VQ, caption encoder, device model
    side = load_device_side(spec)                          # what a phone loads: device model + VQ decoder

A world file is small and validated (pydantic, unknown keys refused, every named file checked before anything loads,
the missing one named with its field). Relative paths are taken relative to the file. Three kinds:

    kind: scenes                      # the default: nothing to configure
    weights: weights/scenes-v2        # optional: another folder in the shipped layout ($CIAR_WEIGHTS otherwise)
    device_checkpoint: device_l1.safetensors   # optional: another device model (relative to the weights folder)

    kind: llamagen                    # LlamaGen t2i GPT + VQ + runtime T5 (flan-t5-xl), as the seeds run CIAR
    gpt_checkpoint: /models/t2i_XL_stage1_256.pt
    gpt_config: GPT-XL                # ciar.models.gpt.GPT_CONFIGS name; gpt_overrides {...} for other sizes
    image_size: 256
    vq_checkpoint: /models/vq_ds16_t2i.pt
    text_encoder: /models/flan-t5-xl  # a local transformers T5 folder, encoded at runtime on the verifier
    text_dtype: bfloat16
    gpt_dtype: bfloat16               # the cloud GPT's weights and KV cache (default float32)
    device_checkpoint: /models/ciar/device.safetensors        # trained for this GPT (pipelines.train_device)
    projector_checkpoint: /models/ciar/projector.safetensors  # optional
    sampling: {cfg_scale: 7.5, temperature: 1.0, top_k: 1000, top_p: 1.0}

    kind: anole                       # Anole-7b: Chameleon's decoder + VQGAN, prompts as Chameleon token ids
    model: /models/Anole-7b-v0.1-hf   # transformers folder: config.json, *.safetensors, tokenizer.json
    cls_token_num: 128                # prompt positions (<s> + text + end-of-turn + begin-of-image)
    image_size: 512                   # the VQGAN's resolution: 32 x 32 tokens of 8192 codes
    vq_checkpoint: /models/Anole-7b-v0.1/tokenizer/vqgan.ckpt
    vq_yaml: /models/Anole-7b-v0.1/tokenizer/vqgan.yaml
    gpt_dtype: bfloat16
    device_checkpoint: /models/ciar/anole/device.safetensors  # a Chameleon trunk (pipelines.train_device)
    sampling: {}                      # default: Anole's cfg 3.0, temperature 0.7, top-p 0.9 (ANOLE_SAMPLING)

The evaluation's metric files (`t5_embeddings`, `inception_weights`, `clip_model`, `reference_images`) may sit in a
LlamaGen world too (an Anole world: the last three); the flat `--model-config` JSON of `pipelines.evaluate` (no
`kind`, sampling keys at the top level) is read as a LlamaGen world. The calibrated CIAR defaults (gate, tau, burst,
span) travel in the device file's metadata.
No Ray imports here: the Serve deployments pass the parsed dict through their builder args.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WEIGHTS_DIR = os.path.join(REPO_ROOT, "weights", "scenes-v2")  # the shipped world
WEIGHTS_ENV = "CIAR_WEIGHTS"


def default_weights_dir() -> str:
    """$CIAR_WEIGHTS if set, else this repo's `weights/scenes-v2` (independent of the working directory)."""
    return os.path.abspath(os.environ.get(WEIGHTS_ENV) or DEFAULT_WEIGHTS_DIR)

SAMPLING_KEYS = ("cfg_scale", "temperature", "top_k", "top_p")


class WorldSpecError(ValueError):
    """A world description that cannot be used: the message names the file and the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_dir: str | None = Field(None, description="folder relative paths are taken from (the world file's)")

    def path(self, value: str | None) -> str | None:
        if value is None:
            return None
        value = os.path.expanduser(value)
        return os.path.abspath(value if os.path.isabs(value) or not self.base_dir
                               else os.path.join(self.base_dir, value))


class SamplingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg_scale: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def given(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ScenesWorldSpec(_Spec):
    """The embedded world: a weights folder in the shipped layout (tokenizer, cloud, device, projector)."""

    kind: Literal["scenes"] = "scenes"
    weights: str | None = Field(None, description="weights folder (default: $CIAR_WEIGHTS or weights/scenes-v2)")
    device_checkpoint: str | None = Field(None, description="device model file (default: the folder's "
                                                            "device.safetensors); relative to the weights folder")
    projector_checkpoint: str | None = Field(None, description="projector file (default: the folder's "
                                                               "projector.safetensors); relative to the weights folder")

    def weights_dir(self) -> str:
        return self.path(self.weights) if self.weights else default_weights_dir()

    def device_file(self) -> str:
        """The device model's file."""
        return self.file("device.safetensors", self.device_checkpoint)

    def file(self, name: str, override: str | None) -> str:
        """A file of the weights folder (an override is relative to that folder)."""
        if override is None:
            return os.path.join(self.weights_dir(), name)
        override = os.path.expanduser(override)
        return override if os.path.isabs(override) else os.path.join(self.weights_dir(), override)

    def check(self, need_device: bool = False) -> None:
        folder = self.weights_dir()
        if not os.path.isdir(folder):
            raise WorldSpecError(f"weights: weights folder not found: {folder}")
        for field, name in (("weights", "tokenizer.safetensors"), ("weights", "cloud.safetensors")):
            if not os.path.isfile(os.path.join(folder, name)):
                raise WorldSpecError(f"{field}: {folder} has no {name}")
        for field in ("device_checkpoint", "projector_checkpoint"):
            given = getattr(self, field)
            if given is not None and not os.path.isfile(self.file("", given)):
                raise WorldSpecError(f"{field}: file not found: {self.file('', given)}")
        if need_device and not os.path.isfile(self.file("device.safetensors", self.device_checkpoint)):
            raise WorldSpecError(f"device_checkpoint: this needs a device model, and there is none at "
                                 f"{self.file('device.safetensors', self.device_checkpoint)} (train one with "
                                 f"`python -m pipelines.train_device`)")

    def describe(self) -> str:
        return f"scenes world {self.weights_dir()}"


class LlamaGenWorldSpec(_Spec):
    """A LlamaGen text-to-image GPT and VQ tokenizer from local checkpoint files, a runtime T5 caption encoder
    (or precomputed T5 features, evaluation only), and the CIAR device model trained for that GPT."""

    kind: Literal["llamagen"] = "llamagen"
    gpt_checkpoint: str
    gpt_config: str = "GPT-XL"
    gpt_overrides: dict[str, Any] = Field(default_factory=dict)
    image_size: int = Field(256, ge=16)
    downsample: int = Field(16, ge=1)
    vq_checkpoint: str
    vq_config: str = "VQ-16"
    vq_overrides: dict[str, Any] = Field(default_factory=dict)
    text_encoder: str | None = Field(None, description="local transformers T5 folder (flan-t5-xl), encoded at runtime")
    text_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    text_max_length: int | None = Field(None, ge=1, description="T5 tokens (default: the GPT's cls_token_num, 120)")
    gpt_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the cloud GPT's weights and KV cache (LlamaGen samples in bfloat16: half the bytes "
                               "each step reads, the bound of a GPU's step)")
    device_checkpoint: str | None = None
    projector_checkpoint: str | None = None
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    # evaluation-only files (pipelines.evaluate)
    t5_embeddings: str | None = Field(None, description="folder of IMAGE_ID.npy T5 features (LlamaGen's script)")
    inception_weights: str | None = None
    clip_model: str | None = None
    reference_images: str | None = None

    FILES: ClassVar[tuple] = ("gpt_checkpoint", "vq_checkpoint", "device_checkpoint", "projector_checkpoint",
                              "inception_weights")
    FOLDERS: ClassVar[tuple] = ("text_encoder", "t5_embeddings", "clip_model", "reference_images")

    @field_validator("gpt_config")
    @classmethod
    def _known_gpt(cls, v: str) -> str:
        from ciar.models.gpt import GPT_CONFIGS

        if v not in GPT_CONFIGS:
            raise ValueError(f"unknown GPT config {v!r}; known: {sorted(GPT_CONFIGS)}")
        return v

    def check(self, need_device: bool = False, need_text: bool = False) -> None:
        for field in self.FILES:
            value = getattr(self, field)
            if value is not None and not os.path.isfile(self.path(value)):
                raise WorldSpecError(f"{field}: file not found: {self.path(value)}")
        for field in self.FOLDERS:
            value = getattr(self, field)
            if value is not None and not os.path.isdir(self.path(value)):
                raise WorldSpecError(f"{field}: folder not found: {self.path(value)}")
        if need_device and self.device_checkpoint is None:
            raise WorldSpecError("device_checkpoint: this needs a device model, the CIAR device model trained for "
                                 "the GPT (python -m pipelines.train_device --world FILE)")
        if need_text and self.text_encoder is None:
            raise WorldSpecError("text_encoder: encoding new captions needs a local T5 folder (flan-t5-xl); "
                                 "t5_embeddings only serve the COCO evaluation")

    def device_file(self) -> str | None:
        """The device model's file (None when the world has none)."""
        return self.path(self.device_checkpoint)

    def gpt_cfg(self):
        """The GPT's config as the checkpoint will be built (no file is read)."""
        from ciar.models.gpt import gpt_config

        grid = self.image_size // self.downsample
        return gpt_config(self.gpt_config, **{"block_size": grid * grid, **self.gpt_overrides})

    def describe(self) -> str:
        return f"LlamaGen world {self.gpt_config} {os.path.basename(self.gpt_checkpoint)} @ {self.image_size}px"


# Anole's sampling (GAIR-NLP/anole text2image.py over Meta's chameleon inference, ciar.models.chameleon): in-batch
# CFG with guidance_scale_text 3.0 (a text-only prompt's image row is the unconditional one, so the two-row rule),
# temperature 0.7, top-p 0.9, no top-k
ANOLE_SAMPLING = {"cfg_scale": 3.0, "temperature": 0.7, "top_k": 0, "top_p": 0.9}


class AnoleWorldSpec(_Spec):
    """Anole-7b (Chameleon's decoder fine-tuned to draw): a transformers `ChameleonForConditionalGeneration` folder
    (config.json with its vocabulary_map, *.safetensors shards, tokenizer.json), Chameleon's VQGAN (the taming
    checkpoint and its yaml), prompts as Chameleon token ids (`ciar.text.ChameleonPromptEncoder`) and the CIAR device
    model trained for it (`ciar.models.chameleon.ChameleonTrunk`). `check` reads the small files (config.json, the
    yaml, the device file's header) and checks every shape against the others before anything loads."""

    kind: Literal["anole"] = "anole"
    model: str = Field(description="transformers Chameleon / Anole folder: config.json, *.safetensors, tokenizer.json")
    tokenizer: str | None = Field(None, description="Chameleon's tokenizer.json (default: the model folder's)")
    cls_token_num: int = Field(128, ge=4, description="prompt positions: <s> + BPE tokens + end-of-turn + "
                                                      "begin-of-image, left-padded; a longer prompt is refused")
    image_size: int = Field(512, ge=16, description="pixels (the VQGAN's resolution; 512 -> 32 x 32 tokens)")
    gpt_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the cloud decoder's weights and KV cache (Anole's weights are bfloat16)")
    vq_checkpoint: str = Field(description="Chameleon's tokenizer/vqgan.ckpt (taming VQModel, Lightning format)")
    vq_yaml: str = Field(description="Chameleon's tokenizer/vqgan.yaml")
    device_checkpoint: str | None = None
    projector_checkpoint: str | None = None
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    # evaluation-only files (pipelines.evaluate), as in a LlamaGen world: FID Inception-v3 weights, a local CLIP
    # folder, the captions' reference images (no t5_embeddings: Anole's prompts are always tokenized at runtime)
    inception_weights: str | None = None
    clip_model: str | None = None
    reference_images: str | None = None

    FILES: ClassVar[tuple] = ("tokenizer", "vq_checkpoint", "vq_yaml", "device_checkpoint", "projector_checkpoint",
                              "inception_weights")
    FOLDERS: ClassVar[tuple] = ("model", "clip_model", "reference_images")

    def tokenizer_file(self) -> str:
        return self.path(self.tokenizer) if self.tokenizer else os.path.join(self.path(self.model), "tokenizer.json")

    def device_file(self) -> str | None:
        return self.path(self.device_checkpoint)

    def weight_files(self) -> list[str]:
        """The model folder's weight files, sorted: *.safetensors, else pytorch_model*.bin ([] when neither)."""
        import glob

        folder = self.path(self.model)
        return sorted(glob.glob(os.path.join(folder, "*.safetensors"))) or \
            sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))

    def hf_config(self) -> dict:
        """The model folder's config.json (transformers' ChameleonConfig as a dict)."""
        path = os.path.join(self.path(self.model), "config.json")
        if not os.path.isfile(path):
            raise WorldSpecError(f"model: {self.path(self.model)} has no config.json")
        try:
            with open(path) as f:
                return json.load(f)
        except ValueError as e:
            raise WorldSpecError(f"model: {path}: not valid JSON: {e}") from None

    def vq_cfg(self):
        """The VQGAN's config from `vq_yaml` (ciar.models.chameleon_vq.ChameleonVQConfig)."""
        from ciar.models.chameleon_vq import ChameleonVQConfigError, read_vqgan_yaml

        try:
            return read_vqgan_yaml(self.path(self.vq_yaml))
        except (ChameleonVQConfigError, OSError) as e:
            raise WorldSpecError(f"vq_yaml: {e}") from None

    def gpt_cfg(self):
        """The cloud decoder's config (ciar.models.chameleon.ChameleonConfig: image codes from the vocabulary map,
        `cls_token_num`, image_size / the VQGAN's downsampling squared tokens); no weight is read."""
        from ciar.models.chameleon import chameleon_config_from_hf

        hf = self.hf_config()
        if not hf.get("vocabulary_map"):
            raise WorldSpecError("model: config.json has no vocabulary_map (the image tokens' ids)")
        grid = self.image_size // self.vq_cfg().downsample
        try:
            return chameleon_config_from_hf(hf, cls_token_num=self.cls_token_num, block_size=grid * grid)
        except (KeyError, TypeError, ValueError) as e:
            raise WorldSpecError(f"model: config.json: {type(e).__name__}: {e} (cls_token_num {self.cls_token_num}, "
                                 f"{grid} x {grid} image tokens)") from None

    def check(self, need_device: bool = False, need_text: bool = False) -> None:
        folder = self.path(self.model)
        if not os.path.isdir(folder):
            raise WorldSpecError(f"model: folder not found: {folder}")
        if not self.weight_files():
            raise WorldSpecError(f"model: {folder} has no *.safetensors (or pytorch_model*.bin) weights")
        if not os.path.isfile(self.tokenizer_file()):
            raise WorldSpecError(f"tokenizer: file not found: {self.tokenizer_file()} (Chameleon's tokenizer.json)")
        for field in self.FILES[1:]:
            value = getattr(self, field)
            if value is not None and not os.path.isfile(self.path(value)):
                raise WorldSpecError(f"{field}: file not found: {self.path(value)}")
        for field in self.FOLDERS[1:]:
            value = getattr(self, field)
            if value is not None and not os.path.isdir(self.path(value)):
                raise WorldSpecError(f"{field}: folder not found: {self.path(value)}")
        vq = self.vq_cfg()
        if vq.resolution != self.image_size:
            raise WorldSpecError(f"image_size: {self.image_size} px, but the VQGAN ({self.vq_yaml}) is built for "
                                 f"resolution {vq.resolution}")
        cfg = self.gpt_cfg()
        if vq.n_embed != cfg.vocab_size:
            raise WorldSpecError(f"vq_yaml: the VQGAN has {vq.n_embed} codes but the model's vocabulary map has "
                                 f"{cfg.vocab_size} image tokens")
        if self.device_checkpoint is not None:
            check_anole_device(self.device_file(), cfg, "device_checkpoint")
        elif need_device:
            raise WorldSpecError("device_checkpoint: this needs a device model, the CIAR device model trained for "
                                 "the decoder (python -m pipelines.train_device --world FILE)")

    def describe(self) -> str:
        return f"Anole world {os.path.basename(os.path.normpath(self.model))} @ {self.image_size}px"


def check_anole_device(path: str, cfg, field: str = "device_checkpoint") -> None:
    """A device file's header against the Anole decoder's config `cfg`: a Chameleon trunk over the same image codes,
    image tokens, prompt positions and width (the caption it receives is the decoder's prompt embeddings)."""
    from ciar.models.checkpoint import read_model_metadata

    try:
        kind, config, _ = read_model_metadata(path)
    except (OSError, ValueError) as e:
        raise WorldSpecError(f"{field}: {e}") from None
    g = config.get("gpt", {}) if isinstance(config, dict) else {}
    if kind != "ciar_device" or g.get("arch") != "chameleon":
        raise WorldSpecError(f"{field}: {path} is not a CIAR device model for a Chameleon decoder (kind {kind!r}, "
                             f"arch {g.get('arch', 'llamagen')!r}; train one with pipelines.train_device --world)")
    have = tuple(g.get(k) for k in ("vocab_size", "block_size", "cls_token_num", "dim"))
    want = (cfg.vocab_size, cfg.block_size, cfg.cls_token_num, cfg.dim)
    if have != want:
        raise WorldSpecError(f"{field}: {path}: the device model (codes {have[0]}, {have[1]} image tokens, "
                             f"{have[2]} prompt positions, width {have[3]}) does not fit the decoder (codes {want[0]}, "
                             f"{want[1]} image tokens, {want[2]} prompt positions, width {want[3]})")


WorldSpec = Annotated[Union[ScenesWorldSpec, LlamaGenWorldSpec, AnoleWorldSpec], Field(discriminator="kind")]
_ADAPTER = TypeAdapter(WorldSpec)


def _legacy(d: dict) -> dict:
    """`pipelines.evaluate --model-config` JSON (flat sampling keys, no kind) -> a llamagen world dict."""
    d = dict(d)
    if "kind" not in d:
        d["kind"] = "llamagen" if "gpt_checkpoint" in d else "scenes"
    if d["kind"] == "llamagen":
        flat = {k: d.pop(k) for k in SAMPLING_KEYS if k in d}
        if flat:
            d["sampling"] = {**flat, **(d.get("sampling") or {})}
    return d


def read_world(source: "str | dict | BaseModel | None" = None, check: bool = True, need_device: bool = False,
               need_text: bool = False):
    """A world description from a YAML / JSON file path, a weights folder (a scenes world), a dict (builder args) or
    None (the shipped scenes world);
    `check` verifies every named file exists. Raises WorldSpecError naming the file and the field."""
    if isinstance(source, (ScenesWorldSpec, LlamaGenWorldSpec, AnoleWorldSpec)):
        spec, where = source, "world"
    else:
        where = "world"
        if source is None:
            data: dict = {"kind": "scenes"}
        elif isinstance(source, str) and os.path.isdir(source):  # a weights folder in the shipped layout
            data = {"kind": "scenes", "weights": os.path.abspath(source)}
        elif isinstance(source, str):
            where = source
            if not os.path.isfile(source):
                raise WorldSpecError(f"world file not found: {source}")
            data = _read_file(source)
            data.setdefault("base_dir", os.path.dirname(os.path.abspath(source)))
        elif isinstance(source, dict):
            data = dict(source)
        else:
            raise WorldSpecError(f"a world is a file path, a dict or None, not {type(source).__name__}")
        try:
            spec = _ADAPTER.validate_python(_legacy(data))
        except ValidationError as e:
            raise WorldSpecError(f"{where}: " + "; ".join(
                f"{'.'.join(str(p) for p in err['loc'][1:]) or err['loc'][0]}: {err['msg']}"
                for err in e.errors())) from None
    if check:
        try:
            if isinstance(spec, (LlamaGenWorldSpec, AnoleWorldSpec)):
                spec.check(need_device=need_device, need_text=need_text)
            else:
                spec.check(need_device=need_device)
        except WorldSpecError as e:
            raise WorldSpecError(f"{where}: {e}") from None
    return spec


def _read_file(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - YAML and JSON raise their own error types
        raise WorldSpecError(f"{path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: "
                             f"{e}") from None
    if not isinstance(data, dict):
        raise WorldSpecError(f"{path}: expected a mapping of world fields")
    return data


def world_source(world: "str | dict | None" = None, weights: str | None = None) -> "str | dict | None":
    """An entry point's `--world FILE` (or inline dict) / `--weights DIR` pair -> what `read_world` takes (both is
    an error)."""
    if world and weights:
        raise WorldSpecError("give --world or --weights, not both (a scenes world file names its weights folder)")
    if weights:
        return {"kind": "scenes", "weights": os.path.abspath(weights)}
    return world


def spec_dict(spec) -> dict:
    """A parsed world as a plain dict with absolute paths (no base_dir): what the Serve builder hands its replicas,
    valid wherever they run from."""
    if isinstance(spec, ScenesWorldSpec):
        d = {"kind": "scenes", "weights": spec.weights_dir()}
        for field, name in (("device_checkpoint", "device.safetensors"),
                            ("projector_checkpoint", "projector.safetensors")):
            if getattr(spec, field) is not None:
                d[field] = spec.file(name, getattr(spec, field))
        return d
    d = spec.model_dump(exclude_none=True, exclude={"base_dir"})
    for field in spec.FILES + spec.FOLDERS:
        if field in d:
            d[field] = spec.path(d[field])
    return d


def add_world_arguments(parser) -> None:
    """`--world FILE` and `--weights DIR` (a scenes world's folder), the same on every entry point."""
    parser.add_argument("--world", default=None,
                        help="world file (YAML / JSON, ciar.world_spec): a LlamaGen world (GPT, VQ, T5 folder, device "
                             "model) or a scenes world (default: the shipped scenes world)")
    parser.add_argument("--weights", default=None,
                        help="a weights folder in the shipped layout (a scenes world; default: $CIAR_WEIGHTS or "
                             "weights/scenes-v2)")


def world_from_args(args) -> "str | dict | None":
    """The world an entry point's parsed `--world` / `--weights` name (what `read_world` / `load_world` take)."""
    return world_source(getattr(args, "world", None), getattr(args, "weights", None))
