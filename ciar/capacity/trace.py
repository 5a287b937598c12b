"""Recorded device sessions, replayed against a verifier without running any device model (trace-driven phones).

    recorder = TracingClient(InProcessCloud(verifier))          # any CloudClient
    CollabDecoder(device, recorder, config, sampling).generate(prompt, seed, session_id="s0")
    traces = recorder.sessions                                  # [SessionTrace]: every request, reply, device gap
    save_traces(traces, "ciar.traces.pt")

    cloud = AsyncVerifierClient(verifier)                       # or a Serve-handle client (loadtests.capacity)
    result = await replay_session(traces[0], cloud, "phone-17", NetworkModel("5g", seed=17))

A trace keeps what the cloud saw of one image: the OpenRequest, then per exchange the device compute before it
(seconds measured between the previous reply and this request), the VerifyRequest exactly as sent (new tokens,
drafts, float16 draft distributions, interval features), and the reply (accepted count, next token, burst
tokens). A cloud-only image (the decoder's "cloud" method) is an open with prefix_len = N and no exchanges.

Replay sends the same requests under a fresh session id, sleeping the recorded device time and the link's
simulated up/down transfer of each message's bytes (`ciar.sim.network.NetworkModel`). The verifier's draws are
keyed by (seed, position), so the replayed replies equal the recorded ones whatever else the verifier is doing;
`replay_session` checks this (a mismatch means the verifier changed or floating-point batching effects flipped a
sample, and is counted, not hidden). One box can so drive hundreds of concurrent phones: replaying costs a sleep
and a message per exchange.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import torch

from ciar.sim.network import NetworkModel
from ciar.collab.protocol import OpenReply, OpenRequest, SessionError, SessionLostError, VerifyReply, VerifyRequest
from ciar_device.history import SessionHistory


@dataclass
class TraceStep:
    device_s: float  # device compute between the previous reply and this request
    request: VerifyRequest
    num_accepted: int
    next_token: int
    burst_tokens: list[int]
    forward_passes: int = 0  # the reply's cloud forwards (0: not recorded; traces before 2026-11-28)


@dataclass
class SessionTrace:
    open: OpenRequest
    prefix_tokens: list[int]
    open_bytes: tuple[int, int]  # (request, reply) bytes
    steps: list[TraceStep] = field(default_factory=list)
    tail_device_s: float = 0.0  # device compute after the last reply (local tokens, decoding the image)
    vocab_size: int = 0
    open_passes: int = 0  # the open reply's cloud forwards (0: not recorded)


class TracingClient:
    """A CloudClient that records every session it carries (`sessions`, in order of opening)."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.sessions: list[SessionTrace] = []
        self._live: dict[str, SessionTrace] = {}
        self._last: dict[str, float] = {}

    def cost_hint(self):
        hint = getattr(self.inner, "cost_hint", None)
        return hint() if hint is not None else None

    def _gap(self, sid: str) -> float:
        now = time.perf_counter()
        return max(0.0, now - self._last.get(sid, now))

    def open(self, request: OpenRequest) -> OpenReply:
        reply = self.inner.open(request)
        t = SessionTrace(request, reply.prefix_tokens.tolist(), (request.nbytes(), reply.nbytes()),
                         vocab_size=self.vocab_size, open_passes=int(reply.forward_passes))
        self.sessions.append(t)
        self._live[request.session_id] = t
        self._last[request.session_id] = time.perf_counter()
        return reply

    def verify(self, request: VerifyRequest) -> VerifyReply:
        sid = request.session_id
        gap = self._gap(sid)
        reply = self.inner.verify(request)
        if sid in self._live:
            self._live[sid].steps.append(TraceStep(gap, request, reply.num_accepted, reply.next_token,
                                                   reply.burst_tokens.tolist() if reply.num_burst else [],
                                                   int(reply.forward_passes)))
        self._last[sid] = time.perf_counter()
        return reply

    def resume(self, request, history, injected=None):
        return self.inner.resume(request, history, injected)

    def close(self, session_id: str) -> None:
        t = self._live.pop(session_id, None)
        if t is not None:
            t.tail_device_s = self._gap(session_id)
        self._last.pop(session_id, None)
        self.inner.close(session_id)


