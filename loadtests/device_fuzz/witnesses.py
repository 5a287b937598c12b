"""The witnesses: real images made over the device channel while it is fuzzed. Each image is made once on a quiet
channel (`quiet_images`), then over and over during the fuzz (`WitnessLoop`, on the second device key), then once
more after it: every one must be bit-identical to the quiet one, without a reconnect (`WitnessLoop.report`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ciar_device.connection import DeviceConnection
from loadtests.device_fuzz.channel import PROMPT, Target

WITNESS_CASES = ((PROMPT, 7), ("a large blue square at the bottom", 11))  # (prompt, seed) per witness image
WITNESS_ERRORS = 5  # the witness loop stops after this many failed images


@dataclass
class Witnesses:
    """Real images made over the device channel: `image(conn, prompt, seed, session_id)` -> tokens [N] int64, on a
    `DeviceConnection` of `vocab_size` (arrays made by `array`)."""

    image: Callable[[DeviceConnection, str, int, str], np.ndarray]
    vocab_size: int
    array: Callable | None = None
    cases: tuple[tuple[str, int], ...] = WITNESS_CASES


def onnx_witnesses(model_dir: str) -> Witnesses:
    """Witnesses on the exported device model (`python -m pipelines.export_onnx`): the torch-free device loop at the
    calibrated point (`policy="fixed"`: the adaptive policy would choose from the costs the fuzz inflates, and a
    witness checks the channel, not the policy)."""
    from ciar_device.loop import generate
    from ciar_device.runtime import DeviceRuntime

    rt = DeviceRuntime(model_dir)
    return Witnesses(lambda conn, prompt, seed, sid: generate(rt, conn, prompt, seed, session_id=sid,
                                                              policy="fixed").tokens, rt.vocab_size)


class _RecordingConnection(DeviceConnection):
    """A DeviceConnection that remembers the session tokens it was issued (for the log scan)."""

    def __init__(self, *args, seen: set, **kw):
        super().__init__(*args, **kw)
        self.seen = seen

    def open(self, request):
        reply = super().open(request)
        self.seen.add(self.sessions[request.session_id].token.hex())
        return reply


class WitnessLoop(threading.Thread):
    """Makes the witness images over and over until stopped; each must equal its quiet reference."""

    def __init__(self, target: Target, w: Witnesses, reference: list[np.ndarray], seen: set):
        super().__init__(daemon=True, name="device-fuzz-witness")
        self.t, self.w, self.reference, self.seen = target, w, reference, seen
        self.stop = threading.Event()
        self.images, self.mismatches, self.errors = 0, 0, []
        self.reconnects = self.resumes = 0

    def _connection(self) -> DeviceConnection:
        return _RecordingConnection(self.t.url, self.t.keys[1], self.w.vocab_size, array=self.w.array,
                                    timeout_s=self.t.timeout_s, connect_timeout_s=self.t.timeout_s, seen=self.seen)

    def run(self) -> None:
        conn = self._connection()
        while not self.stop.is_set() and len(self.errors) < WITNESS_ERRORS:
            for i, (prompt, seed) in enumerate(self.w.cases):
                try:
                    tokens = np.asarray(self.w.image(conn, prompt, seed, f"witness-{i}"))
                except Exception as e:  # noqa: BLE001 - reported; the next image on a fresh connection
                    self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                    self._forget(conn)
                    conn = self._connection()
                    continue
                self.images += 1
                self.mismatches += not np.array_equal(tokens, self.reference[i])
        self._forget(conn)

    def report(self, after: list[np.ndarray], fail: Callable[[str, str, str], None]) -> dict:
        """The run's "witnesses" section, from this loop (stopped) and the images made after it (`after`); `fail(kind,
        what, problem)` for an image that differs, a loop still running, or a witness that had to reconnect."""
        same_after = all(np.array_equal(x, y) for x, y in zip(after, self.reference))
        witnesses = {"cases": [list(c) for c in self.w.cases], "tokens": int(self.reference[0].size),
                     "images_during": self.images, "mismatches_during": self.mismatches, "errors_during": self.errors,
                     "reconnects": self.reconnects, "resumes": self.resumes, "identical_after": same_after,
                     "identical": self.mismatches == 0 and not self.errors and same_after and self.images > 0}
        if self.is_alive():
            fail("witness", "witness loop", f"still running {self.t.timeout_s * 4:g} s after the fuzz")
        if not witnesses["identical"]:
            fail("witness", "images", f"{self.mismatches} of {self.images} images differ from the quiet run, errors "
                 f"{self.errors}, identical after: {same_after}")
        if self.reconnects or self.resumes:
            fail("witness", "connection", f"the witness had to reconnect {self.reconnects} times and resume "
                 f"{self.resumes} sessions (the server stopped answering it)")
        return witnesses

    def _forget(self, conn: DeviceConnection) -> None:
        self.reconnects += conn.reconnects
        self.resumes += conn.resumes
        conn.disconnect()


def quiet_images(target: Target, w: Witnesses, seen: set) -> list[np.ndarray]:
    """The witness images on a connection of their own, the channel quiet (before and after the fuzz); the session
    tokens issued are added to `seen`."""
    conn = _RecordingConnection(target.url, target.keys[1], w.vocab_size, array=w.array, timeout_s=target.timeout_s,
                                seen=seen)
    try:
        return [np.asarray(w.image(conn, prompt, seed, f"witness-{i}")) for i, (prompt, seed) in enumerate(w.cases)]
    finally:
        conn.disconnect()
