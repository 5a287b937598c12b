"""The CIAR device loop on numpy and onnxruntime, against any `CloudClient` (a `DeviceConnection` in production).

    rt = DeviceRuntime("weights/scenes-v2/onnx")
    conn = DeviceConnection("ws://localhost:8000", key="...", vocab_size=rt.vocab_size)
    result = generate(rt, conn, "a small red circle at the top on a gray background", seed=0)
    result.tokens   # [N] int64;  result.who  # "cloud" / "device" per token;  result.stats  # dict

A port of the torch loop (`ciar.collab.decoder`, method "ciar"): the same messages in the same order. Open (the cloud
makes ceil(prefix_rate * N) tokens and returns the caption embeddings), prefill the device and feed the prefix, then
per position: draft x from the float16 draft distribution, score it with the gate on the guided logit box; score <=
tau: accept locally (its hidden state and interval features go with the next request when interval-enhanced
decoding is on); else draft a span of `span` tokens and verify it with the cloud, commit span[:n] + [next] + burst,
roll the device cache back to the accepted prefix and feed the rest. The knobs left at None come from the export's
manifest (the device file's calibrated gate, tau, span, burst; the sampling settings, prefix rate, feature width).
The operating point (`policy`, default "adaptive", as the cluster's devices): before the open the device chooses
the image's span and burst (never below the calibrated ones) or cloud-only from its costs (`ciar_client.policy`),
which every exchange and draft feed; "fixed" drafts at the calibrated point.
Link loss: when the cloud becomes unreachable after the open (the connection is gone after its retries, or 503),
the device keeps the span it drafted and decodes the rest alone (no gate, no verification); the stats count the
image as `degraded` with the tokens it made alone (`degraded_tokens`), as the torch loop's do.

The device's draws use numpy's Generator seeded `seed + 2**32` (the torch loop's DEVICE_SEED_OFFSET): the same
distribution as the torch loop, not the same draws. Stats: the keys of `ciar.collab.stats.GenerationStats.to_dict`
that apply, with measured times: device_s (runtime + maths), cloud_s (as the replies report it), comm_s (wall time
of the exchanges minus their cloud_s), bytes from the frames (`client.exchanges`) or the messages' `nbytes`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ciar_client import maths as M
from ciar_client.policy import CostObserver, OperatingPoint
from ciar_client.wire import OpenRequest, RuleConfig, Sampling, VerifyRequest

DEVICE_SEED_OFFSET = 1 << 32  # ciar.collab.decoder.DEVICE_SEED_OFFSET
LOOP_GATES = ("lower", "interval", "entropy", "softmax")
POLICIES = ("adaptive", "fixed")  # ciar.collab.knobs' `policy`
PROGRESS_EVERY = 12


@dataclass
class Result:
    tokens: np.ndarray  # [N] int64
    who: list[str]  # per token: "cloud" (prefix, verified, recovered, burst) or "device" (accepted locally)
    stats: dict


@dataclass(frozen=True)
class LoopConfig:
    gate: str
    tau: float
    span: int
    burst: int
    burst_entropy: float
    prefix_rate: float
    feature_top: int
    inter_enhance: bool
    sampling: Sampling
    policy: str = "adaptive"  # "adaptive": each image's point from the observed costs; "fixed": span and burst
    cloud_step_price_s: float = 0.0  # the operator's price of a cloud step in seconds (adaptive policy)


def loop_config(manifest: dict, *, tau=None, gate=None, span=None, burst=None, prefix_rate=None,
                inter_enhance: bool = True, policy: str = "adaptive", cloud_step_price_s: float = 0.0) -> LoopConfig:
    """The loop's knobs: the given ones, else the manifest's (ValueError on an unsupported gate or policy, or no
    threshold)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not cloud_step_price_s >= 0:
        raise ValueError(f"cloud_step_price_s must be >= 0, got {cloud_step_price_s}")
    d = manifest.get("ciar_defaults") or {}
    gate = gate if gate is not None else d.get("gate", "interval")
    if gate not in LOOP_GATES:
        raise ValueError(f"gate {gate!r} is not supported by the device loop; supported: {', '.join(LOOP_GATES)}")
    tau = tau if tau is not None else (d.get("taus") or {}).get(gate)
    if tau is None or math.isnan(float(tau)):
        raise ValueError(f"no threshold for the {gate!r} gate: pass tau, or export a calibrated device "
                         f"(`python -m pipelines.calibrate`, then `python -m pipelines.export_onnx`)")
    span = int(span if span is not None else d.get("span", 4))
    burst = int(burst if burst is not None else d.get("burst", 0))
    prefix_rate = float(prefix_rate if prefix_rate is not None else manifest.get("prefix_rate", 0.06))
    if span < 1 or burst < 0 or not 0.0 <= prefix_rate <= 1.0:
        raise ValueError(f"need span >= 1, burst >= 0 and prefix_rate in [0, 1]; got {span}, {burst}, {prefix_rate}")
    s = Sampling(*M.check_sampling(**manifest["sampling"]))
    return LoopConfig(gate, float(tau), span, burst, float(d.get("burst_entropy", 0.0)), prefix_rate,
                      int(manifest.get("feature_top", 8)), bool(inter_enhance), s, policy, float(cloud_step_price_s))


