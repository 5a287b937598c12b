"""The Serve application for real: Ray Serve in-process (ingress, 8 simulated devices, a verifier replica), HTTP
requests and deployment handles against it, over a small RANDOM-weight world with a device model.

One Ray instance for the module; replicas get fractional CPUs. Simulated network time is spent for real.
"""

import base64
import hashlib
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import write_random_world  # noqa: E402
from loadtests.run import each_replica  # noqa: E402
from services.deploy import deploy_config  # noqa: E402

PORT = 8123
METRICS_PORT = 8124  # the shared Ray instance's (tests/conftest.py: SHARED_RAY_METRICS_PORT)
URL = f"http://127.0.0.1:{PORT}"
GEN = f"{URL}/v1/images/generations"
KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "a small red circle at the top on a gray background"
DEVICES = 8
TAU = 0.05


def app_args(weights: str) -> dict:
    # the key by its digest, as serve_config.yaml holds it (Serve logs builder args)
    return {"weights_dir": weights, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "devices": DEVICES,
            "device_num_cpus": 0.1, "device_max_queued_requests": 12, "verifier_num_cpus": 0.5,
            "verifier_max_sessions": 32, "ingress_num_cpus": 0.1, "graceful_shutdown_timeout_s": 0.5, "retry_after_s": 3,
            "allow_simulation_params": True}  # test_link_drop_... drives params.link_drop_after


def deploy(weights: str, app: dict | None = None, **device_live) -> None:
    """A config deploy with live knobs in the deployments' user_config (as serve_config.yaml does). The devices run
    the calibrated point (policy fixed): the tests drive CIAR's mechanics and compare images across requests; on this
    random world an adaptive device gives its later images to the cloud whole (test_adaptive_default_... drives
    the shipped default)."""
    deploy_config({**app_args(weights), **(app or {})}, user_configs={
        "Device": {"tau": TAU, "span": 4, "prefix_rate": 0.06, "realtime": True, "policy": "fixed", **device_live},
        "Verifier": {"max_batch_size": 16, "batch_wait_timeout_s": 0.02, "idle_timeout_s": 30}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_ray):
    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0},
                                 with_device=True)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    deploy(weights)  # the `serve deploy serve_config.yaml` path: import path + args + user_configs
    yield weights
    serve.shutdown()


def post(body, headers=AUTH, timeout=180, **kw):
    return requests.post(GEN, json=body, headers=headers, timeout=timeout, **kw)


def test_healthz(cluster):
    assert requests.get(f"{URL}/healthz", timeout=30).json() == {"status": "ok"}


def test_ciar_png_deterministic_and_equal_to_in_process(cluster):
    from PIL import Image

    body = {"prompt": PROMPT, "seed": 3, "method": "ciar", "response_format": "png"}
    a, b = post(body), post(body)
    assert a.status_code == 200 and a.headers["content-type"] == "image/png", a.text
    assert a.content == b.content
    assert Image.open(io.BytesIO(a.content)).size == (48, 48)

    r = post({**body, "response_format": "tokens"}).json()
    st = r["stats"]
    assert st["method"] == "ciar" and st["total_tokens"] == 144 and st["config"]["tau"] == TAU
    assert 0 < st["cloud_call_rate"] < 1 and st["verifications"] > 0  # some tokens local, some verified
    assert st["comm_s"] > 0 and st["wall_s"] >= st["comm_s"]  # simulated link time was spent for real

    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.world import load_default_world

    world = load_default_world(cluster)
    dec = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", tau=TAU, span=4, prefix_rate=0.06,
                       network="5g")
    local = dec.generate(PROMPT, seed=3)
    assert r["data"][0]["tokens"] == local.tokens.tolist()
    assert st["cloud_requests"] == local.stats.cloud_requests


