// The exported device model and VQ decoder on onnxruntime-web (`ciar_device.runtime` in the page): the same graphs
// (`python -m pipelines.export_onnx`), the same semantics.
//
//   const rt = await DeviceRuntime.create(ort, manifest, { device_prefill: bytes, device_step: bytes }, options);
//   let step = await rt.start(captionEmb, captionMask, 2);  // Float32Array [L * D], booleans [L]; rows 2 = CFG
//   step.center, step.radius, step.hidden                   // Float32Array [rows * V], [rows * V], [rows * dim]
//   step = await rt.feed([17], 0);                          // image token 0 -> the box for image token 1
//   rt.rollback(3);                                         // keep image tokens [0, 3)
//   await rt.stepSeconds(2);                                // one timed step (the adaptive policy's prior)
//   const rgb = await (await ImageDecoder.create(ort, manifest, bytes)).decode(tokens);   // Uint8Array [H * W * 3]
//
// `ort` is the onnxruntime-web module (the page imports it from /web/ort/; tests import the installed package in
// node). `start` is the prefill (row 1 of a CFG pair takes the unconditional caption, mask kept), `feed(tokens,
// start)` feeds the same ids on every row and returns the last position's output, `rollback(length)` moves the KV
// cache's pointer (a query only sees keys at positions up to its own). The cache stays in the tensors the step graph
// returned; nothing is copied between steps.

export const FORMAT_VERSION = 1;

export function checkManifest(manifest) {
  if (manifest.format_version !== FORMAT_VERSION) {
    throw new Error(`the device model's format version is ${manifest.format_version}, this page reads ${FORMAT_VERSION}: re-export it`);
  }
  return manifest;
}

async function session(ort, bytes, options) {
  return ort.InferenceSession.create(bytes, { executionProviders: options.executionProviders || ["wasm"],
    graphOptimizationLevel: "all", ...options.sessionOptions });
}

export class DeviceRuntime {
  static async create(ort, manifest, graphs, options = {}) {
    checkManifest(manifest);
    const [prefill, step] = await Promise.all([session(ort, graphs.device_prefill, options),
      session(ort, graphs.device_step, options)]);
    return new DeviceRuntime(ort, manifest, prefill, step);
  }

  constructor(ort, manifest, prefill, step) {
    Object.assign(this, { ort, manifest, prefill, step });
    this.vocabSize = manifest.vocab_size;
    this.numTokens = manifest.num_tokens;
    this.clsTokenNum = manifest.cls_token_num;
    this.captionDim = manifest.caption_dim;
    this.rows = 0;
    this.length = 0; // image tokens held in the cache
    this.k = this.v = this.mask = null;
  }

  result(out) {
    this.k = out.k_cache || out.k_cache_out; // the prefill's and the step's output names
    this.v = out.v_cache || out.v_cache_out;
    return { center: out.center.data, radius: out.radius.data, hidden: out.hidden.data };
  }

  /** Reset the cache and prefill the caption: emb Float32Array [L * D] (left-padded), mask booleans [L]. */
  async start(emb, mask, rows) {
    if (rows !== 1 && rows !== 2) throw new Error(`rows must be 1 (no guidance) or 2 (classifier-free guidance), got ${rows}`);
    const L = this.clsTokenNum, D = this.captionDim, T = this.ort.Tensor;
    if (emb.length !== L * D || mask.length !== L) throw new Error(`expected a caption of [${L}, ${D}] and a mask of [${L}]`);
    const e = new Float32Array(rows * L * D), m = new Uint8Array(rows * L);
    for (let r = 0; r < rows; r++) {
      e.set(emb, r * L * D);
      for (let i = 0; i < L; i++) m[r * L + i] = mask[i] ? 1 : 0;
    }
    this.mask = new T("bool", m, [rows, L]);
    const out = await this.prefill.run({ caption_emb: new T("float32", e, [rows, L, D]), caption_mask: this.mask,
      drop: new T("bool", Uint8Array.from([0, 1].slice(0, rows)), [rows]) });
    this.rows = rows;
    this.length = 0;
    return this.result(out);
  }

  /** Feed image tokens at image indices start .. start + n - 1 -> the output of the last one. */
  async feed(tokens, start) {
    if (this.k === null) throw new Error("feed before start: prefill a caption first");
    const n = tokens.length;
    if (n === 0) throw new Error("feed needs at least one token");
    if (!(start >= 0 && start <= this.length)) throw new Error(`cannot feed at image index ${start}: the cache holds ${this.length} image tokens`);
    if (start + n > this.numTokens) throw new Error(`feeding ${n} tokens at ${start} runs past the image's ${this.numTokens} tokens`);
    const ids = new BigInt64Array(this.rows * n), T = this.ort.Tensor;
    for (let r = 0; r < this.rows; r++) for (let i = 0; i < n; i++) ids[r * n + i] = BigInt(tokens[i]);
    const out = await this.step.run({ tokens: new T("int64", ids, [this.rows, n]),
      start: new T("int64", BigInt64Array.from([BigInt(start)]), []), caption_mask: this.mask,
      k_cache: this.k, v_cache: this.v });
    this.length = start + n;
    return this.result(out);
  }

  /** Seconds of one step (one token fed), the median of `repeats` after a warm-up, on a caption of zeros: what the
   *  device knows of its own step before its first image (the adaptive policy's prior, policy.js's
   *  CostObserver.prime). Leaves the cache empty (`start` comes next). */
  async stepSeconds(rows = 1, repeats = 3) {
    const L = this.clsTokenNum;
    await this.start(new Float32Array(L * this.captionDim), Array(L).fill(true), rows);
    const times = [];
    for (let i = 0; i <= repeats; i++) {
      const t = performance.now();
      await this.feed([0], 0);
      times.push((performance.now() - t) / 1000);
    }
    this.rollback(0);
    const sorted = times.slice(1).sort((a, b) => a - b), h = sorted.length >> 1;
    return sorted.length % 2 ? sorted[h] : (sorted[h - 1] + sorted[h]) / 2;
  }

  /** Keep image tokens [0, length) in the cache. */
  rollback(length) {
    if (!(length >= 0 && length <= this.length)) throw new Error(`cannot roll back to ${length} image tokens: the cache holds ${this.length}`);
    this.length = length;
  }
}

export class ImageDecoder {
  static async create(ort, manifest, bytes, options = {}) {
    checkManifest(manifest);
    return new ImageDecoder(ort, manifest, await session(ort, bytes, options));
  }

  constructor(ort, manifest, sess) {
    Object.assign(this, { ort, manifest, sess });
    [this.height, this.width] = manifest.image.shape;
  }

  /** [N] token ids -> Uint8Array [H * W * 3] RGB. */
  async decode(tokens) {
    const ids = BigInt64Array.from(tokens, (t) => BigInt(t));
    const out = await this.sess.run({ tokens: new this.ort.Tensor("int64", ids, [1, ids.length]) });
    return out[this.sess.outputNames[0]].data;
  }
}
