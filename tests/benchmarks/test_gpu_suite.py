"""benchmarks.gpu: the suite a lent GPU runs in one call, exercised here at tiny shapes on the CPU (`--tiny`: every
section's code runs; the figures mean nothing). On a CUDA machine the gpu-marked test runs the graph check for real."""

import gc
import json
import os

import pytest
import torch

from ciar.engine import heap


def test_the_tiny_suite_runs_every_section_and_writes_json_and_markdown(tmp_path):
    from benchmarks.gpu import main

    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    assert torch.is_grad_enabled()  # the suite leaves the caller's grad mode alone (it ran in-process in make test)
    result = json.load(open(tmp_path / "gpu.json"))
    sections = result["sections"]
    assert list(sections) == ["env", "compiled_judge", "engine_graphs", "served_steps", "roofline",
                              "capacity_measured", "fused_step", "capacity_parallel", "capacity_process", "overlap",
                              "packed_step", "engine_process", "slot_attention", "xl_steps", "graphs", "fp32",
                              "profile", "capacity", "memory", "oom", "repeat", "engine_repeat", "engine_bisect",
                              "dense_copy", "anole_shape", "engine", "t5", "hf_llama"]
    cj = sections["compiled_judge"]  # the judge compiled (inductor's CPU code here): compiled at start-up, the same
    assert cj["compiled"]["warm_steps"] > 0 and cj["eager"]["warm_steps"] == 0, cj  # replies on these seeded inputs
    assert cj["compiled"]["sessions_4"]["compiled_in_rounds"] == 0, cj  # (the warm-up made every compilation)
    assert cj["sessions_4_replies_equal"] == {"equal": 12, "replies": 12}, cj
    assert all(cj[w]["sessions_4"]["ms_per_step_after_warmup"]["judge"] > 0 for w in ("eager", "compiled")), cj
    ov = sections["overlap"]  # the engine with overlap gives the replies of the engine without it, decodes run ahead
    assert ov["replies_identical"] and ov["replies"] == 4 + 2 * 4, ov
    assert ov["overlap"]["decodes"]["ahead_run"] > 0 and ov["plain"]["decodes"]["ahead_run"] == 0, ov
    ps = sections["packed_step"]  # decodes beside spans packed: the plain step's logits (to the bit on this CPU)
    assert [x["tokens_bucket"] for x in ps["steps"]] == [16, 32], ps
    assert all(x[f"{w}_max_logit_diff"] == 0 and x[f"{w}_argmax_equal"] == 1 for x in ps["steps"]
               for w in ("packed", "fused_packed")), ps
    ep = sections["engine_process"]  # the same phones through the engine thread and the engine's own process
    assert [r["phones"] for r in ep["rows"]] == [8], ep
    assert all(r[w]["verifies_per_s"] > 0 and 0 < r[w]["works_per_step"] <= 4 for r in ep["rows"]
               for w in ("direct", "threaded", "process")), ep
    eg = sections["engine_graphs"]  # the engine's static (bucketed) steps give the dynamic steps' replies
    assert eg["static_vs_dynamic"]["identical"] and eg["static"]["forwards_by_path"]["static"] > 0, eg
    assert all(eg[w]["first_round_s"] > 0 and eg[w]["spans_per_s_all_in_one_step"] > 0 for w in ("dynamic", "static"))
    split = eg["static"]["ms_per_step_after_warmup"]  # each step: forward + judge + host (timed to syncs)
    assert split["steps"] > 0 and split["forward"] > 0 and split["judge"] > 0 and split["host"] >= 0, split
    assert split["step"] >= split["forward"] + split["judge"] - 1e-3 and 0 < split["accelerator_busy_upper_bound"] <= 1
    sa = sections["slot_attention"]  # (no Triton here: both ways run the gather; the loaded step's two forms agree)
    assert {(x["kind"], x["rows"]) for x in sa["served_steps"]} == {(k, r) for k in ("decode", "span") for r in (2, 4)}
    assert sa["mixed_step"]["argmax_equal"] == 1.0 and sa["mixed_step"]["max_abs_logit_diff"] < 1e-4, sa
    served = sections["served_steps"]["steps"]  # the runner's static buckets, as the Verifier serves them
    assert {(x["kind"], x["rows"]) for x in served} == {(k, r) for k in ("decode", "span") for r in (2, 4)}
    assert all(x["path"] == "static" and x["bucket"] and x["served_ms"] > 0 and x["bound_ms"] > 0 for x in served)
    assert sections["memory"]["plan"]["sessions"] >= 1
    fused = sections["fused_step"]  # the fused step against the plain static one, as served
    assert {(x["kind"], x["rows"]) for x in fused["steps"]} == {(k, r) for k in ("decode", "span") for r in (2, 4)}
    assert all(x["static_ms"] > 0 and x["fused_ms"] > 0 for x in fused["steps"])
    tok = fused["tokens_float32"]  # in float32 both decode the same greedy tokens (the same bits on this CPU)
    assert tok["tokens"] == 6 and tok["max_logit_diff_before_any_token_differs"] < 1e-4, tok
    cm = sections["capacity_measured"]  # the real engine on its thread under trace-driven phones, CIAR and cloud-only
    assert cm["heap_frozen"] > 0 and cm["heap"]["frozen"] > 0  # as a replica's: its start-up frozen
    assert gc.get_freeze_count() == 0 and heap._on_gc not in gc.callbacks  # ... and undone after the section
    for method in ("ciar", "cloud"):
        points = cm["points"][method]
        assert [p["phones"] for p in points] == [1, 3]
        # the window is a count of images (any machine); every reply equalled the recording
        assert all(p["images"] >= 3 and p["mismatches"] == 0 and p["errors"] == 0 for p in points), points
        # each step split into forward, judge and host time; what the forwards computed
        assert all(p["ms_per_step"]["steps"] > 0 and p["ms_per_step"]["forward"] > 0 and p["forwards_per_step"] >= 1
                   and 0 <= p["padding"] < 1 for p in points), points
        assert cm["verdicts"][method]["unrecorded"] == 0 and cm["verdicts"][method]["replayed"] > 0
        for way in ("default_3ms", "refit_served_path", "served_costs"):  # the model beside each point, three ways
            assert [p["phones"] for p in cm["model"]["points"][way][method]] == [1, 3]
    # the same model from the written results, on any machine (engine_capacity --refit): the served steps' prediction
    # is the section's own to the image (the refit reads the roofline as rounded in the JSON: not compared)
    from benchmarks.engine_capacity import refit_run

    again = refit_run(str(tmp_path / "gpu.json"), steady_s=2.0)
    assert again["model"]["points"]["served_costs"] == cm["model"]["points"]["served_costs"]
    assert again["model"]["served_costs"] == cm["model"]["served_costs"]
    # ... and once more with a window of its own length (what a longer window would have given)
    assert again["model"]["steady_s"] == 2.0 and "served_steady" not in cm["model"]["points"]
    assert [p["phones"] for p in again["model"]["points"]["served_steady"]["cloud"]] == [1, 3]
    # what the replay is for: CIAR's images take fewer sequential cloud passes than cloud-only's 144 tokens
    assert cm["points"]["cloud"][0]["cloud_passes_per_image"] == 144
    assert cm["points"]["ciar"][0]["cloud_passes_per_image"] < 144
    for method in ("ciar", "cloud"):  # each load's first steps under the profiler (its warm-up: none here)
        pr = cm["points"][method][0]["profile"]
        assert 0 < pr["steps"] <= 8 and pr["wall_ms_per_step"] > 0 and pr["per_step"] > 0 and pr["top"], pr
        assert all(t["ms_per_step"] >= 0 and t["per_step"] > 0 for t in pr["top"]), pr
        assert pr["host_top"] and 0 < pr["host_ops_ms_per_step"] <= pr["wall_ms_per_step"], pr  # (the step's ops)
    assert cm["points"]["cloud"][1]["mean_works_per_step"] > 1  # three phones share steps
    cp = sections["capacity_process"]  # the last loads again, the engine core in its own process
    for method in ("ciar", "cloud"):
        p = cp["points"][method]
        assert p["phones"] == 3 and p["images"] >= 3 and p["mismatches"] == 0 and p["errors"] == 0, p
        assert p["thread_images_per_s"] == cm["points"][method][-1]["images_per_s"] and p["steps"] > 0, p
    assert cp["core"]["verdicts"]["unrecorded"] == 0 and cp["core"]["verdicts"]["replayed"] > 0, cp
    assert cp["points"]["cloud"]["cloud_passes_per_image"] == 144 > cp["points"]["ciar"]["cloud_passes_per_image"]
    assert cm["overlap_served"] is False  # (a CPU overlaps nothing: the GPU configuration's overlap is CUDA's)
    ov = cm["overlap"]  # ... and with the engine's overlap: decodes run ahead, every reply still the recording's
    assert {m: (x["phones"], x["mismatches"], x["errors"]) for m, x in ov.items()} == {"ciar": (3, 0, 0),
                                                                                      "cloud": (3, 0, 0)}, ov
    assert all(x["ahead_run"] > 0 and x["images_per_s"] for x in ov.values()), ov
    sw = cm["switch_interval"]  # each method's last load once more, the GIL handed over sooner
    assert {m: (x["phones"], x["mismatches"]) for m, x in sw.items()} == {"ciar": (3, 0), "cloud": (3, 0)}
    assert all(x["switch_s"] < x["default_s"] and x["images_per_s"] for x in sw.values()), sw
    cp = sections["capacity_parallel"]  # the same for SJD and CIAR with Jacobi windows (no model beside them)
    for method in ("sjd", "ciar_jacobi"):
        points = cp["points"][method]
        assert [p["phones"] for p in points] == [1, 3]
        assert all(p["images"] >= 3 and p["mismatches"] == 0 and p["errors"] == 0 for p in points), points
        assert cp["verdicts"][method]["unrecorded"] == 0 and cp["verdicts"][method]["replayed"] > 0
        assert method not in cp["model"]["points"]["default_3ms"]
    # SJD: a cloud-only image in fewer sequential passes than its 144 tokens (the replay keeps the recorded rounds)
    assert cp["points"]["sjd"][0]["cloud_passes_per_image"] < 144
    assert sections["fp32"]["skipped"] == "the suite already runs in float32 here"
    assert not [n for n, v in sections.items() if "broke" in v or ("skipped" in v and n != "fp32")], sections
    assert sections["oom"]["dynamic"]["replies_identical_to_undisturbed"]  # (no CUDA: no filler, the same replies)
    assert sections["profile"]["by_rows"]["1"]["eager"]["kernels"] > 0
    assert {(s["kind"], s["rows"]) for s in sections["anole_shape"]["steps"]} == {
        (k, r) for k in ("decode", "span") for r in (1, 4)}
    steps = sections["xl_steps"]["steps"]
    assert {(s["kind"], s["rows"]) for s in steps} == {(k, r) for k in ("decode", "span") for r in (1, 4)}
    assert all(s["eager_ms"] > 0 and s["bound_ms"] > 0 and s["keys"] == s["width"] + 8 + 40 for s in steps)
    assert sections["engine"]["spans_per_s_all_in_one_step"] > 0 and sections["capacity"]["overhead_s_eager"] > -1
    for batch in ("1", "16"):  # transformers' caches: a number, or the error its API gave (recorded, not hidden)
        row = sections["hf_llama"]["by_batch"][batch]
        assert isinstance(row["static_cache_ms"], float) and isinstance(row["dynamic_cache_ms"], float), row
    md = open(tmp_path / "gpu.md").read()
    assert md.startswith("# GPU suite: no GPU (cpu)") and "| decode (1 pos) | 1 |" in md
    assert "under torch.profiler in its warm-up" in md and "| ciar | 1 |" in md  # (the loads' profiles' table)
    # the capacity model reads what the suite measured (loadtests.capacity --gpu-costs gpu.json)
    from ciar.capacity.gpu_model import GPU, ModelShapes, forward_s, measured_gpu

    gpu, overhead = measured_gpu(result, "eager")
    cap = sections["capacity"]
    assert (gpu.bandwidth, gpu.peak_flops, overhead) == (cap["bandwidth"], cap["peak_flops"], cap["overhead_s_eager"])
    shapes = ModelShapes.llamagen_xl()
    assert forward_s(gpu, shapes, [(2, 1, 249)], overhead) == pytest.approx(
        forward_s(GPU("x", cap["bandwidth"], cap["peak_flops"], 0, ""), shapes, [(2, 1, 249)], 0.0) + overhead)
    with pytest.raises(ValueError, match="overhead_s_graph"):  # no CUDA here: no graph path was measured
        measured_gpu(result, "graph")