def generate(runtime, client, prompt: str, seed: int, *, session_id: str | None = None, tau=None, gate=None,
             span=None, burst=None, prefix_rate=None, inter_enhance: bool = True, fallback: bool = True,
             policy: str = "adaptive", observer: CostObserver | None = None, cloud_step_price_s: float = 0.0,
             on_progress: Callable[[list[int], dict], None] | None = None) -> Result:
    """One image's tokens. `on_progress(tokens_so_far, stats_so_far)` after the prefix, every 12 more decided tokens
    and at the end. `fallback`: when the cloud becomes unreachable after the open (see `unreachable`), finish the
    image on the device alone and mark it degraded, as the in-cluster device does; False raises instead.
    `policy`: "adaptive" (default) chooses the image's span and burst (never below the calibrated ones) or
    cloud-only before the open from the costs in `observer` (`ciar_client.policy.CostObserver`: keep one per
    connection across images; a fresh one when not given, primed with the connection's handshake, one timed step
    and the WELCOME's hint); "fixed" runs the calibrated span and burst. The point is in the stats (`span_used`,
    `burst_used`, `handovers`): the same request with it as fixed knobs makes the same image."""
    cfg = loop_config(runtime.manifest, tau=tau, gate=gate, span=span, burst=burst, prefix_rate=prefix_rate,
                      inter_enhance=inter_enhance, policy=policy, cloud_step_price_s=cloud_step_price_s)
    if observer is None:
        observer = CostObserver(rates=(runtime.manifest.get("ciar_defaults") or {}).get("policy_rates"))
    return _Loop(runtime, client, cfg, seed, session_id or uuid.uuid4().hex, on_progress, fallback,
                 observer).run(prompt)


def unreachable(exc: BaseException) -> bool:
    """Whether a CloudClient's error means the cloud cannot be reached (the device may finish alone): the connection
    is gone after its retries (ConnectionError / OSError) or no verifier can take the work (status 503)."""
    return isinstance(exc, OSError) or getattr(exc, "status", None) == 503


