"""`pipelines.evaluate` on an Anole world, end to end, on RANDOM-weight files in the real layouts
(`ciar.testing.write_random_anole_files`: a tiny transformers Chameleon folder with its tokenizer.json, a taming VQGAN
checkpoint + yaml, a CIAR device model for the decoder) with the metric files in the world file (a tiny CLIP folder,
FID Inception-v3 weights, reference images) over a COCO-layout captions file. Stage 1 carries Anole's prompt ids (not
embeddings), Generate runs the Chameleon decoder and device trunk, the VQGAN decodes, and the summary has the CLIP
score and the Inception FID; the cloud-only and CIAR images equal in-process generations with the same caption and
seed; a caption over the prompt positions is named before anything starts."""

import json
import os

import numpy as np
import pytest
import yaml

ray = pytest.importorskip("ray")
pd = pytest.importorskip("pandas")
pytest.importorskip("transformers")

from ciar.testing import (ANOLE_TINY, write_coco_captions, write_random_anole_files,  # noqa: E402
                          write_random_clip, write_random_fid_inception)
from pipelines import evaluate  # noqa: E402

CAPTIONS = ["A red bus parked on a city street.", "Two dogs play with a frisbee in the park.",
            "A plate of pasta next to a glass of wine."]
FIRST_ID = 7
IDS = [FIRST_ID + i for i in range(len(CAPTIONS))]
N_TOKENS = 16  # 32 px / 8 -> 4 x 4 codes


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("anole-eval")
    fields = write_random_anole_files(str(root))
    write_random_clip(str(root / "clip"))
    write_random_fid_inception(str(root / "inception.pth"))
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    for i in IDS:  # COCO's file names (.jpg), photos of other sizes than the 32 px images
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(root / "images" / f"{i}.jpg")
    fields.update(inception_weights="inception.pth", clip_model="clip", reference_images="images")
    (root / "anole-eval.yaml").write_text(yaml.safe_dump(fields))
    write_coco_captions(root / "captions.json", CAPTIONS, FIRST_ID)
    return root


@pytest.fixture(scope="module")
def run(files, tmp_path_factory, local_ray):
    out = str(tmp_path_factory.mktemp("eval"))
    assert evaluate.main(["--captions", str(files / "captions.json"), "--methods", "cloud,ciar",
                          "--world", str(files / "anole-eval.yaml"), "--out", out, "--param", "tau=0.05",
                          "--shard-size", "2"]) == 0
    return out


# ------------------------------------------------------------------------------------------------ without Ray
def test_the_world_is_read_with_its_metric_files(files, tmp_path):
    cfg = evaluate.read_model_config(str(files / "anole-eval.yaml"), ["cloud", "ciar"])
    assert cfg["kind"] == "anole"
    for k in ("model", "inception_weights", "clip_model", "reference_images"):
        assert os.path.isabs(cfg[k]) and os.path.exists(cfg[k]), k
    assert evaluate.caption_length(cfg, None) == ANOLE_TINY["cls_token_num"]
    d = yaml.safe_load((files / "anole-eval.yaml").read_text())
    (tmp_path / "w.yaml").write_text(yaml.safe_dump({**d, "base_dir": str(files), "clip_model": "no-clip"}))
    with pytest.raises(FileNotFoundError, match="clip_model: folder not found"):
        evaluate.read_model_config(str(tmp_path / "w.yaml"))


def test_stage_one_carries_anoles_prompt_ids(files):
    """The ids (int64, exact) the world's own prompt encoder gives, without loading the decoder."""
    from ciar.world import load_world

    cfg = evaluate.read_model_config(str(files / "anole-eval.yaml"), ["cloud"])
    out = evaluate.EncodeCaptions(None, cfg)({"caption": np.array(CAPTIONS), "image_id": np.array(IDS)})
    assert "caption_emb" not in out and out["caption_ids"].dtype == np.int64
    assert out["caption_ids"].shape == out["caption_mask"].shape == (len(CAPTIONS), ANOLE_TINY["cls_token_num"])
    want = load_world(str(files / "anole-eval.yaml")).text.encode(CAPTIONS)
    assert np.array_equal(out["caption_ids"], want.emb.numpy()) and np.array_equal(out["caption_mask"],
                                                                                   want.mask.numpy())


