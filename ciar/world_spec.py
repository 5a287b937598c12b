"""One description of a world for every entry point: the embedded scenes world, or a LlamaGen / Anole world from
files on the Hugging Face Hub or local ones.

    spec = read_world("worlds/llamagen-xl-stage1.yaml")   # a YAML / JSON file, a dict, or None (the shipped world)
    world = load_world(spec, device="cuda")                # ciar.world.World: GPT, VQ, caption encoder, device model
    side = load_device_side(spec)                          # what a phone loads: device model + VQ decoder

A world file is small and validated (pydantic, unknown keys refused, every named file checked before anything loads,
the missing one named with its field). Relative paths are taken relative to the file. Any file or folder field may
instead name the Hub: `hf://OWNER/REPO[@REVISION]/PATH` (a file), `hf://OWNER/REPO[@REVISION]` (a snapshot, e.g. a
transformers folder), resolved into huggingface_hub's standard cache before the checks (`ciar.hub`: HF_HOME,
HF_TOKEN, HF_HUB_OFFLINE); `python -m ciar.world_spec fetch WORLD` downloads them ahead and prints the sizes.
The shipped worlds (worlds/*.yaml) name the real repositories pinned to a commit; worlds/mounted/ the same files on a
mounted volume. Three kinds:

    kind: scenes                      # the default: nothing to configure
    weights: weights/scenes-v2        # optional: another folder in the shipped layout ($CIAR_WEIGHTS otherwise)
    device_checkpoint: device_l1.safetensors   # optional: another device model (relative to the weights folder)

    kind: llamagen                    # LlamaGen t2i GPT + VQ + runtime T5 (flan-t5-xl), as the seeds run CIAR
    gpt_checkpoint: hf://peizesun/llamagen_t2i@COMMIT/t2i_XL_stage1_256.pt   # or a local /models/t2i_XL_stage1_256.pt
    gpt_config: GPT-XL                # ciar.models.gpt.GPT_CONFIGS name; gpt_overrides {...} for other sizes
    image_size: 256
    vq_checkpoint: /models/vq_ds16_t2i.pt
    text_encoder: hf://google/flan-t5-xl@COMMIT   # a transformers T5 folder, encoded at runtime on the verifier
    text_dtype: bfloat16
    gpt_dtype: bfloat16               # the cloud GPT's weights and KV cache (default float32)
    device_checkpoint: /models/ciar/device.safetensors        # trained for this GPT (pipelines.train_device)
    projector_checkpoint: /models/ciar/projector.safetensors  # optional
    sampling: {cfg_scale: 7.5, temperature: 1.0, top_k: 1000, top_p: 1.0}

    kind: anole                       # Anole-7b: Chameleon's decoder + VQGAN, prompts as Chameleon token ids
    model: hf://leloy/Anole-7b-v0.1-hf@COMMIT   # transformers folder: config.json, *.safetensors, tokenizer.json
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
import sys
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator

from ciar.hub import is_ref

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
    _resolved: dict = PrivateAttr(default_factory=dict)  # (hf:// reference, kind) -> its path in the Hub cache
    _source: str | None = PrivateAttr(None)  # the world file (named in the fetch hint of an offline error)

    FILES: ClassVar[tuple] = ()
    FOLDERS: ClassVar[tuple] = ()
    TRANSFORMERS: ClassVar[tuple] = ()  # the FOLDERS a transformers loader reads (their snapshots: what it reads)

    def path(self, value: str | None) -> str | None:
        """A field's value as a local absolute path: relative to the world file's folder, or, for an `hf://`
        reference, its path in the Hugging Face cache (resolved by `resolve_hub`; else looked up in the cache, never
        downloaded: a world read with check=False touches no network)."""
        if value is None:
            return None
        if is_ref(value):
            field, kind = self._field_of(value)
            got = self._resolved.get((value, kind))
            return got if got is not None else self._resolve(field, value, kind, download=False)
        value = os.path.expanduser(value)
        return os.path.abspath(value if os.path.isabs(value) or not self.base_dir
                               else os.path.join(self.base_dir, value))

    def field_kind(self, field: str) -> str:
        """"file", "folder" or "transformers" (a folder a transformers loader reads): how a reference resolves."""
        if field in self.FILES:
            return "file"
        return "transformers" if field in self.TRANSFORMERS else "folder"

    def hub_fields(self) -> list[tuple[str, str, str]]:
        """(field, hf:// reference, kind) for every file or folder field that names the Hugging Face Hub."""
        return [(f, getattr(self, f), self.field_kind(f)) for f in self.FILES + self.FOLDERS
                if is_ref(getattr(self, f))]

    def resolve_hub(self, download: bool = True) -> dict[str, str]:
        """Resolve every Hub reference into the Hugging Face cache (downloading what is missing, unless `download`
        is False or HF_HUB_OFFLINE is set) -> {field: local path}. `read_world` does this before its checks, so
        they run on the resolved files. Raises WorldSpecError naming the field, the repository, the file and how
        to fetch it (one line)."""
        out = {}
        for field, value, kind in self.hub_fields():
            if (value, kind) not in self._resolved:
                self._resolved[(value, kind)] = self._resolve(field, value, kind, download)
            out[field] = self._resolved[(value, kind)]
        return out

    def _resolve(self, field: str, value: str, kind: str, download: bool) -> str:
        from ciar.hub import HubError, resolve

        hint = f"python -m ciar.world_spec fetch {self._source}" if self._source else None
        try:
            return resolve(value, kind, download=download, fetch_hint=hint)
        except HubError as e:
            raise WorldSpecError(f"{field}: {e}") from None

    def _field_of(self, value: str) -> tuple[str, str]:
        for field in self.FILES + self.FOLDERS:
            if getattr(self, field) == value:
                return field, self.field_kind(field)
        return "world", "file"  # a reference no field holds (a caller's own): a file

    def portable(self, field: str, value: str | None, hub_refs: bool = False) -> str | None:
        """A field's value for another process: an absolute local path, or the `hf://` reference itself when this
        world has not resolved it (or `hub_refs`: each process resolves it from its own cache)."""
        if value is not None and is_ref(value) and (hub_refs or (value, self.field_kind(field)) not in self._resolved):
            return value
        return self.path(value)


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

    FILES: ClassVar[tuple] = ("device_checkpoint", "projector_checkpoint")
    FOLDERS: ClassVar[tuple] = ("weights",)

    def weights_dir(self) -> str:
        return self.path(self.weights) if self.weights else default_weights_dir()

    def device_file(self) -> str:
        """The device model's file."""
        return self.file("device.safetensors", self.device_checkpoint)

    def file(self, name: str, override: str | None) -> str:
        """A file of the weights folder (an override is relative to that folder)."""
        if override is None:
            return os.path.join(self.weights_dir(), name)
        if is_ref(override):
            return self.path(override)
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
        return f"scenes world {self.weights if is_ref(self.weights) else self.weights_dir()}"


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
    text_encoder: str | None = Field(None, description="transformers T5 folder (flan-t5-xl; a local path or an "
                                                            "hf:// snapshot), encoded at runtime")
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
    TRANSFORMERS: ClassVar[tuple] = ("text_encoder", "clip_model")

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
    TRANSFORMERS: ClassVar[tuple] = ("model", "clip_model")

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
        name = self.model.split("@")[0].rstrip("/").rsplit("/", 1)[-1] if is_ref(self.model) else \
            os.path.basename(os.path.normpath(self.model))
        return f"Anole world {name} @ {self.image_size}px"


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
               need_text: bool = False, download: bool = True):
    """A world description from a YAML / JSON file path, a weights folder (a scenes world), a dict (builder args) or
    None (the shipped scenes world);
    `check` resolves every `hf://` reference into the Hugging Face cache (downloading what is missing unless
    `download` is False or HF_HUB_OFFLINE is set) and then verifies every named file exists. Raises WorldSpecError
    naming the file and the field."""
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
        if where != "world":
            spec._source = where
    if check:
        try:
            spec.resolve_hub(download=download)  # before any check: the checks read the resolved files
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


