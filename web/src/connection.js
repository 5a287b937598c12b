// The page's connection to the device endpoint (ws://HOST/v1/device/sessions): the frames of wire.js on a
// WebSocket, with reconnection and resumption, as `ciar_device.connection.DeviceConnection` does for the Python
// client.
//
//   const conn = new DeviceConnection("ws://localhost:8000", "ciar-dev-device-key", 1024);
//   const reply = await conn.open(openRequest);      // -> the OPEN_REPLY body
//   const rep = await conn.verify(verifyRequest);    // -> the VERIFY_REPLY body
//   await conn.close(sessionId);
//   conn.exchanges                                    // [{ kind, up, down, ms }] per request/reply, as the socket saw it
//   await conn.costHint()                             // the WELCOME's verifier costs (connects); conn.handshakeS
//
// One request at a time (the device loop waits for each reply). The connection starts with HELLO (the device key:
// browsers cannot set headers on a WebSocket, the protocol does not need them) and expects WELCOME. Resumption: per
// open session it keeps the OPEN request, the session token and the committed tokens both sides agree on, with the
// interval features sent along the way; when the socket drops it reconnects (backoff, `retries` attempts) and, for a
// verify that was in flight or a 410 (the verifier lost the session), re-creates the session from that history
// (RESUME) and sends the request again, up to LOST_RETRIES times a request (the replica it was resumed on may be
// lost in turn; the same image: docs/architecture.md, Determinism). An OPEN or a
// CLOSE whose reply was lost is sent again as it is (the verifier answers a repeated OPEN as the first; closing a
// session it does not hold does nothing). The retry semantics of every message: docs/architecture.md §5.

import { costHint } from "./policy.js";
import { CLOSE, ERROR, FATAL_CLOSES, HELLO, OPEN, RESUME, TYPE_NAMES, VERIFY, WELCOME, decodeFrame, encodeFrame } from "./wire.js";

export const DEFAULT_PATH = "/v1/device/sessions";
// a verify whose session the verifier lost (410) is resumed and sent again up to this many times
export const LOST_RETRIES = 3;

export class ServerError extends Error {
  constructor({ status, message, field = "", retry_after_s = 0 }) {
    super(`${status}: ${message}${field ? ` (field ${field})` : ""}`);
    this.name = "ServerError";
    Object.assign(this, { status, field, retryAfterS: retry_after_s });
  }
}

/** The server closed the connection for good (unknown key, another protocol version, a policy). */
export class ConnectionRefused extends Error {
  constructor(code, reason) {
    super(`connection closed by the server (${code}): ${reason}`);
    this.name = "ConnectionRefused";
    Object.assign(this, { code, reason });
  }
}

/** The cloud cannot be reached after the retries: the device loop may finish the image alone. */
export class Unreachable extends Error {
  constructor(message) {
    super(message);
    this.name = "Unreachable";
  }
}

class Dropped extends Error {}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** A session as the device knows it: enough to re-create it on a verifier (`ciar_device.history.SessionHistory`). */
class SessionHistory {
  constructor(request, token, tokens) {
    this.request = { ...request, want_caption: false };
    this.token = token;
    this.tokens = [...tokens];
    this.positions = [];
    this.hidden = [];
    this.features = [];
  }

  commit(req, rep) {
    const m = req.new_tokens.length;
    if (req.device_hidden && req.features && m) {
      for (let i = 0; i < m; i++) this.positions.push(this.tokens.length + i);
      this.hidden.push(req.device_hidden);
      this.features.push(req.features);
    }
    this.tokens.push(...req.new_tokens, ...req.draft_tokens.slice(0, rep.num_accepted), rep.next_token,
      ...rep.burst_tokens);
  }

  resumeBody(vocabSize) {
    const concat = (parts) => {
      const out = new Uint16Array(parts.reduce((n, p) => n + p.bits.length, 0));
      let o = 0;
      for (const p of parts) { out.set(p.bits, o); o += p.bits.length; }
      return out;
    };
    const injected = this.positions.length ? { positions: this.positions, hidden_dim: this.hidden[0].dim,
      hidden: concat(this.hidden), feature_dim: this.features[0].dim, features: concat(this.features) } : null;
    return { request: this.request, vocab_size: vocabSize, history: this.tokens, injected };
  }
}

