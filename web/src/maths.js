// The browser device's maths: guidance and sampling, the float16 draft, the logit box, the gates, the features.
//
// The page's port of `ciar_device.maths` (numpy), function for function, on one position at a time (Float32Array
// [V]; V = 1024 for the scenes world, 16384 for LlamaGen). Python's side and this one are tested against each other
// on inputs recorded from the real device model (tests/device/test_web_maths.py, through node): the same escalate /
// accept decision at the calibrated threshold, scores within float32 rounding, the same float16 draft bits.
//
//   const q32 = logitsToProbs(cond, sampling, uncond);        // CFG -> temperature -> top-k -> top-p
//   const { sent, used } = quantizeDraft(q32);                 // float16 bits as sent (Uint16Array), float32 drawn
//   const x = sample(used, uniform(seed, DRAFT_STREAM, position)); // the draw of image token `position`
//   const { center, radius } = guidedInterval(cc, rc, cu, ru, cfgScale, temperature);
//   const escalate = gateScore("lower", { center, radius, drafted: x }) > tau;
//
// Precision follows the numpy port exactly where it is specified there: float32 steps are rounded with Math.fround
// after each IEEE operation (JS computes in float64, and one float64 operation rounded to float32 is the float32
// operation), float64 inside InterFuse, the lower bound, the softmax and the entropies. Sums run left to right
// (numpy's are pairwise): the float64 results may differ in the last bits, which float32 rounding almost always
// absorbs.
//
// Draws: the same inverse-CDF rule as the Python loop (the first entry whose float64 running sum exceeds u * total) at
// the same counter-based uniform (`uniform(seed, stream, position)`, splitmix64 on BigInts): from the same draft
// distribution, the same token as every other device.

const F32_TINY = 1.1754943508222875e-38; // np.finfo(np.float32).tiny
export const FEATURE_LOGIT_FLOOR = -50.0; // ciar.collab.interval.FEATURE_LOGIT_FLOOR
export const GATES = ["interval", "lower", "entropy", "softmax", "random", "topk"]; // gates that score a position
const fr = Math.fround;

// ------------------------------------------------------------------------------------------- float16

const F32 = new Float32Array(1);
const U32 = new Uint32Array(F32.buffer);

function roundHalfEven(v) {
  const f = Math.floor(v), d = v - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/** float32 value -> float16 bits, round to nearest even (the bits of numpy's `astype(np.float16)`). */
export function toFloat16Bits(x) {
  F32[0] = x;
  const b = U32[0];
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  const mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0); // inf, NaN
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow -> inf
  if (e <= 0) return sign | roundHalfEven(Math.abs(F32[0]) * 16777216); // subnormal: a multiple of 2^-24 (1024: 2^-14)
  let h = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (h & 1))) h += 1; // a carry into the exponent is right (up to inf)
  return sign | h;
}

/** float16 bits -> the value (exact). */
export function fromFloat16Bits(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  if (exp === 0) return sign * m * 5.960464477539063e-8; // m * 2^-24
  if (exp === 0x1f) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (exp - 15);
}

/** Float32Array -> Uint16Array of float16 bits. */
export function toFloat16Array(a) {
  const out = new Uint16Array(a.length);
  for (let i = 0; i < a.length; i++) out[i] = toFloat16Bits(a[i]);
  return out;
}

/** Uint16Array of float16 bits -> Float32Array (exact). */
export function fromFloat16Array(h) {
  const out = new Float32Array(h.length);
  for (let i = 0; i < h.length; i++) out[i] = fromFloat16Bits(h[i]);
  return out;
}

// ------------------------------------------------------------------------------------------- helpers

function max(a) {
  let m = -Infinity;
  for (let i = 0; i < a.length; i++) if (a[i] > m) m = a[i];
  return m;
}

function argmax(a) {
  let m = -Infinity, k = 0;
  for (let i = 0; i < a.length; i++) if (a[i] > m) { m = a[i]; k = i; }
  return k;
}

function sum(a) {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i];
  return s;
}

/** float64 log-sum-exp of a (entries may be -inf); -inf when none is finite. */
function logSumExp(a) {
  let m = max(a);
  if (!Number.isFinite(m)) m = 0;
  let s = 0;
  for (let i = 0; i < a.length; i++) s += Math.exp(a[i] - m);
  return Math.log(s) + m;
}

