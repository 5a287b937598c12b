"""A cloud burst by Jacobi rounds (`ciar.engine.works.VerifyWork`, a session opened with `jacobi_window` > 0): after a
rejection the cloud's own burst tokens are decoded in windows, the first drafted from the verdict's distributions
past the rejection. Under greedy sampling the tokens are the burst's one-token-a-forward tokens exactly (any slip in
positions, feeds or cache lengths would change them), in fewer forwards; the entropy stop ends it where one token a
forward would; without a window nothing changes."""

import pytest
import torch

from ciar.collab.protocol import OpenRequest, VerifyRequest
from ciar.decoding.sampling import SamplingParams
from ciar.engine.core import SchedulerConfig
from ciar.engine.verifier import CloudVerifier

GREEDY = SamplingParams(cfg_scale=2.0, temperature=1.0, top_k=1)
PROMPT = "a small red circle at the top on a gray background"


def _rejected_span(sid: str, vocab: int, seed: int, burst: int, burst_entropy: float = 0.0) -> VerifyRequest:
    """Three drafts, each sent with all its mass on itself: under greedy targets the first draft off the cloud's
    argmax is rejected (the chance that all three are its argmax is 1 / V^3)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (3,), generator=g)
    return VerifyRequest(sid, torch.zeros(0, dtype=torch.long), drafts,
                         torch.nn.functional.one_hot(drafts, vocab).half(), burst=burst, burst_entropy=burst_entropy)


def _image(v: CloudVerifier, sid: str, seed: int, window: int, burst: int, rounds: int = 4,
           burst_entropy: float = 0.0):
    """An open with a 2-token prefix, then verifications with a burst each: -> (tokens, cloud forwards of the
    verifications, burst tokens per reply)."""
    v.open_batch([OpenRequest(sid, PROMPT, seed=seed, sampling=GREEDY, prefix_len=2, jacobi_window=window)])
    passes, bursts = 0, []
    for i in range(rounds):
        r = v.verify_batch([_rejected_span(sid, v.vocab_size, 100 * seed + i, burst, burst_entropy)])[0]
        passes += r.forward_passes
        bursts.append(r.num_burst)
    tokens = list(v.sessions[sid].tokens)
    v.close(sid)
    return tokens, passes, bursts


@torch.no_grad()
@pytest.mark.parametrize("window", [2, 4, 8])
def test_greedy_bursts_by_windows_are_the_same_tokens_in_fewer_forwards(tiny_cloud, stub_text, window):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    fewer = 0
    for seed in range(4):
        one, one_passes, one_bursts = _image(v, "a", seed, 0, burst=6)
        win, win_passes, win_bursts = _image(v, "b", seed, window, burst=6)
        assert win == one, seed
        assert win_bursts == one_bursts == [6] * 4
        assert one_passes == 4 * (1 + 6)  # a verification and one forward per burst token
        assert win_passes <= one_passes
        fewer += win_passes < one_passes
    assert fewer > 0


@torch.no_grad()
def test_windows_beside_other_works_and_in_chunks_give_the_same_tokens(tiny_cloud, stub_text):
    """Two sessions bursting by windows in the same steps, under a budget that cuts their rounds into chunks:
    each one's tokens are what it makes alone."""
    alone = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    want = [_image(alone, "x", seed, 4, burst=5)[0] for seed in (7, 8)]
    for budget in (1024, 6):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=4, scheduler=SchedulerConfig(token_budget=budget,
                                                                                          prefill_chunk=3))
        v.open_batch([OpenRequest(f"s{seed}", PROMPT, seed=seed, sampling=GREEDY, prefix_len=2, jacobi_window=4)
                      for seed in (7, 8)])
        for i in range(4):
            v.verify_batch([_rejected_span(f"s{seed}", v.vocab_size, 100 * seed + i, 5) for seed in (7, 8)])
        assert [list(v.sessions[f"s{seed}"].tokens) for seed in (7, 8)] == want, budget


@torch.no_grad()
def test_the_entropy_stop_ends_a_burst_by_windows_where_it_ends_one_token_a_forward(tiny_cloud, stub_text):
    """A greedy target has entropy 0: a threshold above it stops the burst before its first token, and the step
    that found it is spent, by windows as one token a forward."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    one = _image(v, "a", 3, 0, burst=6, rounds=2, burst_entropy=0.5)
    win = _image(v, "b", 3, 4, burst=6, rounds=2, burst_entropy=0.5)
    assert one == win
    assert one[1:] == (2 * 2, [0, 0])


SAMPLED = SamplingParams(cfg_scale=2.0, temperature=1.0)


def _sampled_span(sid: str, vocab: int, seed: int) -> VerifyRequest:
    """Three drafts drawn from their own random distributions: some kept, one rejected, then a burst."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(3, vocab, generator=g) * 2, -1)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    return VerifyRequest(sid, torch.zeros(0, dtype=torch.long), drafts, q.half(), burst=4)


def _resumed_image(v: CloudVerifier, prefix_len: int, resume_before: int | None):
    """An open (its prefix by SJD windows) and three verifications bursting by windows of 3, sampled; before
    verification `resume_before` the session is closed and resumed from its tokens, as after a lost replica. -> (the
    replies, the tokens, the cloud forwards)."""
    req = OpenRequest("a", PROMPT, seed=7, sampling=SAMPLED, prefix_len=prefix_len, jacobi_window=3)
    first = v.open_batch([req])[0]
    replies, passes = [first.prefix_tokens.tolist()], first.forward_passes
    for i in range(3):
        if i == resume_before:
            history = torch.tensor(v.sessions["a"].tokens, dtype=torch.long)
            v.close("a")
            v.resume_batch([req], [history])
        r = v.verify_batch([_sampled_span("a", v.vocab_size, 100 + i)])[0]
        replies.append((r.num_accepted, r.next_token, r.burst_tokens.tolist() if r.num_burst else []))
        passes += r.forward_passes
    tokens = list(v.sessions["a"].tokens)
    v.close("a")
    return replies, tokens, passes


@torch.no_grad()
@pytest.mark.parametrize("prefix_len", [2, 10])
def test_a_session_resumed_from_its_tokens_drafts_the_same_windows(tiny_cloud, stub_text, prefix_len):
    """A window's drafts are keyed by the committed count, which the tokens alone fix: a session rebuilt from its
    history (a RESUME after a lost replica or a cut socket) drafts the windows the uninterrupted one drafts, so its
    image is the same (docs/architecture.md, *Determinism*). Keyed by the round, as before, a resumed session's round
    count started over and its windows, and then its tokens, differed."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    want, tokens, passes = _resumed_image(v, prefix_len, None)
    assert passes < len(tokens) and any(burst for _, _, burst in want[1:])  # windows drafted tokens, bursts ran
    for resume_before in (1, 2):
        assert _resumed_image(v, prefix_len, resume_before)[:2] == (want, tokens), resume_before
