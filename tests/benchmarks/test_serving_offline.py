"""`benchmarks.serving --offline` runs the verifier core batched vs one at a time on a random world and writes the
documented JSON (no timing thresholds; the Serve mode runs in tests/services and in the results)."""

import json

from benchmarks.serving import main
from ciar.testing import write_random_world


def test_offline_verifier_benchmark_writes_schema(tmp_path):
    weights = write_random_world(str(tmp_path / "world"), sampling={"cfg_scale": 2.0})
    out = tmp_path / "core.json"
    result = main(["--offline", "--compare-gather", "--weights", weights, "--sessions", "3", "--span", "2",
                   "--rounds", "2", "--verifier-threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["mode"] == "offline" and result["setup"]["sessions"] == 3 and result["setup"]["cfg_scale"] == 2.0
    for key in ("batched_spans_per_s", "unbatched_spans_per_s", "batched_gather_spans_per_s", "ratio",
                "runs_vs_gather"):
        assert result[key] > 0, key
    assert result["ratio"] == result["batched_spans_per_s"] / result["unbatched_spans_per_s"]
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
