// The browser device: a module Web Worker that runs the CIAR device loop (loop.js) so the page stays responsive.
// Loaded by the playground (services/playground.html) from /web/device/worker.js; its runtime, onnxruntime-web, from
// /web/ort/ (the installed package, never the internet); the device model from /v1/device/model with a device key.
//
// page -> worker   { type: "generate", key, prompt, seed, previews, policy }  (previews: false skips the partial
//                                                        images; policy: "adaptive" (default) or "fixed", loop.js)
// worker -> page   { type: "status", text }                             (loading the runtime, the model)
//                  { type: "progress", tokens, who, stats, total, shape, rgb }   (rgb: the partial image [H * W * 3],
//                                                        undecided tokens filled with the last decided one's code)
//                  { type: "result", tokens, who, stats, rgb, policy, model }   (model: the runtime's facts; stats
//                                                        span_used, burst_used, handovers: the image's point)
//                  { type: "error", message }
//
// The adaptive policy's cost observer lives with the loaded model: this tab's link, verifier and device step as
// its earlier images saw them (each image opens its own connection to the same server), so each image's point is
// chosen from them; a new key or device model starts a new one (the device file's rates).

import { DeviceConnection } from "./connection.js";
import { generate, newObserver } from "./loop.js";
import { DeviceRuntime, ImageDecoder } from "./runtime.js";

const ORT = "/web/ort/";
const WARMUP_S = 4;
// previews an image at most (services.config.MAX_PREVIEWS): each decodes the whole image, so a fixed cadence of
// loop.js's PROGRESS_EVERY tokens queued 4x the decodes of 4x the pixels on a 1,024-token, 512 px image
const MAX_PREVIEWS = 16;
let ort = null;
let loaded = null; // { key, digest, manifest, rt, decoder, loadS, observer }

async function runtime() {
  if (ort === null) {
    ort = await import(`${ORT}ort.wasm.min.mjs`);
    ort.env.wasm.wasmPaths = ORT;
    ort.env.wasm.numThreads = 1; // one thread: no cross-origin isolation needed, the page's other work keeps a core
    ort.env.logLevel = "error";
  }
  return ort;
}

async function get(url, key, what) {
  const r = await fetch(url, { headers: { authorization: `Bearer ${key}` } });
  if (!r.ok) {
    const err = (await r.json().catch(() => ({}))).error || {};
    throw new Error(`${what}: ${r.status} ${err.message || r.statusText}`);
  }
  return new Uint8Array(await r.arrayBuffer());
}

async function sha256(bytes) {
  if (!globalThis.crypto || !crypto.subtle) return null; // not a secure context (plain http to another host)
  const h = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(h, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** The device model the server serves (downloaded once per worker, each graph checked against the manifest). */
async function model(key) {
  const raw = await get("/v1/device/model", key, "the device model");
  const digest = await sha256(raw) ?? new TextDecoder().decode(raw);
  if (loaded !== null && loaded.key === key && loaded.digest === digest) return loaded;
  const t0 = performance.now();
  const manifest = JSON.parse(new TextDecoder().decode(raw));
  const o = await runtime();
  const bytes = {};
  for (const [name, g] of Object.entries(manifest.graphs)) {
    postMessage({ type: "status", text: `Downloading the device model: ${g.file} (${(g.bytes / 1e6).toFixed(1)} MB)…` });
    const b = await get(`/v1/device/model/${encodeURIComponent(g.file)}`, key, g.file);
    const h = await sha256(b);
    if (b.length !== g.bytes || (h !== null && h !== g.sha256)) throw new Error(`${g.file}: the download does not match the manifest`);
    bytes[name] = b;
  }
  postMessage({ type: "status", text: "Starting onnxruntime-web (WebAssembly)…" });
  const [rt, decoder] = await Promise.all([DeviceRuntime.create(o, manifest, bytes), ImageDecoder.create(o, manifest, bytes.vq_decoder)]);
  // warm up before the first image: the runtime's first runs allocate, and the browser compiles WebAssembly in
  // tiers (a quick baseline first, optimised code once a function is hot), so the first few hundred steps run
  // several times slower. Two images' worth of steps (at most WARMUP_S) belong to loading, not to the first image.
  postMessage({ type: "status", text: "Warming up the device model…" });
  const L = manifest.cls_token_num, rows = manifest.sampling.cfg_scale > 1 ? 2 : 1, n = manifest.num_tokens;
  const tw = performance.now();
  await rt.start(new Float32Array(L * manifest.caption_dim), Array(L).fill(true), rows);
  for (let i = 0; i < 2 * n && performance.now() - tw < 1000 * WARMUP_S; i++) {
    if (i % n === 0) rt.rollback(0);
    await rt.feed([i % manifest.vocab_size], i % n);
  }
  await decoder.decode(Array(n).fill(0));
  loaded = { key, digest, manifest, rt, decoder, loadS: (performance.now() - t0) / 1000,
    observer: newObserver(manifest) };
  return loaded;
}

async function partialImage(decoder, tokens, n) {
  const fill = tokens.length ? tokens[tokens.length - 1] : 0;
  return decoder.decode(tokens.concat(Array(n - tokens.length).fill(fill)));
}

async function run({ key, prompt, seed, previews = true, policy = "adaptive" }) {
  const m = await model(key);
  const url = `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}`;
  const conn = new DeviceConnection(url, key, m.manifest.vocab_size);
  const n = m.manifest.num_tokens;
  let drawing = Promise.resolve();
  const every = Math.max(1, Math.ceil(n / MAX_PREVIEWS));
  let shown = -every; // tokens decided at the last preview
  postMessage({ type: "status", text: "Opening the session with the cloud…" });
  try {
    const result = await generate(m.rt, conn, prompt, seed, {
      policy, observer: m.observer,
      onProgress: (tokens, who, stats) => { // previews are decoded in turn, after the step that made them
        if (!previews || tokens.length >= n || tokens.length - shown < every) return;
        shown = tokens.length;
        drawing = drawing.then(async () => postMessage({ type: "progress", tokens, who, stats, total: n,
          shape: m.manifest.image.shape, rgb: await partialImage(m.decoder, tokens, n) }));
      },
    });
    await drawing;
    const rgb = await m.decoder.decode(result.tokens);
    postMessage({ type: "result", ...result, rgb, policy, model: { load_s: m.loadS,
      backend: "onnxruntime-web (WebAssembly)", shape: m.manifest.image.shape, reconnects: conn.reconnects } });
  } finally {
    conn.disconnect();
  }
}

let busy = Promise.resolve();
onmessage = (e) => {
  if (e.data.type !== "generate") return;
  busy = busy.then(() => run(e.data)).catch((err) => postMessage({ type: "error", message: err.message || String(err) }));
};
