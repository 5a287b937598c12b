"""The engine's overlap (`StepEngine(overlap=True)`, `CloudVerifier(overlap=True)`): a step's decisions are read after
the next step's forward is launched, the works waiting for them sit that step out, and a decode that goes on feeds
its drawn token straight from the accelerator (`ciar.engine.core._Ahead`), as does the first decode of a burst that a
verdict may start, at the position past the drafts the verdict keeps. On a CPU nothing runs concurrently, but the
order of operations is the one a GPU runs: every reply must be what the engine gives without overlap (every draw is
keyed by its position; on a CPU a row's logits do not depend on its batch), with decodes actually run ahead and some
dropped (a burst's entropy stop ended the work under them)."""

import pytest
import torch

from ciar.collab.protocol import OpenRequest, VerifyRequest
from ciar.decoding.sampling import SamplingParams
from ciar.engine.core import SchedulerConfig
from ciar.engine.verifier import CloudVerifier

PROMPT = "a small red circle at the top on a gray background"
SAMPLED = SamplingParams(cfg_scale=2.0, temperature=1.0)


def _span(sid: str, vocab: int, seed: int, k: int, burst: int, burst_entropy: float) -> VerifyRequest:
    """k drafts with their draft distributions (sampled rule: some accepted, some rejected, then a burst)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 2, -1)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    return VerifyRequest(sid, torch.zeros(0, dtype=torch.long), drafts, q.half(), burst=burst,
                         burst_entropy=burst_entropy)


def _load(v: CloudVerifier, rounds: int = 4):
    """Sessions of every kind at once, each sending its next request as soon as its last is answered, the engine
    stepped in between (as a replica serves phones): cloud-only images, CIAR sessions bursting one token a forward
    (one with an entropy stop that fires on some tokens) and by Jacobi windows, and an SJD prefix. -> every reply's
    tokens and counts, by session."""
    opens = {
        "cloud": OpenRequest("cloud", PROMPT, seed=1, sampling=SAMPLED, prefix_len=20),
        "ciar": OpenRequest("ciar", PROMPT, seed=2, sampling=SAMPLED, prefix_len=2),
        "stop": OpenRequest("stop", PROMPT, seed=3, sampling=SAMPLED, prefix_len=1),
        "windows": OpenRequest("windows", PROMPT, seed=4, sampling=SAMPLED, prefix_len=2, jacobi_window=3),
        "sjd": OpenRequest("sjd", PROMPT, seed=5, sampling=SAMPLED, prefix_len=12, jacobi_window=4),
    }
    verifies = {"ciar": (3, 6, 0.0), "stop": (2, 5, 0.93), "windows": (3, 6, 0.0)}  # k, burst, burst_entropy
    sent = {sid: 0 for sid in opens}
    works = {sid: v.submit_open(r) for sid, r in opens.items()}
    out: dict[str, list] = {sid: [] for sid in opens}
    while works:
        v.engine.step()
        for sid, w in list(works.items()):
            if not w.done:
                continue
            if w.error is not None:
                raise w.error
            r = w.result
            out[sid].append(r.prefix_tokens.tolist() if sid in opens and sent[sid] == 0 else
                            (r.num_accepted, r.next_token, r.recovered, r.burst_tokens.tolist()
                             if r.burst_tokens is not None else [], r.forward_passes))
            del works[sid]
            if sid in verifies and sent[sid] < rounds:
                sent[sid] += 1
                k, burst, entropy = verifies[sid]
                works[sid] = v.submit_verify(_span(sid, v.vocab_size, 10 * sent[sid] + len(sid), k, burst, entropy))
    return out, {sid: list(v.sessions[sid].tokens) for sid in opens}


def _tokens_only(load):
    replies, tokens = load
    return {sid: [r[:4] if isinstance(r, tuple) else r for r in rs] for sid, rs in replies.items()}, tokens


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("budget", [1024, 8])
def test_overlap_and_packed_steps_give_every_reply_of_the_engine_without_them(tiny_cloud, stub_text, static,
                                                                               budget):
    config = SchedulerConfig(token_budget=budget, prefill_chunk=4)
    plain = CloudVerifier(tiny_cloud, stub_text, max_sessions=6, scheduler=config, static=static)
    # (static: also the span-wide steps packed, and the inputs through one byte buffer, as on CUDA)
    ahead = CloudVerifier(tiny_cloud, stub_text, max_sessions=6, scheduler=config, static=static, overlap=True,
                          pack=static)
    ahead.runner.pack_inputs = static
    want = _load(plain)
    got = _load(ahead)
    if budget < 1024:  # pieces cut to the budget: a reply's forwards depend on what shared its steps; tokens do not
        want, got = _tokens_only(want), _tokens_only(got)
    assert got == want
    # decodes were fed their token from the device, bursts' first ones at the position past the drafts a verdict
    # kept (before the host knew it)
    assert ahead.engine.ahead["run"] > 0 and ahead.engine.ahead["after_verdicts"] > 0, ahead.engine.ahead
    assert plain.engine.ahead == {"run": 0, "after_verdicts": 0, "dropped": 0}
    if budget == 1024:  # (an entropy stop, or a verdict that started no burst: the decode was dropped, not counted)
        assert ahead.engine.ahead["dropped"] > 0
        assert (ahead.runner.positions["packed"] > 0) == static  # steps of spans and decodes ran packed


@torch.no_grad()
def test_overlap_reads_a_steps_decisions_after_the_next_forward(tiny_cloud, stub_text):
    """The order itself: with overlap, the step that launches a draw does not apply it; the next step's forward
    runs first (with the decode fed from the device), then the draw is applied."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2, overlap=True)
    w = v.submit_open(OpenRequest("a", PROMPT, seed=0, sampling=SAMPLED, prefix_len=6))
    calls = []
    execute = v.runner.execute_step

    def spy(pieces):
        calls.append(("forward", len(v.sessions["a"].tokens) if "a" in v.sessions else 0,
                      [p.token_from is not None for p in pieces]))
        return execute(pieces)

    v.runner.execute_step = spy
    while not w.done:
        v.engine.step()
    assert w.error is None and len(w.result.prefix_tokens) == 6
    # the prefill's step, then a decode fed from the device while the host still holds 0, 1, ... tokens
    assert calls[0] == ("forward", 0, [False])
    assert [c[1] for c in calls[1:]] == [0, 1, 2, 3, 4]
    assert all(c[2] == [True] for c in calls[1:])
    assert not v.engine.busy


