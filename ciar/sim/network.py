"""Simulated device <-> cloud link (the paper's appendix A.2.7, docs/architecture.md §8).

    net = NetworkModel(get_profile("5g"), seed=0)
    t = net.round_trip(up_bytes=1200, down_bytes=72)      # LinkTiming(uplink_s, downlink_s, retransmissions)
    get_profile("4g:jitter_ms=5,loss=0.01")              # a profile with options

Each transmission (one message, one direction) costs `RTT + bytes * 8 / bandwidth` (the paper's Eq. 13); a
request/reply exchange is an uplink transmission plus a downlink transmission (Eq. 14 sums both). Options:
  jitter_ms  - the RTT of each transmission is RTT + |N(0, jitter_ms)| (never below RTT)
  loss       - each transmission is lost with this probability and sent again after a retransmission timeout
               (`rto_ms`, default 3 x RTT, at least 10 ms), repeatedly until it gets through
Profiles (paper Table 9): 5g 300 Mbps / 10 ms, 4g 20 Mbps / 50 ms, wifi 100 Mbps / 20 ms; `none` is an ideal
link (zero time), for tests and for measuring compute alone. The jitter/loss stream is seeded, so a generation's
simulated latency is reproducible.

Outages: `NetworkModel(..., drop_after=n)` delivers n messages and then the link is down: every later `transmit`
raises `LinkDownError` (a `ciar.collab.protocol.CloudUnreachableError`) after `DOWN_TIMEOUTS` retransmission
timeouts, the time a device spends before it gives up on the cloud (`LinkDownError.waited_s`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace

from ciar.collab.protocol import CloudUnreachableError

DOWN_TIMEOUTS = 3  # retransmission timeouts a sender waits before it declares the link down


class LinkDownError(CloudUnreachableError):
    """The simulated link is down. `waited_s`: simulated seconds spent finding out."""

    def __init__(self, message: str, waited_s: float = 0.0):
        super().__init__(message)
        self.waited_s = waited_s

    def __reduce__(self):  # picklable with its waited_s (it crosses process boundaries in the cluster)
        return type(self), (str(self), self.waited_s)


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    bandwidth_mbps: float  # math.inf: no serialisation time
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    rto_ms: float | None = None

    def validate(self) -> "NetworkProfile":
        if not self.bandwidth_mbps > 0:
            raise ValueError(f"network {self.name}: bandwidth_mbps must be > 0, got {self.bandwidth_mbps}")
        if not self.rtt_ms >= 0 or not self.jitter_ms >= 0:
            raise ValueError(f"network {self.name}: rtt_ms and jitter_ms must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"network {self.name}: loss must be in [0, 1), got {self.loss}")
        if self.rto_ms is not None and not self.rto_ms > 0:
            raise ValueError(f"network {self.name}: rto_ms must be > 0, got {self.rto_ms}")
        return self

    @property
    def timeout_s(self) -> float:
        return (self.rto_ms if self.rto_ms is not None else max(10.0, 3.0 * self.rtt_ms)) / 1000.0


PROFILES: dict[str, NetworkProfile] = {
    "5g": NetworkProfile("5g", 300.0, 10.0),
    "4g": NetworkProfile("4g", 20.0, 50.0),
    "wifi": NetworkProfile("wifi", 100.0, 20.0),
    "none": NetworkProfile("none", math.inf, 0.0),
}


def get_profile(spec: str | NetworkProfile) -> NetworkProfile:
    """A profile by name, optionally with options: "4g", "5g:jitter_ms=2,loss=0.01", "wifi:bandwidth_mbps=50"."""
    if isinstance(spec, NetworkProfile):
        return spec.validate()
    name, _, opts = str(spec).partition(":")
    key = name.strip().lower()
    if key not in PROFILES:
        raise ValueError(f"unknown network {name!r}; known: {', '.join(PROFILES)} (options: NAME:key=value,...)")
    profile = PROFILES[key]
    if opts:
        allowed = {f.name for f in fields(NetworkProfile)} - {"name"}
        kw = {}
        for item in opts.split(","):
            k, eq, v = item.partition("=")
            k = k.strip()
            if not eq or k not in allowed:
                raise ValueError(f"bad network option {item!r} in {spec!r}; options: {', '.join(sorted(allowed))}")
            try:
                kw[k] = float(v)
            except ValueError:
                raise ValueError(f"network option {k} must be a number, got {v!r}") from None
        profile = replace(profile, name=str(spec), **kw)
    return profile.validate()


@dataclass
class LinkTiming:
    uplink_s: float
    downlink_s: float
    retransmissions: int = 0

    @property
    def total_s(self) -> float:
        return self.uplink_s + self.downlink_s


class NetworkModel:
    """Seeded per-transmission timing of one link (one device's connection)."""

    def __init__(self, profile: NetworkProfile | str, seed: int = 0, drop_after: int | None = None):
        if drop_after is not None and not (isinstance(drop_after, int) and drop_after >= 0):
            raise ValueError(f"drop_after must be an integer >= 0 or None, got {drop_after!r}")
        self.profile = get_profile(profile)
        self._rng = random.Random(seed)
        self.drop_after = drop_after
        self.sent = 0  # messages delivered

    def transmit(self, nbytes: int) -> tuple[float, int]:
        """Seconds to get one message of nbytes across, and the number of retransmissions it needed. Raises
        LinkDownError once `drop_after` messages have been delivered."""
        p = self.profile
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self.drop_after is not None and self.sent >= self.drop_after:
            raise LinkDownError(f"network {p.name}: link down after {self.sent} messages",
                                waited_s=DOWN_TIMEOUTS * p.timeout_s)
        self.sent += 1
        serial = 0.0 if math.isinf(p.bandwidth_mbps) else nbytes * 8 / (p.bandwidth_mbps * 1e6)
        seconds, retries = 0.0, 0
        while True:
            rtt = p.rtt_ms + (abs(self._rng.gauss(0.0, p.jitter_ms)) if p.jitter_ms else 0.0)
            if p.loss and self._rng.random() < p.loss:
                seconds += p.timeout_s  # lost: the sender waits for the timeout and sends again
                retries += 1
                continue
            return seconds + rtt / 1000.0 + serial, retries

    def round_trip(self, up_bytes: int, down_bytes: int) -> LinkTiming:
        up, r_up = self.transmit(up_bytes)
        down, r_down = self.transmit(down_bytes)
        return LinkTiming(up, down, r_up + r_down)
