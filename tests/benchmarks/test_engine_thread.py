"""benchmarks.engine_thread at --tiny: every way (direct, the engine thread, the engine process) runs the same
sessions through the real engine (forward stubbed) and the report is written; the numbers mean nothing at this
size."""

import json

import torch


def test_the_tiny_engine_thread_benchmark_runs_every_way(tmp_path):
    from benchmarks.engine_thread import main

    assert main(["--tiny", "--out", str(tmp_path), "--reps", "2"]) == 0
    rows = json.load(open(tmp_path / "engine_thread.json"))["rows"]
    assert [r["phones"] for r in rows] == [8]
    for way in ("direct", "threaded", "threaded_switch", "process"):
        x = rows[0][way]
        assert x["steps"] > 0 and x["step_ms"] > 0 and 0 < x["works_per_step"] <= 4 and x["verifies_per_s"] > 0, x
    table = open(tmp_path / "engine_thread.md").read()
    assert "| 8 |" in table
    # medians of an even count are means: rounded like the rest, not 35.986000000000004
    cells = [c.strip(" ×") for line in table.splitlines() if line.startswith("| 8 |") for c in line.split("|")]
    assert all(len(c.partition(".")[2]) <= 3 for c in cells), table
    assert rows[0]["denormals_flushed"]
    assert (torch.tensor([1e-30]) * 1e-10).item() > 0  # ... and this process computes denormals again after it
