"""An Anole (Chameleon) world end to end, on RANDOM-weight files in the real layouts (`ciar.testing.
write_random_anole_files`): a transformers folder saved from a tiny `ChameleonForConditionalGeneration` (config.json
with a 64-code IMGIMG vocabulary map, model.safetensors, a BPE tokenizer.json built with `tokenizers`), a tiny taming
VQGAN checkpoint + yaml and a CIAR device model made from the decoder. The world file, its checks, the prompt encoder
(token ids), the verifier's caption path (ids in, the prompt's embeddings out to the device), the device trunk, the
CLI (cloud-only and CIAR), the trainers, the calibration and the ONNX export with a device loop on onnxruntime."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import yaml

from ciar.testing import ANOLE_TINY, write_coco_captions, write_random_anole_files
from ciar.text import CaptionTooLongError
from ciar.world import load_world
from ciar.world_spec import AnoleWorldSpec, WorldSpecError, read_world

torch.set_num_threads(1)
pytest.importorskip("transformers")

CAPTIONS = ["A red bus parked on a city street.", "Two dogs play with a frisbee in the park.",
            "A plate of pasta next to a glass of wine.", "A man rides a surfboard on a large wave."]
N_TOKENS = 16  # 32 px / 8 -> 4 x 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("anole")
    fields = write_random_anole_files(str(root))
    (root / "tiny-anole.yaml").write_text(yaml.safe_dump(fields))
    return {"root": root, "fields": fields, "world": str(root / "tiny-anole.yaml"),
            "train": write_coco_captions(root / "train.json", CAPTIONS),
            "val": write_coco_captions(root / "val.json", CAPTIONS[:2], 50)}


@pytest.fixture(scope="module")
def world(files):
    return load_world(files["world"], need_device=True, need_text=True)


def edited(files, tmp_path, **changes):
    d = {**files["fields"], "base_dir": str(files["root"]), **changes}
    return {k: v for k, v in d.items() if v is not None}


# ---------------------------------------------------------------------------------------------------- the world
def test_the_world_loads_in_its_real_layout(files, world):
    from ciar.collab.device import DeviceModel
    from ciar.models.chameleon import ChameleonGPT, ChameleonTrunk
    from ciar.models.chameleon_vq import ChameleonVQModel
    from ciar.text import ChameleonPromptEncoder

    assert isinstance(world.cloud, ChameleonGPT) and isinstance(world.vq, ChameleonVQModel)
    assert isinstance(world.text, ChameleonPromptEncoder)
    assert isinstance(world.device_model, DeviceModel) and isinstance(world.device_model.gpt, ChameleonTrunk)
    c = world.cloud.config
    assert (c.vocab_size, c.block_size, c.cls_token_num) == (ANOLE_TINY["n_codes"], N_TOKENS, 24)
    assert world.vq.config.n_embed == c.vocab_size and world.vq.config.grid_size ** 2 == c.block_size
    s = world.sampling  # Anole's defaults: no sampling in the file
    assert (s.cfg_scale, s.temperature, s.top_k, s.top_p) == (3.0, 0.7, 0, 0.9)
    assert world.cloud_file.endswith("model.safetensors")
    spec = read_world(files["world"])
    assert isinstance(spec, AnoleWorldSpec) and spec.gpt_cfg() == c
    assert read_world({**files["fields"], "base_dir": str(files["root"]), "sampling": {"cfg_scale": 5.0}}) \
        .sampling.cfg_scale == 5.0


def test_the_shipped_world_file_parses():
    # the mounted-volume layout (the Hub layout of worlds/anole-7b.yaml: tests/test_hub.py)
    spec = read_world(os.path.join(os.path.dirname(__file__), "..", "worlds", "mounted", "anole-7b.yaml"),
                      check=False)
    assert isinstance(spec, AnoleWorldSpec)
    assert (spec.image_size, spec.cls_token_num, spec.gpt_dtype) == (512, 128, "bfloat16")
    assert spec.tokenizer_file().endswith("Anole-7b-v0.1-hf/tokenizer.json")


@pytest.mark.parametrize("change, message", [
    ({"model": "nope"}, "model: folder not found"),
    ({"tokenizer": "nope.json"}, "tokenizer: file not found"),
    ({"vq_checkpoint": "nope.ckpt"}, "vq_checkpoint: file not found"),
    ({"vq_yaml": "nope.yaml"}, "vq_yaml: file not found"),
    ({"image_size": 64}, "image_size: 64 px, but the VQGAN .* resolution 32"),
    ({"cls_token_num": 60}, "model: config.json: .*max_position_embeddings"),
    ({"device_checkpoint": None}, "device_checkpoint: this needs a device model"),
])
def test_every_field_is_checked_before_anything_loads(files, tmp_path, change, message):
    with pytest.raises(WorldSpecError, match=message):
        read_world(edited(files, tmp_path, **change), need_device=True)


def test_shapes_that_do_not_fit_are_named(files, tmp_path, world):
    from ciar.collab.device import DeviceConfig, DeviceModel
    from ciar.testing import write_llamagen_checkpoints

    doc = yaml.safe_load(open(files["root"] / "tokenizer" / "vqgan.yaml"))
    doc["model"]["params"]["n_embed"] = 128
    (tmp_path / "vq128.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(WorldSpecError, match="vq_yaml: the VQGAN has 128 codes but the model's vocabulary map has 64"):
        read_world(edited(files, tmp_path, vq_yaml=str(tmp_path / "vq128.yaml")))
    # a device made for 16 prompt positions, and a LlamaGen device
    from ciar.models.chameleon import load_chameleon

    other = load_chameleon(str(files["root"] / "anole-hf"), cls_token_num=16, block_size=N_TOKENS)
    DeviceModel.from_cloud(other, DeviceConfig(n_layer=1)).save(str(tmp_path / "dev16.safetensors"))
    with pytest.raises(WorldSpecError, match="device_checkpoint: .* 16 prompt positions.* 24 prompt positions"):
        read_world(edited(files, tmp_path, device_checkpoint=str(tmp_path / "dev16.safetensors")))
    _, _, llamagen_dev = write_llamagen_checkpoints(str(tmp_path / "lg"), "GPT-B", 16, dict(
        n_layer=1, dim=64, n_head=4, caption_dim=32, cls_token_num=24, vocab_size=64), 64, dict(
        ch=16, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=1, z_channels=16, codebook_size=64))
    with pytest.raises(WorldSpecError, match="device_checkpoint: .* not a CIAR device model for a Chameleon decoder"):
        read_world(edited(files, tmp_path, device_checkpoint=llamagen_dev))


# ---------------------------------------------------------------------------------------------------- prompts
def test_the_prompt_encoder_gives_anoles_condition_ids(world):
    enc, cloud = world.text, world.cloud
    cap = enc.encode(CAPTIONS[:2])
    assert cap.emb.dtype == torch.long and cap.emb.shape == (2, 24) and cap.mask.shape == (2, 24)
    words = [enc.tokenizer.encode(c, add_special_tokens=False).ids for c in CAPTIONS[:2]]
    ids, mask = cloud.prompt_condition(words)
    assert torch.equal(cap.emb, ids) and torch.equal(cap.mask, mask)
    c = cloud.config
    row = cap.emb[0][cap.mask[0]].tolist()
    assert row[0] == c.bos_token_id and row[-2:] == [c.eot_token_id, c.boi_token_id] and row[1:-2] == words[0]
    assert enc.count_tokens(CAPTIONS[0]) == len(row)
    with pytest.raises(CaptionTooLongError, match="the model accepts at most 24"):
        enc.encode(["a red bus " * 10])
    with pytest.raises(ValueError, match="caption 0 is empty"):
        enc.encode(["  "])


# ---------------------------------------------------------------------------------------------------- device trunk
def test_the_device_is_the_decoders_first_layers_in_image_code_space(world, tmp_path):
    """A device of ALL the decoder's layers, made by `from_cloud`, gives the decoder's own logits as its centers on
    both CFG rows: the trunk's blocks, 1-D RoPE, image-code table, prompt embeddings and unconditional row (own
    mask) are the decoder's."""
    from ciar.collab.device import DeviceConfig, DeviceModel, device_caption

    cloud = world.cloud
    dev = DeviceModel.from_cloud(cloud, DeviceConfig(n_layer=cloud.config.n_layer)).eval()
    assert dev.gpt.tok_embeddings.weight.shape == (64, 64) and dev.config.caption_dim == cloud.config.dim
    assert dev.inter_head.vocab_size == 64
    cap = world.text.encode(CAPTIONS[:2])
    tokens = torch.randint(0, 64, (2, N_TOKENS - 1), generator=torch.Generator().manual_seed(0))
    cond, mask, drop = cloud.cfg_condition(cap.emb, cap.mask)
    with torch.no_grad():
        ref, _ = cloud(tokens.repeat(2, 1), cond, mask, drop=drop)
        out = dev(tokens.repeat(2, 1), device_caption(cloud, cap.emb).repeat(2, 1, 1), cap.mask.repeat(2, 1),
                  drop=drop)
    assert (out.center - ref).abs().max() < 1e-4
    # cached: prefill + decode on the trunk give the same as its full forward
    cache = dev.new_cache(4)
    with torch.no_grad():
        first = dev.prefill(cache, device_caption(cloud, cap.emb).repeat(2, 1, 1), cap.mask.repeat(2, 1), drop)
        step = dev.decode(cache, tokens.repeat(2, 1)[:, :3], torch.arange(24, 27))
    assert (first.center - ref[:, 0]).abs().max() < 1e-4 and (step.center - ref[:, 1:4]).abs().max() < 1e-4
    dev.save(str(tmp_path / "d.safetensors"))
    back = DeviceModel.load(str(tmp_path / "d.safetensors"))
    assert back.config == dev.config and torch.equal(back.gpt.cls_embedding.uncond_embedding,
                                                     dev.gpt.cls_embedding.uncond_embedding)


