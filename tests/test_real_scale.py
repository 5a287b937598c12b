"""benchmarks.real_scale on tiny shapes: the files in LlamaGen's layout load as a world, every figure is measured,
both images are made through ciar.generate in their own processes and through the Serve application, and
benchmarks.collab runs on 4 prompts."""

import json

import pytest

from benchmarks.real_scale import main


@pytest.mark.cluster  # its Serve step starts a Ray instance (tests/conftest.py)
@pytest.mark.timeout(600)
def test_real_scale_pipeline_on_tiny_shapes(tmp_path):
    out, results = tmp_path / "files", tmp_path / "real_scale.json"
    assert main(["--out", str(out), "--results", str(results), "--sizes", "tiny", "--reps", "1"]) == 0
    r = json.loads(results.read_text())
    m = r["measure"]
    assert m["load_s"] > 0 and m["peak_rss_mb"] >= m["peak_rss_after_load_mb"] > 0
    assert m["t5"]["dtype"] == "torch.bfloat16" and m["t5"]["positions"] == 32
    assert set(m["verifier_forward_s"]["by_rows"]) == {"1", "8", "32"} and m["device_step_s"] > 0
    assert m["kv_cache_mb_per_session"] > 0 and r["gpu_config_max_sessions"] == "auto"
    assert {k: v["rc"] for k, v in r["images"].items()} == {"cloud": 0, "ciar": 0}, r["images"]
    assert r["images"]["ciar"]["peak_rss_mb"] > 0 and not r["broke"], r["broke"]
    serve = r["serve"]  # the Serve application served both images
    assert serve["cloud"]["status"] == serve["ciar"]["status"] == 200 and serve["ciar"]["stats"]["total_tokens"] == 16
    assert serve["replica_peak_rss_mb"].get("Verifier", 0) > 0
    assert r["collab"]["rc"] == 0 and json.loads(open(r["collab"]["results"]).read())
    assert not out.exists()  # the files are removed unless --keep
    md = (tmp_path / "real_scale.md").read_text()
    assert "| T5 encode, one caption |" in md and "Serve application, one image, ciar" in md


@pytest.mark.timeout(600)
def test_real_scale_at_stage2s_token_count_on_tiny_widths(tmp_path):
    """`--sizes tiny-1024`: Stage II's 32 x 32 = 1,024 image tokens (512 px) on tiny widths: the checkpoint under
    Stage II's name loads, the late forward sits near the end of the image, the scheduler figures are those of
    1,024 tokens, and both images are made through ciar.generate."""
    out, results = tmp_path / "files", tmp_path / "real_scale.json"
    assert main(["--out", str(out), "--results", str(results), "--sizes", "tiny-1024", "--reps", "1",
                 "--rows", "1,8", "--steps", "measure,images", "--keep"]) == 0
    r = json.loads(results.read_text())
    assert (out / "t2i_XL_stage2_512.pt").exists() and not r["broke"], r["broke"]
    m = r["measure"]
    assert (m["gpt"]["image_tokens"], m["gpt"]["grid"], m["gpt"]["image_size"]) == (1024, 32, 512)
    assert m["verifier_forward_late_s"]["context"] == 32 + 896 and set(m["verifier_forward_s"]["by_rows"]) == {"1", "8"}
    assert m["kv_cache_positions"] == 32 + 1024 + 16 and m["vq_decode_s"] > 0
    sched = r["scheduler"]
    assert sched["image_tokens"] == 1024 and sched["default"]["alone"]["resume"]["positions"] == 32 + 1023
    assert {k: (v["rc"], v["stats"]["num_tokens"]) for k, v in r["images"].items()} == {"cloud": (0, 1024),
                                                                                        "ciar": (0, 1024)}
    assert "at position 928" in (tmp_path / "real_scale.md").read_text()


