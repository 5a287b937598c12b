"""The knob table (ciar.collab.knobs): one declaration that CollabConfig, a device file's defaults and the service
schemas (tests/services/test_config.py) check against; a request's config is validated once."""

import math
from dataclasses import replace

import pytest

from ciar.sim.decoder import CollabConfig, CollabDecoder, method_config
from ciar.collab.defaults import CIARDefaults
from ciar.collab.knobs import KNOBS, LIVE_KNOBS, REQUEST_KNOBS, SIMULATION_KNOBS, Knob
from ciar.decoding.sampling import SamplingParams


def test_every_knob_is_a_config_field_with_the_tables_default():
    fields = CollabConfig.__dataclass_fields__
    for knob in KNOBS.values():
        assert knob.name in fields and fields[knob.name].default == knob.default, knob.name
        knob.check(knob.default)  # every default is allowed
    assert set(SIMULATION_KNOBS) <= set(REQUEST_KNOBS)
    assert SIMULATION_KNOBS == ("device_slowdown", "link_drop_after")
    assert set(LIVE_KNOBS) == {"tau", "gate", "span", "burst", "prefix_rate", "device_slowdown", "policy",
                               "cloud_step_price_s", "overload_verifier_s", "overload_tau_factor"}


@pytest.mark.parametrize("name, good, bad", [
    ("tau", [0.0, 7.5, 2e6, math.inf], [-0.1, math.nan, "1", True]),
    ("span", [1, 32], [0, 33, 2.0, True, "4"]),
    ("burst", [0, 256, None], [-1, 257, 1.5]),
    ("burst_entropy", [0.0, 1, None], [1.01, -0.01]),
    ("prefix_rate", [0, 0.06, 1.0], [1.5, -0.1, None, math.nan]),
    ("gate", ["lower", "always", "never", None], ["nope", 1]),
    ("device_slowdown", [1.0, 100], [0.5, 101, None]),
    ("cloud_slowdown", [0.1, 50.0], [0.0, -1.0]),
    ("link_drop_after", [0, 100_000, None], [-1, 1.5, 100_001]),
    ("inter_enhance", [True, False], [1, None]),
    ("policy", ["fixed", "adaptive"], ["Adaptive", None, 1]),
    ("cloud_step_price_s", [0.0, 0.05, 60], [-0.01, 61, None, math.nan]),
])
def test_ranges(name, good, bad):
    knob = KNOBS[name]
    for v in good:
        knob.check(v)
        CollabConfig(**{name: v}).validate()
    for v in bad:
        with pytest.raises(ValueError, match=f"^{name} must be {knob.values()[:12]}"):
            knob.check(v)
        with pytest.raises(ValueError, match=name):
            CollabConfig(**{name: v}).validate()


def test_values_in_words():
    assert KNOBS["span"].values() == "an integer in [1, 32]"
    assert KNOBS["tau"].values() == "a number >= 0"
    assert KNOBS["cloud_slowdown"].values() == "a number > 0"
    assert KNOBS["inter_enhance"].values() == "true or false"
    assert KNOBS["gate"].values().startswith("one of interval, lower")


def test_device_defaults_are_checked_with_the_same_knobs():
    for bad in ({"span": 33}, {"burst": 257}, {"burst": None}, {"taus": {"lower": -1.0}}, {"burst_entropy": 2.0}):
        with pytest.raises(ValueError, match="ciar defaults"):
            CIARDefaults(**bad)


def test_a_request_config_is_validated_once(monkeypatch, tiny_device, tiny_cloud):
    """method_config validates; the decoder and `resolve` (filling from checked device defaults) do not again."""
    calls = []
    check = Knob.check
    monkeypatch.setattr(Knob, "check", lambda self, v: (calls.append(self.name), check(self, v))[1])
    cfg = method_config("ciar", tau=0.3, network="none")
    assert len(calls) == len(KNOBS) and cfg.validated
    assert method_config("ciar", tau=0.3, network="none") == cfg  # `==` compares the fields only
    calls.clear()
    dec = CollabDecoder(tiny_device, None, cfg, SamplingParams(), num_tokens=tiny_cloud.config.block_size)
    assert calls == [] and dec.config.validated and (dec.config.gate, dec.config.span) == ("interval", 4)
    resolved = cfg.resolve(CIARDefaults(gate="lower", taus={"lower": 2.0}, span=2))
    assert calls == [] and resolved.validated and (resolved.tau, resolved.span) == (0.3, 2)
    # an unchecked config is checked when the decoder gets it, and a replaced one is unchecked again
    CollabDecoder(tiny_device, None, CollabConfig(tau=0.3), SamplingParams())
    assert len(calls) == len(KNOBS)
    assert not replace(cfg, span=3).validated
    with pytest.raises(ValueError, match="span"):
        CollabDecoder(tiny_device, None, replace(cfg, span=64), SamplingParams())


def test_the_method_rules_live_with_the_knobs():
    """What the HTTP ingress checks before a device runs a job, without the decoder: an unknown method, and
    cloud-only with a prefix rate below 1."""
    import pytest

    from ciar.collab.knobs import check_method_overrides

    check_method_overrides("ciar", {"tau": 0.2})
    check_method_overrides("cloud", {"prefix_rate": 1.0})
    with pytest.raises(ValueError, match="unknown method"):
        check_method_overrides("nope", {})
    with pytest.raises(ValueError, match="prefix_rate must be 1"):
        check_method_overrides("cloud", {"prefix_rate": 0.5})