function sigmoid(x) {
  const e = Math.exp(-Math.abs(x)), d = 1 / (1 + e);
  return x >= 0 ? d : e * d;
}

/** The indices of the k largest entries, in descending order of value (lowest index first among equal values). */
export function topIndices(x, k) {
  const idx = [];
  for (let i = 0; i < x.length; i++) {
    const v = x[i];
    if (idx.length === k && !(v > x[idx[k - 1]])) continue;
    let j = idx.length === k ? k - 1 : idx.length;
    while (j > 0 && v > x[idx[j - 1]]) j--;
    idx.splice(j, 0, i);
    if (idx.length > k) idx.pop();
  }
  return idx;
}

/** The sampling settings, checked as `ciar_device.maths.check_sampling` does (Error naming the field). */
export function checkSampling({ cfg_scale = 1, temperature = 1, top_k = 0, top_p = 1 } = {}) {
  const real = (name, v) => {
    if (typeof v !== "number" || !Number.isFinite(v)) throw new Error(`${name} must be a finite number, got ${v}`);
    return v;
  };
  if (real("cfg_scale", cfg_scale) < 1) throw new Error(`cfg_scale must be >= 1 (1 disables guidance), got ${cfg_scale}`);
  if (real("temperature", temperature) < 0) throw new Error(`temperature must be >= 0 (0 means greedy), got ${temperature}`);
  if (!Number.isInteger(top_k) || top_k < 0) throw new Error(`top_k must be an integer >= 0 (0 disables), got ${top_k}`);
  if (!(real("top_p", top_p) > 0 && top_p <= 1)) throw new Error(`top_p must be in (0, 1] (1 disables), got ${top_p}`);
  return { cfg_scale, temperature, top_k, top_p };
}

// ------------------------------------------------------------------------------------------- sampling

/** Classifier-free guidance on float32 logits: u + (c - u) * s. */
export function guide(cond, uncond, cfgScale) {
  const s = fr(cfgScale), out = new Float32Array(cond.length);
  for (let i = 0; i < cond.length; i++) out[i] = fr(uncond[i] + fr(fr(cond[i] - uncond[i]) * s));
  return out;
}

/** logits [V] (the conditional row), uncond [V] or null -> probs Float32Array [V]: CFG -> temperature -> top-k ->
 *  top-p, as `ciar_device.maths.logits_to_probs`. */
export function logitsToProbs(cond, sampling, uncond = null) {
  const { cfg_scale, temperature, top_k, top_p } = checkSampling(sampling);
  let l = uncond !== null && cfg_scale !== 1 ? guide(cond, uncond, cfg_scale) : Float32Array.from(cond);
  const V = l.length;
  if (temperature === 0) {
    const p = new Float32Array(V);
    p[argmax(l)] = 1;
    return p;
  }
  if (temperature !== 1) {
    const t = fr(Math.max(temperature, F32_TINY)), m = max(l);
    for (let i = 0; i < V; i++) l[i] = fr(fr(l[i] - m) / t);
  }
  if (top_k > 0 && top_k < V) {
    const kth = Float32Array.from(l).sort()[V - top_k]; // the k-th largest
    for (let i = 0; i < V; i++) if (l[i] < kth) l[i] = -Infinity;
  }
  const m = max(l), e = new Float64Array(V);
  let s = 0;
  for (let i = 0; i < V; i++) { e[i] = Math.exp(l[i] - m); s += e[i]; }
  const p = new Float32Array(V);
  for (let i = 0; i < V; i++) p[i] = e[i] / s;
  if (top_p < 1) {
    const sorted = Float32Array.from(p).sort().reverse();
    const tp = fr(top_p);
    let cum = 0, keep = 0;
    for (let i = 0; i < V; i++) {
      cum += sorted[i];
      if (fr(fr(cum) - sorted[i]) < tp) keep++; // mass of strictly more probable tokens, below top_p
    }
    const threshold = sorted[Math.max(keep, 1) - 1];
    for (let i = 0; i < V; i++) if (p[i] < threshold) p[i] = 0;
    const z = fr(sum(p));
    for (let i = 0; i < V; i++) p[i] = fr(p[i] / z);
  }
  return p;
}

/** The draft distribution as it travels: q [V] float32 -> { sent: float16 bits (Uint16Array), used: the float32
 *  distribution the device draws from (q_sent / max(sum q_sent, tiny)) }. */
