"""The device side of collaborative decoding: CIAR and every baseline through one loop and one stats struct.

    decoder = CollabDecoder(device_model, InProcessCloud(verifier), method_config("ciar"), world.sampling)
    result = decoder.generate("a small red circle at the top on a gray background", seed=0)
    result.tokens   # [N] int64 image tokens;  result.stats  # GenerationStats (ciar.collab.stats)

The loop itself (open, draft, gate, span, verify, commit, roll back, go offline) is `ciar_device.loop`, the one
Python device loop, which real devices run too; this module keeps what is the cluster's: the knobs and their
validation (`CollabConfig`, `ciar.collab.knobs`), the method presets (`method_config`), and the wiring of a
simulated device (`CollabDecoder`): the torch model as the loop's runtime (`ciar.collab.device.TorchRuntime`), a
`SimulatedLink` per image (a network model's seconds for each message's exact bytes) and a `Clock` stretched by
`device_slowdown`.

Methods (`METHODS`, the same names in the CLI, the benchmark and the HTTP API):
  cloud   - cloud-only: the cloud generates all N tokens (prefix_rate 1);
  sjd     - cloud-only by speculative Jacobi decoding (SJD, training-free): the cloud drafts a window of tokens from
            its own previous forward and verifies them in the next, several tokens per forward, the same
            distribution as cloud-only (`jacobi_window` 16; `ciar.engine.works.JacobiWork`);
  gsd     - as sjd with GSD's grouped acceptance (a draft is tested as a group of visually valid tokens; lossy:
            `ciar.collab.acceptance`);
  ciar    - an interval gate (the device file's calibrated gate, tau and burst), exact acceptance,
            interval-enhanced catch-up;
  eagle   - EAGLE-2-style speculative decoding with chain drafts: every token is drafted in a span and verified;
  lantern - as eagle with LANTERN's relaxed acceptance;
  cascade - as eagle with CASCADE's context-aware relaxation;
  code    - CoDe adapted to next-token prediction: the cloud makes the first `code_fraction` of the tokens, the
            device the rest with no verification;
  entropy / softmax / random / topk - CIAR with its gate replaced (paper Tables 2 and 3).

Seeds: the cloud's stream is `seed` (so `cloud` equals `ciar.decoding.generate_cloud` with the same seed); the
device's draws and the random gate's scores are keyed by (seed, position) (`ciar_device.maths.uniform`); the network
model's jitter/loss stream is seeded with `seed`, the handshake that primes the adaptive policy with
`seed + HANDSHAKE_SEED_OFFSET`.

Timing: device compute is measured (around the device's forwards, gates and draws) and multiplied by
`device_slowdown`; cloud compute is what the cloud reports per request times `cloud_slowdown` (1 by default: as
measured; a larger value emulates a larger cloud model relative to the network); communication comes from the
network model for the exact bytes of each message (`ciar.collab.protocol`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from ciar.collab.defaults import DEFAULT_SPAN, CIARDefaults, UncalibratedError
from ciar.collab.device import DeviceModel, TorchRuntime
from ciar.collab.gating import GATES
from ciar.collab.knobs import KNOBS, check_method_overrides
from ciar.collab.names import CLOUD_METHODS, METHODS
from ciar.sim.network import LinkDownError, NetworkModel, get_profile
from ciar.collab.protocol import CloudClient, RuleConfig, VerifyRequest
from ciar.collab.stats import GenerationStats
from ciar.decoding.jacobi import DEFAULT_WINDOW as SJD_WINDOW
from ciar.decoding.sampling import SamplingParams
from ciar_device.loop import Clock, Link, LoopConfig, run_image
from ciar_device.policy import CostObserver
from ciar_device.wire import Hello, Welcome

HANDSHAKE_SEED_OFFSET = 3 << 32  # the simulated link of a device's handshake (`CollabDecoder.prime`)
# a connection's HELLO and WELCOME (a 32-character key and device id): the handshake whose round trip primes the link
HANDSHAKE_BYTES = (Hello("k" * 32).nbytes(), Welcome("d" * 32, 0, 0, 0.0, 0.0).nbytes())


def _default(name: str):
    return KNOBS[name].default


@dataclass(frozen=True)
class CollabConfig:
    """Every knob of collaborative decoding; ranges, defaults and meanings are declared once in `ciar.collab.knobs`.
    `gate`, `tau`, `burst`, `burst_entropy` and `span` left at None come from the device model's calibrated defaults
    (`resolve`, `ciar.collab.defaults`): a threshold is a property of the weights, and so is the span it was
    calibrated with.

    Frozen, and validated once: `validate` checks every field against the knob table and remembers that it did, so
    the decoder built from a `method_config` does not check again (change a field with `dataclasses.replace`, which
    makes a new, unchecked config)."""

    method: str = "ciar"
    prefix_rate: float = _default("prefix_rate")  # rho: fraction of the N tokens the cloud generates first
    gate: str | None = _default("gate")  # ciar.collab.gating.GATES, "always" / "never"; None: the device's
    tau: float | None = _default("tau")  # escalate when gate score > tau (the gate's own scale); None: the device's
    span: int | None = _default("span")  # draft tokens per verification, the uncertain one included
    rule: RuleConfig = field(default_factory=RuleConfig)
    burst: int | None = _default("burst")  # cloud burst g after a rejection (0: off)
    burst_entropy: float | None = _default("burst_entropy")  # adaptive burst stop (0: fixed g)
    inter_enhance: bool = _default("inter_enhance")  # interval features with locally accepted tokens
    topk: int = _default("topk")  # set size of the "topk" gate
    margin: float = _default("margin")  # InterFuse safety margin before the gate scores
    feature_top: int = _default("feature_top")  # interval_features(top=...) for the projector
    device_slowdown: float = _default("device_slowdown")  # device compute time = measured time x this factor
    cloud_slowdown: float = _default("cloud_slowdown")  # cloud compute time = reported time x this factor
    network: str = "5g"  # ciar.sim.network profile name (options: get_profile)
    link_drop_after: int | None = _default("link_drop_after")  # simulation: the link goes down after this many messages
    fallback: bool = _default("fallback")  # cloud unreachable mid-generation: finish on the device (degraded)
    policy: str = _default("policy")  # "fixed" (the calibrated span and burst) or "adaptive" (ciar_device.policy)
    cloud_step_price_s: float = _default("cloud_step_price_s")  # adaptive: an operator's price of one cloud step
    overload_verifier_s: float | None = _default("overload_verifier_s")  # degradation under overload (None: off)
    overload_tau_factor: float = _default("overload_tau_factor")  # ... its budget: tau x at most this
    jacobi_window: int = _default("jacobi_window")  # the cloud's own tokens by Jacobi windows (0: one a forward)

    @property
    def validated(self) -> bool:
        return self.__dict__.get("_validated", False)

    def validate(self) -> "CollabConfig":
        """ValueError naming the first field that is not allowed (`ciar.collab.knobs`); -> self. Runs once per
        config: a validated config returns at once."""
        if self.validated:
            return self
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; known: {', '.join(METHODS)}")
        for knob in KNOBS.values():
            knob.check(getattr(self, knob.name))
        get_profile(self.network)
        object.__setattr__(self, "_validated", True)  # not a field: `replace` and `==` ignore it
        return self

    def resolve(self, defaults: CIARDefaults | None) -> "CollabConfig":
        """Fill the knobs left at None from a device's calibrated defaults (or the built-in ones: gate "interval",
        burst 0, span 4). A gate that scores positions needs a threshold: ValueError when neither the config nor
        the device file has one for it. The filled values are checked where the defaults are made (`CIARDefaults`,
        against the same knob table), so a validated config stays validated without checking again."""
        calibrated = defaults or CIARDefaults()
        gate = self.gate if self.gate is not None else calibrated.gate
        tau = self.tau if self.tau is not None else calibrated.taus.get(gate)
        out = replace(self, gate=gate, tau=tau,
                      burst=self.burst if self.burst is not None else calibrated.burst,
                      burst_entropy=self.burst_entropy if self.burst_entropy is not None else calibrated.burst_entropy,
                      span=self.span if self.span is not None else calibrated.span)
        if gate in GATES and tau is None:
            raise UncalibratedError(f"no threshold for the {gate!r} gate: pass tau (or calibrate one to a cloud-call "
                                    f"rate) or write the device's calibrated thresholds with `python -m "
                                    f"pipelines.calibrate`")
        if not self.validated:
            return out.validate()
        object.__setattr__(out, "_validated", True)
        return out

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rule"] = dict(vars(self.rule))
        return out

    def loop_config(self, sampling: SamplingParams) -> LoopConfig:
        """The device loop's knobs (`ciar_device.loop.LoopConfig`) of this resolved config."""
        return LoopConfig(gate=self.gate, tau=self.tau, span=self.span, burst=self.burst,
                          burst_entropy=self.burst_entropy, prefix_rate=self.prefix_rate,
                          feature_top=self.feature_top, inter_enhance=self.inter_enhance, sampling=sampling,
                          policy=self.policy, cloud_step_price_s=self.cloud_step_price_s, rule=self.rule,
                          topk=self.topk, margin=self.margin, fallback=self.fallback,
                          overload_verifier_s=self.overload_verifier_s, overload_tau_factor=self.overload_tau_factor,
                          jacobi_window=self.jacobi_window)