# ---------------------------------------------------------------------------------------------------- verifier
def test_the_runner_moves_ids_without_a_cast_and_marks_the_unconditional_keys(world):
    from ciar.engine.runner import ModelRunner
    from ciar.models.chameleon import unconditional_mask

    runner = ModelRunner(world.cloud, 4)
    cap = world.text.encode(CAPTIONS[:1])
    rows = runner.condition(cap.emb.repeat(2, 1), torch.tensor([False, True]))  # int64 ids in a float32 model
    want = world.cloud.embed_condition(cap.emb.repeat(2, 1), torch.tensor([False, True]))
    assert torch.equal(rows, want)
    runner.mark_caption(0, cap.mask[0])
    runner.mark_caption(1, cap.mask[0], uncond=True)
    cls = world.cloud.config.cls_token_num
    assert torch.equal(runner.cache.key_valid[0, :cls], cap.mask[0])
    assert torch.equal(runner.cache.key_valid[1, :cls], unconditional_mask(1, cls)[0])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_verifier_session_is_the_cloud_only_image(world, static):
    """The verifier's open through the real caption path (prompt -> ids -> cond and unconditional slots with their
    own masks) draws the same tokens as `generate_cloud` with the same seed."""
    from ciar.collab.protocol import OpenRequest
    from ciar.engine.verifier import CloudVerifier
    from ciar.decoding.generate import generate_cloud

    v = CloudVerifier(world.cloud, world.text, max_sessions=2, static=static)
    reply = v.open_batch([OpenRequest("s", CAPTIONS[0], 7, world.sampling, N_TOKENS, want_caption=False)])[0]
    cap = world.text.encode(CAPTIONS[:1])
    ref = generate_cloud(world.cloud, cap.emb, cap.mask, world.sampling, 7)
    assert reply.prefix_tokens.tolist() == ref[0].tolist()
    assert reply.caption_emb is None