class _Loop:
    def __init__(self, rt, client, cfg: LoopConfig, seed: int, sid: str, on_progress, fallback: bool,
                 observer: CostObserver):
        self.rt, self.client, self.cfg, self.seed, self.sid = rt, client, cfg, int(seed), sid
        self.observer = observer  # the device's running cost estimates (fed by every image)
        self.span, self.burst = cfg.span, cfg.burst  # the image's operating point (`choose_point`)
        self.fallback, self.offline = fallback, False
        self.n_total, self.vocab = rt.num_tokens, rt.vocab_size
        self.cfg_rows = cfg.sampling.cfg_scale > 1.0
        self.temp = cfg.sampling.temperature or 1.0  # greedy sampling: the box is taken at temperature 1
        self.rng = np.random.default_rng(self.seed + DEVICE_SEED_OFFSET)
        self.on_progress, self.last_progress = on_progress, -PROGRESS_EVERY
        self.tokens: list[int] = []
        self.who: list[str] = []
        self.box = None
        self.pending: list[int] = []  # accepted locally since the last exchange, with their projector inputs
        self.pend_hidden: list[np.ndarray] = []
        self.pend_box: list[tuple[np.ndarray, np.ndarray]] = []
        self.st = dict.fromkeys(("total_tokens", "prefix_tokens", "cloud_tokens", "device_tokens", "burst_tokens",
                                 "drafted", "accepted", "verifications", "cloud_requests", "resumes",
                                 "cloud_forward_passes", "device_forward_passes", "bytes_up", "bytes_down",
                                 "degraded", "degraded_tokens"), 0)
        self.st.update(device_s=0.0, cloud_s=0.0, comm_s=0.0, images=1, span_used=0, burst_used=0, handovers=0,
                       adapted=0, est_device_step_s=0.0, est_link_latency_s=0.0, est_cloud_step_s=0.0, queue_s=0.0)

    # ------------------------------------------------------------------ the loop
    def run(self, prompt: str) -> Result:
        cfg, n_total, t0 = self.cfg, self.n_total, time.perf_counter()
        prefix_len = n_total if cfg.prefix_rate >= 1.0 else min(n_total, math.ceil(cfg.prefix_rate * n_total))
        if prefix_len < n_total and self.choose_point(n_total - prefix_len).cloud_only:
            prefix_len = n_total  # the whole image on the cloud: cloud-only's open
        drafting = prefix_len < n_total
        req = OpenRequest(self.sid, prompt, self.seed, cfg.sampling, prefix_len, RuleConfig(), want_caption=drafting)
        reply = self.exchange(req, req.nbytes(), lambda: self.client.open(req))
        try:
            self.tokens = np.asarray(reply.prefix_tokens, np.int64).reshape(-1).tolist()
            self.who = ["cloud"] * len(self.tokens)
            self.st.update(prefix_tokens=len(self.tokens), cloud_tokens=len(self.tokens))
            self.progress()
            if drafting:
                t = time.perf_counter()
                self.step = self.rt.start(np.asarray(reply.caption_emb), np.asarray(reply.caption_mask, bool),
                                          rows=2 if self.cfg_rows else 1)
                self.st["device_forward_passes"] += 1
                if self.tokens:
                    self.feed(self.tokens, 0)
                self.st["device_s"] += time.perf_counter() - t
                self.draft_all()
                if self.st["device_forward_passes"]:
                    self.observer.device_step.update(self.st["device_s"] / self.st["device_forward_passes"])
        except BaseException:
            if not self.offline:
                try:  # the error in flight is the one to report
                    self.client.close(self.sid)
                except Exception:  # noqa: BLE001
                    pass
            raise
        if not self.offline:  # an unreachable cloud frees the session after its idle timeout
            self.client.close(self.sid)
        st = self.st
        st["total_tokens"] = len(self.tokens)
        st["wall_s"] = time.perf_counter() - t0
        self.progress(final=True)
        return Result(np.array(self.tokens, np.int64), self.who, finish_stats(st))

    def choose_point(self, remaining: int) -> OperatingPoint:
        """The image's operating point, before its open (`ciar.collab.decoder.CollabDecoder.operating_point`'s
        rule): the calibrated span and burst under the fixed policy; under the adaptive one, `CostObserver.decide`
        from the observed costs, primed on a new observer with the connection's handshake (half its round trip),
        one timed device step and the verifier's hint (the WELCOME's, `cost_hint()`)."""
        cfg, obs, st = self.cfg, self.observer, self.st
        point = OperatingPoint(cfg.span, cfg.burst)
        if cfg.policy == "adaptive":
            if not obs.primed:
                ask = getattr(self.client, "cost_hint", None)
                hint = ask() if ask is not None else None  # connects: the handshake is timed
                handshake = getattr(self.client, "handshake_s", None)
                obs.prime(latency_s=handshake / 2 if handshake else None,
                          device_step_s=self.rt.step_seconds(2 if self.cfg_rows else 1), hint=hint)
            if obs.ready:
                costs = obs.costs(self.vocab, hidden_dim=int(self.rt.manifest["dim"]) if cfg.inter_enhance else 0,
                                  feature_dim=M.interval_feature_dim(cfg.feature_top) if cfg.inter_enhance else 0)
                st.update(est_device_step_s=costs.device_step_s, est_link_latency_s=costs.latency_s,
                          est_cloud_step_s=costs.cloud_step_s)
                chosen = obs.decide(costs, point, remaining, cfg.cloud_step_price_s).point
                st["adapted"] = int(chosen != point)
                point = chosen
        st.update(handovers=int(point.cloud_only), span_used=point.span, burst_used=point.burst)
        self.span, self.burst = point.span, point.burst
        return point

    def draft_all(self) -> None:
        cfg = self.cfg
        while len(self.tokens) < self.n_total:
            self.progress()
            t = time.perf_counter()
            q_sent, q_used, x = self.draft()
            self.box = None
            escalate = not self.offline and self.score(q_used, x) > cfg.tau
            if not self.offline:
                self.observer.escalation.observe(float(escalate))
            if not escalate:
                self.accept_local(x)
                self.st["device_s"] += time.perf_counter() - t
                continue
            span, span_q = self.draft_span(x, q_sent)
            hidden = feats = None
            if cfg.inter_enhance and self.pending:
                hidden = np.stack(self.pend_hidden).astype(np.float16)
                feats = M.interval_features(np.stack([c for c, _ in self.pend_box]),
                                            np.stack([r for _, r in self.pend_box]), top=cfg.feature_top)
                feats = feats.astype(np.float16)
            self.st["device_s"] += time.perf_counter() - t
            req = VerifyRequest(self.sid, np.array(self.pending, np.int64), np.array(span, np.int64),
                                np.stack(span_q), hidden, feats, burst=self.burst, burst_entropy=cfg.burst_entropy)
            try:
                rep = self.exchange(req, req.nbytes(self.vocab), lambda: self.client.verify(req))
            except Exception as e:
                if not (self.fallback and unreachable(e)):
                    raise
                self.go_offline(span)
                continue
            self.commit(span, rep)

    def draft(self) -> tuple[np.ndarray, np.ndarray, int]:
        """At the current position: (q as sent float16, q drawn from float32, drawn token)."""
        c = self.step.center
        q32 = M.logits_to_probs(c[0], self.cfg.sampling, uncond_logits=c[1] if self.cfg_rows else None)
        q_sent, q_used = M.quantize_draft(q32)
        return q_sent, q_used, M.sample(q_used, self.rng)

    def guided_box(self) -> tuple[np.ndarray, np.ndarray]:
        """The guided logit box (center, radius) [V] of the current position, computed once per position."""
        if self.box is None:
            c, r, s = self.step.center, self.step.radius, self.cfg.sampling
            if self.cfg_rows:
                self.box = M.guided_interval(c[0], r[0], c[1], r[1], cfg_scale=s.cfg_scale, temperature=self.temp)
            else:
                self.box = M.guided_interval(c[0], r[0], temperature=self.temp)
        return self.box

    def score(self, q_used: np.ndarray, x: int) -> float:
        if self.cfg.gate in ("entropy", "softmax"):
            return M.gate_score(self.cfg.gate, probs=q_used)
        center, radius = self.guided_box()
        return M.gate_score(self.cfg.gate, center=center, radius=radius, drafted=x)

    def accept_local(self, x: int) -> None:
        i = len(self.tokens)
        self.tokens.append(x)
        self.who.append("device")
        self.st["device_tokens"] += 1
        self.st["degraded_tokens"] += int(self.offline)
        self.pending.append(x)
        if self.cfg.inter_enhance and not self.offline:
            self.pend_hidden.append(self.step.hidden[0].copy())
            self.pend_box.append(self.guided_box())
        if len(self.tokens) < self.n_total:
            self.feed([x], i)

    def draft_span(self, x: int, q_sent: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
        """The uncertain draft x and up to span-1 more (span[:-1] are fed)."""
        i = len(self.tokens)
        k = min(self.span, self.n_total - i)
        span, span_q = [x], [q_sent]
        for j in range(1, k):
            self.feed([span[-1]], i + j - 1)
            qj, _, xj = self.draft()
            span.append(xj)
            span_q.append(qj)
        return span, span_q

    def commit(self, span: list[int], rep) -> None:
        """span[:n] + [next] + burst; roll the device cache back to the accepted prefix and feed the rest."""
        st, i, k, n = self.st, len(self.tokens), len(span), int(rep.num_accepted)
        st["cloud_forward_passes"] += int(rep.forward_passes)
        st["verifications"] += 1
        st["resumes"] += int(bool(getattr(rep, "resumed", False)))
        st["drafted"] += k
        st["accepted"] += n
        self.observer.observe_verdict(k, n)
        burst = np.asarray(rep.burst_tokens, np.int64).reshape(-1).tolist() if rep.num_burst else []
        new = (span[:n] + [int(rep.next_token)] + burst)[: self.n_total - i]
        st["burst_tokens"] += max(0, len(new) - n - 1)
        st["cloud_tokens"] += len(new)
        self.tokens.extend(new)
        self.who.extend(["cloud"] * len(new))
        self.pending, self.pend_hidden, self.pend_box = [], [], []
        if len(self.tokens) < self.n_total:
            t = time.perf_counter()
            keep = i + min(n, k - 1)  # span[:k-1] were fed; the accepted ones stay in the cache
            self.rt.rollback(keep)
            self.feed(self.tokens[keep:], keep)
            st["device_s"] += time.perf_counter() - t

    def go_offline(self, span: list[int]) -> None:
        """The cloud is unreachable: keep the drafted span (the device's own samples) and go on alone."""
        t, i, k = time.perf_counter(), len(self.tokens), len(span)
        self.offline = True
        self.st["degraded"] = 1
        self.tokens.extend(span)
        self.who.extend(["device"] * k)
        self.st["device_tokens"] += k
        self.st["degraded_tokens"] += k
        self.pending, self.pend_hidden, self.pend_box = [], [], []
        if len(self.tokens) < self.n_total:  # span[:k-1] are in the cache already
            self.feed([span[-1]], i + k - 1)
        self.st["device_s"] += time.perf_counter() - t

    # ------------------------------------------------------------------ plumbing
    def feed(self, toks: list[int], start: int) -> None:
        self.step = self.rt.feed(toks, start)
        self.st["device_forward_passes"] += 1

    def exchange(self, req, up_bytes: int, call: Callable):
        """One request/reply: wall time minus the reported cloud time is communication; bytes from the frames the
        connection saw (a `DeviceConnection`, resumes included) or the messages' sizes."""
        log = getattr(self.client, "exchanges", None)
        seen = len(log) if log is not None else 0
        t = time.perf_counter()
        try:
            reply = call()
        except Exception:
            self.st["comm_s"] += time.perf_counter() - t  # the device waited for a reply that did not come
            raise
        wall = time.perf_counter() - t
        st = self.st
        queue_s = float(getattr(reply, "queue_s", 0.0))  # how long the request queued (open and verify replies)
        st["cloud_requests"] += 1
        st["cloud_s"] += float(reply.cloud_s)
        st["comm_s"] += max(0.0, wall - float(reply.cloud_s))
        st["queue_s"] += queue_s
        if log is not None:
            up, down = sum(e.up_bytes for e in log[seen:]), sum(e.down_bytes for e in log[seen:])
        else:
            up, down = up_bytes, reply.nbytes()
        st["bytes_up"] += up
        st["bytes_down"] += down
        # the link: the wall time beyond the verifier's own (its forwards and the queue) — what the socket took
        self.observer.observe_exchange(up, down, max(0.0, wall - float(reply.cloud_s) - queue_s),
                                       float(reply.cloud_s), int(reply.forward_passes), queue_s,
                                       verify=not isinstance(req, OpenRequest))
        if isinstance(req, OpenRequest):
            st["cloud_forward_passes"] += int(reply.forward_passes)
        return reply

    def progress(self, final: bool = False) -> None:
        if self.on_progress is not None and (final or len(self.tokens) - self.last_progress >= PROGRESS_EVERY):
            self.last_progress = len(self.tokens)
            self.on_progress(list(self.tokens), finish_stats(dict(self.st, total_tokens=len(self.tokens))))


def finish_stats(st: dict) -> dict:
    """Counters -> counters + the derived figures of GenerationStats.to_dict (None where undefined)."""
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    out = dict(st)
    out["cloud_call_rate"] = ratio(st["cloud_tokens"], st["total_tokens"])
    out["steps_compression"] = ratio(st["total_tokens"], st["cloud_forward_passes"])
    out["acceptance_rate"] = ratio(st["accepted"], st["drafted"])
    out["mean_accepted_length"] = 1.0 + st["accepted"] / st["verifications"] if st["verifications"] else None
    out["total_s"] = st["device_s"] + st["cloud_s"] + st["comm_s"]
    out["device_ms_per_token"] = ratio(1000.0 * st["device_s"], st["total_tokens"])
    return out
