"""The knobs of collaborative decoding, declared once: name, type, allowed values, default, meaning, who sets them.

    from ciar.collab.knobs import KNOBS, REQUEST_KNOBS
    KNOBS["span"].check(8)          # ValueError naming the knob and its range when the value is not allowed
    REQUEST_KNOBS                   # the knobs a request's `params` may set

Every layer reads this table: `CollabConfig.validate` (ciar.sim.decoder) checks its fields with it, a device
file's calibrated defaults (ciar.collab.defaults) are checked with it, and the service schemas build their fields
from it (services.schemas: the API's `params`, the typed overrides a job carries to a device; services.config: the
device fleet's live defaults), so a range or a description cannot differ between them. Torch-free: the CLI and the
HTTP schemas import it without torch.

Who sets a knob (a knob may be several of these; every knob is a `CollabConfig` field):
  request     a client, per request (the API's `params`); unset: the device fleet's live default, else `default`
  live        the device fleet's operator (Serve `user_config` of the Device deployment, changed live)
  simulation  a request knob that only a deployment with `allow_simulation_params` accepts (else 422)
`default` is CollabConfig's; None means "from the device model's calibrated defaults or the method's preset"
(`unset` says which).

Not here: `method` and `rule` (a preset names them: `method_config`), `network` (a profile name from
`ciar.collab.names.NETWORKS`, optionally with options: `ciar.sim.network.get_profile`), and the sampling knobs
(`ciar.decoding.sampling.SamplingParams`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ciar.collab.names import CLOUD_METHODS, GATES, METHODS


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type  # bool, int, float or str
    default: object  # CollabConfig's default; None: unset (see `unset`)
    description: str
    unset: str | None = None  # what None means (knobs whose default is None)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    request: bool = False
    live: bool = False
    simulation: bool = False

    @property
    def nullable(self) -> bool:
        return self.default is None

    def allows(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (self.choices is None or value in self.choices)
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else numbers.Real):
            return False
        if math.isnan(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def check(self, value) -> None:
        """ValueError naming the knob and its allowed values when `value` is not one of them."""
        if not self.allows(value):
            raise ValueError(f"{self.name} must be {self.values()}, got {value!r}")

    def values(self) -> str:
        """The allowed values in words: "an integer in [1, 32]", "a number >= 0", "one of a, b"."""
        if self.kind is bool:
            return "true or false"
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        if self.kind is str:
            return "a string"
        what = "an integer" if self.kind is int else "a number"
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        if low is not None and self.le is not None:
            return f"{what} in {low}, {self.le:g}]"
        if low is not None:
            return f"{what} {'>=' if self.ge is not None else '>'} {low[1:]}"
        return what if self.le is None else f"{what} <= {self.le:g}"

_KNOBS = (
    Knob("tau", float, None, "gate threshold on the gate's own score scale: a draft whose score is above it goes to "
         "the cloud", unset="the device model's calibrated threshold for the gate (pipelines.calibrate)", ge=0.0,
         request=True, live=True),
    Knob("gate", str, None, "the gate that scores each draft (ciar.collab.gating); always: verify every token, "
         "never: verify none", unset="the device model's calibrated gate", choices=GATES + ("always", "never"),
         live=True),
    Knob("span", int, None, "draft tokens per verification, the uncertain one included",
         unset="the span the device model's thresholds were calibrated with", ge=1, le=32, request=True, live=True),
    Knob("burst", int, None, "cloud burst: after a rejection the cloud samples up to this many more tokens itself "
         "(0: off)", unset="the device model's", ge=0, le=256, request=True, live=True),
    Knob("burst_entropy", float, None, "adaptive burst: the cloud stops once its next distribution's entropy / log V "
         "is at or below this (0: a fixed burst)", unset="the device model's", ge=0.0, le=1.0),
    Knob("prefix_rate", float, 0.06, "fraction of the image tokens the cloud generates first (prefix injection, rho)",
         ge=0.0, le=1.0, request=True, live=True),
    Knob("jacobi_window", int, 0, "the cloud decodes the tokens it makes itself (the prefix and the bursts after a "
         "rejection; every token for cloud and sjd) by speculative Jacobi decoding with windows of this many drafts: "
         "several tokens per forward, the same distribution (0: one token per forward; sjd's and gsd's preset: 16)",
         ge=0, le=64, request=True),
    Knob("inter_enhance", bool, True, "send interval features with the locally accepted tokens (off: the paper's "
         "w/o Inter-Enhance)", request=True),
    Knob("topk", int, 200, "set size of the topk gate", ge=1),
    Knob("margin", float, 0.0, "InterFuse safety margin before the gate scores (0: the tight bounds, see "
         "ciar.collab.gating)", ge=0.0),
    Knob("feature_top", int, 8, "top entries of the interval features the projector reads (interval_features)",
         ge=1),
    Knob("device_slowdown", float, 1.0, "simulated device compute: measured device time x this factor", ge=1.0,
         le=100.0, request=True, live=True, simulation=True),
    Knob("cloud_slowdown", float, 1.0, "cloud compute: reported cloud time x this factor (emulates a larger cloud "
         "model)", gt=0.0),
    Knob("link_drop_after", int, None, "the device's link goes down after this many messages (both directions); the "
         "device finishes the image alone and the result is marked degraded (stats.degraded)",
         unset="the link stays up", ge=0, le=100_000, request=True, simulation=True),
    Knob("fallback", bool, True, "the cloud unreachable mid-generation: finish on the device (degraded) instead of "
         "failing"),
    Knob("policy", str, "adaptive", "the image's operating point: adaptive, the span and burst (at least the "
         "calibrated ones) or cloud-only that minimise the expected time to finish the image from the link, device "
         "and verifier costs the device observed on its earlier images (ciar_device.policy; the stats report the "
         "point: docs/architecture.md, Determinism); fixed, the calibrated span and burst always (the paper's "
         "tables)", choices=("fixed", "adaptive"), request=True, live=True),
    Knob("overload_verifier_s", float, None, "graceful degradation under overload: when the device's running "
         "estimate of the verifier's seconds per exchange (queue wait + its forwards, as the replies report them) is "
         "past this, the image's gate runs at tau x overload_tau_factor (fewer cloud calls, lower fidelity; the stats "
         "say so: overloaded, tau_used)", unset="off", gt=0.0, le=60.0, request=True, live=True),
    Knob("overload_tau_factor", float, 1.4, "graceful degradation's quality budget: tau x at most this under "
         "overload (benchmarks.frontier measures what a factor costs in fidelity)", ge=1.0, le=4.0, request=True,
         live=True),
    Knob("cloud_step_price_s", float, 0.0, "adaptive policy: the operator's price of one cloud step, in seconds of "
         "the user's time (0: the user's time alone)", ge=0.0, le=60.0, request=True, live=True),
)
KNOBS: dict[str, Knob] = {k.name: k for k in _KNOBS}
REQUEST_KNOBS = tuple(k.name for k in _KNOBS if k.request)
LIVE_KNOBS = tuple(k.name for k in _KNOBS if k.live)
SIMULATION_KNOBS = tuple(k.name for k in _KNOBS if k.simulation)


def check_method_overrides(method: str, overrides: dict) -> None:
    """The rules that tie knobs to a method (each knob's own range is above): ValueError for an unknown method, for
    "cloud", "sjd" or "gsd" with a prefix rate other than 1 (they make every token on the cloud), or for "sjd" or
    "gsd" without a Jacobi window. The HTTP ingress checks a request
    with this before any device runs it (without importing the decoder); `method_config` applies it to every
    config."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if method in CLOUD_METHODS and overrides.get("prefix_rate", 1.0) != 1.0:
        raise ValueError(f"method {method!r} makes every token on the cloud: prefix_rate must be 1 (or left out)")
    if method in ("sjd", "gsd") and overrides.get("jacobi_window", 1) == 0:
        raise ValueError(f"method {method!r} decodes by Jacobi windows: jacobi_window must be >= 1 (or left out)")
