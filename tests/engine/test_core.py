"""The verifier's step-level engine (ciar.engine.core): mixed steps, chunking, the token budget, ordering."""

import pytest
import torch

from ciar.engine.core import SchedulerConfig
from ciar.collab.protocol import CapacityError, OpenRequest, SessionLostError, VerifyRequest
from ciar.engine.verifier import CloudVerifier
from ciar.decoding.sampling import SamplingParams

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
PROMPT = "a small red circle at the top on a gray background"


def _open_req(sid, prefix, seed=0, prompt=PROMPT):
    return OpenRequest(sid, prompt, seed=seed, sampling=PARAMS, prefix_len=prefix)


def _span(v, sid, k=3, m=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(k, v.vocab_size, generator=g), -1)
    return VerifyRequest(sid, torch.randint(0, v.vocab_size, (m,), generator=g),
                         torch.multinomial(q, 1, generator=g)[:, 0], q.half(), burst=2)


def _reply(r):
    return (r.num_accepted, r.next_token, r.burst_tokens.tolist() if r.num_burst else [])


@torch.no_grad()
def test_chunked_prefill_and_catch_up_give_the_same_tokens(tiny_cloud, stub_text):
    """A tiny token budget cuts every prefill, history and catch-up into chunks: the same tokens as whole pieces."""
    out = {}
    for budget in (4096, 6):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=3, scheduler=SchedulerConfig(token_budget=budget))
        cloud = v.open_batch([_open_req("c", tiny_cloud.config.block_size, seed=5)])[0].prefix_tokens.tolist()
        v.open_batch([_open_req("s", 2, seed=1)])
        spans = [_reply(v.verify_batch([_span(v, "s", m=6, seed=i)])[0]) for i in range(3)]
        v.resume_batch([_open_req("r", 0, seed=1)], [torch.tensor(v.sessions["s"].tokens)])
        after = _reply(v.verify_batch([_span(v, "r", seed=9)])[0])
        out[budget] = (cloud, spans, after)
        if budget == 6:  # the budget held: no step padded past it, except a lone work (rows x 1 token)
            assert all(s["rows"] * s["width"] <= 6 or s["works"] == 1 for s in v.engine.step_log)
            assert max(s["width"] for s in v.engine.step_log) < tiny_cloud.config.cls_token_num
    assert out[4096] == out[6]


