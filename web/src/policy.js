// The browser device's operating points and the cost model that chooses one: `ciar_device.policy` (numpy) ported
// function for function, with the same formulas, constants and decision (its module docstring derives the model).
// Held against the Python side on hand-made and random costs and on a scripted observer's whole history
// (tests/device/test_web_policy.py, through node): the same costs to ~1e-9 relative, the same points.
//
//   const costs = new Costs({ deviceStepS: 1e-3, latencyS: 0.010, bandwidthBps: 300e6 / 8, cloudStepS: 0.060,
//     queueS: 0, escalationRate: 0.25, acceptFirst: 0.5, acceptNext: 0.9, vocabSize: 1024 });
//   expectedCost(costs, operatingPoint(2, 4), 135);                // { seconds, cloudSteps }
//   choose(costs, operatingPoint(2, 4), 135);                      // { point, outlook, objectiveS }: the cheapest
//   const obs = new CostObserver({ rates: manifest.ciar_defaults.policy_rates });   // one per link, kept
//   obs.prime({ latencyS, deviceStepS, hint });  obs.decide(obs.costs(V), calibrated, remaining).point
//
// An operating point is { span, burst, cloudOnly }: spans of `span` drafts and a cloud burst of up to `burst` tokens
// after a rejection, or (CLOUD_ONLY) the cloud makes every remaining token. Names are the Python ones in camelCase
// (Costs' fields too: device_step_s -> deviceStepS); null stands for Python's None. Message sizes are wire.js's
// exact byte counts of the frames (Python's `nbytes`).

import { verifyReplyBytes, verifyRequestBytes } from "./wire.js";

export const POLICY_RATES = ["escalation_rate", "accept_first", "accept_next"]; // as the device file carries them
export const SESSION_ID_BYTES = 32; // the sizes' session id: the decoder's are uuid4().hex
export const SPANS = Array.from({ length: 32 }, (_, i) => i + 1); // the span knob's range (ciar.collab.knobs)
export const BURSTS = [0, 1, 2, 4, 8, 16, 32]; // T and C are monotone in g: a coarse grid finds the best
// another point than the calibrated one must be expected to save this share of its time (noise would flip the
// choice, and with it the image a request and seed make, near a tie)
export const SWITCH_MARGIN = 0.10;
// images in a row on the cloud after which the device drafts one at the calibrated point, the wait doubling up to
// EXPLORE_MAX each time the look leaves the choice on the cloud
export const EXPLORE_EVERY = 32;
export const EXPLORE_MAX = 512;

/** An operating point of `span` >= 1 drafts and a burst >= 0 (Error otherwise). */
export function operatingPoint(span = 1, burst = 0) {
  if (!(span >= 1 && burst >= 0)) throw new Error(`an operating point needs span >= 1 and burst >= 0, got ${span}, ${burst}`);
  return { span, burst, cloudOnly: false };
}

export const CLOUD_ONLY = Object.freeze({ span: 0, burst: 0, cloudOnly: true });

/** Whether two operating points are the same (Python's == on the dataclass). */
export function samePoint(a, b) {
  return a.span === b.span && a.burst === b.burst && a.cloudOnly === b.cloudOnly;
}

/** The costs the model reads, checked as `Costs.__post_init__` does (decodeStepS null: cloudStepS). */
export class Costs {
  constructor({ deviceStepS, latencyS, bandwidthBps, cloudStepS, queueS, escalationRate, acceptFirst, acceptNext,
    vocabSize, hiddenDim = 0, featureDim = 0, decodeStepS = null }) {
    Object.assign(this, { deviceStepS, latencyS, bandwidthBps, cloudStepS, queueS, escalationRate, acceptFirst,
      acceptNext, vocabSize, hiddenDim, featureDim, decodeStepS: decodeStepS ?? cloudStepS });
    for (const name of ["deviceStepS", "latencyS", "cloudStepS", "queueS", "decodeStepS"]) {
      if (!(this[name] >= 0)) throw new Error(`costs: ${name} must be >= 0, got ${this[name]}`);
    }
    if (!(bandwidthBps > 0)) throw new Error(`costs: bandwidthBps must be > 0, got ${bandwidthBps}`);
    for (const name of ["escalationRate", "acceptFirst", "acceptNext"]) {
      if (!(this[name] >= 0 && this[name] <= 1)) throw new Error(`costs: ${name} must be in [0, 1], got ${this[name]}`);
    }
    if (!(vocabSize >= 1 && hiddenDim >= 0 && featureDim >= 0)) throw new Error("costs: vocabSize must be >= 1, hiddenDim and featureDim >= 0");
  }

