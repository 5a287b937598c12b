"""The Serve application for real: Ray Serve in-process, HTTP requests against the ingress (random-weight world).

One Ray instance per module; replicas get fractional CPUs.
"""

import base64
import io
import os

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import write_random_world  # noqa: E402

PORT = 8123
URL = f"http://127.0.0.1:{PORT}"
PROMPT = "a small red circle at the top on a gray background"


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0})
    # a loaded 2-core CI box can miss Serve's 5 s proxy readiness check; these are read by the controller,
    # which inherits the driver's environment when ray.init starts the local cluster
    for var, value in (("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60"), ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60"),
                       ("RAY_SERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", "1")):
        os.environ.setdefault(var, value)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    from services.app import build_app

    serve.run(build_app({"weights_dir": weights, "generator_num_cpus": 0.5}), name="ciar", route_prefix="/")
    yield URL
    serve.shutdown()
    ray.shutdown()


def test_healthz(app_url):
    assert requests.get(f"{app_url}/healthz", timeout=30).json() == {"status": "ok"}


def test_png_is_deterministic_per_seed(app_url):
    from PIL import Image

    body = {"prompt": PROMPT, "seed": 3, "response_format": "png"}
    a = requests.post(f"{app_url}/v1/images/generations", json=body, timeout=120)
    b = requests.post(f"{app_url}/v1/images/generations", json=body, timeout=120)
    assert a.status_code == 200 and a.headers["content-type"] == "image/png", a.text
    assert a.content == b.content
    assert Image.open(io.BytesIO(a.content)).size == (48, 48)


def test_json_response_with_stats(app_url):
    r = requests.post(f"{app_url}/v1/images/generations", json={"prompt": PROMPT, "seed": 1}, timeout=120).json()
    assert base64.b64decode(r["data"][0]["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["stats"]["method"] == "cloud" and r["stats"]["tokens_total"] == 144
    toks = requests.post(f"{app_url}/v1/images/generations",
                         json={"prompt": PROMPT, "seed": 1, "response_format": "tokens"}, timeout=120).json()
    assert len(toks["data"][0]["tokens"]) == 144


@pytest.mark.parametrize("body,field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": PROMPT, "method": "telepathy"}, "method"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "params": {"temperature": -1}}, "temperature"),
    ({"prompt": PROMPT, "unknown": 1}, "unknown"),
    ({"prompt": "red " * 60}, "prompt"),
])
def test_bad_input_is_4xx_naming_the_field(app_url, body, field):
    r = requests.post(f"{app_url}/v1/images/generations", json=body, timeout=120)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text


def test_invalid_json_is_4xx(app_url):
    r = requests.post(f"{app_url}/v1/images/generations", data=b"{not json", timeout=30,
                      headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
