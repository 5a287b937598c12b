"""benchmarks.parallel on two prompts: every column of the side-by-side table, the Jacobi methods in fewer cloud passes
than cloud-only, and the GPU-priced images/s from the passes and positions."""

import json
import os

import pytest

from benchmarks import parallel


def test_images_per_s_follows_passes_and_width():
    one = parallel.gpu_images_per_s(144, 2 * 144, 144, 0.0)
    assert parallel.gpu_images_per_s(72, 2 * 144, 144, 0.0) > one  # fewer passes, wider: more images
    assert parallel.gpu_images_per_s(144, 2 * 144, 144, 3e-3) < one  # a per-forward overhead costs


def test_a_small_run_writes_the_table(tmp_path):
    out = str(tmp_path / "parallel")
    res = parallel.run(2, ["5g"], 0, out, ("cloud", "sjd", "ciar fixed"))
    rows = res["rows"]
    assert list(rows) == ["cloud", "sjd", "ciar fixed"]
    assert rows["cloud"]["cloud_passes_per_image"] == 144 and rows["cloud"]["cloud_requests_per_image"] == 1
    assert rows["sjd"]["cloud_passes_per_image"] < 144 and rows["sjd"]["step_compression"] > 1
    assert rows["sjd"]["cloud_positions_per_image"] > rows["cloud"]["cloud_positions_per_image"]  # its windows
    assert rows["ciar fixed"]["cloud_requests_per_image"] > 1 and rows["ciar fixed"]["handed_to_cloud"] == 0
    for r in rows.values():
        assert r["speedup"]["5g"] > 0 and r["gpu_images_per_s"] > 0 and r["fidelity"] is not None
    with open(os.path.join(out, "parallel.json")) as f:
        assert json.load(f)["command"].endswith("--variants 'cloud,sjd,ciar fixed'")
    assert "| sjd |" in open(os.path.join(out, "parallel.md")).read()
    with pytest.raises(SystemExit, match="variants"):
        parallel.run(1, ["5g"], 0, out, ("sjd",))
