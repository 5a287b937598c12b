"""`pipelines.set_sampling`: new defaults reach `load_default_world`, the tensors and the rest of the metadata stay
as they were, and a bad value or a non-cloud file is a readable error that leaves the file untouched."""

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from ciar.testing import write_random_world
from ciar.world import load_default_world
from pipelines import set_sampling


@pytest.fixture()
def world_dir(tmp_path):
    return write_random_world(str(tmp_path / "w"), sampling={"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0,
                                                             "top_p": 1.0})


def _meta(path):
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata())


def test_sets_defaults_and_keeps_everything_else(world_dir):
    path = f"{world_dir}/cloud.safetensors"
    before, meta_before = load_file(path), _meta(path)
    assert set_sampling.main([path, "--cfg-scale", "1.5", "--chosen-by", "val sweep"]) == 0
    sampling = load_default_world(world_dir).sampling
    assert (sampling.cfg_scale, sampling.temperature, sampling.top_k) == (1.5, 1.0, 0)  # others kept
    after, meta_after = load_file(path), _meta(path)
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and before[k].equal(after[k]) for k in before)
    assert meta_after["kind"] == meta_before["kind"] and meta_after["config"] == meta_before["config"]
    assert json.loads(meta_after["extra"])["sampling_chosen_by"] == "val sweep"
    assert set_sampling.main([path, "--temperature", "0.9"]) == 0  # a new setting without a note drops the old one
    extra = json.loads(_meta(path)["extra"])
    assert extra["sampling"]["temperature"] == 0.9 and "sampling_chosen_by" not in extra


@pytest.mark.parametrize("args, message", [
    (["--cfg-scale", "0.5"], "cfg_scale must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    ([], "nothing to set"),
])
def test_bad_value_is_an_error_and_the_file_is_unchanged(world_dir, args, message, capsys):
    path = f"{world_dir}/cloud.safetensors"
    raw = open(path, "rb").read()
    with pytest.raises(SystemExit) as e:
        set_sampling.main([path, *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert open(path, "rb").read() == raw


def test_not_a_cloud_file(world_dir, capsys):
    with pytest.raises(SystemExit):
        set_sampling.main([f"{world_dir}/tokenizer.safetensors", "--cfg-scale", "2"])
    assert "expected a cloud ('gpt') weight file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        set_sampling.main([f"{world_dir}/missing.safetensors", "--cfg-scale", "2"])
    assert "not found" in capsys.readouterr().err
