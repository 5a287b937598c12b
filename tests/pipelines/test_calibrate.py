"""pipelines.calibrate: thresholds found by real generations on val prompts, written into the device file."""

import shutil

import pytest
import torch

from ciar.collab.decoder import method_config
from ciar.collab.device import DeviceModel
from ciar.models.checkpoint import read_model_file
from pipelines import calibrate


def test_calibrate_writes_the_device_defaults(tmp_path, shipped_world_copy):
    from ciar.world import DEFAULT_WEIGHTS_DIR

    world = tmp_path / "w"
    shutil.copytree(shipped_world_copy, world)
    dev_path = world / "device.safetensors"
    shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/device.safetensors", dev_path)
    before = read_model_file(str(dev_path))[0]
    assert calibrate.main([str(dev_path), "--gate", "lower", "--gates", "lower", "--target-rate", "0.5",
                           "--burst", "2", "--prompts", "1"]) == 0
    after = read_model_file(str(dev_path))[0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    d = DeviceModel.load(str(dev_path)).ciar_defaults
    assert d.gate == "lower" and d.burst == 2 and d.target_rate == 0.5 and set(d.taus) == {"lower"}
    assert d.span == 2 == DeviceModel.load(f"{DEFAULT_WEIGHTS_DIR}/device.safetensors").ciar_defaults.span  # kept
    rate = d.calibration["measured_rates"]["lower"]
    assert abs(rate - 0.5) < 0.1
    cfg = method_config("ciar").resolve(d)
    assert cfg.tau == d.taus["lower"] and cfg.burst == 2


def test_calibrate_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        calibrate.main([str(tmp_path / "missing.safetensors")])
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate.main([str(tmp_path / "x"), "--gates", "nope"])
    assert "unknown gates" in capsys.readouterr().err
