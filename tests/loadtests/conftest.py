"""Fixtures of the load and reliability tools' tests."""

import pytest


@pytest.fixture(scope="module")
def random_world(tmp_path_factory):
    from ciar.testing import write_random_world

    return write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0}, with_device=True)
