"""GenerationStats arithmetic and the network model."""

import math

import pytest

from ciar.sim.network import PROFILES, NetworkModel, get_profile
from ciar.collab.protocol import feature_bytes, token_bytes
from ciar.collab.stats import GenerationStats


def test_derived_figures_and_sum():
    a = GenerationStats(total_tokens=144, prefix_tokens=9, cloud_tokens=40, device_tokens=104, drafted=32,
                        accepted=20, verifications=8, cloud_requests=9, cloud_forward_passes=17,
                        device_s=0.5, cloud_s=1.0, comm_s=0.25, images=1)
    assert a.cloud_call_rate == pytest.approx(40 / 144)
    assert a.steps_compression == pytest.approx(144 / 17)
    assert a.acceptance_rate == pytest.approx(20 / 32)
    assert a.mean_accepted_length == pytest.approx(1 + 20 / 8)
    assert a.total_s == pytest.approx(1.75)
    b = sum([a, a], GenerationStats())
    assert b.total_tokens == 288 and b.images == 2 and b.cloud_call_rate == a.cloud_call_rate
    assert sum([a, a]).total_tokens == 288  # sum() without a start value works too


def test_to_dict_is_json_safe():
    d = GenerationStats().to_dict()
    assert d["acceptance_rate"] is None and d["cloud_call_rate"] is None and d["total_tokens"] == 0
    assert GenerationStats.from_dict(GenerationStats(total_tokens=3).to_dict()).total_tokens == 3


def test_payload_encodings():
    assert token_bytes(8, 1024) == 10  # 10 bits each
    assert token_bytes(1, 16384) == 2 and token_bytes(0, 1024) == 0
    assert feature_bytes(3, 20) == 120


def test_network_formula_matches_paper():
    net = NetworkModel("5g", seed=0)
    t = net.round_trip(up_bytes=375_000, down_bytes=0)  # 3 Mbit at 300 Mbps = 10 ms
    assert t.uplink_s == pytest.approx(0.010 + 0.010)
    assert t.downlink_s == pytest.approx(0.010)
    assert NetworkModel("none").round_trip(10 ** 9, 10 ** 9).total_s == 0.0
    assert PROFILES["4g"].bandwidth_mbps == 20 and PROFILES["wifi"].rtt_ms == 20


def test_jitter_and_loss_are_seeded_and_only_add_time():
    prof = get_profile("4g:jitter_ms=5,loss=0.2")
    assert prof.jitter_ms == 5 and prof.loss == 0.2
    a = [NetworkModel(prof, seed=3).round_trip(100, 100).total_s for _ in range(2)]
    assert a[0] == a[1]
    runs = [NetworkModel(prof, seed=s).round_trip(100, 100) for s in range(200)]
    base = NetworkModel("4g").round_trip(100, 100).total_s
    assert all(r.total_s >= base - 1e-12 for r in runs)
    assert sum(r.retransmissions for r in runs) > 0  # loss 0.2 over 400 transmissions
    assert max(r.total_s for r in runs) > base + prof.timeout_s - 1e-9


@pytest.mark.parametrize("spec", ["6g", "5g:speed=3", "5g:loss=1.5", "4g:jitter_ms=abc", "5g:loss"])
def test_bad_profiles(spec):
    with pytest.raises(ValueError):
        get_profile(spec)


def test_timeout_default():
    assert get_profile("4g").timeout_s == pytest.approx(0.15)
    assert math.isclose(get_profile("none").timeout_s, 0.010)


def test_the_methods_table_has_a_paper_profile_column_only_where_a_row_simulates_one():
    """`pipelines.evaluate` measures and does not simulate: its table had a paper-profile column of "x–" cells."""
    from ciar.collab.stats import methods_markdown

    row = {"fidelity": 0.76, "fid": 2.3, "speedup": 1.0, "steps_compression": 1.0, "cloud_call_rate": 1.0,
           "cloud_requests": 1.0, "acceptance_rate": None, "latency_s": {"device": 0.0, "cloud": 0.7, "comm": 0.02}}
    measured = methods_markdown({"cloud": row, "ciar": {**row, "speedup": 1.44}}, "t").splitlines()
    assert "paper profile" not in measured[1] and "x–" not in "".join(measured)
    assert measured[1].count("|") == measured[2].count("|") == measured[4].count("|") == 12
    assert measured[4].startswith("| ciar | 0.7600 | 2.300 | x1.44 | x1.00 | 100.00% |")
    simulated = methods_markdown({"cloud": {**row, "speedup_paper_profile": 1.0},
                                  "ciar": {**row, "speedup_paper_profile": 3.2}}, "t").splitlines()
    assert "| Speedup | Speedup, paper profile (sim.) | Steps |" in simulated[1]
    assert simulated[4].startswith("| ciar | 0.7600 | 2.300 | x1.00 | x3.20 | x1.00 |")
