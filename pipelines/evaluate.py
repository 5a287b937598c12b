"""Large-scale evaluation with Ray Data over MS-COCO-format captions: every method on the same captions and seeds.

    python -m pipelines.evaluate --captions DIR/captions.json --methods cloud,ciar,lantern,code,eagle --limit 500 \
        --out runs/eval [--param tau=T] [--network 5g] [--seed 0] [--world FILE]

Captions: the real `captions_val2017.json` layout (`images` + `annotations`; the first caption of each image, in
image-id order) or a scenes export (`python -m ciar.data.scenes export ...`, whose `labels.json` and `images/`
beside the captions give the attribute-probe fidelity and the FID references).

Ray Data pipeline (one callable class per stage, model loaded in `__init__`, `ActorPoolStrategy`, `num_gpus`
when GPUs exist):
  captions -> EncodeCaptions (caption embeddings: the world's text encoder, or precomputed T5 files)
           -> Generate (every method per caption: `ciar.collab` decoder + in-process verifier, PNG to
              OUT/images/METHOD/, the full stats struct per sample)
           -> MetricFeatures (attribute-probe checks, FID feature vector; Inception features and the CLIP score
              on the real-model path)
           -> OUT/samples/shard-NNNNN.parquet (one row per caption x method: caption, method, seed, image path,
              every stats field, metric features)
Resumable: captions are cut into shards of `--shard-size`; a shard whose Parquet file exists is skipped, and a
shard's file is written (atomically) only when all its rows are in. OUT/run.json records what the samples depend on
(the captions file and its SHA-256, --limit, --seed, the methods, --param, --network, the weights or world,
--shard-size); a run into an OUT made with other settings is refused, naming them, since its finished shards would
be taken as this run's (another --out, or remove the folder).

Aggregation (driver): OUT/summary.json `{"methods": {NAME: {...}}}` with the field names of `benchmarks.collab`
(speedup vs cloud-only from the per-sample latencies, cloud-call rate, requests, acceptance, fidelity, FID,
latency split, bytes) and OUT/report.md with PNG plots: quality-vs-speedup frontier, latency split per method,
an image grid (same captions across methods), and the wall time of each stage.

Real-model path (`--world FILE`, a LlamaGen or Anole world of `ciar.world_spec`; the older flat `--model-config`
JSON is read as a LlamaGen world): a LlamaGen t2i GPT and VQ tokenizer from local checkpoints
(`ciar.world.load_llamagen_world`), a CIAR device model trained for that GPT, captions encoded by the world's T5
folder (`text_encoder`) or read from LlamaGen's T5 script (`t5_embeddings/IMAGE_ID.npy`), FID with the standard FID
Inception-v3 (`ciar.metrics.inception`) from a local weights file against `reference_images`, and the CLIP score from
a local CLIP folder; a missing file is named before anything starts.

Anole world (`kind: anole`): the same stages and metric files (`inception_weights`, `clip_model`,
`reference_images` in the world file). Stage 1 tokenizes each caption into Anole's prompt ids
(`ciar.text.ChameleonPromptEncoder`, from the folder's tokenizer.json and config.json only: no decoder weights) and
carries the ids [cls_token_num] int64 + mask, not embeddings (see `EncodeCaptions`); Generate runs the Chameleon
decoder as the cloud and the `ChameleonTrunk` device model (its caption, the prompt's embeddings, made by the
verifier from those ids as everywhere else), and decodes with Chameleon's VQGAN; the metrics read the decoded
images as for LlamaGen. A caption over the prompt positions is named before anything starts.

Seeds: caption i is generated with seed `seed * 1000003 + i` by every method (as `benchmarks.collab`, so its
rows agree on the same prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from ciar.collab.stats import STATS_FIELDS, GenerationStats, summarize_method
from ciar.data.coco import CaptionsError, read_coco_captions


# ---------------------------------------------------------------------------------------------- captions
def read_captions(path: str, limit: int | None, seed: int) -> tuple[list[dict], dict]:
    """COCO captions JSON (`ciar.data.coco`: the first caption of each image, by image id) -> rows {index, image_id,
    caption, seed, file_name} (+ info on references)."""
    rows = [{"index": i, **r, "seed": seed * 1_000_003 + i}
            for i, r in enumerate(read_coco_captions(path, limit=limit))]
    root = os.path.dirname(os.path.abspath(path))
    labels_path = os.path.join(root, "labels.json")
    info = {"root": root, "labels": None}
    if os.path.isfile(labels_path):
        with open(labels_path) as f:
            info["labels"] = json.load(f)
    return rows, info


# ---------------------------------------------------------------------------------------------- model config
# the path-valued fields of a world file (relative to the file; absolute in `read_model_config`'s answer)
MODEL_CONFIG_FILES = ("gpt_checkpoint", "vq_checkpoint", "device_checkpoint", "projector_checkpoint",
                      "inception_weights", "text_encoder", "t5_embeddings", "clip_model", "reference_images")


def read_model_config(path: str | None, methods: list[str] | None = None) -> dict:
    """The evaluation's world (`ciar.world_spec`): a world file (YAML / JSON), or the older flat `--model-config`
    JSON (read as a LlamaGen world). -> {} for a scenes world (its weights come from --weights), else the LlamaGen
    world as a dict with absolute paths: gpt_checkpoint, vq_checkpoint, device_checkpoint (needed by every method
    but cloud), captions from `text_encoder` (runtime T5) or `t5_embeddings` (IMAGE_ID.npy features from LlamaGen's
    script), and the metric files inception_weights (pt_inception-2015-12-05-6726825d.pth or torch-fidelity's
    copy: FID, checked key by key here), clip_model (a local CLIP folder) and reference_images (the captions'
    images by file_name). An Anole world: its dict (`kind` "anole"; prompts from the model folder's tokenizer.json)
    with the same metric files. Raises FileNotFoundError / ValueError naming the field."""
    from ciar.collab.names import CLOUD_METHODS
    from ciar.world_spec import AnoleWorldSpec, LlamaGenWorldSpec, ScenesWorldSpec, WorldSpecError, read_world, \
        spec_dict

    if not path:
        return {}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"world file not found: {path}")
    need_device = any(m not in CLOUD_METHODS for m in methods or ["ciar"])
    try:
        spec = read_world(path, need_device=need_device)
    except WorldSpecError as e:
        raise (FileNotFoundError if "not found" in str(e) else ValueError)(str(e)) from None
    if isinstance(spec, ScenesWorldSpec):
        return {}
    if not isinstance(spec, (LlamaGenWorldSpec, AnoleWorldSpec)):  # never evaluate the scenes world in its place
        raise ValueError(f"{path}: pipelines.evaluate takes scenes, LlamaGen and Anole worlds, not kind: {spec.kind}")
    if isinstance(spec, LlamaGenWorldSpec) and not (spec.t5_embeddings or spec.text_encoder):
        raise ValueError(f"{path}: the captions need text_encoder (a local T5 folder) or t5_embeddings")
    cfg = spec_dict(spec)
    if "inception_weights" in cfg:  # a wrong file fails now, naming its keys, not after generation
        from ciar.metrics.inception import FIDInceptionV3, read_inception_state
        from ciar.models.checkpoint import load_strict

        try:
            load_strict(FIDInceptionV3(), read_inception_state(cfg["inception_weights"]), what="FID Inception-v3")
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}: inception_weights = {cfg['inception_weights']!r}: {e}") from None
    return cfg


def caption_length(model_config: dict, weights_dir: str | None) -> int:
    """Caption positions of the cloud model (the padded length stage 1 produces)."""
    if model_config:
        from ciar.world_spec import read_world

        return read_world(model_config, check=False).gpt_cfg().cls_token_num
    from ciar.models.checkpoint import read_model_metadata
    from ciar.world import default_weights_dir

    _, cfg, _ = read_model_metadata(os.path.join(weights_dir or default_weights_dir(), "cloud.safetensors"))
    return int(cfg["cls_token_num"])


# ---------------------------------------------------------------------------------------------- stages
def _threads():
    import torch

    torch.set_num_threads(int(os.environ.get("CIAR_EVAL_THREADS", "1")))
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_anole(model_config: dict | None) -> bool:
    return bool(model_config) and model_config.get("kind") == "anole"


class _PromptLayout:
    """What `ciar.text.ChameleonPromptEncoder` uses of its cloud, without the decoder's weights (7B for Anole): the
    config (special token ids, cls_token_num) and `prompt_condition`, which reads nothing else."""

    def __init__(self, config):
        self.config = config

    def prompt_condition(self, text_ids):
        from ciar.models.chameleon import prompt_condition

        return prompt_condition(self.config, text_ids)


def anole_prompt_encoder(model_config: dict):
    """An Anole world's prompt encoder over its tokenizer.json and config.json (no weight file is read)."""
    from ciar.text import ChameleonPromptEncoder
    from ciar.world_spec import read_world

    spec = read_world(model_config, check=False)
    return ChameleonPromptEncoder(spec.tokenizer_file(), _PromptLayout(spec.gpt_cfg()))


class EncodeCaptions:
    """Stage 1: caption -> embedding [L, D] float16 + mask [L] (the world's encoder, or T5 files by image id), left
    padded to the cloud model's caption positions.

    An Anole world: caption -> `caption_ids` [L] int64 + mask [L], Anole's prompt `[<s>] + BPE + [end-of-turn,
    begin-of-image]` left-padded with <pad> (what `ChameleonPromptEncoder` gives the verifier everywhere else).
    Ids, not embeddings, because (1) they are what the Chameleon cloud takes: it embeds its condition itself
    (`ChameleonGPT.embed_condition`), and the device's caption (the prompt's embeddings, `device_caption`) is made
    from them by the verifier in Generate exactly as in `ciar.generate` and Serve; (2) they are exact, where the
    float16 `caption_emb` column would not hold ids above 2048 (Chameleon's vocabulary is 65,536); (3) they are
    1 KiB per caption in Ray's object store where the prompt embeddings are [L, 4096] float16, 1 MiB; (4) this
    stage then needs only tokenizer.json and config.json, not the 7B decoder."""

    def __init__(self, weights_dir: str | None, model_config: dict):
        device = _threads()
        self.t5 = model_config.get("t5_embeddings")
        self.length = caption_length(model_config, weights_dir)
        self.anole = is_anole(model_config)
        if self.anole:
            self.text = anole_prompt_encoder(model_config)
        elif not self.t5 and model_config.get("text_encoder"):  # runtime T5 (flan-t5-xl), on the stage's GPU if any
            from ciar.t5 import T5CaptionEncoder

            self.text = T5CaptionEncoder(model_config["text_encoder"], max_length=self.length, device=device,
                                         dtype=model_config.get("text_dtype", "float32"))
        elif not self.t5:
            from ciar.text import TextEncoder

            self.text = TextEncoder(max_length=self.length, device=device)

    def __call__(self, batch: dict) -> dict:
        from ciar.text import CaptionBatch

        if self.anole:
            cap = self.text.encode([str(c) for c in batch["caption"]])
            batch["caption_ids"] = cap.emb.cpu().numpy().astype(np.int64)
            batch["caption_mask"] = cap.mask.cpu().numpy()
            return batch
        if self.t5:
            # (main checked that every file exists before the pipeline started)
            embs = [np.load(os.path.join(self.t5, f"{int(i)}.npy")) for i in batch["image_id"]]
            cap = CaptionBatch.from_precomputed(embs, self.length)
        else:
            cap = self.text.encode([str(c) for c in batch["caption"]])
        batch["caption_emb"] = cap.emb.cpu().numpy().astype(np.float16)
        batch["caption_mask"] = cap.mask.cpu().numpy()
        return batch


class PrecomputedPromptIds:
    """The verifier's caption encoder in Generate for an Anole world: answers `encode` from stage 1's prompt ids
    (`add(caption, ids [cls] or [1, cls], mask)`), as `ciar.text.PrecomputedCaptions` does for embeddings; a caption
    it was not given is an error naming it."""

    def __init__(self):
        self.table: dict[str, tuple] = {}

    def add(self, caption: str, ids, mask) -> None:
        import torch

        ids, mask = torch.as_tensor(ids), torch.as_tensor(mask)
        if ids.is_floating_point():
            raise TypeError(f"prompt ids of {caption[:60]!r} are {ids.dtype}, not integers")
        self.table[caption] = (ids.reshape(-1).long(), mask.reshape(-1).bool())

    def clear(self) -> None:
        self.table.clear()

    def encode(self, captions: list[str]):
        import torch

        from ciar.text import CaptionBatch

        if isinstance(captions, str):
            captions = [captions]
        missing = [c for c in captions if c not in self.table]
        if missing:
            raise KeyError(f"no prompt ids for caption {missing[0][:80]!r} (stage 1 gives them)")
        return CaptionBatch(torch.stack([self.table[c][0] for c in captions]),
                            torch.stack([self.table[c][1] for c in captions]))


class Generate:
    """Stage 2: every method on each caption; writes PNGs, returns one row per (caption, method)."""

    def __init__(self, weights_dir: str | None, model_config: dict, methods: list[str], overrides: dict,
                 network: str, out_dir: str):
        _threads()
        import torch

        from ciar.sim.decoder import shared_knobs
        from ciar.sim.runtime import make_decoder, make_verifier
        from ciar.world import load_default_world

        from ciar.text import PrecomputedCaptions
        from ciar.world import load_anole_world, load_llamagen_world

        device = "cuda" if torch.cuda.is_available() else "cpu"
        # captions arrive as stage 1's embeddings (Anole: prompt ids): no caption encoder here (text=False)
        self.anole = is_anole(model_config)
        if self.anole:
            self.world = load_anole_world(model_config, device=device, text=False)
            self.world.text = PrecomputedPromptIds()  # stage 1's ids, by caption (the verifier embeds them)
        elif model_config:
            self.world = load_llamagen_world(model_config, device=device, text=False)
        else:
            self.world = load_default_world(weights_dir, device=device)
        self.verifier = make_verifier(self.world, max_sessions=2)
        c = self.world.cloud.config
        # stage 1's embeddings, by caption: the real world's own (the verifier already reads them; a one-token
        # stand-in for the warm-up), else a table swapped in for the text encoder after the warm-up
        self.captions = self.world.text if model_config else PrecomputedCaptions(c.cls_token_num, c.caption_dim)
        if self.anole:  # the warm-up's prompt: no text, only Anole's markers
            self.captions.add("warm-up", *self.world.cloud.prompt_condition([[]]))
        elif model_config:
            self.captions.add("warm-up", torch.zeros(1, c.caption_dim))
        self.decoders = {m: make_decoder(self.world, self.verifier, m, network=network,
                                         **shared_knobs(m, overrides)) for m in methods}
        self.methods, self.out_dir = methods, out_dir
        for m in methods:
            os.makedirs(os.path.join(out_dir, "images", m), exist_ok=True)
        self.decoders[methods[0]].generate("warm-up", seed=10 ** 9)  # first-call overheads out of the timings
        self.verifier.text = self.captions

    def __call__(self, batch: dict) -> dict:
        import torch
        from PIL import Image

        from ciar.models.vq import tensor_to_images

        self.captions.clear()
        if self.anole:
            for c, ids, m in zip(batch["caption"], batch["caption_ids"], batch["caption_mask"]):
                self.captions.add(str(c), torch.from_numpy(ids), torch.from_numpy(m))
        else:
            for c, e, m in zip(batch["caption"], batch["caption_emb"], batch["caption_mask"]):
                self.captions.add(str(c), torch.from_numpy(e[m].astype(np.float32)))
        cols: dict[str, list] = {k: [] for k in ("index", "image_id", "caption", "seed", "method", "image_path",
                                                 "image", "file_name", "wall_s", *STATS_FIELDS)}
        for i in range(len(batch["caption"])):
            caption, seed = str(batch["caption"][i]), int(batch["seed"][i])
            for m in self.methods:  # methods interleaved per caption: machine-load drift hits all alike
                t0 = time.perf_counter()
                r = self.decoders[m].generate(caption, seed=seed)
                wall = time.perf_counter() - t0
                with torch.no_grad():
                    codes = r.tokens.reshape(1, -1).to(self.world.device)
                    img = tensor_to_images(self.world.vq.decode_code(codes))[0].cpu().numpy()
                path = os.path.join(self.out_dir, "images", m, f"{int(batch['image_id'][i])}.png")
                Image.fromarray(img).save(path)
                st = r.stats.to_dict()
                for k, v in (("index", int(batch["index"][i])), ("image_id", int(batch["image_id"][i])),
                             ("caption", caption), ("seed", seed), ("method", m),
                             ("image_path", os.path.relpath(path, self.out_dir)), ("image", img),
                             ("file_name", str(batch["file_name"][i])), ("wall_s", wall)):
                    cols[k].append(v)
                for k in STATS_FIELDS:
                    cols[k].append(st[k])
        out = {k: (np.stack(v) if k == "image" else np.asarray(v)) for k, v in cols.items()}
        return out


class MetricFeatures:
    """Stage 3: the FID feature vector of each image (the scenes feature net; Inception-v3 from a local weights file on
    the real-model path, none without one), attribute-probe checks against the scene labels (if any), and the CLIP
    score against the caption (when a CLIP model is given)."""

    def __init__(self, weights_dir: str | None, labels: dict | None, model_config: dict | None = None):
        self.device = _threads()
        from ciar.metrics.fid import feature_extractor
        from ciar.metrics.probe import load_probe
        from ciar.world import default_weights_dir

        model_config = model_config or {}
        w = weights_dir or default_weights_dir()
        self.labels = labels
        self.probe = load_probe(os.path.join(w, "probe.safetensors")) if labels and not model_config else None
        self.features = feature_extractor(model_config, w, device=self.device)
        self.clip = None
        if model_config.get("clip_model"):
            from ciar.metrics.clip import ClipScorer

            self.clip = ClipScorer(model_config["clip_model"], device=self.device)

    def __call__(self, batch: dict) -> dict:
        import torch

        from ciar.metrics.probe import accuracy_from_predictions, predict, scene_targets

        images = batch["image"]
        n = len(images)
        if self.features is not None:
            with torch.no_grad():
                feats = self.features(torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2))
            batch["fid_features"] = feats.cpu().numpy().astype(np.float32)
        else:
            batch["fid_features"] = np.zeros((n, 0), dtype=np.float32)
        batch["clip_score"] = self.clip(images, [str(c) for c in batch["caption"]]).astype(np.float64) \
            if self.clip is not None else np.full(n, np.nan)
        checks, correct = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float64)
        if self.probe is not None:
            pred = predict(self.probe, images)
            for i in range(n):
                lab = self.labels.get(str(int(batch["image_id"][i])))
                if lab is None:
                    continue
                one = {k: v[i:i + 1] for k, v in pred.items()}
                acc = accuracy_from_predictions(one, scene_targets([lab]))
                checks[i] = 4 * acc["num_objects"]
                correct[i] = acc["attribute_accuracy"] * checks[i]
        batch["fidelity_checks"] = checks
        batch["fidelity_correct"] = correct
        del batch["image"]
        return batch