def test_a_bfloat16_gpt_world_generates(tmp_path):
    """`gpt_dtype: bfloat16`: the cloud GPT and its KV cache in bfloat16 on the verifier, cloud-only and CIAR."""
    import torch

    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.testing import LLAMAGEN_SMALL_GPT, make_tiny_t5, write_random_llamagen_files
    from ciar.world import load_world, load_world_cloud

    cfg = write_random_llamagen_files(str(tmp_path), [1])
    keep = ("gpt_checkpoint", "gpt_config", "gpt_overrides", "image_size", "vq_checkpoint", "vq_overrides",
            "device_checkpoint")
    spec = {"kind": "llamagen", "base_dir": str(tmp_path), "gpt_dtype": "bfloat16", "sampling": {"cfg_scale": 2.0},
            "text_encoder": make_tiny_t5(str(tmp_path / "t5"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"]),
            **{k: cfg[k] for k in keep}}
    world = load_world(spec)
    assert world.cloud.tok_embeddings.weight.dtype == torch.bfloat16
    assert world.device_model.gpt.tok_embeddings.weight.dtype == torch.float32  # the phone's model is not changed
    assert load_world_cloud(spec)[0].output.weight.dtype == torch.bfloat16
    verifier = make_verifier(world, max_sessions=2)
    assert verifier.cache.k[0].dtype == torch.bfloat16
    for method, knobs in (("cloud", {}), ("ciar", {"tau": 0.05, "span": 4})):
        r = make_decoder(world, verifier, method, network="none", **knobs).generate("A red bus on a street.", seed=1)
        assert r.tokens.shape == (16,) and int(r.tokens.max()) < 64


@pytest.mark.timeout(300)
def test_real_scale_measures_an_anole_world_on_tiny_shapes(tmp_path):
    """`--sizes anole-tiny`: an Anole world's files written shard by shard in the transformers layout (as `anole-7b`
    writes Anole-7b's 14 GB) load as a world, and the measure step times it: load, the forwards at 1 / 8 rows at
    mid-image and 7/8, the sampled step, the VQ decode, the device step, KV bytes. Other steps are refused."""
    out, results = tmp_path / "files", tmp_path / "real_scale.json"
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--results", str(results), "--sizes", "anole-tiny", "--steps", "measure,images"])
    assert main(["--out", str(out), "--results", str(results), "--sizes", "anole-tiny", "--reps", "1", "--keep"]) == 0
    r = json.loads(results.read_text())
    assert not r["broke"], r["broke"]
    assert r["gpt_dtype"] == "bfloat16" and r["threads"] == 1
    hf = out / "anole-hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert r["write"]["decoder_shards"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(r["write"]["decoder_shards"])
    assert any(k.startswith("model.vqmodel.") for k in index["weight_map"])  # as transformers saves it
    m = r["measure"]
    assert m["gpt"]["arch"] == "chameleon" and m["gpt"]["dtype"] == "torch.bfloat16"
    assert (m["gpt"]["image_tokens"], m["gpt"]["caption_positions"], m["gpt"]["image_size"]) == (16, 40, 32)
    assert m["load_s"] > 0 and m["peak_rss_mb"] >= m["peak_rss_after_load_mb"] > 0
    assert set(m["verifier_forward_s"]["by_rows"]) == {"1", "8"} == set(m["verifier_forward_late_s"]["by_rows"])
    assert (m["verifier_forward_s"]["context"], m["verifier_forward_late_s"]["context"]) == (40 + 8, 40 + 14)
    assert set(m["cloud_decode_step_s"]) == {"48", "54"} and m["vq_decode_s"] > 0 and m["device_step_s"] > 0
    assert m["dropped_before_forwards"] == ["device_model", "vq"] and m["device"]["layers"] == 1
    # 2 rows x 2 layers x (keys + values) x (40 + 16 + 16 positions) x 2 KV heads x 16 wide, bfloat16
    assert m["kv_cache_positions"] == 72
    assert m["kv_cache_mb_per_session"] == round(2 * 2 * 2 * 72 * 2 * 16 * 2 / 2**20, 1)
    assert r["scheduler"]["image_tokens"] == 16 and r["scheduler"]["caption_positions"] == 40
    md = (tmp_path / "real_scale.md").read_text()
    assert "# Anole (anole-tiny)" in md and "| prompt tokenized, one caption |" in md and "at position 54" in md
