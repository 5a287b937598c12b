"""benchmarks.device_client's arithmetic (the run itself needs a cluster: it is run for the results, see its
docstring): means per device and seed, paired differences with their standard error, seed-to-seed noise."""

import math

import pytest

from benchmarks.device_client import markdown, summarize


def _rows(rates, requests):
    return [{"cloud_call_rate": r, "cloud_requests": q, "device_ms_per_token": 1.0, "bytes_up": 100,
             "bytes_down": 50} for r, q in zip(rates, requests)]


def test_summary_arithmetic():
    raw = {"cluster": {0: {"rows": _rows([0.2, 0.4], [8, 10])}, 1: {"rows": _rows([0.3, 0.3], [9, 9])}},
           "client": {0: {"rows": _rows([0.3, 0.4], [9, 12])}, 1: {"rows": _rows([0.3, 0.5], [9, 11])}}}
    fid = {"cluster": {0: 0.8, 1: 0.7}, "client": {0: 0.75, 1: 0.7}}
    s = summarize(raw, [0, 1], fid, ("cluster", "client"))
    assert s["mean"]["cluster"][0]["cloud_call_rate"] == pytest.approx(0.3)
    assert s["mean"]["client"][1]["cloud_requests"] == pytest.approx(10.0)
    d = s["minus_cluster"]["client"][0]["cloud_call_rate"]  # per prompt: +0.1, 0.0
    assert d["mean"] == pytest.approx(0.05) and d["paired_se"] == pytest.approx(math.sqrt(0.005) / math.sqrt(2))
    assert s["minus_cluster"]["client"][0]["cloud_requests"]["mean"] == pytest.approx(1.5)
    assert s["minus_cluster"]["client"][0]["fidelity"]["mean"] == pytest.approx(-0.05)
    assert s["seed_to_seed"]["cluster"]["cloud_call_rate"] == pytest.approx(0.0)
    assert s["seed_to_seed"]["client"]["fidelity"] == pytest.approx(0.05)
    md = markdown(s, [0, 1], 2)
    assert "| client | 1 | 0.400 | 10.00 | 0.700 |" in md and "| client | 0 | +0.050 ± 0.050" in md


def test_wire_table_sets_socket_bytes_beside_the_charged_ones():
    from ciar_device.connection import Exchange

    from benchmarks.device_client import wire_markdown, wire_table

    ex = [Exchange("OPEN", 40, 900, 0.1), Exchange("VERIFY", 300, 30, 0.1), Exchange("VERIFY", 200, 20, 0.1),
          Exchange("CLOSE", 30, 10, 0.1)]
    t = wire_table(ex, {"OPEN": [1, 40, 900], "VERIFY": [2, 500, 50]})
    assert t["VERIFY"] == {"messages": 2, "wire_up": 500, "wire_down": 50, "accounted_messages": 2,
                           "accounted_up": 500, "accounted_down": 50}
    assert t["CLOSE"]["accounted_up"] is None
    assert "| CLOSE | 1 | 30 | not charged | 10 | not charged |" in wire_markdown(t)