def save_traces(traces: list[SessionTrace], path: str) -> None:
    torch.save({"version": 1, "traces": traces}, path)


def load_traces(path: str) -> list[SessionTrace]:
    blob = torch.load(path, weights_only=False)  # our own file: dataclasses of tensors
    if blob.get("version") != 1:
        raise ValueError(f"{path}: not a trace file of this version")
    return blob["traces"]


class AsyncVerifierClient:
    """The async replay interface over a `CloudVerifier` in this process: open / verify / resume / close, as a Serve
    handle offers them. Its engine is stepped by an `AsyncStepper` on the caller's loop, or by `stepper` (an
    `EngineThread`: the Verifier deployment's own driver). `caption(request)` -> the caption embeddings [L, D] of
    an open or resume, for a verifier without a text encoder (None: the verifier encodes the prompt)."""

    def __init__(self, verifier, wait_s: float = 0.0, stepper=None, caption=None):
        from ciar.engine.core import AsyncStepper

        self.verifier = verifier
        self.stepper = stepper if stepper is not None else AsyncStepper(verifier.engine, wait_s)
        self.caption = caption or (lambda request: None)

    async def open(self, request: OpenRequest) -> OpenReply:
        return await self.stepper.run(self.verifier.open_work(request, self.caption(request)))

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        return await self.stepper.run(self.verifier.verify_work(request))

    async def resume(self, request: OpenRequest, history, injected=None) -> OpenReply:
        return await self.stepper.run(self.verifier.resume_work(request, history, injected, self.caption(request)))

    async def close(self, session_id: str) -> None:
        self.stepper.call(self.verifier.close, session_id)


@dataclass
class ReplayResult:
    session_id: str
    latency_s: float  # wall time from the open's send to the image's last token (device tail included)
    exchanges: int  # cloud requests (open + verifications)
    forward_passes: int  # cloud forwards the session's requests took part in
    mismatches: int  # replies that differ from the recorded ones
    cloud_s: float
    resumes: int = 0  # times the session was re-created after the verifier lost it


async def replay_session(trace: SessionTrace, cloud, session_id: str, net: NetworkModel | None = None,
                         device_scale: float = 1.0, is_lost=None) -> ReplayResult:
    """Replay one recorded session under `session_id` against `cloud` (async open / verify / resume / close). A
    verification that finds its session gone (`is_lost(exc)`, default: SessionLostError; a replica that went away
    or a new one that took the session over) re-creates it from the committed history, as a device's
    `ciar.sim.recovery.RecoveringClient` does, and is sent again: nothing is lost as replicas come and go."""
    is_lost = is_lost or (lambda e: isinstance(e, SessionLostError))
    t0 = time.perf_counter()

    async def link(nbytes: int) -> None:
        if net is not None:
            await asyncio.sleep(net.transmit(nbytes)[0])

    await link(trace.open_bytes[0])
    open_req = replace(trace.open, session_id=session_id)
    reply = await cloud.open(open_req)
    await link(trace.open_bytes[1])
    tracked = SessionHistory(replace(open_req, want_caption=False), reply.prefix_tokens.tolist())
    mismatches = int(reply.prefix_tokens.tolist() != trace.prefix_tokens)
    passes, cloud_s, resumes = reply.forward_passes, reply.cloud_s, 0
    for i, step in enumerate(trace.steps):
        if step.device_s * device_scale > 0:
            await asyncio.sleep(step.device_s * device_scale)
        req = replace(step.request, session_id=session_id)
        await link(req.nbytes(trace.vocab_size))
        try:
            try:
                rep = await cloud.verify(req)
            except Exception as e:  # noqa: BLE001 - only a lost session is recovered here
                if not is_lost(e):
                    raise
                res = await cloud.resume(tracked.request, tracked.history(torch.from_numpy),
                                         tracked.injected(torch.from_numpy))
                resumes += 1
                passes += res.forward_passes
                rep = await cloud.verify(req)
        except SessionError:  # an earlier mismatch moved the session off its recorded course: stop here
            if not mismatches:
                raise
            mismatches += len(trace.steps) - i
            break
        await link(rep.nbytes())
        tracked.commit(req, rep)
        got = (rep.num_accepted, rep.next_token, rep.burst_tokens.tolist() if rep.num_burst else [])
        mismatches += int(got != (step.num_accepted, step.next_token, step.burst_tokens))
        passes += rep.forward_passes
        cloud_s += rep.cloud_s
    if trace.tail_device_s * device_scale > 0:
        await asyncio.sleep(trace.tail_device_s * device_scale)
    latency = time.perf_counter() - t0
    try:
        await cloud.close(session_id)
    except Exception as e:  # noqa: BLE001 - a session already gone needs no closing
        if not is_lost(e):
            raise
    return ReplayResult(session_id, latency, 1 + len(trace.steps), passes, mismatches, cloud_s, resumes)


