// The CIAR device loop in the page: `ciar_device.loop` (numpy) ported message for message, on onnxruntime-web and
// maths.js, against a DeviceConnection (or any object with async open / verify / close).
//
//   const result = await generate(runtime, conn, prompt, seed, { onProgress });
//   result.tokens   // [N] token ids;  result.who  // "cloud" / "device" per token;  result.stats
//
// Open (the cloud makes ceil(prefix_rate * N) tokens and returns the caption embeddings), prefill the device and feed
// the prefix, then per position: draft x from the float16 draft distribution, score it with the gate (the device
// file's calibrated gate and tau, served with the model); score <= tau: accept locally (its hidden state and interval
// features go with the next request); else draft a span of `span` tokens and verify it with the cloud, commit
// span[:n] + [next] + burst, roll the device cache back to the accepted prefix and feed the rest. When the cloud
// becomes unreachable after the open, the device keeps the span it drafted and finishes alone (`degraded`).
//
// The operating point: under the adaptive policy (the default, `ciar_device.loop`'s) each image's span and burst
// (never below the calibrated ones) or cloud-only (the open asks for all N tokens, no device work) is chosen before
// its open from the costs a CostObserver (policy.js) saw on this connection's earlier images; keep one per connection
// across images (options.observer). A fresh one is primed before its first image with the connection's handshake
// (half its round trip), one timed device step and the verifier's hint in the WELCOME. "fixed" runs the calibrated
// span and burst. The stats say which point the image used (span_used, burst_used, handovers, adapted) and the
// estimates it was chosen from (est_*): the same request at that point under the fixed policy makes the same image.
//
// Stats: the Python client's keys (device_s: runtime + maths, cloud_s as the replies report it, comm_s: wall time of
// the exchanges minus their cloud_s, bytes as the socket carried them), plus `round_trip_ms` (the mean request's
// wall time) and `device_graph_s` (the part of device_s spent in onnxruntime-web; the rest is the page's maths).

import * as M from "./maths.js";
import * as P from "./policy.js";

export const PROGRESS_EVERY = 12;
export const POLICIES = ["adaptive", "fixed"]; // ciar.collab.knobs' `policy`
// every gate of the Python loop: those that score a position against tau, "always" (every token verified, EAGLE's)
// and "never" (none: CoDe's)
export const LOOP_GATES = [...M.GATES, "always", "never"];

/** The loop's knobs: the given ones, else the manifest's (Error on an unsupported gate or policy, or no threshold).
 *  policy: "adaptive" (default) or "fixed"; cloudStepPriceS: the operator's price of a cloud step in seconds;
 *  jacobiWindow: the cloud makes its own tokens by Jacobi windows of this many drafts (0: one a forward). */
export function loopConfig(manifest, { tau = null, gate = null, span = null, burst = null, prefixRate = null,
  interEnhance = true, policy = "adaptive", cloudStepPriceS = 0, topk = 200, jacobiWindow = 0 } = {}) {
  if (!POLICIES.includes(policy)) throw new Error(`policy must be one of ${POLICIES.join(", ")}, got "${policy}"`);
  if (!(cloudStepPriceS >= 0)) throw new Error(`cloudStepPriceS must be >= 0, got ${cloudStepPriceS}`);
  const d = manifest.ciar_defaults || {};
  gate = gate ?? d.gate ?? "interval";
  if (!LOOP_GATES.includes(gate)) throw new Error(`gate "${gate}" is not supported by the browser device; supported: ${LOOP_GATES.join(", ")}`);
  tau = tau ?? (d.taus || {})[gate] ?? null;
  const scores = M.GATES.includes(gate);
  if (scores && (tau === null || Number.isNaN(tau))) throw new Error(`no threshold for the "${gate}" gate: the device model is not calibrated`);
  if (!(topk >= 1)) throw new Error(`topk must be >= 1, got ${topk}`);
  if (!(Number.isInteger(jacobiWindow) && jacobiWindow >= 0)) throw new Error(`jacobiWindow must be an integer >= 0, got ${jacobiWindow}`);
  span = span ?? d.span ?? 4;
  burst = burst ?? d.burst ?? 0;
  prefixRate = prefixRate ?? manifest.prefix_rate ?? 0.06;
  if (!(span >= 1 && burst >= 0 && prefixRate >= 0 && prefixRate <= 1)) throw new Error(`need span >= 1, burst >= 0 and prefix_rate in [0, 1]; got ${span}, ${burst}, ${prefixRate}`);
  return { gate, tau, scores, topk, span, burst, burstEntropy: d.burst_entropy ?? 0, prefixRate,
    featureTop: manifest.feature_top ?? 8, interEnhance, sampling: M.checkSampling(manifest.sampling), policy,
    cloudStepPriceS, jacobiWindow };
}

