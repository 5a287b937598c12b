"""loadtests.capacity end to end on the shipped world: recorded phones against one real Verifier replica."""

import json
import os

import pytest

from loadtests.capacity import main, plot, summarize


def test_summary_picks_the_largest_load_within_the_slo():
    def pt(phones, p99, errors=0):
        return {"phones": phones, "images": 3, "latency_s": {"p50": p99 / 2, "p95": p99, "p99": p99},
                "errors": errors, "cloud_passes_per_image": 10.0, "cloud_requests_per_image": 4.0,
                "cloud_positions_per_image": {"span": 100.0, "decode": 10.0, "history": 0.0, "prefill": 50.0}}

    r = summarize({"ciar": [pt(1, 1.0), pt(2, 1.5), pt(4, 2.5, errors=1), pt(8, 9.0)],
                   "cloud": [pt(1, 1.0), pt(2, 3.0)]}, 2.0, "cpu", {})
    assert r["phones_at_slo"] == {"ciar": 2, "cloud": 1} and r["ratio"] == 2.0
    assert r["cloud_positions_per_image"]["ciar"] == 110.0


def test_plot_of_a_run_where_no_image_finished_inside_a_window(tmp_path):
    """A box too slow for the window (every point 0 images, as a loaded 2-core box gave with 3 s windows): the
    figure is still written, its panels saying why they are empty (a log axis without data raised before)."""
    empty = {"phones": 1, "images": 0, "latency_s": {"p50": None, "p95": None, "p99": None}, "images_per_s": 0.0,
             "mean_batch_size": 1.0}
    result = summarize({"ciar": [empty], "cloud": [empty]}, 30.0, "cpu", {})
    plot(result, str(tmp_path / "capacity.png"))
    assert (tmp_path / "capacity.png").stat().st_size > 10_000


def test_a_point_counts_images_per_phone_however_long_an_image_takes(monkeypatch):
    """`--images N`: a point measures until every phone has N images in its window, here images four times as long
    as the window (the replay stubbed: an image sleeps, then feeds its verifier estimate 1 s per exchange, past the
    0.5 s overload limit). A window of seconds alone counted none of them; the degradation applies from a phone's
    second image on, so each phone's later images, and only they, are overloaded."""
    import argparse
    import asyncio
    import types

    from loadtests import capacity

    async def replay(trace, client, session_id, net, is_lost=None):
        await asyncio.sleep(0.2)
        client.verifier.update(1.0)  # what its verify replies would have fed the phone's estimate
        return types.SimpleNamespace(latency_s=0.2, resumes=0, forward_passes=3, exchanges=2, mismatches=0)

    async def replica_stats(handle, replicas):
        return {"replicas": ["r"], "forwards": 0, "real_positions": 0, "padded_positions": 0, "resumed": 0,
                "positions_by_kind": {}, "batch_size_hist": {}}

    monkeypatch.setattr("ciar.capacity.trace.replay_session", replay)
    monkeypatch.setattr(capacity, "replica_stats", replica_stats)
    monkeypatch.setattr(capacity, "running_replicas", lambda app="capacity": 1)
    args = argparse.Namespace(network="none", warmup=0.0, duration=0.05, images=3, overload="0.5:1.5")
    p = asyncio.run(capacity._point(None, ["recorded"], 2, args, "t", raised=["raised"]))
    assert p["images_per_phone"]["min"] >= 3 and p["images"] >= 6 and p["errors"] == 0
    assert p["phones_past_first"] == 2
    assert p["overloaded_images"] == p["later_images"] == p["images"] - 2  # all but each phone's first
    assert p["overloaded_share"] == pytest.approx(p["later_images"] / p["images"])


def test_a_replica_that_never_answers_stats_fails_the_run_with_that_said():
    """A hung replica (its event loop blocked: a heap.stats deadlock did it once) held the whole run at its stats
    call; now the call is bounded and the run fails saying so. (A stub handle whose stats never answer.)"""
    import asyncio

    from loadtests.capacity import replica_stats

    class HungHandle:  # STUB: a deployment handle whose replica never answers
        class stats:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()  # never resolved

    with pytest.raises(RuntimeError, match="did not answer stats"):
        asyncio.run(replica_stats(HungHandle(), 1, timeout_s=0.05))


def test_recordings_of_other_settings_in_the_traces_dir_are_refused(tmp_path, capsys):
    """--traces-dir read whatever recordings it held: another --traces, --seed, world or overload was replayed as this
    run's phones. Nothing is recorded or read here: the settings are checked first."""
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "traces.json").write_text(json.dumps({"traces": 2, "seed": 0, "world": "None",
                                                    "overload_factor": None}))
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "cap"), "--traces-dir", str(folder), "--traces", "3", "--seed", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--traces-dir {folder} was made with other settings (seed: 0 there, 1 now; traces: 2 there, 3 now)" in err
    assert sorted(os.listdir(folder)) == ["traces.json"]


@pytest.mark.cluster  # its own Ray instance and Serve (tests/conftest.py)
@pytest.mark.timeout(900)
def test_capacity_run_writes_the_report(tmp_path):
    """Each point measures until every phone has two images in its window (`--images 2`, a count): with windows of
    seconds, a slower box finished each phone's first image only, and the degradation (a phone's later images) was
    never seen."""
    out = tmp_path / "cap"
    assert main(["--out", str(out), "--phones", "1,3", "--duration", "1", "--warmup", "1", "--images", "2",
                 "--traces", "2", "--network", "5g", "--slo-p99-s", "30", "--overload", "0.000001:1.5"]) == 0
    r = json.loads((out / "capacity.json").read_text())
    for key in ("slo_p99_s", "phones_at_slo", "ratio", "cloud_positions_per_image", "cloud_passes_per_image",
                "accelerator", "points"):
        assert key in r
    assert (out / "capacity.png").stat().st_size > 10_000
    assert {p["method"] for p in r["points"]} == {"ciar", "cloud", "ciar overload"}
    assert r["setup"]["images_per_phone"] == 2
    for p in r["points"]:  # counted: every phone has its two images, so each reached one after its first
        assert p["images_per_phone"]["min"] >= 2 and p["images"] >= 2 * p["phones"], p
        assert p["phones_past_first"] == p["phones"] and p["later_images"] >= p["phones"], p
    # graceful degradation: past a 1 µs verifier, every image after a phone's first runs at the raised tau (the first
    # has nothing observed yet)
    degraded = [p for p in r["points"] if p["method"] == "ciar overload"]
    assert degraded and all(p["overloaded_images"] == p["later_images"] for p in degraded), degraded
    assert all(0 < p["overloaded_share"] <= 1 for p in degraded)
    assert all(p["overloaded_share"] is None for p in r["points"] if p["method"] != "ciar overload")
    assert r["setup"]["overload"] == "0.000001:1.5"
    raised, ciar = r["setup"]["recorded_requests_per_image"]["ciar raised"], \
        r["setup"]["recorded_requests_per_image"]["ciar"]
    assert raised <= ciar  # a raised tau sends fewer spans
    for p in r["points"]:
        assert p["errors"] == 0 and p["mismatches"] == 0, p
    cloud = [p for p in r["points"] if p["method"] == "cloud" and p["images"]]
    assert cloud and cloud[0]["cloud_requests_per_image"] == 1.0
    # cloud-only: every image token is one decode step of the cloud (N = 144 on the shipped world)
    assert r["cloud_passes_per_image"]["cloud"] >= 144
    assert r["cloud_requests_per_image"]["ciar"] > 1.0
