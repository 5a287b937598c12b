"""pipelines.calibrate: thresholds found by real generations on val prompts, written into the device file."""

import shutil

import pytest
import torch

from ciar.sim.decoder import method_config
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


def test_choose_cascade_threshold_takes_the_lowest_within_tolerance_from_the_top():
    choose = calibrate.choose_cascade_threshold
    assert choose({0.6: 0.80, 0.5: 0.795, 0.4: 0.78, 0.3: 0.79}, exact=0.80, tolerance=0.01) == 0.5
    # a noisy pass below a failure is not taken
    assert choose({0.6: 0.80, 0.5: 0.70, 0.4: 0.80}, exact=0.80, tolerance=0.01) == 0.6
    assert choose({0.6: 0.75, 0.5: 0.80}, exact=0.80, tolerance=0.01) is None
    assert choose({0.2: 0.81, 0.6: 0.80}, exact=0.80, tolerance=0.0) == 0.2


def test_cascade_calibration_changes_nothing_else(tmp_path, shipped_world_copy):
    from ciar.collab.defaults import EXTRA_KEY, CIARDefaults
    from ciar.models.checkpoint import read_model_metadata
    from ciar.world import DEFAULT_WEIGHTS_DIR

    world = tmp_path / "w"
    shutil.copytree(shipped_world_copy, world)
    for name in ("device.safetensors", "probe.safetensors"):
        shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/{name}", world / name)
    dev_path = str(world / "device.safetensors")
    before_tensors, before = read_model_file(dev_path)[0], read_model_metadata(dev_path)[2]
    assert calibrate.main([dev_path, "--gates", "none", "--cascade", "--cascade-prompts", "1",
                           "--cascade-thresholds", "0.5,-1", "--cascade-tolerance", "1"]) == 0
    after_tensors, after = read_model_file(dev_path)[0], read_model_metadata(dev_path)[2]
    assert all(torch.equal(before_tensors[k], after_tensors[k]) for k in before_tensors)
    new = after[EXTRA_KEY]
    assert new.pop("cascade_threshold") == -1.0  # tolerance 1: every candidate passes, the lowest is chosen
    record = new.pop("cascade_calibration")
    assert set(record["thresholds"]) == {"0.5", "-1"} and "--gates none" in record["command"]
    assert record["exact"]["fidelity"] is not None
    old = {**CIARDefaults().to_dict(), **before[EXTRA_KEY]}  # fields the file did not carry: their defaults
    old.pop("cascade_threshold"), old.pop("cascade_calibration")
    assert new == old and {k: v for k, v in after.items() if k != EXTRA_KEY} == \
        {k: v for k, v in before.items() if k != EXTRA_KEY}  # gate, taus, span, burst, training facts: as they were
    d = DeviceModel.load(dev_path).ciar_defaults
    assert d.cascade_threshold_or(None) == -1.0


def test_gates_none_takes_no_knobs(tmp_path, capsys):
    from ciar.world import DEFAULT_WEIGHTS_DIR

    dev = f"{DEFAULT_WEIGHTS_DIR}/device.safetensors"
    with pytest.raises(SystemExit):
        calibrate.main([dev, "--gates", "none"])
    assert "calibrates nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate.main([dev, "--gates", "none", "--cascade", "--burst", "2"])
    assert "burst" in capsys.readouterr().err


def test_policy_rates_are_measured_and_the_device_starts_from_them(tmp_path, shipped_world_copy):
    from ciar.collab.defaults import EXTRA_KEY, CIARDefaults
    from ciar_device.policy import CostObserver
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.models.checkpoint import read_model_metadata
    from ciar.world import DEFAULT_WEIGHTS_DIR, load_world

    world = tmp_path / "w"
    shutil.copytree(shipped_world_copy, world)
    shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/device.safetensors", world / "device.safetensors")
    dev_path = str(world / "device.safetensors")
    before = read_model_metadata(dev_path)[2][EXTRA_KEY]
    assert calibrate.main([dev_path, "--gates", "none", "--policy-rates", "--policy-prompts", "2"]) == 0
    new = dict(read_model_metadata(dev_path)[2][EXTRA_KEY])
    rates, record = new.pop("policy_rates"), new.pop("policy_calibration")
    assert set(rates) == set(CostObserver.RATES) and all(0.0 < r < 1.0 for r in rates.values())
    assert record["trials"]["verifications"] > 0 and record["point"]["tau"] == before["taus"][before["gate"]]
    before = {**CIARDefaults().to_dict(), **before}  # fields the file did not carry: their defaults
    before.pop("policy_rates"), before.pop("policy_calibration")
    assert new == before  # nothing else moved
    w = load_world(str(world))
    dec = make_decoder(w, make_verifier(w), "ciar")
    dec.generate("a small red circle at the top on a gray background", seed=0)
    fresh = CostObserver(rates=rates)
    assert dec.observers["5g"].escalation.prior == fresh.escalation.prior == rates["escalation_rate"]


def test_a_device_file_of_the_hugging_face_cache_is_refused(tmp_path, capsys):
    """Calibration writes its defaults into the device file: a file of the Hub cache (an hf:// device) is refused
    before anything runs, with what to do instead."""
    import pytest

    from pipelines.calibrate import in_hub_cache, main

    cached = tmp_path / "hub" / "models--org--device" / "snapshots" / ("0" * 40) / "device.safetensors"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not read")
    assert in_hub_cache(str(cached)) and not in_hub_cache(str(tmp_path / "device.safetensors"))
    with pytest.raises(SystemExit) as e:
        main([str(cached)])
    assert e.value.code == 2 and "copy it out first" in capsys.readouterr().err
