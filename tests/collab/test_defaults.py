"""Weight-dependent CIAR defaults (ciar.collab.defaults): read from the device file, applied unless overridden."""

import pytest
import torch

from ciar.sim.decoder import CollabDecoder, method_config, shared_knobs
from ciar.collab.defaults import EXTRA_KEY, CIARDefaults
from ciar.collab.device import DeviceModel
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams
from ciar.models.checkpoint import read_model_file, update_extra

D = CIARDefaults(gate="lower", taus={"lower": 2.5, "interval": 1300.0, "entropy": 0.4}, burst=3, span=2,
                 target_rate=0.3)


def test_resolve_fills_only_what_is_unset():
    cfg = method_config("ciar").resolve(D)
    assert (cfg.gate, cfg.tau, cfg.burst, cfg.burst_entropy) == ("lower", 2.5, 3, 0.0)
    cfg = method_config("ciar", tau=9.0, burst=0).resolve(D)
    assert (cfg.gate, cfg.tau, cfg.burst) == ("lower", 9.0, 0)
    cfg = method_config("ciar", gate="interval").resolve(D)  # another gate: its own calibrated threshold
    assert cfg.tau == 1300.0
    assert method_config("entropy").resolve(D).tau == 0.4
    assert method_config("eagle").resolve(D).burst == 0  # baselines run as their papers do
    # the span the thresholds were calibrated with: CIAR and its gate variants take it, the baselines keep theirs
    assert method_config("ciar").resolve(D).span == 2 == method_config("entropy").resolve(D).span
    assert method_config("ciar", span=6).resolve(D).span == 6
    assert method_config("eagle").resolve(D).span == method_config("lantern").resolve(D).span == 4
    assert method_config("ciar", tau=1.0).resolve(None).span == 4  # a file without defaults: the built-in span
    assert CIARDefaults.from_extra({EXTRA_KEY: {"gate": "lower"}}).span == 4  # files written before the field
    with pytest.raises(ValueError, match="pipelines.calibrate"):
        method_config("softmax").resolve(D)  # no calibrated threshold for it
    with pytest.raises(ValueError, match="threshold"):
        method_config("ciar").resolve(None)


def test_shared_knobs_keep_gate_tau_and_burst_where_they_belong():
    knobs = {"tau": 2.0, "gate": "lower", "burst": 2, "span": 4, "prefix_rate": None}
    assert shared_knobs("ciar", knobs) == {"tau": 2.0, "gate": "lower", "burst": 2, "span": 4}
    assert shared_knobs("entropy", knobs) == {"burst": 2, "span": 4}
    assert shared_knobs("eagle", knobs) == {"span": 4}


def test_defaults_validate():
    with pytest.raises(ValueError, match="gate"):
        CIARDefaults(gate="nope")
    with pytest.raises(ValueError, match="burst"):
        CIARDefaults(burst=-1)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="span"):
            CIARDefaults(span=bad)
    with pytest.raises(ValueError, match="span"):
        method_config("ciar", span=0)
    assert CIARDefaults.from_extra({}) is None
    with pytest.raises(ValueError, match="ciar"):
        CIARDefaults.from_extra({EXTRA_KEY: {"bogus": 1}})


def test_device_file_carries_its_defaults_to_the_decoder(tmp_path, tiny_cloud, tiny_device, stub_text):
    path = str(tmp_path / "device.safetensors")
    tiny_device.save(path)
    before = read_model_file(path)[0]
    update_extra(path, {EXTRA_KEY: D.to_dict()})
    after = read_model_file(path)[0]
    assert all(torch.equal(before[k], after[k]) for k in before)  # tensors bit for bit
    dev = DeviceModel.load(path)
    assert dev.ciar_defaults == D
    dec = CollabDecoder(dev, InProcessCloud(CloudVerifier(tiny_cloud, stub_text, max_sessions=1)),
                        method_config("ciar", network="none"), SamplingParams(cfg_scale=2.0),
                        num_tokens=tiny_cloud.config.block_size)
    assert (dec.config.gate, dec.config.tau, dec.config.burst, dec.config.span) == ("lower", 2.5, 3, 2)
    r = dec.generate("a red circle", seed=0)
    assert r.stats.total_tokens == tiny_cloud.config.block_size


def test_cascade_threshold_travels_with_the_defaults():
    from ciar.collab.protocol import RuleConfig

    d = CIARDefaults(gate="lower", taus={"lower": 2.5}, cascade_threshold=0.4,
                     cascade_calibration={"tolerance": 0.01})
    assert CIARDefaults.from_extra({EXTRA_KEY: d.to_dict()}) == d
    assert d.cascade_threshold_or(None) == 0.4  # the calibrated one
    assert d.cascade_threshold_or(0.7) == 0.7  # an explicit value wins
    # a file calibrated before the field: the paper's threshold
    assert CIARDefaults.from_extra({EXTRA_KEY: {"gate": "lower"}}).cascade_threshold_or(None) \
        == RuleConfig().cascade_threshold == 0.9
    for bad in (1.5, -2, True, "0.4", float("nan")):
        with pytest.raises(ValueError, match="cascade_threshold"):
            CIARDefaults(cascade_threshold=bad)