class RecordedVerdicts:
    """The recorded sessions' decisions, given by a verifier whose weights would decide otherwise (random weights at
    a real model's shapes: `benchmarks.gpu`'s measured capacity), so that replayed phones keep their recorded course.

        verdicts = RecordedVerdicts(traces).install(verifier)    # wraps verifier.judge.launch
        ... replay_session(...) ...                              # replies equal the recording (mismatches == 0)
        verdicts.replayed, verdicts.unrecorded, verdicts.changed

    The judge's own batched pass still runs on every step (its arithmetic over the step's real logits, its copies,
    its one host read: what a step costs); then each decision a recorded session made is replaced by the recorded
    one, found by (seed, image position): a token the cloud drew itself (a prefix or burst token) by its position;
    a span's verdict (drafts kept, next token) by its first draft's position; the draw after a burst's last
    recorded token (its entropy stop fired) is a stop. `changed` counts the replacements that differed from what
    the judge decided (0 with the weights the traces were recorded with: the replay is then exact on its own);
    `unrecorded` the decisions no trace knew (left as decided: the session has left its recorded course).

    A session opened with Jacobi windows (`OpenRequest.jacobi_window`): the device saw its prefix's and each
    burst's tokens and forwards, not how many tokens each round committed, so the replay keeps those: the prefix's
    first round commits one token (its window is uniform), the rest are split evenly over the recorded rounds, a
    burst whose entropy stop fired ends with a round that takes none; every window drafted after a verdict is
    replaced by the recorded tokens it would have to be for those rounds (`Decided.redrafts`). Such rounds count as
    changed when the judge split them otherwise, even with the recording's weights."""

    def __init__(self, traces: list[SessionTrace]):
        self.draws: dict[tuple[int, int], int] = {}
        self.spans: dict[tuple[int, int], tuple[int, int]] = {}
        self.rounds: dict[tuple[int, int], tuple[int, bool]] = {}  # a Jacobi round: (tokens it commits, a stop)
        self.sequence: dict[int, list[int]] = {}  # seed -> every recorded token
        self.burst_ends: set[tuple[int, int]] = set()
        self.replayed = self.unrecorded = self.changed = 0
        for t in traces:
            seed = int(t.open.seed)
            windows = int(getattr(t.open, "jacobi_window", 0)) > 0
            tokens = list(t.prefix_tokens)
            for i, tok in enumerate(tokens):
                self._put(self.draws, (seed, i), int(tok))
            if windows and tokens:
                self._put_rounds(seed, 0, _split_rounds(len(tokens), t.open_passes - 1, first_one=True))
            for st in t.steps:
                r = st.request
                tokens += [int(x) for x in r.new_tokens]
                self._put(self.spans, (seed, len(tokens)), (int(st.num_accepted), int(st.next_token)))
                tokens += [int(x) for x in r.draft_tokens[:st.num_accepted]] + [int(st.next_token)]
                stopped = st.num_accepted < len(r.draft_tokens) and len(st.burst_tokens) < int(r.burst)
                if windows and st.num_accepted < len(r.draft_tokens) and int(r.burst) > 0:
                    self._put_rounds(seed, len(tokens), _split_rounds(len(st.burst_tokens), st.forward_passes - 1,
                                                                      stop=stopped))
                for b in st.burst_tokens:
                    self._put(self.draws, (seed, len(tokens)), int(b))
                    tokens.append(int(b))
                if stopped:
                    self.burst_ends.add((seed, len(tokens)))  # the burst stopped early: its entropy stop fired
            self.sequence[seed] = tokens
        self._launch = None

    def _put_rounds(self, seed: int, position: int, plan: list[tuple[int, bool]] | None) -> None:
        for m, stop in plan or []:  # (no plan: the counts do not fit; those rounds are left unrecorded)
            self._put(self.rounds, (seed, position), (m, stop))
            position += m

    @staticmethod
    def _put(table: dict, key, value) -> None:
        if table.setdefault(key, value) != value:
            raise ValueError(f"two recorded sessions with seed {key[0]} decided differently at image position "
                             f"{key[1]}: record traces with distinct seeds")

    def install(self, verifier) -> "RecordedVerdicts":
        """The verifier's judge launches its decisions as before; what they read back is replaced (`replace`)."""
        self._launch = verifier.judge.launch
        verifier.judge.launch = self.launch
        return self

    def uninstall(self, verifier) -> None:
        verifier.judge.launch = self._launch

    def launch(self, draws: list, spans: list, step_logits=None):
        deciding = self._launch(draws, spans, step_logits)
        collect = deciding.collect
        deciding.collect = lambda: self.replace(draws, spans, collect())
        return deciding

    def replace(self, draws: list, spans: list, out):
        """The judge's decisions `out` (`Decided`) with the recorded ones put in where the recording has them.
        (With the engine's overlap, a decode run ahead was already fed the judge's own token, after a verdict at
        the judge's own position: the recorded one then stands in the session's tokens, and the cache holds the
        other; with random weights the tokens decide nothing, and the steps, pieces and counts keep the recording's
        course.)"""
        for i, d in enumerate(draws):
            key = (int(d.seed), int(d.position))
            if key in self.draws:
                token, stop = self.draws[key], False
            elif d.stop_entropy > 0 and key in self.burst_ends:
                token, stop = out.tokens[i], True
            else:
                self.unrecorded += 1
                continue
            self.replayed += 1
            self.changed += int(stop != out.stops[i] or (not stop and token != out.tokens[i]))
            out.tokens[i], out.stops[i] = token, stop
        for i, s in enumerate(spans):
            key = (int(s.seed), int(s.position))
            if out.verdicts[i] is None:
                continue
            stop = None
            if s.jacobi is not None:  # a Jacobi round: its planned tokens, the next one from the recording
                if key not in self.rounds:
                    self.unrecorded += 1
                    continue
                m, stop = self.rounds[key]
                n = min(m if stop else m - 1, s.k)
                seq = self.sequence[key[0]]
                z = seq[key[1] + n] if key[1] + n < len(seq) else out.verdicts[i][1]
            elif key in self.spans:
                n, z = self.spans[key]
            else:
                self.unrecorded += 1
                continue
            verdict = (n, z, n < s.k)  # a draft rejected: the next token was drawn from the residual
            self.replayed += 1
            self.changed += int(verdict != out.verdicts[i] or
                                (stop is not None and out.span_stops.get(i) != (m if stop else None)))
            out.verdicts[i] = verdict
            if stop:
                out.span_stops[i] = m
            elif stop is not None:
                out.span_stops.pop(i, None)
            if i in out.redrafts and key[0] in self.sequence:  # the next window: the tokens the recording has there
                tokens, q = out.redrafts[i]
                after = key[1] + n + 1
                recorded = self.sequence[key[0]][after:after + len(tokens)]
                out.redrafts[i] = (recorded + list(tokens[len(recorded):]), q)
        return out


def _split_rounds(tokens: int, rounds: int, first_one: bool = False,
                  stop: bool = False) -> list[tuple[int, bool]] | None:
    """Jacobi rounds that commit `tokens` in `rounds` forwards, as (tokens, stop) per round: evenly (`first_one`:
    the first round commits one token, the rest evenly); with `stop` the last round takes none (an entropy stop).
    None when the counts do not fit (a round that is not a stop commits at least one token)."""
    if rounds < 1:
        return None
    tail = [(0, True)] if stop else []
    rounds -= len(tail)
    if rounds == 0:
        return [(tokens, True)] if stop else None
    plan: list[tuple[int, bool]] = []
    if first_one:
        plan.append((1, False))
        tokens, rounds = tokens - 1, rounds - 1
        if rounds == 0:
            return plan + tail if tokens == 0 else None
    if tokens < rounds:
        return None
    q, r = divmod(tokens, rounds)
    return plan + [(q + 1, False)] * r + [(q, False)] * (rounds - r) + tail
