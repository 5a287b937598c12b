"""The CIAR device loop: the one Python implementation of the device side, for every device and every method.

    rt = DeviceRuntime("weights/scenes-v2/onnx")
    conn = DeviceConnection("ws://localhost:8000", key="...", vocab_size=rt.vocab_size)
    result = generate(rt, conn, "a small red circle at the top on a gray background", seed=0)
    result.tokens   # [N] int64;  result.who  # "cloud" / "device" per token;  result.stats  # dict

A real device calls `generate` (the ONNX runtime, a WebSocket). The cluster's simulated phones run the same loop
(`run_image`) through `ciar.sim.decoder.CollabDecoder`, which only plugs in their parts. The loop has three
plug-ins:
- the **runtime**: the device model behind `start` / `feed` / `rollback` / `step_seconds` (`ciar_device.runtime.
  DeviceRuntime` on onnxruntime, `ciar.collab.device.TorchRuntime` on torch);
- the **link**: one image's requests and what they cost. `Link` measures a real transport: wall time and the
  frames a `DeviceConnection` saw. `ciar.sim.decoder.SimulatedLink` charges a network model's seconds for each
  message's bytes instead, spending them for real when asked;
- the **clock**: device compute, measured (`Clock`; a simulated device stretches it by its slowdown).
The maths and the draws are not plugged: every device computes with `ciar_device.maths` on numpy and draws with its
counter-based `uniform(seed, stream, position)`. Two devices with the same draft distributions draw the same tokens,
whatever runs their model. The browser's port (`web/src/loop.js`) computes the same bits.

One image (docs/architecture.md §4, §7):
1. *choose the point*: before the open, the image's span and burst (the calibrated ones under the fixed policy;
   the adaptive policy's choice from the device's observed costs, `ciar_device.policy`; or cloud-only);
2. *open*: the cloud makes ceil(prefix_rate * N) tokens (all N for cloud-only) and returns the caption embeddings;
3. per position: draft x from the float16 draft distribution (`quantize_draft`), score it with the gate (the
   calibrated gate on the guided logit box, a baseline gate, or "always" / "never"); score <= tau: *accept
   locally* (its hidden state and interval features go with the next request when interval-enhanced decoding is
   on); else draft a *span* of `span` tokens, verify it with the cloud, commit span[:n] + [next] + burst, roll the
   device cache back to the accepted prefix and feed the rest;
4. close the session.
Overload (opt-in, `overload_verifier_s`): when the device's estimate of the verifier's seconds per exchange is past
it, the image's tau is multiplied by `overload_tau_factor`. Voting devices (several Inter-Heads, "voting") escalate
when a majority of heads score above tau.

Link loss: when the cloud becomes unreachable after the open (`unreachable`: the connection is gone after its
retries, the simulated link is down, no verifier answers, or 503), the device keeps the span it drafted and decodes
the rest alone (no gate, no verification); the stats count the image as `degraded` with the tokens it made alone.
`fallback=False` raises instead. Every image ends with a CLOSE, best effort: a transport that knows its link is down
sends none, and a close that fails loses nothing (the verifier frees an idle session itself).

Stats: `ciar_device.stats.GenerationStats`, filled the same way by every device; `generate` returns them as a dict
with the wall time and device ms per token.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ciar_device import maths as M
from ciar_device.policy import CostObserver, OperatingPoint
from ciar_device.stats import GenerationStats
from ciar_device.wire import OpenRequest, RuleConfig, Sampling, VerifyRequest

SCORING_GATES = M.GATES  # gates that score each position against tau
LOOP_GATES = SCORING_GATES + ("always", "never")  # "always": every token verified (EAGLE); "never": none (CoDe)
POLICIES = ("adaptive", "fixed")  # ciar.collab.knobs' `policy`
PROGRESS_EVERY = 12


@dataclass(frozen=True)
class LoopConfig:
    """Every knob the loop reads (`ciar.collab.knobs` declares their ranges; `loop_config` builds one from an
    export's manifest, `ciar.sim.decoder.CollabConfig.loop_config` from the cluster's config)."""

    gate: str  # LOOP_GATES
    tau: float | None  # escalate when the gate's score > tau (None: the gate scores nothing)
    span: int  # draft tokens per verification (the calibrated one; the adaptive policy may draft more)
    burst: int  # cloud burst g after a rejection
    burst_entropy: float
    prefix_rate: float  # fraction of the image the cloud makes first
    feature_top: int  # interval_features(top=...) for the projector
    inter_enhance: bool  # interval features with the locally accepted tokens
    sampling: Any  # cfg_scale, temperature, top_k, top_p (wire `Sampling` or `ciar.decoding.sampling.SamplingParams`)
    policy: str = "adaptive"  # "adaptive": each image's point from the observed costs; "fixed": span and burst
    cloud_step_price_s: float = 0.0  # the operator's price of a cloud step in seconds (adaptive policy)
    rule: RuleConfig = field(default_factory=RuleConfig)  # the cloud's acceptance rule
    topk: int = 200  # set size of the "topk" gate
    margin: float = 0.0  # InterFuse safety margin before the gate scores
    fallback: bool = True  # cloud unreachable mid-image: finish on the device (degraded)
    overload_verifier_s: float | None = None  # graceful degradation under overload (None: off)
    overload_tau_factor: float = 1.0  # ... its budget: tau x at most this
    jacobi_window: int = 0  # the cloud's own tokens (the prefix) by Jacobi windows of this many drafts (0: one a pass)

    @property
    def scores(self) -> bool:
        return self.gate in SCORING_GATES

    @property
    def cfg_rows(self) -> int:
        return 2 if self.sampling.cfg_scale > 1.0 else 1


def loop_config(manifest: dict, *, tau=None, gate=None, span=None, burst=None, prefix_rate=None,
                inter_enhance: bool = True, policy: str = "adaptive", cloud_step_price_s: float = 0.0,
                fallback: bool = True) -> LoopConfig:
    """The loop's knobs for an exported device: the given ones, else the manifest's (ValueError on an unsupported
    gate or policy, or no threshold)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not cloud_step_price_s >= 0:
        raise ValueError(f"cloud_step_price_s must be >= 0, got {cloud_step_price_s}")
    d = manifest.get("ciar_defaults") or {}
    gate = gate if gate is not None else d.get("gate", "interval")
    if gate not in LOOP_GATES:
        raise ValueError(f"gate {gate!r} is not supported by the device loop; supported: {', '.join(LOOP_GATES)}")
    tau = tau if tau is not None else (d.get("taus") or {}).get(gate)
    if gate in SCORING_GATES and (tau is None or math.isnan(float(tau))):
        raise ValueError(f"no threshold for the {gate!r} gate: pass tau, or export a calibrated device "
                         f"(`python -m pipelines.calibrate`, then `python -m pipelines.export_onnx`)")
    span = int(span if span is not None else d.get("span", 4))
    burst = int(burst if burst is not None else d.get("burst", 0))
    prefix_rate = float(prefix_rate if prefix_rate is not None else manifest.get("prefix_rate", 0.06))
    if span < 1 or burst < 0 or not 0.0 <= prefix_rate <= 1.0:
        raise ValueError(f"need span >= 1, burst >= 0 and prefix_rate in [0, 1]; got {span}, {burst}, {prefix_rate}")
    s = Sampling(*M.check_sampling(**manifest["sampling"]))
    return LoopConfig(gate, None if tau is None else float(tau), span, burst, float(d.get("burst_entropy", 0.0)),
                      prefix_rate, int(manifest.get("feature_top", 8)), bool(inter_enhance), s, policy,
                      float(cloud_step_price_s), fallback=bool(fallback))