  /** m: tokens accepted locally between two escalations, (1 - e) / e rounded half to even as Python's round (0
   *  when e is 0: no exchange). */
  get pendingPerExchange() {
    const e = this.escalationRate;
    return e > 0 ? roundHalfEven((1 - e) / e) : 0;
  }
}

function roundHalfEven(v) {
  const f = Math.floor(v), d = v - f;
  if (d !== 0.5) return d < 0.5 ? f : f + 1;
  return f % 2 === 0 ? f : f + 1;
}

/** The verifier's own recent figures (the WELCOME's), null where not measured: `CostHint`. */
export function costHint(spanS = null, stepS = null, queueS = null) {
  return { spanS, stepS, queueS };
}

/** P_full(k): every draft of a k-draft span is accepted. */
export function fullAccept(costs, span) {
  return costs.acceptFirst * costs.acceptNext ** (span - 1);
}

/** A(k): expected accepted drafts of a k-draft span. */
export function acceptedDrafts(costs, span) {
  const a = costs.acceptNext;
  return costs.acceptFirst * (a === 1 ? span : (1 - a ** span) / (1 - a));
}

const sizes = new Map(); // sizes depend on shapes only: a device choosing at each image does not recount them

function cached(key, compute) {
  let n = sizes.get(key);
  if (n === undefined) {
    if (sizes.size >= 4096) sizes.clear();
    n = compute();
    sizes.set(key, n);
  }
  return n;
}

/** B_up: the VerifyRequest's exact size with `span` drafts and `pending` locally accepted tokens (with their
 *  projector inputs when Inter-Enhance is on: hiddenDim + featureDim > 0). */
export function requestBytes(costs, span, pending) {
  const { vocabSize: V, hiddenDim: h, featureDim: f } = costs;
  return cached(`u${V},${h},${f},${span},${pending}`, () => {
    const enhance = pending > 0 && h + f > 0;
    return verifyRequestBytes(V, pending, span, enhance ? { hiddenDim: h, featureDim: f, sessionIdBytes: SESSION_ID_BYTES }
      : { sessionIdBytes: SESSION_ID_BYTES });
  });
}

/** B_down: the VerifyReply's exact size when it commits `tokens` cloud tokens (the next one and tokens - 1 burst). */
export function replyBytes(costs, tokens) {
  const V = costs.vocabSize;
  return cached(`d${V},${tokens}`, () => verifyReplyBytes(V, Math.max(0, tokens - 1), { sessionIdBytes: SESSION_ID_BYTES }));
}

/** One exchange's time on the link and in the verifier's queue: 2 l + (B_up + B_down) / b + w. */
export function linkS(costs, upBytes, downBytes) {
  return 2 * costs.latencyS + (upBytes + downBytes) / costs.bandwidthBps + costs.queueS;
}

/** { seconds: T, cloudSteps: C } of finishing `remaining` tokens at `point` (`expected_cost`). pending: tokens
 *  accepted locally that handing the rest to the cloud mid-image would carry; atOpen: chosen before the image's
 *  open, which goes out either way (cloud-only then costs the cloud's R sampled steps and the R tokens' bytes). */
