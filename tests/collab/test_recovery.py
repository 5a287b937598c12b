"""Recoverable cloud sessions: a lost verifier or an evicted slot costs a re-prefill, never a different token."""

import pickle
import random
from dataclasses import replace

import pytest
import torch

from ciar.collab.names import METHODS
from ciar.sim.decoder import GATED_METHODS, CollabDecoder, method_config
from ciar.collab.projector import IntervalProjector, ProjectorConfig
from ciar.collab.protocol import CapacityError, OpenRequest, SessionError, SessionLostError, VerifyRequest
from ciar.sim.recovery import RecoveringClient
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams, counter_uniform, seed_tensor
from ciar_device import maths

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
PROMPT = "a small red circle at the top on a gray background"
EMPTY = torch.zeros(0, dtype=torch.long)
FROZEN_ACCEPT_7_10 = 0.867816663551894


class FlakyCloud(InProcessCloud):
    """InProcessCloud that, just before verify call number `at` (1-based; None: the call after the first one that
    carries interval features) and the `times` - 1 calls after it, either swaps its verifier for a FRESH one (a lost
    replica) or evicts every idle session (a lost slot)."""

    def __init__(self, make_verifier, at: int, mode: str, times: int = 1):
        super().__init__(make_verifier())
        self.make_verifier, self.at, self.mode, self.times = make_verifier, at, mode, times
        self.calls = 0
        self.resume_calls = []

    def verify(self, request):
        self.calls += 1
        if self.at is not None and self.at <= self.calls < self.at + self.times:
            if self.mode == "replace":
                self.verifier = self.make_verifier()
            else:
                assert self.verifier.evict_idle(0.0) == [request.session_id]
        if self.at is None and request.device_hidden is not None:
            self.at = self.calls + 1
        return super().verify(request)

    def resume(self, request, history, injected=None):
        self.resume_calls.append((request, history.clone(), injected))
        return super().resume(request, history, injected)


def run_pair(tiny_cloud, tiny_device, stub_text, mode, projector=None, seed=11, at=3, **overrides):
    cfg = method_config("ciar", network="none", **overrides)

    def make_verifier():
        return CloudVerifier(tiny_cloud, stub_text, max_sessions=2, projector=projector)

    ref = CollabDecoder(tiny_device, InProcessCloud(make_verifier()), cfg, PARAMS,
                        num_tokens=tiny_cloud.config.block_size).generate(PROMPT, seed=seed)
    flaky = FlakyCloud(make_verifier, at=at, mode=mode)
    client = RecoveringClient(flaky)
    got = CollabDecoder(tiny_device, client, cfg, PARAMS,
                        num_tokens=tiny_cloud.config.block_size).generate(PROMPT, seed=seed)
    return ref, got, flaky, client


@pytest.mark.parametrize("mode,burst,window", [("replace", 0, 0), ("evict", 0, 0), ("replace", 3, 0),
                                               ("replace", 4, 3)])
def test_lost_session_is_resumed_with_identical_tokens(tiny_cloud, tiny_device, stub_text, mode, burst, window,
                                                       median_tau):
    """... also with a cloud burst: the burst tokens are part of the committed history the device re-sends; and with
    the prefix and bursts by Jacobi windows, whose drafts the resumed session draws as the lost one would have."""
    ref, got, flaky, client = run_pair(tiny_cloud, tiny_device, stub_text, mode, tau=median_tau,
                                       span=3, burst=burst, jacobi_window=window)
    assert (ref.stats.burst_tokens > 0) == (burst > 0)
    assert ref.stats.verifications >= 3  # the loss happens mid-session
    assert ref.stats.device_tokens > 0 or burst  # (the random tiny device escalates right after each burst)
    assert torch.equal(got.tokens, ref.tokens)
    assert got.stats.resumes == 1 and ref.stats.resumes == 0 and client.resumes == 1
    assert len(flaky.resume_calls) == 1
    req, history, _ = flaky.resume_calls[0]
    assert not req.want_caption and history.numel() > 0
    assert torch.equal(history, got.tokens[:history.numel()])  # the committed prefix, as the device has it
    assert got.stats.cloud_forward_passes == ref.stats.cloud_forward_passes + 2  # prefill + one history feed
    assert got.stats.verifications == ref.stats.verifications
    assert flaky.verifier.num_sessions == 0  # closed at the end