@dataclass
class Result:
    tokens: np.ndarray  # [N] int64
    who: list[str]  # per token: "cloud" (prefix, verified, recovered, burst) or "device" (accepted locally)
    stats: dict


def generate(runtime, client, prompt: str, seed: int, *, session_id: str | None = None, tau=None, gate=None,
             span=None, burst=None, prefix_rate=None, inter_enhance: bool = True, fallback: bool = True,
             policy: str = "adaptive", observer: CostObserver | None = None, cloud_step_price_s: float = 0.0,
             on_progress: Callable[[list[int], dict], None] | None = None) -> Result:
    """One image on an exported device (`DeviceRuntime`) over a real transport (`DeviceConnection`, or any
    `CloudClient`). `on_progress(tokens_so_far, stats_so_far)` after the prefix, every 12 more decided tokens and at
    the end. `fallback`: when the cloud becomes unreachable after the open (`unreachable`), finish the image on the
    device alone and mark it degraded; False raises instead. `policy`: "adaptive" (default) chooses the image's span
    and burst (never below the calibrated ones) or cloud-only before the open from the costs in `observer`
    (`ciar_device.policy.CostObserver`: keep one per connection across images; a fresh one when not given, primed
    with the connection's handshake, one timed step and the WELCOME's hint); "fixed" runs the calibrated span and
    burst. The point is in the stats (`span_used`, `burst_used`, `handovers`): the same request with it as fixed
    knobs makes the same image."""
    cfg = loop_config(runtime.manifest, tau=tau, gate=gate, span=span, burst=burst, prefix_rate=prefix_rate,
                      inter_enhance=inter_enhance, policy=policy, cloud_step_price_s=cloud_step_price_s,
                      fallback=fallback)
    if observer is None:
        observer = CostObserver(rates=(runtime.manifest.get("ciar_defaults") or {}).get("policy_rates"))
    progress = None if on_progress is None else (lambda toks, st: on_progress(toks, stats_dict(st)))
    t0 = time.perf_counter()
    tokens, who, stats = run_image(runtime, Link(client, observer), cfg, prompt, seed, session_id,
                                   num_tokens=runtime.num_tokens, on_progress=progress)
    out = stats_dict(stats)
    out["wall_s"] = time.perf_counter() - t0
    return Result(np.array(tokens, np.int64), who, out)


