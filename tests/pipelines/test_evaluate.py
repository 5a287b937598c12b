"""The Ray Data evaluation for real: a tiny scenes export (8 captions, 2 methods) through every stage, Parquet rows,
summary, report; the summary agrees with the per-sample rows and with `benchmarks.collab` on the same prompts;
re-runs skip finished shards; bad inputs give readable errors."""

import json
import re
import os

import pytest

ray = pytest.importorskip("ray")
pd = pytest.importorskip("pandas")

from pipelines import evaluate  # noqa: E402

TAU = "7024"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from ciar.data import scenes

    root = str(tmp_path_factory.mktemp("export"))
    scenes.export("heldout", 8, 0, root)
    return os.path.join(root, "captions.json")


@pytest.fixture(scope="module")
def run(export, tmp_path_factory, local_ray):
    out = str(tmp_path_factory.mktemp("eval"))
    assert evaluate.main(["--captions", export, "--methods", "cloud,ciar", "--limit", "8", "--out", out,
                          "--param", f"tau={TAU}", "--shard-size", "4"]) == 0
    return out


def test_parquet_summary_report(run):
    shards = sorted(os.listdir(os.path.join(run, "samples")))
    assert shards == ["shard-00000.parquet", "shard-00001.parquet"]
    rows = pd.concat([pd.read_parquet(os.path.join(run, "samples", s)) for s in shards])
    assert len(rows) == 16 and set(rows["method"]) == {"cloud", "ciar"}
    for col in ("caption", "seed", "image_path", "cloud_tokens", "total_tokens", "cloud_requests", "comm_s",
                "fidelity_checks", "fid_features"):
        assert col in rows.columns
    assert all(os.path.isfile(os.path.join(run, p)) for p in rows["image_path"])
    summary = json.load(open(os.path.join(run, "summary.json")))
    for m in ("cloud", "ciar"):
        r = summary["methods"][m]
        s = rows[rows["method"] == m]
        # the summary is the aggregation of the rows
        assert r["cloud_call_rate"] == pytest.approx(s["cloud_tokens"].sum() / s["total_tokens"].sum())
        assert r["cloud_requests"] == pytest.approx(s["cloud_requests"].mean())
        assert r["fidelity"] == pytest.approx(s["fidelity_correct"].sum() / s["fidelity_checks"].sum())
        assert r["latency_s"]["comm"] == pytest.approx(s["comm_s"].mean())
        assert r["fid"] is not None and r["fid"] > 0
    assert summary["methods"]["cloud"]["speedup"] == pytest.approx(1.0)
    assert summary["methods"]["ciar"]["cloud_call_rate"] < 1.0
    report = open(os.path.join(run, "report.md")).read()
    assert "| ciar |" in report and "MapBatches(Generate)" in report
    for plot in ("frontier.png", "latency.png", "grid.png"):
        assert os.path.getsize(os.path.join(run, "plots", plot)) > 1000


def test_agrees_with_collab_benchmark(run, export, tmp_path):
    """Same prompts, seeds and threshold: the deterministic figures are identical, the timings close."""
    from benchmarks import collab

    out = str(tmp_path / "collab.json")
    assert collab.main(["--methods", "cloud,ciar", "--captions", export, "--num-prompts", "8", "--tau", TAU,
                        "--no-inter-enhance-ablation", "--out", out]) == 0
    bench = json.load(open(out))["methods"]
    ours = json.load(open(os.path.join(run, "summary.json")))["methods"]
    for m in ("cloud", "ciar"):
        for key in ("cloud_call_rate", "cloud_requests", "acceptance_rate", "fidelity", "steps_compression"):
            assert ours[m][key] == pytest.approx(bench[m][key]), (m, key)
        assert ours[m]["latency_s"]["comm"] == pytest.approx(bench[m]["latency_s"]["comm"])  # same bytes, seeded link
    assert ours["ciar"]["fid"] == pytest.approx(bench["ciar"]["fid"], rel=1e-3)


