// The device <-> cloud wire format in the page: the frames of `ciar_device.wire` (the protocol's one definition,
// whose module docstring lays every body out), for the messages a device sends (HELLO, OPEN, VERIFY, RESUME, CLOSE)
// and the ones it receives (WELCOME, OPEN_REPLY, VERIFY_REPLY, CLOSED, ERROR). Tested against the Python codec both
// ways on the same messages (tests/device/test_web_wire.py, through node): Python decodes what this encodes, and
// this decodes what Python encodes, field for field.
//
//   const bytes = encodeFrame({ type: VERIFY, requestId: 7, token, body: { session_id, vocab_size, new_tokens, ... } });
//   const frame = decodeFrame(arrayBuffer);   // { type, name, requestId, token, body }; WireError when malformed
//   verifyRequestBytes(V, m, k, { hiddenDim, featureDim });   // a VERIFY frame's size from its shapes (policy.js)
//
// Token ids travel bit-packed at ceil(log2 V) bits each (little-endian bit order); float16 arrays travel as their
// bits (Uint16Array here: the device quantises with maths.toFloat16Array, exactly as numpy does).

export const PROTOCOL_VERSION = 5;
export const HEADER_BYTES = 8;
export const TOKEN_BYTES = 32;
export const [HELLO, WELCOME, OPEN, OPEN_REPLY, VERIFY, VERIFY_REPLY, RESUME, CLOSE, CLOSED, ERROR] =
  [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
export const TYPE_NAMES = { 1: "HELLO", 2: "WELCOME", 3: "OPEN", 4: "OPEN_REPLY", 5: "VERIFY", 6: "VERIFY_REPLY",
  7: "RESUME", 8: "CLOSE", 9: "CLOSED", 10: "ERROR" };
export const RULES = ["exact", "lantern", "greedy", "cascade", "gsd"];
// WebSocket close codes of the device endpoint that end a connection for good (a new one would be refused too)
export const CLOSE_POLICY = 1008, CLOSE_TOO_BIG = 1009, CLOSE_OVERLOADED = 1013;
export const CLOSE_PROTOCOL = 4000, CLOSE_UNAUTHORIZED = 4001, CLOSE_VERSION = 4002;
export const FATAL_CLOSES = [CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_PROTOCOL, CLOSE_UNAUTHORIZED, CLOSE_VERSION];

export class WireError extends Error {
  constructor(message, field = null) {
    super(message);
    this.name = "WireError";
    this.field = field;
  }
}

/** Bits per token id of a V-entry vocabulary: ceil(log2 V), at least 1. */
export function tokenBits(vocabSize) {
  return Math.max(1, Math.ceil(Math.log2(Math.max(2, vocabSize))));
}

const utf8 = new TextEncoder();
const fromUtf8 = new TextDecoder("utf-8", { fatal: true });

/** Bytes of a VERIFY frame (`VerifyRequest.nbytes`, what encodeFrame makes) with m new tokens and k drafts of a
 *  V-entry vocabulary, the new tokens' hidden values and features when their widths are given (0 is a width: the
 *  array goes, empty), and a session id of `sessionIdBytes` UTF-8 bytes. Shapes only: the cost model's sizes
 *  (policy.js) without building a message. */
export function verifyRequestBytes(V, m, k, { hiddenDim = null, featureDim = null, sessionIdBytes = 32 } = {}) {
  let n = HEADER_BYTES + 1 + sessionIdBytes + TOKEN_BYTES + 4 + 2 + 2 + Math.ceil(((m + k) * tokenBits(V)) / 8);
  n += 2 * k * V + 1;
  if (hiddenDim !== null) n += 2 + 2 * m * hiddenDim;
  if (featureDim !== null) n += 2 + 2 * m * featureDim;
  return n + 2 + 8;
}

/** Bytes of a VERIFY_REPLY frame (`VerifyReply.nbytes`) carrying `burst` burst tokens of a V-entry vocabulary. */
export function verifyReplyBytes(V, burst, { sessionIdBytes = 32 } = {}) {
  return HEADER_BYTES + 1 + sessionIdBytes + 2 + 4 + 1 + 8 + 8 + 2 + 2 + 4 + 2 + Math.ceil((burst * tokenBits(V)) / 8);
}

class Writer {
  constructor() {
    this.buf = new Uint8Array(256);
    this.view = new DataView(this.buf.buffer);
    this.n = 0;
  }

  room(k) {
    if (this.n + k <= this.buf.length) return;
    const grown = new Uint8Array(Math.max(2 * this.buf.length, this.n + k));
    grown.set(this.buf.subarray(0, this.n));
    this.buf = grown;
    this.view = new DataView(grown.buffer);
  }

  u8(v) { this.room(1); this.view.setUint8(this.n, v); this.n += 1; }
  u16(v, what) { this.check(v, 0xffff, what); this.room(2); this.view.setUint16(this.n, v, true); this.n += 2; }
  u32(v, what) { this.check(v, 0xffffffff, what); this.room(4); this.view.setUint32(this.n, v, true); this.n += 4; }
  i64(v) { this.room(8); this.view.setBigInt64(this.n, BigInt(v), true); this.n += 8; }
  f64(v) { this.room(8); this.view.setFloat64(this.n, v, true); this.n += 8; }

  check(v, limit, what) {
    if (!Number.isInteger(v) || v < 0 || v > limit) throw new WireError(`${what}: ${v} is out of range for the wire`, what);
  }

  bytes(b) { this.room(b.length); this.buf.set(b, this.n); this.n += b.length; }

  str(s, width, what) {
    const b = utf8.encode(s);
    if (b.length >= 2 ** (8 * width)) throw new WireError(`${what} of ${b.length} bytes is too long for the wire`, what);
    if (width === 1) this.u8(b.length); else this.u16(b.length, what);
    this.bytes(b);
  }

  tokens(ids, vocabSize, what) {
    const bits = tokenBits(vocabSize), out = new Uint8Array(Math.ceil((ids.length * bits) / 8));
    for (let i = 0; i < ids.length; i++) {
      const t = Number(ids[i]);
      if (!Number.isInteger(t) || t < 0 || t >= vocabSize) throw new WireError(`${what}: token ids must be in [0, ${vocabSize})`, what);
      for (let j = 0; j < bits; j++) if ((t >>> j) & 1) { const p = i * bits + j; out[p >> 3] |= 1 << (p & 7); }
    }
    this.bytes(out);
  }

  f16(bits) { // Uint16Array of float16 bits
    this.room(2 * bits.length);
    for (let i = 0; i < bits.length; i++) this.view.setUint16(this.n + 2 * i, bits[i], true);
    this.n += 2 * bits.length;
  }

  token(token) {
    if (token && token.length && token.length !== TOKEN_BYTES) throw new WireError(`a session token has ${TOKEN_BYTES} bytes, got ${token.length}`, "token");
    this.bytes(token && token.length ? token : new Uint8Array(TOKEN_BYTES));
  }

  done() { return this.buf.slice(0, this.n); }
}

function openBody(w, r) {
  const s = r.sampling, rule = r.rule || {};
  const ruleIndex = RULES.indexOf(rule.rule || "exact");
  if (ruleIndex < 0) throw new WireError(`unknown acceptance rule ${rule.rule}`, "rule");
  w.str(r.session_id, 1, "session_id");
  w.i64(r.seed);
  w.f64(s.cfg_scale); w.f64(s.temperature); w.u32(s.top_k, "top_k"); w.f64(s.top_p);
  w.u16(r.prefix_len, "prefix_len"); w.u16(r.jacobi_window ?? 0, "jacobi_window"); w.u8(ruleIndex); w.u32(rule.lantern_k ?? 1000, "lantern_k");
  w.f64(rule.lantern_delta ?? 0.15); w.f64(rule.cascade_threshold ?? 0.9);
  w.u16(rule.gsd_ranks ?? 7, "gsd_ranks"); w.f64(rule.gsd_prob_gap ?? 0.15); w.f64(rule.gsd_distance ?? 0.5);
  w.u8(r.want_caption ? 1 : 0);
  w.str(r.prompt, 2, "prompt");
}

/** A frame { type, requestId, body, token } -> Uint8Array. Bodies use the Python field names:
 *  HELLO { key, client }; OPEN { session_id, prompt, seed, sampling, prefix_len, jacobi_window?, rule?,
 *  want_caption };
 *  VERIFY { session_id, vocab_size, new_tokens, draft_tokens, draft_probs (Uint16Array [k * V] float16 bits),
 *  device_hidden?, features? ({ dim, bits }), burst, burst_entropy };
 *  RESUME { request (an OPEN body), vocab_size, history, injected? { positions, hidden_dim, hidden, feature_dim,
 *  features } }; CLOSE { session_id }. */
export function encodeFrame({ type, requestId, body, token = null }) {
  const w = new Writer();
  w.bytes(new Uint8Array([0x43, 0x49, PROTOCOL_VERSION, type]));
  w.u32(requestId, "request_id");
  if (type === HELLO) {
    w.str(body.key, 2, "key");
    w.str(body.client || "", 1, "client");
  } else if (type === OPEN) {
    openBody(w, body);
  } else if (type === VERIFY) {
    const V = body.vocab_size, m = body.new_tokens.length, k = body.draft_tokens.length;
    if (body.draft_probs.length !== k * V) throw new WireError(`draft_probs must be [${k}, ${V}]`, "draft_probs");
    w.str(body.session_id, 1, "session_id");
    w.token(token);
    w.u32(V, "vocab_size"); w.u16(m, "new_tokens"); w.u16(k, "draft_tokens");
    w.tokens([...body.new_tokens, ...body.draft_tokens], V, "tokens");
    w.f16(body.draft_probs);
    const h = body.device_hidden || null, f = body.features || null;
    w.u8((h ? 1 : 0) | (f ? 2 : 0));
    for (const [name, a] of [["device_hidden", h], ["features", f]]) {
      if (!a) continue;
      if (a.bits.length !== m * a.dim) throw new WireError(`${name} must be [${m}, ${a.dim}]`, name);
      w.u16(a.dim, name);
      w.f16(a.bits);
    }
    w.u16(body.burst || 0, "burst"); w.f64(body.burst_entropy || 0);
  } else if (type === RESUME) {
    const V = body.vocab_size, inj = body.injected || null;
    openBody(w, body.request);
    w.token(token);
    w.u32(V, "vocab_size"); w.u16(body.history.length, "history");
    w.tokens(body.history, V, "history");
    const n = inj ? inj.positions.length : 0;
    w.u16(n, "injected");
    if (n) {
      for (const p of inj.positions) w.u16(p, "positions");
      w.u16(inj.hidden_dim, "device_hidden"); w.u16(inj.feature_dim, "features");
      w.f16(inj.hidden); w.f16(inj.features);
    }
  } else if (type === CLOSE) {
    w.str(body.session_id, 1, "session_id");
    w.token(token);
  } else {
    throw new WireError(`a device does not send ${TYPE_NAMES[type] || type} frames`, "type");
  }
  return w.done();
}

class Reader {
  constructor(data) {
    this.bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
    this.view = new DataView(this.bytes.buffer, this.bytes.byteOffset, this.bytes.byteLength);
    this.pos = 0;
  }

  take(n, what) {
    if (n < 0 || this.pos + n > this.bytes.length) throw new WireError(`truncated frame: ${what} needs ${n} bytes, ${this.bytes.length - this.pos} left`, what);
    const p = this.pos;
    this.pos += n;
    return p;
  }

  u8(what) { return this.view.getUint8(this.take(1, what)); }
  u16(what) { return this.view.getUint16(this.take(2, what), true); }
  u32(what) { return this.view.getUint32(this.take(4, what), true); }
  f64(what) { return this.view.getFloat64(this.take(8, what), true); }

  str(width, what) {
    const n = width === 1 ? this.u8(what) : this.u16(what);
    const p = this.take(n, what);
    try {
      return fromUtf8.decode(this.bytes.subarray(p, p + n));
    } catch {
      throw new WireError(`${what} is not valid UTF-8`, what);
    }
  }

  tokens(n, vocabSize, what) {
    const bits = tokenBits(vocabSize), p = this.take(Math.ceil((n * bits) / 8), what), out = new Array(n);
    for (let i = 0; i < n; i++) {
      let t = 0;
      for (let j = 0; j < bits; j++) { const b = i * bits + j; t += ((this.bytes[p + (b >> 3)] >> (b & 7)) & 1) * 2 ** j; }
      if (t >= vocabSize) throw new WireError(`${what}: token ids must be in [0, ${vocabSize})`, what);
      out[i] = t;
    }
    return out;
  }

  f16(n, what) {
    const p = this.take(2 * n, what), out = new Uint16Array(n);
    for (let i = 0; i < n; i++) out[i] = this.view.getUint16(p + 2 * i, true);
    return out;
  }

  token() { const p = this.take(TOKEN_BYTES, "token"); return this.bytes.slice(p, p + TOKEN_BYTES); }
}

function checkVocab(v) {
  if (!(v >= 2 && v <= 2 ** 24)) throw new WireError(`vocabulary size ${v} out of range [2, 2^24]`, "vocab_size");
}

/** ArrayBuffer / Uint8Array -> { type, name, requestId, token, body } of a frame a device receives (WireError on
 *  anything malformed or another protocol version). Float16 arrays come back as their bits (Uint16Array). */
export function decodeFrame(data) {
  const r = new Reader(data);
  if (r.bytes.length < HEADER_BYTES) throw new WireError(`truncated frame: ${r.bytes.length} bytes, the header alone has ${HEADER_BYTES}`, "header");
  if (r.bytes[0] !== 0x43 || r.bytes[1] !== 0x49) throw new WireError("not a CIAR frame (bad magic)", "header");
  const version = r.bytes[2], type = r.bytes[3];
  if (version !== PROTOCOL_VERSION) throw new WireError(`unsupported protocol version ${version}: this side speaks version ${PROTOCOL_VERSION}`, "version");
  r.pos = 4;
  const requestId = r.u32("header");
  let body, token = null;
  if (type === WELCOME) {
    body = { device_id: r.str(1, "device_id"), max_frame_bytes: r.u32("welcome"), max_sessions: r.u16("welcome"),
      messages_per_s: r.f64("welcome"), idle_timeout_s: r.f64("welcome") };
    body.server = r.str(1, "server");
    body.verify_s = r.f64("welcome"); body.step_s = r.f64("welcome"); body.queue_s = r.f64("welcome");
  } else if (type === OPEN_REPLY) {
    const sid = r.str(1, "session_id");
    token = r.token();
    const V = r.u32("open_reply"), p = r.u16("open_reply");
    checkVocab(V);
    body = { session_id: sid, vocab_size: V, prefix_tokens: r.tokens(p, V, "prefix_tokens"),
      cloud_s: r.f64("open_reply"), queue_s: r.f64("open_reply"), forward_passes: r.u32("open_reply"),
      caption_emb: null, caption_mask: null };
    if (r.u8("open_reply")) {
      const L = r.u16("caption"), D = r.u16("caption");
      body.caption_shape = [L, D];
      body.caption_emb = r.f16(L * D, "caption_emb");
      const q = r.take(Math.ceil(L / 8), "caption_mask");
      body.caption_mask = Array.from({ length: L }, (_, i) => ((r.bytes[q + (i >> 3)] >> (i & 7)) & 1) === 1);
    }
  } else if (type === VERIFY_REPLY) {
    body = { session_id: r.str(1, "session_id"), num_accepted: r.u16("verify_reply"), next_token: r.u32("verify_reply") };
    const flags = r.u8("verify_reply");
    Object.assign(body, { recovered: (flags & 1) !== 0, resumed: (flags & 2) !== 0, cloud_s: r.f64("verify_reply"),
      queue_s: r.f64("verify_reply"), batch_size: r.u16("verify_reply"), forward_passes: r.u16("verify_reply"), vocab_size: r.u32("verify_reply") });
    const g = r.u16("verify_reply");
    if (g) checkVocab(body.vocab_size);
    body.burst_tokens = g ? r.tokens(g, body.vocab_size, "burst_tokens") : [];
  } else if (type === CLOSED) {
    body = { session_id: r.str(1, "session_id") };
  } else if (type === ERROR) {
    body = { status: r.u16("error"), retry_after_s: r.f64("error"), session_id: r.str(1, "session_id"),
      field: r.str(1, "field") };
    body.message = r.str(2, "message");
  } else {
    throw new WireError(`a device does not receive ${TYPE_NAMES[type] ? TYPE_NAMES[type] + " frames" : "frame type " + type}`, "type");
  }
  if (r.pos !== r.bytes.length) throw new WireError(`${r.bytes.length - r.pos} trailing bytes after a ${TYPE_NAMES[type]} frame`, "body");
  return { type, name: TYPE_NAMES[type], requestId, token, body };
}
