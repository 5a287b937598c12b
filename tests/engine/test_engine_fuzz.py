"""A differential fuzzer of the verifier's engine: seeded phones of every kind (cloud-only, CIAR with catch-up tokens,
bursts, entropy stops and every acceptance rule, bursts by Jacobi windows, SJD prefixes) and per-row sampling
settings talk to one `CloudVerifier` at once, each sending its next request when its last is answered, as a replica
serves them. One run is the reference: the plain engine (no overlap, a budget that never cuts a piece, a slot for
every phone), no disruption. Each fuzzed run takes an engine (overlap, static buckets, packed steps, the byte buffer,
a token budget and chunk that cut pieces, few works a step, fewer slots than phones: refused, or waited for) and
disrupts it:
  - a session closed under its request in flight, dropped while idle, or every idle one evicted: the phone resumes
    from the tokens it knows, then sends its request again (as `DeviceConnection` does after a drop);
  - a caller that goes away (`StepEngine.withdraw`): nobody reads the reply; resume, send it again;
  - a session moved (closed and resumed between requests), an OPEN sent twice (its first reply lost), an OPEN or
    RESUME refused for want of a slot (sent again);
  - forwards and judge passes that raise; phones that wait a few steps between requests.
Every phone's replies and tokens must be the reference's (docs/architecture.md, *Determinism*: position-keyed draws,
and on a CPU a row's logits whatever shares its step), a repeated OPEN's reply the first's, twin phones (the same
requests under two session ids, side by side in the same steps) must get the same replies, and the engine must end
empty with every slot free.

    CIAR_FUZZ_SEEDS=300 .venv/bin/python -m pytest tests/engine/test_engine_fuzz.py -m slow    # a longer search

Written beside the fix of a session resumed from its tokens drafting other Jacobi windows than the uninterrupted one
(the windows were keyed by the round, which a resume started over): its `make test` seeds fail on the engine before
that fix (seed 3, an SJD phone resumed after a failed pass). 1,200 seeds after it found nothing more."""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from ciar.collab.protocol import CapacityError, ForwardFault, OpenRequest, RuleConfig, VerifyRequest
from ciar.decoding.sampling import SamplingParams
from ciar.engine.core import SchedulerConfig
from ciar.engine.verifier import CloudVerifier
from ciar_device.history import SessionHistory

PROMPTS = ("a small red circle at the top on a gray background",
           "two green triangles at the left on a white background")
KINDS = ("cloud", "ciar", "windows", "sjd")
SAMPLINGS = (SamplingParams(cfg_scale=2.0, temperature=1.0), SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=40),
             SamplingParams(cfg_scale=3.0, temperature=1.0, top_p=0.9), SamplingParams(cfg_scale=1.0, temperature=1.0),
             SamplingParams(cfg_scale=2.0, temperature=0.0))
RULES = (RuleConfig(), RuleConfig(), RuleConfig(rule="greedy"), RuleConfig(rule="cascade", cascade_threshold=0.5),
         RuleConfig(rule="lantern", lantern_k=4, lantern_delta=0.2), RuleConfig(rule="gsd"))
STEP_LIMIT = 20_000  # a run that has not ended by then is stuck (a work that never finishes)


def codebook(cloud) -> torch.Tensor:
    """A fixed random codebook [V, 8] (LANTERN's neighbours)."""
    return torch.randn(cloud.config.vocab_size, 8, generator=torch.Generator().manual_seed(0))


class InjectedFault(RuntimeError):
    """A forward or judge pass that raised on purpose (as an out-of-memory error would)."""


@dataclass
class Disruption:
    """How often a fuzzed run disrupts its phones (per phone and engine step) and its passes."""

    cancel: float = 0.0  # close a session under its request in flight
    withdraw: float = 0.0  # its caller goes away (`StepEngine.withdraw`): the phone never reads the reply
    evict: float = 0.0  # per step: every idle session is evicted (`evict_idle(0)`)
    repeat_open: float = 0.0  # an OPEN is sent twice (its first reply lost): both replies must be the same
    drop: float = 0.0  # close an idle session (evicted, a lost replica): its next request fails
    move: float = 0.0  # close and resume a session before its next request (a moved session)
    think: int = 0  # steps a phone waits between a reply and its next request: up to this many
    forward_fault: float = 0.0  # a step's forward raises
    judge_fault: float = 0.0  # a step's judge pass raises