def test_rerun_skips_finished_shards(run, export, capsys):
    before = {s: os.path.getmtime(os.path.join(run, "samples", s)) for s in os.listdir(os.path.join(run, "samples"))}
    assert evaluate.main(["--captions", export, "--methods", "cloud,ciar", "--limit", "8", "--out", run,
                          "--param", f"tau={TAU}", "--shard-size", "4"]) == 0
    assert "2 done already" in capsys.readouterr().out
    after = {s: os.path.getmtime(os.path.join(run, "samples", s)) for s in before}
    assert after == before


def test_a_rerun_with_other_settings_is_refused_naming_them(run, export, capsys):
    """A finished shard is only reused by a run with the settings it was made with (OUT/run.json): before, a re-run
    with another threshold or other methods took the old shards as its own."""
    recorded = json.load(open(os.path.join(run, "run.json")))
    assert recorded["methods"] == ["cloud", "ciar"] and recorded["params"] == {"tau": float(TAU)}
    before = {s: os.path.getmtime(os.path.join(run, "samples", s)) for s in os.listdir(os.path.join(run, "samples"))}
    base = ["--captions", export, "--limit", "8", "--out", run, "--shard-size", "4"]
    for other, named in ((["--methods", "cloud,ciar", "--param", "tau=5"], "params"),
                         (["--methods", "cloud", "--param", f"tau={TAU}"], "methods"),
                         (["--methods", "cloud,ciar", "--param", f"tau={TAU}", "--network", "4g"], "network"),
                         (["--methods", "cloud,ciar", "--param", f"tau={TAU}", "--seed", "1"], "seed")):
        assert evaluate.main(base + other) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {run} was made with other settings ({named}: ") and \
            "give another --out" in err, err
    after = {s: os.path.getmtime(os.path.join(run, "samples", s)) for s in before}
    assert after == before and json.load(open(os.path.join(run, "run.json"))) == recorded


@pytest.mark.parametrize("flag,value", [("--limit", "-3"), ("--limit", "0"), ("--shard-size", "0"),
                                        ("--seed", "-1"), ("--batch-size", "0"), ("--generators", "0")])
def test_counts_out_of_range_are_named(flag, value, tmp_path, capsys):
    """(a negative --limit was taken as a slice: every caption but the last N)"""
    with pytest.raises(SystemExit):
        evaluate.main(["--captions", "x.json", "--out", str(tmp_path / "o"), flag, value])
    assert f"{flag} must be >= " in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ('{"images": []}', "MS-COCO captions layout"),
    ('{"images": [{"id": 1}], "annotations": [{"image_id": 2, "caption": "x"}]}', "not in 'images'"),
    ('{"images": [{"id": 1}], "annotations": [{"image_id": 1}]}', "string 'caption'"),
    ('{"images": [], "annotations": []}', "no captions"),
])
def test_malformed_captions_give_a_readable_error(tmp_path, capsys, content, message):
    bad = tmp_path / "captions.json"
    bad.write_text(content)
    assert evaluate.main(["--captions", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_model_config_names_the_missing_file(tmp_path, capsys, export):
    cfg = tmp_path / "models.json"
    cfg.write_text(json.dumps({"gpt_checkpoint": str(tmp_path / "t2i_XL_stage1_256.pt"),
                               "vq_checkpoint": str(tmp_path / "vq_ds16_t2i.pt")}))
    assert evaluate.main(["--captions", export, "--model-config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "gpt_checkpoint" in err and "t2i_XL_stage1_256.pt" in err


def test_bad_params_and_methods():
    with pytest.raises(SystemExit):
        evaluate.main(["--captions", "x.json", "--out", "o", "--methods", "dalle"])
    with pytest.raises(SystemExit, match="bad --param"):
        evaluate.main(["--captions", "x.json", "--out", "o", "--param", "nope=1"])


def test_params_are_parsed_by_their_kind_and_range():
    from pipelines.evaluate import parse_params

    assert parse_params(["gate=lower", "tau=7.5", "span=2", "inter_enhance=false"]) == \
        {"gate": "lower", "tau": 7.5, "span": 2, "inter_enhance": False}  # `--param gate=lower` used to need a number
    for bad, says in (("span=x", "span must be an integer in [1, 32]"), ("gate=nope", "gate must be one of"),
                      ("tau=nan", "tau must be a number >= 0"), ("bogus=1", "bad --param")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            parse_params([bad])
