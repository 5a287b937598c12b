"""The browser device's modules (web/src) run under node for the tests that hold them against the Python side."""

import json
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(REPO, "web", "test", "harness.mjs")
ORT = os.path.join(REPO, "web", "node_modules", "onnxruntime-web", "dist", "ort.wasm.min.mjs")


class _NodeHarness:
    """One `node web/test/harness.mjs serve` process for the session: a JSON line per call each way (node's start-up
    and onnxruntime-web's import paid once, the device runtime kept per export); started again after a call that
    timed out or a process that died."""

    def __init__(self, exe: str):
        self.exe, self.proc = exe, None

    def _start(self):
        import tempfile

        self.err = tempfile.TemporaryFile(mode="w+")  # (a file, not a pipe nobody reads: a full pipe would block node)
        self.proc = subprocess.Popen([self.exe, "--experimental-websocket", "--no-warnings", HARNESS, "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, bufsize=1)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def call(self, command: str, payload: dict, timeout_s: float):
        import queue
        import threading

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc, answers = self.proc, queue.Queue()
        proc.stdin.write(json.dumps({"command": command, "input": payload}) + "\n")
        proc.stdin.flush()
        threading.Thread(target=lambda: answers.put(proc.stdout.readline()), daemon=True).start()
        try:
            line = answers.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"node harness: no answer to {command} in {timeout_s:g} s") from None
        if not line:
            self.stop()
            self.err.seek(0)
            raise AssertionError(f"node harness exited: {self.err.read()[-3000:]}")
        answer = json.loads(line)
        assert "error" not in answer, answer["error"][-3000:]
        return answer["output"]


@pytest.fixture(scope="session")
def node():
    """run(command, payload) -> the harness's JSON answer (web/test/harness.mjs, one process for the session).
    Skipped, with the reason, on a machine without node; CI's machines have it (`make test` also installs
    onnxruntime-web with npm)."""
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed: the browser device's tests run its modules under node")
    harness = _NodeHarness(exe)

    def run(command: str, payload: dict, timeout_s: float = 300.0):
        if command == "generate" and not os.path.isfile(ORT):
            pytest.fail("onnxruntime-web is not installed: run `make web` (npm ci --prefix web)")
        return harness.call(command, payload, timeout_s)

    yield run
    harness.stop()
