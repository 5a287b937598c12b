"""The device's draws (`ciar_device.maths.uniform` and `sample`): counter-based uniforms keyed by (seed, stream,
position), fixed bits, uniform and independent; draws that follow the draft distribution; and, on a real (tiny)
device model, image-token sequences distributed as the previous scheme's (torch.multinomial on a seeded stream) made
them: the change of draws that re-recorded tests/collab/decoder_tokens.json left the distribution of images alone.

Every statistical check runs on fixed seeds (no flakes: the outcome is decided once) at a significance level of
1e-3. Its power, checked by hand on the device test: draws at u ** 1.15 instead of u give p = 1.5e-4 (fail), one
uniform for every position p ~ 1e-276 (fail); the position-keyed scheme gives p >= 0.29 at every check."""

import numpy as np
import pytest
import torch
from scipy import stats

from ciar_device import maths as M

ALPHA = 1e-3


def test_uniform_bits_are_fixed():
    """The scheme is fixed forever (every image drafted for a seed depends on it): pinned values, computed by hand
    from the definition (splitmix64 thrice, top 53 bits)."""
    mask = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    for seed, stream, pos in [(0, M.DRAFT_STREAM, 0), (7, M.GATE_STREAM, 255), (2**62, M.DRAFT_STREAM, 1023),
                              (-1, M.DRAFT_STREAM, 3)]:
        z = mix(mix(mix(seed & mask) ^ stream) ^ pos)
        assert M.uniform(seed, stream, pos) == (z >> 11) / 2.0**53
    assert M.uniform(0, M.DRAFT_STREAM, 0) == 0.8932059517808882
    assert M.uniform(1, M.DRAFT_STREAM, 0) != M.uniform(0, M.DRAFT_STREAM, 1) != M.uniform(0, M.GATE_STREAM, 0)


def _grid(stream, seeds=200, positions=500):
    return np.array([[M.uniform(s, stream, p) for p in range(positions)] for s in range(seeds)])


def test_uniforms_are_uniform_and_independent():
    u = _grid(M.DRAFT_STREAM)  # [seeds, positions]
    g = _grid(M.GATE_STREAM)
    assert ((u >= 0) & (u < 1)).all()
    assert stats.kstest(u.reshape(-1), "uniform").pvalue > ALPHA
    # neighbours: along positions, along seeds, across the two streams: a 10 x 10 histogram of pairs is uniform
    for a, b in [(u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, g)]:
        counts = np.histogram2d(a.reshape(-1), b.reshape(-1), bins=10, range=[[0, 1], [0, 1]])[0]
        assert stats.chisquare(counts.reshape(-1)).pvalue > ALPHA
        assert abs(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1]) < 4 / np.sqrt(a.size)


def test_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.full(40, 0.5)).astype(np.float32)
    q[[3, 17]] = 0.0  # never drawn
    draws = np.array([M.sample(q, M.uniform(s, M.DRAFT_STREAM, p)) for s in range(100) for p in range(500)])
    counts = np.bincount(draws, minlength=q.size)
    assert counts[[3, 17]].sum() == 0
    expected = M.draft_distribution(M.to_float16(q)).astype(np.float64) * draws.size
    keep = expected > 0
    assert stats.chisquare(counts[keep], expected[keep] * counts.sum() / expected[keep].sum()).pvalue > ALPHA


@torch.no_grad()
def _device_sequences(device, text, n_seeds: int, length: int, new: bool) -> np.ndarray:
    """[n_seeds, length] token sequences the device drafts alone (CFG 2, uncached forwards, every seed one row):
    `new` draws as the device loop does (the float16 draft at the position's uniform); otherwise as the previous
    loop did (torch.multinomial on a generator seeded per image)."""
    from ciar.decoding.sampling import SamplingParams, logits_to_probs, sample

    params = SamplingParams(cfg_scale=2.0, temperature=1.0)
    cap = text.encode(["a small red circle at the top on a gray background"])
    emb = torch.cat([cap.emb, cap.emb]).half().float()
    mask, drop = torch.cat([cap.mask, cap.mask]), torch.tensor([False, True])
    emb, mask = emb.repeat(n_seeds, 1, 1), mask.repeat(n_seeds, 1)  # rows 2s, 2s + 1: seed s, cond and uncond
    drop = drop.repeat(n_seeds)
    gens = [torch.Generator().manual_seed(s + (1 << 32)) for s in range(n_seeds)]
    toks = torch.zeros(2 * n_seeds, 0, dtype=torch.long)
    for i in range(length):
        c = device(toks, emb, mask, drop=drop).center[:, -1]  # [2 n_seeds, V]
        xs = []
        for s in range(n_seeds):
            cond, uncond = c[2 * s], c[2 * s + 1]
            if new:
                q32 = M.logits_to_probs(cond.numpy(), params, uncond_logits=uncond.numpy())
                xs.append(M.sample(M.quantize_draft(q32)[1], M.uniform(s, M.DRAFT_STREAM, i)))
            else:
                xs.append(int(sample(logits_to_probs(cond[None], params, uncond_logits=uncond[None]), gens[s])[0]))
        toks = torch.cat([toks, torch.tensor(xs).repeat_interleave(2)[:, None]], dim=1)
    return toks[0::2].numpy()


def _homogeneous(a: np.ndarray, b: np.ndarray) -> float:
    """The p-value of a chi-square test that two samples of categories come from one distribution (categories with
    fewer than 10 draws in both together pooled into one)."""
    cats = np.union1d(a, b)
    ca = np.array([(a == c).sum() for c in cats])
    cb = np.array([(b == c).sum() for c in cats])
    small = ca + cb < 10
    if small.any():
        ca = np.append(ca[~small], ca[small].sum())
        cb = np.append(cb[~small], cb[small].sum())
    return stats.chi2_contingency(np.stack([ca, cb]))[1]


def test_device_images_are_distributed_as_with_the_previous_draws(tiny_device, stub_text):
    """4,000 device-only images of 3 tokens per scheme from the tiny device: each position's marginal and the pair
    (x0, x1) are homogeneous between the previous draws (torch.multinomial) and the position-keyed ones."""
    n, length = 4000, 3
    old = _device_sequences(tiny_device, stub_text, n, length, new=False)
    new = _device_sequences(tiny_device, stub_text, n, length, new=True)
    assert not np.array_equal(old, new)  # different draws ...
    p = [_homogeneous(old[:, i], new[:, i]) for i in range(length)]
    p.append(_homogeneous(old[:, 0] * 64 + old[:, 1], new[:, 0] * 64 + new[:, 1]))
    assert min(p) > ALPHA, p  # ... from one distribution
