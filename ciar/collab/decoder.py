"""The device side of collaborative decoding: CIAR and every baseline through one loop and one stats struct.

    decoder = CollabDecoder(device_model, InProcessCloud(verifier), method_config("ciar"), world.sampling)
    result = decoder.generate("a small red circle at the top on a gray background", seed=0)
    result.tokens   # [N] int64 image tokens;  result.stats  # GenerationStats (ciar.collab.stats)

One generation (docs/architecture.md §4, §7):
1. *open*: the cloud encodes the caption, generates the first ceil(prefix_rate * N) tokens itself (prefix
   injection) and returns them with the caption embeddings;
2. the device prefills its cache and drafts token by token from its Inter-Head centers (post-guidance, through
   `logits_to_probs`, quantised to the float16 it sends: `quantize_draft`); the gate scores each draft (the
   device file's calibrated gate for CIAR: -log p_lo of the drafted token, or the paper's U; entropy / max-prob /
   random / top-k set for the baselines). score <= tau: the token is *accepted locally* (committed at once);
3. score > tau: the device drafts a *span* of `span` tokens starting with the uncertain one and sends the cloud
   the locally accepted tokens since the last exchange (with their interval features when interval-enhanced
   decoding is on) plus the span and its draft distributions;
4. the cloud catches up, verifies with the session's acceptance rule and answers (accepted n, next token); with a
   cloud burst (g > 0) a reply after a rejection also carries up to g tokens the cloud sampled itself (exact cloud
   tokens, a cloud step each, no round trip: escalations cluster). The device commits span[:n] + [next] + burst,
   rolls its cache back to the accepted prefix and feeds the rest.

Methods (`METHODS`, the same names in the CLI, the benchmark and the HTTP API):
  cloud   - cloud-only: the cloud generates all N tokens (prefix_rate 1);
  ciar    - an interval gate (the device file's calibrated gate, tau and burst), exact acceptance,
            interval-enhanced catch-up;
  eagle   - EAGLE-2-style speculative decoding with chain drafts: every token is drafted in a span and verified;
  lantern - as eagle with LANTERN's relaxed acceptance;
  cascade - as eagle with CASCADE's context-aware relaxation;
  code    - CoDe adapted to next-token prediction: the cloud makes the first `code_fraction` of the tokens, the
            device the rest with no verification;
  entropy / softmax / random / topk - CIAR with its gate replaced (paper Tables 2 and 3).

Seeds: the cloud's stream is `seed` (so `cloud` equals `ciar.decoding.generate_cloud` with the same seed), the
device's draws use `seed + DEVICE_SEED_OFFSET`, the random gate `seed + GATE_SEED_OFFSET`; the network model's
jitter/loss stream is seeded with `seed`.

Link loss: when the cloud becomes unreachable after the open (`CloudUnreachableError`: the simulated link is down,
`link_drop_after`, or no verifier replica answers), the device keeps the span it had drafted and decodes the rest
alone (its own samples, no gate, no verification); the stats count the image as `degraded` with the tokens it made
alone (`degraded_tokens`). `fallback=False` raises instead. Without an open there is no caption encoding: the error
propagates.

Timing: device compute is measured (perf_counter around the device's forwards, gates and draws) and multiplied
by `device_slowdown`; cloud compute is what the cloud reports per request times `cloud_slowdown` (1 by default:
as measured; a larger value emulates a larger cloud model relative to the network); communication comes from the network
model for the exact bytes of each message (`ciar.collab.protocol`).

Structure: `CollabDecoder` holds the configuration and builds each generation; `_Link` is one generation's link (every
request/reply and what it costs); `_Generation` is one generation's device-side state with its draft step (draw,
score, escalate, send, commit, roll back).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from ciar.collab.defaults import DEFAULT_SPAN, CIARDefaults, UncalibratedError
from ciar.collab.device import DeviceModel
from ciar.collab.gating import GATES, gate_scores
from ciar.collab.interval import guided_interval, interval_feature_dim, interval_features
from ciar.collab.knobs import KNOBS
from ciar.collab.network import LinkDownError, NetworkModel, get_profile
from ciar.collab.names import METHODS
from ciar.collab.protocol import (CloudClient, CloudUnreachableError, OpenRequest, RuleConfig, VerifyRequest,
                                  quantize_draft)
from ciar.collab.stats import GenerationStats
from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample
from ciar_client.policy import CostObserver, OperatingPoint
from ciar_client.wire import Hello, Welcome

DEVICE_SEED_OFFSET = 1 << 32
GATE_SEED_OFFSET = 2 << 32
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
    network: str = "5g"  # ciar.collab.network profile name (options: get_profile)
    link_drop_after: int | None = _default("link_drop_after")  # simulation: the link goes down after this many messages
    fallback: bool = _default("fallback")  # cloud unreachable mid-generation: finish on the device (degraded)
    policy: str = _default("policy")  # "fixed" (the calibrated span and burst) or "adaptive" (ciar_client.policy)
    cloud_step_price_s: float = _default("cloud_step_price_s")  # adaptive: an operator's price of one cloud step
    overload_verifier_s: float | None = _default("overload_verifier_s")  # degradation under overload (None: off)
    overload_tau_factor: float = _default("overload_tau_factor")  # ... its budget: tau x at most this

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


GATED_METHODS = ("ciar", "entropy", "softmax", "random", "topk")  # CIAR with its own or a baseline gate


def shared_knobs(method: str, knobs: dict) -> dict:
    """The subset of fleet- or run-wide knobs that `method` takes: the gate and its threshold only for "ciar" (every
    other gate has its own score scale), the cloud burst only for CIAR and its gate variants (the other baselines
    run as their papers do), the prefix rate not for "cloud" and "code" (there it is the method itself); knobs set
    to None are left out (the method's preset or the device's calibrated default applies)."""
    out = {k: v for k, v in knobs.items() if v is not None}
    if method != "ciar":
        out.pop("tau", None)
        out.pop("gate", None)
    if method not in GATED_METHODS:
        for name in ("burst", "burst_entropy", "policy", "cloud_step_price_s", "overload_verifier_s",
                     "overload_tau_factor"):
            out.pop(name, None)
    if method in ("cloud", "code"):
        out.pop("prefix_rate", None)
    return out


def check_method_overrides(method: str, overrides: dict) -> None:
    """The rules that tie knobs to a method (each knob's own range is `ciar.collab.knobs`'): ValueError for an unknown
    method, or for "cloud" with a prefix rate other than 1 (it makes every token on the cloud). The HTTP ingress
    checks a request with this before any device runs it; `method_config` applies it to every config."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if method == "cloud" and overrides.get("prefix_rate", 1.0) != 1.0:
        raise ValueError("method 'cloud' makes every token on the cloud: prefix_rate must be 1 (or left out)")


