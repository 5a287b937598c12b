"""benchmarks.gpu: the suite a lent GPU runs in one call, exercised here at tiny shapes on the CPU (`--tiny`: every
section's code runs; the figures mean nothing). On a CUDA machine the gpu-marked test runs the graph check for real."""

import json
import os

import pytest
import torch


def test_the_tiny_suite_runs_every_section_and_writes_json_and_markdown(tmp_path):
    from benchmarks.gpu import main

    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    assert torch.is_grad_enabled()  # the suite leaves the caller's grad mode alone (it ran in-process in make test)
    result = json.load(open(tmp_path / "gpu.json"))
    sections = result["sections"]
    assert list(sections) == ["env", "roofline", "xl_steps", "graphs", "fp32", "profile", "capacity", "engine_graphs",
                              "memory", "oom", "anole_shape", "engine", "t5", "hf_llama"]
    eg = sections["engine_graphs"]  # the engine's static (bucketed) steps give the dynamic steps' replies
    assert eg["static_vs_dynamic"]["identical"] and eg["static"]["forwards_by_path"]["static"] > 0, eg
    assert sections["memory"]["plan"]["sessions"] >= 1
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
    # the capacity model reads what the suite measured (loadtests.capacity --gpu-costs gpu.json)
    from ciar.collab.gpu_model import GPU, ModelShapes, forward_s, measured_gpu

    gpu, overhead = measured_gpu(result, "eager")
    cap = sections["capacity"]
    assert (gpu.bandwidth, gpu.peak_flops, overhead) == (cap["bandwidth"], cap["peak_flops"], cap["overhead_s_eager"])
    shapes = ModelShapes.llamagen_xl()
    assert forward_s(gpu, shapes, [(2, 1, 249)], overhead) == pytest.approx(
        forward_s(GPU("x", cap["bandwidth"], cap["peak_flops"], 0, ""), shapes, [(2, 1, 249)], 0.0) + overhead)
    with pytest.raises(ValueError, match="overhead_s_graph"):  # no CUDA here: no graph path was measured
        measured_gpu(result, "graph")


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


@pytest.mark.gpu
def test_graph_replays_make_the_same_tokens_as_eager(tmp_path):
    g = _gpu_section(tmp_path, "env,roofline,graphs", "graphs")
    assert g["identical"], g


@pytest.mark.gpu
def test_the_engine_replays_cuda_graphs_with_the_eager_static_steps_replies(tmp_path):
    g = _gpu_section(tmp_path, "env,engine_graphs", "engine_graphs")
    assert g["graphs_vs_static"]["identical"] and g["graphs"]["forwards_by_path"]["graph"] > 0, g
