"""The world description (`ciar.world_spec`) and its loaders (`ciar.world.load_world`, `load_device_side`) on the
shipped scenes world and on RANDOM-weight LlamaGen files in the real layout: every named file is checked before
anything loads, mismatches (vocabulary, grid, device model) are refused naming the field."""

import json
import os

import pytest
import torch

from ciar.testing import write_random_llamagen_files
from ciar.text import PrecomputedCaptions
from ciar.world import load_device_side, load_world
from ciar.world_spec import (LlamaGenWorldSpec, ScenesWorldSpec, WorldSpecError, read_world, spec_dict,
                             world_source)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENES = os.path.join(REPO, "weights", "scenes-v2")


@pytest.fixture(scope="module")
def llamagen(tmp_path_factory):
    """(folder, world dict with paths relative to the folder): tiny LlamaGen GPT + VQ + device model."""
    root = tmp_path_factory.mktemp("llamagen-world")
    cfg = write_random_llamagen_files(str(root), [1, 2])
    world = {"kind": "llamagen", "gpt_checkpoint": cfg["gpt_checkpoint"], "gpt_config": cfg["gpt_config"],
             "gpt_overrides": cfg["gpt_overrides"], "image_size": cfg["image_size"],
             "vq_checkpoint": cfg["vq_checkpoint"], "vq_overrides": cfg["vq_overrides"],
             "device_checkpoint": cfg["device_checkpoint"], "t5_embeddings": cfg["t5_embeddings"],
             "sampling": {"cfg_scale": 2.0, "top_k": 0}}
    return root, world


def write(folder, name, data) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        if name.endswith(".json"):
            json.dump(data, f)
        else:
            import yaml

            yaml.safe_dump(data, f)
    return path


def test_default_is_the_shipped_scenes_world():
    spec = read_world(None)
    assert isinstance(spec, ScenesWorldSpec)
    assert spec_dict(spec) == {"kind": "scenes", "weights": SCENES}
    assert isinstance(read_world(SCENES), ScenesWorldSpec)  # a weights folder is a scenes world
    assert spec_dict(read_world(world_source(None, SCENES)))["weights"] == SCENES


def test_scenes_world_file_with_another_device_model(tmp_path):
    path = write(tmp_path, "w.yaml", {"kind": "scenes", "weights": SCENES, "device_checkpoint": "device_l1.safetensors"})
    world = load_world(path)
    assert world.device_model.device_config.n_layer == 1  # the shipped device.safetensors has 2 layers
    assert world.cloud_file == os.path.join(SCENES, "cloud.safetensors")
    side = load_device_side(path)
    assert side.device_model.device_config.n_layer == 1 and side.num_tokens == 144


def test_llamagen_world_from_a_yaml_file_with_relative_paths(llamagen):
    root, world = llamagen
    path = write(root, "world.yaml", world)
    spec = read_world(path, need_device=True)
    assert isinstance(spec, LlamaGenWorldSpec)
    d = spec_dict(spec)
    assert d["gpt_checkpoint"] == os.path.join(root, world["gpt_checkpoint"]) and "base_dir" not in d
    assert spec_dict(read_world(d)) == d  # the dict the Serve builder hands out reads back (absolute paths)
    w = load_world(path)
    assert isinstance(w.text, PrecomputedCaptions)  # t5_embeddings only: captions come precomputed
    assert w.cloud.config.block_size == 16 and w.vq.config.codebook_size == 64
    assert w.sampling.cfg_scale == 2.0 and w.sampling.top_k == 0 and w.sampling.temperature == 1.0
    assert w.device_model is not None and w.cloud_file == os.path.join(root, world["gpt_checkpoint"])
    side = load_device_side(path)
    assert side.num_tokens == 16 and side.sampling == w.sampling
    code = torch.zeros(1, 16, dtype=torch.long)
    assert side.vq.decode_code(code).shape[-1] == 64  # images at the world's resolution


