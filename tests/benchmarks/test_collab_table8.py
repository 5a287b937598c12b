"""benchmarks.collab --table 8 on the shipped world, two prompts, one regime: cloud-only, fixed and adaptive CIAR on
every link, each row priced against cloud-only on its own link."""

import json

from benchmarks.collab import main


def test_table8_grid_runs_and_prices_each_cell_against_its_own_cloud_only(tmp_path):
    out = tmp_path / "t8.json"
    assert main(["--table", "8", "--num-prompts", "2", "--costs", "measured", "--loads", "saturated",
                 "--saturation", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["table8_regimes"]) == ["measured saturated"]
    assert r["table8_regimes"]["measured saturated"]["cloud_factor"] == 4.0
    rows = r["methods"]
    for net in ("5g", "wifi", "4g"):
        cell = {label: rows[f"{label} | {net} | measured saturated"] for label in ("cloud", "ciar", "ciar adaptive")}
        assert cell["cloud"]["speedup"] == 1.0 and cell["cloud"]["cloud_call_rate"] == 1.0
        for row in cell.values():
            assert row["speedup"] == cell["cloud"]["seconds_per_image"] / row["seconds_per_image"]
        assert r["configs"][f"ciar | {net} | measured saturated"]["policy"] == "fixed"
        assert r["configs"][f"ciar adaptive | {net} | measured saturated"]["policy"] == "adaptive"
        assert r["configs"][f"ciar adaptive | {net} | measured saturated"]["cloud_slowdown"] == 4.0
    assert "| 4g | measured | saturated | ciar adaptive |" in (tmp_path / "t8.md").read_text()
