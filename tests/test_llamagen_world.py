"""A LlamaGen world through the entry points, on RANDOM-weight files in the real formats: LlamaGen's t2i GPT and
VQ-16 `.pt` layouts, a tiny random T5 encoder + tokenizer saved with `save_pretrained` (runtime caption encoding),
a device model for that GPT, and MS-COCO-format captions. The CLI, `benchmarks.collab`, the device distillation
(which resumes), the projector and the calibration all take the same world file."""

import json
import os

import numpy as np
import pytest
import torch

from ciar.testing import LLAMAGEN_SMALL_GPT, make_tiny_t5, write_coco_captions, write_random_llamagen_files
from ciar.world import load_world
from ciar.world_spec import WorldSpecError

CAPTIONS = ["A red bus parked on a city street.", "Two dogs play with a frisbee in the park.",
            "A plate of pasta next to a glass of wine.", "A man rides a surfboard on a large wave.",
            "A small kitchen with a white refrigerator.", "A giraffe standing next to a tall tree.",
            "A laptop on a wooden desk by the window.", "Children flying kites on a sunny beach."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamagen-entry")
    cfg = write_random_llamagen_files(str(root / "models"), [1])
    make_tiny_t5(str(root / "models" / "t5"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"])
    world = {"kind": "llamagen", "text_encoder": "models/t5", "sampling": {"cfg_scale": 2.0, "top_k": 0},
             **{k: (f"models/{cfg[k]}" if k.endswith("checkpoint") else cfg[k])
                for k in ("gpt_checkpoint", "gpt_config", "gpt_overrides", "image_size", "vq_checkpoint",
                          "vq_overrides", "device_checkpoint")}}
    (root / "world.json").write_text(json.dumps(world))
    return {"root": root, "world": str(root / "world.json"),
            "train": write_coco_captions(root / "train.json", CAPTIONS),
            "val": write_coco_captions(root / "val.json", CAPTIONS[:4], first_id=50)}


def test_the_world_encodes_captions_with_t5_at_runtime(files):
    from ciar.t5 import T5CaptionEncoder

    w = load_world(files["world"], need_text=True)
    assert isinstance(w.text, T5CaptionEncoder)
    cap = w.text.encode(CAPTIONS[:2])
    assert cap.emb.shape == (2, LLAMAGEN_SMALL_GPT["cls_token_num"], LLAMAGEN_SMALL_GPT["caption_dim"])
    assert cap.mask[:, -1].all()  # left padding: the real tokens end at the last position


def test_a_t5_of_the_wrong_width_is_refused(files, tmp_path):
    make_tiny_t5(str(tmp_path / "t5-16"), d_model=16)
    world = json.load(open(files["world"]))
    world.update(base_dir=str(files["root"]), text_encoder=str(tmp_path / "t5-16"))
    with pytest.raises(WorldSpecError, match="text_encoder: .* gives 16-d caption embeddings but the GPT's caption "
                                             "projector takes caption_dim=32"):
        load_world(world)


@pytest.mark.parametrize("method", ["cloud", "ciar"])
def test_cli_generates_at_the_worlds_resolution(files, tmp_path, method):
    from PIL import Image

    from ciar.generate import main

    outs = []
    for k in range(2):
        out = tmp_path / f"{method}{k}.png"
        args = ["--world", files["world"], "--prompt", CAPTIONS[0], "--method", method, "--seed", "3",
                "--out", str(out), "--stats", str(tmp_path / f"{method}.json")]
        assert main(args + (["--tau", "0.05"] if method == "ciar" else [])) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert Image.open(tmp_path / f"{method}0.png").size == (64, 64)
    stats = json.load(open(tmp_path / f"{method}.json"))
    assert stats["num_tokens"] == 16 and stats["sampling"]["cfg_scale"] == 2.0


def test_benchmark_runs_on_the_world_and_its_captions(files, tmp_path):
    from benchmarks.collab import main

    out = tmp_path / "t1.json"
    assert main(["--world", files["world"], "--captions", files["train"], "--methods", "cloud,ciar,eagle",
                 "--num-prompts", "2", "--tau", "0.05", "--no-inter-enhance-ablation", "--out", str(out)]) == 0
    rows = json.load(open(out))["methods"]
    assert {"cloud", "ciar", "eagle"} <= set(rows)
    assert rows["cloud"]["cloud_call_rate"] == 1.0 and 0 < rows["ciar"]["cloud_call_rate"] <= 1.0
    assert rows["ciar"]["fidelity"] is None  # the attribute probe belongs to the scenes world


def test_a_llamagen_benchmark_needs_captions(files):
    from benchmarks.collab import main

    with pytest.raises(SystemExit, match="needs --captions"):
        main(["--world", files["world"], "--methods", "cloud", "--num-prompts", "1", "--out", "x.json"])


def test_device_distillation_on_the_world_resumes(files, tmp_path):
    from ciar.collab.device import DeviceModel
    from pipelines.train_device import main

    args = ["--world", files["world"], "--captions", files["train"], "--val-captions", files["val"],
            "--num-train", "8", "--num-val", "4", "--eval-n", "4", "--steps", "4", "--batch-size", "2",
            "--eval-every", "2", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--name", "device", "--threads", "1"]
    assert main(args + ["--stop-after", "2"]) == 0
    first = DeviceModel.load(str(tmp_path / "out" / "device.safetensors"))
    assert first.extra["trained_steps"] == 2 and "LlamaGen world" in first.extra["world"]
    # the captions were encoded by the world's T5 and the sequences sampled from its GPT, on disk
    emb = np.load(tmp_path / "data" / "train_8_emb.npy", mmap_mode="r")
    assert emb.shape == (8, LLAMAGEN_SMALL_GPT["cls_token_num"], LLAMAGEN_SMALL_GPT["caption_dim"])
    assert np.abs(emb).sum() > 0
    assert main(args) == 0  # resumes from step 2
    done = DeviceModel.load(str(tmp_path / "out" / "device.safetensors"))
    assert done.extra["trained_steps"] == 4
    hist = json.load(open(tmp_path / "ckpt" / "history.json"))
    assert [h["step"] for h in hist] == [2, 4]
    assert done.config.vocab_size == 64 and done.config.block_size == 16
    assert not torch.equal(done.inter_head.heads[0].weight, first.inter_head.heads[0].weight)


def test_evaluation_encodes_captions_with_the_worlds_t5(files):
    """pipelines.evaluate's caption stage on a world file with `text_encoder` (no precomputed features)."""
    from ciar.t5 import T5CaptionEncoder
    from pipelines.evaluate import EncodeCaptions, read_model_config

    cfg = read_model_config(files["world"], ["cloud", "ciar"])
    assert cfg["text_encoder"] == os.path.join(files["root"], "models", "t5") and "t5_embeddings" not in cfg
    out = EncodeCaptions(None, cfg)({"caption": np.array(CAPTIONS[:3]), "image_id": np.array([1, 2, 3])})
    want = T5CaptionEncoder(cfg["text_encoder"], max_length=LLAMAGEN_SMALL_GPT["cls_token_num"]).encode(CAPTIONS[:3])
    assert out["caption_emb"].shape == tuple(want.emb.shape)
    assert np.allclose(out["caption_emb"].astype(np.float32), want.emb.numpy(), atol=1e-2)
    assert (out["caption_mask"] == want.mask.numpy()).all()


def test_decode_benchmark_takes_the_worlds_gpt(files):
    from benchmarks.decode import run_benchmark

    res = run_benchmark(batch_sizes=(1,), tokens=4, repeats=1, world=files["world"])
    assert res["meta"]["weights"] == os.path.join(files["root"], "models", "t2i_small.pt")
    assert res["meta"]["model"]["vocab_size"] == 64 and res["batch_1"]["ours_tok_s"] > 0


def test_onpolicy_sequences_through_ray_data_equal_the_local_ones(files, tmp_path, shared_ray):
    """pipelines.onpolicy with --workers: the chunks sampled on a Ray Data actor pool give the same bytes as in
    process (each chunk has its own seeded generator), written in order, resumable."""
    from pipelines.common import SettingsMismatch
    from pipelines.onpolicy import build_onpolicy, load_captions, onpolicy_tag

    w = load_world(files["world"])
    caps = load_captions(str(tmp_path / "data"), "train", 8, 0, w, "cpu", files["train"])
    with pytest.raises(SettingsMismatch, match="the train split of 8 was made with other settings \\(sha256: .*"
                                               "source: .*train.json.* there, .*val.json.* now"):
        load_captions(str(tmp_path / "data"), "train", 8, 0, w, "cpu", files["val"])  # (another file's captions)
    tag = onpolicy_tag(w.cloud_file, w.sampling)
    local = build_onpolicy(str(tmp_path / "local"), "train", caps, w.cloud, w.sampling, 7, tag, chunk=3,
                           progress=False)
    remote = build_onpolicy(str(tmp_path / "ray"), "train", caps, w.cloud, w.sampling, 7, tag, chunk=3,
                            progress=False, workers=2, world=files["world"])
    assert remote.done == local.done == 8
    assert np.array_equal(np.asarray(remote.tokens), np.asarray(local.tokens))
    assert len(np.unique(np.asarray(local.tokens), axis=0)) == 8  # not one sequence repeated