def test_the_older_flat_model_config_reads_as_a_llamagen_world(llamagen):
    root, world = llamagen
    flat = {k: v for k, v in world.items() if k not in ("kind", "sampling")}
    path = write(root, "models.json", {**flat, "cfg_scale": 3.0, "top_k": 5})
    spec = read_world(path)
    assert isinstance(spec, LlamaGenWorldSpec) and spec.sampling.cfg_scale == 3.0 and spec.sampling.top_k == 5


@pytest.mark.parametrize("field", ["gpt_checkpoint", "vq_checkpoint", "device_checkpoint", "t5_embeddings"])
def test_a_missing_file_is_named_with_its_field(llamagen, tmp_path, field):
    root, world = llamagen
    path = write(tmp_path, "w.json", {**world, field: "nope/missing.pt", "base_dir": str(root)})
    with pytest.raises(WorldSpecError, match=rf"{field}: (file|folder) not found: .*missing\.pt"):
        read_world(path)


def test_bad_fields_are_refused_with_their_names(llamagen, tmp_path):
    root, world = llamagen
    with pytest.raises(WorldSpecError, match="bogus: Extra inputs are not permitted"):
        read_world({**world, "bogus": 1, "base_dir": str(root)})
    with pytest.raises(WorldSpecError, match="gpt_config: .*unknown GPT config 'GPT-Q'"):
        read_world({**world, "gpt_config": "GPT-Q", "base_dir": str(root)})
    with pytest.raises(WorldSpecError, match="text_dtype"):
        read_world({**world, "text_dtype": "int8", "base_dir": str(root)})
    with pytest.raises(WorldSpecError, match="world file not found"):
        read_world(str(tmp_path / "absent.yaml"))
    (tmp_path / "broken.yaml").write_text("kind: [llamagen\n")
    with pytest.raises(WorldSpecError, match="not valid YAML"):
        read_world(str(tmp_path / "broken.yaml"))
    with pytest.raises(WorldSpecError, match="not both"):
        world_source("w.yaml", "weights/")


def test_device_and_text_requirements_are_checked_up_front(llamagen):
    root, world = llamagen
    no_device = {k: v for k, v in world.items() if k != "device_checkpoint"}
    read_world({**no_device, "base_dir": str(root)})  # cloud-only is fine
    with pytest.raises(WorldSpecError, match="device_checkpoint: this needs a device model"):
        read_world({**no_device, "base_dir": str(root)}, need_device=True)
    with pytest.raises(WorldSpecError, match="text_encoder: encoding new captions needs a local T5 folder"):
        read_world({**world, "base_dir": str(root)}, need_text=True)


def test_mismatched_vocabulary_grid_and_device_model_are_refused(llamagen, tmp_path):
    root, world = llamagen
    base = {**world, "base_dir": str(root)}
    # the tokenizer at another resolution: its 8x8 grid cannot carry the GPT's 16 tokens
    with pytest.raises(WorldSpecError, match=r"vq_checkpoint: the tokenizer's 8x8 grid at 128px does not fit the "
                                             r"GPT's 16 image tokens"):
        load_world({**base, "vq_overrides": {**world["vq_overrides"], "image_size": 128}})
    # a GPT with another vocabulary than the tokenizer's codebook
    from ciar.models.gpt import build_gpt
    from ciar.testing import LLAMAGEN_SMALL_GPT

    gpt = build_gpt("GPT-B", block_size=16, **{**LLAMAGEN_SMALL_GPT, "vocab_size": 96})
    torch.save({"model": gpt.state_dict()}, tmp_path / "t2i_v96.pt")
    with pytest.raises(WorldSpecError, match="vq_checkpoint: the tokenizer has 64 codes but the GPT predicts 96"):
        load_world({**base, "gpt_checkpoint": str(tmp_path / "t2i_v96.pt"),
                    "gpt_overrides": {**world["gpt_overrides"], "vocab_size": 96}})
    # the shipped scenes device model does not fit a LlamaGen GPT
    with pytest.raises(WorldSpecError, match="device_checkpoint: .*does not fit the GPT"):
        load_world({**base, "device_checkpoint": os.path.join(SCENES, "device.safetensors")})