def test_the_busy_share_is_the_union_of_the_kernels_over_their_window():
    from benchmarks.gpu import busy_share

    assert busy_share([]) is None
    assert busy_share([(0, 10)]) == 1.0
    assert busy_share([(10, 20), (0, 5)]) == 0.75  # a gap of 5 in a window of 20 (in any order)
    assert busy_share([(0, 10), (2, 4), (8, 15), (20, 25)]) == 0.8  # nested and overlapping once; the last apart
    assert busy_share([(0, 10), (10, 20)]) == 1.0  # touching


def test_without_a_gpu_the_full_suite_says_so(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    from benchmarks.gpu import main

    assert main(["--out", str(tmp_path)]) == 2 and "no CUDA device" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "gpu.json")


def _gpu_section(tmp_path, sections: str, name: str) -> dict:
    """The suite's `sections` run on this machine's CUDA device (skipped without one) -> section `name`'s result."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from benchmarks.gpu import main

    main(["--out", str(tmp_path), "--sections", sections])
    return json.load(open(tmp_path / "gpu.json"))["sections"][name]


# In bfloat16 the engine's paths (dynamic, static, graphs) need not make the same tokens on a GPU (the first lent
# H100 run, benchmarks/results/2026-11-26-gpu: 138-143 of 192 greedy tokens): a step's rounding depends on its
# shape. Whether the paths agree is checked in float32, where they must to the bit; repeatability (the same path
# twice) is checked in the served dtype, below.
@pytest.mark.gpu
def test_in_float32_graph_replays_and_every_engine_path_make_the_same_tokens(tmp_path):
    f = _gpu_section(tmp_path, "env,roofline,fp32", "fp32")
    assert f["graphs"]["identical"] and f["graphs"]["max_logit_diff_at_equal_shape"] == 0.0, f["graphs"]
    eg = f["engine_graphs"]
    assert eg["graphs"]["forwards_by_path"]["graph"] > 0, eg
    assert all(eg[k]["identical"] for k in ("static_vs_dynamic", "graphs_vs_static", "graphs_vs_dynamic")), eg


@pytest.mark.gpu
def test_a_real_out_of_memory_fails_one_step_and_a_retry_gives_the_undisturbed_replies(tmp_path):
    f = _gpu_section(tmp_path, "env,fp32", "fp32")
    for path in ("dynamic", "default"):
        o = f["oom"][path]
        assert o["origin"] == "OutOfMemoryError" and o["open_sessions_after"] == 16, o
        assert o["undisturbed_repeatable"] and o["replies_identical_to_undisturbed"], o


@pytest.mark.gpu
def test_two_fresh_verifiers_give_the_same_replies_in_the_served_dtype(tmp_path):
    """With cuDNN's attention off (ciar.models.gpt.repeatable_attention, as every verifier does): bit-repeatable."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from benchmarks.gpu import main

    main(["--out", str(tmp_path), "--sections", "env,engine_bisect,engine_repeat"])
    s = json.load(open(tmp_path / "gpu.json"))["sections"]
    assert not s["env"]["cudnn_attention"]
    b = s["engine_bisect"]
    assert b["first_input_difference"] is None and b["first_output_difference"] is None, b
    r = s["engine_repeat"]["default"]
    assert r["replies_equal"] == r["replies"], s["engine_repeat"]