export class DeviceConnection {
  /** url: ws(s)://HOST[:PORT] (the endpoint's path is added when missing) or the full endpoint URL. */
  constructor(url, key, vocabSize, { clientName = "ciar-web/0.1", retries = 6, backoffMs = 200, timeoutMs = 300000,
    WebSocketImpl = globalThis.WebSocket } = {}) {
    this.url = url.replace(/\/+$/, "").endsWith(DEFAULT_PATH) ? url : url.replace(/\/+$/, "") + DEFAULT_PATH;
    Object.assign(this, { key, vocabSize, clientName, retries, backoffMs, timeoutMs, WebSocketImpl });
    this.ws = null;
    this.welcome = null;
    this.handshakeS = null; // the last HELLO -> WELCOME round trip in seconds (the link's first sample)
    this.sessions = new Map();
    this.rid = 0;
    this.waiting = null; // { id, resolve, reject, timer } of the request in flight
    this.reconnects = 0;
    this.resumes = 0;
    this.exchanges = [];
  }

  // ------------------------------------------------------------------ the socket
  async connect() {
    if (this.ws !== null) return;
    const ws = new this.WebSocketImpl(this.url);
    ws.binaryType = "arraybuffer";
    let sent = 0;
    const welcome = await new Promise((resolve, reject) => {
      ws.onopen = () => {
        sent = performance.now();
        ws.send(encodeFrame({ type: HELLO, requestId: 0, body: { key: this.key, client: this.clientName } }));
      };
      ws.onmessage = (e) => {
        try {
          const f = decodeFrame(e.data);
          if (f.type === WELCOME) { this.handshakeS = (performance.now() - sent) / 1000; resolve(f.body); }
          else reject(new ConnectionRefused(4000, `expected WELCOME, got ${f.name}`));
        } catch (err) {
          reject(err);
        }
      };
      // a socket that never opened: browsers fire error then close, node's WebSocket only error
      ws.onerror = () => reject(new Dropped(`cannot connect to ${this.url}`));
      ws.onclose = (e) => reject(FATAL_CLOSES.includes(e.code) ? new ConnectionRefused(e.code, e.reason)
        : new Dropped(`cannot connect to ${this.url} (${e.code}${e.reason ? ": " + e.reason : ""})`));
    });
    ws.onmessage = (e) => this.received(e.data);
    const gone = (err) => {
      if (this.ws === ws) this.ws = null;
      const w = this.waiting;
      if (w !== null) {
        this.waiting = null;
        clearTimeout(w.timer);
        w.reject(err);
      }
    };
    ws.onerror = () => gone(new Dropped("connection error"));
    ws.onclose = (e) => gone(FATAL_CLOSES.includes(e.code) ? new ConnectionRefused(e.code, e.reason)
      : new Dropped(`connection closed (${e.code})`));
    if (this.welcome !== null) this.reconnects += 1;
    this.ws = ws;
    this.welcome = welcome;
  }

  received(data) {
    const w = this.waiting;
    let frame;
    try {
      frame = decodeFrame(data);
    } catch (err) {
      if (w !== null) { this.waiting = null; clearTimeout(w.timer); w.reject(err); }
      return;
    }
    if (w === null || frame.requestId !== w.id) return; // a late reply of a request given up on
    this.waiting = null;
    clearTimeout(w.timer);
    w.resolve({ frame, bytes: data.byteLength });
  }

  /** Close the socket (the sessions stay open on the verifier until closed or idle). */
  disconnect() {
    const ws = this.ws;
    this.ws = null;
    if (ws !== null) ws.close();
  }

