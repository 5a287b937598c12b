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
from loadtests.device_fuzz.strategies import FRAME_KINDS
from loadtests.device_fuzz.witnesses import WitnessLoop, Witnesses, quiet_images


class DeviceFuzzer(Recorder):
    """The device-channel fuzz run against one endpoint (see loadtests.device_fuzz)."""

    def __init__(self, target: Target, witnesses: Witnesses | None = None, seed: int = 0):
        super().__init__(target, seed)
        self.w = witnesses

    def run(self, frames: int = 1000, sessions_tried: int = 200, connections_extra: int = 8,
            slow_reader_s: float | None = None, witness_images: int = 1) -> dict:
        """The whole run -> the report. `witness_images`: the frame fuzz goes on (rounds of `frames` / 4 more frames)
        until the witnesses have made this many images during it, however long an image takes on this machine."""
        t0 = time.perf_counter()
        # read before the setup's own session: its CLOSE is answered at once and applied on the verifier's engine
        # after, so a count read right after the setup may still hold it
        sessions_before = self.verifier_sessions()
        self.setup()

        reference, witness = None, None
        if self.w is not None:
            reference = self.quiet_witnesses()
            witness = WitnessLoop(self.t, self.w, reference, self.tokens_seen)
            witness.start()
        phases = {"frames": lambda: self.fuzz_frames_beside(witness, frames, witness_images),
                  "frame_limits": self.probe_frame_limits,
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
        sessions_after, settle_s = self.settled_sessions(sessions_before)
        if sessions_before is not None and sessions_after is not None:
            self.probes["verifier_sessions"] = {"before": sessions_before, "after": sessions_after}
            self.probes["verifier_sessions_settle_s"] = round(settle_s, 2)
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

    def settled_sessions(self, before: int | None, poll_s: float = 0.05) -> tuple[int | None, float]:
        """The verifier's sessions once the run's last closes have been applied -> (sessions, seconds waited). A
        CLOSE is answered before the verifier's engine applies it, and the requests in flight on a connection that
        closed are withdrawn there after it closed: the count is read until it is no more than `before`, or until
        `Target.timeout_s` (a hang guard, shorter than a verifier's idle timeout, which would free a leaked session
        by itself) has passed; then what is left over `before` leaked."""
        t0 = time.monotonic()
        while True:
            sessions = self.verifier_sessions()
            waited = time.monotonic() - t0
            if sessions is None or before is None or sessions <= before or waited > self.t.timeout_s:
                return sessions, waited
            time.sleep(poll_s)

    def quiet_witnesses(self) -> list[np.ndarray]:
        return quiet_images(self.t, self.w, self.tokens_seen)

    # the phases (frames.py, protocol.py, connections.py)
    def fuzz_frames(self, frames: int, round_: int = 0) -> None:
        fuzz_frames(self, frames, round_)

    def fuzz_frames_beside(self, witness: WitnessLoop | None, frames: int, images: int) -> None:
        """`frames` frames, then more rounds until `witness` (when there) has made `images` images: a count of
        images made while frames were fuzzed, not what fitted in the time the frames took. Bounded (a hang guard)
        by `Target.timeout_s` x 4 of extra rounds, and by the witness loop's end (it stops after its errors)."""
        self.fuzz_frames(frames)
        t0, round_ = time.monotonic(), 0
        while witness is not None and witness.is_alive() and witness.images < images and \
                time.monotonic() - t0 < self.t.timeout_s * 4:
            round_ += 1
            self.fuzz_frames(max(len(FRAME_KINDS), frames // 4), round_)

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