def stats_dict(stats: GenerationStats) -> dict:
    """GenerationStats -> its dict (`to_dict`) plus device milliseconds per token."""
    out = stats.to_dict()
    out["device_ms_per_token"] = 1000.0 * stats.device_s / stats.total_tokens if stats.total_tokens else None
    return out


def unreachable(exc: BaseException) -> bool:
    """Whether a CloudClient's error means the cloud cannot be reached (the device may finish alone): the connection
    is gone after its retries or the simulated link is down (ConnectionError / OSError; `ciar.collab.protocol.
    CloudUnreachableError` is one), or no verifier can take the work (status 503)."""
    return isinstance(exc, OSError) or getattr(exc, "status", None) == 503


# ---------------------------------------------------------------------------------------------- plug-ins


class Clock:
    """Device compute: accumulates the measured seconds of the code inside `with clock:` blocks. A simulated device
    is `slowdown` x slower: its seconds are charged x slowdown, and with `wait` (e.g. time.sleep) it also waits
    (slowdown - 1) x the measured time after each block, so that it is slow for real."""

    def __init__(self, slowdown: float = 1.0, wait: Callable[[float], None] | None = None):
        self.seconds = 0.0
        self.slowdown = float(slowdown)
        self.wait = wait

    def __enter__(self):
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t
        self.seconds += dt
        if self.wait is not None and self.slowdown > 1.0:
            self.wait(dt * (self.slowdown - 1.0))

    @property
    def charged_s(self) -> float:
        return self.seconds * self.slowdown


