"""Speculative Jacobi decoding in the engine (`ciar.engine.works.JacobiWork`, an OPEN with `jacobi_window` > 0): the
same tokens as `ciar.decoding.jacobi.generate_sjd` for the same caption and seed, alone, beside other works and
under a budget that cuts its windows into chunks; fewer forwards than tokens."""

import pytest
import torch

from ciar.collab.protocol import OpenRequest, SessionError
from ciar.engine.verifier import CloudVerifier, JacobiWork
from ciar.decoding.jacobi import generate_sjd
from ciar.decoding.sampling import SamplingParams
from ciar.engine.core import SchedulerConfig

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
PROMPTS = ["a small red circle at the top on a gray background", "a blue square"]


def _sjd(cloud, text, prompt, seed, n, window):
    cap = text.encode([prompt])
    tokens, stats = generate_sjd(cloud, cap.emb, cap.mask, PARAMS, seed=seed, num_tokens=n, window=window)
    return tokens.tolist(), stats


def _open(sid, prompt, seed, n, window):
    return OpenRequest(sid, prompt, seed=seed, sampling=PARAMS, prefix_len=n, jacobi_window=window)


@torch.no_grad()
@pytest.mark.parametrize("window", [1, 4, 8])
def test_the_engine_decodes_as_generate_sjd(tiny_cloud, stub_text, window):
    n = tiny_cloud.config.block_size
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=4)
    for seed in range(3):
        want, stats = _sjd(tiny_cloud, stub_text, PROMPTS[0], seed, n, window)
        work = v.submit_open(_open(f"s{seed}", PROMPTS[0], seed, n, window))
        assert isinstance(work, JacobiWork)
        v.engine.run([work])
        assert work.error is None
        assert work.result.prefix_tokens.tolist() == want
        assert work.rounds == stats.accepted  # the same tokens per round: the same rounds
        assert work.result.forward_passes == stats.forwards + 1  # and the prefill
        v.close(f"s{seed}")


@torch.no_grad()
def test_windows_beside_other_works_and_in_chunks_give_the_same_tokens(tiny_cloud, stub_text):
    """Two Jacobi opens, a cloud-only open and a CIAR prefix in the same steps, with a budget that cuts prefills and
    windows into chunks: every Jacobi image is generate_sjd's, the others are what they are alone."""
    n = tiny_cloud.config.block_size
    want = [_sjd(tiny_cloud, stub_text, PROMPTS[i % 2], 10 + i, n, 6)[0] for i in range(2)]
    alone = CloudVerifier(tiny_cloud, stub_text, max_sessions=4)
    plain = [r.prefix_tokens.tolist() for r in alone.open_batch([
        OpenRequest("c", PROMPTS[1], seed=5, sampling=PARAMS, prefix_len=n),
        OpenRequest("p", PROMPTS[0], seed=6, sampling=PARAMS, prefix_len=7)])]
    for budget in (1024, 12):
        v = CloudVerifier(tiny_cloud, stub_text, max_sessions=6, scheduler=SchedulerConfig(token_budget=budget,
                                                                                          prefill_chunk=3))
        works = [v.submit_open(_open(f"j{i}", PROMPTS[i % 2], 10 + i, n, 6)) for i in range(2)]
        works += [v.submit_open(OpenRequest("c", PROMPTS[1], seed=5, sampling=PARAMS, prefix_len=n)),
                  v.submit_open(OpenRequest("p", PROMPTS[0], seed=6, sampling=PARAMS, prefix_len=7))]
        v.engine.run(works)
        assert [w.result.prefix_tokens.tolist() for w in works] == want + plain, budget


@torch.no_grad()
def test_a_jacobi_open_takes_fewer_forwards_than_tokens_and_checks_its_window(tiny_cloud, stub_text):
    n = tiny_cloud.config.block_size
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    reply = v.open_batch([_open("a", PROMPTS[0], 0, n, 8)])[0]
    assert len(reply.prefix_tokens) == n
    assert reply.forward_passes < n
    with pytest.raises(SessionError, match="jacobi_window"):
        v.open_batch([_open("b", PROMPTS[0], 0, n, n + 1)])
    with pytest.raises(SessionError, match="jacobi_window"):
        v.open_batch([_open("b", PROMPTS[0], 0, n, -1)])
