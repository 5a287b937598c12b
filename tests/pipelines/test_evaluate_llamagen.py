"""The evaluation's real-model path for real, on RANDOM-weight stand-ins in the real file formats: a LlamaGen-layout
t2i checkpoint and VQ-16 `.pt`, a device model for that GPT, T5-style `IMAGE_ID.npy` caption embeddings, a local
CLIP folder, FID Inception-v3 weights and reference images, named by a `--model-config` file (relative paths) over
a COCO-layout captions file. Every Ray Data stage runs; the summary carries the CLIP score and the Inception FID;
missing and wrong files are named."""

import json
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pd = pytest.importorskip("pandas")

from ciar.testing import write_random_llamagen_files  # noqa: E402
from pipelines import evaluate  # noqa: E402

IDS = [3, 5, 8, 13]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamagen")
    cfg = write_random_llamagen_files(str(root / "models"), IDS)
    cfg = {k: (os.path.join("models", v) if k in evaluate.MODEL_CONFIG_FILES else v) for k, v in cfg.items()}
    (root / "models.json").write_text(json.dumps(cfg))
    coco = {"images": [{"id": i, "file_name": f"{i}.png"} for i in IDS],
            "annotations": [{"id": 100 + i, "image_id": i, "caption": f"a photo number {i}"} for i in IDS]}
    (root / "captions_val2017.json").write_text(json.dumps(coco))
    return root


@pytest.fixture(scope="module")
def run(files, tmp_path_factory, local_ray):
    out = str(tmp_path_factory.mktemp("eval"))
    assert evaluate.main(["--captions", str(files / "captions_val2017.json"), "--methods", "cloud,ciar,eagle",
                          "--model-config", str(files / "models.json"), "--out", out, "--param", "tau=0.05",
                          "--shard-size", "2"]) == 0
    return out


def test_llamagen_path_runs_every_stage(run):
    from PIL import Image

    s = json.load(open(os.path.join(run, "summary.json")))
    assert set(s["methods"]) == {"cloud", "ciar", "eagle"} and s["num_captions"] == len(IDS)
    for m, r in s["methods"].items():
        assert r["num_samples"] == len(IDS)
        assert 0.0 <= r["clip_score"] <= 100.0  # CLIP score from the local folder
        assert r["fidelity"] is None  # no scene labels on the real-model path
        assert np.isfinite(r["fid"]) and r["fid"] > 0  # Inception FID against the reference images
    assert s["methods"]["cloud"]["speedup"] == pytest.approx(1.0)
    assert s["methods"]["cloud"]["cloud_call_rate"] == 1.0 and s["methods"]["ciar"]["cloud_call_rate"] < 1.0
    rows = pd.concat([pd.read_parquet(os.path.join(run, "samples", f)) for f in os.listdir(os.path.join(run, "samples"))])
    assert len(rows) == 3 * len(IDS) and set(rows["total_tokens"]) == {16}  # 64 px at downsample 16: 4 x 4 tokens
    mean_clip = rows[rows["method"] == "ciar"]["clip_score"].mean()
    assert mean_clip == pytest.approx(s["methods"]["ciar"]["clip_score"])
    img = Image.open(os.path.join(run, rows.iloc[0]["image_path"]))
    assert img.size == (64, 64)
    report = open(os.path.join(run, "report.md")).read()
    assert "CLIP score" in report


def test_same_caption_and_seed_give_the_same_tokens_as_in_process(run, files):
    """The cloud-only row of caption 0 equals an in-process generation with the same T5 embedding and seed."""
    import torch
    from PIL import Image

    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.models.vq import tensor_to_images
    from ciar.world import load_llamagen_world

    cfg = evaluate.read_model_config(str(files / "models.json"), ["cloud"])
    world = load_llamagen_world(cfg)
    world.text.add("c", np.load(os.path.join(cfg["t5_embeddings"], f"{IDS[0]}.npy")))
    tokens = make_decoder(world, make_verifier(world), "cloud", network="5g").generate("c", seed=0).tokens
    with torch.no_grad():
        want = tensor_to_images(world.vq.decode_code(tokens.reshape(1, -1)))[0].numpy()
    got = np.asarray(Image.open(os.path.join(run, "images", "cloud", f"{IDS[0]}.png")).convert("RGB"))
    assert np.array_equal(got, want)


def test_missing_t5_embedding_is_named(files, tmp_path, capsys):
    cfg = json.load(open(files / "models.json"))
    t5 = tmp_path / "t5"
    t5.mkdir()
    for i in IDS[:-1]:
        os.symlink(os.path.join(files, cfg["t5_embeddings"], f"{i}.npy"), t5 / f"{i}.npy")
    cfg = {k: (os.path.join(files, v) if k in evaluate.MODEL_CONFIG_FILES else v) for k, v in cfg.items()}
    cfg["t5_embeddings"] = str(t5)
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    assert evaluate.main(["--captions", str(files / "captions_val2017.json"), "--model-config",
                          str(tmp_path / "m.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "t5_embeddings" in err and f"{IDS[-1]}.npy" in err


def test_device_checkpoint_needed_unless_cloud_only(files, tmp_path, capsys):
    cfg = json.load(open(files / "models.json"))
    cfg = {k: (os.path.join(files, v) if k in evaluate.MODEL_CONFIG_FILES else v) for k, v in cfg.items()}
    del cfg["device_checkpoint"]
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    args = ["--captions", str(files / "captions_val2017.json"), "--model-config", str(tmp_path / "m.json"),
            "--out", str(tmp_path / "o")]
    assert evaluate.main(args + ["--methods", "cloud,ciar"]) == 2
    assert "device_checkpoint" in capsys.readouterr().err
    assert evaluate.read_model_config(str(tmp_path / "m.json"), ["cloud"])["gpt_checkpoint"].endswith("t2i_small.pt")


def test_inception_weights_missing_or_wrong_are_named(files, tmp_path):
    cfg = json.load(open(files / "models.json"))
    cfg = {k: (os.path.join(files, v) if k in evaluate.MODEL_CONFIG_FILES else v) for k, v in cfg.items()}
    cfg["inception_weights"] = str(tmp_path / "pt_inception-2015-12-05-6726825d.pth")
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="inception_weights"):
        evaluate.read_model_config(str(tmp_path / "m.json"))
    # a file of another network: refused before anything runs, with the file and its first keys named
    import torch

    torch.save({"conv1.weight": torch.zeros(8, 3, 3, 3)}, tmp_path / "pt_inception-2015-12-05-6726825d.pth")
    with pytest.raises(ValueError, match=r"(?s)inception_weights.*unexpected keys \(1\): conv1.weight"):
        evaluate.read_model_config(str(tmp_path / "m.json"))


