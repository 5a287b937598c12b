// The page's modules (web/src) under node, for the tests that hold them against the Python side
// (tests/device/test_web_*.py) and for running the browser device's loop without a browser:
//
//   node web/test/harness.mjs maths    < cases.json    # {"calls": [{"fn": "lowerScore", "args": [...]}, ...]} -> results
//   node web/test/harness.mjs policy   < cases.json    # {"calls": [{"fn": "choose", "costs": {...}, ...}]} -> results
//        # (the cost model's functions on Costs given by their Python field names, and "observer": a CostObserver
//        # run through a script of updates and decisions, its state after each; see policyCall)
//   node web/test/harness.mjs encode   < frames.json   # {"frames": [{type, requestId, token, body}]} -> hex frames
//   node web/test/harness.mjs decode   < frames.json   # {"frames": ["hex", ...]} -> decoded frames (or their errors)
//   node --experimental-websocket web/test/harness.mjs serve   # many calls, one JSON line each way (below)
//   node --experimental-websocket web/test/harness.mjs generate < job.json
//        # {"url", "key", "model_dir", "jobs": [{"prompt", "seed", "session_id"?, "options"?}], "options"?, "cuts"?,
//        #  "vanish_after"?} -> one result per job, the connection's exchanges, reconnects, resumes and handshake
//        # time, and its cost observer's state. The jobs run in turn on one connection with one CostObserver (a
//        # device's images); a job's options go over the run's (loop.js's generate options: policy, span, burst,
//        # prefixRate, cloudStepPriceS, tau, ...). cuts: the VERIFY requests (counted from 1 over the run) whose socket is closed right after the frame is sent (a reply lost in
//        # flight); vanish_after: after that many VERIFY requests the server becomes unreachable.
//
// JSON carries typed arrays as plain arrays, float16 bits as integers, BigInts as numbers; the strings "Infinity",
// "-Infinity" and "NaN" in the input are those numbers (null in an array argument: -Infinity, a masked logit).

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import * as M from "../src/maths.js";
import * as P from "../src/policy.js";
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
      if (fn === "sampleMany") { // [q, seed, n]: the draws of positions 0 .. n - 1
        const [q, seed, n] = args, qf = Float32Array.from(q);
        return Array.from({ length: n }, (_, i) => M.sample(qf, M.uniform(seed, M.DRAFT_STREAM, i)));
      }
      if (fn === "uniforms") { // [[seed (a decimal string), stream (a decimal string), position], ...]
        return args[0].map(([seed, stream, position]) => M.uniform(BigInt(seed), BigInt(stream), position));
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

// ------------------------------------------------------------------------------------------- policy
const camel = (k) => k.replace(/_([a-zA-Z])/g, (_, c) => c.toUpperCase()); // device_step_s -> deviceStepS
const costsOf = (c) => new P.Costs(Object.fromEntries(Object.entries(c).map(([k, v]) => [camel(k), v])));
const pointOf = (p) => (p === "cloud-only" ? P.CLOUD_ONLY : P.operatingPoint(p[0], p[1]));
const pointOut = (p) => (p.cloudOnly ? "cloud-only" : [p.span, p.burst]);
const decisionOut = (d) => ({ point: pointOut(d.point), seconds: d.outlook.seconds, cloud_steps: d.outlook.cloudSteps,
  objective_s: d.objectiveS });
const hintOf = (h) => (h ? P.costHint(h.span_s ?? null, h.step_s ?? null, h.queue_s ?? null) : null);

/** A CostObserver's state, under the names test_web_policy.py's Python twin gives it. */
function observerState(o) {
  return { ready: o.ready, primed: o.primed, link_samples: o.link.samples, latency_s: o.link.latencyS,
    bandwidth_Bps: o.link.bandwidthBps, cloud_steps: o.cloud.steps(), cloud_samples: o.cloud.samples,
    queue_s: o.queue.value, verifier_s: o.verifier.value, device_step_s: o.deviceStep.value,
    escalation: o.escalation.value, escalation_observed: o.escalation.observed, accept_first: o.acceptFirst.value,
    accept_next: o.acceptNext.value, streak: o.cloudOnlyStreak, explore_after: o.exploreAfter, exploring: o.exploring };
}

function observerRun({ init = {}, ops }) {
  const o = new P.CostObserver({ weight: init.weight ?? 0.2, rates: init.rates ?? null, decay: init.decay ?? 0.998 });
  return ops.map((op) => {
    const out = {};
    if (op.op === "prime") {
      o.prime({ latencyS: op.latency_s ?? null, deviceStepS: op.device_step_s ?? null, hint: hintOf(op.hint) });
    } else if (op.op === "exchange") {
      o.observeExchange(op.up, op.down, op.link_s, op.cloud_s, op.passes, op.queue_s, op.verify, op.tokens ?? null);
    } else if (op.op === "verdict") {
      o.observeVerdict(op.span, op.accepted);
    } else if (op.op === "escalation") {
      o.escalation.observe(op.x);
    } else if (op.op === "device_step") {
      o.deviceStep.update(op.s);
    } else if (op.op === "decide") {
      const costs = o.costs(op.vocab, { hiddenDim: op.hidden ?? 0, featureDim: op.feature ?? 0,
        deviceStepS: op.device_step_s ?? null });
      out.costs = { ...costs };
      Object.assign(out, decisionOut(o.decide(costs, pointOf(op.calibrated), op.remaining,
        { cloudStepPriceS: op.price ?? 0, spans: op.spans ?? null })));
    } else {
      throw new Error(`unknown observer op ${op.op}`);
    }
    return { ...out, state: observerState(o) };
  });
}

/** One call of the cost model; keyword arguments under their Python names. */
function policyCall(c) {
  const kw = { pending: c.pending ?? 0, atOpen: c.at_open ?? false };
  switch (c.fn) {
    case "expectedCost": {
      const o = P.expectedCost(costsOf(c.costs), pointOf(c.point), c.remaining, kw);
      return { seconds: o.seconds, cloud_steps: o.cloudSteps };
    }
    case "choose":
      return decisionOut(P.choose(costsOf(c.costs), pointOf(c.calibrated), c.remaining, { ...kw, margin: c.margin ?? 0,
        cloudStepPriceS: c.price ?? 0, spans: c.spans ?? P.SPANS, bursts: c.bursts ?? P.BURSTS }));
    case "requestBytes": return P.requestBytes(costsOf(c.costs), c.span, c.pending);
    case "replyBytes": return P.replyBytes(costsOf(c.costs), c.tokens);
    case "pendingPerExchange": return costsOf(c.costs).pendingPerExchange;
    case "candidateSpans": return P.candidateSpans(c.k);
    case "allowedPoints":
      return P.allowedPoints(pointOf(c.calibrated), c.spans ?? P.SPANS, c.bursts ?? P.BURSTS).map(pointOut);
    case "verifyFrame": { // the byte formula against the frame encodeFrame makes with those shapes (the policy's id)
      const { V, m, k, hidden_dim: h, feature_dim: f } = c;
      const body = { session_id: "s".repeat(P.SESSION_ID_BYTES), vocab_size: V, new_tokens: Array(m).fill(V - 1),
        draft_tokens: Array(k).fill(V - 1), draft_probs: new Uint16Array(k * V), burst: 2, burst_entropy: 0.5,
        device_hidden: h === null ? null : { dim: h, bits: new Uint16Array(m * h) },
        features: f === null ? null : { dim: f, bits: new Uint16Array(m * f) } };
      return { formula: W.verifyRequestBytes(V, m, k, { hiddenDim: h, featureDim: f }),
        encoded: W.encodeFrame({ type: W.VERIFY, requestId: 1, body, token: new Uint8Array(W.TOKEN_BYTES) }).length };
    }
    case "verifyReplyBytes": return W.verifyReplyBytes(c.V, c.burst);
    case "observer": return observerRun(c);
    default: throw new Error(`unknown policy function ${c.fn}`);
  }
}

/** Numbers JSON cannot carry (an infinite bandwidth) as the strings the input uses for them. */
function finite(v) {
  if (typeof v === "number") return Number.isFinite(v) ? v : String(v);
  if (Array.isArray(v)) return v.map(finite);
  if (v && typeof v === "object") return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, finite(x)]));
  return v;
}