export function expectedCost(costs, point, remaining, { pending = 0, atOpen = false } = {}) {
  if (remaining <= 0) return { seconds: 0, cloudSteps: 0 };
  if (point.cloudOnly && atOpen) {
    return { seconds: remaining * costs.decodeStepS + replyBytes(costs, remaining) / costs.bandwidthBps,
      cloudSteps: remaining };
  }
  if (point.cloudOnly) {
    const seconds = linkS(costs, requestBytes(costs, 0, pending), replyBytes(costs, remaining));
    return { seconds: seconds + costs.cloudStepS + (remaining - 1) * costs.decodeStepS, cloudSteps: remaining };
  }
  const e = costs.escalationRate, k = point.span, g = point.burst;
  const pFull = fullAccept(costs, k);
  const burst = g * (1 - pFull); // expected burst tokens of one exchange
  const down = pFull * replyBytes(costs, 1) + (1 - pFull) * replyBytes(costs, 1 + g);
  const steps = 1 + burst; // S(k, g)
  const exchange = linkS(costs, requestBytes(costs, k, costs.pendingPerExchange), down) + costs.cloudStepS
    + costs.decodeStepS * burst;
  const perPosition = (1 - e) * costs.deviceStepS + e * (k * costs.deviceStepS + exchange);
  const tokensPerPosition = (1 - e) + e * (acceptedDrafts(costs, k) + 1 + burst);
  return { seconds: remaining * perPosition / tokensPerPosition, cloudSteps: remaining * e * steps / tokensPerPosition };
}

/** The spans the adaptive policy considers from the calibrated span k on (a coarse grid of the longer ones). */
export function candidateSpans(k) {
  const last = SPANS[SPANS.length - 1];
  const spans = new Set([k, k + 1, k + 2, 2 * k, 3 * k, 4 * k, 8, 12, 16].filter((s) => s >= k).map((s) => Math.min(last, s)));
  return [...spans].sort((a, b) => a - b);
}

/** The points that verify no less than `calibrated`: it first, then every span >= its span and burst >= its burst
 *  from the grids, then cloud-only. A cloud-only calibration allows cloud-only alone. */
export function allowedPoints(calibrated, spans = SPANS, bursts = BURSTS) {
  if (calibrated.cloudOnly) return [CLOUD_ONLY];
  const points = [calibrated];
  for (const k of spans) {
    for (const g of bursts) {
      if (k >= calibrated.span && g >= calibrated.burst && !(k === calibrated.span && g === calibrated.burst)) {
        points.push(operatingPoint(k, g));
      }
    }
  }
  points.push(CLOUD_ONLY);
  return points;
}

/** The allowed point with the least T + price x C, { point, outlook, objectiveS }; on a tie the earlier one (the
 *  calibrated point first). margin: another point must be expected to save this share of the calibrated point's
 *  objective (SWITCH_MARGIN). */
export function choose(costs, calibrated, remaining, { cloudStepPriceS = 0, pending = 0, spans = SPANS, bursts = BURSTS,
  atOpen = false, margin = 0 } = {}) {
  if (!(cloudStepPriceS >= 0)) throw new Error(`cloudStepPriceS must be >= 0, got ${cloudStepPriceS}`);
  if (!(margin >= 0 && margin < 1)) throw new Error(`margin must be in [0, 1), got ${margin}`);
  let best = null, bar = 0;
  for (const point of allowedPoints(calibrated, spans, bursts)) {
    const outlook = expectedCost(costs, point, remaining, { pending, atOpen });
    const objectiveS = outlook.seconds + cloudStepPriceS * outlook.cloudSteps;
    if (best === null) { // the calibrated point, which the others must beat by the margin
      best = { point, outlook, objectiveS };
      bar = objectiveS * (1 - margin);
    } else if (objectiveS < Math.min(bar, best.objectiveS)) {
      best = { point, outlook, objectiveS };
    }
  }
  return best;
}

// ------------------------------------------------------------------------------------------- running estimates