def test_a_caption_over_the_prompt_positions_is_named_before_anything_starts(files, tmp_path, capsys):
    long = " ".join(["red bus"] * ANOLE_TINY["cls_token_num"])
    write_coco_captions(tmp_path / "c.json", [CAPTIONS[0], long], 1)
    assert evaluate.main(["--captions", str(tmp_path / "c.json"), "--world", str(files / "anole-eval.yaml"),
                          "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "caption of image 2" in err and f"cls_token_num is {ANOLE_TINY['cls_token_num']}" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ the pipeline
def _rows(run):
    folder = os.path.join(run, "samples")
    return pd.concat([pd.read_parquet(os.path.join(folder, f)) for f in sorted(os.listdir(folder))])


def test_anole_world_runs_every_stage(run):
    from PIL import Image

    s = json.load(open(os.path.join(run, "summary.json")))
    assert set(s["methods"]) == {"cloud", "ciar"} and s["num_captions"] == len(CAPTIONS)
    for m, r in s["methods"].items():
        assert r["num_samples"] == len(CAPTIONS)
        assert 0.0 <= r["clip_score"] <= 100.0  # CLIP score of the decoded images, from the world's CLIP folder
        assert r["fidelity"] is None
        assert np.isfinite(r["fid"]) and r["fid"] > 0  # Inception FID against reference_images
    assert s["methods"]["cloud"]["speedup"] == pytest.approx(1.0)
    assert s["methods"]["cloud"]["cloud_call_rate"] == 1.0
    rows = _rows(run)
    assert len(rows) == 2 * len(CAPTIONS) and set(rows["total_tokens"]) == {N_TOKENS}
    assert not {"caption_ids", "caption_emb", "caption_mask"} & set(rows.columns)
    assert rows[rows["method"] == "ciar"]["device_tokens"].max() > 0  # the Chameleon trunk drafted (the first image
    # runs at the calibrated point; the adaptive policy may give later ones to the cloud whole on this tiny world)
    assert Image.open(os.path.join(run, rows.iloc[0]["image_path"])).size == (32, 32)  # the VQGAN's resolution
    assert "CLIP score" in open(os.path.join(run, "report.md")).read()


def test_same_caption_and_seed_give_the_same_image_as_in_process(run, files):
    """The first two captions' rows equal in-process generations with the world's own prompt encoder and the same
    seed: cloud-only bit for bit; CIAR (its device conditions on the prompt's embeddings the verifier makes from the
    ids) at the operating point its row reports (the adaptive policy picks it from observed costs;
    `tests/collab/test_adaptive.py` replays it with the fixed policy the same way)."""
    import torch
    from PIL import Image

    from ciar.sim.decoder import shared_knobs
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.models.vq import tensor_to_images
    from ciar.world import load_world

    rows = _rows(run)
    world = load_world(str(files / "anole-eval.yaml"))
    verifier = make_verifier(world, max_sessions=2)
    for i, m in ((i, m) for i in (0, 1) for m in ("cloud", "ciar")):
        row = rows[(rows["method"] == m) & (rows["index"] == i)].iloc[0]
        assert row["seed"] == 0 * 1_000_003 + i  # --seed 0
        knobs = shared_knobs(m, {"tau": 0.05})
        if m == "ciar":
            knobs.update(policy="fixed", **({"prefix_rate": 1.0} if row["handovers"] else
                                            {"span": int(row["span_used"]), "burst": int(row["burst_used"])}))
        r = make_decoder(world, verifier, m, network="5g", **knobs).generate(CAPTIONS[i], seed=int(row["seed"]))
        with torch.no_grad():
            want = tensor_to_images(world.vq.decode_code(r.tokens.reshape(1, -1)))[0].numpy()
        got = np.asarray(Image.open(os.path.join(run, row["image_path"])).convert("RGB"))
        assert np.array_equal(got, want), (i, m)
