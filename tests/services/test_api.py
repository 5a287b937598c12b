"""The HTTP API in its ecosystem, against the real Serve application (ingress, 4 simulated devices, a verifier) over
a small RANDOM-weight world: the official `openai` client, the OpenAPI contract (document checks and a short
schemathesis run with its default checks), and the playground page in a real headless browser (Debian's chromium
through Playwright; `make test` installs it).

One Ray instance for the module; simulated waits are off (realtime: false) so generations run at compute speed.
"""

import base64
import hashlib
import io
import os

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.collab.names import METHODS, NETWORKS  # noqa: E402
from ciar.testing import write_random_world  # noqa: E402
from services.deploy import deploy_config  # noqa: E402

PORT = 8133
URL = f"http://127.0.0.1:{PORT}"
KEY = "api-test-key-0123456789"
DEVICE_KEY = "api-test-device-key-42"
PROMPT = "a small red circle at the top on a gray background"
TAU = 0.05
SIZE = "48x48"  # the random world: 12 x 12 tokens, downsampling 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_ray):
    # the device file carries its gate's threshold as a calibrated one does (the browser device reads it)
    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0},
                                 with_device=True, ciar_defaults={"gate": "interval", "taus": {"interval": TAU},
                                                                  "span": 4})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {"weights_dir": weights, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "devices": 4,
            "max_images": 3, "device_num_cpus": 0.1, "verifier_num_cpus": 0.5, "verifier_max_sessions": 32,
            "ingress_num_cpus": 0.1, "graceful_shutdown_timeout_s": 0.5, "retry_after_s": 3,
            "device_key_sha256": [hashlib.sha256(DEVICE_KEY.encode()).hexdigest()]}
    # the calibrated point (policy fixed): these tests drive CIAR's mechanics (previews, the token map, the
    # browser's comparison); on this random world an adaptive device gives its later images to the cloud whole
    deploy_config(args, user_configs={"Device": {"tau": TAU, "span": 4, "prefix_rate": 0.06, "realtime": False,
                                                 "preview_every": 16, "policy": "fixed"}})
    yield {"weights": weights, "alias": os.path.basename(weights)}
    serve.shutdown()


@pytest.fixture
def client(cluster):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{URL}/v1", api_key=KEY, max_retries=0, timeout=300)


def png_image(b64: str):
    from PIL import Image

    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(raw))


# ---------------------------------------------------------------------------------------------- OpenAI client
def test_openai_client_with_model_n_and_size(cluster, client):
    r = client.images.generate(prompt=PROMPT, model="ciar", n=2, size=SIZE, response_format="b64_json",
                               quality="standard", style="natural", user="tester-1", extra_body={"seed": 7})
    assert len(r.data) == 2
    images = [png_image(d.b64_json) for d in r.data]
    assert all(im.size == (48, 48) for im in images)
    extra = [d.model_extra for d in r.data]  # our fields ride along: per-image seed, stats and who made each token
    assert [e["seed"] for e in extra] == [7, 8]
    assert all(e["stats"]["method"] == "ciar" and e["stats"]["total_tokens"] == 144 for e in extra)
    assert extra[0]["stats"]["device_id"] != extra[1]["stats"]["device_id"]  # n images on n devices at once
    assert r.data[0].b64_json != r.data[1].b64_json  # seed + i

    # image i is the single image of seed + i
    one = client.images.generate(prompt=PROMPT, model="ciar", size=SIZE, extra_body={"seed": 8})
    assert one.data[0].b64_json == r.data[1].b64_json


def test_openai_client_model_is_a_method_or_the_world(cluster, client):
    cloud = client.images.generate(prompt=PROMPT, model="cloud", extra_body={"seed": 1})
    assert cloud.data[0].model_extra["stats"]["method"] == "cloud"
    world = client.images.generate(prompt=PROMPT, model=cluster["alias"], extra_body={"seed": 1})
    assert world.data[0].model_extra["stats"]["method"] == "ciar"  # the world alias: the default method applies
    auto = client.images.generate(prompt=PROMPT, size="auto", extra_body={"seed": 1})
    assert auto.data[0].b64_json == world.data[0].b64_json