function policy(input) {
  return input.calls.map((c) => {
    try {
      return finite(policyCall(c));
    } catch (err) {
      return { error: err.message };
    }
  });
}

// ------------------------------------------------------------------------------------------- wire
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

const RUNTIMES = new Map();

async function generate(input) {
  const ort = await import(join(ORT_DIST, "ort.wasm.min.mjs"));
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = ORT_DIST + "/";
  ort.env.logLevel = "error";
  const { DeviceRuntime } = await import("../src/runtime.js");
  const { DeviceConnection } = await import("../src/connection.js");
  const { generate: run, newObserver } = await import("../src/loop.js");
  const manifestText = readFileSync(join(input.model_dir, "manifest.json"), "utf-8");
  const manifest = JSON.parse(manifestText);
  const runtimeKey = `${input.model_dir}\n${manifestText}`; // one runtime per export, kept across `serve` calls
  if (!RUNTIMES.has(runtimeKey)) {
    const graphs = {};
    for (const key of ["device_prefill", "device_step"]) graphs[key] = readFileSync(join(input.model_dir, manifest.graphs[key].file));
    RUNTIMES.set(runtimeKey, await DeviceRuntime.create(ort, manifest, graphs));
  }
  const rt = RUNTIMES.get(runtimeKey);
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
  const observer = newObserver(manifest), results = [];
  for (const job of input.jobs) {
    try {
      const r = await run(rt, conn, job.prompt, job.seed, { ...(input.options || {}), ...(job.options || {}), observer,
        sessionId: job.session_id });
      results.push(r);
    } catch (err) {
      results.push({ error: `${err.name}: ${err.message}`, status: err.status ?? null, code: err.code ?? null });
    }
  }
  conn.disconnect();
  return { results, exchanges: conn.exchanges, reconnects: conn.reconnects, resumes: conn.resumes,
    handshake_s: conn.handshakeS, observer: finite(observerState(observer)) };
}

