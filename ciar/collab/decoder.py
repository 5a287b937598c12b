"""The device side of collaborative decoding: CIAR and every baseline through one loop and one stats struct.

    decoder = CollabDecoder(device_model, InProcessCloud(verifier), method_config("ciar", tau=0.3))
    result = decoder.generate("a small red circle at the top on a gray background", seed=0)
    result.tokens   # [N] int64 image tokens;  result.stats  # GenerationStats (ciar.collab.stats)

One generation (DESIGN.md sections 2 and 4):
1. *open*: the cloud encodes the caption, generates the first ceil(prefix_rate * N) tokens itself (prefix
   injection) and returns them with the caption embeddings;
2. the device prefills its cache and drafts token by token from its Inter-Head centers (post-guidance, through
   `logits_to_probs`); the gate scores each draft (U of the guided interval for CIAR; entropy / max-prob /
   random / top-k set for the baselines). score <= tau: the token is *accepted locally* (committed at once);
3. score > tau: the device drafts a *span* of `span` tokens starting with the uncertain one and sends the cloud
   the locally accepted tokens since the last exchange (with their interval features when interval-enhanced
   decoding is on) plus the span and its draft distributions;
4. the cloud catches up, verifies with the session's acceptance rule and answers (accepted n, next token); the
   device commits span[:n] + [next], rolls its cache back to the accepted prefix and feeds the rest.

Methods (`METHODS`, the same names in the CLI, the benchmark and the HTTP API):
  cloud   - cloud-only: the cloud generates all N tokens (prefix_rate 1);
  ciar    - interval gate U, exact acceptance, interval-enhanced catch-up;
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
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from ciar.collab.device import DeviceModel
from ciar.collab.gating import GATES, gate_scores
from ciar.collab.interval import guided_interval, interval_features
from ciar.collab.network import LinkDownError, NetworkModel, get_profile
from ciar.collab.protocol import CloudClient, CloudUnreachableError, OpenRequest, RuleConfig, VerifyRequest
from ciar.collab.stats import GenerationStats
from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample

METHODS = ("cloud", "ciar", "eagle", "lantern", "cascade", "code", "entropy", "softmax", "random", "topk")
DEVICE_SEED_OFFSET = 1 << 32
GATE_SEED_OFFSET = 2 << 32


@dataclass
class CollabConfig:
    """Every knob of collaborative decoding (defaults: CIAR as in the paper, tau on the normalised U scale)."""

    method: str = "ciar"
    prefix_rate: float = 0.06  # rho: fraction of the N tokens the cloud generates first
    gate: str = "interval"  # one of ciar.collab.gating.GATES, or "always" (verify every token) / "never"
    tau: float = 0.30  # escalate when gate score > tau (the gate's own scale; see ciar.collab.gating)
    span: int = 4  # draft tokens per verification, the uncertain one included
    rule: RuleConfig = field(default_factory=RuleConfig)
    inter_enhance: bool = True  # send interval features with locally accepted tokens (off: "w/o Inter-Enhance")
    topk: int = 200  # set size of the "topk" gate
    margin: float = 0.01  # InterFuse safety margin
    feature_top: int = 8  # interval_features(top=...) for the projector
    device_slowdown: float = 1.0  # device compute time = measured time x this factor
    cloud_slowdown: float = 1.0  # cloud compute time = reported time x this factor (emulates a larger cloud model)
    network: str = "5g"  # ciar.collab.network profile name
    link_drop_after: int | None = None  # simulation: the link goes down after this many messages (both directions)
    fallback: bool = True  # cloud unreachable mid-generation: finish on the device (degraded) instead of failing

    def validate(self) -> "CollabConfig":
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; known: {', '.join(METHODS)}")
        if not 0.0 <= self.prefix_rate <= 1.0:
            raise ValueError(f"prefix_rate must be in [0, 1], got {self.prefix_rate}")
        if self.gate not in GATES + ("always", "never"):
            raise ValueError(f"unknown gate {self.gate!r}; known: {', '.join(GATES + ('always', 'never'))}")
        if not (isinstance(self.span, int) and self.span >= 1):
            raise ValueError(f"span must be an integer >= 1, got {self.span!r}")
        if math.isnan(self.tau):
            raise ValueError("tau must not be NaN")
        if not self.device_slowdown > 0:
            raise ValueError(f"device_slowdown must be > 0, got {self.device_slowdown}")
        if not self.cloud_slowdown > 0:
            raise ValueError(f"cloud_slowdown must be > 0, got {self.cloud_slowdown}")
        if self.link_drop_after is not None and not (isinstance(self.link_drop_after, int)
                                                     and self.link_drop_after >= 0):
            raise ValueError(f"link_drop_after must be an integer >= 0, got {self.link_drop_after!r}")
        get_profile(self.network)
        return self

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rule"] = dict(vars(self.rule))
        return d


def shared_knobs(method: str, knobs: dict) -> dict:
    """The subset of fleet- or run-wide knobs that `method` takes: the threshold only for "ciar" (every other gate
    has its own score scale), the prefix rate not for "cloud" and "code" (there it is the method itself)."""
    out = dict(knobs)
    if method != "ciar":
        out.pop("tau", None)
    if method in ("cloud", "code"):
        out.pop("prefix_rate", None)
    return out


def method_config(method: str, **overrides) -> CollabConfig:
    """The preset of a method name, with overrides (e.g. `method_config("ciar", tau=0.2, span=8)`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    base = CollabConfig(method=method)
    preset: dict = {
        "cloud": dict(prefix_rate=1.0, gate="never", inter_enhance=False),
        "ciar": {},
        "eagle": dict(gate="always", inter_enhance=False),
        "lantern": dict(gate="always", inter_enhance=False, rule=RuleConfig(rule="lantern")),
        "cascade": dict(gate="always", inter_enhance=False, rule=RuleConfig(rule="cascade")),
        "code": dict(prefix_rate=0.3, gate="never", inter_enhance=False),
        "entropy": dict(gate="entropy"),
        "softmax": dict(gate="softmax"),
        "random": dict(gate="random"),
        "topk": dict(gate="topk"),
    }[method]
    rule = overrides.pop("rule", None)
    if method == "cloud" and overrides.get("prefix_rate", 1.0) != 1.0:
        raise ValueError("method 'cloud' makes every token on the cloud: prefix_rate must be 1 (or left out)")
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
    def __init__(self, device: DeviceModel | None, client: CloudClient, config: CollabConfig,
                 sampling: SamplingParams, num_tokens: int | None = None,
                 wait: Callable[[float], None] | None = None, progress_every: int = 12):
        """`wait`: when given (e.g. `time.sleep`), simulated time is spent for real: each message waits for its
        uplink before it is sent and for its downlink after the reply, and device compute is stretched by
        `device_slowdown` (a simulated device in a live cluster). Without it, time is only accounted.
        `progress_every`: `generate(on_progress=...)` is called each time this many more tokens are decided."""
        self.wait = wait
        self.progress_every = max(1, int(progress_every))
        self.device_model = device.eval() if device is not None else None
        self.client = client
        self.config = config.validate()
        self.sampling = sampling.validate()
        self.num_tokens = num_tokens
        if config.method != "cloud" and device is None:
            raise ValueError(f"method {config.method!r} needs a device model")

    @torch.no_grad()
    def generate(self, prompt: str, seed: int, session_id: str | None = None, trace: bool = False,
                 on_progress: Callable[[list[int], GenerationStats], None] | None = None) -> CollabResult:
        """Generate the image tokens of one caption. `on_progress(tokens_so_far, stats_so_far)` is called after the
        prefix, every `progress_every` more decided tokens, and once at the end (streaming previews)."""
        cfg, params = self.config, self.sampling
        sid = session_id or uuid.uuid4().hex
        n_total = self.num_tokens or (self.device_model.config.block_size if self.device_model is not None
                                      else None)
        stats = GenerationStats()
        net = NetworkModel(get_profile(cfg.network), seed=seed, drop_after=cfg.link_drop_after)
        prefix_len = n_total if n_total is not None and cfg.prefix_rate >= 1.0 else None
        if n_total is None:
            raise ValueError("num_tokens is required without a device model")
        if prefix_len is None:
            prefix_len = min(n_total, math.ceil(cfg.prefix_rate * n_total))
        drafting = prefix_len < n_total

        open_req = OpenRequest(sid, prompt, seed, params, prefix_len, cfg.rule, want_caption=drafting)
        try:
            reply = self._exchange(stats, net, open_req.nbytes(), lambda: self.client.open(open_req))
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
                self._draft_loop(reply, tokens, who, n_total, seed, sid, stats, net, progress)
        finally:
            self.client.close(sid)  # also after a link loss (frees local state; a real device sends it later)
        stats.total_tokens = len(tokens)
        stats.images = 1
        progress(tokens, stats, final=True)
        return CollabResult(torch.tensor(tokens, dtype=torch.long), stats, who if trace else None)

    def _exchange(self, stats: GenerationStats, net: NetworkModel, up_bytes: int, call: Callable):
        """One request/reply over the simulated link: uplink transmission, `call()`, downlink transmission of the
        reply's bytes (in this order, so the link's seeded jitter/loss stream does not depend on `wait`). A link that
        goes down costs the sender's give-up time (LinkDownError.waited_s) before the error is raised."""
        try:
            up_s, _ = net.transmit(up_bytes)
            if self.wait is not None:
                self.wait(up_s)
            reply = call()
            down_bytes = reply.nbytes()
            down_s, _ = net.transmit(down_bytes)
        except LinkDownError as e:
            stats.comm_s += e.waited_s
            if self.wait is not None:
                self.wait(e.waited_s)
            raise
        cloud_s = reply.cloud_s * self.config.cloud_slowdown
        if self.wait is not None:
            self.wait(down_s + reply.cloud_s * (self.config.cloud_slowdown - 1.0))
        stats.bytes_up += up_bytes
        stats.bytes_down += down_bytes
        stats.comm_s += up_s + down_s
        stats.cloud_s += cloud_s
        return reply

    # ------------------------------------------------------------------ device loop
    def _draft_loop(self, reply, tokens: list[int], who: list[str], n_total: int, seed: int, sid: str,
                    stats: GenerationStats, net: NetworkModel, progress: "_Progress") -> None:
        cfg, params, dev = self.config, self.sampling, self.device_model
        c = dev.config
        wdev = dev.gpt.tok_embeddings.weight
        clock = _Clock(cfg.device_slowdown, self.wait)
        gen = torch.Generator().manual_seed(seed + DEVICE_SEED_OFFSET)
        gate_gen = torch.Generator().manual_seed(seed + GATE_SEED_OFFSET)
        cfg_rows = params.uses_cfg
        voting = dev.device_config.num_heads > 1 and dev.device_config.combine == "voting"

        with clock:
            emb = reply.caption_emb.to(wdev.device, wdev.dtype).unsqueeze(0)
            mask = reply.caption_mask.to(wdev.device).unsqueeze(0)
            if cfg_rows:
                emb, mask = emb.expand(2, -1, -1), mask.expand(2, -1)
                drop = torch.tensor([False, True], device=wdev.device)
            else:
                drop = None
            rows = emb.shape[0]
            cache = dev.new_cache(rows)
            slots = torch.arange(rows, device=wdev.device)
            out = dev.prefill(cache, emb, mask, drop, slots, with_heads=voting)
            stats.device_forward_passes += 1
            if tokens:
                out = self._feed(cache, tokens, 0, rows, voting)
                stats.device_forward_passes += 1
            cur = _last(out)

        pending: list[int] = []
        pend_hidden: list[torch.Tensor] = []
        pend_feat: list[torch.Tensor] = []
        offline = False  # the cloud became unreachable: the device decides the rest alone
        while len(tokens) < n_total:
            i = len(tokens)
            progress(tokens, stats)
            with clock:
                q, x, score = self._draft_one(cur, gen, gate_gen, score_it=not offline)
                escalate = not offline and (cfg.gate == "always" or (cfg.gate != "never" and score > cfg.tau))
                if not escalate:
                    tokens.append(x)
                    who.append("device")
                    stats.device_tokens += 1
                    stats.degraded_tokens += int(offline)
                    pending.append(x)
                    if cfg.inter_enhance and not offline:
                        center, radius = self._guided(cur)
                        pend_hidden.append(cur.hidden[0])
                        pend_feat.append(interval_features(center, radius, top=cfg.feature_top))
                    if len(tokens) < n_total:
                        cur = _last(self._feed(cache, [x], i, rows, voting))
                        stats.device_forward_passes += 1
                    continue
                # a span: the uncertain draft and up to span-1 more, each drawn from the device
                k = min(cfg.span, n_total - i)
                span, span_q = [x], [q]
                for j in range(1, k):
                    cur = _last(self._feed(cache, [span[-1]], i + j - 1, rows, voting))
                    stats.device_forward_passes += 1
                    qj, xj, _ = self._draft_one(cur, gen, gate_gen, score_it=False)
                    span.append(xj)
                    span_q.append(qj)
                send_feat = cfg.inter_enhance and pending
                req = VerifyRequest(
                    sid, torch.tensor(pending, dtype=torch.long), torch.tensor(span, dtype=torch.long),
                    torch.stack(span_q).to(torch.float16),
                    torch.stack(pend_hidden).float().cpu() if send_feat else None,
                    torch.stack(pend_feat).float().cpu() if send_feat else None)
            try:
                rep = self._exchange(stats, net, req.nbytes(self.client.vocab_size), lambda: self.client.verify(req))
            except CloudUnreachableError:
                if not cfg.fallback:
                    raise
                # keep the drafted span (the device's own samples) and go on alone
                offline = True
                stats.degraded = 1
                tokens.extend(span)
                who.extend(["device"] * k)
                stats.device_tokens += k
                stats.degraded_tokens += k
                if len(tokens) < n_total:
                    with clock:  # span[:k-1] are in the cache already
                        cur = _last(self._feed(cache, [span[-1]], i + k - 1, rows, voting))
                        stats.device_forward_passes += 1
                continue
            stats.cloud_requests += 1
            stats.cloud_forward_passes += rep.forward_passes
            stats.verifications += 1
            stats.resumes += int(getattr(rep, "resumed", False))
            stats.drafted += k
            stats.accepted += rep.num_accepted
            n = rep.num_accepted
            new = span[:n] + [rep.next_token]
            new = new[: n_total - i]
            tokens.extend(new)
            who.extend(["cloud"] * len(new))
            stats.cloud_tokens += len(new)
            pending, pend_hidden, pend_feat = [], [], []
            if len(tokens) < n_total:
                with clock:
                    keep = i + min(n, k - 1)  # span[:k-1] were fed; the accepted ones stay in the cache
                    for r in range(rows):
                        cache.rollback(r, c.cls_token_num + keep)
                    cur = _last(self._feed(cache, tokens[keep:], keep, rows, voting))
                    stats.device_forward_passes += 1
        stats.device_s += clock.seconds * cfg.device_slowdown

    def _feed(self, cache, toks: list[int], start: int, rows: int, voting: bool):
        """Feed image tokens toks (indices start..) to the device cache; -> DeviceOutput of the last position."""
        dev = self.device_model
        c = dev.config
        w = dev.gpt.tok_embeddings.weight
        t = torch.tensor(toks, dtype=torch.long, device=w.device).unsqueeze(0).expand(rows, -1)
        pos0 = c.cls_token_num + start
        pos = torch.arange(pos0, pos0 + len(toks), device=w.device)
        out = dev.decode(cache, t, pos, kv_len=pos0 + len(toks), with_heads=voting)
        for r in range(rows):
            cache.lengths[r] = pos0 + len(toks)
        return out

    def _guided(self, cur):
        """Guided interval (center, radius) [V] of the current position (cond row 0, uncond row 1 with CFG); with
        greedy sampling (temperature 0) the box is taken at temperature 1."""
        p = self.sampling
        if p.uses_cfg:
            return guided_interval(cur.center[0], cur.radius[0], cur.center[1], cur.radius[1],
                                   cfg_scale=p.cfg_scale, temperature=p.temperature or 1.0)
        return guided_interval(cur.center[0], cur.radius[0], temperature=p.temperature or 1.0)

    def _draft_one(self, cur, gen, gate_gen, score_it: bool = True):
        """-> (q [V] post-guidance draft distribution, drawn token, gate score)."""
        cfg, p = self.config, self.sampling
        if p.uses_cfg:
            q = logits_to_probs(cur.center[0], p, uncond_logits=cur.center[1])
        else:
            q = logits_to_probs(cur.center[0], p)
        x = int(sample(q.unsqueeze(0), gen)[0])
        score = 0.0
        if score_it and cfg.gate in GATES:
            if cfg.gate == "random":
                score = float(gate_scores("random", probs=q.unsqueeze(0), generator=gate_gen)[0])
            elif cfg.gate in ("entropy", "softmax"):
                score = float(gate_scores(cfg.gate, probs=q.unsqueeze(0))[0])
            else:
                score = self._interval_score(cur)
        return q, x, score

    def _interval_score(self, cur) -> float:
        cfg, p = self.config, self.sampling
        dev = self.device_model
        if dev.device_config.num_heads > 1 and dev.device_config.combine == "voting":
            centers, radii = cur.heads  # [H, rows, V]
            votes = 0
            for h in range(centers.shape[0]):
                if p.uses_cfg:
                    c_, r_ = guided_interval(centers[h, 0], radii[h, 0], centers[h, 1], radii[h, 1],
                                             cfg_scale=p.cfg_scale, temperature=p.temperature or 1.0)
                else:
                    c_, r_ = guided_interval(centers[h, 0], radii[h, 0], temperature=p.temperature or 1.0)
                s = float(gate_scores(cfg.gate, center=c_.unsqueeze(0), radius=r_.unsqueeze(0), topk=cfg.topk,
                                      margin=cfg.margin)[0])
                votes += s > cfg.tau
            # majority of heads says "uncertain" -> a score above tau, else below
            return math.inf if votes * 2 > centers.shape[0] else -math.inf
        center, radius = self._guided(cur)
        return float(gate_scores(cfg.gate, center=center.unsqueeze(0), radius=radius.unsqueeze(0), topk=cfg.topk,
                                 margin=cfg.margin)[0])


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