def spec_dict(spec, hub_refs: bool = False) -> dict:
    """A parsed world as a plain dict with absolute paths (no base_dir): what the Serve builder hands its replicas,
    valid wherever they run from. An `hf://` reference this world has resolved (`read_world` with check) becomes
    its path in the Hugging Face cache (every node that shares the cache, baked into the image or on a volume, reads
    the same files); one it has not resolved, or every one with `hub_refs`, stays a reference that each process
    resolves from its own cache."""
    if isinstance(spec, ScenesWorldSpec):
        d = {"kind": "scenes", "weights": spec.portable("weights", spec.weights, hub_refs) if spec.weights
             else spec.weights_dir()}
        for field, name in (("device_checkpoint", "device.safetensors"),
                            ("projector_checkpoint", "projector.safetensors")):
            value = getattr(spec, field)
            if value is not None:
                d[field] = spec.portable(field, value, hub_refs) if is_ref(value) else spec.file(name, value)
        return d
    d = spec.model_dump(exclude_none=True, exclude={"base_dir"})
    for field in spec.FILES + spec.FOLDERS:
        if field in d:
            d[field] = spec.portable(field, d[field], hub_refs)
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


# ---------------------------------------------------------------------------------------------- fetch ahead
def fetch_world(source, download: bool = True) -> tuple[Any, list[dict]]:
    """Put every file and folder a world names on the Hugging Face Hub into the cache (`resolve_hub`), and list
    them all -> (spec, rows); a row: field, value (as written), path (local), bytes (None: not there), hub (bool),
    commit (the snapshot's commit hash for a Hub file). Raises WorldSpecError for a reference that cannot be
    fetched; a missing local file is only listed (a device model is trained after the rest is fetched)."""
    from ciar.hub import commit_of, disk_size

    spec = read_world(source, check=False)
    resolved = spec.resolve_hub(download=download)
    rows = []
    for field in spec.FILES + spec.FOLDERS:
        value = getattr(spec, field)
        if value is None:
            continue
        if field in resolved:
            path = resolved[field]
        elif isinstance(spec, ScenesWorldSpec) and field != "weights":
            path = spec.file("", value)
        else:
            path = spec.path(value)
        there = os.path.isfile(path) if field in spec.FILES else os.path.isdir(path)
        rows.append({"field": field, "value": value, "path": path, "hub": field in resolved,
                     "bytes": disk_size(path) if there else None, "commit": commit_of(path)})
    return spec, rows