def parse_params(items: list[str]) -> dict:
    """`--param key=value` items -> collaborative knobs, each parsed by its kind and checked against its range in
    the one table of knobs (`ciar.collab.knobs`)."""
    from ciar.collab.knobs import KNOBS

    known = sorted(KNOBS)
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or k not in KNOBS:
            raise SystemExit(f"error: bad --param {item!r}: use key=value with key in {known}")
        knob = KNOBS[k]
        try:
            if knob.kind is bool:
                if v.lower() not in ("true", "false"):
                    raise ValueError
                value = v.lower() == "true"
            elif knob.kind is str:
                value = v
            else:
                value = knob.kind(v)
            knob.check(value)
        except ValueError:
            raise SystemExit(f"error: --param {k} must be {knob.values()}, got {v!r}") from None
        out[k] = value
    return out


# ---------------------------------------------------------------------------------------------- shards
RUN_FILE = "run.json"  # in OUT: the settings its samples were made with (`run_settings`)


def run_settings(args, methods: list[str], overrides: dict, model_config: dict) -> dict:
    """What a run's samples depend on (not how they are computed: --generators, --batch-size), JSON-ready."""
    from ciar_device.fetch import sha256_file

    return json.loads(json.dumps({
        "captions": os.path.abspath(args.captions), "captions_sha256": sha256_file(args.captions),
        "limit": args.limit, "seed": args.seed, "methods": methods, "params": overrides, "network": args.network,
        "weights": os.path.abspath(args.weights) if args.weights else None, "world": model_config,
        "shard_size": args.shard_size}, sort_keys=True, default=str))