def test_the_device_receives_the_prompts_embeddings_over_the_unchanged_wire(world):
    """want_caption: the OPEN_REPLY carries the prompt's embeddings [cls, dim] as float16 (what the device trunk
    conditions on), never the ids as float16; the wire format is the one every world uses."""
    from ciar.collab.device import device_caption
    from ciar.collab.protocol import OpenRequest
    from ciar.engine.verifier import CloudVerifier
    from ciar_device import wire

    v = CloudVerifier(world.cloud, world.text, max_sessions=2)
    reply = v.open_batch([OpenRequest("s", CAPTIONS[1], 3, world.sampling, 2)])[0]
    cap = world.text.encode(CAPTIONS[1:2])
    assert reply.caption_emb.dtype == torch.float16 and reply.caption_emb.shape == (24, world.cloud.config.dim)
    assert torch.equal(reply.caption_emb, device_caption(world.cloud, cap.emb)[0].half())
    assert torch.equal(reply.caption_mask, cap.mask[0])
    frame = wire.decode_frame(wire.encode_frame(wire.Frame(wire.OPEN_REPLY, 1, reply, b"t" * 32)))
    assert np.array_equal(frame.body.caption_emb, reply.caption_emb.numpy())
    assert len(wire.encode_frame(wire.Frame(wire.OPEN_REPLY, 1, reply, b"t" * 32))) == reply.nbytes()


