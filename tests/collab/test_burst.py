"""Cloud burst (ciar.engine.verifier): after a rejection the cloud samples g more tokens itself in the same reply."""

import pytest
import torch

from ciar.sim.decoder import CollabDecoder, method_config
from ciar.collab.protocol import OpenRequest, SessionError, VerifyRequest
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
PROMPT = "a small red circle at the top on a gray background"


def _open(v, sid="s", prefix=3, seed=0):
    v.open_batch([OpenRequest(sid, PROMPT, seed=seed, sampling=PARAMS, prefix_len=prefix)])


def _rejecting_request(v, sid, burst, **kw):
    """A span whose draft the exact rule rejects for sure: q puts all mass on a token the cloud gives ~0."""
    V = v.vocab_size
    q = torch.zeros(2, V)
    q[:, 0] = 1.0
    return VerifyRequest(sid, torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long), q.half(),
                         burst=burst, **kw)


@torch.no_grad()
def test_burst_adds_exact_cloud_tokens_after_a_rejection(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    _open(v)
    rep = v.verify_batch([_rejecting_request(v, "s", burst=3)])[0]
    if not rep.recovered:
        pytest.skip("the random cloud accepted token 0")
    assert rep.num_burst == 3 and rep.forward_passes == 4
    s = v.sessions["s"]
    assert s.tokens[-3:] == rep.burst_tokens.tolist() and len(s.tokens) == 3 + rep.num_accepted + 1 + 3
    n = tiny_cloud.config.cls_token_num + len(s.tokens) - 1
    assert all(v.cache.lengths[slot] == n for slot in s.slots)  # invariant: last committed token not fed
    # the burst tokens are what the cloud samples from the same history with the same (seeded) generator
    again = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    _open(again)
    rep2 = again.verify_batch([_rejecting_request(again, "s", burst=3)])[0]
    assert rep2.burst_tokens.tolist() == rep.burst_tokens.tolist()


@torch.no_grad()
def test_burst_is_independent_of_batch_company(tiny_cloud, stub_text):
    def run(batched: bool):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=3)
        for i in range(3):
            _open(v, f"s{i}", prefix=2 + i, seed=i)
        reqs = [_rejecting_request(v, f"s{i}", burst=i + 1) for i in range(3)]
        reps = v.verify_batch(reqs) if batched else [v.verify_batch([r])[0] for r in reqs]
        return [(r.num_accepted, r.next_token, r.burst_tokens.tolist() if r.num_burst else []) for r in reps]

    assert run(True) == run(False)


@torch.no_grad()
def test_no_burst_after_a_full_accept_nor_past_the_last_token(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    N = tiny_cloud.config.block_size
    _open(v, prefix=N - 3)
    V = v.vocab_size
    # drafts equal to... anything, with q = p: we cannot know p, so use an empty span: the next token is a bonus
    rep = v.verify_batch([VerifyRequest("s", torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                        torch.zeros(0, V).half(), burst=5)])[0]
    assert not rep.recovered and rep.num_burst == 0 and rep.forward_passes == 1
    rep = v.verify_batch([_rejecting_request(v, "s", burst=5)])[0]
    assert len(v.sessions["s"].tokens) <= N and rep.num_burst <= 1


def test_adaptive_burst_stops_on_a_confident_cloud(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    _open(v)
    rep = v.verify_batch([_rejecting_request(v, "s", burst=4, burst_entropy=1.0)])[0]
    assert rep.num_burst == 0  # every distribution has entropy <= log V: the cloud hands back at once
    with pytest.raises(SessionError, match="burst"):
        v.verify_batch([_rejecting_request(v, "s", burst=-1)])


def test_decoder_commits_burst_tokens_and_counts_them(tiny_cloud, tiny_device, stub_text):
    def run(burst):
        verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
        dec = CollabDecoder(tiny_device, InProcessCloud(verifier),
                            method_config("ciar", network="none", tau=0.0, burst=burst), PARAMS,
                            num_tokens=tiny_cloud.config.block_size)
        return dec.generate(PROMPT, seed=3, trace=True)

    base, burst = run(0), run(4)
    N = tiny_cloud.config.block_size
    for r in (base, burst):
        assert r.tokens.numel() == N and r.stats.total_tokens == N
        assert r.stats.cloud_tokens + r.stats.device_tokens == N
    assert base.stats.burst_tokens == 0 and burst.stats.burst_tokens > 0
    # tau 0 verifies every token (all cloud-decided either way): a burst replaces round trips with cloud steps
    assert burst.stats.cloud_requests < base.stats.cloud_requests
    assert torch.equal(run(4).tokens, burst.tokens)  # seeded