  async exchange(type, body, token = null) {
    await this.connect();
    this.rid = (this.rid + 1) >>> 0;
    const id = this.rid, data = encodeFrame({ type, requestId: id, body, token });
    const t0 = performance.now();
    const { frame, bytes } = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting = null;
        this.disconnect();
        reject(new Dropped(`no reply in ${this.timeoutMs / 1000} s`));
      }, this.timeoutMs);
      this.waiting = { id, resolve, reject, timer };
      this.ws.send(data);
    });
    this.exchanges.push({ kind: TYPE_NAMES[type], up: data.length, down: bytes, ms: performance.now() - t0 });
    if (frame.type === ERROR) throw new ServerError(frame.body);
    return frame;
  }

  /** call() until it succeeds: reconnect after a drop (then onDrop()), wait out 429 / 503 answers. */
  async retrying(call, onDrop = null) {
    for (let attempt = 0; ; attempt++) {
      try {
        return await call();
      } catch (err) {
        if (err instanceof Dropped) {
          if (attempt >= this.retries) throw new Unreachable(`lost the connection to ${this.url} ${attempt + 1} times`);
          await sleep(Math.min(2000, this.backoffMs * 2 ** attempt));
          this.ws = null;
          if (onDrop !== null) {
            try {
              await this.connect();
              await onDrop();
            } catch (e) {
              // a busy or lost replica: the next attempt finds the session's state
              const busy = e instanceof ServerError && (e.status === 429 || e.status === 503) && attempt < this.retries;
              if (!(e instanceof Dropped) && !busy) throw e;
              if (busy) await sleep(Math.max(1000 * e.retryAfterS, this.backoffMs));
            }
          }
        } else if (err instanceof ServerError && (err.status === 429 || err.status === 503) && attempt < this.retries) {
          await sleep(Math.max(1000 * err.retryAfterS, this.backoffMs));
        } else if (err instanceof ServerError && err.status === 503) {
          throw new Unreachable(err.message);
        } else {
          throw err;
        }
      }
    }
  }

  // ------------------------------------------------------------------ the CloudClient calls
  /** The verifier's recent costs as the WELCOME carried them (connecting first; policy.js's costHint), null where
   *  it had measured neither its span forward nor its sampled step (0 on the wire: not measured). */
  async costHint() {
    await this.retrying(() => this.connect());
    const w = this.welcome;
    if (!w.verify_s && !w.step_s) return null;
    return costHint(w.verify_s || null, w.step_s || null, w.queue_s || null);
  }

  async open(request) {
    const sid = request.session_id;
    // an OPEN whose reply was lost is sent again as it is: the verifier answers a repeated OPEN as the first
    const frame = await this.retrying(() => this.exchange(OPEN, request));
    this.sessions.set(sid, new SessionHistory(request, frame.token, frame.body.prefix_tokens));
    return frame.body;
  }

  async verify(request) {
    const s = this.sessions.get(request.session_id);
    if (!s) throw new ServerError({ status: 410, message: `session ${request.session_id} was not opened on this connection` });
    const extra = { cloud_s: 0, passes: 0 };
    const resume = async () => {
      this.resumes += 1;
      const rep = (await this.exchange(RESUME, s.resumeBody(this.vocabSize), s.token)).body;
      extra.cloud_s += rep.cloud_s;
      extra.passes += rep.forward_passes;
    };
    const attempt = async () => { // lost again under the retry (the replica it was resumed on went too): again
      for (let lost = 0; ; lost += 1) {
        try {
          return await this.exchange(VERIFY, request, s.token);
        } catch (err) {
          if (!(err instanceof ServerError && err.status === 410) || lost >= LOST_RETRIES) throw err;
          await resume();
        }
      }
    };
    const reply = { ...(await this.retrying(attempt, resume)).body };
    if (extra.passes) Object.assign(reply, { resumed: true, cloud_s: reply.cloud_s + extra.cloud_s,
      forward_passes: reply.forward_passes + extra.passes });
    s.commit(request, reply);
    return reply;
  }

  /** Close a session, best effort: sent on a live connection only (a close never reconnects: after the link was
   *  lost the verifier frees the idle session itself); the local state goes either way. */
  async close(sessionId) {
    const s = this.sessions.get(sessionId);
    if (!s) return;
    this.sessions.delete(sessionId);
    if (this.ws === null) return;
    try {
      await this.retrying(() => this.exchange(CLOSE, { session_id: sessionId }, s.token));
    } catch (err) { // best effort: the verifier frees idle sessions itself
      if (!(err instanceof ServerError || err instanceof Unreachable)) throw err;
    }
  }
}