def test_ciar_decoding_verifies_spans_with_the_verifier(world):
    from ciar.sim.runtime import make_decoder, make_verifier

    dec = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", tau=0.0, span=4, burst=0)
    result = dec.generate(CAPTIONS[2], seed=1)
    st = result.stats
    assert result.tokens.shape == (N_TOKENS,) and st.verifications > 0 and st.drafted > 0
    assert 0 <= int(result.tokens.min()) and int(result.tokens.max()) < 64


# ---------------------------------------------------------------------------------------------------- entry points
def test_generate_writes_a_png_cloud_only_and_with_ciar(files, tmp_path):
    from PIL import Image

    from ciar.generate import main

    for method, extra in (("cloud", []), ("ciar", ["--tau", "0.5"])):
        out, stats = tmp_path / f"{method}.png", tmp_path / f"{method}.json"
        assert main(["--world", files["world"], "--prompt", CAPTIONS[0], "--method", method, "--out", str(out),
                     "--stats", str(stats), "--threads", "1", *extra]) == 0
        assert Image.open(out).size == (32, 32)
        st = json.load(open(stats))
        assert st["num_tokens"] == N_TOKENS and st["sampling"]["temperature"] == 0.7
    assert main(["--world", files["world"], "--prompt", "a red bus " * 10, "--out", str(tmp_path / "x.png")]) == 2