/** An exponentially weighted running mean, weights normalised (the first sample is the estimate); `value` is
 *  `prior` before any sample; with `clip`, from the third sample on a sample is clipped into [value / clip,
 *  value x clip] (one stalled step moves the estimate a bounded amount). */
export class Ewma {
  constructor(weight = 0.2, prior = null, clip = null) {
    if (!(weight > 0 && weight <= 1)) throw new Error(`weight must be in (0, 1], got ${weight}`);
    if (clip !== null && !(clip > 1)) throw new Error(`clip must be > 1, got ${clip}`);
    Object.assign(this, { weight, prior, clip });
    this.sum = this.norm = 0; // decayed sum of samples, decayed sum of their weights
    this.samples = 0;
  }

  update(x) {
    if (this.clip !== null && this.samples >= 2 && this.value > 0) {
      x = Math.min(Math.max(x, this.value / this.clip), this.value * this.clip);
    }
    const keep = 1 - this.weight;
    this.sum = keep * this.sum + this.weight * x;
    this.norm = keep * this.norm + this.weight;
    this.samples += 1;
    return this.value;
  }

  get value() {
    return this.samples ? this.sum / this.norm : this.prior;
  }
}

/** Running latency and bandwidth of a link: a weighted least-squares line through each exchange's (bytes, seconds
 *  on the link), slope 1 / b, intercept 2 l. Without enough spread in the sizes (or a fit that is not positive) the
 *  bandwidth is the prior and the latency comes from the mean exchange at it; with no sample both are priors. */
export class LinkEstimator {
  static MIN_SPREAD_BYTES = 64;

  constructor(weight = 0.2, priorLatencyS = 0, priorBandwidthBps = Infinity) {
    Object.assign(this, { priorLatencyS, priorBandwidthBps });
    [this.x, this.y, this.xx, this.xy] = [0, 1, 2, 3].map(() => new Ewma(weight));
  }

  /** One exchange: its bytes each way and its seconds on the link (wall time minus the cloud's and queue's). */
  observe(upBytes, downBytes, seconds) {
    const x = upBytes + downBytes;
    this.x.update(x);
    this.y.update(seconds);
    this.xx.update(x * x);
    this.xy.update(x * seconds);
  }

  get samples() {
    return this.x.samples;
  }

  get bandwidthBps() {
    if (!this.x.samples) return this.priorBandwidthBps;
    const mx = this.x.value, v = this.xx.value - mx * mx;
    const slope = v > LinkEstimator.MIN_SPREAD_BYTES ** 2 ? (this.xy.value - mx * this.y.value) / v : 0;
    return slope > 0 ? 1 / slope : this.priorBandwidthBps;
  }

  get latencyS() {
    if (!this.x.samples) return this.priorLatencyS;
    return Math.max(0, (this.y.value - this.x.value / this.bandwidthBps) / 2);
  }
}

/** The verifier's span forward t_c (verify replies with one forward) and sampled step t_s (a verify reply's burst per
 *  step, and a long open's seconds per step; a step: a token the cloud made itself or a forward, whichever there
 *  were more of), each the mean seconds per forward until first seen (ciar_device.policy.CloudStepEstimator). */
export class CloudStepEstimator {
  static LONG_OPEN = 32; // an open with at least this many steps counts towards t_s

  constructor(weight = 0.2, clip = 3) {
    this.span = new Ewma(weight, null, clip); // t_c
    this.step = new Ewma(weight, null, clip); // t_s
    this.perPass = new Ewma(weight, null, clip); // every reply's seconds per forward: the stand-in for either
    this.samples = 0; // verify replies observed
  }

  observe(cloudS, forwardPasses, verify = true, tokens = null) {
    const passes = Math.max(1, Math.trunc(forwardPasses));
    this.perPass.update(cloudS / passes);
    const made = tokens === null || tokens === undefined ? 0 : Math.max(0, Math.trunc(tokens));
    if (verify) {
      this.samples += 1;
      if (passes === 1) this.span.update(cloudS);
      else if (this.span.samples) this.step.update(Math.max(0, cloudS - this.span.value) / Math.max(passes - 1, made));
    } else if (Math.max(passes, made) >= CloudStepEstimator.LONG_OPEN) {
      this.step.update(cloudS / Math.max(passes, made));
    }
  }