def test_resume_reinjects_interval_features(tiny_cloud, tiny_device, stub_text, median_tau):
    """With a non-zero projector the cloud cache holds injected features; the resume must rebuild them too."""
    proj = IntervalProjector(ProjectorConfig(device_dim=64, cloud_dim=64, feature_dim=20))
    torch.manual_seed(0)
    with torch.no_grad():
        torch.nn.init.normal_(proj.fc2.weight, std=5.0)
    ref, got, flaky, _ = run_pair(tiny_cloud, tiny_device, stub_text, "replace", projector=proj.eval(), seed=3,
                                  at=None, tau=median_tau, span=3)
    assert torch.equal(got.tokens, ref.tokens) and got.stats.resumes == 1
    _, history, injected = flaky.resume_calls[0]
    assert injected is not None  # locally accepted tokens before the loss: their features travel with the history
    assert injected.positions.numel() == injected.device_hidden.shape[0] == injected.features.shape[0] > 0
    assert int(injected.positions.max()) < history.numel() - 1


def _open_and_verify(v, sid, prompt, seed, prefix_len, rounds, g):
    V = v.vocab_size
    v.open_batch([OpenRequest(sid, prompt, seed=seed, sampling=PARAMS, prefix_len=prefix_len)])
    for rnd in range(rounds):
        m, k = rnd % 3, 1 + rnd % 3
        drafts = torch.randint(0, V, (k,), generator=g)
        v.verify_batch([VerifyRequest(sid, torch.randint(0, V, (m,), generator=g), drafts,
                                      torch.softmax(torch.randn(k, V, generator=g), -1))])


@torch.no_grad()
def test_resume_batch_rebuilds_cache_and_continues_identically(tiny_cloud, stub_text):
    """Ragged resume of several sessions (0, 1 and many committed tokens) into a fresh verifier: caches match the
    originals and the following verifications (batched) give the same answers."""
    orig = CloudVerifier(tiny_cloud, stub_text, max_sessions=4)
    g = torch.Generator().manual_seed(0)
    plan = [("a", PROMPT, 0, 0, 0), ("b", "a large blue square", 1, 1, 0), ("c", "two green triangles", 2, 2, 3),
            ("d", "one tiny dot", 3, 0, 1)]  # (sid, prompt, seed, prefix_len, verify rounds)
    for sid, prompt, seed, prefix_len, rounds in plan:
        _open_and_verify(orig, sid, prompt, seed, prefix_len, rounds, g)
    fresh = CloudVerifier(tiny_cloud, stub_text, max_sessions=4)
    reqs = [OpenRequest(sid, p, seed=seed, sampling=PARAMS, prefix_len=99 if sid == "c" else 0, want_caption=sid == "b")
            for sid, p, seed, _, _ in plan]  # prefix_len is ignored on resume
    hist = [torch.tensor(orig.sessions[sid].tokens, dtype=torch.long) for sid, *_ in plan]
    assert [h.numel() for h in hist][:2] == [0, 1] and hist[2].numel() > 5
    replies = fresh.resume_batch(reqs, hist)
    assert [r.forward_passes for r in replies] == [1 + (h.numel() >= 2) for h in hist]
    assert all(r.prefix_tokens.numel() == 0 for r in replies) and all(r.cloud_s > 0 for r in replies)
    assert replies[1].caption_emb is not None and replies[0].caption_emb is None
    c = tiny_cloud.config
    for sid, *_ in plan:
        a, b = orig.sessions[sid], fresh.sessions[sid]
        assert a.tokens == b.tokens and a.seed == b.seed
        assert (a.first_logits is None) == (b.first_logits is None)
        if a.first_logits is not None:
            torch.testing.assert_close(a.first_logits, b.first_logits)
        n = c.cls_token_num + max(len(a.tokens) - 1, 0)
        assert [fresh.cache.lengths[s] for s in b.slots] == [n] * len(b.slots)
        for layer in range(c.n_layer):
            for sa, sb in zip(a.slots, b.slots):
                torch.testing.assert_close(orig.cache.k[layer][sa, :, :n], fresh.cache.k[layer][sb, :, :n])
                torch.testing.assert_close(orig.cache.v[layer][sa, :, :n], fresh.cache.v[layer][sb, :, :n])
    V = tiny_cloud.config.vocab_size
    for _ in range(3):
        vreqs = [VerifyRequest(sid, torch.randint(0, V, (1,), generator=g), torch.randint(0, V, (2,), generator=g),
                               torch.softmax(torch.randn(2, V, generator=g), -1)) for sid, *_ in plan]
        a = [(r.num_accepted, r.next_token) for r in orig.verify_batch(vreqs)]
        b = [(r.num_accepted, r.next_token) for r in fresh.verify_batch(vreqs)]
        assert a == b