def test_openai_client_errors_name_the_field(cluster, client):
    import openai

    cases = [({"size": "1024x1024"}, "size", SIZE), ({"model": "dall-e-3"}, "model", "GET /v1/models"),
             ({"n": 4}, "n", "at most 3"), ({"response_format": "url"}, "response_format", "b64_json")]
    for kwargs, field, hint in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt=PROMPT, **kwargs)
        err = e.value.body
        assert e.value.status_code == 400 and err["field"] == field and hint in err["message"], err
    for method in ("ciar", "cloud"):  # two names of one knob: `model` naming a method, or `method` (the schema's not)
        with pytest.raises(openai.UnprocessableEntityError) as e:
            client.images.generate(prompt=PROMPT, model="cloud", extra_body={"method": method})
        err = e.value.body
        assert err["field"] == "method" and "`model` or `method`, not both" in err["message"], err
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.generate(prompt=PROMPT, n=0)
    assert e.value.body["field"] == "n"
    for extra in ({"response_format": "png"}, {"stream": True}):  # the schema's allOf states it (issue 36): 422
        r = requests.post(f"{URL}/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"prompt": PROMPT, "n": 2, "size": SIZE, **extra})
        assert r.status_code == 422 and r.json()["error"]["field"] == "n", r.text
    bad = type(client)(base_url=f"{URL}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.images.generate(prompt=PROMPT)


def test_openai_client_lists_the_models(cluster, client):
    models = {m.id: m.model_extra for m in client.models.list()}
    assert set(models) == set(METHODS) | {cluster["alias"]}
    assert models[cluster["alias"]]["kind"] == "world" and models["ciar"]["kind"] == "method"
    assert all(m["sizes"] == [SIZE] for m in models.values())


def test_tokens_carry_who_made_each_one(cluster):
    r = requests.post(f"{URL}/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                      json={"prompt": PROMPT, "seed": 3, "response_format": "tokens"}).json()
    item, st = r["data"][0], r["stats"]
    assert len(item["who"]) == len(item["tokens"]) == 144 and set(item["who"]) <= {"cloud", "device"}
    assert item["who"].count("cloud") == st["cloud_tokens"] and item["who"].count("device") == st["device_tokens"]
    prefix = st["prefix_tokens"]
    assert prefix > 0 and item["who"][:prefix] == ["cloud"] * prefix  # prefix injection: the cloud starts


# ---------------------------------------------------------------------------------------------- OpenAPI contract
def test_openapi_documents_bodies_answers_and_errors(cluster):
    doc = requests.get(f"{URL}/openapi.json", timeout=60).json()
    op = doc["paths"]["/v1/images/generations"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    props = doc["components"]["schemas"][body]["properties"]
    assert {"prompt", "model", "n", "size", "response_format", "user", "quality", "style", "seed", "method",
            "params", "network", "stream"} <= set(props)
    assert props["size"]["anyOf"][0]["enum"] == [SIZE, "auto"] and props["n"]["maximum"] == 3
    assert props["method"]["enum"] == list(METHODS) and props["network"]["enum"] == list(NETWORKS)
    assert doc["components"]["schemas"][body]["not"] == {"required": ["model", "method"],
                                                         "properties": {"model": {"enum": list(METHODS)}}}
    assert {"not": {"required": ["n", "response_format"], "properties": {"n": {"minimum": 2}, "response_format": {
        "const": "png"}}}} in doc["components"]["schemas"][body]["allOf"]  # n > 1 answers JSON without stream
    for status in ("400", "401", "413", "422", "500", "503", "504"):
        content = op["responses"][status]["content"]["application/json"]["schema"]
        assert content["$ref"].endswith("/ErrorResponse"), status
    assert "Retry-After" in op["responses"]["503"]["headers"]
    ok = op["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ImagesResponse") and "image/png" in ok
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert "/v1/models" in doc["paths"] and requests.get(f"{URL}/docs", timeout=60).status_code == 200


@pytest.mark.parametrize("fuzz_s", [pytest.param(30, id="fuzz-30s"),
                                     pytest.param(300, id="fuzz-300s", marks=pytest.mark.slow)])
def test_schemathesis_finds_nothing(cluster, tmp_path, fuzz_s):
    """The coverage phase in full (every documented boundary, negative cases included: 223 cases in ~8 s), then
    fuzzing until the run's time box: ~20 s in the fast suite, ~290 s in the slow one (fuzzing runs at ~1.3 cases a
    second here and does not end by itself)."""
    pytest.importorskip("schemathesis")
    from loadtests.contract import run_contract

    out = run_contract(URL, KEY, examples=10, seed=0, phases="coverage,fuzzing", max_time_s=fuzz_s,
                       report_dir=str(tmp_path))
    assert KEY not in out["output"] and KEY not in out["command"]
    assert out["ok"], out["output"]
    assert "Coverage (in" in out["output"] and "Fuzzing (in" in out["output"]  # both phases ran


# ---------------------------------------------------------------------------------------------- playground
def test_playground_in_a_headless_browser(cluster, tmp_path):
    pytest.importorskip("playwright")
    from loadtests.playground import chromium_path, drive

    if chromium_path() is None:
        pytest.fail("no chromium: `make test` installs Debian's (apt-get install chromium), or set CIAR_CHROMIUM")
    page = requests.get(f"{URL}/", timeout=60)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from the internet

    shown = drive(URL, KEY, PROMPT, method="ciar", network="5g", seed=2, shots=str(tmp_path))
    assert shown["state"] == "done", shown["status"]
    assert shown["methods"] == list(METHODS) and shown["networks"] == list(NETWORKS)
    assert shown["previews"] >= 1  # the image built up from the stream's previews
    assert shown["image_src_prefix"] == "data:image/png;base64,"
    st = shown["stats"]
    assert st["method"] == "ciar" and st["tokens"] == "144" and int(st["cloud requests"]) >= 1
    cells = shown["overlay_cells"]  # the token map drawn over the image: every token coloured, both kinds present
    assert shown["overlay_visible"] and cells["none"] == 0 and cells["device"] > 0 and cells["cloud"] > 0
    assert cells["device"] + cells["cloud"] == 144
    assert st["decided by the cloud"] == str(cells["cloud"])
    for shot in ("playground-running.png", "playground-done.png"):
        assert (tmp_path / shot).stat().st_size > 10_000


@pytest.mark.parametrize("name, value", [("device_slowdown", 50.0), ("link_drop_after", 0),
                                         ("device_exit_after", 0)])
def test_simulation_knobs_are_an_operators_not_a_clients(cluster, name, value):
    """A deployment that does not set allow_simulation_params (the shipped configs) refuses them, naming the field."""
    r = requests.post(f"{URL}/v1/images/generations", json={"prompt": PROMPT, "params": {name: value}},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["field"] == f"params.{name}", r.text


def test_a_real_device_over_the_websocket_endpoint(cluster):
    """A simulated phone (`CollabDecoder`) over the device endpoint of the Serve application (WebSocket through Serve's proxy to
    the ingress, then the Verifier handle routed by session): the same tokens as in process, also when the socket is
    cut mid-image with a verify in flight; a wrong key is closed with its reason."""
    import torch

    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.testing import cutting_connection
    from ciar.world import load_default_world
    from ciar_device.connection import ConnectionRefused, DeviceConnection

    world = load_default_world(cluster["weights"])
    knobs = dict(tau=TAU, span=4, prefix_rate=0.06, network="none", policy="fixed")  # the channel, not the policy
    local = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", **knobs).generate(PROMPT, seed=5,
                                                                                          session_id="ws-img")
    ws = f"ws://127.0.0.1:{PORT}"
    vocab = world.cloud.config.vocab_size
    for cuts in ((), (2,)):
        conn = cutting_connection(ws, DEVICE_KEY, vocab, cuts=cuts, array=torch.from_numpy, backoff_s=0.05)
        dec = CollabDecoder(world.device_model, conn, method_config("ciar", **knobs), world.sampling,
                            num_tokens=world.cloud.config.block_size)
        out = dec.generate(PROMPT, seed=5, session_id="ws-img")
        assert out.tokens.tolist() == local.tokens.tolist(), cuts
        assert conn.resumes == len(cuts) and out.stats.bytes_up == local.stats.bytes_up
        conn.disconnect()
    with pytest.raises(ConnectionRefused, match="unknown device key"):
        DeviceConnection(ws, KEY, vocab).connect()  # an API key is not a device key


def test_the_device_model_is_served_to_devices(cluster, tmp_path):
    """GET /v1/device/model (a device key) serves the export's manifest and graphs; the client's fetch verifies and
    caches them; an API key or none is refused; before the export the answer says how to make it."""
    from ciar_device.fetch import fetch_model
    from ciar_device.runtime import read_manifest
    from pipelines.export_onnx import export_onnx

    r = requests.get(f"{URL}/v1/device/model", headers={"Authorization": f"Bearer {DEVICE_KEY}"}, timeout=60)
    assert r.status_code == 404 and "pipelines.export_onnx" in r.json()["error"]["message"]
    manifest = export_onnx({"kind": "scenes", "weights": cluster["weights"]}, None)
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        assert requests.get(f"{URL}/v1/device/model", headers=headers, timeout=60).status_code == 401
    r = requests.get(f"{URL}/v1/device/model/..%2Fcloud.safetensors",
                     headers={"Authorization": f"Bearer {DEVICE_KEY}"}, timeout=60)
    assert r.status_code == 404
    folder = fetch_model(f"ws://127.0.0.1:{PORT}", DEVICE_KEY, cache_dir=str(tmp_path))
    assert read_manifest(folder)["graphs"] == manifest["graphs"]
    assert fetch_model(f"ws://127.0.0.1:{PORT}", DEVICE_KEY, cache_dir=str(tmp_path)) == folder  # cached


def test_the_browser_runtime_is_served_from_the_install(cluster):
    """GET /web/ort/ says whether onnxruntime-web is installed (`make web`); its files are served with their
    content types, byte for byte; an encoded or absolute traversal is a 404 (services.web; more in test_web.py)."""
    from services import web

    status = requests.get(f"{URL}/web/ort/", timeout=60).json()
    assert status == web.ort_status()
    for name in ("..%2Fpackage.json", "%2e%2e%2F%2e%2e%2Fpackage.json", "%2Fetc%2Fpasswd", "ort.min.mjs.map"):
        assert requests.get(f"{URL}/web/ort/{name}", timeout=60).status_code == 404  # ours, or no route matched
    if not status["available"]:
        assert "make web" in requests.get(f"{URL}/web/ort/ort.min.mjs", timeout=60).json()["error"]["message"]
        pytest.skip("onnxruntime-web is not installed: run `make web`")
    for name in (status["entry"], "ort-wasm-simd-threaded.jsep.wasm"):
        r = requests.get(f"{URL}/web/ort/{name}", timeout=60)
        path, media_type = web.ort_file(name)
        with open(path, "rb") as f:
            assert r.status_code == 200 and r.content == f.read()
        assert r.headers["content-type"].split(";")[0] == media_type


def test_the_browser_is_the_device_in_a_headless_browser(cluster, tmp_path):
    """The playground's browser mode in chromium: the tab downloads the device model, runs it on onnxruntime-web in
    a Web Worker, drafts and gates every token, sends the uncertain spans over the device endpoint; three prompts
    each finish with an image, the token map and the tab's stats beside the cluster device's for the same prompt and
    seed (different draws, so different tokens: a loose bound on the cloud-call rates). The tab drafts at the
    calibrated point (?policy=fixed): under the adaptive default this box's wasm step (~10 ms, as long as the
    verifier's) can give its images to the cloud whole, which is the node harness's test (tests/device)."""
    pytest.importorskip("playwright")
    from loadtests.playground import chromium_path, drive
    from pipelines.export_onnx import export_onnx

    if chromium_path() is None:
        pytest.fail("no chromium: `make test` installs Debian's (apt-get install chromium), or set CIAR_CHROMIUM")
    if not requests.get(f"{URL}/web/ort/", timeout=60).json()["available"]:
        pytest.fail("onnxruntime-web is not installed: `make test` runs `make web` (npm ci --prefix web)")
    export_onnx({"kind": "scenes", "weights": cluster["weights"]}, None)
    prompts = [("a large blue square at the bottom right on a white background", 3),
               ("a small green triangle at the center on a black background", 4)]
    shown = drive(URL, KEY, PROMPT, network="5g", seed=2, shots=str(tmp_path), device="browser",
                  device_key=DEVICE_KEY, prompts=prompts, timeout_s=240, policy="fixed")
    assert not [m for m in shown["console"] if "pageerror" in m], shown["console"]
    rates = []
    for one in [shown] + shown["more"]:
        assert one["state"] == "done", (one["status"], shown["console"])
        assert one["previews"] >= 1 and one["image_src_prefix"] == "data:image/png;base64,"
        mine, theirs = one["stats"], one["cluster_stats"]
        assert mine["device"] == "this browser" and mine["tokens"] == "144" and int(mine["cloud requests"]) >= 1
        assert theirs["method"] == "ciar" and theirs["tokens"] == "144"
        cells = one["overlay"]  # the tab's token map: every token coloured
        assert cells["none"] == 0 and cells["device"] + cells["cloud"] == 144
        assert mine["decided by the cloud"] == str(cells["cloud"])
        assert float(mine["device ms / token"]) > 0 and float(mine["round trip ms"]) > 0
        rates.append((float(mine["cloud-call rate"]), float(theirs["cloud-call rate"])))
    browser, cluster_device = (sum(r) / len(rates) for r in zip(*rates))
    assert 0 < browser < 1 and abs(browser - cluster_device) < 0.25, rates
    for shot in ("playground-browser-running.png", "playground-browser-done.png"):
        assert (tmp_path / shot).stat().st_size > 10_000


def test_the_page_says_how_to_enable_the_browser_device(cluster):
    """Where onnxruntime-web is not installed (GET /web/ort/ says so; here the answer is replaced in the browser), the
    page disables "this browser" and shows the server's message naming `make web`; the cluster device still works."""
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright

    from loadtests.playground import BROWSER_CHECKED, CHROMIUM_ARGS, chromium_path
    from services.web import ENABLE

    if chromium_path() is None:
        pytest.fail("no chromium: `make test` installs Debian's (apt-get install chromium), or set CIAR_CHROMIUM")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.route("**/web/ort/", lambda route: route.fulfill(
                json={"available": False, "message": ENABLE}))
            page.goto(f"{URL}/?device=browser", timeout=120_000)
            page.wait_for_function(BROWSER_CHECKED, timeout=120_000)
            assert page.is_disabled('#devicemode option[value="browser"]')
            assert page.input_value("#devicemode") == "cluster"
            note = page.inner_text("#browsernote")
            assert page.is_visible("#browsernote") and "make web" in note and "node and npm" in note
        finally:
            browser.close()
