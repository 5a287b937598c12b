"""CIAR's weight-dependent defaults: the calibrated gate, threshold, cloud burst and span of a device model, and
CASCADE's cosine threshold, in its file.

    d = CIARDefaults.from_extra(extra)            # extra = the device file's metadata (DeviceModel.load keeps it)
    cfg = method_config("ciar").resolve(d)        # tau / gate / burst / span left unset -> the device's values

A gate's threshold tau lives on the gate's own score scale and depends on the device model (its radius, its
calibration), so a number in code or config turns CIAR into something else as soon as the weights change: the
scenes-v2 device needed tau ~1312 on the normalised-U scale where the paper's 0.30 escalated every token. The
calibration command (`python -m pipelines.calibrate`) measures, on **val** prompts, the tau of every gate that
gives the target cloud-call rate and writes them here under extra["ciar"]; every entry point (CLI, benchmarks,
evaluation, the Serve device fleet with `tau: null`) uses them unless told otherwise.

CASCADE's threshold is the same kind of number: its paper's 0.9 on cos(E[x], E[y]) of two output-embedding rows
relaxes nothing on the scenes cloud (no two of its rows have a cosine above 0.72), so CASCADE was EAGLE-2 to the
last digit. `python -m pipelines.calibrate --cascade` chooses it on val prompts (the lowest threshold whose probe
fidelity stays within a tolerance of the exact rule's) and writes `cascade_threshold` with how it was chosen;
`cascade_threshold_or(explicit)` gives the threshold CASCADE runs with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ciar.collab.knobs import KNOBS
from ciar.collab.names import GATES
from ciar_device.policy import POLICY_RATES
from ciar_device.wire import RuleConfig

EXTRA_KEY = "ciar"
DEFAULT_SPAN = 4  # draft tokens per verification of a device file that names none


class UncalibratedError(ValueError):
    """A gate that scores positions has no threshold: none given, and the device file calibrated none for it
    (the API answers 422 naming `params.tau`)."""


@dataclass(frozen=True)
class CIARDefaults:
    gate: str = "interval"  # CIAR's gate (ciar.collab.names.GATES)
    taus: dict = field(default_factory=dict)  # gate -> calibrated tau at `target_rate` (CIAR's gate and baselines)
    burst: int = 0  # cloud burst g (ciar.collab.protocol.VerifyRequest.burst)
    burst_entropy: float = 0.0  # adaptive burst stop (0: fixed g)
    span: int = DEFAULT_SPAN  # draft tokens per verification the taus were calibrated with
    target_rate: float | None = None  # the cloud-call rate the taus were calibrated to
    calibration: dict = field(default_factory=dict)  # prompts, seed, measured rates, the command
    cascade_threshold: float | None = None  # CASCADE's cosine threshold chosen on val prompts (None: the paper's)
    cascade_calibration: dict = field(default_factory=dict)  # prompts, criterion, per-threshold measures, command
    # the adaptive policy's starting rates at the calibrated point, measured on val prompts (escalation_rate,
    # accept_first, accept_next; `python -m pipelines.calibrate --policy-rates`) and how (`policy_calibration`)
    policy_rates: dict = field(default_factory=dict)
    policy_calibration: dict = field(default_factory=dict)

    def __post_init__(self):
        """Each value is checked against its knob (`ciar.collab.knobs`, the same table `CollabConfig` uses); the
        gate must be one that scores positions (it has thresholds)."""
        if self.gate not in GATES:
            raise ValueError(f"ciar defaults: gate must be one of {GATES}, got {self.gate!r}")
        for g in self.taus:
            if g not in GATES:
                raise ValueError(f"ciar defaults: a threshold for an unknown gate {g!r}; known: {', '.join(GATES)}")
        values = [(f"taus[{g!r}]", "tau", t) for g, t in self.taus.items()] + \
            [(name, name, getattr(self, name)) for name in ("burst", "burst_entropy", "span")]
        for label, knob, value in values:
            if value is None or not KNOBS[knob].allows(value):
                raise ValueError(f"ciar defaults: {label} must be {KNOBS[knob].values()}, got {value!r}")
        c = self.cascade_threshold
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not -1.0 <= c <= 1.0):
            raise ValueError(f"ciar defaults: cascade_threshold must be a cosine in [-1, 1] or None, got {c!r}")
        for name, rate in self.policy_rates.items():
            if name not in POLICY_RATES or isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                    or not 0.0 <= rate <= 1.0:
                raise ValueError(f"ciar defaults: policy_rates takes {', '.join(POLICY_RATES)} in [0, 1], got "
                                 f"{name}={rate!r}")

    @property
    def tau(self) -> float | None:
        """The calibrated threshold of CIAR's own gate (None if not calibrated)."""
        return self.taus.get(self.gate)

    def cascade_threshold_or(self, explicit: float | None) -> float:
        """The cosine threshold CASCADE runs with: `explicit` when given, else the calibrated one, else the paper's
        (`RuleConfig`'s default, 0.9)."""
        if explicit is not None:
            return explicit
        return self.cascade_threshold if self.cascade_threshold is not None else RuleConfig().cascade_threshold

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_extra(extra: dict | None, source: str = "device file") -> "CIARDefaults | None":
        """extra["ciar"] of a device file -> CIARDefaults, or None when the file carries none."""
        given = (extra or {}).get(EXTRA_KEY)
        if given is None:
            return None
        try:
            return CIARDefaults(**given)
        except TypeError as e:
            raise ValueError(f"{source}: bad '{EXTRA_KEY}' metadata: {e}") from None