@torch.no_grad()
def test_resume_with_empty_history_then_verify(tiny_cloud, stub_text):
    V = tiny_cloud.config.vocab_size
    orig = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    fresh = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    req = OpenRequest("s", PROMPT, seed=5, sampling=PARAMS, prefix_len=0)
    orig.open_batch([req])
    rep = fresh.resume_batch([req], [EMPTY])[0]
    assert rep.forward_passes == 1 and rep.caption_emb is not None  # want_caption honoured
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(2)), -1)
    vr = VerifyRequest("s", EMPTY, torch.tensor([1, 2, 3]), q)
    a, b = orig.verify_batch([vr])[0], fresh.verify_batch([vr])[0]
    assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)
    assert orig.sessions["s"].tokens == fresh.sessions["s"].tokens


def test_session_lost_before_its_first_verification(tiny_cloud, tiny_device, stub_text, median_tau):
    """No prefix, lost at once: the resume sends an empty history and the prefill logits are rebuilt."""
    ref, got, flaky, _ = run_pair(tiny_cloud, tiny_device, stub_text, "evict", at=1, prefix_rate=0.0,
                                  tau=median_tau)
    assert torch.equal(got.tokens, ref.tokens) and got.stats.resumes == 1
    assert flaky.resume_calls[0][1].numel() == 0


def test_verify_of_unknown_session_raises_session_lost(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    V = tiny_cloud.config.vocab_size
    vr = VerifyRequest("s", EMPTY, torch.zeros(1, dtype=torch.long), torch.full((1, V), 1.0 / V))
    with pytest.raises(SessionLostError, match="unknown session") as e:
        v.verify_batch([vr])
    assert isinstance(e.value, SessionError) and e.value.session_id == "s"
    again = pickle.loads(pickle.dumps(e.value))  # transports ship it between processes
    assert isinstance(again, SessionLostError) and again.session_id == "s" and str(again) == str(e.value)
    v.open_batch([OpenRequest("s", PROMPT, 0, PARAMS, 1)])
    v.verify_batch([vr])
    v.close("s")
    with pytest.raises(SessionLostError):
        v.verify_batch([vr])
    v.open_batch([OpenRequest("s", PROMPT, 0, PARAMS, 1)])
    assert v.evict_idle(1e9) == [] and v.evict_idle(0.0) == ["s"]
    with pytest.raises(SessionLostError):
        v.verify_batch([vr])
    # other client bugs stay plain SessionErrors
    v.open_batch([OpenRequest("s", PROMPT, 0, PARAMS, 1)])
    with pytest.raises(SessionError, match="token ids") as e:
        v.verify_batch([VerifyRequest("s", torch.tensor([V]), torch.zeros(1, dtype=torch.long),
                                      torch.full((1, V), 1.0 / V))])
    assert not isinstance(e.value, SessionLostError)


def test_capacity_evicts_idle_sessions_only_when_allowed(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1, idle_timeout_s=0.0)
    v.open_batch([OpenRequest("a", PROMPT, 0, PARAMS, 1)])
    assert v.num_sessions == 1 and v.free_slot_count == 0
    v.open_batch([OpenRequest("b", PROMPT, 0, PARAMS, 1)])  # "a" is idle: evicted for "b"
    assert set(v.sessions) == {"b"} and v.num_sessions == 1
    v.resume_batch([OpenRequest("a", PROMPT, 0, PARAMS, 0)], [torch.tensor([3, 4])])  # resume evicts too
    assert set(v.sessions) == {"a"}

    strict = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)  # idle_timeout_s=None: never evict on demand
    strict.open_batch([OpenRequest("a", PROMPT, 0, PARAMS, 1)])
    with pytest.raises(CapacityError, match="full"):
        strict.open_batch([OpenRequest("b", PROMPT, 0, PARAMS, 1)])
    with pytest.raises(CapacityError):
        strict.resume_batch([OpenRequest("b", PROMPT, 0, PARAMS, 0)], [EMPTY])
    assert set(strict.sessions) == {"a"}
    strict.idle_timeout_s = 3600.0  # "a" was used just now: still not evictable
    with pytest.raises(CapacityError):
        strict.open_batch([OpenRequest("b", PROMPT, 0, PARAMS, 1)])
    assert strict.free_slot_count == 0


