"""`pipelines.eval_world` for real on the shipped world (a few held-out scenes): the probe reads the rendered
references right, the tokenizer reconstructs them, generation is deterministic, and a sweep reports every grid
point with its accuracy parts and FID; a bad grid is a readable command-line error."""

import json
import math

import pytest

from ciar.world import load_default_world
from pipelines import eval_world

N = 6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_world") / "report.json"
    assert eval_world.main(["--split", "heldout", "--n", str(N), "--batch-size", str(N), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_full_report_on_the_shipped_world(report):
    assert report["split"] == "heldout" and report["n"] == N
    assert report["probe_on_references"]["attribute_accuracy"] >= 0.95  # the instrument reads the ground truth
    tok = report["tokenizer"]
    assert tok["psnr_db"] > 25 and tok["probe_on_reconstructions"]["attribute_accuracy"] >= 0.8
    cloud = report["cloud"]
    assert cloud["deterministic"] is True
    assert 0.0 <= cloud["attribute_accuracy"]["attribute_accuracy"] <= 1.0
    shipped = load_default_world().sampling  # no sampling flags: the shipped file's defaults
    assert (cloud["sampling"]["cfg_scale"], cloud["sampling"]["temperature"]) == (shipped.cfg_scale,
                                                                                    shipped.temperature)
    assert math.isfinite(cloud["fid_vs_references"]) and cloud["fid_vs_references"] >= 0.0
    assert math.isfinite(tok["fid_vs_references"]) and tok["fid_vs_references"] >= 0.0


def test_sweep_reports_every_grid_point(tmp_path):
    out = tmp_path / "sweep.json"
    assert eval_world.main(["--split", "val", "--n", "4", "--batch-size", "4", "--sweep", "--cfg-grid", "1,3",
                            "--temperature-grid", "0.9", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["cfg_scale"], r["temperature"]) for r in rows] == [(1.0, 0.9), (3.0, 0.9)]
    for r in rows:
        parts = {f"{a}_accuracy" for a in ("attribute", "shape", "color", "size", "position")}
        assert parts <= set(r)
        assert r["fid_vs_references"] >= 0.0
    assert rows[0]["fid_vs_references"] != rows[1]["fid_vs_references"]  # different guidance, different images


def test_bad_grid_is_a_readable_error(capsys):
    with pytest.raises(SystemExit) as e:
        eval_world.main(["--sweep", "--cfg-grid", "1,x"])
    assert e.value.code == 2
    assert "comma-separated numbers" in capsys.readouterr().err
