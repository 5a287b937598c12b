"""CIAR's operating points and the cost model that chooses one: the expected time to finish an image (issue 29).

    costs = Costs(device_step_s=1e-3, latency_s=0.010, bandwidth_Bps=300e6 / 8, cloud_step_s=0.060, queue_s=0.0,
                  escalation_rate=0.25, accept_first=0.5, accept_next=0.9, vocab_size=1024)
    expected_cost(costs, OperatingPoint(span=2, burst=4), remaining=135)   # Outlook(seconds, cloud_steps)
    choose(costs, calibrated=OperatingPoint(span=2, burst=4), remaining=135)  # Decision: the cheapest allowed point
    link = LinkEstimator(); link.observe(up_bytes, down_bytes, seconds)     # running latency and bandwidth

An *operating point* is how the device makes the rest of the image: drafting with spans of `span` tokens and a cloud
burst of `burst` tokens after a rejection (`OperatingPoint(span, burst)`), or handing the rest to the cloud
(`CLOUD_ONLY`). Nothing here changes what the gate escalates: τ and the gate stay the calibrated ones.

The cost model (written once, here; the notation of docs/architecture.md §2 and §8). Inputs (`Costs`): the device's
step time t_d (one device forward with its draft and gate), the link's per-transmission latency l (the RTT that
`ciar.sim.network` charges each message) and bandwidth b (bytes/s), the verifier's time t_c for the forward that
judges a span, t_s for each token it samples itself (a burst or cloud-only step) and its queue wait w per exchange,
the gate's escalation rate e (the share of drafted positions whose score is > τ), and the
cloud's acceptance: α1 for the uncertain draft that opens a span, α for each later draft once the previous one was
accepted. For a span of k drafts and a burst g:

    P_full(k) = α1 α^(k-1)                                   all k drafts accepted (then no burst)
    A(k)      = α1 (1 + α + ... + α^(k-1))                   expected accepted drafts ("accepted length" - 1)
    L(k, g)   = A(k) + 1 + g (1 - P_full(k))                 tokens one exchange commits (+ the next token, burst)
    S(k, g)   = 1 + g (1 - P_full(k))                        sequential cloud steps of one exchange
    X(k, g)   = 2 l + (B_up(k) + B_down(g)) / b + w + t_c + t_s (S(k, g) - 1)      one exchange, request to reply

B_up is the exact size of the VerifyRequest (`ciar_device.wire`'s `nbytes`) with the k drafts, their [k, V] float16
distributions and the m = round((1 - e) / e) tokens accepted locally since the last exchange (with their
projector inputs under Inter-Enhance); B_down the VerifyReply's, averaged over a burst (1 - P_full) or none. Each
drafted position costs one device step and ends locally with probability 1 - e; an escalation costs k device steps
(the k - 1 further drafts, and the feed of the committed tokens) and an exchange. Over the R remaining tokens
(renewal-reward: the cost per token of one drafted position, times R; the image's end cutting a span is ignored):

    T(k, g) = R [(1 - e) t_d + e (k t_d + X(k, g))] / [(1 - e) + e L(k, g)]       expected seconds to finish
    C(k, g) = R e S(k, g) / [(1 - e) + e L(k, g)]                                 expected cloud steps
    T_cloud = 2 l + (B_up(0) + B_down(R)) / b + w + t_c + (R - 1) t_s,   C_cloud = R    hand the rest to the cloud
    T_open  = R t_s + B_down(R) / b          cloud-only chosen before the open (which goes out either way)

(B_up(0): the pending tokens alone; B_down(R): a reply carrying R tokens.) `choose` minimises T + π C, π an
operator's price of a cloud step in seconds (0: the users' time alone), over the points that verify no less than the
calibrated one: span >= its span and burst >= its burst (a longer span sends more drafts to the exact rule; a longer
burst makes more exact cloud tokens), and cloud-only (every token the cloud's). Quality may only go up.

The inputs are a device's running estimates (`CostObserver`, one per link, kept across its images): the link
(`LinkEstimator`: each exchange's bytes against the seconds it spent on the link, its wall time minus the cloud and
queue time the reply reports: what a real socket sees, and what the simulated network charges), the verifier's t_c,
t_s and queue wait (`CloudStepEstimator`, an `Ewma`), the device's step time, and the gate's and the cloud's rates
(`RateEstimator`, starting from the device file's `policy_rates`). Before its first image a device knows them from
what it has without drafting (`CostObserver.prime`): the round trip of its connection's handshake, one timed device
step, and the verifier's own recent figures (`CostHint`, from the server: the WELCOME frame, or
`CloudClient.cost_hint()` in the cluster). A device chooses once per image, before its open
(`CostObserver.decide`), with a margin (`SWITCH_MARGIN`) and a look back at drafting after `EXPLORE_EVERY` images in a
row on the cloud, the wait doubling (up to `EXPLORE_MAX`) each time the look did not change the choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

# the messages' sizes come from the codec itself (numpy only: every device runs this module, the torch decoder and
# the torch-free client alike)
from ciar_device.wire import VerifyReply, VerifyRequest

# the adaptive policy's rates, under the names the device file carries them (`CIARDefaults.policy_rates`)
POLICY_RATES = ("escalation_rate", "accept_first", "accept_next")

SESSION_ID = "0" * 32  # the decoder's session ids are uuid4().hex: 32 characters
SPANS = tuple(range(1, 33))  # the span knob's range (ciar.collab.knobs)
BURSTS = (0, 1, 2, 4, 8, 16, 32)  # T and C are monotone in g (linear over linear): a coarse grid finds the best
# the adaptive policy leaves the calibrated point only for an expected saving of at least this share of its time:
# near a tie the measured costs' noise would flip the choice from image to image (and with it the image a request
# and seed make) for nothing; a saving this large is beyond the model's error on this box (its inputs predicted
# another point's seconds within 2.5 %, results/2026-11-25e/policy_cost_model.md)
SWITCH_MARGIN = 0.10
# after this many images in a row given to the cloud whole, the device drafts one at the calibrated point: an image
# on the cloud shows nothing new of the device's step, the gate's rate or the cloud's acceptance, so an estimate that
# was wrong when the device gave up drafting would never be corrected. Each look that leaves the choice on the cloud
# doubles the wait, up to EXPLORE_MAX (the looks cost 1/33, then 1/65, ... of the difference: ~0 in the long run)
EXPLORE_EVERY = 32
EXPLORE_MAX = 512


@dataclass(frozen=True)
class OperatingPoint:
    """How the rest of an image is made: spans of `span` drafts and a cloud burst of up to `burst` tokens after a
    rejection, or (`cloud_only`) the cloud makes every remaining token."""

    span: int = 1
    burst: int = 0
    cloud_only: bool = False

    def __post_init__(self):
        if not self.cloud_only and (self.span < 1 or self.burst < 0):
            raise ValueError(f"an operating point needs span >= 1 and burst >= 0, got {self.span}, {self.burst}")

    def __str__(self) -> str:
        return "cloud-only" if self.cloud_only else f"span {self.span}, burst {self.burst}"


CLOUD_ONLY = OperatingPoint(span=0, cloud_only=True)


@dataclass(frozen=True)
class Costs:
    """The costs the model reads (see the module docstring for the symbols)."""

    device_step_s: float  # t_d: one device forward with its draft and gate
    latency_s: float  # l: per transmission (ciar.sim.network's RTT, charged once per message)
    bandwidth_Bps: float  # b: bytes per second (math.inf: no serialisation time)
    cloud_step_s: float  # t_c: one verifier forward over a span (the catch-up and the drafts in one piece)
    queue_s: float  # w: the verifier's queue wait per exchange
    escalation_rate: float  # e: share of drafted positions the calibrated gate sends to the cloud
    accept_first: float  # α1: the cloud accepts the uncertain draft that opens a span
    accept_next: float  # α: it accepts a later draft, the previous one accepted
    vocab_size: int  # V: the draft distributions' length
    hidden_dim: int = 0  # device hidden values sent per locally accepted token (Inter-Enhance; 0: off)
    feature_dim: int = 0  # interval features per locally accepted token (Inter-Enhance; 0: off)
    decode_step_s: float | None = None  # t_s: one cloud-sampled token (a burst or cloud-only step; None: t_c)

    def __post_init__(self):
        if self.decode_step_s is None:
            object.__setattr__(self, "decode_step_s", self.cloud_step_s)
        for name in ("device_step_s", "latency_s", "cloud_step_s", "queue_s", "decode_step_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"costs: {name} must be >= 0, got {getattr(self, name)}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"costs: bandwidth_Bps must be > 0, got {self.bandwidth_Bps}")
        for name in ("escalation_rate", "accept_first", "accept_next"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"costs: {name} must be in [0, 1], got {getattr(self, name)}")
        if self.vocab_size < 1 or self.hidden_dim < 0 or self.feature_dim < 0:
            raise ValueError("costs: vocab_size must be >= 1, hidden_dim and feature_dim >= 0")

    @property
    def pending_per_exchange(self) -> int:
        """m: tokens accepted locally between two escalations, (1 - e) / e rounded (0 when e is 0: no exchange)."""
        e = self.escalation_rate
        return round((1.0 - e) / e) if e > 0 else 0


@dataclass(frozen=True)
class CostHint:
    """The verifier's own recent figures, sent to a device before its first image (WELCOME, or
    `CloudClient.cost_hint()`): its span forward t_c, sampled step t_s and queue wait per exchange, as its replies
    reported them (`CloudStepEstimator` over every device's replies). None where it has not measured one yet."""

    span_s: float | None = None
    step_s: float | None = None
    queue_s: float | None = None

    def scaled(self, factor: float) -> "CostHint":
        """The hint with the verifier's compute times x `factor` (a simulated device's cloud slowdown)."""
        return CostHint(None if self.span_s is None else self.span_s * factor,
                        None if self.step_s is None else self.step_s * factor, self.queue_s)


@dataclass(frozen=True)
class Outlook:
    """What finishing the image at one operating point is expected to cost."""

    seconds: float  # T: expected time to finish
    cloud_steps: float  # C: expected sequential cloud forwards


@dataclass(frozen=True)
class Decision:
    """A chosen operating point, what it is expected to cost, and the objective it minimised (T + price x C)."""

    point: OperatingPoint
    outlook: Outlook
    objective_s: float


def full_accept(costs: Costs, span: int) -> float:
    """P_full(k): every draft of a k-draft span is accepted (no burst follows)."""
    return costs.accept_first * costs.accept_next ** (span - 1)


def accepted_drafts(costs: Costs, span: int) -> float:
    """A(k): expected accepted drafts of a k-draft span."""
    a = costs.accept_next
    return costs.accept_first * (span if a == 1.0 else (1.0 - a ** span) / (1.0 - a))


def request_bytes(costs: Costs, span: int, pending: int) -> int:
    """B_up: the VerifyRequest's exact size with `span` drafts and `pending` locally accepted tokens."""
    return _request_bytes(costs.vocab_size, costs.hidden_dim, costs.feature_dim, span, pending)


def reply_bytes(costs: Costs, tokens: int) -> int:
    """B_down: the VerifyReply's exact size when it commits `tokens` cloud tokens (the next token and tokens - 1
    burst tokens)."""
    return _reply_bytes(costs.vocab_size, tokens)


# sizes depend on shapes only: cached, so that a device choosing at every escalation does not build messages
@functools.lru_cache(maxsize=4096)
def _request_bytes(vocab_size: int, hidden_dim: int, feature_dim: int, span: int, pending: int) -> int:
    def shaped(*shape):  # nbytes reads shapes only: a zero-copy stand-in for the arrays
        return np.broadcast_to(np.float16(0), shape)

    enhance = pending > 0 and hidden_dim + feature_dim > 0
    return VerifyRequest(SESSION_ID, shaped(pending), shaped(span), shaped(span, vocab_size),
                         shaped(pending, hidden_dim) if enhance else None,
                         shaped(pending, feature_dim) if enhance else None).nbytes(vocab_size)


@functools.lru_cache(maxsize=4096)
def _reply_bytes(vocab_size: int, tokens: int) -> int:
    burst = np.broadcast_to(np.int64(0), (max(0, tokens - 1),))
    return VerifyReply(SESSION_ID, 0, 0, False, 0.0, 1, burst_tokens=burst, vocab_size=vocab_size).nbytes()


def link_s(costs: Costs, up_bytes: float, down_bytes: float) -> float:
    """One exchange's time on the link and in the verifier's queue: 2 l + (B_up + B_down) / b + w."""
    return 2.0 * costs.latency_s + (up_bytes + down_bytes) / costs.bandwidth_Bps + costs.queue_s


def expected_cost(costs: Costs, point: OperatingPoint, remaining: int, pending: int = 0,
                  at_open: bool = False) -> Outlook:
    """T and C of finishing the `remaining` tokens at `point` (the module docstring's equations). `pending`: tokens
    accepted locally since the last exchange, which handing the rest to the cloud mid-image would carry (the model of
    a device deciding mid-image; the decoder decides before the open). `at_open`: the choice is made
    before the image's open, which goes out either way: cloud-only then costs no exchange of its own, only the
    cloud's R sampled steps and the R tokens' bytes in the open's reply (T_open = R t_s + B_down(R) / b)."""
    if remaining <= 0:
        return Outlook(0.0, 0.0)
    if point.cloud_only and at_open:
        return Outlook(remaining * costs.decode_step_s + reply_bytes(costs, remaining) / costs.bandwidth_Bps,
                       float(remaining))
    if point.cloud_only:
        seconds = link_s(costs, request_bytes(costs, 0, pending), reply_bytes(costs, remaining))
        return Outlook(seconds + costs.cloud_step_s + (remaining - 1) * costs.decode_step_s, float(remaining))
    e, k, g = costs.escalation_rate, point.span, point.burst
    p_full = full_accept(costs, k)
    burst = g * (1.0 - p_full)  # expected burst tokens of one exchange
    down = p_full * reply_bytes(costs, 1) + (1.0 - p_full) * reply_bytes(costs, 1 + g)
    steps = 1.0 + burst  # S(k, g)
    exchange = (link_s(costs, request_bytes(costs, k, costs.pending_per_exchange), down) + costs.cloud_step_s
                + costs.decode_step_s * burst)
    per_position = (1.0 - e) * costs.device_step_s + e * (k * costs.device_step_s + exchange)
    tokens_per_position = (1.0 - e) + e * (accepted_drafts(costs, k) + 1.0 + burst)
    return Outlook(remaining * per_position / tokens_per_position, remaining * e * steps / tokens_per_position)


def candidate_spans(k: int) -> list[int]:
    """The spans the adaptive policy considers from the calibrated one `k` on (longer spans are rarely accepted
    whole: a coarse grid of them is enough)."""
    return sorted({min(SPANS[-1], s) for s in (k, k + 1, k + 2, 2 * k, 3 * k, 4 * k, 8, 12, 16) if s >= k})


def allowed_points(calibrated: OperatingPoint, spans=SPANS, bursts=BURSTS) -> list[OperatingPoint]:
    """The points that verify no less than `calibrated`: the calibrated point first, then every span >= its span
    and burst >= its burst from the grids, then cloud-only. A cloud-only calibration allows cloud-only alone."""
    if calibrated.cloud_only:
        return [CLOUD_ONLY]
    points = [calibrated]
    points += [OperatingPoint(k, g) for k in spans for g in bursts
               if k >= calibrated.span and g >= calibrated.burst and (k, g) != (calibrated.span, calibrated.burst)]
    return points + [CLOUD_ONLY]


def choose(costs: Costs, calibrated: OperatingPoint, remaining: int, cloud_step_price_s: float = 0.0,
           pending: int = 0, spans=SPANS, bursts=BURSTS, at_open: bool = False, margin: float = 0.0) -> Decision:
    """The allowed point (`allowed_points`) with the least T + price x C; on a tie the earlier one (the calibrated
    point first). `cloud_step_price_s`: the operator's price of one cloud step, in seconds of the user's time;
    `at_open`: chosen before the image's open (`expected_cost`); `margin`: another point than the calibrated one
    must be expected to save at least this share of the calibrated point's objective (`SWITCH_MARGIN`)."""
    if not cloud_step_price_s >= 0:
        raise ValueError(f"cloud_step_price_s must be >= 0, got {cloud_step_price_s}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    best = None
    for point in allowed_points(calibrated, spans, bursts):
        outlook = expected_cost(costs, point, remaining, pending, at_open)
        objective = outlook.seconds + cloud_step_price_s * outlook.cloud_steps
        if best is None:  # the calibrated point, which the others must beat by the margin
            best, bar = Decision(point, outlook, objective), objective * (1.0 - margin)
        elif objective < min(bar, best.objective_s):
            best = Decision(point, outlook, objective)
    return best


# ---------------------------------------------------------------------------------------------- running estimates
class Ewma:
    """An exponentially weighted running mean: each sample weighs `weight`, and the weights are normalised, so the
    first sample is the estimate at once (no pull towards zero). `value` is `prior` before any sample. With `clip`,
    from the third sample on a sample is first clipped into [value / clip, value x clip]: one step that a busy box
    stalled for 30 ms moves a 6 ms estimate by a bounded amount, while a real change gets through in a few samples."""

    def __init__(self, weight: float = 0.2, prior: float | None = None, clip: float | None = None):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if clip is not None and not clip > 1.0:
            raise ValueError(f"clip must be > 1, got {clip}")
        self.weight, self.prior, self.clip = weight, prior, clip
        self._sum = self._norm = 0.0  # decayed sum of samples, decayed sum of their weights
        self.samples = 0

    def update(self, x: float) -> float:
        if self.clip is not None and self.samples >= 2 and self.value > 0:
            x = min(max(x, self.value / self.clip), self.value * self.clip)
        keep = 1.0 - self.weight
        self._sum = keep * self._sum + self.weight * x
        self._norm = keep * self._norm + self.weight
        self.samples += 1
        return self.value

    @property
    def value(self) -> float | None:
        return self._sum / self._norm if self.samples else self.prior


class LinkEstimator:
    """Running latency and bandwidth of one device's link, fitted to its exchanges: an exchange that moves
    up + down bytes spends 2 l + (up + down) / b on the link (the network model's two transmissions), so an
    exponentially weighted least-squares line through (bytes, seconds) has slope 1 / b and intercept 2 l.

    Until the exchanges' sizes differ enough to fit a slope (they do once their pending tokens, spans or features
    differ), or when the fit is not positive (noise), the bandwidth is `prior_bandwidth_Bps` and the latency comes
    from the mean exchange at that bandwidth; with no sample both are their priors."""

    MIN_SPREAD_BYTES = 64.0  # the bytes' weighted standard deviation below which no slope is fitted

    def __init__(self, weight: float = 0.2, prior_latency_s: float = 0.0, prior_bandwidth_Bps: float = math.inf):
        self.prior_latency_s, self.prior_bandwidth_Bps = prior_latency_s, prior_bandwidth_Bps
        self._x, self._y, self._xx, self._xy = (Ewma(weight) for _ in range(4))

    def observe(self, up_bytes: int, down_bytes: int, seconds: float) -> None:
        """One exchange: its bytes each way and the seconds it spent on the link (wall time from request to reply,
        minus the cloud and queue time the reply reports)."""
        x = float(up_bytes + down_bytes)
        for est, value in ((self._x, x), (self._y, seconds), (self._xx, x * x), (self._xy, x * seconds)):
            est.update(value)

    @property
    def samples(self) -> int:
        return self._x.samples

    @property
    def bandwidth_Bps(self) -> float:
        if not self._x.samples:
            return self.prior_bandwidth_Bps
        mx = self._x.value
        var = self._xx.value - mx * mx
        slope = (self._xy.value - mx * self._y.value) / var if var > self.MIN_SPREAD_BYTES ** 2 else 0.0
        return 1.0 / slope if slope > 0 else self.prior_bandwidth_Bps

    @property
    def latency_s(self) -> float:
        if not self._x.samples:
            return self.prior_latency_s
        return max(0.0, (self._y.value - self._x.value / self.bandwidth_Bps) / 2.0)


class CloudStepEstimator:
    """The verifier's two costs, from its replies: t_c, the forward that judges a span (a verify reply with one
    forward: no burst followed), and t_s, one token it samples itself: a verify reply's burst, (cloud_s - t_c) /
    its steps, and a long open's seconds per step, whose sampled steps dominate it (a device whose images go to the
    cloud whole still sees the verifier's step change). A *step* is a token the cloud made itself or a forward,
    whichever there were more of (`tokens`, when the reply says): one token a forward, the forwards (a burst's
    entropy stop spends one that makes none); by Jacobi windows (`jacobi_window`, several tokens a forward), the
    tokens, so the model prices a burst and a cloud-only image at what a token costs there. Until one of them has
    been seen it is the mean seconds per forward of every reply.

    Not a least-squares line through (forward_passes - 1, cloud_s): with bursts of one or two lengths and a busy
    box's noise such a fit tilted (t_c 300 ms, t_s 10 ms), the model then gave every image to the cloud, and with
    no more verify replies the tilted line was never corrected (benchmarks/results/2026-11-25f/README.md)."""

    LONG_OPEN = 32  # an open with at least this many steps counts towards t_s (its prefill is one of them)

    def __init__(self, weight: float = 0.2, clip: float = 3.0):
        self.span = Ewma(weight, clip=clip)  # t_c
        self.step = Ewma(weight, clip=clip)  # t_s
        self.per_pass = Ewma(weight, clip=clip)  # every reply's seconds per forward: the stand-in for either
        self.samples = 0  # verify replies observed

    def observe(self, cloud_s: float, forward_passes: int, verify: bool = True, tokens: int | None = None) -> None:
        """One reply: the cloud's seconds and forwards, and `tokens` the cloud made itself (a verify reply's burst
        tokens, an open's prefix tokens; None: one a forward)."""
        passes = max(1, int(forward_passes))
        self.per_pass.update(cloud_s / passes)
        made = 0 if tokens is None else max(0, int(tokens))
        if verify:
            self.samples += 1
            if passes == 1:
                self.span.update(cloud_s)
            elif self.span.samples:
                self.step.update(max(0.0, cloud_s - self.span.value) / max(passes - 1, made))
        elif max(passes, made) >= self.LONG_OPEN:
            self.step.update(cloud_s / max(passes, made))

    def prime(self, hint: CostHint) -> None:
        """The server's figures as t_c's and t_s's priors (`Ewma.prior`: the replies' own replace them)."""
        self.span.prior, self.step.prior = hint.span_s, hint.step_s

    def steps(self) -> tuple[float, float] | None:
        """(t_c, t_s) in seconds: observed, else primed (`prime`), else the mean per forward so far; None when
        neither a reply nor a prior gives one."""
        fallback = self.per_pass.value  # no prior: None before any reply
        t_c = self.span.value if self.span.value is not None else fallback
        t_s = self.step.value if self.step.value is not None else fallback
        if t_c is None and t_s is None:
            return None
        return (t_c if t_c is not None else t_s, t_s if t_s is not None else t_c)

    def hint(self, queue_s: float | None = None) -> CostHint:
        """What this estimator has seen, as a hint for a device that has seen nothing (a verifier's own figures)."""
        return CostHint(self.span.value if self.span.samples else None,
                        self.step.value if self.step.samples else None, queue_s)


class RateEstimator:
    """A rate (successes / trials) with `prior_trials` pseudo-trials at `prior`, whose counts decay by `decay` per
    trial (a device's rates drift with its prompts: half-life ln 2 / (1 - decay) trials)."""

    def __init__(self, prior: float, prior_trials: float, decay: float = 0.998):
        self.prior, self.prior_trials, self.decay = prior, prior_trials, decay
        self.successes = self.trials = 0.0

    def observe(self, successes: float, trials: float = 1.0) -> None:
        keep = self.decay ** trials
        self.successes = keep * self.successes + successes
        self.trials = keep * self.trials + trials

    @property
    def value(self) -> float:
        return (self.successes + self.prior * self.prior_trials) / (self.trials + self.prior_trials)

    @property
    def observed(self) -> float | None:
        """The observations alone (no prior), None without any."""
        return self.successes / self.trials if self.trials else None


class CostObserver:
    """What one device has observed of its costs, kept across its images (its link and its verifier change slowly
    compared with an image): the link (`LinkEstimator`), the verifier's span forward, sampled step and queue wait
    (`CloudStepEstimator`, an `Ewma`), the device's own step time, the gate's escalation rate and the cloud's
    acceptance (`RateEstimator`s, priors until observed). Fed by the device's exchanges and draft loop; `costs()`
    gives the model's inputs. One observer per link (a simulated device fleet keeps one per network profile)."""

    ESCALATION_PRIOR = (0.15, 8.0)  # (rate, pseudo-drafts) before the device has shown its own
    ACCEPT_PRIOR = (0.5, 0.8, 4.0)  # (alpha1, alpha, pseudo-verifications)
    RATES = POLICY_RATES  # the names the device file carries them under

    def __init__(self, weight: float = 0.2, rates: dict | None = None, decay: float = 0.998):
        """`rates`: the starting escalation and acceptance rates (`RATES`; the device file's, measured on val
        prompts at its calibrated point: `CIARDefaults.policy_rates`), else the built-in priors; `decay`: the
        rates' counts decay per trial (1: a plain average)."""
        self.link = LinkEstimator(weight)
        self.cloud = CloudStepEstimator()
        self.queue = Ewma(weight, prior=0.0)
        self.verifier = Ewma(weight)  # seconds in the verifier per verify exchange: queue wait + its forwards
        self.device_step = Ewma(weight, clip=3.0)
        self.primed = False  # `prime` was called (a device primes an observer once, before its first image)
        self.link_primed = False  # the link's latency is known from a handshake (0 on a perfect link)
        self.cloud_only_streak = 0  # images in a row the policy gave to the cloud whole (EXPLORE_EVERY)
        self.explore_after = EXPLORE_EVERY  # the streak after which the next image looks at drafting again
        self.exploring = False  # the last image was such a look
        rates = rates or {}
        e0, n0 = self.ESCALATION_PRIOR
        a1, a, m0 = self.ACCEPT_PRIOR
        self.escalation = RateEstimator(rates.get("escalation_rate", e0), n0, decay)
        self.accept_first = RateEstimator(rates.get("accept_first", a1), m0, decay)
        self.accept_next = RateEstimator(rates.get("accept_next", a), m0, decay)

    def observe_exchange(self, up_bytes: int, down_bytes: int, link_s: float, cloud_s: float, forward_passes: int,
                         queue_s: float, verify: bool, tokens: int | None = None) -> None:
        """One request/reply: its bytes, seconds on the link, the cloud's seconds, forwards and the tokens it made
        itself (an open's only towards the sampled step: `CloudStepEstimator`) and the queue wait a verify reply
        reports."""
        self.link.observe(up_bytes, down_bytes, link_s)
        self.cloud.observe(cloud_s, forward_passes, verify, tokens)
        if verify:
            self.queue.update(queue_s)
            self.verifier.update(queue_s + cloud_s)

    def observe_verdict(self, span: int, accepted: int) -> None:
        """The cloud's judgement of a span of `span` drafts: `accepted` kept."""
        self.accept_first.observe(float(accepted > 0))
        later = min(accepted, span - 1)  # a later draft is judged once the one before it passed
        if later:
            self.accept_next.observe(float(max(0, accepted - 1)), float(later))

    def prime(self, latency_s: float | None = None, device_step_s: float | None = None,
              hint: CostHint | None = None) -> None:
        """What a device knows before its first exchange, as the estimates' priors (its observations replace them):
        `latency_s`, the link's per-transmission latency from its connection's handshake (half its round trip);
        `device_step_s`, one timed device step; `hint`, the verifier's own recent figures (`CostHint`)."""
        self.primed = True
        if latency_s is not None:
            self.link.prior_latency_s = max(0.0, float(latency_s))
            self.link_primed = True
        if device_step_s is not None:
            self.device_step.prior = max(0.0, float(device_step_s))
        if hint is not None:
            self.cloud.prime(hint)
            if hint.queue_s is not None:
                self.queue.prior = max(0.0, float(hint.queue_s))

    @property
    def ready(self) -> bool:
        """Whether every cost the model reads has a value, observed (an image drafted and verified) or primed before
        the first image (`prime`: the handshake, a timed device step, the verifier's hint)."""
        link = self.link.samples or self.link_primed
        return bool(link and self.cloud.steps() is not None and self.device_step.value is not None)

    def cloud_steps(self) -> tuple[float, float]:
        """(t_c, t_s) as observed (`CloudStepEstimator`; the server's hint until then), (0, 0) without either."""
        return self.cloud.steps() or (0.0, 0.0)

    def decide(self, costs: Costs, calibrated: OperatingPoint, remaining: int, cloud_step_price_s: float = 0.0,
               spans=None, bursts=BURSTS) -> Decision:
        """The operating point of the device's next image, chosen before its open: `choose` with the margin
        (`SWITCH_MARGIN`), except that after `explore_after` images in a row on the cloud the image drafts at the
        calibrated point, to look at drafting's costs again; when the image after such a look goes to the cloud
        again, the wait doubles (up to `EXPLORE_MAX`), and a device that drafts by choice starts over at
        `EXPLORE_EVERY`. Keeps the streak (`cloud_only_streak`). `spans`: the spans considered (default
        `candidate_spans` of the calibrated span)."""
        if spans is None:
            spans = candidate_spans(calibrated.span) if not calibrated.cloud_only else ()
        decision = choose(costs, calibrated, remaining, cloud_step_price_s, spans=spans, bursts=bursts, at_open=True,
                          margin=SWITCH_MARGIN)
        if not decision.point.cloud_only:
            self.cloud_only_streak, self.explore_after, self.exploring = 0, EXPLORE_EVERY, False
            return decision
        if self.exploring:  # the look at drafting did not change the choice: look less often
            self.explore_after = min(EXPLORE_MAX, 2 * self.explore_after)
        self.exploring = self.cloud_only_streak >= self.explore_after
        if self.exploring:
            self.cloud_only_streak = 0
            outlook = expected_cost(costs, calibrated, remaining, at_open=True)
            return Decision(calibrated, outlook, outlook.seconds + cloud_step_price_s * outlook.cloud_steps)
        self.cloud_only_streak += 1
        return decision

    def costs(self, vocab_size: int, hidden_dim: int = 0, feature_dim: int = 0,
              device_step_s: float | None = None) -> Costs:
        """The model's inputs as observed (`device_step_s`: a fresher figure, e.g. the current image's own)."""
        steps = self.cloud_steps()
        return Costs(
            device_step_s=device_step_s if device_step_s is not None else (self.device_step.value or 0.0),
            latency_s=self.link.latency_s, bandwidth_Bps=self.link.bandwidth_Bps,
            cloud_step_s=steps[0], decode_step_s=steps[1], queue_s=self.queue.value or 0.0,
            escalation_rate=self.escalation.value, accept_first=self.accept_first.value,
            accept_next=self.accept_next.value, vocab_size=vocab_size, hidden_dim=hidden_dim,
            feature_dim=feature_dim)
