"""The device endpoint's limits and per-device bookkeeping (`services.device_endpoint`): the limits a deployment sets
(`EndpointLimits`, from AppConfig.device_endpoint), the message-rate bucket of each connection (`TokenBucket`) and
what the endpoint knows of each device across its connections (`DeviceRecord`: its open sessions and connections)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EndpointLimits:
    """The device endpoint's limits (AppConfig.device_endpoint)."""

    max_frame_bytes: int = 8 << 20  # LlamaGen-XL's largest device frame: 1.6 MB at 256 tokens, 3.6 MB at 1,024
    max_sessions_per_device: int = 8
    messages_per_s: float = 200.0
    burst: int = 400
    idle_timeout_s: float = 60.0
    session_ttl_s: float = 120.0  # a session unused this long no longer counts against its device (the verifier
    # frees it after its own idle timeout)
    max_connections: int = 256
    max_connections_per_device: int = 16
    retry_after_s: float = 2.0
    hello_timeout_s: float = 10.0
    send_timeout_s: float = 10.0
    max_refused: int = 1000  # rate-limited frames in a row before the connection is closed


class TokenBucket:
    """Messages per second with a burst: `take` says how long to wait before the next may pass."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.t = float(burst), time.monotonic()

    def take(self) -> float:
        """0 when a message may pass now, else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class DeviceRecord:
    """One device across its connections: its sessions (pruned after `ttl` unused) and connections."""

    sessions: dict[str, float] = field(default_factory=dict)  # client session id -> last use (monotonic)
    connections: int = 0

    def live(self, ttl: float) -> int:
        now = time.monotonic()
        for sid in [s for s, t in self.sessions.items() if now - t > ttl]:
            del self.sessions[sid]
        return len(self.sessions)