export function quantizeDraft(q) {
  const sent = toFloat16Array(q);
  return { sent, used: draftDistribution(sent) };
}

/** float16 bits as sent -> the normalised float32 distribution (the float16 sum is exact in float64). */
export function draftDistribution(sent) {
  const q = fromFloat16Array(sent);
  const z = Math.max(fr(sum(q)), F32_TINY);
  for (let i = 0; i < q.length; i++) q[i] = fr(q[i] / z);
  return q;
}

/** A seeded stream of uniform doubles in [0, 1): SplitMix64 (BigInt), 53 bits per draw. */
const MASK64 = (1n << 64n) - 1n;
// the device's draw streams (ciar_device.maths.DRAFT_STREAM / GATE_STREAM)
export const DRAFT_STREAM = 0x6369617264726166n; // "ciardraf"
export const GATE_STREAM = 0x6369617267617465n; // "ciargate"

/** One splitmix64 step on a BigInt in [0, 2**64). */
export function splitmix64(x) {
  x = (x + 0x9e3779b97f4a7c15n) & MASK64;
  x = ((x ^ (x >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK64;
  x = ((x ^ (x >> 27n)) * 0x94d049bb133111ebn) & MASK64;
  return x ^ (x >> 31n);
}

/** The device's uniform double in [0, 1) for image token `position` of the image with `seed`, in `stream`:
 *  `ciar_device.maths.uniform`, bit for bit (splitmix64 of the seed, then of the stream, then of the position; the
 *  top 53 bits / 2**53). */
export function uniform(seed, stream, position) {
  const s = splitmix64(BigInt.asUintN(64, BigInt(seed)));
  const z = splitmix64(splitmix64(s ^ BigInt.asUintN(64, BigInt(stream))) ^ BigInt.asUintN(64, BigInt(position)));
  return Number(z >> 11n) / 9007199254740992;
}

/** One token from q [V] by inverse CDF at the uniform u in [0, 1) (`uniform`): the first index whose float64 running
 *  sum exceeds u * total. Zero-probability entries are never drawn. */
export function sample(q, u) {
  const cdf = new Float64Array(q.length);
  let total = 0;
  for (let i = 0; i < q.length; i++) { total += q[i]; cdf[i] = total; }
  if (!(total > 0) || !Number.isFinite(total)) throw new Error("sample needs a probability vector with a positive, finite total");
  const target = u * total;
  let lo = 0, hi = q.length; // the first index with cdf > target
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (cdf[mid] > target) hi = mid; else lo = mid + 1;
  }
  if (lo < q.length) return lo;
  for (let i = q.length - 1; i >= 0; i--) if (q[i] > 0) return i;
  return q.length - 1;
}

// ------------------------------------------------------------------------------------------- the logit box

/** The logit box after guidance and temperature: center = guide(cc, cu, s), radius = |s| rc + |1 - s| ru; both / T.
 *  cu, ru null: no guidance. */
export function guidedInterval(cc, rc, cu = null, ru = null, cfgScale = 1, temperature = 1) {
  if (!(temperature > 0 && Number.isFinite(temperature))) throw new Error(`temperature must be a finite number > 0, got ${temperature}`);
  let center = Float32Array.from(cc), radius = Float32Array.from(rc);
  if (cu !== null) {
    const s = cfgScale, a = fr(Math.abs(s)), b = fr(Math.abs(1 - s));
    center = guide(cc, cu, s);
    for (let i = 0; i < radius.length; i++) radius[i] = fr(fr(a * rc[i]) + fr(b * ru[i]));
  }
  if (temperature !== 1) {
    const t = fr(temperature);
    for (let i = 0; i < center.length; i++) { center[i] = fr(center[i] / t); radius[i] = fr(radius[i] / t); }
  }
  return { center, radius };
}

/** log sum_{j != i} exp(a_j) for every i, float64 (`ciar_device.maths._log_rest`). */
function logRest(a) {
  const V = a.length, rest = new Float64Array(V);
  if (V === 1) return rest.fill(-Infinity);
  let m = max(a);
  if (!Number.isFinite(m)) m = 0;
  const e = new Float64Array(V);
  let s = 0;
  for (let i = 0; i < V; i++) { e[i] = Math.exp(a[i] - m); s += e[i]; }
  const ls = Math.log(s) + m;
  for (let i = 0; i < V; i++) rest[i] = ls + Math.log1p(-Math.min(e[i] / s, 0.5));
  const k = argmax(a);
  let without = 0;
  for (let i = 0; i < V; i++) if (i !== k) without += e[i];
  rest[k] = Math.log(without) + m;
  return rest;
}

/** InterFuse: the tight softmax bounds over [c - r, c + r] -> { lo, hi } Float32Array [V] (float64 inside, the same
 *  edge rules and safety margin as the Python side). */
export function interFuse(center, radius, margin = 0.01, maxRadius = null) {
  const V = center.length, lo = new Float64Array(V), hi = new Float64Array(V);
  const logLo = new Float64Array(V), logHi = new Float64Array(V);
  for (let i = 0; i < V; i++) {
    let r = Math.max(radius[i], 0);
    if (maxRadius !== null) r = Math.min(r, maxRadius);
    logLo[i] = center[i] - r;
    logHi[i] = center[i] + r;
  }
  const restHi = logRest(logHi), restLo = logRest(logLo);
  let sLo = 0, sHi = 0;
  for (let i = 0; i < V; i++) {
    if (center[i] > -Infinity) {
      hi[i] = sigmoid(logHi[i] - restLo[i]);
      lo[i] = Math.min(sigmoid(logLo[i] - restHi[i]), hi[i]);
    }
    sLo += lo[i];
    sHi += hi[i];
  }
  const cap = 1 - margin, floor = 1 + margin;
  const scaleLo = sLo > cap ? cap / Math.max(sLo, 1e-300) : 1;
  const scaleHi = sHi < floor ? floor / Math.max(sHi, 1e-300) : 1;
  const outLo = new Float32Array(V), outHi = new Float32Array(V);
  for (let i = 0; i < V; i++) {
    outLo[i] = scaleLo === 1 ? lo[i] : lo[i] * scaleLo;
    outHi[i] = Math.min(scaleHi === 1 ? hi[i] : hi[i] * scaleHi, 1);
  }
  return { lo: outLo, hi: outHi };
}

/** delta = hi - lo (float32) -> { omega: its sum, sigma: its population std } (float32 values). */
function omegaSigma(lo, hi) {
  const V = lo.length, d = new Float64Array(V);
  let s = 0;
  for (let i = 0; i < V; i++) { d[i] = fr(hi[i] - lo[i]); s += d[i]; }
  const mean = s / V;
  let ss = 0;
  for (let i = 0; i < V; i++) ss += (d[i] - mean) * (d[i] - mean);
  return { omega: fr(s), sigma: fr(Math.sqrt(ss / V)) };
}

/** U * V / sqrt(V - 1) (float32); 0 when V < 2. */
export function normalizedUncertainty(u, V) {
  return V < 2 ? 0 : fr(u * fr(V / Math.sqrt(V - 1)));
}

/** The interval gate's score: InterFuse (margin 0 for the gate), U = Omega * sigma, normalised. */
export function intervalUncertainty(center, radius, margin = 0.01) {
  const { lo, hi } = interFuse(center, radius, margin);
  const { omega, sigma } = omegaSigma(lo, hi);
  return normalizedUncertainty(fr(omega * sigma), center.length);
}

/** Entropy of softmax(x) (float64), masked -inf entries contribute 0. */
function softmaxEntropy(x) {
  const m = max(x);
  let s = 0, ed = 0;
  for (let i = 0; i < x.length; i++) {
    const d = x[i] - m, e = Math.exp(d);
    s += e;
    if (e > 0) ed += e * d;
  }
  return Math.log(s) - ed / s;
}

/** Width of intervalFeatures(..., top): 2 * top + 4. */
export function intervalFeatureDim(top) {
  return 2 * top + 4;
}

/** center, radius [V] -> Float32Array [2 * top + 4]: the `top` largest centers minus the max (floored), the radii
 *  there, then Omega, kappa, U_norm (InterFuse, margin 0.01) and the entropy of softmax(center) / log V. */
export function intervalFeatures(center, radius, top = 8) {
  const V = center.length, k = Math.min(top, V), out = new Float32Array(intervalFeatureDim(top));
  const idx = topIndices(center, k);
  for (let j = 0; j < k; j++) {
    out[j] = Math.max(fr(center[idx[j]] - center[idx[0]]), FEATURE_LOGIT_FLOOR);
    out[top + j] = Math.max(radius[idx[j]], 0);
  }
  const { lo, hi } = interFuse(center, radius);
  const { omega, sigma } = omegaSigma(lo, hi);
  let kappa = 0, ent = 0;
  if (V > 1) {
    const sigmaMax = fr(omega * fr(Math.sqrt(V - 1) / V));
    kappa = omega > 0 ? fr(sigma / Math.max(sigmaMax, fr(1e-30))) : 0;
    kappa = Math.min(Math.max(kappa, 0), 1);
    ent = fr(softmaxEntropy(center) / Math.log(V));
  }
  out[2 * top] = omega;
  out[2 * top + 1] = kappa;
  out[2 * top + 2] = normalizedUncertainty(fr(omega * sigma), V);
  out[2 * top + 3] = ent;
  return out;
}

// ------------------------------------------------------------------------------------------- the gates

/** -log p_lo[x], the drafted token's tight InterFuse lower bound (float64 inside, one log-sum-exp). */
export function lowerScore(center, radius, x) {
  const V = center.length, hi = new Float64Array(V);
  for (let i = 0; i < V; i++) hi[i] = center[i] + Math.max(radius[i], 0);
  const logLoX = center[x] - Math.max(radius[x], 0);
  if (!Number.isFinite(logLoX)) return Infinity;
  hi[x] = -Infinity;
  const z = logLoX - logSumExp(hi);
  return fr(Math.max(-z, 0) + Math.log1p(Math.exp(-Math.abs(z))));
}

/** Shannon entropy of probs / log V, in [0, 1]. */
export function entropyScore(p) {
  const V = p.length;
  if (V < 2) return 0;
  let h = 0;
  for (let i = 0; i < V; i++) {
    if (p[i] > 0) h -= p[i] * Math.log(p[i]);
    else if (p[i] < 0) h = -Infinity;
  }
  return fr(Math.min(Math.max(h / Math.log(V), 0), 1));
}

/** 1 - max p. */
export function softmaxScore(p) {
  return fr(1 - max(p));
}

/** The gate's score of one position (escalate when score > tau): "interval", "lower" (center, radius, drafted) or
 *  "entropy", "softmax" (probs: the draft distribution the token was drawn from). */
/** The discrete top-k gate (`ciar_device.maths.topk_score`): InterFuse over the k largest centers, then
 *  (n_feasible - 1 + Omega / (1 + Omega)) / k in float32; a feasible winner i has p_hi_i >= max_j p_lo_j. */
export function topkScore(center, radius, topk = 200, margin = 0) {
  if (!(topk >= 1)) throw new Error(`topk must be >= 1, got ${topk}`);
  const k = Math.min(Math.floor(topk), center.length);
  const idx = topIndices(center, k);
  const { lo, hi } = interFuse(Float32Array.from(idx, (i) => center[i]), Float32Array.from(idx, (i) => radius[i]),
    margin);
  let maxLo = -Infinity, s = 0;
  for (let i = 0; i < k; i++) { maxLo = Math.max(maxLo, lo[i]); s += fr(hi[i] - lo[i]); }
  let n = 0;
  for (let i = 0; i < k; i++) if (hi[i] >= maxLo) n++;
  const omega = fr(s), frac = fr(omega / fr(1 + omega));
  return fr(fr(n - 1 + frac) / k);
}

/** The gate's score of one position (escalate when > tau), as `ciar_device.maths.gate_score`: u is the "random"
 *  gate's uniform (`uniform(seed, GATE_STREAM, position)`), topk the "topk" gate's set size. */
export function gateScore(kind, { center = null, radius = null, probs = null, drafted = null, u = null, topk = 200 } = {}) {
  const need = (inputs) => {
    const missing = Object.entries(inputs).filter(([, v]) => v === null).map(([k]) => k);
    if (missing.length) throw new Error(`gate "${kind}" needs ${missing.join(", ")}`);
  };
  if (kind === "interval") { need({ center, radius }); return intervalUncertainty(center, radius, 0); }
  if (kind === "lower") { need({ center, radius, drafted }); return lowerScore(center, radius, drafted); }
  if (kind === "entropy") { need({ probs }); return entropyScore(probs); }
  if (kind === "softmax") { need({ probs }); return softmaxScore(probs); }
  if (kind === "random") { need({ u }); return u; }
  if (kind === "topk") { need({ center, radius }); return topkScore(center, radius, topk, 0); }
  throw new Error(`gate "${kind}" is not supported by the browser device; supported: ${GATES.join(", ")}`);
}
