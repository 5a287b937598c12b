"""Simulated phones that die under a job, for real: Ray Serve in-process (ingress, 2 simulated devices, a verifier)
over a small RANDOM-weight world. A phone killed under a job (its process SIGKILLed) costs the job one retry on a
live phone, and the image is the one an undisturbed run makes; a job that kills every phone it runs on (the
simulation param `device_exit_after`) is given up after the second phone, with a 500 that names the cause, and
takes no third phone with it. The pool is whole again after each.

One Ray instance for the module (tests/conftest.py: shared_ray); simulated network time is spent for real.
"""

import hashlib
import json
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import write_random_world  # noqa: E402
from services.device_retry import JOB_DEVICE_DEATHS  # noqa: E402
from services.deploy import deploy_config  # noqa: E402

PORT = 8137
URL = f"http://127.0.0.1:{PORT}"
GEN = f"{URL}/v1/images/generations"
KEY = "deaths-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "a small red circle at the top on a gray background"
DEVICES = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_ray):
    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0},
                                 with_device=True)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {"weights_dir": weights, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "devices": DEVICES, "device_num_cpus": 0.1, "verifier_num_cpus": 0.5, "verifier_max_sessions": 16,
            "ingress_num_cpus": 0.1, "graceful_shutdown_timeout_s": 0.5, "retry_after_s": 3,
            "allow_simulation_params": True}  # params.device_exit_after, params.device_slowdown
    deploy_config(args, user_configs={"Device": {"tau": 0.05, "span": 4, "prefix_rate": 0.06, "realtime": True,
                                                 "policy": "fixed", "preview_every": 16}})
    yield weights
    serve.shutdown()


def phones(state: str = "ALIVE") -> dict[str, dict]:
    """The Device replicas' actors in `state` (Ray's actor table), by actor id."""
    from ray._private import state as ray_state

    return {a: info for a, info in ray_state.actors(actor_state_name=state).items()
            if "#Device#" in (info.get("Name") or "")}


def pool_whole(timeout_s: float = 180.0) -> None:
    """Wait until DEVICES phones are alive again and the cluster answers /healthz."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(phones()) == DEVICES and serve.status().applications["ciar"].deployments["Device"].status == \
                "HEALTHY":
            if requests.get(f"{URL}/healthz", timeout=30).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the device pool is not whole again after {timeout_s} s: {len(phones())} phones alive")


def test_a_phone_killed_under_a_job_costs_one_retry_and_the_image_is_the_same(cluster):
    """One death (a SIGKILLed phone process, the kind of death JOB_DEVICE_DEATHS counts): the job runs again on a
    live phone, answers 200 with device_retries 1, and makes the image an undisturbed run makes."""
    body = {"prompt": PROMPT, "seed": 2, "method": "ciar", "response_format": "tokens"}
    undisturbed = requests.post(GEN, json=body, headers=AUTH, timeout=300)
    assert undisturbed.status_code == 200, undisturbed.text
    # slow enough (simulated device compute x 40) that the phone is killed while the image is being made
    slow = {**body, "params": {"device_slowdown": 40.0}, "stream": True}
    dead_before = set(phones("DEAD"))
    events: list[tuple[str, dict]] = []
    started = threading.Event()

    def stream() -> None:
        with requests.post(GEN, json=slow, headers=AUTH, timeout=300, stream=True) as r:
            assert r.status_code == 200, r.text
            event = None
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("data: "):
                    events.append((event, json.loads(line[len("data: "):])))
                    started.set()

    th = threading.Thread(target=stream, daemon=True)
    th.start()
    assert started.wait(120), "no progress event: the job never started"
    # the phone making the image is at its one ongoing request: a state() call is routed to the other one
    idle = serve.get_deployment_handle("Device", app_name="ciar").state.remote().result(timeout_s=60)["device_id"]
    busy = [info for info in phones().values() if not info["Name"].endswith(idle)]
    assert len(busy) == 1, busy
    os.kill(busy[0]["Pid"], signal.SIGKILL)
    th.join(300)
    assert not th.is_alive()
    kinds = [e for e, _ in events]
    assert kinds[-1] == "result", events[-1]
    result = events[-1][1]
    assert result["stats"]["device_retries"] == 1, result["stats"]
    # the image the lost phone would have made (simulated slowdown changes time, never tokens)
    assert result["data"][0]["tokens"] == undisturbed.json()["data"][0]["tokens"]
    assert len(set(phones("DEAD")) - dead_before) == 1
    pool_whole()


def test_a_job_that_kills_its_phones_is_given_up_after_the_second(cluster):
    """A job that kills every phone it runs on (device_exit_after): exactly JOB_DEVICE_DEATHS phones die (before the
    rule, DEVICE_ATTEMPTS = 5 did), and the answer is a 500 that says the request itself is the likely cause."""
    pool_whole()
    dead_before = set(phones("DEAD"))
    body = {"prompt": PROMPT, "seed": 3, "method": "ciar", "params": {"device_exit_after": 20}}
    r = requests.post(GEN, json=body, headers=AUTH, timeout=300)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "killed_devices", err
    assert f"killed {JOB_DEVICE_DEATHS} simulated devices" in err["message"], err
    assert "likely cause is the request itself" in err["message"], err
    assert "worker process has died" in err["message"], err  # Ray's death cause, as each phone died of it
    time.sleep(5)  # a third phone, if the job were run again, would have died by now (retries wait <= 2 s)
    killed = set(phones("DEAD")) - dead_before
    assert len(killed) == JOB_DEVICE_DEATHS, killed
    pool_whole()
    # the cluster serves other requests as before
    ok = requests.post(GEN, json={**body, "params": {}}, headers=AUTH, timeout=300)
    assert ok.status_code == 200, ok.text


def test_a_streamed_job_that_kills_its_phones_ends_with_the_same_error(cluster):
    """The stream's retry loop counts the deaths as the plain one does: its `error` event is the same 500."""
    pool_whole()
    dead_before = set(phones("DEAD"))
    body = {"prompt": PROMPT, "seed": 4, "method": "ciar", "stream": True, "params": {"device_exit_after": 20}}
    with requests.post(GEN, json=body, headers=AUTH, timeout=300, stream=True) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-2] == "event: error", lines[-2:]
    err = json.loads(lines[-1][len("data: "):])
    assert err["status"] == 500 and err["error"]["type"] == "killed_devices", err
    time.sleep(5)
    assert len(set(phones("DEAD")) - dead_before) == JOB_DEVICE_DEATHS
    pool_whole()