def test_capacity_loads_and_window_are_checked(tmp_path, capsys):
    """--capacity-loads / --capacity-window (the measured-phones sections' points on a GPU): a readable error."""
    from benchmarks.gpu import main

    for bad in (["--capacity-window", "4"], ["--capacity-loads", "0,3"], ["--capacity-window", "4,0"]):
        with pytest.raises(SystemExit) as e:
            main(["--tiny", "--out", str(tmp_path), "--sections", "env"] + bad)
        assert e.value.code == 2 and "--capacity-window WARMUP_S,WINDOW_S" in capsys.readouterr().err


def test_the_capacity_reruns_switch_the_overlap_away_from_the_served_setting():
    """`capacity_measured` builds its replica as served: the overlap on where the GPU configuration serves it (CUDA),
    off on a CPU. Each method's last load runs again with the overlap the other way: "no_overlap" on a GPU (run on
    no CPU test otherwise), "overlap" here; the setting is restored after, and the table names the rerun."""
    from types import SimpleNamespace

    from benchmarks.engine_capacity import _again, markdown

    for served, name in ((True, "no_overlap"), (False, "overlap")):
        v = SimpleNamespace(engine=SimpleNamespace(overlap=served))  # (a stand-in: only the flag is read)
        [(got, enter, leave)] = _again(v, None, True)
        assert got == name
        enter()
        assert v.engine.overlap is (not served)
        leave()
        assert v.engine.overlap is served
    assert _again(SimpleNamespace(engine=SimpleNamespace(overlap=True)), None, False) == []
    point = {"phones": 3, "images_per_s": 2.0, "latency_s": {"p50": 1.0, "p99": 1.5}, "cloud_passes_per_image": 9,
             "mean_works_per_step": 2.0, "engine_stepping": 0.9, "mismatches": 0}
    again = {"phones": 3, "images_per_s": 1.5, "default_images_per_s": 2.0, "latency_s": {"p99": 2.0},
             "default_latency_s": {"p99": 1.5}, "ms_per_step": None, "default_ms_per_step": None}
    sec = {"sessions": 8, "scheduler": {}, "fused_step": True, "overlap_served": True, "network": "5g",
           "duration_s": 12, "warmup_s": 4, "points": {"ciar": [point]}, "no_overlap": {"ciar": again}}
    table = "\n".join(markdown(sec))
    assert "overlap True" in table and "The last load again without the engine's overlap" in table, table


def test_a_step_profile_ended_early_reports_the_steps_it_saw():
    """`StepProfile` profiles up to 8 steps; a load that ends first (its images counted before) still reports the
    steps profiled, and the engine's step is unwrapped either way. A stand-in engine whose step is one matmul."""
    from types import SimpleNamespace

    from benchmarks.engine_capacity import StepProfile

    x = torch.randn(64, 64)
    engine = SimpleNamespace(step=lambda: x @ x)
    v = SimpleNamespace(engine=engine, device=torch.device("cpu"))
    real = engine.step
    profiler = StepProfile(v, steps=8)
    for _ in range(3):
        engine.step()
    report = profiler.remove()
    assert engine.step is real and report["steps"] == 3 and report["wall_ms_per_step"] > 0, report
    assert [t["name"] for t in report["host_top"]] == ["aten::matmul"] and report["host_top"][0]["per_step"] == 1
    assert StepProfile(v).remove() == {} and engine.step is real  # (no step: nothing profiled)