@dataclass
class Phone:
    """One device's session: its OPEN and, drawn from its own generator as it goes (so a request sent again is the
    same request), its VERIFYs; the tokens it knows and the replies it got."""

    sid: str
    kind: str
    open: OpenRequest
    script: random.Random
    history: SessionHistory | None = None  # what it knows of its session (the device's own bookkeeping)
    replies: list = field(default_factory=list)
    request: VerifyRequest | None = None  # the verify being sent (again, after a failure)
    work: object = None  # the work in flight
    resuming: bool = False  # the work in flight is a resume
    twin: object = None  # the same OPEN sent again while the first is in flight
    token: str = ""  # its session token (`tests/engine/test_service_fuzz.py`: the services check it)
    opened: bool = False
    finished: bool = False
    wait: int = 0  # steps before its next request
    verifies: int = 0
    script_seed: int = 0  # its generator's seed (a twin's is the same)

    @property
    def tokens(self) -> list[int]:
        """The committed tokens it knows (what it resumes from)."""
        return self.history.tokens if self.history is not None else []

    def took_open(self, reply) -> None:
        """Its OPEN's reply: the prefix tokens, recorded."""
        self.history = SessionHistory(self.open, reply.prefix_tokens.tolist())
        self.replies.append(list(self.tokens))

    def took_verify(self, request: VerifyRequest, reply) -> None:
        """A VERIFY's reply, recorded, and what it committed added to the tokens (`SessionHistory.commit`)."""
        self.history.commit(request, reply)
        self.replies.append((reply.num_accepted, reply.next_token, reply.recovered,
                             reply.burst_tokens.tolist() if reply.num_burst else []))
        self.verifies += 1