def method_config(method: str, **overrides) -> CollabConfig:
    """The preset of a method name, with overrides (e.g. `method_config("ciar", tau=0.2, span=8)`), validated."""
    check_method_overrides(method, overrides)
    base = CollabConfig(method=method)
    # the baselines as their papers run them: no cloud burst, and the span fixed (not the device file's CIAR span)
    as_published = dict(burst=0, burst_entropy=0.0, span=DEFAULT_SPAN, policy="fixed")
    preset: dict = {
        "cloud": dict(prefix_rate=1.0, gate="never", inter_enhance=False, **as_published),
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


class _Clock:
    """Accumulates measured seconds of the code inside `with clock:` blocks; with `wait`, also waits
    (slowdown - 1) x the measured time after each block, so a slowed-down device is slow for real."""

    def __init__(self, slowdown: float = 1.0, wait: Callable[[float], None] | None = None):
        self.seconds = 0.0
        self.slowdown = slowdown
        self.wait = wait

    def __enter__(self):
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t
        self.seconds += dt
        if self.wait is not None and self.slowdown > 1.0:
            self.wait(dt * (self.slowdown - 1.0))


class CollabDecoder:
    """The configuration of collaborative decoding (config, sampling, the device model, the cloud client) and the
    construction of each generation: `generate` opens the session over a `_Link` and hands the drafting to a
    `_Generation`."""

    def __init__(self, device: DeviceModel | None, client: CloudClient, config: CollabConfig,
                 sampling: SamplingParams, num_tokens: int | None = None,
                 wait: Callable[[float], None] | None = None, progress_every: int = 12,
                 observers: dict[str, CostObserver] | None = None):
        """`config`'s gate / tau / burst / span left at None are filled from the device model's calibrated defaults
        (`CollabConfig.resolve`); a config already validated (`method_config`'s) is not checked again. `wait`: when
        given (e.g. `time.sleep`), simulated time is spent for real: each message waits for its uplink before it is
        sent and for its downlink after the reply, and device compute is stretched by `device_slowdown` (a simulated
        device in a live cluster). Without it, time is only accounted.
        `progress_every`: `generate(on_progress=...)` is called each time this many more tokens are decided.
        `observers`: the device's running cost estimates per link (network profile name -> `CostObserver`), kept
        across its images and shared by the decoders of one device (a fresh dict when not given); the adaptive
        policy reads them, every generation feeds them."""
        self.observers = {} if observers is None else observers
        self.wait = wait
        self.progress_every = max(1, int(progress_every))
        self.device_model = device.eval() if device is not None else None
        self.client = client
        self.config = config.validate().resolve(getattr(device, "ciar_defaults", None))
        self.sampling = sampling.validate()
        self.num_tokens = num_tokens
        if config.method != "cloud" and device is None:
            raise ValueError(f"method {config.method!r} needs a device model")

    def generate(self, prompt: str, seed: int, session_id: str | None = None, trace: bool = False,
                 on_progress: Callable[[list[int], GenerationStats], None] | None = None) -> CollabResult:
        """Generate the image tokens of one caption. `on_progress(tokens_so_far, stats_so_far)` is called after the
        prefix, every `progress_every` more decided tokens, and once at the end (streaming previews)."""
        tokens, who, stats = self._generate(prompt, seed, session_id, on_progress)
        return CollabResult(torch.tensor(tokens, dtype=torch.long), stats, who if trace else None)

    # inference mode, not no_grad: no version counters or view tracking on the per-token small ops (device seconds
    # per image on 12 val prompts, one thread: 0.157 -> 0.131; the in-process cloud's 0.57 -> 0.51). The result is
    # built outside it (`generate`), so callers get ordinary tensors.
    @torch.inference_mode()
    def _generate(self, prompt: str, seed: int, session_id: str | None,
                  on_progress: Callable[[list[int], GenerationStats], None] | None):
        """-> (tokens, who decided each, stats) of one caption."""
        cfg, params = self.config, self.sampling
        sid = session_id or uuid.uuid4().hex
        n_total = self.num_tokens or (self.device_model.config.block_size if self.device_model is not None
                                      else None)
        if n_total is None:
            raise ValueError("num_tokens is required without a device model")
        stats = GenerationStats()
        observer = self.observers.get(cfg.network)
        if observer is None:  # the device's first image on this link: the device file's rates to start from
            defaults = getattr(self.device_model, "ciar_defaults", None)
            observer = self.observers[cfg.network] = CostObserver(rates=defaults.policy_rates if defaults else None)
        link = _Link(self.client, NetworkModel(get_profile(cfg.network), seed=seed, drop_after=cfg.link_drop_after),
                     stats, cfg.cloud_slowdown, self.wait, observer)
        prefix_len = n_total if cfg.prefix_rate >= 1.0 else min(n_total, math.ceil(cfg.prefix_rate * n_total))
        point = self.operating_point(observer, n_total - prefix_len, stats, seed) if prefix_len < n_total else None
        if point is not None and point.cloud_only:
            prefix_len = n_total  # the whole image on the cloud: cloud-only's open
        drafting = prefix_len < n_total

        open_req = OpenRequest(sid, prompt, seed, params, prefix_len, cfg.rule, want_caption=drafting)
        try:
            reply = link.exchange(open_req.nbytes(), lambda: self.client.open(open_req))
        except CloudUnreachableError:
            self.client.close(sid)  # the cloud may have opened it before the reply was lost: drop local state
            raise
        progress = _Progress(on_progress, self.progress_every)
        try:
            stats.cloud_requests += 1
            stats.cloud_forward_passes += reply.forward_passes
            tokens = reply.prefix_tokens.tolist()
            stats.prefix_tokens = len(tokens)
            stats.cloud_tokens = len(tokens)
            who = ["cloud"] * len(tokens)
            progress(tokens, stats)
            if drafting:
                tau = self.image_tau(observer, stats)
                _Generation(self, link, reply, tokens, who, n_total, seed, sid, progress, point, tau).run()
        finally:
            self.client.close(sid)  # also after a link loss (frees local state; a real device sends it later)
        stats.total_tokens = len(tokens)
        stats.images = 1
        progress(tokens, stats, final=True)
        return tokens, who, stats

    def prime(self, observer: CostObserver, seed: int) -> None:
        """What the device knows of a link's costs before drafting on it (`CostObserver.prime`), so that its first
        adaptive image there is chosen too: the round trip of its connection's handshake (HELLO and WELCOME through
        the link's network model, seeded apart from the images' links), one timed device step (x
        `device_slowdown`), and the verifier's hint (the client's `cost_hint()`, x `cloud_slowdown`)."""
        cfg = self.config
        handshake = NetworkModel(get_profile(cfg.network), seed=seed + HANDSHAKE_SEED_OFFSET)
        round_trip = sum(handshake.transmit(n)[0] for n in HANDSHAKE_BYTES)
        ask = getattr(self.client, "cost_hint", None)
        hint = ask() if ask is not None else None
        rows = 2 if self.sampling.uses_cfg else 1
        observer.prime(latency_s=round_trip / 2,
                       device_step_s=self.device_model.step_seconds(rows) * cfg.device_slowdown,
                       hint=hint.scaled(cfg.cloud_slowdown) if hint is not None else None)

    def operating_point(self, observer: CostObserver, drafted: int, stats: GenerationStats,
                        seed: int) -> OperatingPoint:
        """The image's operating point, chosen before its open and kept to its end: the calibrated span and burst
        under the fixed policy (and under the adaptive one while a cost is unknown: no hint from the verifier and no
        image verified yet); under the adaptive policy, the allowed point (never verifying less than the calibrated
        one: a span and a burst at least its, or cloud-only) with the least expected time to finish the `drafted`
        tokens (+ the operator's price per cloud step) from the device's observed costs (`CostObserver.decide`). One
        point per image, recorded in the stats (`span_used`, `burst_used`, `handovers`), so the same request with
        that point as fixed knobs (or cloud-only's prefix_rate 1) makes the same image again. The first adaptive
        image on a link primes the observer (`prime`; earlier images at fixed points may have created it)."""
        cfg = self.config
        point = OperatingPoint(cfg.span, cfg.burst)
        adaptive = cfg.policy == "adaptive" and cfg.gate in GATES
        if adaptive and not observer.primed:
            self.prime(observer, seed)
        if adaptive and observer.ready:
            enhance = cfg.inter_enhance and self.device_model is not None
            costs = observer.costs(self.client.vocab_size,
                                   hidden_dim=self.device_model.config.dim if enhance else 0,
                                   feature_dim=interval_feature_dim(cfg.feature_top) if enhance else 0)
            stats.est_device_step_s, stats.est_link_latency_s = costs.device_step_s, costs.latency_s
            stats.est_cloud_step_s = costs.cloud_step_s
            chosen = observer.decide(costs, point, drafted, cfg.cloud_step_price_s).point
            stats.adapted = int(chosen != point)
            point = chosen
        stats.handovers = int(point.cloud_only)
        stats.span_used, stats.burst_used = point.span, point.burst
        return point

    def image_tau(self, observer: CostObserver, stats: GenerationStats) -> float | None:
        """The image's gate threshold: the config's, or under overload (graceful degradation, opt-in: the device's
        estimate of the verifier's seconds per exchange past `overload_verifier_s`) the config's x
        `overload_tau_factor`, the quality budget. Recorded in the stats (`tau_used`, `overloaded`): the same
        request with that tau makes the same image."""
        cfg, tau = self.config, self.config.tau
        limit, busy = cfg.overload_verifier_s, observer.verifier.value
        if tau is not None and cfg.gate in GATES and limit is not None and busy is not None and busy > limit:
            tau *= cfg.overload_tau_factor
            stats.overloaded = 1
        stats.tau_used = tau if tau is not None else 0.0
        return tau


class _Link:
    """One generation's link to the cloud: the client, the simulated network of the device's connection, and the
    stats every request/reply is charged to (bytes, communication and cloud seconds)."""

    def __init__(self, client: CloudClient, network: NetworkModel, stats: GenerationStats, cloud_slowdown: float,
                 wait: Callable[[float], None] | None, observer: CostObserver):
        self.client, self.network, self.stats = client, network, stats
        self.cloud_slowdown = cloud_slowdown  # cloud compute time = reported time x this factor
        self.wait = wait  # spends simulated seconds for real (None: accounted only)
        self.observer = observer  # the device's running cost estimates, which every exchange feeds

    def exchange(self, up_bytes: int, call: Callable, verify: bool = False):
        """One request/reply: uplink transmission of `up_bytes`, `call()`, downlink transmission of the reply's bytes
        (in this order, so the link's seeded jitter/loss stream does not depend on `wait`). A link that goes down
        costs the sender's give-up time (LinkDownError.waited_s) before the error is raised. -> the reply."""
        stats = self.stats
        try:
            up_s, _ = self.network.transmit(up_bytes)
            self._spend(up_s)
            t = time.perf_counter()
            reply = call()
            wall = time.perf_counter() - t
            down_bytes = reply.nbytes()
            down_s, _ = self.network.transmit(down_bytes)
        except LinkDownError as e:
            stats.comm_s += e.waited_s
            self._spend(e.waited_s)
            raise
        self._spend(down_s + reply.cloud_s * (self.cloud_slowdown - 1.0))
        queue_s = float(getattr(reply, "queue_s", 0.0))  # how long the request queued (open and verify replies)
        stats.bytes_up += up_bytes
        stats.bytes_down += down_bytes
        stats.comm_s += up_s + down_s
        stats.cloud_s += reply.cloud_s * self.cloud_slowdown
        stats.queue_s += queue_s
        # the link: the simulated transmissions plus whatever the call took beyond the verifier's own time (a real
        # socket's transport); the verifier (verify replies): its span forward and sampled steps, and the queue wait
        self.observer.observe_exchange(up_bytes, down_bytes, up_s + down_s + max(0.0, wall - reply.cloud_s - queue_s),
                                       reply.cloud_s * self.cloud_slowdown, reply.forward_passes, queue_s, verify)
        return reply

    def _spend(self, seconds: float) -> None:
        if self.wait is not None:
            self.wait(seconds)


class _Generation:
    """One generation's device-side state after the open, and the draft step that advances it.

    State: the committed tokens and who decided each, the tokens accepted locally since the last exchange (with
    their projector inputs), the device's KV cache and its output at the current position (`current`), the device's
    and the random gate's generators, the operating point of its escalations (`point`: span and burst), and the link
    (with the stats). `run` drafts until the image is complete: each step draws a draft and scores it (`draft`),
    then either accepts it locally (`accept_local`) or drafts a span (`draft_span`), sends it (`send_span`) and
    commits the cloud's answer (`commit`); a lost link switches to device-only decoding (`go_offline`)."""

    def __init__(self, decoder: CollabDecoder, link: _Link, reply, tokens: list[int], who: list[str], n_total: int,
                 seed: int, session_id: str, progress: "_Progress", point: OperatingPoint, tau: float | None):
        self.config, self.sampling, self.device_model = decoder.config, decoder.sampling, decoder.device_model
        self.link, self.stats = link, link.stats
        self.tokens, self.who, self.n_total = tokens, who, n_total  # committed tokens, "cloud" / "device" per token
        self.session_id, self.progress = session_id, progress
        self.point = point  # the span and burst of every escalation (CollabDecoder.operating_point)
        self.tau = tau  # the gate's threshold (CollabDecoder.image_tau: the config's, or raised under overload)
        self.observer = link.observer  # the device's running cost estimates (the adaptive policy's inputs)
        self.clock = _Clock(self.config.device_slowdown, decoder.wait)
        self.draw_rng = torch.Generator().manual_seed(seed + DEVICE_SEED_OFFSET)  # the device's draws
        self.gate_rng = torch.Generator().manual_seed(seed + GATE_SEED_OFFSET)  # the random gate's scores
        device_config = self.device_model.device_config
        self.voting = device_config.num_heads > 1 and device_config.combine == "voting"  # heads vote on escalation
        self.pending: list[int] = []  # accepted locally since the last exchange
        self.pending_hidden: list[torch.Tensor] = []  # their device hidden states [dim] (projector inputs)
        self.pending_boxes: list[tuple[torch.Tensor, torch.Tensor]] = []  # their guided boxes (features at send time)
        self.offline = False  # the cloud became unreachable: the device decides the rest alone
        self._box_cache: tuple | None = None  # (current, guided center, guided radius), computed once per position
        w = self.device_model.gpt.tok_embeddings.weight
        with self.clock:
            emb = reply.caption_emb.to(w.device, w.dtype).unsqueeze(0)
            mask = reply.caption_mask.to(w.device).unsqueeze(0)
            drop = None
            if self.sampling.uses_cfg:
                emb, mask = emb.expand(2, -1, -1), mask.expand(2, -1)
                drop = torch.tensor([False, True], device=w.device)
            self.rows = emb.shape[0]  # cache rows: cond (and uncond with CFG)
            self.cache = self.device_model.new_cache(self.rows)
            out = self.device_model.prefill(self.cache, emb, mask, drop, torch.arange(self.rows, device=w.device),
                                            with_heads=self.voting)
            self.stats.device_forward_passes += 1
            if tokens:
                out = self.feed(tokens, 0)
            self.current = _last(out)  # DeviceOutput [rows, ...] of the next position to draft

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        scores = self.config.gate in GATES
        while len(self.tokens) < self.n_total:
            self.progress(self.tokens, self.stats)
            with self.clock:
                q_sent, x, score = self.draft(score_it=not self.offline)
                escalate = self.escalates(score)
                if scores and not self.offline:
                    self.observer.escalation.observe(float(escalate))
                if not escalate:
                    self.accept_local(x)
                    continue
                span, span_q = self.draft_span(x, q_sent)
            self.send_span(span, span_q)
        self.stats.device_s += self.clock.seconds * self.config.device_slowdown
        if self.stats.device_forward_passes:
            self.observer.device_step.update(self.device_step_s())

    def device_step_s(self) -> float:
        """This image's device seconds per forward so far (simulated: x device_slowdown)."""
        return self.clock.seconds * self.config.device_slowdown / max(1, self.stats.device_forward_passes)

    def escalates(self, score: float) -> bool:
        """Whether the draft with this gate score goes to the cloud (never offline)."""
        gate = self.config.gate
        return not self.offline and (gate == "always" or (gate != "never" and score > self.tau))

    def accept_local(self, x: int) -> None:
        """Commit a draft the gate let through (and keep its projector inputs for the next exchange)."""
        position = len(self.tokens)
        self.tokens.append(x)
        self.who.append("device")
        self.stats.device_tokens += 1
        self.stats.degraded_tokens += int(self.offline)
        self.pending.append(x)
        if self.config.inter_enhance and not self.offline:
            self.pending_hidden.append(self.current.hidden[0])
            self.pending_boxes.append(self.box())
        if len(self.tokens) < self.n_total:
            self.current = _last(self.feed([x], position))

    def draft_span(self, x: int, q_sent: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """The uncertain draft x and up to point.span - 1 more, each drawn from the device (span[:-1] are fed)."""
        position = len(self.tokens)
        span_len = min(self.point.span, self.n_total - position)
        span, span_q = [x], [q_sent]
        for j in range(1, span_len):
            self.current = _last(self.feed([span[-1]], position + j - 1))
            q_j, x_j, _ = self.draft(score_it=False)
            span.append(x_j)
            span_q.append(q_j)
        return span, span_q

    def send_span(self, span: list[int], span_q: list[torch.Tensor]) -> None:
        """Send the pending tokens and the span; commit the reply, or go offline when the cloud is unreachable."""
        cfg = self.config
        hidden = feats = None
        if cfg.inter_enhance and self.pending:
            with self.clock:  # one batched call for every pending box (the same values row by row); float16 as the
                # wire carries them (ciar_client.wire), so every transport gives the cloud the same projector inputs
                hidden = torch.stack(self.pending_hidden).to(torch.float16).cpu()
                feats = interval_features(torch.stack([c for c, _ in self.pending_boxes]),
                                          torch.stack([r for _, r in self.pending_boxes]),
                                          top=cfg.feature_top).to(torch.float16).cpu()
        req = VerifyRequest(
            self.session_id, torch.tensor(self.pending, dtype=torch.long), torch.tensor(span, dtype=torch.long),
            torch.stack(span_q),  # float16: `quantize_draft` drew each token from exactly these values
            hidden, feats, burst=self.point.burst, burst_entropy=cfg.burst_entropy)
        client = self.link.client
        try:
            reply = self.link.exchange(req.nbytes(client.vocab_size), lambda: client.verify(req), verify=True)
        except CloudUnreachableError:
            if not cfg.fallback:
                raise
            self.go_offline(span)
            return
        self.commit(span, reply)

    def commit(self, span: list[int], reply) -> None:
        """Commit span[:n] + [next] + burst tokens, roll the device cache back to the accepted prefix, feed the rest."""
        stats, start, span_len, accepted = self.stats, len(self.tokens), len(span), reply.num_accepted
        stats.cloud_requests += 1
        stats.cloud_forward_passes += reply.forward_passes
        stats.verifications += 1
        stats.resumes += int(getattr(reply, "resumed", False))
        stats.drafted += span_len
        stats.accepted += accepted
        self.observer.observe_verdict(span_len, accepted)
        burst = reply.burst_tokens.tolist() if reply.num_burst else []
        committed = (span[:accepted] + [reply.next_token] + burst)[: self.n_total - start]
        stats.burst_tokens += max(0, len(committed) - accepted - 1)
        self.tokens.extend(committed)
        self.who.extend(["cloud"] * len(committed))
        stats.cloud_tokens += len(committed)
        self.pending, self.pending_hidden, self.pending_boxes = [], [], []
        if len(self.tokens) < self.n_total:
            with self.clock:
                keep = start + min(accepted, span_len - 1)  # span[:-1] were fed; the accepted ones stay in the cache
                for r in range(self.rows):
                    self.cache.rollback(r, self.device_model.config.cls_token_num + keep)
                self.current = _last(self.feed(self.tokens[keep:], keep))

    def go_offline(self, span: list[int]) -> None:
        """The cloud is unreachable: keep the drafted span (the device's own samples) and go on alone."""
        stats, start, span_len = self.stats, len(self.tokens), len(span)
        self.offline = True
        stats.degraded = 1
        self.tokens.extend(span)
        self.who.extend(["device"] * span_len)
        stats.device_tokens += span_len
        stats.degraded_tokens += span_len
        if len(self.tokens) < self.n_total:
            with self.clock:  # span[:-1] are in the cache already
                self.current = _last(self.feed([span[-1]], start + span_len - 1))

    # ------------------------------------------------------------------ the draft step
    def draft(self, score_it: bool = True) -> tuple[torch.Tensor, int, float]:
        """Draft at the current position: -> (q [V] float16 draft distribution as sent, drawn token, gate score; 0
        unless `score_it` and the gate scores positions). The token is drawn from the float16 values, normalised
        (`quantize_draft`), so the cloud judges it by exactly the distribution it came from."""
        p, current = self.sampling, self.current
        q32 = logits_to_probs(current.center[0], p, uncond_logits=current.center[1] if p.uses_cfg else None)
        q_sent, q_used = quantize_draft(q32)
        x = int(sample(q_used.unsqueeze(0), self.draw_rng)[0])
        score = self.gate_score(x, q_used) if score_it and self.config.gate in GATES else 0.0
        return q_sent, x, score

    def gate_score(self, x: int, q_used: torch.Tensor) -> float:
        """The gate's score of draft x at the current position (higher: more uncertain); `q_used` [V] is the
        distribution it was drawn from. Voting heads score +-inf: a majority of heads above tau, or not."""
        cfg = self.config
        if cfg.gate == "random":
            return float(gate_scores("random", probs=q_used.unsqueeze(0), generator=self.gate_rng)[0])
        if cfg.gate in ("entropy", "softmax"):
            return float(gate_scores(cfg.gate, probs=q_used.unsqueeze(0))[0])
        if self.voting:
            centers, radii = self.current.heads  # [H, rows, V]
            votes = sum(self._box_score(*_guided_box(centers[h], radii[h], self.sampling), x) > self.tau
                        for h in range(centers.shape[0]))
            return math.inf if votes * 2 > centers.shape[0] else -math.inf
        return self._box_score(*self.box(), x)

    def _box_score(self, center: torch.Tensor, radius: torch.Tensor, x: int) -> float:
        """The interval gate's score of draft x from a guided box (center, radius) [V]."""
        cfg = self.config
        return float(gate_scores(cfg.gate, center=center.unsqueeze(0), radius=radius.unsqueeze(0), topk=cfg.topk,
                                 margin=cfg.margin, drafted=torch.tensor([x]))[0])

    def box(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The guided interval (center, radius) [V] of the current position, computed once per position (the gate and
        the projector's features both read it)."""
        if self._box_cache is None or self._box_cache[0] is not self.current:
            self._box_cache = (self.current, *_guided_box(self.current.center, self.current.radius, self.sampling))
        return self._box_cache[1], self._box_cache[2]

    # ------------------------------------------------------------------ device model
    def feed(self, toks: list[int], start: int):
        """Feed image tokens toks (indices start..) to the device cache; -> DeviceOutput of the last fed position
        ([rows, 1, ...]: only the next token's distribution is ever read)."""
        self.stats.device_forward_passes += 1
        dev = self.device_model
        w = dev.gpt.tok_embeddings.weight
        t = torch.tensor(toks, dtype=torch.long, device=w.device).unsqueeze(0).expand(self.rows, -1)
        pos0 = dev.config.cls_token_num + start
        pos = torch.arange(pos0, pos0 + len(toks), device=w.device)
        out = dev.decode(self.cache, t, pos, kv_len=pos0 + len(toks), with_heads=self.voting, last_only=True)
        self.cache.set_length(range(self.rows), pos0 + len(toks))
        return out


def _guided_box(center: torch.Tensor, radius: torch.Tensor, sampling: SamplingParams):
    """Guided interval (center, radius) [V] from a position's box [rows, V] (cond row 0, uncond row 1 with CFG); with
    greedy sampling (temperature 0) the box is taken at temperature 1."""
    temperature = sampling.temperature or 1.0
    if sampling.uses_cfg:
        return guided_interval(center[0], radius[0], center[1], radius[1], cfg_scale=sampling.cfg_scale,
                               temperature=temperature)
    return guided_interval(center[0], radius[0], temperature=temperature)


class _Progress:
    """Calls `callback(tokens, stats)` whenever `every` more tokens are decided since the last call (and at the end)."""

    def __init__(self, callback: Callable[[list[int], GenerationStats], None] | None, every: int):
        self.callback, self.every, self.last = callback, every, -1

    def __call__(self, tokens: list[int], stats: GenerationStats, final: bool = False) -> None:
        if self.callback is None:
            return
        if final or self.last < 0 or len(tokens) - self.last >= self.every:
            self.last = len(tokens)
            self.callback(list(tokens), stats)


def _last(out):
    """DeviceOutput over [rows, T, ...] -> the last position [rows, ...] (prefill outputs are already [rows, ...])."""
    from ciar.collab.device import DeviceOutput

    if out.center.dim() == 2:
        return out
    heads = None if out.heads is None else (out.heads[0][:, :, -1], out.heads[1][:, :, -1])
    return DeviceOutput(out.center[:, -1], out.radius[:, -1], out.hidden[:, -1], heads)