  /** The server's figures (a costHint) as t_c's and t_s's priors (Ewma.prior: the replies' own replace them). */
  prime(hint) {
    this.span.prior = hint.spanS;
    this.step.prior = hint.stepS;
  }

  /** [t_c, t_s]: observed, else primed, else the mean per forward; null without any. */
  steps() {
    const fallback = this.perPass.value; // no prior: null before any reply
    const tc = this.span.value ?? fallback;
    const ts = this.step.value ?? fallback;
    if (tc === null && ts === null) return null;
    return [tc ?? ts, ts ?? tc];
  }
}

/** A rate with `priorTrials` pseudo-trials at `prior`, its counts decaying by `decay` per trial. */
export class RateEstimator {
  constructor(prior, priorTrials, decay = 0.998) {
    Object.assign(this, { prior, priorTrials, decay });
    this.successes = this.trials = 0;
  }

  observe(successes, trials = 1) {
    const keep = this.decay ** trials;
    this.successes = keep * this.successes + successes;
    this.trials = keep * this.trials + trials;
  }

  get value() {
    return (this.successes + this.prior * this.priorTrials) / (this.trials + this.priorTrials);
  }

  /** The observations alone (no prior), null without any. */
  get observed() {
    return this.trials ? this.successes / this.trials : null;
  }
}

/** What one device has observed of its costs, kept across its images (one per link): the link, the verifier's
 *  span forward, sampled step and queue wait, the device's step, the gate's and the cloud's rates. Fed by the
 *  device's exchanges and draft loop; `costs()` gives the model's inputs, `decide` the next image's point. */
export class CostObserver {
  static ESCALATION_PRIOR = [0.15, 8]; // (rate, pseudo-drafts) before the device has shown its own
  static ACCEPT_PRIOR = [0.5, 0.8, 4]; // (alpha1, alpha, pseudo-verifications)
  static RATES = POLICY_RATES;

  /** rates: the starting rates by POLICY_RATES name (the device file's `ciar_defaults.policy_rates`), else the
   *  built-in priors; decay: the rates' counts decay per trial. */
  constructor({ weight = 0.2, rates = null, decay = 0.998 } = {}) {
    this.link = new LinkEstimator(weight);
    this.cloud = new CloudStepEstimator();
    this.queue = new Ewma(weight, 0);
    this.verifier = new Ewma(weight); // seconds in the verifier per verify exchange: queue wait + its forwards
    this.deviceStep = new Ewma(weight, null, 3);
    this.primed = false; // `prime` was called (once, before the device's first image)
    this.linkPrimed = false; // the link's latency is known from a handshake (0 on a perfect link)
    this.cloudOnlyStreak = 0; // images in a row given to the cloud whole
    this.exploreAfter = EXPLORE_EVERY; // the streak after which the next image looks at drafting again
    this.exploring = false; // the last image was such a look
    rates = rates || {};
    const [e0, n0] = CostObserver.ESCALATION_PRIOR, [a1, a, m0] = CostObserver.ACCEPT_PRIOR;
    this.escalation = new RateEstimator(rates.escalation_rate ?? e0, n0, decay);
    this.acceptFirst = new RateEstimator(rates.accept_first ?? a1, m0, decay);
    this.acceptNext = new RateEstimator(rates.accept_next ?? a, m0, decay);
  }

  /** One request/reply: its bytes, seconds on the link, the cloud's seconds and forwards (an open's only towards
   *  the mean step) and the queue wait a verify reply reports. */
  observeExchange(upBytes, downBytes, linkSeconds, cloudS, forwardPasses, queueS, verify, tokens = null) {
    this.link.observe(upBytes, downBytes, linkSeconds);
    this.cloud.observe(cloudS, forwardPasses, verify, tokens);
    if (verify) {
      this.queue.update(queueS);
      this.verifier.update(queueS + cloudS);
    }
  }