def test_json_response_and_every_method(cluster):
    for method in ("cloud", "eagle", "code", "entropy"):
        # the random world's device carries no calibrated thresholds: the entropy gate gets one per request
        params = {"tau": 0.5} if method == "entropy" else {}
        r = post({"prompt": PROMPT, "seed": 1, "method": method, "network": "wifi", "params": params})
        assert r.status_code == 200, r.text
        j = r.json()
        assert base64.b64decode(j["data"][0]["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert j["stats"]["method"] == method and j["stats"]["network"] == "wifi"
    assert j["stats"]["total_tokens"] == 144


def test_sjd_and_gsd_through_serve(cluster):
    """The cloud's own Jacobi windows through the cluster: sjd's image is the in-process decoder's, in fewer cloud
    passes than tokens; gsd runs; a Jacobi method without a window is a 422 naming the params."""
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.world import load_default_world

    body = {"prompt": PROMPT, "seed": 4, "method": "sjd", "response_format": "tokens"}
    r = post(body).json()
    st = r["stats"]
    assert st["method"] == "sjd" and st["config"]["jacobi_window"] == 16 and st["cloud_call_rate"] == 1.0
    assert st["cloud_requests"] == 1 and st["cloud_forward_passes"] < 144
    world = load_default_world(cluster)
    local = make_decoder(world, make_verifier(world, max_sessions=1), "sjd", network="5g").generate(PROMPT, seed=4)
    assert r["data"][0]["tokens"] == local.tokens.tolist()
    g = post({**body, "method": "gsd"})
    assert g.status_code == 200 and g.json()["stats"]["config"]["rule"] == "gsd", g.text
    bad = post({**body, "params": {"jacobi_window": 0}})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "params", bad.text


def test_via_handle(cluster):
    h = serve.get_deployment_handle("Device", app_name="ciar")
    job = {"session_id": "handle-test", "prompt": PROMPT, "seed": 5, "method": "ciar", "network": "5g"}
    out = h.generate.remote(job).result(timeout_s=180)  # a dict job is validated into a GenerationJob
    assert out.png[:8] == b"\x89PNG\r\n\x1a\n" and len(out.tokens) == 144 == len(out.who)
    http = post({"prompt": PROMPT, "seed": 5, "method": "ciar", "response_format": "tokens"}).json()
    assert http["data"][0]["tokens"] == out.tokens and http["data"][0]["who"] == out.who


def test_concurrent_devices_batch_spans(cluster):
    bodies = [{"prompt": f"a large blue square at the bottom {i}", "seed": i, "method": "eagle", "network": "4g",
               "response_format": "tokens"} for i in range(DEVICES)]
    with ThreadPoolExecutor(DEVICES) as pool:
        rs = list(pool.map(post, bodies))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    stats = [r.json()["stats"] for r in rs]
    devices = {s["device_id"] for s in stats}
    assert len(devices) >= DEVICES // 2, devices  # a phone makes one image at a time
    assert max(s["verifier_batch_size"]["max"] for s in stats) > 1  # spans of several sessions in one forward
    vstats = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result()
    assert any(int(size) > 1 for size in vstats["batch_size_hist"]), vstats
    # the engine's options as configured (serve_config.yaml: neither; a GPU configuration may turn them on)
    assert (vstats["overlap"], vstats["packed_step"], vstats["decodes_run_ahead"]["run"]) == (False, False, 0)
    assert vstats["compiled_judge"] is False
    assert vstats["heap"]["frozen"] > 0  # the replica froze its start-up out of the collector's reach


def test_prometheus_metrics(cluster):
    """The application's own metrics reach Ray's Prometheus endpoint (after at least one generation; over a link, so
    that its latency has a communication part whichever tests ran before)."""
    post({"prompt": PROMPT, "seed": 0, "method": "ciar", "network": "5g", "response_format": "tokens"})
    want = ("ray_ciar_requests_total", "ray_ciar_cloud_calls_total", "ray_ciar_latency_seconds",
            "ray_ciar_verifier_batch_size", "ray_ciar_verifier_spans_total", "ray_ciar_accepted_length",
            'part="comm"', 'method="ciar"')  # (waited for too: this image's series come with a later export)
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        try:
            text = requests.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
        except requests.RequestException:
            text = ""
        if all(name in text for name in want):
            break
        time.sleep(2)
    missing = [name for name in want if name not in text]
    assert not missing, missing


def test_unauthorized(cluster):
    body = {"prompt": PROMPT}
    for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": KEY}):
        r = post(body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["field"] == "authorization", r.text
        assert r.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": ""}, 422, "prompt"),
    ({"prompt": "   "}, 422, "prompt"),
    ({"prompt": "x" * 401}, 422, "prompt"),
    ({"prompt": "red " * 80}, 422, "prompt"),  # under 400 characters, over the caption encoder's 40 tokens
    ({"prompt": PROMPT, "method": "dalle"}, 422, "method"),
    ({"prompt": PROMPT, "params": {"tau": -1}}, 422, "params.tau"),
    ({"prompt": PROMPT, "params": {"span": 0}}, 422, "params.span"),
    ({"prompt": PROMPT, "params": {"top_p": 0}}, 422, "params.top_p"),
    ({"prompt": PROMPT, "params": {"bogus": 1}}, 422, "params.bogus"),
    ({"prompt": PROMPT, "seed": -1}, 422, "seed"),
    ({"prompt": PROMPT, "network": "3g"}, 422, "network"),
    ({"prompt": PROMPT, "response_format": "gif"}, 422, "response_format"),
    ({"seed": 1}, 422, "prompt"),
])
def test_bad_input_is_4xx_naming_the_field(cluster, body, status, field):
    r = post(body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"], err


def test_bad_bodies(cluster):
    r = requests.post(GEN, data="{not json", headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    r = requests.post(GEN, data=json.dumps({"prompt": "x" * 20000}), headers=AUTH, timeout=30)
    assert r.status_code == 413
    r = requests.post(GEN, data="[1, 2]", headers=AUTH, timeout=30)
    assert r.status_code == 422


def test_session_cannot_be_driven_by_another_device(cluster):
    import torch

    from ciar.collab.protocol import OpenRequest, VerifyRequest
    from ciar.decoding.sampling import SamplingParams

    v = serve.get_deployment_handle("Verifier", app_name="ciar")
    sid = "owned-session"
    reply, token = v.options(session_id=sid).open.remote(OpenRequest(sid, PROMPT, 0, SamplingParams(), 4), session_id=sid,
                                 device_id="phone-a").result()
    req = VerifyRequest(sid, torch.zeros(0, dtype=torch.long), torch.tensor([1]), torch.full((1, 1024), 1 / 1024))
    with pytest.raises(PermissionError):
        v.options(session_id=sid).verify.remote(req, session_id=sid, device_id="phone-b", token=token).result()
    with pytest.raises(PermissionError):
        v.options(session_id=sid).verify.remote(req, session_id=sid, device_id="phone-a", token="0" * 64).result()
    ok = v.options(session_id=sid).verify.remote(req, session_id=sid, device_id="phone-a", token=token).result()
    assert ok.num_accepted in (0, 1)
    v.options(session_id=sid).close.remote(session_id=sid, device_id="phone-a", token=token).result()


def test_full_verifier_answers_503(cluster):
    """Every KV-cache slot held by live (not idle) sessions: a new generation is refused with 503 + Retry-After."""
    from ciar.collab.protocol import OpenRequest
    from ciar.decoding.sampling import SamplingParams

    v = serve.get_deployment_handle("Verifier", app_name="ciar")
    held = []
    try:
        for i in range(32):  # verifier_max_sessions = 32 sessions (a cond + an uncond slot each)
            sid = f"filler-{i}"
            _, token = v.open.remote(OpenRequest(sid, PROMPT, 0, SamplingParams(cfg_scale=2.0), 0),
                                     session_id=sid, device_id="filler").result()
            held.append((sid, token))
        r = post({"prompt": PROMPT, "seed": 0, "method": "ciar"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
        assert "KV-cache" in r.json()["error"]["message"]
    finally:
        for sid, token in held:
            v.options(session_id=sid).close.remote(session_id=sid, device_id="filler", token=token).result()
    assert post({"prompt": PROMPT, "seed": 0, "method": "ciar"}).status_code == 200


def test_stream_sends_progress_and_previews(cluster):
    body = {"prompt": PROMPT, "seed": 3, "method": "ciar", "stream": True, "response_format": "tokens"}
    events = []
    with post(body, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                events.append([line[7:], None])
            elif line.startswith("data: "):
                events[-1][1] = json.loads(line[6:])
    kinds = [e for e, _ in events]
    assert kinds[-1] == "result" and kinds.count("progress") >= 3
    done = [d["tokens_done"] for e, d in events if e == "progress"]
    assert done == sorted(done) and done[-1] == 144
    assert any("preview_b64" in d for e, d in events if e == "progress")
    plain = post({**body, "stream": False}).json()
    assert events[-1][1]["data"][0]["tokens"] == plain["data"][0]["tokens"]


def test_overload_answers_503_with_retry_after(cluster):
    # 8 devices busy + 12 queued: the rest must be refused at once, never queued without bound
    body = {"prompt": PROMPT, "seed": 0, "method": "cloud", "network": "4g", "response_format": "tokens"}
    with ThreadPoolExecutor(36) as pool:
        rs = list(pool.map(lambda _: post(body), range(36)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and codes.count(200) >= DEVICES, codes
    r503 = next(r for r in rs if r.status_code == 503)
    assert r503.headers["retry-after"] == "3" and r503.json()["error"]["type"] == "overloaded"


def replica_actors(kind: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if kind in a["name"]}


def test_uncalibrated_gate_is_a_422_naming_the_threshold(cluster):
    r = post({"prompt": PROMPT, "seed": 1, "method": "softmax", "network": "wifi"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "params.tau"
    assert "pipelines.calibrate" in r.json()["error"]["message"]


def test_reconfigure_changes_tau_live(cluster):
    body = {"prompt": PROMPT, "seed": 2, "method": "ciar", "response_format": "tokens"}
    before = post(body).json()["stats"]
    devices = replica_actors("Device")
    assert len(devices) == DEVICES and before["config"]["tau"] == TAU
    try:
        deploy(cluster, tau=1e6)
        local = post(body).json()["stats"]
        assert local["config"]["tau"] == 1e6 and local["verifications"] == 0 and local["device_tokens"] > 0
        deploy(cluster, tau=0.0)
        every = post(body).json()["stats"]
        assert every["config"]["tau"] == 0.0 and every["device_tokens"] == 0
        assert replica_actors("Device") == devices  # the same replicas, reconfigured live (not restarted)
    finally:
        deploy(cluster)
    assert post(body).json()["stats"]["config"]["tau"] == TAU


def test_adaptive_default_reports_its_point_and_the_point_reproduces_the_image(cluster):
    """The shipped default (policy adaptive, per request here): every image reports the operating point it ran at,
    and the same request with that point as fixed knobs (or cloud-only's prefix_rate 1) makes the same image, through
    the same Serve application. Several requests land on the devices, so some decide from costs they observed; even
    a device's first image is chosen, from its handshake, a timed step and the verifier's hint (`Verifier.cost_hint`,
    which has figures once it has verified a span: the fixed image first)."""
    warm = post({"prompt": PROMPT, "seed": 99, "method": "ciar", "response_format": "tokens",
                 "params": {"policy": "fixed"}})
    assert warm.status_code == 200 and warm.json()["stats"]["verifications"] > 0
    seen = set()
    for seed in range(6):
        body = {"prompt": PROMPT, "seed": seed, "method": "ciar", "response_format": "tokens",
                "params": {"policy": "adaptive"}}
        r = post(body)
        assert r.status_code == 200, r.text
        st, tokens = r.json()["stats"], r.json()["data"][0]["tokens"]
        assert st["config"]["policy"] == "adaptive" and st["handovers"] in (0, 1) and st["adapted"] in (0, 1)
        # durations the device measured; the link's latency is a fitted line's intercept, which noise on a busy box
        # can push below zero on loopback (clipped to 0: a fresh-clone run with another job on the cores saw 0.0)
        assert st["est_cloud_step_s"] > 0 and st["est_device_step_s"] > 0 and st["est_link_latency_s"] >= 0
        if st["handovers"]:
            assert (st["span_used"], st["burst_used"]) == (0, 0) and st["verifications"] == 0
            point = {"prefix_rate": 1.0}
        else:
            assert st["span_used"] >= 4 and st["burst_used"] >= st["config"]["burst"]
            point = {"span": st["span_used"], "burst": st["burst_used"]}
        seen.add(st["handovers"])
        again = post({**body, "params": {"policy": "fixed", **point}})
        assert again.status_code == 200 and again.json()["data"][0]["tokens"] == tokens
    assert seen  # at least one image; which points occur depends on the costs the devices saw


def test_link_drop_degrades_to_device_only_and_leaves_no_state(cluster):
    body = {"prompt": PROMPT, "seed": 4, "method": "ciar", "network": "5g", "response_format": "tokens",
            "params": {"link_drop_after": 4}}  # the open and one verify get through, then the link is down
    r = post(body)
    assert r.status_code == 200, r.text
    st = r.json()["stats"]
    assert st["degraded"] == 1 and 0 < st["degraded_tokens"] < 144 and st["total_tokens"] == 144
    assert len(r.json()["data"][0]["tokens"]) == 144 and st["cloud_requests"] == 2
    png = post({**body, "response_format": "png"})
    assert png.status_code == 200 and png.headers["x-ciar-degraded"] == "1"
    fine = post({**body, "params": {}, "response_format": "png"})
    assert fine.status_code == 200 and fine.headers["x-ciar-degraded"] == "0"
    gone = post({**body, "params": {"link_drop_after": 0}})  # no caption encoding without the open: refused
    assert gone.status_code == 503 and gone.json()["error"]["type"] == "unavailable" and gone.headers["retry-after"]
    # every phone is idle and holds nothing; the verifier holds no session
    h = serve.get_deployment_handle("Device", app_name="ciar")
    states = each_replica(lambda: h.state.remote().result(timeout_s=60), "device_id", DEVICES, tries_per_replica=12)
    assert len(states) == DEVICES
    for one in states.values():
        assert (one["busy"], one["session_tokens"], one["batch_size_records"], one["tracked_sessions"]) == \
            (False, 0, 0, 0), one
        assert one["heap"]["frozen"] > 0  # each phone's start-up out of the collector's reach
    ingress = serve.get_deployment_handle("Ingress", app_name="ciar").heap_stats.remote().result(timeout_s=60)
    assert ingress["frozen"] > 0 and len(ingress["pause_max_ms"]) == 3
    v = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result(timeout_s=60)
    assert v["sessions"] == 0


@pytest.mark.slow  # 1-4 min depending on what hypothesis draws; run with `make test-slow`
def test_fuzz_http_api_never_answers_5xx(cluster):
    """Random JSON bodies (hypothesis, loadtests.fuzz's strategies): every answer is 2xx or a 4xx / 503 with a
    message, never another 5xx. Devices are reconfigured live to skip the simulated waits while fuzzing (valid
    bodies still generate for real)."""
    from loadtests.fuzz import Fuzzer

    f = Fuzzer(URL, KEY, timeout_s=180)
    deploy(cluster, realtime=False)
    try:
        f.run(examples=120, seed=0)
    finally:
        deploy(cluster)
    assert not f.failures, f.failures[:3]
    assert f.requests >= 100 and f.by_status.get("200", 0) >= 1, f.by_status


def test_verifier_replica_killed_mid_request(cluster):
    body = {"prompt": PROMPT, "seed": 7, "method": "ciar", "stream": True, "response_format": "tokens",
            "network": "4g"}  # tau = TAU: some tokens accepted locally, their interval features must be re-sent
    killed = threading.Event()

    def kill_verifier():
        for name in ray.util.list_named_actors(all_namespaces=True):
            if "Verifier" in name["name"]:
                ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
        killed.set()

    result = None
    with post(body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        event = None
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "progress" and data["tokens_done"] > 20 and not killed.is_set():
                    kill_verifier()
                if event == "result":
                    result = data
                assert event != "error", data
    assert killed.is_set() and result is not None
    st = result["stats"]
    assert st["total_tokens"] == 144 and st["resumes"] >= 1
    # exact despite the re-prefill on the new replica: same tokens as an undisturbed run
    again = post({**body, "stream": False}).json()
    assert again["data"][0]["tokens"] == result["data"][0]["tokens"] and again["stats"]["resumes"] == 0


def test_the_verifier_with_its_engine_in_a_process_of_its_own_answers_as_with_its_thread(cluster):
    """The Verifier deployment's class with `verifier_engine_process` (its engine core in a process of its own,
    which loads the world: `ciar.engine.process`) beside the same class with its engine thread, in this process:
    concurrent sessions' calls give the same replies, and its stats and metrics come from the core. (Through Serve:
    the slow test below.)"""
    import asyncio

    import torch

    from ciar.collab.protocol import OpenRequest, VerifyRequest
    from ciar.decoding.sampling import SamplingParams
    from services.config import AppConfig
    from services.verifier import Verifier

    world = AppConfig(**app_args(cluster)).world_dict()

    async def calls(v):
        async def session(i):
            sid = f"v{i}"
            reply, token = await v.open(OpenRequest(sid, PROMPT, i, SamplingParams(cfg_scale=2.0), 3),
                                        session_id=sid, device_id="d")
            got = [reply.prefix_tokens.tolist()]
            for r in range(3):
                g = torch.Generator().manual_seed(10 * i + r)
                q = torch.softmax(torch.randn(4, v.vocab_size, generator=g), -1)
                span = VerifyRequest(sid, torch.zeros(0, dtype=torch.long), torch.multinomial(q, 1, generator=g)[:, 0],
                                     q.half(), burst=2)
                out = await v.verify(span, session_id=sid, device_id="d", token=token)
                got.append((out.num_accepted, out.next_token, out.burst_tokens.tolist() if out.num_burst else []))
            await v.close(session_id=sid, device_id="d", token=token)
            return got

        replies = await asyncio.gather(*(session(i) for i in range(3)))
        return replies, await v.stats()

    thread = Verifier(world, 4, "secret")
    try:
        want, _ = asyncio.run(calls(thread))
    finally:
        thread.service.shutdown()
    process = Verifier(world, 4, "secret", engine_process=True)
    try:
        got, st = asyncio.run(calls(process))
        process.check_health()
    finally:
        process.service.shutdown()
    assert got == want
    assert st["engine_process"] == process.service.proc.pid and st["core_rss_mb"] > 0 and st["opened"] == 3
    assert st["spans_verified"] == 9 and sum(st["batch_size_hist"].values()) == st["forwards"] > 0


@pytest.mark.slow  # (a redeploy: about a minute on 2 cores; the test above runs the same class in this process)
def test_the_engine_core_in_a_process_of_its_own_makes_the_same_images(cluster):
    """verifier_engine_process: the Verifier replica starts its engine core in a process of its own, which loads
    the world and serves the replica's calls (`ciar.engine.process`). Images made one at a time and concurrently
    (spans of several sessions in its steps) are the engine thread's, token for token; the replica's stats come
    from the core. Last in the module: it leaves the deployment as it redeployed it."""
    bodies = [{"prompt": f"{PROMPT} {i}", "seed": i, "method": method, "response_format": "tokens"}
              for i, method in enumerate(["ciar", "eagle", "ciar"])]

    def images():
        first = post(bodies[0])
        with ThreadPoolExecutor(2) as pool:
            rs = [first] + list(pool.map(post, bodies[1:]))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["data"][0]["tokens"] for r in rs]

    want = images()
    deploy(cluster, app={"verifier_engine_process": True})  # (the module's last test: its deployment stays)
    got = images()
    vstats = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result()
    assert got == want
    assert vstats["engine_process"] and vstats["core_rss_mb"] > 0 and vstats["forwards"] > 0
    assert vstats["spans_verified"] > 0 and sum(vstats["batch_size_hist"].values()) == vstats["forwards"]
