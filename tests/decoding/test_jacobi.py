"""Speculative Jacobi decoding (ciar.decoding.jacobi): fewer sequential passes, the same distribution as cloud-only
decoding (chi-square over many seeds), deterministic per seed."""

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from ciar.decoding.generate import generate_cloud
from ciar.decoding.jacobi import generate_sjd
from ciar.decoding.sampling import SamplingParams, logits_to_probs

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
SEEDS = 1500


@pytest.fixture(scope="module")
def caption(stub_text):
    return stub_text.encode(["a small red circle at the top on a gray background"])


@pytest.fixture(scope="module")
def sjd_runs(tiny_cloud, caption):
    """The first 6 tokens of SEEDS images by SJD (window 4), and the passes each took."""
    torch.set_num_threads(1)
    toks, passes = [], []
    for s in range(SEEDS):
        t, st = generate_sjd(tiny_cloud, caption.emb, caption.mask, PARAMS, seed=s, num_tokens=6, window=4)
        toks.append(t.tolist())
        passes.append(st.forwards)
    return np.array(toks), passes


def _first_two_marginals(model, caption):
    """The exact distributions of image tokens 0 and 1 under cloud-only decoding (CFG 2): p0, and sum_x p0(x) p1(.|x)."""
    with torch.no_grad():
        cond, mask, drop = model.cfg_condition(caption.emb, caption.mask)
        cache = model.new_cache(2)
        logits = model.prefill(cache, cond, mask, drop)
        p0 = logits_to_probs(logits[:1], PARAMS, uncond_logits=logits[1:])[0]
        v = p0.numel()
        p1 = torch.zeros(v)
        c = model.config
        for x in range(v):
            step = torch.full((2, 1), x, dtype=torch.long)
            lg = model.decode(cache, step, torch.tensor([c.cls_token_num]), kv_len=c.cls_token_num + 1)[:, -1]
            p1 += p0[x] * logits_to_probs(lg[:1], PARAMS, uncond_logits=lg[1:])[0]
    return p0.double().numpy(), p1.double().numpy()


def _chi2_against(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=p.size)
    keep = p * len(samples) >= 5  # bins with an expected count of at least 5; the rest pooled
    f_obs = np.append(counts[keep], counts[~keep].sum())
    f_exp = np.append(p[keep], p[~keep].sum()) * len(samples)
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue  # (p's float32 sum is 1 to rounding)


def test_sjd_tokens_follow_cloud_only_decoding(tiny_cloud, caption, sjd_runs):
    """Token 0 and token 1 against their exact cloud-only marginals; token 5 against cloud-only samples (two-sample
    chi-square): speculative sampling is exact whatever the Jacobi drafts were."""
    toks, _ = sjd_runs
    p0, p1 = _first_two_marginals(tiny_cloud, caption)
    assert _chi2_against(toks[:, 0], p0) > 1e-4
    assert _chi2_against(toks[:, 1], p1) > 1e-4
    assert _chi2_against(toks[:, 1], p0) < 1e-6  # power: token 1 is not token 0's distribution
    ref = generate_cloud(tiny_cloud, caption.emb.expand(SEEDS, -1, -1), caption.mask.expand(SEEDS, -1), PARAMS,
                         seed=[10_000 + s for s in range(SEEDS)], num_tokens=6)[:, 5].numpy()
    v = tiny_cloud.config.vocab_size
    table = np.stack([np.bincount(toks[:, 5], minlength=v), np.bincount(ref, minlength=v)])
    table = table[:, table.sum(0) >= 10]
    assert chi2_contingency(table).pvalue > 1e-4


def test_sjd_takes_fewer_passes_than_tokens_and_repeats_per_seed(tiny_cloud, caption, sjd_runs):
    _, passes = sjd_runs
    assert max(passes) <= 6 and np.mean(passes) < 6  # at least one token a pass, often more
    a, sa = generate_sjd(tiny_cloud, caption.emb, caption.mask, PARAMS, seed=3, window=8)
    b, sb = generate_sjd(tiny_cloud, caption.emb, caption.mask, PARAMS, seed=3, window=8)
    n = tiny_cloud.config.block_size
    assert torch.equal(a, b) and a.shape == (n,) and sum(sa.accepted) == n and sa.forwards == sb.forwards < n
    assert sa.positions >= n  # a pass feeds the whole window: more positions than tokens


def test_bad_arguments_are_refused(tiny_cloud, caption):
    with pytest.raises(ValueError, match="one caption"):
        generate_sjd(tiny_cloud, caption.emb.expand(2, -1, -1), None, PARAMS, seed=0)
    with pytest.raises(ValueError, match="window"):
        generate_sjd(tiny_cloud, caption.emb, caption.mask, PARAMS, seed=0, window=0)
    with pytest.raises(TypeError, match="seed"):
        generate_sjd(tiny_cloud, caption.emb, caption.mask, PARAMS, seed=torch.Generator())