def make_phones(seed: int, n: int, vocab: int, block: int) -> list[Phone]:
    """`n` phones drawn from `seed`; now and then one is the twin of the one before (the same requests under another
    session id: `twins`)."""
    rng = random.Random(seed)
    phones: list[Phone] = []
    for i in range(n):
        if phones and rng.random() < 0.2:
            twin = phones[-1]
            phones.append(Phone(f"p{i}", twin.kind, dataclasses.replace(twin.open, session_id=f"p{i}"),
                                random.Random(twin.script_seed), script_seed=twin.script_seed))
            continue
        kind = rng.choice(KINDS)
        sampling = rng.choice(SAMPLINGS)
        prefix = {"cloud": block, "ciar": rng.randint(1, 3), "windows": rng.randint(1, 3),
                  "sjd": rng.randint(4, block // 2)}[kind]
        window = rng.randint(2, 4) if kind in ("windows", "sjd") else 0
        rule = rng.choice(RULES) if kind == "ciar" else rng.choice(RULES[:2] + RULES[-1:]) if kind == "sjd" else \
            RuleConfig()  # (an SJD prefix: the exact rule or GSD's groups)
        req = OpenRequest(f"p{i}", rng.choice(PROMPTS), seed=rng.randrange(1 << 31), sampling=sampling,
                          prefix_len=prefix, rule=rule, want_caption=False, jacobi_window=window)
        script_seed = rng.randrange(1 << 31)
        phones.append(Phone(req.session_id, kind, req, random.Random(script_seed), script_seed=script_seed))
    return phones


def twins(phones: list[Phone]) -> list[list[Phone]]:
    """The phones that send the same requests (`make_phones`' twins), grouped."""
    groups: dict = {}
    for p in phones:
        groups.setdefault((repr(dataclasses.replace(p.open, session_id="")), p.script_seed), []).append(p)
    return [g for g in groups.values() if len(g) > 1]


def next_verify(p: Phone, vocab: int, block: int) -> VerifyRequest | None:
    """The phone's next VERIFY (catch-up tokens, drafts from random draft distributions, a burst), or None: its
    image is done or one more would not fit."""
    r = p.script
    if p.kind == "cloud" or p.verifies >= 6:
        return None
    m, k = r.randint(0, 3), r.randint(0, 4)
    if len(p.tokens) + m + k + 1 > block:
        return None
    g = torch.Generator().manual_seed(r.randrange(1 << 31))
    q = torch.softmax(torch.randn(k, vocab, generator=g) * r.choice((0.5, 2.0, 6.0)), -1)
    drafts = torch.multinomial(q, 1, generator=g).flatten() if k else torch.zeros(0, dtype=torch.long)
    return VerifyRequest(p.sid, torch.randint(0, vocab, (m,), generator=g), drafts, q.half(),
                         burst=r.choice((0, 2, 5)), burst_entropy=r.choice((0.0, 0.0, 0.9)))


def _fails(fn, chance: float, rng: random.Random, counts: dict, name: str):
    def maybe(*args, **kwargs):
        if chance and rng.random() < chance:
            counts[name] += 1
            raise InjectedFault(f"injected: {name}")
        return fn(*args, **kwargs)

    return maybe


def run(cloud, text, phones: list[Phone], engine: dict, disrupt: Disruption, seed: int) -> dict:
    """Drive `phones` to their ends on one verifier built with `engine` (CloudVerifier's keywords and `budget`,
    `chunk`, `works`, `pack_inputs`), disrupted as `disrupt` says (its draws from `seed`). -> what happened."""
    engine = dict(engine)
    config = SchedulerConfig(token_budget=engine.pop("budget", 1 << 14), prefill_chunk=engine.pop("chunk", 64),
                             max_works=engine.pop("works", 64))
    pack_inputs = engine.pop("pack_inputs", False)
    slots = max(1, len(phones) - engine.pop("fewer_slots", 0))  # fewer: OPENs and RESUMEs refused until one frees
    v = CloudVerifier(cloud, text, max_sessions=slots, scheduler=config, codebook=codebook(cloud), **engine)
    v.runner.pack_inputs = pack_inputs
    vocab, block = v.vocab_size, v.ctx.block_size
    free = v.free_slot_count
    rng = random.Random(seed)
    counts = {k: 0 for k in ("forward", "judge", "cancel", "withdraw", "evict", "repeat_open", "drop", "move",
                             "resume", "failed", "refused", "steps")}
    v.runner.execute_step = _fails(v.runner.execute_step, disrupt.forward_fault, rng, counts, "forward")
    v.judge.launch = _fails(v.judge.launch, disrupt.judge_fault, rng, counts, "judge")

    def resume(p: Phone) -> None:
        v.close(p.sid)
        p.work, p.resuming = v.submit_resume(p.open, torch.tensor(p.tokens, dtype=torch.long)), True
        counts["resume"] += 1

    def act(p: Phone) -> None:
        w = p.work
        if w is not None:
            if not w.done:
                if disrupt.cancel and rng.random() < disrupt.cancel:
                    counts["cancel"] += 1
                    v.close(p.sid)  # its request fails (SessionLostError): resume, send it again
                elif disrupt.withdraw and rng.random() < disrupt.withdraw:
                    counts["withdraw"] += 1
                    v.engine.withdraw(w)  # queued: dropped; an OPEN or RESUME: fails; a VERIFY runs to its end
                    p.work, p.twin = None, None  # and nobody reads what it gives: resume, send it again
                    if p.opened:
                        resume(p)
                    else:
                        v.close(p.sid)
                        p.work = v.submit_open(p.open)
                return
            p.work = None
            if p.twin is not None:  # a repeated OPEN is answered as the first was
                twin, p.twin = p.twin, None
                if w.error is None:
                    v.engine.run([twin])
                    assert twin.error is None and twin.result.prefix_tokens.tolist() == \
                        w.result.prefix_tokens.tolist(), p.sid
            if w.error is not None:  # the phone knows its tokens: resume from them, then send its request again
                counts["failed"] += 1
                counts["refused"] += isinstance(w.error, CapacityError) and not isinstance(w.error, ForwardFault)
                if p.opened:
                    resume(p)
                else:
                    v.close(p.sid)  # an OPEN that failed is sent again as it was
                    p.work = v.submit_open(p.open)
                return
            if p.resuming:
                p.resuming = False
            elif not p.opened:
                p.opened = True
                p.took_open(w.result)
                p.wait = rng.randint(0, disrupt.think)
            else:
                p.took_verify(p.request, w.result)
                p.request = None
                p.wait = rng.randint(0, disrupt.think)
            if p.request is None:
                p.request = next_verify(p, vocab, block)
                if p.request is None:
                    assert v.sessions[p.sid].tokens == p.tokens, p.sid  # what the phone knows is the session
                    v.close(p.sid)
                    p.finished = True
                    return
            if p.resuming or p.request is None:
                return
        if p.wait > 0:
            p.wait -= 1
            if disrupt.drop and rng.random() < disrupt.drop:
                counts["drop"] += 1
                v.close(p.sid)  # its next verify finds no session and fails
            return
        if not p.opened:
            p.work = v.submit_open(p.open)
            if disrupt.repeat_open and rng.random() < disrupt.repeat_open:
                counts["repeat_open"] += 1
                p.twin = v.submit_open(p.open)
        elif disrupt.move and rng.random() < disrupt.move:
            counts["move"] += 1
            resume(p)
        else:
            p.work = v.submit_verify(p.request)

    for _ in range(STEP_LIMIT):
        for p in phones:
            if not p.finished:
                act(p)
        if all(p.finished for p in phones):
            break
        if disrupt.evict and rng.random() < disrupt.evict:
            counts["evict"] += len(v.evict_idle(0.0))  # their phones' next requests fail: resume, send again
        v.engine.step()
        counts["steps"] += 1
    else:
        raise AssertionError(f"stuck after {STEP_LIMIT} steps: {[(p.sid, p.work) for p in phones if not p.finished]}")
    v.engine.step()  # (finished works leave; nothing else is left)
    assert not v.engine.busy and not v.engine.scheduler.parked and v.engine._pending is None
    assert v.num_sessions == 0 and v.free_slot_count == free
    return counts


# the engines and disruptions of the fuzzed runs (seed % len of each: 13 and 6, so every pair comes); slot_wait_s:
# an OPEN or RESUME without a slot waits for one (parked) instead of being refused
ENGINES = (dict(), dict(overlap=True), dict(static=True),
           dict(static=True, overlap=True, pack=True, pack_inputs=True),
           dict(budget=8, chunk=3), dict(budget=6, chunk=4, overlap=True), dict(works=2),
           dict(works=3, budget=12, chunk=5, static=True, overlap=True),
           dict(fewer_slots=2, overlap=True), dict(fewer_slots=1, budget=10, chunk=4, static=True),
           dict(fewer_slots=1, works=4, static=True, overlap=True, pack=True),
           dict(fewer_slots=2, slot_wait_s=600.0, overlap=True), dict(fewer_slots=1, slot_wait_s=600.0, static=True))
DISRUPTIONS = (Disruption(), Disruption(think=3), Disruption(cancel=0.08, drop=0.1, move=0.05, think=2),
               Disruption(forward_fault=0.05, judge_fault=0.05),
               Disruption(withdraw=0.06, evict=0.05, repeat_open=0.5, think=2),
               Disruption(cancel=0.04, withdraw=0.03, evict=0.02, repeat_open=0.3, drop=0.03, move=0.05, think=2,
                          forward_fault=0.04, judge_fault=0.04))


def fuzz_one(cloud, text, seed: int, extra: dict | None = None) -> dict:
    """One seed: its phones, and its engine (with `extra`'s CloudVerifier keywords) and disruption (78 consecutive
    seeds take every pair); the reference and the fuzzed run compared."""
    n = random.Random(seed).randint(2, 6)
    engine, disrupt = {**ENGINES[seed % len(ENGINES)], **(extra or {})}, DISRUPTIONS[seed % len(DISRUPTIONS)]
    block = cloud.config.block_size
    ref = make_phones(seed, n, cloud.config.vocab_size, block)
    reference = dict(static=True) if engine.get("static") else {}  # (each path gives its own last bits: SJD draws)
    run(cloud, text, ref, reference, Disruption(), seed)
    got = make_phones(seed, n, cloud.config.vocab_size, block)
    counts = run(cloud, text, got, engine, disrupt, seed + 1)
    for a, b in zip(ref, got):
        assert b.replies == a.replies, (seed, a.sid, a.kind, engine, disrupt)
        assert b.tokens == a.tokens, (seed, a.sid, a.kind, engine, disrupt)
    for group in twins(got):  # the same requests, side by side in the same steps: the same replies
        assert all(p.replies == group[0].replies for p in group), (seed, [p.sid for p in group])
    counts["twins"] = sum(len(g) for g in twins(got))
    return counts


def _seeds(default: int) -> range:
    return range(int(os.environ.get("CIAR_FUZZ_SEEDS", default)))


@torch.no_grad()
def test_fuzzed_engines_give_every_phone_the_reference_replies(tiny_cloud, stub_text):
    """Thirteen seeds in `make test` (every engine, every disruption); the disruptions they drew happened."""
    seen = {}
    for seed in range(13):
        for k, x in fuzz_one(tiny_cloud, stub_text, seed).items():
            seen[k] = seen.get(k, 0) + x
    assert min(x for k, x in seen.items() if k != "refused") > 0, seen


@pytest.mark.slow
@torch.no_grad()
def test_fuzzed_engines_many_seeds(tiny_cloud, stub_text):
    for seed in _seeds(80):
        fuzz_one(tiny_cloud, stub_text, 1000 + seed)


@pytest.mark.slow
@torch.no_grad()
def test_fuzzed_engines_with_the_compiled_judge(tiny_cloud, stub_text):
    """The judge compiled (`compiled_judge=True`: its draws and spans by torch.compile'd functions, off by default
    until the GPU suite has measured it) on every engine and disruption gives the eager reference's replies (its
    probabilities may differ from the eager ones in the last bits, so a draw on a boundary could flip; none has in
    78 seeds). ~25 s of compilations on a 2-core CPU, then ~1 s a seed."""
    for seed in _seeds(78):
        fuzz_one(tiny_cloud, stub_text, seed, extra=dict(compiled_judge=True))
