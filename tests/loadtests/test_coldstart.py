"""The first image after a cold `make serve` (loadtests.coldstart): a request sent as soon as the port opens gets the
image or 503 + Retry-After, never a hang, and /healthz says 200 only once an image can be served. Slow (a cold
cluster, about a minute on the 2-core box; `make test-slow`) and needs port 8000 free."""

import pytest


@pytest.mark.slow
@pytest.mark.cluster  # starts Ray / Serve (tests/conftest.py)
def test_a_request_at_once_after_make_serve_gets_the_image_or_a_503(tmp_path):
    from loadtests.coldstart import one_run

    r = one_run("http://127.0.0.1:8000", "ciar-dev-key", str(tmp_path / "serve.log"), hang_s=120.0, limit_s=300.0)
    assert r["image"] and not r["hang"] and not r["off_contract"], r
    assert set(r["after_healthz_ok"]) == {200}, r  # healthz 200 means an image can be served now
    assert any(a["status"] == 503 and a["retry_after"] for a in r["answers"]) or r["answers"][0]["status"] == 200