const COUNTERS = ["total_tokens", "prefix_tokens", "cloud_tokens", "device_tokens", "burst_tokens", "drafted", "accepted",
  "verifications", "cloud_requests", "resumes", "cloud_forward_passes", "device_forward_passes", "bytes_up",
  "bytes_down", "degraded", "degraded_tokens"];

/** Counters -> counters + the derived figures of the Python side's stats (null where undefined). */
export function finishStats(st) {
  const ratio = (a, b) => (b ? a / b : null);
  return { ...st, cloud_call_rate: ratio(st.cloud_tokens, st.total_tokens),
    steps_compression: ratio(st.total_tokens, st.cloud_forward_passes),
    acceptance_rate: ratio(st.accepted, st.drafted),
    mean_accepted_length: st.verifications ? 1 + st.accepted / st.verifications : null,
    total_s: st.device_s + st.cloud_s + st.comm_s,
    device_ms_per_token: ratio(1000 * st.device_s, st.total_tokens),
    round_trip_ms: ratio(st.round_trip_s * 1000, st.cloud_requests) };
}

/** Whether an error means the cloud cannot be reached (the device may finish alone). */
export function unreachable(err) {
  return err && (err.name === "Unreachable" || err.status === 503);
}

/** A CostObserver for a device running this model: the device file's escalation and acceptance rates to start from. */
export function newObserver(manifest) {
  return new P.CostObserver({ rates: (manifest.ciar_defaults || {}).policy_rates || null });
}

/** One image's tokens (see the module's comment). options: the loopConfig knobs, observer (the connection's
 *  CostObserver, kept across its images; a fresh one when not given), sessionId, fallback (default true),
 *  onProgress(tokens, who, stats) after the prefix, every 12 more decided tokens and at the end. */