@torch.no_grad()
def test_a_cloud_only_image_does_not_hold_back_spans(tiny_cloud, stub_text):
    """Static batching ran a cloud-only open to its last token before anything else; the engine feeds a span that
    arrives meanwhile in the very next forward, next to the cloud-only session's decode step."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    v.open_batch([_open_req("phone", 2)])
    n = tiny_cloud.config.block_size
    cloud = v.submit_open(_open_req("cloud", n, seed=3))
    for _ in range(4):  # prefill + a few prefix tokens
        v.engine.step()
    span = v.submit_verify(_span(v, "phone"))
    steps = 0
    while not span.done:
        v.engine.step()
        steps += 1
    assert span.error is None and steps <= 1 + span.result.num_burst  # one forward for the span, one per burst token
    assert not cloud.done and 0 < len(v.sessions["cloud"].tokens) < n  # the cloud-only image is still decoding
    assert sorted(v.engine.step_log[-steps]["kinds"]) == ["decode", "span"]  # the span shared the cloud's step
    v.engine.run([cloud])
    alone = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    assert cloud.result.prefix_tokens.tolist() == alone.open_batch([_open_req("cloud", n, seed=3)])[0] \
        .prefix_tokens.tolist()


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_works_in_mixed_steps_match_works_run_alone(tiny_cloud, stub_text, static):
    """Opens, verifications (with bursts) and resumes of several sessions interleaved step by step give what each
    gives alone: draws are per session and keyed by position, so company changes nothing. The same with the runner's
    static steps (padded rows, widths and keys: what CUDA graphs replay), which also give the dynamic steps' replies."""
    def drive(together: bool, static: bool = static):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=8, scheduler=SchedulerConfig(token_budget=48),
                          static=static)
        v.open_batch([_open_req(f"s{i}", 1 + i, seed=i, prompt=f"prompt {i} " * (i + 1)) for i in range(3)])
        v.engine.step_log.clear()
        results = {}
        for rnd in range(3):
            submits = [lambda i=i: v.submit_verify(_span(v, f"s{i}", m=rnd + i, seed=10 * rnd + i)) for i in range(3)]
            submits.append(lambda: v.submit_open(_open_req(f"c{rnd}", 6 + rnd, seed=rnd)))
            if rnd == 1:
                submits.append(lambda: v.submit_resume(_open_req("r", 0, seed=4), torch.tensor([1, 2, 3, 4, 5])))
            if together:
                works = [submit() for submit in submits]
                v.engine.run(works)
            else:
                works = []
                for submit in submits:
                    works.append(submit())
                    v.engine.run(works[-1:])
            for i, w in enumerate(works):
                assert w.error is None, w.error
                results[(rnd, i)] = _reply(w.result) if hasattr(w.result, "num_accepted") else \
                    w.result.prefix_tokens.tolist()
        results["r"] = _reply(v.verify_batch([_span(v, "r", seed=77)])[0])
        assert v.runner.steps["static" if static else "dynamic"] > v.runner.steps["dynamic" if static else "static"]
        return results, max(s["works"] for s in v.engine.step_log)

    (together, widest), (alone, single) = drive(True), drive(False)
    assert widest >= 4 and single == 1
    assert together == alone
    if static:
        assert together == drive(True, static=False)[0]