const commands = { maths, policy, encode, decode, generate };
const cmd = process.argv[2];
const SPECIAL = { Infinity, "-Infinity": -Infinity, NaN };
const parse = (text) => JSON.parse(text, (_, v) => (typeof v === "string" && v in SPECIAL ? SPECIAL[v] : v));
if (cmd === "serve") {
  // one process for many calls (the tests' node fixture): a line {"command", "input"} in, a line {"output"} or
  // {"error"} out, in order; node's start-up and onnxruntime-web's import are paid once
  const { createInterface } = await import("node:readline");
  for await (const line of createInterface({ input: process.stdin, crlfDelay: Infinity })) {
    if (!line.trim()) continue;
    let answer;
    try {
      const { command, input } = parse(line);
      if (!(command in commands)) throw new Error(`unknown command ${command}`);
      answer = { output: await commands[command](input) };
    } catch (err) {
      answer = { error: `${err.name}: ${err.message}\n${err.stack || ""}` };
    }
    await new Promise((done) => process.stdout.write(JSON.stringify(answer, plain) + "\n", done));
  }
  process.exit(0);
}
if (!(cmd in commands)) {
  process.stderr.write(`usage: node web/test/harness.mjs {${Object.keys(commands).join("|")}|serve} < input.json\n`);
  process.exit(2);
}
const output = await commands[cmd](parse(readFileSync(0, "utf-8")));
process.stdout.write(JSON.stringify(output, plain), () => process.exit(0)); // exit once the pipe took it all
