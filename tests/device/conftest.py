"""The browser device's modules (web/src) run under node for the tests that hold them against the Python side."""

import json
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(REPO, "web", "test", "harness.mjs")
ORT = os.path.join(REPO, "web", "node_modules", "onnxruntime-web", "dist", "ort.wasm.min.mjs")


@pytest.fixture(scope="session")
def node():
    """run(command, payload) -> the harness's JSON answer (web/test/harness.mjs). Skipped, with the reason, on a
    machine without node; CI's machines have it (`make test` also installs onnxruntime-web with npm)."""
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed: the browser device's tests run its modules under node")

    def run(command: str, payload: dict, timeout_s: float = 300.0):
        if command == "generate" and not os.path.isfile(ORT):
            pytest.fail("onnxruntime-web is not installed: run `make web` (npm ci --prefix web)")
        out = subprocess.run([exe, "--experimental-websocket", "--no-warnings", HARNESS, command],
                             input=json.dumps(payload), capture_output=True, text=True, timeout=timeout_s)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    return run