@torch.no_grad()
def test_closing_or_filling_up_fails_only_the_affected_work(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    v.open_batch([_open_req("a", 2)])
    busy = v.submit_open(_open_req("b", tiny_cloud.config.block_size))
    full = v.submit_open(_open_req("c", 1))  # no slot left: fails alone
    v.engine.step()
    assert isinstance(full.error, CapacityError) and not busy.done
    span = v.submit_verify(_span(v, "a"))
    v.close("b")  # closed under its request: the request fails, the other session's span goes on
    v.engine.run([span])
    assert isinstance(busy.error, SessionLostError) and span.error is None
    v.open_batch([_open_req("b", 1)])  # its slots were freed


@torch.no_grad()
def test_max_works_one_is_unbatched(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=3, scheduler=SchedulerConfig(max_works=1))
    v.open_batch([_open_req(f"s{i}", 2, seed=i) for i in range(3)])
    v.verify_batch([_span(v, f"s{i}", seed=i) for i in range(3)])
    assert {s["works"] for s in v.engine.step_log} == {1}
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(token_budget=0)


@torch.no_grad()
def test_a_failed_forward_fails_its_works_and_frees_their_sessions(tiny_cloud, stub_text, monkeypatch):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    v.open_batch([_open_req("a", 2)])
    span, opening = v.submit_verify(_span(v, "a")), v.submit_open(_open_req("b", 3))

    def broken(*args, **kwargs):
        raise RuntimeError("accelerator lost")

    monkeypatch.setattr(v.runner, "execute_step", broken)  # FAULT INJECTION at the model runner
    v.engine.run([span, opening])
    assert isinstance(span.error, RuntimeError) and isinstance(opening.error, RuntimeError)
    assert "b" not in v.sessions and v.sessions["a"].work is None  # the half-opened session is gone, "a" is free
    monkeypatch.undo()
    assert v.verify_batch([_span(v, "a")])[0].next_token >= 0  # the session takes its next request
    v.open_batch([_open_req("b", 1)])


def _projecting_verifier(tiny_cloud, stub_text):
    from ciar.collab.interval import interval_feature_dim
    from ciar.collab.projector import IntervalProjector, ProjectorConfig

    proj = IntervalProjector(ProjectorConfig(device_dim=16, cloud_dim=tiny_cloud.config.dim,
                                             feature_dim=interval_feature_dim(8)))
    return CloudVerifier(tiny_cloud, stub_text, max_sessions=4, projector=proj), proj.config


def _with_features(v, sid, hidden_dim, feature_dim, m=2, seed=0):
    from dataclasses import replace

    r = _span(v, sid, m=m, seed=seed)
    return replace(r, device_hidden=torch.randn(m, hidden_dim).half(), features=torch.randn(m, feature_dim).half())


@torch.no_grad()
def test_malformed_interval_features_are_refused_before_they_reach_a_session(tiny_cloud, stub_text):
    """A verify (or resume) whose interval features do not fit the projector is refused up front, naming the shapes;
    the session takes the next, well-formed request (found by the device-channel fuzz: one such frame wedged its
    session and failed other devices' requests)."""
    from dataclasses import replace

    from ciar.collab.protocol import InjectedFeatures, SessionError

    v, c = _projecting_verifier(tiny_cloud, stub_text)
    v.open_batch([_open_req("a", 2)])
    for bad, match in ((_with_features(v, "a", c.device_dim + 1, c.feature_dim), "device_hidden must be"),
                       (replace(_with_features(v, "a", c.device_dim, c.feature_dim),
                                features=torch.zeros(3, c.feature_dim)), "one row per token"),
                       (replace(_with_features(v, "a", c.device_dim, c.feature_dim), features=None), "go together")):
        with pytest.raises(SessionError, match=match):
            v.verify_batch([bad])
    assert v.sessions["a"].work is None
    assert v.verify_batch([_with_features(v, "a", c.device_dim, c.feature_dim)])[0].next_token >= 0
    history = torch.tensor(v.sessions["a"].tokens)
    injected = InjectedFeatures(torch.tensor([0]), torch.zeros(1, c.device_dim + 3), torch.zeros(1, c.feature_dim))
    with pytest.raises(SessionError, match="injected"):
        v.resume_batch([_open_req("a", 2)], [history], injected=[injected])


@torch.no_grad()
def test_an_admission_that_breaks_fails_only_its_own_work(tiny_cloud, stub_text, monkeypatch):
    v, c = _projecting_verifier(tiny_cloud, stub_text)
    v.open_batch([_open_req("a", 2), _open_req("b", 2, seed=1)])

    def broken(*args, **kwargs):
        raise RuntimeError("projector exploded")

    monkeypatch.setattr(v.projector, "forward", broken)
    bad, good = v.submit_verify(_with_features(v, "a", c.device_dim, c.feature_dim)), v.submit_verify(_span(v, "b"))
    v.engine.run([bad, good])
    assert "RuntimeError" in str(bad.error) and good.error is None and good.result.next_token >= 0
    assert v.sessions["a"].work is None and not v.engine.busy
    monkeypatch.undo()
    assert v.verify_batch([_with_features(v, "a", c.device_dim, c.feature_dim)])[0].next_token >= 0


@torch.no_grad()
def test_injected_features_need_one_row_per_position(tiny_cloud, stub_text):
    from ciar.collab.protocol import InjectedFeatures, SessionError

    v, c = _projecting_verifier(tiny_cloud, stub_text)
    history = torch.tensor(v.open_batch([_open_req("a", 4)])[0].prefix_tokens)
    two_rows = InjectedFeatures(torch.tensor([0, 1]), torch.zeros(1, c.device_dim), torch.zeros(2, c.feature_dim))
    with pytest.raises(SessionError, match="one row per token"):
        v.resume_batch([_open_req("a", 4)], [history], injected=[two_rows])
    missing = InjectedFeatures(torch.tensor([0]), None, None)
    with pytest.raises(SessionError, match="are missing"):
        v.resume_batch([_open_req("a", 4)], [history], injected=[missing])


# ---------------------------------------------------------------------------------------------- the engine's thread
def test_the_engine_thread_answers_control_calls_while_a_forward_runs(tiny_cloud, stub_text):
    """With the engine on its own thread (`EngineThread`, the Verifier's default), the caller's loop is free while a
    forward runs: a readiness probe, a cost hint and a close are answered during a forward that is held open, and the
    held work completes after. (On the loop itself, `AsyncStepper`, they would wait for the forward.)"""
    import asyncio
    import threading

    from ciar.engine.service import VerifierService, session_token
    from ciar.engine.verifier import CloudVerifier

    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    service = VerifierService(v, "s")
    entered, release = threading.Event(), threading.Event()
    forward = v.runner.execute_step

    def held_forward(pieces):  # FAULT INJECTION: the forward waits for the test
        entered.set()
        assert release.wait(30), "the test never released the forward"
        return forward(pieces)

    v.runner.execute_step = held_forward

    async def run():
        opening = asyncio.ensure_future(service.open(_open_req("a", 3), session_id="a", device_id="d"))
        assert await asyncio.to_thread(entered.wait, 30)  # a forward is running on the engine's thread
        ready = await asyncio.wait_for(service.ready(), 10)
        await asyncio.wait_for(service.cost_hint(), 10)
        await asyncio.wait_for(service.close(session_id="x", device_id="d", token=session_token("s", "x", "d")), 10)
        assert not opening.done() and ready["sessions"] == 1
        release.set()
        reply, _ = await asyncio.wait_for(opening, 30)
        return reply

    try:
        reply = asyncio.run(run())
    finally:
        release.set()
        service.shutdown()
    assert len(reply.prefix_tokens) == 3


def test_the_engine_thread_gives_the_same_replies_as_the_loop(tiny_cloud, stub_text):
    """The same opens and spans through `VerifierService` with the engine on its thread and on the loop: the same
    prefix tokens and verdicts (the thread changes who steps the engine, not what it computes)."""
    import asyncio

    from ciar.engine.service import VerifierService
    from ciar.engine.verifier import CloudVerifier

    def replies(engine_thread: bool):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=3)
        service = VerifierService(v, "s", engine_thread=engine_thread)

        async def one(sid):
            reply, token = await service.open(_open_req(sid, 4, seed=len(sid)), session_id=sid, device_id="d")
            out = [reply.prefix_tokens.tolist()]
            for _ in range(3):
                r = await service.verify(_span(v, sid), session_id=sid, device_id="d", token=token)
                out.append((r.num_accepted, r.next_token))
            await service.close(session_id=sid, device_id="d", token=token)
            return out

        async def run():
            return await asyncio.gather(*(one(s) for s in ("a", "bb", "ccc")))

        try:
            return asyncio.run(run())
        finally:
            service.shutdown()

    assert replies(True) == replies(False)


@torch.no_grad()
def test_a_session_a_work_leaves_of_no_use_is_closed_before_the_next_admission(tiny_cloud, stub_text):
    """Works never close sessions themselves (`Work.drop_session`; the verifier closes it when the work leaves the
    engine). An open abandoned between steps leaves a half-built session: the next step frees it before admitting
    anything, so the same session id opened again is a new session, not a conflict."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    first = v.submit_open(_open_req("a", 6))
    v.engine.step()  # admitted: the session holds the only slot
    assert not first.done and "a" in v.sessions
    v.engine.withdraw(first)  # its caller went away: it fails, its session is left of no use
    assert first.done and first.drop_session and "a" in v.sessions  # (closed when it leaves the engine)
    again = v.submit_open(_open_req("a", 2, seed=7))
    v.engine.run([again])
    assert again.error is None and len(again.result.prefix_tokens) == 2
    assert v.num_sessions == 1 and v.sessions["a"].open_request.seed == 7