def test_resume_replaces_a_stale_copy_and_validates(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
    V, N = tiny_cloud.config.vocab_size, tiny_cloud.config.block_size
    v.open_batch([OpenRequest("s", PROMPT, 0, PARAMS, 4)])
    v.resume_batch([OpenRequest("s", PROMPT, 0, PARAMS, 0)], [torch.tensor([1, 2])])  # max_sessions=1: slots reused
    assert v.sessions["s"].tokens == [1, 2] and v.num_sessions == 1
    bad = [torch.tensor([V]), torch.tensor([-1]), torch.zeros(N + 1, dtype=torch.long), torch.zeros(2, 2).long()]
    for h in bad:
        with pytest.raises(SessionError):
            v.resume_batch([OpenRequest("t", PROMPT, 0, PARAMS, 0)], [h])
    assert set(v.sessions) == {"s"}  # refused before any state changed
    v.resume_batch([OpenRequest("s", PROMPT, 0, PARAMS, 0)], [torch.zeros(N, dtype=torch.long)])  # full length ok


def test_cloud_draws_are_keyed_by_seed_stream_and_position():
    """The cloud's draws (what makes a resumed session continue as the undisturbed one): the torch counter-based
    uniform equals the device's, bit for bit, for any seed (mod 2**64) and position; the streams differ; frozen."""
    seeds = [0, 1, 2, -1, 2 ** 64 - 1, 2 ** 70 + 5, 123456789]
    positions = list(range(0, 300, 7))
    for stream in (maths.CLOUD_STREAM, maths.ACCEPT_STREAM, maths.NEXT_STREAM):
        got = counter_uniform(seed_tensor(seeds)[:, None], stream, torch.tensor(positions)[None, :]).tolist()
        assert got == [[maths.uniform(s, stream, p) for p in positions] for s in seeds]
    assert maths.uniform(-1, maths.ACCEPT_STREAM, 3) == maths.uniform(2 ** 64 - 1, maths.ACCEPT_STREAM, 3)
    draws = {maths.uniform(7, st, 10) for st in (maths.CLOUD_STREAM, maths.ACCEPT_STREAM, maths.NEXT_STREAM,
                                                  maths.DRAFT_STREAM, maths.GATE_STREAM)}
    assert len(draws) == 5 and all(0.0 <= u < 1.0 for u in draws)
    assert maths.uniform(7, maths.ACCEPT_STREAM, 10) == FROZEN_ACCEPT_7_10  # changing the mix changes every output


class _LostOnClose:
    vocab_size = 8

    def __init__(self, exc):
        self.exc = exc

    def close(self, session_id):
        raise self.exc


def test_recovering_client_close_and_is_lost_predicate():
    RecoveringClient(_LostOnClose(SessionLostError("lost", "x"))).close("x")  # lost on close: nothing to do
    with pytest.raises(RuntimeError):
        RecoveringClient(_LostOnClose(RuntimeError("boom"))).close("x")
    RecoveringClient(_LostOnClose(ConnectionError("gone")), is_lost=lambda e: isinstance(e, ConnectionError)).close("x")


def test_custom_lost_error_triggers_resume(tiny_cloud, tiny_device, stub_text):
    """A transport error mapped to 'lost' by `is_lost` recovers the same way; others propagate."""

    class ReplicaDied(RuntimeError):
        pass

    class Dying(InProcessCloud):
        def __init__(self, verifier):
            super().__init__(verifier)
            self.calls = 0

        def verify(self, request):
            self.calls += 1
            if self.calls == 2:
                self.verifier.close(request.session_id)
                raise ReplicaDied("replica died")
            return super().verify(request)

    cfg = method_config("eagle", network="none", span=3)
    n = tiny_cloud.config.block_size
    ref = CollabDecoder(tiny_device, InProcessCloud(CloudVerifier(tiny_cloud, stub_text, max_sessions=1)), cfg,
                        PARAMS, num_tokens=n).generate(PROMPT, seed=4)
    client = RecoveringClient(Dying(CloudVerifier(tiny_cloud, stub_text, max_sessions=1)),
                              is_lost=lambda e: isinstance(e, (SessionLostError, ReplicaDied)))
    got = CollabDecoder(tiny_device, client, cfg, PARAMS, num_tokens=n).generate(PROMPT, seed=4)
    assert torch.equal(got.tokens, ref.tokens) and got.stats.resumes == 1
    plain = RecoveringClient(Dying(CloudVerifier(tiny_cloud, stub_text, max_sessions=1)))
    with pytest.raises(ReplicaDied):
        CollabDecoder(tiny_device, plain, cfg, PARAMS, num_tokens=n).generate(PROMPT, seed=4)


class ChaosCloud(InProcessCloud):
    """InProcessCloud that, before each call, at random (seeded): swaps its verifier for a fresh one (a lost replica),
    evicts every idle session (lost slots), or makes the next forward raise (a failed forward: `ForwardFault`)."""

    def __init__(self, make_verifier, seed: int, lose: float, evict: float, fault: float):
        super().__init__(make_verifier())
        self.make_verifier, self.rng = make_verifier, random.Random(seed)
        self.p = (lose, evict, fault)
        self.events = {"replaced": 0, "evicted": 0, "faults": 0}
        self._arm(self.verifier)

    def _arm(self, v) -> None:
        forward, armed = v.runner.execute_step, self.events

        def maybe(pieces):
            if armed.pop("armed", False):
                armed["faults"] += 1
                raise RuntimeError("injected: the forward failed")
            return forward(pieces)

        v.runner.execute_step = maybe

    def _chaos(self) -> None:
        r = self.rng.random()
        lose, evict, fault = self.p
        if r < lose:
            self.events["replaced"] += 1
            self.verifier = self.make_verifier()
            self._arm(self.verifier)
        elif r < lose + evict:
            self.events["evicted"] += len(self.verifier.evict_idle(0.0))
        elif r < lose + evict + fault:
            self.events["armed"] = True

    def open(self, request):
        self._chaos()
        return super().open(request)

    def verify(self, request):
        self._chaos()
        return super().verify(request)

    def resume(self, request, history, injected=None):
        self._chaos()
        return super().resume(request, history, injected)


@pytest.mark.parametrize("method", METHODS + ("ciar:jacobi3",))
def test_random_losses_and_faults_leave_every_methods_image_unchanged(tiny_cloud, tiny_device, stub_text, method,
                                                                      median_tau):
    """Every method's decoder through `RecoveringClient` over a cloud that loses replicas, evicts slots and fails
    forwards at random (with the interval projector injecting features): the same tokens as undisturbed, four seeds
    each; the disruptions happened."""
    proj = IntervalProjector(ProjectorConfig(device_dim=64, cloud_dim=64, feature_dim=20))
    torch.manual_seed(0)
    with torch.no_grad():
        torch.nn.init.normal_(proj.fc2.weight, std=5.0)

    codebook = torch.randn(tiny_cloud.config.vocab_size, 8, generator=torch.Generator().manual_seed(0))  # LANTERN's

    def make_verifier():
        return CloudVerifier(tiny_cloud, stub_text, max_sessions=2, projector=proj.eval(), codebook=codebook)

    method, _, windows = method.partition(":jacobi")  # (CIAR with its prefix and bursts by Jacobi windows)
    knobs = dict(tau=median_tau, span=3, burst=2) if method in GATED_METHODS else {}
    cfg = method_config(method, network="none", **knobs, **({"jacobi_window": int(windows)} if windows else {}))
    n = tiny_cloud.config.block_size
    events, resumes = {}, 0
    for seed in range(4):
        ref = CollabDecoder(tiny_device, InProcessCloud(make_verifier()), cfg, PARAMS, num_tokens=n).generate(
            PROMPT, seed=seed)
        chaos = ChaosCloud(make_verifier, seed, lose=0.1, evict=0.1, fault=0.15)
        client = RecoveringClient(chaos)
        got = CollabDecoder(tiny_device, client, cfg, PARAMS, num_tokens=n).generate(PROMPT, seed=seed)
        assert torch.equal(got.tokens, ref.tokens), (method, seed, chaos.events)
        assert chaos.verifier.num_sessions == 0 and client.open_sessions == 0
        resumes += client.resumes
        for k, x in chaos.events.items():
            events[k] = events.get(k, 0) + x
    assert events["faults"] > 0, events
    if ref.stats.verifications >= 3:  # (methods that exchange: sessions were lost under them)
        assert resumes > 0, events


def test_a_session_lost_again_under_its_retried_verify_is_resumed_again(tiny_cloud, tiny_device, stub_text,
                                                                        median_tau):
    """The replica a session was resumed on is lost in turn before the verify is sent again: RecoveringClient resumes
    it again (up to LOST_RETRIES), and the image is the undisturbed one; past LOST_RETRIES the loss is raised."""

    def make_verifier():
        return CloudVerifier(tiny_cloud, stub_text, max_sessions=2)

    cfg = method_config("ciar", network="none", tau=median_tau, span=3)
    n = tiny_cloud.config.block_size
    ref = CollabDecoder(tiny_device, InProcessCloud(make_verifier()), cfg, PARAMS, num_tokens=n).generate(PROMPT,
                                                                                                         seed=5)
    assert ref.stats.verifications >= 3
    # (from the third verify on: the verify and its retries, each on a fresh replica)
    client = RecoveringClient(FlakyCloud(make_verifier, at=3, mode="replace", times=RecoveringClient.LOST_RETRIES))
    got = CollabDecoder(tiny_device, client, cfg, PARAMS, num_tokens=n).generate(PROMPT, seed=5)
    assert torch.equal(got.tokens, ref.tokens) and client.resumes == RecoveringClient.LOST_RETRIES
    client = RecoveringClient(FlakyCloud(make_verifier, at=3, mode="replace", times=RecoveringClient.LOST_RETRIES + 1))
    with pytest.raises(SessionLostError):
        CollabDecoder(tiny_device, client, replace(cfg, fallback=False), PARAMS, num_tokens=n).generate(PROMPT, seed=5)
    client = RecoveringClient(FlakyCloud(make_verifier, at=3, mode="replace"))
    client.LOST_RETRIES = 0  # no resume at all: the loss itself is raised
    with pytest.raises(SessionLostError):
        CollabDecoder(tiny_device, client, replace(cfg, fallback=False), PARAMS, num_tokens=n).generate(PROMPT, seed=5)
    assert client.resumes == 0
