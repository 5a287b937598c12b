"""`python -m ciar.generate` run in-process against a folder of random weights; `ciar.world` loading."""

import json
import os

import pytest
import torch

from ciar.decoding.sampling import SamplingParams
from ciar.generate import main
from ciar.testing import write_random_world
from ciar.world import FALLBACK_SAMPLING, WEIGHTS_ENV, default_weights_dir, load_default_world

torch.set_num_threads(1)

PROMPT = "a small red circle at the top on a gray background"
SAMPLING = {"cfg_scale": 2.0, "temperature": 1.0, "top_k": 100, "top_p": 1.0}


def write_weights(folder, sampling=SAMPLING, cloud_dtype=torch.float16):
    return write_random_world(str(folder), sampling=sampling, cloud_dtype=cloud_dtype)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_weights(tmp_path_factory.mktemp("weights"))


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m ciar.generate: error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


# ---------------------------------------------------------------------------------------------- world
def test_world_loads_float32_eval_with_sampling_from_metadata(weights):
    world = load_default_world(weights)
    assert world.weights_dir == os.path.abspath(weights)
    assert world.sampling == SamplingParams(**SAMPLING)
    assert all(p.dtype == torch.float32 for p in world.cloud.parameters())  # stored as float16
    assert not world.cloud.training and not world.vq.training
    assert world.text.max_length == world.cloud.config.cls_token_num
    assert world.device == torch.device("cpu")


def test_world_fallback_sampling_env_var_and_missing_files(tmp_path, monkeypatch):
    folder = write_weights(tmp_path / "w", sampling=None)
    monkeypatch.setenv(WEIGHTS_ENV, folder)
    assert default_weights_dir() == os.path.abspath(folder)
    assert load_default_world().sampling == FALLBACK_SAMPLING == SamplingParams(cfg_scale=3.0)
    os.remove(os.path.join(folder, "cloud.safetensors"))
    with pytest.raises(FileNotFoundError, match="cloud.safetensors"):
        load_default_world(folder)
    with pytest.raises(FileNotFoundError, match="tokenizer.safetensors"):
        load_default_world(str(tmp_path))
    monkeypatch.delenv(WEIGHTS_ENV)
    assert default_weights_dir().endswith(os.path.join("weights", "scenes-v2"))
    assert os.path.isabs(default_weights_dir())


def test_world_rejects_bad_sampling_metadata(tmp_path):
    folder = write_weights(tmp_path, sampling={"cfg_scale": 2.0, "beam_width": 4})
    with pytest.raises(ValueError, match="beam_width"):
        load_default_world(folder)


# ---------------------------------------------------------------------------------------------- CLI
def test_png_written_same_seed_same_bytes(weights, tmp_path, capsys):
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "new" / "c.png"  # a missing folder is created
    stats = tmp_path / "a.json"
    code, out, _ = run_cli(capsys, "--prompt", PROMPT, "--method", "cloud", "--seed", "3", "--out", str(a),
                           "--stats", str(stats), "--weights", weights)
    assert code == 0 and "wrote" in out
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(a).size == (48, 48)

    s = json.loads(stats.read_text())
    assert s["method"] == "cloud" and s["prompt"] == PROMPT and s["seed"] == 3
    assert s["num_tokens"] == 144 == len(s["tokens"]) and all(0 <= t < 1024 for t in s["tokens"])
    assert s["wall_time_s"] > 0 and s["tokens_per_s"] > 0 and s["total_time_s"] >= s["wall_time_s"]
    assert s["sampling"] == SAMPLING

    os.environ[WEIGHTS_ENV] = weights  # the env var is honoured as well as --weights
    try:
        assert main(["--prompt", PROMPT, "--seed", "3", "--out", str(b)]) == 0
    finally:
        del os.environ[WEIGHTS_ENV]
    assert a.read_bytes() == b.read_bytes()
    assert main(["--prompt", PROMPT, "--seed", "4", "--out", str(c), "--weights", weights]) == 0
    assert a.read_bytes() != c.read_bytes()


def test_sampling_flags_override_the_defaults(weights, tmp_path, capsys):
    stats = tmp_path / "s.json"
    code, _, _ = run_cli(capsys, "--prompt", PROMPT, "--seed", "0", "--out", str(tmp_path / "g.png"), "--stats",
                         str(stats), "--weights", weights, "--cfg-scale", "1", "--temperature", "0", "--top-k", "5",
                         "--top-p", "0.9")
    assert code == 0
    assert json.loads(stats.read_text())["sampling"] == {"cfg_scale": 1.0, "temperature": 0.0, "top_k": 5,
                                                         "top_p": 0.9}


@pytest.mark.parametrize("argv,needles", [
    (["--prompt", "   "], ["--prompt is empty"]),
    (["--prompt", PROMPT, "--seed", "-1"], ["--seed"]),
    (["--prompt", PROMPT, "--top-p", "1.5"], ["top_p"]),
    (["--prompt", PROMPT, "--temperature", "-1"], ["temperature"]),
    (["--prompt", PROMPT, "--top-k", "-3"], ["top_k"]),
    (["--prompt", PROMPT, "--cfg-scale", "0.5"], ["cfg_scale"]),
    (["--prompt", PROMPT, "--method", "nope"], ["--method", "cloud", "ciar"]),
    (["--prompt", PROMPT, "--method", "ciar"], ["needs a device model", "device.safetensors"]),
    (["--prompt", PROMPT, "--seed", "abc"], ["--seed"]),
    (["--seed", "1"], ["--prompt"]),
    (["--prompt", PROMPT, "--network", "6g"], ["--network", "unknown network '6g'", "5g"]),  # (cloud-only too)
    (["--prompt", PROMPT, "--network", "5g:loss=2"], ["--network", "loss"]),
])
def test_bad_arguments_exit_2_with_one_line(weights, tmp_path, capsys, argv, needles):
    code, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "x.png"), "--weights", weights)
    assert_usage_error(code, err, *needles)
    assert not (tmp_path / "x.png").exists()


def test_too_long_prompt_reports_the_encoder_message(weights, tmp_path, capsys):
    prompt = " and ".join(["a small red circle at the top left"] * 10)
    code, _, err = run_cli(capsys, "--prompt", prompt, "--out", str(tmp_path / "x.png"), "--weights", weights)
    assert_usage_error(code, err, "tokens long", "at most 40")


def test_unwritable_outputs_and_missing_weights(weights, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")  # a folder that cannot be created: its parent is a file
    code, _, err = run_cli(capsys, "--prompt", PROMPT, "--out", str(tmp_path / "a-file" / "x.png"), "--weights",
                           weights)
    assert_usage_error(code, err, "--out", "cannot create folder")
    code, _, err = run_cli(capsys, "--prompt", PROMPT, "--out", str(tmp_path), "--weights", weights)
    assert_usage_error(code, err, "is a directory")
    code, _, err = run_cli(capsys, "--prompt", PROMPT, "--out", str(tmp_path / "x.png"), "--stats",
                           str(tmp_path / "a-file" / "s.json"), "--weights", weights)
    assert_usage_error(code, err, "--stats")
    code, _, err = run_cli(capsys, "--prompt", PROMPT, "--out", str(tmp_path / "x.png"), "--weights",
                           str(tmp_path / "missing"))
    assert_usage_error(code, err, "weights folder not found")