GATED_METHODS = ("ciar", "entropy", "softmax", "random", "topk")  # CIAR with its own or a baseline gate


def shared_knobs(method: str, knobs: dict) -> dict:
    """The subset of fleet- or run-wide knobs that `method` takes: the gate and its threshold only for "ciar" (every
    other gate has its own score scale), the cloud burst only for CIAR and its gate variants (the other baselines
    run as their papers do), the prefix rate not for "cloud", "sjd", "gsd" and "code" (there it is the method
    itself), the Jacobi window only for CIAR, its gate variants, "sjd" and "gsd"; knobs set to None are left out (the
    method's preset or the device's calibrated default applies)."""
    out = {k: v for k, v in knobs.items() if v is not None}
    if method != "ciar":
        out.pop("tau", None)
        out.pop("gate", None)
    if method not in GATED_METHODS:
        for name in ("burst", "burst_entropy", "policy", "cloud_step_price_s", "overload_verifier_s",
                     "overload_tau_factor"):
            out.pop(name, None)
    if method in CLOUD_METHODS + ("code",):
        out.pop("prefix_rate", None)
    if method not in GATED_METHODS + ("sjd", "gsd"):
        out.pop("jacobi_window", None)
    return out


def method_config(method: str, **overrides) -> CollabConfig:
    """The preset of a method name, with overrides (e.g. `method_config("ciar", tau=0.2, span=8)`), validated."""
    check_method_overrides(method, overrides)
    base = CollabConfig(method=method)
    # the baselines as their papers run them: no cloud burst, and the span fixed (not the device file's CIAR span)
    as_published = dict(burst=0, burst_entropy=0.0, span=DEFAULT_SPAN, policy="fixed")
    preset: dict = {
        "cloud": dict(prefix_rate=1.0, gate="never", inter_enhance=False, **as_published),
        "sjd": dict(prefix_rate=1.0, gate="never", inter_enhance=False, jacobi_window=SJD_WINDOW, **as_published),
        "gsd": dict(prefix_rate=1.0, gate="never", inter_enhance=False, jacobi_window=SJD_WINDOW,
                    rule=RuleConfig(rule="gsd"), **as_published),
        "ciar": {},
        "eagle": dict(gate="always", inter_enhance=False, **as_published),
        "lantern": dict(gate="always", inter_enhance=False, rule=RuleConfig(rule="lantern"), **as_published),
        "cascade": dict(gate="always", inter_enhance=False, rule=RuleConfig(rule="cascade"), **as_published),
        "code": dict(prefix_rate=0.3, gate="never", inter_enhance=False, **as_published),
        "entropy": dict(gate="entropy"),
        "softmax": dict(gate="softmax"),
        "random": dict(gate="random"),
        "topk": dict(gate="topk"),
    }[method]
    rule = overrides.pop("rule", None)
    cfg = replace(base, **{**preset, **overrides})  # an override wins over the preset (e.g. code's prefix_rate)
    if rule is not None:
        cfg = replace(cfg, rule=rule if isinstance(rule, RuleConfig) else RuleConfig(**rule))
    return cfg.validate()