  /** The cloud's judgement of a span of `span` drafts: `accepted` kept. */
  observeVerdict(span, accepted) {
    this.acceptFirst.observe(accepted > 0 ? 1 : 0);
    const later = Math.min(accepted, span - 1); // a later draft is judged once the one before it passed
    if (later) this.acceptNext.observe(Math.max(0, accepted - 1), later);
  }

  /** What a device knows before its first exchange, as the estimates' priors: latencyS (half its handshake's round
   *  trip), deviceStepS (one timed step), hint (the verifier's figures, a costHint); null: not known. */
  prime({ latencyS = null, deviceStepS = null, hint = null } = {}) {
    this.primed = true;
    if (latencyS !== null) {
      this.link.priorLatencyS = Math.max(0, latencyS);
      this.linkPrimed = true;
    }
    if (deviceStepS !== null) this.deviceStep.prior = Math.max(0, deviceStepS);
    if (hint !== null) {
      this.cloud.prime(hint);
      if (hint.queueS !== null) this.queue.prior = Math.max(0, hint.queueS);
    }
  }

  /** Whether every cost the model reads has a value, observed or primed. */
  get ready() {
    const link = this.link.samples > 0 || this.linkPrimed;
    return link && this.cloud.steps() !== null && this.deviceStep.value !== null;
  }

  /** [t_c, t_s] as observed (the server's hint until then), [0, 0] without either. */
  cloudSteps() {
    return this.cloud.steps() || [0, 0];
  }

  /** The next image's point, chosen before its open: `choose` with SWITCH_MARGIN, except that after `exploreAfter`
   *  images in a row on the cloud the image drafts at the calibrated point (a look at drafting's costs); a look
   *  that leaves the choice on the cloud doubles the wait (up to EXPLORE_MAX), drafting by choice resets it.
   *  spans: the spans considered (default candidateSpans of the calibrated span). */
  decide(costs, calibrated, remaining, { cloudStepPriceS = 0, spans = null, bursts = BURSTS } = {}) {
    if (spans === null) spans = calibrated.cloudOnly ? [] : candidateSpans(calibrated.span);
    const decision = choose(costs, calibrated, remaining, { cloudStepPriceS, spans, bursts, atOpen: true,
      margin: SWITCH_MARGIN });
    if (!decision.point.cloudOnly) {
      this.cloudOnlyStreak = 0;
      this.exploreAfter = EXPLORE_EVERY;
      this.exploring = false;
      return decision;
    }
    if (this.exploring) this.exploreAfter = Math.min(EXPLORE_MAX, 2 * this.exploreAfter); // the look changed nothing
    this.exploring = this.cloudOnlyStreak >= this.exploreAfter;
    if (this.exploring) {
      this.cloudOnlyStreak = 0;
      const outlook = expectedCost(costs, calibrated, remaining, { atOpen: true });
      return { point: calibrated, outlook, objectiveS: outlook.seconds + cloudStepPriceS * outlook.cloudSteps };
    }
    this.cloudOnlyStreak += 1;
    return decision;
  }

  /** The model's inputs as observed (deviceStepS: a fresher figure, e.g. the current image's own). */
  costs(vocabSize, { hiddenDim = 0, featureDim = 0, deviceStepS = null } = {}) {
    const [cloudStepS, decodeStepS] = this.cloudSteps();
    return new Costs({ deviceStepS: deviceStepS ?? this.deviceStep.value ?? 0, latencyS: this.link.latencyS,
      bandwidthBps: this.link.bandwidthBps, cloudStepS, decodeStepS, queueS: this.queue.value ?? 0,
      escalationRate: this.escalation.value, acceptFirst: this.acceptFirst.value, acceptNext: this.acceptNext.value,
      vocabSize, hiddenDim, featureDim });
  }
}