def claim_out(out: str, settings: dict) -> None:
    """Record `settings` in OUT/run.json, or check them against the ones recorded there (`SettingsMismatch`, a
    ValueError, naming the settings that differ: the finished shards were made with the recorded ones)."""
    from ciar.results import claim_settings

    path = os.path.join(out, RUN_FILE)
    if not os.path.isfile(path) and any(n.startswith("shard-") for n in os.listdir(os.path.join(out, "samples"))):
        print(f"{out} has shards but no {RUN_FILE} (made before it was written): their settings are not checked; "
              f"recording this run's", flush=True)
    claim_settings(path, settings, f"--out {out}", "its finished shards would be taken as this run's: give another "
                                                   "--out, or remove that folder")


def shard_path(out: str, shard: int) -> str:
    return os.path.join(out, "samples", f"shard-{shard:05d}.parquet")


def write_shard(out: str, shard: int, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(rows, key=lambda r: (r["index"], r["method"]))
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    cols["fid_features"] = [list(map(float, v)) for v in cols["fid_features"]]
    path = shard_path(out, shard)
    tmp = path + ".tmp"
    pq.write_table(pa.table(cols), tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- aggregation
def summarize(samples, methods: list[str], ref_features: np.ndarray | None) -> dict:
    """Per-sample rows (a pandas DataFrame) -> {"methods": {NAME: {...benchmarks.collab fields...}}}."""
    import torch
    from torchmetrics.image.fid import _compute_fid

    rows = {}
    base = samples[samples["method"] == "cloud"]
    base_total = float((base["device_s"] + base["cloud_s"] + base["comm_s"]).mean()) if len(base) else None
    for m in methods:
        s = samples[samples["method"] == m]
        n = len(s)
        if not n:
            continue
        stats = [GenerationStats.from_dict(r) for r in s[list(STATS_FIELDS)].to_dict("records")]
        fid = None
        if ref_features is not None and n >= 2:
            f = np.stack(s["fid_features"].to_numpy()).astype(np.float64)
            r = ref_features.astype(np.float64)
            fid = float(_compute_fid(torch.from_numpy(r.mean(0)), torch.from_numpy(np.cov(r, rowvar=False)),
                                     torch.from_numpy(f.mean(0)), torch.from_numpy(np.cov(f, rowvar=False))))
        checks = float(s["fidelity_checks"].sum())
        clip = s["clip_score"].dropna() if "clip_score" in s else []
        rows[m] = {
            **summarize_method(stats, base_total),
            "fidelity": float(s["fidelity_correct"].sum()) / checks if checks else None,
            "fid": fid,
            "clip_score": float(clip.mean()) if len(clip) else None,
            "wall_s_per_image": float(s["wall_s"].mean()),
        }
    return {"methods": rows}


def reference_features(info: dict, rows: list[dict], weights_dir: str | None,
                       model_config: dict | None = None) -> np.ndarray | None:
    """FID features of the reference images of the captions: a scenes export's DIR/images/FILE with the scenes
    feature net, or (real-model path) `reference_images`/FILE with Inception. None when there are none."""
    import torch
    from PIL import Image

    from ciar.metrics.fid import feature_extractor
    from ciar.world import default_weights_dir

    model_config = model_config or {}
    folder = model_config.get("reference_images") if model_config else os.path.join(info["root"], "images")
    if not folder:
        return None
    paths = [os.path.join(folder, r["file_name"]) for r in rows if r["file_name"]]
    if len(paths) < 2:
        return None
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        if model_config:
            raise FileNotFoundError(f"reference_images: {len(missing)} images missing, e.g. {missing[0]}")
        return None
    features = feature_extractor(model_config, weights_dir or default_weights_dir())
    if features is None:
        return None
    feats = []
    with torch.no_grad():
        if model_config:  # real photos differ in size: one at a time (the extractor resizes to its input)
            for p in paths:
                im = torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1)[None]
                feats.append(features(im).cpu().numpy())
        else:
            imgs = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])
            for s in range(0, len(imgs), 256):
                feats.append(features(torch.from_numpy(imgs[s:s + 256]).permute(0, 3, 1, 2)).cpu().numpy())
    return np.concatenate(feats)