class Link:
    """One image's link to the cloud over a real transport: every request's wall time is measured; communication is
    that time less the cloud's reported seconds; bytes are the frames the connection saw (a `DeviceConnection`'s
    `exchanges`, resumes included) or the messages' exact sizes. Every exchange feeds the device's cost estimates
    (`observer`). Subclasses (`ciar.sim.decoder.SimulatedLink`) charge a network model instead."""

    def __init__(self, client, observer: CostObserver):
        self.client, self.observer = client, observer

    @property
    def vocab_size(self) -> int:
        return int(self.client.vocab_size)

    def send(self, request):
        """The client's call for one request (OPEN or VERIFY) -> its reply."""
        return self.client.verify(request) if isinstance(request, VerifyRequest) else self.client.open(request)

    def request_bytes(self, request) -> int:
        """The request's exact frame size (a VERIFY's token ids are packed at the vocabulary's width)."""
        return request.nbytes(self.vocab_size) if isinstance(request, VerifyRequest) else request.nbytes()

    def exchange(self, request, stats: GenerationStats):
        """Send one request (OPEN or VERIFY), charge its costs to `stats`; -> the reply."""
        verify = isinstance(request, VerifyRequest)
        log = getattr(self.client, "exchanges", None)
        seen = len(log) if log is not None else 0
        t = time.perf_counter()
        try:
            reply = self.send(request)
        except Exception:
            stats.comm_s += time.perf_counter() - t  # the device waited for a reply that did not come
            raise
        wall = time.perf_counter() - t
        if log is not None:
            up, down = sum(e.up_bytes for e in log[seen:]), sum(e.down_bytes for e in log[seen:])
        else:
            up, down = self.request_bytes(request), reply.nbytes()
        cloud_s, queue_s = float(reply.cloud_s), float(getattr(reply, "queue_s", 0.0))
        # the link: the wall time beyond the verifier's own (its forwards and the queue): what the transport took
        self.charge(stats, reply, verify, up, down, comm_s=max(0.0, wall - cloud_s), cloud_s=cloud_s,
                    link_s=max(0.0, wall - cloud_s - queue_s))
        return reply

    def charge(self, stats: GenerationStats, reply, verify: bool, up: int, down: int, *, comm_s: float,
               cloud_s: float, link_s: float) -> None:
        queue_s = float(getattr(reply, "queue_s", 0.0))  # how long the request queued (open and verify replies)
        stats.cloud_requests += 1
        stats.cloud_forward_passes += int(reply.forward_passes)
        stats.bytes_up += up
        stats.bytes_down += down
        stats.comm_s += comm_s
        stats.cloud_s += cloud_s
        stats.queue_s += queue_s
        made = int(reply.num_burst) if verify else len(reply.prefix_tokens)  # the tokens the cloud made itself
        self.observer.observe_exchange(up, down, link_s, cloud_s, int(reply.forward_passes), queue_s, verify, made)

    def latency_prior_s(self) -> float | None:
        """The link's one-way latency before any image: half the connection's handshake round trip (None: unknown)."""
        handshake = getattr(self.client, "handshake_s", None)
        return handshake / 2 if handshake else None

    def cost_hint(self):
        """The verifier's recent costs (`CostHint`) as the client knows them (a WELCOME's), or None."""
        ask = getattr(self.client, "cost_hint", None)
        return ask() if ask is not None else None

    def close(self, session_id: str) -> None:
        self.client.close(session_id)


# ---------------------------------------------------------------------------------------------- one image


def run_image(runtime, link: Link, cfg: LoopConfig, prompt: str, seed: int, session_id: str | None = None, *,
              num_tokens: int, clock: Clock | None = None,
              on_progress: Callable[[list[int], GenerationStats], None] | None = None,
              progress_every: int = PROGRESS_EVERY) -> tuple[list[int], list[str], GenerationStats]:
    """One image's tokens, who decided each and its stats. `runtime` may be None for cloud-only (prefix_rate 1).
    `on_progress(tokens, stats)` after the prefix, every `progress_every` more decided tokens and at the end."""
    return _Image(runtime, link, cfg, int(seed), session_id or uuid.uuid4().hex, num_tokens, clock or Clock(),
                  _Progress(on_progress, progress_every)).run(prompt)


class _Progress:
    """Calls `callback(tokens, stats)` whenever `every` more tokens are decided since the last call (and at the end)."""

    def __init__(self, callback: Callable[[list[int], GenerationStats], None] | None, every: int):
        self.callback, self.every, self.last = callback, max(1, int(every)), -1

    def __call__(self, tokens: list[int], stats: GenerationStats, final: bool = False) -> None:
        if self.callback is None:
            return
        if final or self.last < 0 or len(tokens) - self.last >= self.every:
            self.last = len(tokens)
            self.callback(list(tokens), stats)


