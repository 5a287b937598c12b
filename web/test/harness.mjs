// The page's modules (web/src) under node, for the tests that hold them against the Python side
// (tests/client/test_web_*.py) and for running the browser device's loop without a browser:
//
//   node web/test/harness.mjs maths    < cases.json    # {"calls": [{"fn": "lowerScore", "args": [...]}, ...]} -> results
//   node web/test/harness.mjs encode   < frames.json   # {"frames": [{type, requestId, token, body}]} -> hex frames
//   node web/test/harness.mjs decode   < frames.json   # {"frames": ["hex", ...]} -> decoded frames (or their errors)
//   node --experimental-websocket web/test/harness.mjs generate < job.json
//        # {"url", "key", "model_dir", "jobs": [{"prompt", "seed", "session_id"?}], "options"?, "cuts"?, "vanish_after"?}
//        # -> one result per job, the connection's exchanges, reconnects and resumes. cuts: the VERIFY requests
//        # (counted from 1 over the run) whose socket is closed right after the frame is sent (a reply lost in
//        # flight); vanish_after: after that many VERIFY requests the server becomes unreachable.
//
// JSON carries typed arrays as plain arrays, float16 bits as integers, BigInts as numbers; the strings "Infinity",
// "-Infinity" and "NaN" in the input are those numbers (null in an array argument: -Infinity, a masked logit).

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import * as M from "../src/maths.js";
import * as W from "../src/wire.js";

const HERE = dirname(fileURLToPath(import.meta.url));
const ORT_DIST = join(HERE, "..", "node_modules", "onnxruntime-web", "dist");

const plain = (_, v) => (ArrayBuffer.isView(v) ? Array.from(v, Number) : typeof v === "bigint" ? Number(v) : v);
const hex = (b) => Buffer.from(b).toString("hex");


function typed(args) {
  return args.map((a) => (Array.isArray(a) ? Float32Array.from(a, (v) => (v === null ? -Infinity : v)) : a));
}

function maths(input) {
  return input.calls.map(({ fn, args }) => {
    try {
      if (fn === "sampleMany") { // [q, seed, n]: n draws from one stream
        const [q, seed, n] = args, rng = new M.DeviceRandom(BigInt(seed));
        return Array.from({ length: n }, () => M.sample(Float32Array.from(q), rng));
      }
      if (fn === "quantizeDraft") {
        const { sent, used } = M.quantizeDraft(Float32Array.from(args[0]));
        return { sent: Array.from(sent), used: Array.from(used) };
      }
      if (fn === "gateScore") return M.gateScore(args[0], { ...args[1], center: args[1].center ? Float32Array.from(args[1].center) : null,
        radius: args[1].radius ? Float32Array.from(args[1].radius) : null, probs: args[1].probs ? Float32Array.from(args[1].probs) : null });
      const out = M[fn](...typed(args));
      return out;
    } catch (err) {
      return { error: err.message };
    }
  });
}

function toBytes(x) {
  return Array.isArray(x) ? Uint8Array.from(x) : x;
}

function encode(input) {
  return input.frames.map((f) => {
    try {
      const body = structuredClone(f.body);
      if (body.draft_probs) body.draft_probs = Uint16Array.from(body.draft_probs);
      for (const k of ["device_hidden", "features"]) if (body[k]) body[k].bits = Uint16Array.from(body[k].bits);
      if (body.injected) for (const k of ["hidden", "features"]) body.injected[k] = Uint16Array.from(body.injected[k]);
      return hex(W.encodeFrame({ type: f.type, requestId: f.requestId, body, token: f.token ? toBytes(f.token) : null }));
    } catch (err) {
      return { error: err.message, field: err.field ?? null };
    }
  });
}

function decode(input) {
  return input.frames.map((h) => {
    try {
      return W.decodeFrame(Uint8Array.from(Buffer.from(h, "hex")));
    } catch (err) {
      return { error: err.message, field: err.field ?? null };
    }
  });
}

async function generate(input) {
  const ort = await import(join(ORT_DIST, "ort.wasm.min.mjs"));
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = ORT_DIST + "/";
  ort.env.logLevel = "error";
  const { DeviceRuntime } = await import("../src/runtime.js");
  const { DeviceConnection } = await import("../src/connection.js");
  const { generate: run } = await import("../src/loop.js");
  const manifest = JSON.parse(readFileSync(join(input.model_dir, "manifest.json"), "utf-8"));
  const graphs = {};
  for (const key of ["device_prefill", "device_step"]) graphs[key] = readFileSync(join(input.model_dir, manifest.graphs[key].file));
  const rt = await DeviceRuntime.create(ort, manifest, graphs);
  const conn = new DeviceConnection(input.url, input.key, manifest.vocab_size, { backoffMs: 50, retries: 3 });
  const cuts = new Set(input.cuts || []), vanishAfter = input.vanish_after ?? Infinity;
  let verifies = 0;
  const exchange = conn.exchange.bind(conn);
  conn.exchange = async (type, body, token) => { // the test's faults, on the real socket
    if (type === W.VERIFY && ++verifies > vanishAfter) {
      conn.url = "ws://127.0.0.1:1/v1/device/sessions";
      conn.disconnect();
    } else if (type === W.VERIFY && cuts.has(verifies)) {
      await conn.connect();
      const ws = conn.ws, send = ws.send.bind(ws);
      ws.send = (data) => { send(data); ws.close(); };
    }
    return exchange(type, body, token);
  };
  const results = [];
  for (const job of input.jobs) {
    try {
      const r = await run(rt, conn, job.prompt, job.seed, { ...(input.options || {}), sessionId: job.session_id });
      results.push(r);
    } catch (err) {
      results.push({ error: `${err.name}: ${err.message}`, status: err.status ?? null, code: err.code ?? null });
    }
  }
  conn.disconnect();
  return { results, exchanges: conn.exchanges, reconnects: conn.reconnects, resumes: conn.resumes };
}

const commands = { maths, encode, decode, generate };
const cmd = process.argv[2];
if (!(cmd in commands)) {
  process.stderr.write(`usage: node web/test/harness.mjs {${Object.keys(commands).join("|")}} < input.json\n`);
  process.exit(2);
}
const SPECIAL = { Infinity, "-Infinity": -Infinity, NaN };
const input = JSON.parse(readFileSync(0, "utf-8"), (_, v) => (typeof v === "string" && v in SPECIAL ? SPECIAL[v] : v));
const output = await commands[cmd](input);
process.stdout.write(JSON.stringify(output, plain), () => process.exit(0)); // exit once the pipe took it all