def write_report(out: str, summary: dict, samples, methods: list[str], runs: list[dict], agg_s: float,
                 args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from ciar.collab.stats import methods_markdown

    rows = summary["methods"]
    plots = os.path.join(out, "plots")
    os.makedirs(plots, exist_ok=True)
    # frontier: quality vs speedup
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    has_probe = any(r.get("fidelity") is not None for r in rows.values())
    quality = ("fidelity", "attribute fidelity (higher is better)") if has_probe else \
        ("clip_score", "CLIP score (higher is better)")
    for ax, key, label in ((axes[0], *quality), (axes[1], "fid", "FID (lower is better)")):
        for m, r in rows.items():
            if r.get(key) is not None and r.get("speedup") is not None:
                ax.scatter(r["speedup"], r[key])
                ax.annotate(m, (r["speedup"], r[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("speedup vs cloud-only (end-to-end latency)")
        ax.set_ylabel(label)
        ax.axvline(1.0, color="gray", lw=0.5)
    fig.tight_layout()
    fig.savefig(os.path.join(plots, "frontier.png"), dpi=120)
    plt.close(fig)
    # latency split
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    bottom = np.zeros(len(rows))
    for part in ("device", "cloud", "comm"):
        vals = np.array([r["latency_s"][part] for r in rows.values()])
        ax.bar(list(rows), vals, bottom=bottom, label=part)
        bottom += vals
    ax.set_ylabel(f"seconds per image ({args.network})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(plots, "latency.png"), dpi=120)
    plt.close(fig)
    # image grid: the first captions, one row per method
    idx = sorted(samples["index"].unique())[:8]
    grid = []
    for m in methods:
        s = samples[samples["method"] == m].set_index("index")
        grid.append(np.concatenate([np.asarray(Image.open(os.path.join(out, s.loc[i, "image_path"])).convert("RGB"))
                                    for i in idx if i in s.index], axis=1))
    Image.fromarray(np.concatenate(grid, axis=0)).resize(
        (grid[0].shape[1] * 2, len(grid) * grid[0].shape[0] * 2), Image.NEAREST).save(os.path.join(plots, "grid.png"))
    captions = samples[samples["method"] == methods[0]].set_index("index").loc[idx, "caption"].tolist()

    lines = [f"# Evaluation report\n\nCaptions: `{args.captions}` ({int(samples['index'].nunique())} captions), "
             f"methods: {', '.join(methods)}, network: {args.network}, seed: {args.seed}, params: {args.param}\n\n",
             methods_markdown(rows, "Methods side by side (speedup vs cloud-only from the per-sample latencies)"),
             *(["\n| Method | CLIP score (↑) |\n|---|---|\n"]
               + [f"| {m} | {r['clip_score']:.2f} |\n" for m, r in rows.items() if r.get("clip_score") is not None]
               if any(r.get("clip_score") is not None for r in rows.values()) else []),
             "\n![quality vs speedup](plots/frontier.png)\n\n![latency split](plots/latency.png)\n\n",
             f"Image grid (rows: {', '.join(methods)}; columns: the first {len(idx)} captions):\n\n",
             "![grid](plots/grid.png)\n\n", *[f"{k + 1}. {c}\n" for k, c in enumerate(captions)],
             "\n## Wall time per stage\n\n| run finished | samples | stage | seconds |\n|---|---|---|---|\n",
             *[f"| {r['finished']} | {r['samples_run']} | {k} | {v:.1f} |\n" for r in runs
               for k, v in r["stage_wall_s"].items()],
             f"| (this call) | – | aggregation: FID, summary | {agg_s:.1f} |\n"]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("".join(lines))


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--captions", required=True, help="MS-COCO captions JSON (or a scenes export's captions.json)")
    ap.add_argument("--methods", default="cloud,ciar", help="comma list of ciar.collab methods")
    ap.add_argument("--limit", type=int, default=None, help="first N captions (by image id)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", default=None, help="world file (ciar.world_spec): a LlamaGen world with its T5 folder "
                                                  "or features, or an Anole world, and metric files (default: the "
                                                  "shipped scenes world)")
    ap.add_argument("--model-config", default=None, help="the older flat JSON of the real-model path (read as a "
                                                         "LlamaGen world; use --world)")
    ap.add_argument("--param", action="append", default=[], help="CollabConfig override key=value (repeatable)")
    ap.add_argument("--network", default="5g")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default=None, help="weights folder (default: shipped weights/scenes-v1)")
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--generators", type=int, default=1, help="actors of the generation stage (max)")
    ap.add_argument("--batch-size", type=int, default=4, help="captions per generation call")
    args = ap.parse_args(argv)
    for flag, value, least in (("--limit", args.limit, 1), ("--seed", args.seed, 0),
                               ("--shard-size", args.shard_size, 1), ("--generators", args.generators, 1),
                               ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:  # (a negative --limit was taken as a slice: all but the last N)
            ap.error(f"{flag} must be >= {least}, got {value}")

    from ciar.sim.decoder import METHODS, method_config, shared_knobs

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"unknown methods {bad}; known: {', '.join(METHODS)}")
    overrides = parse_params(args.param)
    try:
        for m in methods:
            method_config(m, network=args.network, **shared_knobs(m, overrides))
        rows, info = read_captions(args.captions, args.limit, args.seed)
        model_config = read_model_config(args.world or args.model_config, methods)
        if model_config.get("t5_embeddings"):
            missing = [r["image_id"] for r in rows
                       if not os.path.isfile(os.path.join(model_config["t5_embeddings"], f"{r['image_id']}.npy"))]
            if missing:
                raise FileNotFoundError(f"t5_embeddings: no embedding file for {len(missing)} of the captions' "
                                        f"images, e.g. {os.path.join(model_config['t5_embeddings'], str(missing[0]))}.npy")
        if is_anole(model_config):  # a caption over the prompt positions would stop stage 1 midway: name it now
            enc = anole_prompt_encoder(model_config)
            long = [(r, n) for r in rows if (n := enc.count_tokens(r["caption"])) > enc.max_length]
            if long:
                (r, n), more = long[0], f" (and {len(long) - 1} more)" if len(long) > 1 else ""
                raise ValueError(f"caption of image {r['image_id']} is {n} prompt tokens with Anole's markers; the "
                                 f"world's cls_token_num is {enc.max_length}{more}: {r['caption'][:80]!r}")
        out = os.path.abspath(args.out)
        os.makedirs(os.path.join(out, "samples"), exist_ok=True)
        claim_out(out, run_settings(args, methods, overrides, model_config))  # (SettingsMismatch: a ValueError)
    except (CaptionsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        r["shard"] = r["index"] // args.shard_size
    shards = sorted({r["shard"] for r in rows})
    todo = [s for s in shards if not os.path.isfile(shard_path(out, s))]
    print(f"{len(rows)} captions x {len(methods)} methods, {len(shards)} shards, {len(shards) - len(todo)} done "
          f"already", flush=True)

    stage_wall: dict = {}
    if todo:
        import ray
        import torch
        from tqdm import tqdm

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                               "OMP_NUM_THREADS": "1"}})
        gpus = 1 if torch.cuda.is_available() else 0
        todo_set = set(todo)
        pending = [r for r in rows if r["shard"] in todo_set]
        t0 = time.time()
        ds = ray.data.from_items(pending)
        ds = ds.map_batches(EncodeCaptions, fn_constructor_kwargs={"weights_dir": args.weights,
                                                                   "model_config": model_config},
                            batch_size=64, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5)
        ds = ds.map_batches(Generate, fn_constructor_kwargs={"weights_dir": args.weights, "model_config": model_config,
                                                             "methods": methods, "overrides": overrides,
                                                             "network": args.network, "out_dir": out},
                            batch_size=args.batch_size,
                            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, args.generators)),
                            num_cpus=1, num_gpus=gpus)
        ds = ds.map_batches(MetricFeatures, fn_constructor_kwargs={"weights_dir": args.weights,
                                                                   "labels": info["labels"],
                                                                   "model_config": model_config},
                            batch_size=64, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5)
        per_shard = {s: [] for s in todo}
        need = {s: sum(1 for r in pending if r["shard"] == s) * len(methods) for s in todo}
        bar = tqdm(total=len(pending) * len(methods), desc="samples", dynamic_ncols=True)
        for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
            n = len(batch["method"])
            for i in range(n):
                row = {k: (v[i].item() if hasattr(v[i], "item") and np.ndim(v[i]) == 0 else v[i])
                       for k, v in batch.items() if k not in ("caption_emb", "caption_ids", "caption_mask")}
                s = int(row["shard"]) if "shard" in row else int(row["index"]) // args.shard_size
                row.pop("shard", None)
                per_shard[s].append(row)
                if len(per_shard[s]) == need[s]:
                    write_shard(out, s, per_shard.pop(s))
            bar.update(n)
        bar.close()
        stage_wall["pipeline (all stages, streaming)"] = time.time() - t0
        stage_wall.update(_operator_times(ds))
        if per_shard:
            raise RuntimeError(f"shards {sorted(per_shard)} incomplete: rows were lost in the pipeline")

    runs_path = os.path.join(out, "stages.json")  # wall time per stage of every run into this folder
    runs = json.load(open(runs_path)) if os.path.isfile(runs_path) else []
    if stage_wall:
        runs.append({"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "shards_run": len(todo),
                     "samples_run": sum(r["shard"] in set(todo) for r in rows) * len(methods),
                     "stage_wall_s": stage_wall})
        with open(runs_path, "w") as f:
            json.dump(runs, f, indent=2)

    import pandas as pd

    t1 = time.time()
    samples = pd.concat([pd.read_parquet(shard_path(out, s)) for s in shards], ignore_index=True)
    samples = samples[samples["method"].isin(methods)]
    ref = reference_features(info, rows, args.weights, model_config)
    summary = summarize(samples, methods, ref)
    summary.update({"captions": os.path.abspath(args.captions), "num_captions": len(rows), "network": args.network,
                    "seed": args.seed, "params": overrides, "runs": runs})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    write_report(out, summary, samples, methods, runs, time.time() - t1, args)
    print(json.dumps({m: {k: r[k] for k in ("speedup", "cloud_call_rate", "fidelity", "fid", "clip_score")}
                      for m, r in summary["methods"].items()}, indent=1))
    return 0


def _operator_times(ds) -> dict:
    """Per Ray Data operator: the summed remote wall time of its tasks (the stage's busy time), parsed from the
    dataset's execution stats (best effort: an unknown format gives {})."""
    import re

    try:
        text = ds.stats()
    except Exception:  # noqa: BLE001
        return {}
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Operator \d+ (.+?): ", line)
        if m:
            name = m.group(1).strip()
            continue
        t = re.search(r"Remote wall time: .*?([0-9.]+)(us|ms|s) total", line)
        if name and t:
            out[f"{name} (busy)"] = float(t.group(1)) * unit[t.group(2)]
            name = None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