def test_distillation_projector_and_calibration_run_on_the_world(files, tmp_path):
    import shutil

    from ciar.collab.device import DeviceModel
    from pipelines.calibrate import main as calibrate
    from pipelines.train_device import main as train_device
    from pipelines.train_projector import main as train_projector

    common = ["--world", files["world"], "--captions", files["train"], "--val-captions", files["val"],
              "--num-train", "4", "--num-val", "2", "--data-dir", str(tmp_path / "data"), "--threads", "1"]
    assert train_device(common + ["--eval-n", "2", "--steps", "2", "--batch-size", "2", "--eval-every", "2",
                                  "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]) == 0
    dev = DeviceModel.load(str(tmp_path / "out" / "device.safetensors"))
    assert dev.extra["trained_steps"] == 2 and "Anole world" in dev.extra["world"]
    ids = np.load(tmp_path / "data" / "train_4_emb.npy", mmap_mode="r")  # the prompts' ids, not float16
    assert ids.dtype == np.int32 and ids.shape == (4, 24) and int(ids.max()) > 2 ** 6
    assert train_projector(common + ["--steps", "2", "--batch-size", "2", "--out", str(tmp_path / "out"),
                                     "--ckpt-dir", str(tmp_path / "pckpt")]) == 0
    assert os.path.isfile(tmp_path / "out" / "projector.safetensors")
    shutil.copy(files["root"] / "device.safetensors", tmp_path / "device.safetensors")
    assert calibrate([str(tmp_path / "device.safetensors"), "--world", files["world"], "--captions", files["val"],
                      "--gates", "lower", "--gate", "lower", "--prompts", "2", "--threads", "1"]) == 0
    assert DeviceModel.load(str(tmp_path / "device.safetensors")).ciar_defaults.taus["lower"] is not None


def test_onnx_export_and_a_device_loop_on_onnxruntime(files, world, tmp_path):
    pytest.importorskip("onnxruntime")
    from ciar.collab.device import TorchRuntime, device_caption
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar_device.runtime import DeviceRuntime, ImageDecoder
    from pipelines.export_onnx import export_onnx

    manifest = export_onnx(files["world"], str(tmp_path / "onnx"))
    assert manifest["vocab_size"] == 64 and manifest["caption_dim"] == 64 and manifest["unconditional_mask"] == "own"
    cap = world.text.encode(CAPTIONS[:1])
    emb, mask = device_caption(world.cloud, cap.emb)[0].half().numpy(), cap.mask[0].numpy()
    ort, ref = DeviceRuntime(str(tmp_path / "onnx")), TorchRuntime(world.device_model)
    for rows in (1, 2):
        diffs = [np.abs(ort.start(emb, mask, rows).center - ref.start(emb, mask, rows).center).max()]
        for toks, start in (([5], 0), ([7, 9, 11], 1), ([3], 4)):
            diffs.append(np.abs(ort.feed(toks, start).center - ref.feed(toks, start).center).max())
        assert max(diffs) < 1e-4
    dec = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", tau=0.0, span=4, runtime=ort)
    result = dec.generate(CAPTIONS[3], seed=2)
    assert result.tokens.shape == (N_TOKENS,) and result.stats.verifications > 0
    image = ImageDecoder(str(tmp_path / "onnx")).decode(result.tokens.numpy())
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8


def test_the_wire_refuses_ids_as_a_caption(world):
    """Token ids never cross the wire as float16 (ids above 2048 would be rounded): an OPEN_REPLY whose caption is
    integer is refused, naming the field."""
    from ciar.collab.protocol import OpenReply
    from ciar_device import wire

    cap = world.text.encode(CAPTIONS[:1])
    for ids in (cap.emb[0], cap.emb[0].numpy()):
        reply = OpenReply("s", torch.zeros(0, dtype=torch.long), ids, cap.mask[0], 0.0, 1, 64)
        with pytest.raises(wire.WireError, match="caption_emb must be float embeddings"):
            wire.encode_frame(wire.Frame(wire.OPEN_REPLY, 1, reply, b"t" * 32))


def test_the_collab_benchmark_runs_on_the_world_and_the_evaluation_reads_it(files, tmp_path):
    """benchmarks.collab takes an Anole world (COCO captions); pipelines.evaluate reads it as an Anole world, never the
    scenes world in its place (it used to: a world that was not LlamaGen's read as 'no world'; the evaluation itself:
    tests/pipelines/test_evaluate_anole.py)."""
    from benchmarks.collab import main as collab
    from pipelines.evaluate import read_model_config

    out = tmp_path / "collab.md"  # (the benchmark takes its prompts after the first two of the file)
    assert collab(["--world", files["world"], "--captions", files["train"], "--num-prompts", "2",
                   "--methods", "cloud,ciar", "--tau", "0.05", "--out", str(out)]) == 0
    table = out.read_text()
    assert "| cloud |" in table and "| ciar |" in table, table[:2000]
    cfg = read_model_config(files["world"], ["cloud", "ciar"])
    assert cfg["kind"] == "anole" and os.path.isabs(cfg["model"])