@dataclass
class CollabResult:
    tokens: torch.Tensor  # [N] int64
    stats: GenerationStats
    trace: list[str] | None = None  # per token: "cloud" (prefix/verified) or "device" (accepted locally)


class SimulatedLink(Link):
    """A simulated device's link: each message costs the seconds a network model (`ciar.sim.network`, seeded per
    image) charges for its exact bytes, spent for real when `wait` is given; the cloud's reported seconds are
    stretched by `cloud_slowdown`. A link that goes down costs the sender's give-up time before the error."""

    def __init__(self, client: CloudClient, observer: CostObserver, network: NetworkModel, cloud_slowdown: float,
                 wait: Callable[[float], None] | None, handshake_seed: int):
        super().__init__(client, observer)
        self.network, self.cloud_slowdown, self.wait = network, cloud_slowdown, wait
        self.handshake_seed = handshake_seed

    def exchange(self, request, stats: GenerationStats):
        """Uplink transmission of the request's bytes, the call, downlink transmission of the reply's bytes (in this
        order, so the link's seeded jitter/loss stream does not depend on `wait`)."""
        verify = isinstance(request, VerifyRequest)
        up = self.request_bytes(request)
        try:
            up_s, _ = self.network.transmit(up)
            self._spend(up_s)
            t = time.perf_counter()
            reply = self.send(request)
            wall = time.perf_counter() - t
            down = reply.nbytes()
            down_s, _ = self.network.transmit(down)
        except LinkDownError as e:
            stats.comm_s += e.waited_s
            self._spend(e.waited_s)
            raise
        cloud_s, queue_s = float(reply.cloud_s), float(getattr(reply, "queue_s", 0.0))
        self._spend(down_s + cloud_s * (self.cloud_slowdown - 1.0))
        # the link: the simulated transmissions plus whatever the call took beyond the verifier's own time (a real
        # transport's, e.g. Ray's); the verifier: its forwards (x cloud_slowdown) and the queue wait
        self.charge(stats, reply, verify, up, down, comm_s=up_s + down_s, cloud_s=cloud_s * self.cloud_slowdown,
                    link_s=up_s + down_s + max(0.0, wall - cloud_s - queue_s))
        return reply

    def latency_prior_s(self) -> float:
        """Half the round trip of the device's connection handshake (HELLO and WELCOME through the network model,
        seeded apart from the images' links)."""
        handshake = NetworkModel(self.network.profile, seed=self.handshake_seed)
        return sum(handshake.transmit(n)[0] for n in HANDSHAKE_BYTES) / 2

    def cost_hint(self):
        hint = super().cost_hint()
        return hint.scaled(self.cloud_slowdown) if hint is not None else None

    def _spend(self, seconds: float) -> None:
        if self.wait is not None:
            self.wait(seconds)