export async function generate(runtime, client, prompt, seed, options = {}) {
  const cfg = loopConfig(runtime.manifest, options);
  const sid = options.sessionId || `web-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
  const observer = options.observer || newObserver(runtime.manifest);
  return new Loop(runtime, client, cfg, seed, sid, options.onProgress || null, options.fallback ?? true, observer)
    .run(prompt);
}

class Loop {
  constructor(rt, client, cfg, seed, sid, onProgress, fallback, observer) {
    Object.assign(this, { rt, client, cfg, seed, sid, onProgress, fallback, observer });
    this.span = cfg.span; // the image's operating point (choosePoint)
    this.burst = cfg.burst;
    this.offline = false;
    this.nTotal = rt.numTokens;
    this.V = rt.vocabSize;
    this.cfgRows = cfg.sampling.cfg_scale > 1;
    this.temp = cfg.sampling.temperature || 1; // greedy sampling: the box is taken at temperature 1
    this.lastProgress = -PROGRESS_EVERY;
    this.tokens = [];
    this.who = [];
    this.box = null;
    this.pending = []; // accepted locally since the last exchange, with their projector inputs
    this.pendHidden = [];
    this.pendBox = [];
    this.st = Object.fromEntries(COUNTERS.map((k) => [k, 0]));
    Object.assign(this.st, { device_s: 0, device_graph_s: 0, cloud_s: 0, comm_s: 0, round_trip_s: 0, images: 1,
      span_used: 0, burst_used: 0, handovers: 0, adapted: 0, est_device_step_s: 0, est_link_latency_s: 0,
      est_cloud_step_s: 0, queue_s: 0 });
  }

  row(a, r) { // row r of a [rows, n] output
    const n = a.length / this.rt.rows;
    return a.subarray(r * n, (r + 1) * n);
  }

  async run(prompt) {
    const cfg = this.cfg, n = this.nTotal, t0 = performance.now();
    let prefixLen = cfg.prefixRate >= 1 ? n : Math.min(n, Math.ceil(cfg.prefixRate * n));
    if (prefixLen < n && (await this.choosePoint(n - prefixLen)).cloudOnly) prefixLen = n; // cloud-only's open
    const drafting = prefixLen < n;
    const req = { session_id: this.sid, prompt, seed: this.seed, sampling: cfg.sampling, prefix_len: prefixLen,
      jacobi_window: cfg.jacobiWindow, want_caption: drafting };
    const reply = await this.exchange(() => this.client.open(req), true);
    try {
      this.tokens = [...reply.prefix_tokens];
      this.who = this.tokens.map(() => "cloud");
      Object.assign(this.st, { prefix_tokens: this.tokens.length, cloud_tokens: this.tokens.length });
      this.progress();
      if (drafting) {
        const t = performance.now();
        this.step = await this.rt.start(M.fromFloat16Array(reply.caption_emb), reply.caption_mask, this.cfgRows ? 2 : 1);
        this.st.device_graph_s += (performance.now() - t) / 1000;
        this.st.device_forward_passes += 1;
        if (this.tokens.length) await this.feed(this.tokens, 0);
        this.st.device_s += (performance.now() - t) / 1000;
        await this.draftAll();
        const st = this.st;
        if (st.device_forward_passes) this.observer.deviceStep.update(st.device_s / st.device_forward_passes);
      }
    } catch (err) {
      await this.client.close(this.sid).catch(() => {}); // the error in flight is the one to report
      throw err;
    }
    // every image ends with a close, best effort (ciar_device.loop's rule): the image is complete, and a transport
    // whose link is gone sends none
    await this.client.close(this.sid).catch(() => {});
    this.st.total_tokens = this.tokens.length;
    this.st.wall_s = (performance.now() - t0) / 1000;
    this.progress(true);
    return { tokens: this.tokens, who: this.who, stats: finishStats(this.st) };
  }

  /** The image's operating point, before its open: the calibrated span and burst under the fixed policy; under the
   *  adaptive one CostObserver.decide from the observed costs, a new observer primed first with the connection's
   *  handshake (half its round trip), one timed device step and the verifier's hint (the WELCOME's). */
  async choosePoint(remaining) {
    const cfg = this.cfg, obs = this.observer, st = this.st;
    let point = P.operatingPoint(cfg.span, cfg.burst);
    if (cfg.policy === "adaptive" && cfg.scores) {
      if (!obs.primed) {
        const hint = this.client.costHint ? await this.client.costHint() : null; // connects: the handshake is timed
        const handshake = this.client.handshakeS;
        const deviceStepS = await this.rt.stepSeconds(this.cfgRows ? 2 : 1);
        obs.prime({ latencyS: handshake ? handshake / 2 : null, deviceStepS, hint });
      }
      if (obs.ready) {
        const costs = obs.costs(this.V, { hiddenDim: cfg.interEnhance ? this.rt.manifest.dim : 0,
          featureDim: cfg.interEnhance ? M.intervalFeatureDim(cfg.featureTop) : 0 });
        Object.assign(st, { est_device_step_s: costs.deviceStepS, est_link_latency_s: costs.latencyS,
          est_cloud_step_s: costs.cloudStepS });
        const chosen = obs.decide(costs, point, remaining, { cloudStepPriceS: cfg.cloudStepPriceS }).point;
        st.adapted = P.samePoint(chosen, point) ? 0 : 1;
        point = chosen;
      }
    }
    Object.assign(st, { handovers: point.cloudOnly ? 1 : 0, span_used: point.span, burst_used: point.burst });
    this.span = point.span;
    this.burst = point.burst;
    return point;
  }

  async draftAll() {
    const cfg = this.cfg;
    while (this.tokens.length < this.nTotal) {
      this.progress();
      const t = performance.now();
      const { sent, used, x } = this.draft(this.tokens.length);
      this.box = null;
      const escalate = this.escalates(used, x);
      if (cfg.scores && !this.offline) this.observer.escalation.observe(escalate ? 1 : 0);
      if (!escalate) {
        await this.acceptLocal(x);
        this.st.device_s += (performance.now() - t) / 1000;
        continue;
      }
      const { span, spanQ } = await this.draftSpan(x, sent);
      let hidden = null, features = null;
      if (cfg.interEnhance && this.pending.length) {
        hidden = { dim: this.pendHidden[0].length, bits: M.toFloat16Array(concat(this.pendHidden)) };
        const feats = this.pendBox.map(({ center, radius }) => M.intervalFeatures(center, radius, cfg.featureTop));
        features = { dim: M.intervalFeatureDim(cfg.featureTop), bits: M.toFloat16Array(concat(feats)) };
      }
      this.st.device_s += (performance.now() - t) / 1000;
      const req = { session_id: this.sid, vocab_size: this.V, new_tokens: [...this.pending], draft_tokens: span,
        draft_probs: concatU16(spanQ), device_hidden: hidden, features, burst: this.burst,
        burst_entropy: cfg.burstEntropy };
      let rep;
      try {
        rep = await this.exchange(() => this.client.verify(req), false);
      } catch (err) {
        if (!(this.fallback && unreachable(err))) throw err;
        await this.goOffline(span);
        continue;
      }
      await this.commit(span, rep);
    }
  }

  /** Image token `position` (the current output): { sent: the float16 bits as sent, used: the float32 q drawn
   *  from, x: the token drawn at the position's uniform }. */
  draft(position) {
    const c = this.step.center;
    const q32 = M.logitsToProbs(this.row(c, 0), this.cfg.sampling, this.cfgRows ? this.row(c, 1) : null);
    const { sent, used } = M.quantizeDraft(q32);
    return { sent, used, x: M.sample(used, M.uniform(this.seed, M.DRAFT_STREAM, position)) };
  }

  /** The guided logit box of the current position, computed once per position. */
  guidedBox() {
    if (this.box === null) {
      const { center: c, radius: r } = this.step, s = this.cfg.sampling;
      this.box = this.cfgRows
        ? M.guidedInterval(this.row(c, 0), this.row(r, 0), this.row(c, 1), this.row(r, 1), s.cfg_scale, this.temp)
        : M.guidedInterval(this.row(c, 0), this.row(r, 0), null, null, 1, this.temp);
    }
    return this.box;
  }

  /** Whether draft x at the current position goes to the cloud (never offline). */
  escalates(used, x) {
    const gate = this.cfg.gate;
    if (this.offline || gate === "never") return false;
    return gate === "always" || this.score(used, x) > this.cfg.tau;
  }

  score(used, x) {
    const gate = this.cfg.gate;
    if (gate === "random") return M.gateScore(gate, { u: M.uniform(this.seed, M.GATE_STREAM, this.tokens.length) });
    if (gate === "entropy" || gate === "softmax") return M.gateScore(gate, { probs: used });
    const { center, radius } = this.guidedBox();
    return M.gateScore(gate, { center, radius, drafted: x, topk: this.cfg.topk });
  }

  async acceptLocal(x) {
    const i = this.tokens.length;
    this.tokens.push(x);
    this.who.push("device");
    this.st.device_tokens += 1;
    this.st.degraded_tokens += this.offline ? 1 : 0;
    this.pending.push(x);
    if (this.cfg.interEnhance && !this.offline) {
      this.pendHidden.push(Float32Array.from(this.row(this.step.hidden, 0)));
      this.pendBox.push(this.guidedBox());
    }
    if (this.tokens.length < this.nTotal) await this.feed([x], i);
  }

  /** The uncertain draft x and up to span - 1 more (span[:-1] are fed). */
  async draftSpan(x, sent) {
    const i = this.tokens.length, k = Math.min(this.span, this.nTotal - i);
    const span = [x], spanQ = [sent];
    for (let j = 1; j < k; j++) {
      await this.feed([span[span.length - 1]], i + j - 1);
      const d = this.draft(i + j);
      span.push(d.x);
      spanQ.push(d.sent);
    }
    return { span, spanQ };
  }

  /** span[:n] + [next] + burst; roll the device cache back to the accepted prefix and feed the rest. */
  async commit(span, rep) {
    const st = this.st, i = this.tokens.length, k = span.length, n = rep.num_accepted;
    st.cloud_forward_passes += rep.forward_passes;
    st.verifications += 1;
    st.resumes += rep.resumed ? 1 : 0;
    st.drafted += k;
    st.accepted += n;
    this.observer.observeVerdict(k, n);
    const fresh = [...span.slice(0, n), rep.next_token, ...rep.burst_tokens].slice(0, this.nTotal - i);
    st.burst_tokens += Math.max(0, fresh.length - n - 1);
    st.cloud_tokens += fresh.length;
    this.tokens.push(...fresh);
    this.who.push(...fresh.map(() => "cloud"));
    this.pending = [];
    this.pendHidden = [];
    this.pendBox = [];
    if (this.tokens.length < this.nTotal) {
      const t = performance.now(), keep = i + Math.min(n, k - 1); // span[:k-1] were fed; the accepted ones stay
      this.rt.rollback(keep);
      await this.feed(this.tokens.slice(keep), keep);
      st.device_s += (performance.now() - t) / 1000;
    }
  }

  /** The cloud is unreachable: keep the drafted span (the device's own samples) and go on alone. */
  async goOffline(span) {
    const t = performance.now(), i = this.tokens.length, k = span.length;
    this.offline = true;
    this.st.degraded = 1;
    this.tokens.push(...span);
    this.who.push(...span.map(() => "device"));
    this.st.device_tokens += k;
    this.st.degraded_tokens += k;
    this.pending = [];
    this.pendHidden = [];
    this.pendBox = [];
    if (this.tokens.length < this.nTotal) await this.feed([span[k - 1]], i + k - 1); // span[:k-1] are fed already
    this.st.device_s += (performance.now() - t) / 1000;
  }

  async feed(toks, start) {
    const t = performance.now();
    this.step = await this.rt.feed(toks, start);
    this.st.device_graph_s += (performance.now() - t) / 1000;
    this.st.device_forward_passes += 1;
  }

  /** One request/reply: wall time minus the reported cloud time is communication; bytes as the socket saw them
   *  (none without the connection's log). The observer sees the link's share: the wall time beyond the verifier's
   *  own (its forwards and the queue wait a verify reply reports). */
  async exchange(call, isOpen) {
    const log = this.client.exchanges || null, seen = log ? log.length : 0, t = performance.now();
    let reply;
    try {
      reply = await call();
    } catch (err) {
      this.st.comm_s += (performance.now() - t) / 1000; // the device waited for a reply that did not come
      throw err;
    }
    const wall = (performance.now() - t) / 1000, st = this.st, queueS = reply.queue_s || 0; // open and verify replies
    st.cloud_requests += 1;
    st.cloud_s += reply.cloud_s;
    st.comm_s += Math.max(0, wall - reply.cloud_s);
    st.queue_s += queueS;
    st.round_trip_s += wall;
    let up = 0, down = 0;
    if (log) for (const e of log.slice(seen)) { up += e.up; down += e.down; }
    st.bytes_up += up;
    st.bytes_down += down;
    const made = isOpen ? reply.prefix_tokens.length : (reply.burst_tokens || []).length; // tokens the cloud made
    this.observer.observeExchange(up, down, Math.max(0, wall - reply.cloud_s - queueS), reply.cloud_s,
      reply.forward_passes, queueS, !isOpen, made);
    if (isOpen) st.cloud_forward_passes += reply.forward_passes;
    return reply;
  }

  progress(final = false) {
    if (this.onProgress && (final || this.tokens.length - this.lastProgress >= PROGRESS_EVERY)) {
      this.lastProgress = this.tokens.length;
      this.onProgress([...this.tokens], [...this.who], finishStats({ ...this.st, total_tokens: this.tokens.length }));
    }
  }
}

function concat(arrays) {
  const out = new Float32Array(arrays.reduce((n, a) => n + a.length, 0));
  let o = 0;
  for (const a of arrays) { out.set(a, o); o += a.length; }
  return out;
}

function concatU16(arrays) {
  const out = new Uint16Array(arrays.reduce((n, a) => n + a.length, 0));
  let o = 0;
  for (const a of arrays) { out.set(a, o); o += a.length; }
  return out;
}