def _fetch_main(args) -> int:
    from ciar.hub import cache_dir, human_bytes, offline

    try:
        spec, rows = fetch_world(args.world, download=not args.cache_only)
    except WorldSpecError as e:
        print(f"error: {args.world}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"world": args.world, "cache": cache_dir(), "files": rows}, indent=1))
    else:
        width = max(len(r["field"]) for r in rows) if rows else 5
        for r in rows:
            size = human_bytes(r["bytes"]) if r["bytes"] is not None else "missing"
            where = f"{r['value']} -> {r['path']}" if r["hub"] else f"local {r['path']}"
            print(f"{r['field']:<{width}}  {size:>9}  {where}")
        hub = [r for r in rows if r["hub"]]
        print(f"{len(hub)} from the Hub, {human_bytes(sum(r['bytes'] or 0 for r in hub))} in {cache_dir()}"
              f"{' (HF_HUB_OFFLINE: the cache only)' if offline() or args.cache_only else ''}")
        unpinned = [r["value"] for r in hub if not r["commit"] or r["commit"] not in r["value"]]
        if unpinned:
            print(f"not pinned to a commit (a branch or tag moves): {', '.join(unpinned)}")
    try:  # the world's own checks on what is now on disk: information, not the fetch's result
        read_world(spec, download=False)
        print("world check: ok", file=sys.stderr)
    except WorldSpecError as e:
        print(f"world check: {e}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ciar.world_spec fetch WORLD`: download everything a world names on the Hub into the cache
    ($HF_HOME), so an image or a volume can be baked with it; prints each file's size."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ciar.world_spec", description="World files (ciar.world_spec).")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download every hf:// file and folder of a world into the Hugging Face cache "
                                     "and print the sizes")
    f.add_argument("world", help="a world file (YAML / JSON)")
    f.add_argument("--cache-only", action="store_true", help="download nothing: list what the cache holds, and "
                                                             "fail naming what it lacks")
    f.add_argument("--json", action="store_true", help="the list as JSON on stdout")
    args = p.parse_args(argv)
    return _fetch_main(args)


if __name__ == "__main__":
    from ciar.world_spec import main as _main  # the imported module's, so its classes are the ones `ciar` uses

    sys.exit(_main())
