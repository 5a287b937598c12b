"""benchmarks.frontier: its lines, the assembly of the frontier and the equal-fidelity answer, on tiny inputs."""

import pytest

from benchmarks import frontier as F
from ciar.collab.defaults import CIARDefaults
from ciar.collab.protocol import RuleConfig


def _row(fidelity, speedup, paper, rate=0.3, fid=2.0):
    return {"fidelity": fidelity, "fid": fid, "speedup": speedup, "speedup_paper_profile": paper,
            "cloud_call_rate": rate, "acceptance_rate": 0.5}


def test_lines_and_their_overrides():
    d = CIARDefaults(gate="lower", taus={"lower": 10.0, "entropy": 0.5}, cascade_threshold=0.45)
    lines = F.default_lines(d)
    assert lines["ciar"].values == tuple(10.0 * s for s in F.TAU_SCALES) and lines["entropy"].values[1] == 0.5
    assert 0.45 in lines["cascade"].values and set(F.CASCADE_THRESHOLDS) < set(lines["cascade"].values)
    assert "ciar" not in F.default_lines(None)  # no calibrated tau to centre CIAR's line on
    ov = lines["cascade"].overrides(0.3, {"network": "5g"})
    assert ov == {"network": "5g", "rule": RuleConfig(rule="cascade", cascade_threshold=0.3)}
    ov = lines["lantern"].overrides(0.05, {})
    assert ov["rule"] == RuleConfig(rule="lantern", lantern_delta=0.05)
    assert lines["code"].overrides(0.45, {"network": "4g"}) == {"network": "4g", "prefix_rate": 0.45}
    assert lines["cascade"].point_name(0.3) == "cascade cascade_threshold=0.3"


def test_an_extra_line_from_the_command_line():
    line = F.parse_line("adaptive ciar=ciar:tau=6,7.5:burst=0:policy=adaptive")
    assert (line.label, line.method, line.knob, line.values) == ("adaptive ciar", "ciar", "tau", (6.0, 7.5))
    assert line.fixed == {"burst": 0, "policy": "adaptive"}  # a knob the decoder does not have yet passes through
    assert isinstance(line.values[0], float) and isinstance(line.fixed["burst"], int)
    assert F.parse_line("l=lantern:rule.lantern_k=10,20").values == (10, 20)
    for bad in ("noequals", "x=nope:tau=1", "x=ciar", "x=ciar:tau"):
        with pytest.raises(ValueError):
            F.parse_line(bad)


def test_assemble_and_the_answer_at_equal_fidelity(tmp_path):
    rows = {"cloud": _row(0.80, 1.0, 1.0, rate=1.0),
            "ciar tau=1": _row(0.805, 1.05, 3.2), "ciar tau=2": _row(0.795, 1.3, 3.6),
            "ciar tau=3": _row(0.75, 1.6, 4),
            "code prefix_rate=0.3": _row(0.77, 2.0, 3.3), "code prefix_rate=0.8": _row(0.80, 1.1, 1.2),
            "lantern lantern_delta=0.15": _row(0.70, 0.4, 2.0)}
    points = {"ciar tau=1": ("ciar", "tau", 1.0), "ciar tau=2": ("ciar", "tau", 2.0),
              "ciar tau=3": ("ciar", "tau", 3.0),
              "code prefix_rate=0.3": ("code", "prefix_rate", 0.3), "code prefix_rate=0.8": ("code", "prefix_rate", 0.8),
              "lantern lantern_delta=0.15": ("lantern", "rule.lantern_delta", 0.15)}
    lines = F.assemble(rows, points)
    assert list(lines) == ["cloud", "ciar", "code", "lantern"] and [p["value"] for p in lines["ciar"]] == [1, 2, 3]
    answer = F.equal_fidelity(lines, tolerance=0.01)
    assert answer["fidelity_floor"] == pytest.approx(0.79)
    measured, paper = answer["speedup"], answer["speedup_paper_profile"]
    assert measured["per_line"]["ciar"]["name"] == "ciar tau=2"  # tau=3 is faster but 5 points lower
    assert measured["per_line"]["code"]["name"] == "code prefix_rate=0.8" and measured["per_line"]["lantern"] is None
    assert measured["fastest"] == "ciar" and paper["fastest"] == "ciar"
    assert F.equal_fidelity(lines, tolerance=0.04)["speedup"]["fastest"] == "code"
    md = F.frontier_markdown(lines, answer, "t")
    assert "| ciar | tau | 2 | 0.7950 |" in md and "none within the tolerance" in md and "**ciar**" in md
    F.plot(lines, str(tmp_path / "f.png"), "t")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_paired_fidelity_interval():
    """Paired over the prompts: the same images give 0 with an empty interval; a method right on one more check in
    every image of 200 (4 checks each) is +25 points with an interval away from 0; one extra check on a single image
    of 200 is within the prompts' noise (the interval holds 0)."""
    import numpy as np

    from benchmarks.collab import paired_fidelity_ci

    made = np.full(200, 4)
    base = (np.full(200, 2), made)
    assert paired_fidelity_ci(base, base) == {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    better = paired_fidelity_ci(base, (np.full(200, 3), made))
    assert better["diff"] == 0.25 and better["lo"] == better["hi"] == 0.25
    rng = np.random.default_rng(0)
    noisy = rng.integers(0, 5, 200)
    one = noisy.copy()
    one[0] = min(4, one[0] + 1) if one[0] < 4 else 3
    ci = paired_fidelity_ci((noisy, made), (one, made))
    assert ci["lo"] <= 0.0 <= ci["hi"] and abs(ci["diff"]) == pytest.approx(1 / 800)
    wide = paired_fidelity_ci((noisy, made), (rng.integers(0, 5, 200), made))
    assert wide["lo"] < wide["diff"] < wide["hi"] and wide["hi"] - wide["lo"] > 0.05
    with pytest.raises(ValueError):
        paired_fidelity_ci(base, (np.full(10, 2), np.full(10, 4)))
