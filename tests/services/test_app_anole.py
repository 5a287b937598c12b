"""The Serve application serving an Anole world for real (issue 39, item 5): RANDOM-weight files in the real layouts
(a transformers Chameleon folder with its tokenizer.json, Chameleon's VQGAN checkpoint + yaml, a CIAR device made from
the decoder: `ciar.testing.write_random_anole_files`), named by a world dict in the builder args. An image over HTTP
(the same image again, and the in-process image of the same world), and a phone over the device endpoint (a
simulated phone on a real WebSocket through Serve's proxy, with a cut socket): the same tokens.

Slow (a Chameleon world's start-up): `make test-slow`. On the test session's shared Ray instance."""

import hashlib
import io

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from services.deploy import deploy_config  # noqa: E402

pytestmark = pytest.mark.slow

PORT = 8135
URL = f"http://127.0.0.1:{PORT}"
KEY = "test-key-anole-0123456"
DEVICE_KEY = "test-device-key-anole-42"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "a red bus"
TAU = 0.05
KNOBS = dict(tau=TAU, span=4, prefix_rate=0.1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from ciar.testing import write_random_anole_files

    root = tmp_path_factory.mktemp("anole-serve")
    return {"kind": "anole", "base_dir": str(root), **write_random_anole_files(str(root))}


@pytest.fixture(scope="module")
def cluster(world, shared_ray):
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        deploy_config({"world": world, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                       "device_key_sha256": [hashlib.sha256(DEVICE_KEY.encode()).hexdigest()], "devices": 2,
                       "device_num_cpus": 0.1, "verifier_num_cpus": 0.5, "verifier_max_sessions": 8,
                       "ingress_num_cpus": 0.1, "graceful_shutdown_timeout_s": 0.5},
                      user_configs={"Device": {**KNOBS, "realtime": False, "policy": "fixed"},
                                    "Verifier": {"max_batch_size": 8, "batch_wait_timeout_s": 0.005}})
        yield world
    finally:
        serve.shutdown()


def post(body):
    return requests.post(f"{URL}/v1/images/generations", json=body, headers=AUTH, timeout=300)


def _local(world, method: str = "ciar", **knobs):
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.world import load_world

    w = load_world(world)
    return w, make_decoder(w, make_verifier(w, max_sessions=1), method, network="none", policy="fixed",
                           **{**KNOBS, **knobs})


def test_an_anole_image_over_http_equals_the_in_process_one(cluster):
    from PIL import Image

    body = {"prompt": PROMPT, "seed": 5, "method": "ciar", "response_format": "png"}
    a, b = post(body), post(body)
    assert a.status_code == 200 and a.headers["content-type"] == "image/png", a.text
    assert a.content == b.content  # same request and seed, same image
    w, dec = _local(cluster)
    side = w.cloud.config.block_size
    assert Image.open(io.BytesIO(a.content)).size[0] > 0

    r = post({**body, "response_format": "tokens"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["stats"]["total_tokens"] == side and got["stats"]["config"]["tau"] == TAU
    # the verifier tokenised the prompt with the world's tokenizer.json: in process, the same world, the same tokens
    assert got["data"][0]["tokens"] == dec.generate(PROMPT, seed=5).tokens.tolist()
    cloud = post({"prompt": PROMPT, "seed": 5, "method": "cloud", "response_format": "tokens"})
    assert cloud.status_code == 200 and cloud.json()["stats"]["cloud_call_rate"] == 1.0


def test_a_phone_over_the_device_endpoint_makes_the_same_tokens(cluster):
    import torch

    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.testing import cutting_connection

    always = dict(KNOBS, gate="always")  # every span verified: several VERIFYs in 16 tokens, so the cut lands on one
    w, dec = _local(cluster, **always)
    local = dec.generate(PROMPT, seed=7, session_id="anole-ws")
    knobs = dict(network="none", policy="fixed", **always)
    for cuts in ((), (2,)):
        conn = cutting_connection(f"ws://127.0.0.1:{PORT}", DEVICE_KEY, w.cloud.config.vocab_size, cuts=cuts,
                                  array=torch.from_numpy, backoff_s=0.05)
        phone = CollabDecoder(w.device_model, conn, method_config("ciar", **knobs), w.sampling,
                              num_tokens=w.cloud.config.block_size)
        out = phone.generate(PROMPT, seed=7, session_id="anole-ws")
        assert out.tokens.tolist() == local.tokens.tolist(), cuts
        assert out.stats.verifications >= 2 and conn.resumes == len(cuts)  # (the cut falls on the second VERIFY)
        conn.disconnect()
