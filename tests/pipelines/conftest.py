"""A local Ray instance for a test module of the Ray Data pipelines (2 CPUs, offline, one torch thread)."""

import pytest


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def shipped_world_copy(tmp_path_factory):
    """A world folder with the shipped cloud model and tokenizer (the device pipelines read their cloud from it)."""
    import shutil

    from ciar.world import DEFAULT_WEIGHTS_DIR

    d = tmp_path_factory.mktemp("world")
    for name in ("cloud.safetensors", "tokenizer.safetensors"):
        shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/{name}", d / name)
    return d
