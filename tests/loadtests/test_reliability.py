"""Reliability and fuzzing tools: their verdict logic (fast) and one short real run of each against an in-process
cluster over a random-weight world (slow)."""

import json
import os
import subprocess
import sys

import pytest

from loadtests import fuzz, reliability
from loadtests.jobs import make_jobs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def test_check_answer_accepts_2xx_and_named_4xx_503_only():
    ok_err = json.dumps({"error": {"type": "invalid_request", "message": "prompt: too long"}})
    assert fuzz.check_answer(200, "application/json", "{}") is None
    assert fuzz.check_answer(422, "application/json", ok_err) is None
    assert fuzz.check_answer(503, "application/json", ok_err) is None
    assert "500" in fuzz.check_answer(500, "text/plain", "Internal Server Error")
    assert "without a JSON error message" in fuzz.check_answer(400, "text/plain", "Bad Request")
    assert "empty" in fuzz.check_answer(401, "application/json", json.dumps({"error": {"message": ""}}))


def test_body_strategy_draws_valid_and_invalid_bodies():
    from hypothesis import HealthCheck, given, settings

    from services.schemas import GenerationRequest

    seen = {"valid": 0, "invalid": 0}

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fuzz.body_strategy())
    def one(body):
        try:
            GenerationRequest.model_validate(body)
            seen["valid"] += 1
        except Exception:  # noqa: BLE001 - pydantic's ValidationError and friends
            seen["invalid"] += 1

    one()
    assert seen["valid"] >= 20 and seen["invalid"] >= 20, seen


def test_keys_in_logs_counts_every_occurrence(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "a.log").write_text("auth ok for secret-key-123\nsecret-key-123 again\n")
    (tmp_path / "w.err").write_text("nothing here")
    assert fuzz.keys_in_logs(str(tmp_path), ["secret-key-123", "other-key-456"]) == {"secr…": 2, "othe…": 0}


def test_request_mix_and_tally():
    jobs = make_jobs(8, seed=3)
    assert jobs == make_jobs(8, seed=3) and len({j["method"] for j in jobs}) == 4
    res = [{"code": 200, "degraded": True}, {"code": 200}, {"code": 503, "error": "busy"}, {"code": None,
                                                                                            "error": "Timeout"}]
    c = reliability._count(res)
    assert (c["attempted"], c["succeeded"], c["degraded"], c["lost"]) == (4, 2, 1, 2)
    assert reliability.percentile([3.0, 1.0, 2.0], 50) == 2.0 and reliability.percentile([], 50) is None


def _fleet(sessions=0, opened=10, resumed=0, busy=0, tracked=0, seen=3, replica="v1"):
    """A `reliability.fleet_state` snapshot of a 3-phone fleet."""
    return {"devices_seen": seen, "devices_busy": busy,
            "device_state": {"session_tokens": 0, "batch_size_records": 0, "tracked_sessions": tracked},
            "device_rss_mb": 100.0, "verifier_sessions": sessions, "verifier_free_slots": 8,
            "verifier_opened": opened, "verifier_resumed": resumed, "verifier_rss_mb": 500.0,
            "verifier_replica": replica}


def test_wait_idle_waits_until_no_phone_works(monkeypatch):
    """Unit test of the waiting logic, over scripted fleet snapshots (no cluster): phones answer state() only
    between images, so `devices_busy` is 0 while they work; the wait reads the verifier instead and returns the
    first snapshot that is idle for certain, with the one before it: no session held at either, none opened or
    resumed between them, every phone answered holding nothing."""
    script = [_fleet(sessions=2),  # phones at work (the old wait returned this one: nobody answered busy)
              _fleet(sessions=0, opened=10),
              _fleet(sessions=0, opened=11),  # a job opened and closed its session between two reads
              _fleet(sessions=0, opened=11, resumed=1),  # ... or resumed one
              _fleet(sessions=0, opened=11, resumed=1, busy=1),  # a cancelled job still running in its thread
              _fleet(sessions=0, opened=11, resumed=1, tracked=1),  # a phone still tracking a session
              _fleet(sessions=0, opened=11, resumed=1, seen=2),  # a phone did not answer
              _fleet(sessions=0, opened=11, resumed=1, replica="v2"),  # another replica's counters
              _fleet(sessions=0, opened=11, resumed=1, replica="v2")]  # idle: this one
    reads = iter(script)
    monkeypatch.setattr(reliability, "fleet_state", lambda devices: next(reads))
    st = reliability._wait_idle(3, timeout_s=1e9, sleep=lambda s: None)
    assert st["idle"] and st["snapshots"] == len(script) and next(reads, None) is None  # every snapshot was read
    assert {k: st[k] for k in _fleet()} == script[-1]


def test_wait_idle_gives_up_after_its_hang_guard(monkeypatch):
    """A fleet that never settles (a session held for good): the last snapshot, marked not idle, once the guard
    ran out (the clock is scripted: 10 s per read)."""
    ticks = iter(range(0, 10_000, 10))
    monkeypatch.setattr(reliability, "fleet_state", lambda devices: _fleet(sessions=1))
    st = reliability._wait_idle(3, timeout_s=55, clock=lambda: float(next(ticks)), sleep=lambda s: None)
    assert not st["idle"] and st["verifier_sessions"] == 1 and st["waited_s"] > 55


@pytest.mark.slow
@pytest.mark.cluster  # starts Ray / Serve (tests/conftest.py)
@pytest.mark.timeout(900)
def test_reliability_run_against_a_random_world(tmp_path, random_world):
    """A replica kill, link drops and the leak check, small: nothing lost, every drop degraded, nothing left."""
    out = tmp_path / "rel"
    cmd = [PY, "-m", "loadtests.reliability", "--scenarios", "kill,linkdrop,leak", "--requests", "6",
           "--concurrency", "3", "--kills", "1", "--leak-requests", "30", "--abandoned", "2", "--devices", "3",
           "--weights", random_world, "--out", str(out), "--set", "Device.tau=0.05",
           "--set", "Verifier.idle_timeout_s=3"]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=840)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    r = json.loads((out / "reliability.json").read_text())
    kill, drop, leak = (r["scenarios"][k] for k in ("kill", "linkdrop", "leak"))
    assert kill["lost"] == 0 and kill["succeeded"] == 6 and kill["kills_at_s"]
    assert drop["with_drop"]["lost"] == 0 and drop["with_drop"]["degraded"] >= 1
    assert drop["without_drop"]["degraded"] == 0
    assert leak["verifier_sessions_after_abandoning"] >= 2 and leak["after_idle_timeout"]["verifier_sessions"] == 0
    assert leak["idle_snapshots"] and all(leak[k]["idle"] for k in ("before", "middle", "after", "after_idle_timeout"))
    assert not any(leak["after_idle_timeout"]["device_state"].values())


@pytest.mark.slow
@pytest.mark.cluster  # starts Ray / Serve (tests/conftest.py)
@pytest.mark.timeout(900)
def test_fuzz_cli_against_a_random_world(tmp_path, random_world):
    out = tmp_path / "fuzz"
    cmd = [PY, "-m", "loadtests.fuzz", "--examples", "40", "--devices", "2", "--weights", random_world,
           "--out", str(out), "--set", "Device.tau=0.05"]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=840)
    r = json.loads((out / "fuzz.json").read_text())
    assert p.returncode == 0 and r["ok"], p.stdout[-3000:] + p.stderr[-2000:]
    assert r["requests"] >= 40 and r["five_xx"] == 0 and r["oversized"]["1MB_status"] == 413
    assert set(r["keys_in_logs"].values()) == {0} and r["bad_keys"]["codes"] == [401] * 4