@torch.no_grad()
def test_overlap_fails_only_the_works_of_a_failed_forward(tiny_cloud, stub_text):
    """A forward that raises while a step's decisions are still unread fails its works (a decode run ahead fails
    its work); the decisions are then applied to the others, and the engine goes on."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=4, overlap=True)
    a = v.submit_open(OpenRequest("a", PROMPT, seed=0, sampling=SAMPLED, prefix_len=8))
    b = v.submit_open(OpenRequest("b", PROMPT, seed=1, sampling=SAMPLED, prefix_len=2))
    execute, n = v.runner.execute_step, [0]

    def flaky(pieces):
        n[0] += 1
        if n[0] == 3:
            raise torch.OutOfMemoryError("injected")
        return execute(pieces)

    v.runner.execute_step = flaky
    while not (a.done and b.done):
        v.engine.step()
    assert a.error is not None and "OutOfMemoryError" in str(a.error)
    # (step 3 held only a's decode run ahead; b's last draw, launched in step 2, was read after that forward failed)
    assert b.error is None and len(b.result.prefix_tokens) == 2
    assert not v.engine.busy
    c = v.submit_open(OpenRequest("c", PROMPT, seed=0, sampling=SAMPLED, prefix_len=8))
    while not c.done:
        v.engine.step()
    alone = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    assert c.result.prefix_tokens.tolist() == alone.open_batch([OpenRequest("c", PROMPT, seed=0, sampling=SAMPLED,
                                                                            prefix_len=8)])[0].prefix_tokens.tolist()


def test_overlap_on_the_engine_thread_with_concurrent_callers(tiny_cloud, stub_text):
    """The replica's shape: the engine on its own thread (`VerifierService`), sessions sent by concurrent asyncio
    callers, each verifying as soon as its last reply came, one closed mid-image: with overlap the replies are the
    engine's without it, and nothing is left running."""
    import asyncio

    from ciar.engine.service import VerifierService

    async def phones(service, n=4, rounds=3):
        async def phone(i):
            sid = f"p{i}"
            reply, token = await service.open(OpenRequest(sid, PROMPT, seed=i, sampling=SAMPLED, prefix_len=2 + i),
                                              session_id=sid, device_id="d")
            got = [reply.prefix_tokens.tolist()]
            for r in range(rounds):
                v = await service.verify(_span(sid, tiny_cloud.config.vocab_size, 7 * i + r, 3, 3 + i, 0.0),
                                         session_id=sid, device_id="d", token=token)
                got.append((v.num_accepted, v.next_token, v.burst_tokens.tolist() if v.num_burst else []))
            await service.close(session_id=sid, device_id="d", token=token)
            return got

        return await asyncio.gather(*(phone(i) for i in range(n)))

    results = []
    for overlap in (False, True):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=4, overlap=overlap)
        service = VerifierService(v, "s", batch_wait_s=0.002)
        try:
            results.append(asyncio.run(phones(service)))
            asyncio.run(service.stepper.settled())
        finally:
            service.shutdown()
        assert not v.engine.busy and len(v.table) == 0
    assert results[1] == results[0]
    assert v.engine.ahead["run"] > 0
