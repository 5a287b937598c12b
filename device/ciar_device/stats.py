"""One accounting struct for every decoding method and every device (docs/architecture.md §8).

    stats = GenerationStats(total_tokens=144, cloud_tokens=40, ...)
    total = sum(per_image_stats, GenerationStats())          # aggregate over images
    total.cloud_call_rate, total.steps_compression, total.to_dict()

Counters (per image, summed by `+`):
  total_tokens           image tokens generated
  prefix_tokens          tokens the cloud generated itself (prefix injection; all N for cloud-only)
  cloud_tokens           tokens decided by the cloud: prefix + verified drafts + recovered/bonus tokens
  device_tokens          tokens accepted locally by the device (never seen by the cloud's acceptance rule)
  drafted / accepted     draft tokens sent for verification / accepted by the cloud
  verifications          spans verified (one per verify request)
  cloud_requests         round trips to the cloud (open + verify requests)
  resumes                sessions re-created on the cloud after it lost them (ciar.sim.recovery)
  degraded               images finished on the device alone after the cloud became unreachable (link down)
  degraded_tokens        tokens the device decided alone after that (no gate, no verification)
  cloud_forward_passes   sequential cloud forwards (what bounds latency; steps compression divides by it)
  device_forward_passes  device forwards
  bytes_up / bytes_down  payload bytes device -> cloud / cloud -> device
  device_s, cloud_s, comm_s  device compute (measured x slowdown), cloud compute, communication (network model)
  queue_s                time the verify requests queued in the verifier before their first forward (as replied)
  images                 images accounted
The image's operating point (ciar_device.loop's `choose_point`; per image, an aggregate divides by `images`):
  span_used, burst_used  the span and burst of its escalations (the calibrated ones under the fixed policy)
  adapted                1 when the adaptive policy chose another point than the calibrated one
  handovers              1 when it gave the whole image to the cloud (cloud-only's open)
  est_device_step_s, est_link_latency_s, est_cloud_step_s   the observed costs it chose from (0: not chosen)
  tau_used               the gate's threshold (the config's; x overload_tau_factor under overload)
  overloaded             1 when graceful degradation raised it (the verifier past `overload_verifier_s`)
Derived: cloud_call_rate = cloud_tokens / total_tokens; steps_compression = total_tokens / cloud_forward_passes;
acceptance_rate = accepted / drafted; mean_accepted_length = 1 + accepted / verifications (tokens gained per
verification, the bonus/recovered token included); total_s = device_s + cloud_s + comm_s.

Bytes: each message's exact frame size on the wire (`nbytes()` of the messages of `ciar_device.wire`, which
`ciar.collab.protocol` re-exports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class GenerationStats:
    total_tokens: int = 0
    prefix_tokens: int = 0
    cloud_tokens: int = 0
    device_tokens: int = 0
    burst_tokens: int = 0  # cloud tokens sampled in cloud bursts (part of cloud_tokens)
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    cloud_requests: int = 0
    resumes: int = 0
    degraded: int = 0
    degraded_tokens: int = 0
    cloud_forward_passes: int = 0
    device_forward_passes: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    device_s: float = 0.0
    cloud_s: float = 0.0
    comm_s: float = 0.0
    queue_s: float = 0.0
    images: int = 0
    span_used: int = 0
    burst_used: int = 0
    tau_used: float = 0.0
    overloaded: int = 0
    adapted: int = 0
    handovers: int = 0
    est_device_step_s: float = 0.0
    est_link_latency_s: float = 0.0
    est_cloud_step_s: float = 0.0

    # ------------------------------------------------------------------ derived
    @property
    def cloud_call_rate(self) -> float:
        return _ratio(self.cloud_tokens, self.total_tokens)

    @property
    def steps_compression(self) -> float:
        return _ratio(self.total_tokens, self.cloud_forward_passes)

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted, self.drafted)

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.verifications if self.verifications else float("nan")

    @property
    def total_s(self) -> float:
        return self.device_s + self.cloud_s + self.comm_s

    # ------------------------------------------------------------------ aggregation / export
    def __add__(self, other: "GenerationStats") -> "GenerationStats":
        if not isinstance(other, GenerationStats):
            return NotImplemented
        return GenerationStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __radd__(self, other):
        if other == 0:  # sum(list_of_stats)
            return self
        return self.__add__(other)

    def to_dict(self) -> dict:
        """Counters and derived figures as JSON-safe values (NaN -> None)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("cloud_call_rate", "steps_compression", "acceptance_rate", "mean_accepted_length", "total_s"):
            d[name] = getattr(self, name)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


STATS_FIELDS = tuple(f.name for f in fields(GenerationStats))
