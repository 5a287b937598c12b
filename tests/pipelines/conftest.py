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
