"""Fixtures of the Ray Data pipelines' tests: Ray (the session's shared instance) and a copy of the shipped world."""

import pytest


@pytest.fixture(scope="module")
def local_ray(shared_ray):
    """The test session's shared local Ray instance (tests/conftest.py: `shared_ray`)."""
    return shared_ray


@pytest.fixture(scope="session")
def shipped_world_copy(tmp_path_factory):
    """A world folder with the shipped cloud model and tokenizer (the device pipelines read their cloud from it)."""
    import shutil

    from ciar.world import DEFAULT_WEIGHTS_DIR

    d = tmp_path_factory.mktemp("world")
    for name in ("cloud.safetensors", "tokenizer.safetensors"):
        shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/{name}", d / name)
    return d
