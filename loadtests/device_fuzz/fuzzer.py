"""The whole run (`DeviceFuzzer.run`): the setup, the witnesses, the frame fuzz and the fixed probes in turn, then the
checks after them (health, the witnesses' images, the verifier's sessions) -> the report; `summary_lines` for the
console."""

from __future__ import annotations

import time

import numpy as np

from loadtests.device_fuzz import connections, protocol
from loadtests.device_fuzz.channel import Target
from loadtests.device_fuzz.frames import fuzz_frames
from loadtests.device_fuzz.recorder import Recorder
from loadtests.device_fuzz.witnesses import WitnessLoop, Witnesses, quiet_images


class DeviceFuzzer(Recorder):
    """The device-channel fuzz run against one endpoint (see loadtests.device_fuzz)."""

    def __init__(self, target: Target, witnesses: Witnesses | None = None, seed: int = 0):
        super().__init__(target, seed)
        self.w = witnesses

    def run(self, frames: int = 1000, sessions_tried: int = 200, connections_extra: int = 8,
            slow_reader_s: float | None = None) -> dict:
        t0 = time.perf_counter()
        self.setup()
        sessions_before = self.verifier_sessions()

        reference, witness = None, None
        if self.w is not None:
            reference = self.quiet_witnesses()
            witness = WitnessLoop(self.t, self.w, reference, self.tokens_seen)
            witness.start()
        phases = {"frames": lambda: self.fuzz_frames(frames), "frame_limits": self.probe_frame_limits,
                  "order": self.probe_order, "tokens": self.probe_tokens,
                  "slow_reader": lambda: self.probe_slow_reader(slow_reader_s),
                  "connections": lambda: self.probe_connections(connections_extra),
                  "device_connections": self.probe_device_connections,
                  "sessions": lambda: self.probe_sessions(sessions_tried)}  # last: it also sees what others leaked
        phases_s = {}
        try:
            for name, phase in phases.items():
                t1 = time.perf_counter()
                phase()
                phases_s[name] = round(time.perf_counter() - t1, 1)
        finally:
            if witness is not None:
                witness.stop.set()
                witness.join(timeout=self.t.timeout_s * 4)
        health = self.healthy()
        witnesses = None
        if self.w is not None:
            witnesses = witness.report(self.quiet_witnesses(), self.fail)
        sessions_after = self.verifier_sessions()
        if sessions_before is not None and sessions_after is not None:
            self.probes["verifier_sessions"] = {"before": sessions_before, "after": sessions_after}
            if sessions_after > sessions_before:
                self.fail("sessions", "verifier sessions", f"the verifier holds {sessions_after} sessions after the "
                          f"run, {sessions_before} before: {sessions_after - sessions_before} leaked")
        if not health["ok"]:
            self.fail("health", "after the fuzz", f"not healthy: {health}")
        return {"frames": sum(self.frames.values()), "by_kind": dict(sorted(self.frames.items())),
                "answers": dict(sorted(self.answers.items())), "failure_count": self.failure_count,
                "failures": self.failures, "probes": self.probes, "witnesses": witnesses, "healthy": health,
                "wall_s": round(time.perf_counter() - t0, 1), "phases_s": phases_s, "seed": self.seed,
                "ok": self.failure_count == 0 and (witnesses is None or witnesses["identical"]) and health["ok"]}

    def quiet_witnesses(self) -> list[np.ndarray]:
        return quiet_images(self.t, self.w, self.tokens_seen)

    # the phases (frames.py, protocol.py, connections.py)
    def fuzz_frames(self, frames: int) -> None:
        fuzz_frames(self, frames)

    def probe_frame_limits(self) -> None:
        protocol.probe_frame_limits(self)

    def probe_order(self) -> None:
        protocol.probe_order(self)

    def probe_tokens(self) -> None:
        protocol.probe_tokens(self)

    def probe_sessions(self, tried: int) -> None:
        protocol.probe_sessions(self, tried)

    def probe_slow_reader(self, send_s: float | None = None) -> None:
        connections.probe_slow_reader(self, send_s)

    def probe_connections(self, extra: int) -> None:
        connections.probe_connections(self, extra)

    def probe_device_connections(self) -> None:
        connections.probe_device_connections(self)


def summary_lines(report: dict) -> list[str]:
    """A few lines for the console."""
    w = report.get("witnesses") or {}
    lines = [f"device channel: {report['frames']} frames in {report['wall_s']} s; answers "
             + ", ".join(f"{k} {v}" for k, v in sorted(report["answers"].items(), key=lambda kv: -kv[1])[:12]),
             f"witnesses: {w.get('images_during', 0)} images during the fuzz, identical: {w.get('identical')}; "
             f"healthy after: {report['healthy'].get('ok')}",
             f"failures: {report['failure_count']}"]
    lines += [f"  {f['kind']}: {f['what']}: {f['problem']}" + (f" [{f['answer']}]" if "answer" in f else "")
              for f in report["failures"][:10]]
    return lines