class _Image:
    """One image's device-side state and its draft step.

    State: the committed tokens and who decided each, the tokens accepted locally since the last exchange (with their
    projector inputs), the runtime's output at the current position (`step`), the image's operating point (span,
    burst) and tau, the link and the stats. `draft_all` drafts until the image is complete: each step draws a draft
    and scores it (`draft`, `score`), then either accepts it locally (`accept_local`) or drafts a span
    (`draft_span`), sends it (`send_span`) and commits the cloud's answer (`commit`); a lost link switches to
    device-only decoding (`go_offline`)."""

    def __init__(self, runtime, link: Link, cfg: LoopConfig, seed: int, sid: str, n_total: int, clock: Clock,
                 progress: _Progress):
        self.rt, self.link, self.cfg, self.seed, self.sid = runtime, link, cfg, seed, sid
        self.observer = link.observer  # the device's running cost estimates (fed by every image)
        self.n_total, self.clock, self.progress = int(n_total), clock, progress
        self.stats = GenerationStats()
        self.span, self.burst, self.tau = cfg.span, cfg.burst, cfg.tau  # the image's point and threshold
        self.temp = cfg.sampling.temperature or 1.0  # greedy sampling: the box is taken at temperature 1
        self.offline = False  # the cloud became unreachable: the device decides the rest alone
        self.tokens: list[int] = []
        self.who: list[str] = []
        self.step = None  # the runtime's Step of the position to draft next
        self.box = None  # its guided box, computed once per position
        self.pending: list[int] = []  # accepted locally since the last exchange, with their projector inputs
        self.pend_hidden: list[np.ndarray] = []
        self.pend_box: list[tuple[np.ndarray, np.ndarray]] = []

    # ------------------------------------------------------------------ the image
    def run(self, prompt: str) -> tuple[list[int], list[str], GenerationStats]:
        cfg, st, n_total = self.cfg, self.stats, self.n_total
        prefix_len = n_total if cfg.prefix_rate >= 1.0 else min(n_total, math.ceil(cfg.prefix_rate * n_total))
        if prefix_len < n_total and self.rt is None:
            raise ValueError("drafting needs a device runtime (only cloud-only, prefix_rate 1, runs without one)")
        if prefix_len < n_total and self.choose_point(n_total - prefix_len).cloud_only:
            prefix_len = n_total  # the whole image on the cloud: cloud-only's open
        drafting = prefix_len < n_total
        req = OpenRequest(self.sid, prompt, self.seed, cfg.sampling, prefix_len, cfg.rule, want_caption=drafting,
                          jacobi_window=cfg.jacobi_window)
        try:
            reply = self.link.exchange(req, st)
            self.tokens = np.asarray(reply.prefix_tokens, np.int64).reshape(-1).tolist()
            self.who = ["cloud"] * len(self.tokens)
            st.prefix_tokens = st.cloud_tokens = len(self.tokens)
            self.progress(self.tokens, st)
            if drafting:
                self.choose_tau()
                self.start(reply)
                self.draft_all()
                st.device_s += self.clock.charged_s
                if st.device_forward_passes:
                    self.observer.device_step.update(self.clock.charged_s / st.device_forward_passes)
        finally:
            try:  # best effort: a failed close costs the verifier an idle session, not the image (nor the error)
                self.link.close(self.sid)
            except Exception:  # noqa: BLE001
                pass
        st.total_tokens = len(self.tokens)
        st.images = 1
        self.progress(self.tokens, st, final=True)
        return self.tokens, self.who, st

    def choose_point(self, remaining: int) -> OperatingPoint:
        """The image's operating point, chosen before its open and kept to its end: the calibrated span and burst
        under the fixed policy (and under the adaptive one while a cost is unknown); under the adaptive policy (gates
        that score positions only), the allowed point (never verifying less than the calibrated one: a span and a
        burst at least its, or cloud-only) with the least expected time to finish the `remaining` tokens (+ the
        operator's price per cloud step) from the device's observed costs (`CostObserver.decide`). The first
        adaptive image on an observer primes it: the link's handshake (half its round trip), one timed device step
        and the verifier's hint. Recorded in the stats (`span_used`, `burst_used`, `handovers`, `adapted`), so the
        same request with that point as fixed knobs (or cloud-only's prefix_rate 1) makes the same image again."""
        cfg, obs, st = self.cfg, self.observer, self.stats
        point = OperatingPoint(cfg.span, cfg.burst)
        if cfg.policy == "adaptive" and cfg.scores:
            if not obs.primed:
                hint = self.link.cost_hint()
                obs.prime(latency_s=self.link.latency_prior_s(),
                          device_step_s=self.rt.step_seconds(cfg.cfg_rows) * self.clock.slowdown, hint=hint)
            if obs.ready:
                enhance = cfg.inter_enhance
                costs = obs.costs(self.link.vocab_size, hidden_dim=int(self.rt.dim) if enhance else 0,
                                  feature_dim=M.interval_feature_dim(cfg.feature_top) if enhance else 0)
                st.est_device_step_s, st.est_link_latency_s = costs.device_step_s, costs.latency_s
                st.est_cloud_step_s = costs.cloud_step_s
                chosen = obs.decide(costs, point, remaining, cfg.cloud_step_price_s).point
                st.adapted = int(chosen != point)
                point = chosen
        st.handovers = int(point.cloud_only)
        st.span_used, st.burst_used = point.span, point.burst
        self.span, self.burst = point.span, point.burst
        return point

    def choose_tau(self) -> None:
        """The image's gate threshold: the config's, or under overload (graceful degradation, opt-in: the device's
        estimate of the verifier's seconds per exchange past `overload_verifier_s`) the config's x
        `overload_tau_factor`. Recorded in the stats (`tau_used`, `overloaded`): the same request with that tau makes
        the same image."""
        cfg, tau = self.cfg, self.cfg.tau
        limit, busy = cfg.overload_verifier_s, self.observer.verifier.value
        if tau is not None and cfg.scores and limit is not None and busy is not None and busy > limit:
            tau *= cfg.overload_tau_factor
            self.stats.overloaded = 1
        self.stats.tau_used = tau if tau is not None else 0.0
        self.tau = tau

    def start(self, reply) -> None:
        """Prefill the caption (float16, as every transport carries it) and feed the prefix."""
        with self.clock:
            self.step = self.rt.start(np.asarray(reply.caption_emb, np.float16),
                                      np.asarray(reply.caption_mask, bool).reshape(-1), rows=self.cfg.cfg_rows)
            self.stats.device_forward_passes += 1
            if self.tokens:
                self.feed(self.tokens, 0)

    # ------------------------------------------------------------------ the loop
    def draft_all(self) -> None:
        st = self.stats
        while len(self.tokens) < self.n_total:
            self.progress(self.tokens, st)
            with self.clock:
                q_sent, q_used, x = self.draft(len(self.tokens))
                escalate = self.escalates(q_used, x)
                if self.cfg.scores and not self.offline:
                    self.observer.escalation.observe(float(escalate))
                if not escalate:
                    self.accept_local(x)
                    continue
                span, span_q = self.draft_span(x, q_sent)
            self.send_span(span, span_q)

    def escalates(self, q_used: np.ndarray, x: int) -> bool:
        """Whether draft x at the current position goes to the cloud (never offline)."""
        gate = self.cfg.gate
        if self.offline or gate == "never":
            return False
        return gate == "always" or self.score(q_used, x) > self.tau

    def draft(self, position: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Draft image token `position` (the runtime's current output): (q as sent float16, q drawn from float32,
        drawn token). The token is drawn from the float16 values, normalised (`quantize_draft`), so the cloud judges
        it by exactly the distribution it came from, at the position's uniform (`maths.uniform`)."""
        self.box = None
        c = self.step.center
        q32 = M.logits_to_probs(c[0], self.cfg.sampling, uncond_logits=c[1] if self.cfg.cfg_rows == 2 else None)
        q_sent, q_used = M.quantize_draft(q32)
        return q_sent, q_used, M.sample(q_used, M.uniform(self.seed, M.DRAFT_STREAM, position))

    def score(self, q_used: np.ndarray, x: int) -> float:
        """The gate's score of draft x at the current position (higher: more uncertain). Voting heads score +-inf: a
        majority of heads above tau, or not."""
        cfg = self.cfg
        if cfg.gate == "random":
            return M.gate_score("random", u=M.uniform(self.seed, M.GATE_STREAM, len(self.tokens)))
        if cfg.gate in ("entropy", "softmax"):
            return M.gate_score(cfg.gate, probs=q_used)
        heads = self.step.heads
        if heads is not None:
            centers, radii = heads  # [H, rows, V]
            votes = sum(M.gate_score(cfg.gate, center=c, radius=r, drafted=x, topk=cfg.topk, margin=cfg.margin)
                        > self.tau for c, r in (self._guided(centers[h], radii[h]) for h in range(len(centers))))
            return math.inf if votes * 2 > len(centers) else -math.inf
        center, radius = self.guided_box()
        return M.gate_score(cfg.gate, center=center, radius=radius, drafted=x, topk=cfg.topk, margin=cfg.margin)

    def guided_box(self) -> tuple[np.ndarray, np.ndarray]:
        """The guided logit box (center, radius) [V] of the current position, computed once per position (the gate
        and the projector's features both read it)."""
        if self.box is None:
            self.box = self._guided(self.step.center, self.step.radius)
        return self.box

    def _guided(self, c: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.cfg.cfg_rows == 2:
            return M.guided_interval(c[0], r[0], c[1], r[1], cfg_scale=self.cfg.sampling.cfg_scale,
                                     temperature=self.temp)
        return M.guided_interval(c[0], r[0], temperature=self.temp)

    def accept_local(self, x: int) -> None:
        """Commit a draft the gate let through (and keep its projector inputs for the next exchange)."""
        i = len(self.tokens)
        if self.cfg.inter_enhance and not self.offline:
            self.pend_hidden.append(np.array(self.step.hidden[0], np.float32))
            self.pend_box.append(self.guided_box())
        self.tokens.append(x)
        self.who.append("device")
        self.stats.device_tokens += 1
        self.stats.degraded_tokens += int(self.offline)
        self.pending.append(x)
        if len(self.tokens) < self.n_total:
            self.feed([x], i)

    def draft_span(self, x: int, q_sent: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
        """The uncertain draft x and up to span - 1 more, each drawn at its own position (span[:-1] are fed)."""
        i = len(self.tokens)
        k = min(self.span, self.n_total - i)
        span, span_q = [x], [q_sent]
        for j in range(1, k):
            self.feed([span[-1]], i + j - 1)
            qj, _, xj = self.draft(i + j)
            span.append(xj)
            span_q.append(qj)
        return span, span_q

    def send_span(self, span: list[int], span_q: list[np.ndarray]) -> None:
        """Send the pending tokens and the span; commit the reply, or go offline when the cloud is unreachable."""
        cfg = self.cfg
        hidden = feats = None
        if cfg.inter_enhance and self.pending:
            with self.clock:  # float16, as the wire carries them: every transport gives the cloud the same inputs
                hidden = np.stack(self.pend_hidden).astype(np.float16)
                feats = M.interval_features(np.stack([c for c, _ in self.pend_box]),
                                            np.stack([r for _, r in self.pend_box]), top=cfg.feature_top)
                feats = feats.astype(np.float16)
        req = VerifyRequest(self.sid, np.array(self.pending, np.int64), np.array(span, np.int64), np.stack(span_q),
                            hidden, feats, burst=self.burst, burst_entropy=cfg.burst_entropy)
        try:
            reply = self.link.exchange(req, self.stats)
        except Exception as e:
            if not (cfg.fallback and unreachable(e)):
                raise
            self.go_offline(span)
            return
        self.commit(span, reply)

    def commit(self, span: list[int], reply) -> None:
        """Commit span[:n] + [next] + burst tokens, roll the device cache back to the accepted prefix, feed the rest."""
        st, i, k, n = self.stats, len(self.tokens), len(span), int(reply.num_accepted)
        st.verifications += 1
        st.resumes += int(bool(getattr(reply, "resumed", False)))
        st.drafted += k
        st.accepted += n
        self.observer.observe_verdict(k, n)
        burst = np.asarray(reply.burst_tokens, np.int64).reshape(-1).tolist() if reply.num_burst else []
        new = (span[:n] + [int(reply.next_token)] + burst)[: self.n_total - i]
        st.burst_tokens += max(0, len(new) - n - 1)
        st.cloud_tokens += len(new)
        self.tokens.extend(new)
        self.who.extend(["cloud"] * len(new))
        self.pending, self.pend_hidden, self.pend_box = [], [], []
        if len(self.tokens) < self.n_total:
            with self.clock:
                keep = i + min(n, k - 1)  # span[:k-1] were fed; the accepted ones stay in the cache
                self.rt.rollback(keep)
                self.feed(self.tokens[keep:], keep)

    def go_offline(self, span: list[int]) -> None:
        """The cloud is unreachable: keep the drafted span (the device's own samples) and go on alone."""
        st, i, k = self.stats, len(self.tokens), len(span)
        self.offline = True
        st.degraded = 1
        self.tokens.extend(span)
        self.who.extend(["device"] * k)
        st.device_tokens += k
        st.degraded_tokens += k
        self.pending, self.pend_hidden, self.pend_box = [], [], []
        if len(self.tokens) < self.n_total:
            with self.clock:  # span[:k-1] are in the cache already
                self.feed([span[-1]], i + k - 1)

    def feed(self, toks: list[int], start: int) -> None:
        self.step = self.rt.feed(toks, start)
        self.stats.device_forward_passes += 1
