"""Head-node failure with GCS fault tolerance (loadtests.headloss): the timeline and summary arithmetic, the Redis
wire helper and the process marks (fast), and one short real run against a random-weight world: a real
redis-server, a Ray head whose GCS is killed and restarted under load (slow; `make test-slow`; needs `make redis`)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from loadtests import headloss

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _rec(job, start, end, code=200, kind="plain", tokens=None):
    return {"job": job, "kind": kind, "method": ("ciar", "cloud")[job % 2], "start": start, "end": end, "code": code,
            "error": None if code == 200 else "x", "tokens": tokens if tokens is not None else [job]}


# ------------------------------------------------------------------------------------------------ timeline maths
def test_phases_split_at_the_kill_and_the_restart():
    kill, restart = 100.0, 110.0
    assert headloss.phase_of(_rec(0, 90, 99.9), kill, restart) == "before"
    assert headloss.phase_of(_rec(1, 95, 101), kill, restart) == "during"      # in flight at the kill
    assert headloss.phase_of(_rec(2, 103, 105), kill, restart) == "during"     # entirely while down
    assert headloss.phase_of(_rec(3, 108, 130), kill, restart) == "during"     # started while down, ended after
    assert headloss.phase_of(_rec(4, 95, 130), kill, restart) == "during"      # spans the whole outage
    assert headloss.phase_of(_rec(5, 110, 111), kill, restart) == "after"


def test_phase_table_counts_latencies_and_completions_while_down():
    recs = [_rec(0, 0, 2), _rec(1, 1, 5), _rec(2, 9, 12), _rec(3, 11, 13, code=None), _rec(4, 15, 16, code=503),
            _rec(5, 16, 20, kind="stream")]
    t = headloss.phase_table(recs, t_kill=10.0, t_restart=14.0)
    assert (t["before"]["attempted"], t["before"]["succeeded"]) == (2, 2)
    assert t["before"]["latency_ms"] == {"p50": 2000.0, "p99": 4000.0, "max": 4000.0}
    assert (t["during"]["attempted"], t["during"]["succeeded"], t["during"]["failed"]) == (2, 1, 1)
    assert (t["after"]["attempted"], t["after"]["failed"], t["after"]["streamed"]) == (2, 1, 1)
    assert t["all"]["attempted"] == 6 and t["all"]["failed"] == 2
    assert t["completed_while_down"] == 1  # job 2 ended at 12, inside [10, 14)
    assert (t["started_while_down"]["attempted"], t["started_while_down"]["failed"]) == (1, 1)  # job 3 (11 s)
    assert t["after"]["errors"] == {"503: x": 1}
    assert t["before"]["p50_ms_by_method"] == {"ciar": 2000.0, "cloud": 4000.0}
    empty = headloss.tally([])
    assert empty["attempted"] == 0 and empty["latency_ms"]["p50"] is None


def test_tokens_compared_by_job_with_the_undisturbed_run():
    recs = [_rec(0, 0, 1, tokens=[1, 2]), _rec(1, 0, 1, tokens=[3, 4]), _rec(2, 0, 1, code=None),
            _rec(7, 0, 1, tokens=[9])]
    c = headloss.compare_tokens(recs, {0: [1, 2], 1: [3, 5], 2: [0]})
    assert c == {"succeeded": 3, "compared": 2, "identical": 1, "differing_jobs": [1], "without_reference": 1}


def test_buckets_count_ends_and_requests_in_flight():
    recs = [_rec(0, 0, 3), _rec(1, 2, 7), _rec(2, 6, 8, code=None), _rec(3, 9, 12)]
    rows = headloss.buckets(recs, t0=0.0, width=5.0, until=12.0, origin=5.0)
    assert [r["t"] for r in rows] == [-5.0, 0.0, 5.0]
    assert [(r["ok"], r["failed"], r["in_flight"]) for r in rows] == [(1, 0, 1), (1, 1, 1), (1, 0, 1)]


def test_probe_queries():
    probes = [{"probe": "nodes", "t": 1, "ok": True, "alive": 1}, {"probe": "nodes", "t": 5, "ok": False,
                                                                     "error": "down"},
              {"probe": "nodes", "t": 9, "ok": True, "alive": 0}, {"probe": "nodes", "t": 11, "ok": True, "alive": 1},
              {"probe": "serve", "t": 6, "ok": True, "app": "ApplicationStatus.RUNNING"}]
    assert headloss.first_ok(probes, "nodes", 4)["t"] == 9
    assert headloss.first_ok(probes, "nodes", 4, lambda p: p["alive"] > 0)["t"] == 11
    assert headloss.first_ok(probes, "serve", 7) is None
    assert headloss.last_ok(probes, "nodes", 9)["t"] == 1
    assert headloss.answered_between(probes, "nodes", 4, 10) == {"answered": 1, "failed": 1, "errors": ["down"]}
    assert headloss.app_running(probes[-1]) and not headloss.app_running({"app": "DEPLOYING"})
    # a call that hung through the outage [4, 10) and one that failed inside it
    calls = [{"probe": "nodes", "t0": 3.5, "t": 10.5, "ok": True}, {"probe": "nodes", "t0": 1.0, "t": 1.1, "ok": True},
             {"probe": "nodes", "t0": 5.0, "t": 6.0, "ok": False, "error": "Timeout"}]
    assert headloss.spanning(calls, "nodes", 4.0, 10.0) == [
        {"start_s": -0.5, "end_s": 6.5, "ok": True}, {"start_s": 1.0, "end_s": 2.0, "ok": False, "error": "Timeout"}]


def test_verdict_needs_every_check():
    ft = {"requests": {"all": {"attempted": 4, "failed": 0}, "completed_while_down": 1},
          "tokens": {"succeeded": 4, "compared": 4, "identical": 4},
          "recovery": {"ray_nodes_back_after_restart_s": 1.2, "serve_running_after_restart_s": 1.5},
          "serve": {"same_replicas": True, "redeployed": False}, "new_task_after_recovery": {"ok": True}}
    assert headloss.verdict(ft)["ok"]
    for path, value in ((("requests", "all", "failed"), 1), (("requests", "completed_while_down"), 0),
                        (("tokens", "identical"), 3), (("serve", "redeployed"), True),
                        (("recovery", "ray_nodes_back_after_restart_s"), None)):
        bad = json.loads(json.dumps(ft))
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        assert not headloss.verdict(bad)["ok"], path
    assert not headloss.verdict({})["ok"]


def test_cpu_rate_adds_the_processes_present_in_both_samples():
    samples = [(0.0, {1: ("raylet", 1.0), 2: ("gcs_server", 5.0)}),
               (1.0, {1: ("raylet", 1.5), 2: ("gcs_server", 5.25)}),
               (2.0, {1: ("raylet", 2.5), 3: ("ray::Device", 9.0)}),  # the GCS gone, a worker new: neither counts
               (3.0, {1: ("raylet", 2.5), 3: ("ray::Device", 9.5)})]
    r = headloss.cpu_rate(samples, 0.0, 3.0)
    assert r == {"cores": round((0.5 + 0.25 + 1.0 + 0.5) / 3, 3),
                 "by_name": {"raylet": 0.5, "ray::Device": round(0.5 / 3, 3), "gcs_server": round(0.25 / 3, 3)}}
    assert headloss.cpu_rate(samples, 1.0, 2.0)["cores"] == 1.0
    assert headloss.cpu_rate(samples, 5.0, 9.0) == {"cores": None, "by_name": {}}
    own = headloss.cpu_seconds([os.getpid(), 10**9])
    assert list(own) == [os.getpid()] and own[os.getpid()][1] > 0


# ------------------------------------------------------------------------------------------------ helpers
def test_resp_speaks_redis_wire_format():
    """The RESP helper against a fake server: the bytes it sends, and every reply type it reads."""
    a, b = socket.socketpair()
    replies = [b"+PONG\r\n", b":42\r\n", b"$5\r\nhello\r\n", b"$-1\r\n", b"*2\r\n$1\r\nx\r\n:7\r\n",
               b"-WRONGPASS invalid\r\n"]
    got = []

    def server():
        for reply in replies:
            got.append(b.recv(4096))
            b.sendall(reply)

    th = threading.Thread(target=server)
    th.start()
    try:
        assert headloss.resp(a, "PING") == "PONG"
        assert headloss.resp(a, "HLEN", "k") == 42
        assert headloss.resp(a, "GET", "k") == "hello"
        assert headloss.resp(a, "GET", "none") is None
        assert headloss.resp(a, "KEYS", "*") == ["x", 7]
        with pytest.raises(RuntimeError, match="WRONGPASS"):
            headloss.resp(a, "AUTH", "bad")
    finally:
        th.join()
        a.close()
        b.close()
    assert got[0] == b"*1\r\n$4\r\nPING\r\n" and got[1] == b"*2\r\n$4\r\nHLEN\r\n$1\r\nk\r\n"


def test_log_events_drop_the_periodic_dumps():
    lines = ["[2026-11-26 20:04:28,966 I 1 1] (gcs_server) gcs_server.cc:1326: ray_event_io_context Event stats:",
             "\tRedisStoreClient.AsyncPut - 3 total", "[runtime env manager] ID to URIs table:",
             "[2026-11-26 20:04:29,000 I 1 1] (gcs_server) gcs_server.cc:930: Using external Redis for KV storage",
             "[state-dump] NodeManager:", "[2026-11-26 20:04:30,000 I 1 1] (raylet) x.cc:1: [state-dump] y"]
    assert headloss.log_events(lines) == [lines[3]]


def test_marked_pids_finds_only_the_marked_processes():
    mark = "test-" + os.urandom(4).hex()
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], env={**os.environ, headloss.MARK: mark},
                         start_new_session=True)
    q = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert headloss.marked_pids(mark) == [p.pid]
        assert headloss.alive(p.pid)
        assert headloss.stop_pids([p.pid], grace_s=5) == {"terminated": 1, "killed": 0}
        p.wait(timeout=5)
        assert not headloss.alive(p.pid) and headloss.marked_pids(mark) == []
        assert headloss.alive(q.pid)  # not ours: untouched
    finally:
        for proc in (p, q):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------------------------------------ the real run
@pytest.mark.slow
@pytest.mark.cluster  # starts Ray / Serve (tests/conftest.py)
@pytest.mark.timeout(900)
def test_gcs_killed_and_restarted_under_load_with_redis_loses_nothing(tmp_path, random_world):
    """The ft run, short: the GCS backed by a real redis-server is SIGKILLed under load and started again; every
    request is answered 200 with the undisturbed tokens, some while the GCS is down, and the application keeps its
    replicas. Nothing the run started is left."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH: `make redis`")
    out = tmp_path / "headloss"
    cmd = [PY, "-m", "loadtests.headloss", "--out", str(out), "--no-control", "--weights", random_world,
           "--devices", "2", "--concurrency", "2", "--warmup", "8", "--outage", "6", "--after", "8",
           "--recovery-timeout", "60", "--set", "Device.tau=0.05"]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=840)
    assert (out / "headloss.json").exists(), p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((out / "headloss.json").read_text())
    ft = r["runs"]["ft"]
    assert p.returncode == 0 and r["verdict"]["ok"], (r.get("verdict"), p.stdout[-3000:], p.stderr[-2000:])
    assert ft["requests"]["all"]["failed"] == 0 and ft["requests"]["completed_while_down"] >= 1
    assert ft["tokens"]["identical"] == ft["tokens"]["succeeded"] > 0
    assert ft["serve"]["same_replicas"] and not ft["serve"]["redeployed"]
    assert ft["redis_footprint"]["keys"] > 0  # the GCS kept its tables in the run's Redis namespace
    assert ft["stopped"]["left"] == 0