class CollabDecoder:
    """A simulated device: the configuration of collaborative decoding (config, sampling, the device model, the
    cloud client) wired into the device loop (`ciar_device.loop.run_image`) with its plug-ins: the torch model as
    the runtime (`TorchRuntime`), a `SimulatedLink` per image and a `Clock` stretched by `device_slowdown`."""

    def __init__(self, device: DeviceModel | None, client: CloudClient, config: CollabConfig,
                 sampling: SamplingParams, num_tokens: int | None = None,
                 wait: Callable[[float], None] | None = None, progress_every: int = 12,
                 observers: dict[str, CostObserver] | None = None, runtime=None):
        """`config`'s gate / tau / burst / span left at None are filled from the device model's calibrated defaults
        (`CollabConfig.resolve`); a config already validated (`method_config`'s) is not checked again. `wait`: when
        given (e.g. `time.sleep`), simulated time is spent for real: each message waits for its uplink before it is
        sent and for its downlink after the reply, and device compute is stretched by `device_slowdown` (a simulated
        device in a live cluster). Without it, time is only accounted.
        `progress_every`: `generate(on_progress=...)` is called each time this many more tokens are decided.
        `observers`: the device's running cost estimates per link (network profile name -> `CostObserver`), kept
        across its images and shared by the decoders of one device (a fresh dict when not given); the adaptive
        policy reads them, every generation feeds them. `runtime`: what runs the device model (default
        `TorchRuntime(device)`; `ciar.sim.runtime.device_runtime("onnx", ...)` runs the export real phones run);
        one image at a time."""
        self.observers = {} if observers is None else observers
        self.wait = wait
        self.progress_every = max(1, int(progress_every))
        self.device_model = device.eval() if device is not None else None
        if runtime is None and device is not None:
            runtime = TorchRuntime(self.device_model)
        self.runtime = runtime
        self.client = client
        self.config = config.validate().resolve(getattr(device, "ciar_defaults", None))
        self.sampling = sampling.validate()
        self.num_tokens = num_tokens
        if config.method not in CLOUD_METHODS and device is None:
            raise ValueError(f"method {config.method!r} needs a device model")
        self.loop_config = self.config.loop_config(self.sampling)

    def generate(self, prompt: str, seed: int, session_id: str | None = None, trace: bool = False,
                 on_progress: Callable[[list[int], GenerationStats], None] | None = None) -> CollabResult:
        """Generate the image tokens of one caption. `on_progress(tokens_so_far, stats_so_far)` is called after the
        prefix, every `progress_every` more decided tokens, and once at the end (streaming previews)."""
        cfg = self.config
        n_total = self.num_tokens or (self.device_model.config.block_size if self.device_model is not None
                                      else None)
        if n_total is None:
            raise ValueError("num_tokens is required without a device model")
        observer = self.observers.get(cfg.network)
        if observer is None:  # the device's first image on this link: the device file's rates to start from
            defaults = getattr(self.device_model, "ciar_defaults", None)
            observer = self.observers[cfg.network] = CostObserver(rates=defaults.policy_rates if defaults else None)
        link = SimulatedLink(self.client, observer,
                             NetworkModel(get_profile(cfg.network), seed=seed, drop_after=cfg.link_drop_after),
                             cfg.cloud_slowdown, self.wait, seed + HANDSHAKE_SEED_OFFSET)
        tokens, who, stats = run_image(self.runtime, link, self.loop_config, prompt, seed, session_id,
                                       num_tokens=n_total, clock=Clock(cfg.device_slowdown, self.wait),
                                       on_progress=on_progress, progress_every=self.progress_every)
        return CollabResult(torch.tensor(tokens, dtype=torch.long), stats, who if trace else None)
