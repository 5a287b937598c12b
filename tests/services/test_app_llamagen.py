"""The Serve application serving a LlamaGen world for real: RANDOM-weight files in LlamaGen's layout (t2i GPT `.pt`,
VQ-16 `.pt`), a tiny random T5 encoder + tokenizer saved with `save_pretrained` (encoded on the verifier at
runtime), and a device model for that GPT, named by a world dict in the builder args as serve_config.gpu.yaml does.

On the test session's shared Ray instance (1 verifier, 2 devices, fractional CPUs)."""

import hashlib
import io

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import LLAMAGEN_SMALL_GPT, make_tiny_t5, write_random_llamagen_files  # noqa: E402
from services.deploy import deploy_config  # noqa: E402

PORT = 8133
URL = f"http://127.0.0.1:{PORT}"
KEY = "test-key-llamagen-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "A red bus parked on a city street."
TAU = 0.05


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamagen-serve")
    cfg = write_random_llamagen_files(str(root), [1])
    t5 = make_tiny_t5(str(root / "flan-t5-tiny"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"])
    keep = ("gpt_checkpoint", "gpt_config", "gpt_overrides", "image_size", "vq_checkpoint", "vq_overrides",
            "device_checkpoint")
    return {"kind": "llamagen", "base_dir": str(root), "text_encoder": t5, "sampling": {"cfg_scale": 2.0, "top_k": 0},
            **{k: cfg[k] for k in keep}}


@pytest.fixture(scope="module")
def cluster(world, shared_ray):
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        deploy_config({"world": world, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "devices": 2,
                       "device_num_cpus": 0.1, "verifier_num_cpus": 0.5, "verifier_max_sessions": "auto",
                       "ingress_num_cpus": 0.1, "graceful_shutdown_timeout_s": 0.5},
                      user_configs={"Device": {"tau": TAU, "span": 4, "prefix_rate": 0.1, "realtime": False},
                                    "Verifier": {"max_batch_size": 8, "batch_wait_timeout_s": 0.005}})
        yield world
    finally:
        serve.shutdown()


def post(body):
    return requests.post(f"{URL}/v1/images/generations", json=body, headers=AUTH, timeout=180)


def test_llamagen_world_served_end_to_end_and_equal_to_in_process(cluster):
    from PIL import Image

    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.world import load_world

    body = {"prompt": PROMPT, "seed": 5, "method": "ciar", "response_format": "png"}
    a, b = post(body), post(body)
    assert a.status_code == 200 and a.headers["content-type"] == "image/png", a.text
    assert a.content == b.content  # same request and seed, same image
    assert Image.open(io.BytesIO(a.content)).size == (64, 64)  # the world's resolution (64 px, 4x4 tokens here)

    r = post({**body, "response_format": "tokens"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["stats"]["total_tokens"] == 16 and got["stats"]["config"]["tau"] == TAU

    # the verifier encoded the caption with the world's T5 at runtime: in-process, the same world gives the same tokens
    w = load_world(cluster)
    dec = make_decoder(w, make_verifier(w, max_sessions=1), "ciar", tau=TAU, span=4, prefix_rate=0.1, network="5g")
    assert got["data"][0]["tokens"] == dec.generate(PROMPT, seed=5).tokens.tolist()

    cloud = post({"prompt": PROMPT, "seed": 5, "method": "cloud", "response_format": "tokens"})
    assert cloud.status_code == 200 and cloud.json()["stats"]["cloud_call_rate"] == 1.0


def test_the_gpu_configs_memory_sized_verifier_runs_on_a_cpu(cluster):
    """`verifier_max_sessions: auto` (serve_config.gpu.yaml's) on a CPU replica: 64 sessions, and the replica says why;
    its steps ran on the dynamic path (static steps and CUDA graphs are the default on CUDA only)."""
    st = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result()
    assert st["max_sessions"] == 64 and "no accelerator" in st["memory"]["how"], st["memory"]
    assert st["forwards_by_path"]["dynamic"] > 0 and st["forwards_by_path"]["graph"] == 0
    assert st["forward_faults"] == {} and st["step_running_s"] >= 0
