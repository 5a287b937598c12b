"""Tests for ciar.collab.acceptance: fixed cases per rule, row independence, losslessness (chi-square), LANTERN
neighbour tables, CASCADE relaxation and input validation. Most cases pass a torch generator to the module's
`verify_span` below, which draws the uniforms from it (`SpanDraws.from_generator`); the independence tests use the
verifier's position-keyed draws (`SpanDraws.counter`)."""

import pytest
import torch
from scipy.stats import chisquare

from ciar.collab import acceptance
from ciar.collab.acceptance import (RULES, CascadeConfig, GsdConfig, LanternConfig, NeighborTable, SpanDraws,
                                    VerifyOutput)
from ciar.decoding.sampling import seed_tensor


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def verify_span(rule, x, q, p, draws, *args, **kwargs):
    """acceptance.verify_span, with a torch generator standing for its uniforms (SpanDraws.from_generator)."""
    if isinstance(draws, torch.Generator):
        draws = SpanDraws.from_generator(draws, x.shape[0], x.shape[1] if x.dim() == 2 else 0)
    return acceptance.verify_span(rule, x, q, p, draws, *args, **kwargs)


def counter(seeds, positions, k):
    return SpanDraws.counter(seed_tensor(seeds), torch.tensor(positions), k)


def onehot(idx, v):
    out = torch.zeros(v)
    out[idx] = 1.0
    return out


def random_probs(*shape, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g) * sharp, dim=-1)


def random_case(b=5, k=4, v=12, seed=0):
    """Drafts sampled from q, so every rule has a realistic mix of accepts and rejects."""
    q = random_probs(b, k, v, seed=seed)
    p = random_probs(b, k + 1, v, seed=seed + 100)
    x = torch.multinomial(q.reshape(-1, v), 1, generator=gen(seed + 7)).view(b, k)
    return x, q, p


def same(a: VerifyOutput, b: VerifyOutput):
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.next_token, b.next_token)
    assert torch.equal(a.recovered, b.recovered)


def cfg_kwargs(rule, v, neighbors=None, emb=None):
    if rule == "lantern":
        return {"neighbors": neighbors, "lantern": LanternConfig(k=3, delta=0.2)}
    if rule == "cascade":
        return {"cascade": CascadeConfig(threshold=0.5), "token_embeddings": emb}
    if rule == "gsd":
        return {"token_embeddings": emb, "gsd": GsdConfig(ranks=3, prob_gap=0.3, distance=4.0)}
    return {}


# ----------------------------------------------------------------------------------------------- fixed cases
@pytest.mark.parametrize("rule", ["exact", "lantern", "cascade", "greedy", "gsd"])
def test_full_accept_gives_bonus(rule):
    v, k = 5, 3
    x = torch.tensor([[1, 2, 3]])
    q = torch.stack([onehot(t, v) for t in (1, 2, 3)])[None]  # [1, 3, V]
    p = torch.stack([onehot(1, v), onehot(2, v), onehot(3, v), onehot(4, v)])[None]  # bonus is token 4
    kw = cfg_kwargs(rule, v, NeighborTable.from_codebook(torch.randn(v, 2), 3), torch.randn(v, 4))
    out = verify_span(rule, x, q, p, gen(), **kw)
    assert out.num_accepted.tolist() == [k]
    assert out.next_token.tolist() == [4]
    assert out.recovered.tolist() == [False]
    assert out.num_accepted.dtype == torch.long and out.next_token.dtype == torch.long
    assert out.recovered.dtype == torch.bool


def test_partial_probs_full_accept():
    """p(x) >= q(x) at every position: always accepted, whatever the uniforms."""
    v = 4
    x = torch.tensor([[0, 1]])
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    p = torch.tensor([[[0.6, 0.2, 0.2, 0.0], [0.1, 0.5, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]]])
    for seed in range(20):
        out = verify_span("exact", x, q, p, gen(seed))
        assert out.num_accepted.tolist() == [2] and out.next_token.tolist() == [3] and not out.recovered[0]


def test_early_reject_samples_residual():
    v = 4
    x = torch.tensor([[2, 0]])
    q = torch.tensor([[[0.2, 0.3, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]])
    # p_0(x_0) = 0 -> rejected; residual max(0, p - q) is one-hot on token 3
    p = torch.tensor([[[0.2, 0.3, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]])
    for seed in range(10):
        out = verify_span("exact", x, q, p, gen(seed))
        assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [3] and out.recovered.tolist() == [True]


def test_second_position_reject():
    x = torch.tensor([[1, 1]])
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]])
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    out = verify_span("exact", x, q, p, gen())
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [2] and out.recovered.tolist() == [True]


def test_zero_mass_residual_falls_back_to_p():
    """q = p but the draft has p(x) = q(x) = 0: rejected, residual empty -> drawn from p."""
    x = torch.tensor([[0]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    p = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    out = verify_span("exact", x, q, p, gen())
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [2] and out.recovered.tolist() == [True]


@pytest.mark.parametrize("rule", RULES)
def test_empty_span(rule):
    v = 6
    x = torch.zeros(2, 0, dtype=torch.long)
    q = torch.zeros(2, 0, v)
    p = torch.stack([onehot(4, v), onehot(1, v)])[:, None]  # [2, 1, V]
    kw = cfg_kwargs(rule, v, NeighborTable.from_codebook(torch.randn(v, 2), 3), torch.randn(v, 4))
    out = verify_span(rule, x, q, p, gen(), **kw)
    assert out.num_accepted.tolist() == [0, 0]
    assert out.next_token.tolist() == [4, 1]
    assert out.recovered.tolist() == [False, False]


def test_empty_span_follows_p():
    v = 3
    p = torch.tensor([0.2, 0.5, 0.3]).expand(6000, 1, v).contiguous()
    out = verify_span("exact", torch.zeros(6000, 0, dtype=torch.long), torch.zeros(6000, 0, v), p, gen(3))
    counts = torch.bincount(out.next_token, minlength=v).double().numpy()
    expected = p[0, 0].double() / p[0, 0].double().sum() * 6000
    assert chisquare(counts, expected.numpy()).pvalue > 1e-3


# ------------------------------------------------------------------------------------- ragged / independence
def test_ragged_span_len_deterministic_rows():
    v, k = 5, 3
    x = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    q = torch.stack([onehot(t, v) for t in (1, 2, 3)]).expand(3, k, v).contiguous()
    p = torch.zeros(3, k + 1, v)
    p[:, 0, 1] = p[:, 1, 2] = 1.0  # positions 0 and 1 agree with the drafts
    p[:, 2, 0] = 1.0  # position 2 would reject token 3 (residual one-hot on 0)
    p[:, 3, 4] = 1.0  # bonus after position 2
    span = torch.tensor([3, 1, 0])
    seeds, positions = [5, 6, 7], [0, 10, 20]
    out = verify_span("exact", x, q, p, counter(seeds, positions, k), span_len=span)
    # row 0: accepts 2, rejects at 2 -> token 0; row 1: accepts 1, bonus from p[1, 1] -> token 2;
    # row 2: empty span, token from p[2, 0] -> 1
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.next_token.tolist() == [0, 2, 1]
    assert out.recovered.tolist() == [True, False, False]
    for b in range(3):
        n = int(span[b])
        alone = verify_span("exact", x[b:b + 1, :n], q[b:b + 1, :n], p[b:b + 1, :n + 1],
                            counter(seeds[b:b + 1], positions[b:b + 1], n))
        assert alone.num_accepted.item() == out.num_accepted[b].item()
        assert alone.next_token.item() == out.next_token[b].item()
        assert alone.recovered.item() == out.recovered[b].item()


@pytest.mark.parametrize("rule", RULES)
def test_every_row_of_a_batch_equals_the_row_judged_alone(rule):
    """Position-keyed draws: each row's verdict (drafts kept, next token) is its own inputs' and (seed, position)'s
    alone, whatever the batch holds and wherever the row sits in it: what lets the verifier judge every span of a
    step at once."""
    v, k = 10, 4
    x, q, p = random_case(b=6, k=k, v=v, seed=11)
    kw = cfg_kwargs(rule, v, NeighborTable.from_codebook(torch.randn(v, 3, generator=gen(1)), 4),
                    torch.randn(v, 4, generator=gen(2)))
    span = torch.tensor([4, 2, 0, 3, 4, 1])
    for trial in range(10):
        seeds, positions = [trial * 7 + b for b in range(6)], [trial + 3 * b for b in range(6)]
        batch = verify_span(rule, x, q, p, counter(seeds, positions, k), span_len=span, **kw)
        order = torch.randperm(6, generator=gen(trial))  # the same rows, shuffled
        shuffled = verify_span(rule, x[order], q[order], p[order],
                               counter([seeds[i] for i in order], [positions[i] for i in order], k),
                               span_len=span[order], **kw)
        same(VerifyOutput(batch.num_accepted[order], batch.next_token[order], batch.recovered[order]), shuffled)
        for b in range(6):
            n = int(span[b])
            one = verify_span(rule, x[b:b + 1, :n], q[b:b + 1, :n], p[b:b + 1, :n + 1],
                              counter(seeds[b:b + 1], positions[b:b + 1], n), **kw)
            same(one, VerifyOutput(batch.num_accepted[b:b + 1], batch.next_token[b:b + 1], batch.recovered[b:b + 1]))


def test_reproducible_same_seed():
    x, q, p = random_case(b=8, k=5, v=16, seed=3)
    same(verify_span("exact", x, q, p, gen(42)), verify_span("exact", x, q, p, gen(42)))


# ---------------------------------------------------------------------------------------------- losslessness
def _lossless_counts(v=6, trials=20000, seed=0):
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.10, 0.20])
    g = gen(seed)
    x = torch.multinomial(q, trials, replacement=True, generator=g).view(trials, 1)
    qq = q.expand(trials, 1, v).contiguous()
    pp = torch.stack([p, torch.full((v,), 1.0 / v)]).expand(trials, 2, v).contiguous()
    out = verify_span("exact", x, qq, pp, g)
    first = torch.where(out.num_accepted > 0, x[:, 0], out.next_token)
    verified = torch.bincount(first, minlength=v).double().numpy()
    unverified = torch.bincount(x[:, 0], minlength=v).double().numpy()
    pd = p.double() / p.double().sum()
    return verified, unverified, (pd * trials).numpy()


def test_exact_rule_is_lossless():
    verified, unverified, expected = _lossless_counts()
    assert chisquare(verified, expected).pvalue > 1e-3
    # power check: the raw drafts (no verification) follow q, and the same test must reject them
    assert chisquare(unverified, expected).pvalue < 1e-6


def test_exact_acceptance_rate_matches_theory():
    """P(accept) = sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    v, n = 6, 20000
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.10, 0.20])
    g = gen(9)
    x = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    out = verify_span("exact", x, q.expand(n, 1, v), torch.stack([p, p]).expand(n, 2, v), g)
    rate = out.num_accepted.double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 0.02


# -------------------------------------------------------------------------------------------------- lantern
def test_neighbor_table_matches_brute_force():
    g = gen(4)
    cb = torch.randint(-3, 4, (40, 3), generator=g).float()  # integer coordinates: many exact distance ties
    table = NeighborTable.from_codebook(cb, 7)
    assert table.k == 7 and table.indices.shape == (40, 7) and table.indices.dtype == torch.long
    d = ((cb[:, None].double() - cb[None].double()) ** 2).sum(-1)
    for i in range(40):
        order = sorted((j for j in range(40) if j != i), key=lambda j: (d[i, j].item(), j))[:7]
        assert table.indices[i].tolist() == order
        assert i not in table.indices[i].tolist()


def test_neighbor_table_chunked_and_clamped(monkeypatch):
    import ciar.collab.acceptance as acc
    cb = torch.randn(50, 4, generator=gen(8))
    full = NeighborTable.from_codebook(cb, 10)
    monkeypatch.setattr(acc, "_CHUNK_ELEMS", 4 * 50 * 3)  # 3 rows per chunk
    assert torch.equal(NeighborTable.from_codebook(cb, 10).indices, full.indices)
    clamped = NeighborTable.from_codebook(cb, 500)
    assert clamped.k == 49
    assert all(sorted(r) == [j for j in range(50) if j != i] for i, r in enumerate(clamped.indices.tolist()))
    assert NeighborTable.from_codebook(cb, 10).to("cpu").indices.device.type == "cpu"


def test_lantern_delta_zero_equals_exact():
    v = 16
    table = NeighborTable.from_codebook(torch.randn(v, 4, generator=gen(1)), 6)
    for seed in range(10):
        x, q, p = random_case(b=12, k=5, v=v, seed=seed)
        span = torch.randint(0, 6, (12,), generator=gen(seed))
        same(verify_span("exact", x, q, p, gen(seed), span_len=span),
             verify_span("lantern", x, q, p, gen(seed), span_len=span, neighbors=table,
                         lantern=LanternConfig(k=6, delta=0.0)))


def test_lantern_accepts_at_least_as_often():
    v = 32
    table = NeighborTable.from_codebook(torch.randn(v, 4, generator=gen(1)), 10)
    x, q, p = random_case(b=400, k=4, v=v, seed=2)
    exact = verify_span("exact", x, q, p, gen(5))
    relaxed = verify_span("lantern", x, q, p, gen(5), neighbors=table, lantern=LanternConfig(k=10, delta=0.3))
    # same uniforms: the relaxed ratio is never smaller, so every row accepts at least as many drafts
    assert (relaxed.num_accepted >= exact.num_accepted).all()
    assert relaxed.num_accepted.sum() > exact.num_accepted.sum()


def test_gsd_without_a_group_equals_exact():
    """A group of the draft alone (no ranks around it, or no neighbour near enough): the exact rule."""
    v = 16
    emb = torch.randn(v, 4, generator=gen(1))
    for seed in range(10):
        x, q, p = random_case(b=12, k=5, v=v, seed=seed)
        span = torch.randint(0, 6, (12,), generator=gen(seed))
        for cfg in (GsdConfig(ranks=0), GsdConfig(ranks=7, distance=0.0)):
            same(verify_span("exact", x, q, p, gen(seed), span_len=span),
                 verify_span("gsd", x, q, p, gen(seed), span_len=span, token_embeddings=emb, gsd=cfg))


def test_gsd_fixed_case():
    """Draft 0: p(0) = 0.05 < q(0) = 0.2 (the exact test keeps it with probability 0.25), but token 1 is near it in
    p's ranking, in probability (0.15) and in embedding (squared distance 0.25): p(G) = 0.2 = q(G) -> always kept.
    Tokens 2 and 3 carry p's mass but are far in embedding."""
    emb = torch.tensor([[0.0], [0.5], [5.0], [9.0]])
    p = torch.tensor([[[0.05, 0.15, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.2, 0.0, 0.4, 0.4]]])
    x = torch.tensor([[0]])
    kept = [int(verify_span("gsd", x, q, p, gen(s), token_embeddings=emb).num_accepted) for s in range(50)]
    exact = [int(verify_span("exact", x, q, p, gen(s)).num_accepted) for s in range(50)]
    assert kept == [1] * 50 and 0 < sum(exact) < 50
    far = verify_span("gsd", x, q, p, gen(0), token_embeddings=emb * 10)  # token 1 no longer near: exact's verdict
    same(far, verify_span("exact", x, q, p, gen(0)))
    with pytest.raises(ValueError, match="token_embeddings"):
        verify_span("gsd", x, q, p, gen(0))


def test_lantern_fixed_case():
    """Draft 0 has p = 0, but its neighbour 1 carries 0.1 <= delta: p~(0) = 0.1 >= q(0) -> accepted."""
    cb = torch.tensor([[0.0], [1.0], [5.0], [9.0]])
    table = NeighborTable.from_codebook(cb, 3)
    assert table.indices[0].tolist() == [1, 2, 3]
    x = torch.tensor([[0]])
    q = torch.tensor([[[0.1, 0.3, 0.3, 0.3]]])
    p = torch.tensor([[[0.0, 0.1, 0.5, 0.4], [0.0, 0.0, 1.0, 0.0]]])
    for seed in range(10):
        out = verify_span("lantern", x, q, p, gen(seed), neighbors=table, lantern=LanternConfig(k=3, delta=0.15))
        assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [2]
        # prefix sums 0.1, 0.6 -> only 0.1 fits under 0.15; with k = 1 still 0.1; delta 0.05 -> nothing moves
        out = verify_span("lantern", x, q, p, gen(seed), neighbors=table, lantern=LanternConfig(k=3, delta=0.05))
        assert out.num_accepted.tolist() == [0] and out.recovered.tolist() == [True]


# --------------------------------------------------------------------------------------------------- greedy
def test_greedy_cases():
    x = torch.tensor([[2, 1, 0], [0, 1, 2], [1, 1, 1]])
    q = torch.full((3, 3, 4), 0.25)
    p = torch.tensor([
        [[0.1, 0.1, 0.7, 0.1], [0.1, 0.6, 0.2, 0.1], [0.2, 0.2, 0.2, 0.4], [0.9, 0.1, 0.0, 0.0]],
        [[0.4, 0.4, 0.1, 0.1], [0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.5, 0.3], [0.0, 0.0, 0.0, 1.0]],
        [[0.3, 0.3, 0.2, 0.2], [0.1, 0.5, 0.2, 0.2], [0.1, 0.5, 0.2, 0.2], [0.1, 0.5, 0.2, 0.2]],
    ])
    for seed in range(3):
        out = verify_span("greedy", x, q, p, gen(seed))
        # row 0: 2, 1 match; position 2 argmax 3 != 0 -> 2 accepted, token 3
        # row 1: ties -> lowest index: 0 matches, 0 != 1 -> 1 accepted, token 0
        # row 2: tie at position 0 -> argmax 0 != 1 -> 0 accepted, token 0
        assert out.num_accepted.tolist() == [2, 1, 0]
        assert out.next_token.tolist() == [3, 0, 0]
        assert out.recovered.tolist() == [True, True, True]
    out = verify_span("greedy", x[1:2], q[1:2], p[1:2], gen(), span_len=torch.tensor([1]))
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [0] and out.recovered.tolist() == [False]


def test_greedy_full_accept_bonus_reads_no_draw():
    x = torch.tensor([[0, 2]])
    p = torch.tensor([[[0.9, 0.1, 0.0], [0.0, 0.2, 0.8], [0.1, 0.7, 0.2]]])
    q = torch.full((1, 2, 3), 1 / 3)
    outs = [verify_span("greedy", x, q, p, counter([s], [0], 2)) for s in range(5)]
    for out in outs:  # deterministic: whatever the uniforms
        assert out.num_accepted.tolist() == [2] and out.next_token.tolist() == [1] and out.recovered.tolist() == [False]


# -------------------------------------------------------------------------------------------------- cascade
def test_cascade_strict_threshold_equals_exact():
    v = 12
    emb = torch.randn(v, 16, generator=gen(3))  # distinct random rows: cos < 1 for every pair
    for seed in range(10):
        x, q, p = random_case(b=10, k=4, v=v, seed=seed)
        span = torch.randint(0, 5, (10,), generator=gen(seed))
        same(verify_span("exact", x, q, p, gen(seed), span_len=span),
             verify_span("cascade", x, q, p, gen(seed), span_len=span, cascade=CascadeConfig(threshold=1.0),
                         token_embeddings=emb))


def test_cascade_interchangeable_tokens_accepted():
    v = 4
    x = torch.tensor([[2]])
    q = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]])
    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]])  # exact rejects 2, replacement is 3
    emb = torch.eye(v)
    out = verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig(threshold=0.9), token_embeddings=emb)
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [3] and out.recovered.tolist() == [True]
    emb[3] = emb[2]  # identical rows for draft and replacement: cos = 1
    out = verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig(threshold=0.9), token_embeddings=emb)
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [0] and out.recovered.tolist() == [False]


def test_cascade_sequence_convergence():
    v = 4
    x = torch.tensor([[2, 1]])
    q = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]])
    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]])
    emb = torch.eye(v)
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.01], [0.0, 1.0]]])  # h0 ~ h1, h1 !~ h2
    cfg = CascadeConfig(threshold=0.9, seq_threshold=0.95)
    out = verify_span("cascade", x, q, p, gen(), cascade=cfg, token_embeddings=emb, target_hidden=hidden)
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [3] and out.recovered.tolist() == [True]
    out = verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig(threshold=0.9), token_embeddings=emb,
                      target_hidden=hidden)  # seq_threshold None: hidden states ignored
    assert out.num_accepted.tolist() == [0]


# ------------------------------------------------------------------------------------------ dtypes / devices
def test_float16_inputs():
    x, q, p = random_case(b=6, k=3, v=10, seed=1)
    same(verify_span("exact", x, q, p, gen(2)), verify_span("exact", x, q.half(), p.half().float(), gen(2)))
    out = verify_span("exact", x, q.half(), p.half(), gen(2))
    assert out.next_token.shape == (6,)


@pytest.mark.gpu
def test_cuda_matches_cpu_with_cpu_generator():
    x, q, p = random_case(b=6, k=3, v=10, seed=1)
    for rule in ("exact", "greedy"):
        cpu = verify_span(rule, x, q, p, gen(2))
        gpu = verify_span(rule, x.cuda(), q.cuda(), p.cuda(), gen(2))
        assert gpu.next_token.device.type == "cuda"
        assert torch.equal(cpu.num_accepted, gpu.num_accepted.cpu())
        assert torch.equal(cpu.recovered, gpu.recovered.cpu())


# ------------------------------------------------------------------------------------------------ validation
def test_bad_inputs_raise():
    x, q, p = random_case(b=2, k=3, v=5)
    with pytest.raises(ValueError, match="rule"):
        verify_span("typical", x, q, p, gen())
    with pytest.raises(ValueError, match="draft_probs"):
        verify_span("exact", x, q[:, :2], p, gen())
    with pytest.raises(ValueError, match="target_probs"):
        verify_span("exact", x, q, p[:, :3], gen())
    with pytest.raises(ValueError, match="draft_probs"):
        verify_span("exact", x, q[..., :4], p, gen())
    with pytest.raises(ValueError, match="span_len"):
        verify_span("exact", x, q, p, gen(), span_len=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="span_len"):
        verify_span("exact", x, q, p, gen(), span_len=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_span("exact", x.float(), q, p, gen())
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_span("exact", x + 5, q, p, gen())
    with pytest.raises(ValueError, match="lantern"):
        verify_span("lantern", x, q, p, gen())
    with pytest.raises(ValueError, match="neighbors"):
        verify_span("lantern", x, q, p, gen(), neighbors=NeighborTable.from_codebook(torch.randn(7, 2), 2),
                    lantern=LanternConfig())
    with pytest.raises(ValueError, match="cascade"):
        verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig())
    with pytest.raises(ValueError, match="token_embeddings"):
        verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig(), token_embeddings=torch.randn(4, 3))
    with pytest.raises(ValueError, match="target_hidden"):
        verify_span("cascade", x, q, p, gen(), cascade=CascadeConfig(), token_embeddings=torch.randn(5, 3),
                    target_hidden=torch.randn(2, 3, 4))


@pytest.mark.parametrize("make", [
    lambda: LanternConfig(k=0), lambda: LanternConfig(delta=-0.1), lambda: LanternConfig(delta=1.5),
    lambda: LanternConfig(delta=float("nan")), lambda: CascadeConfig(threshold=1.5),
    lambda: CascadeConfig(threshold=-2.0), lambda: CascadeConfig(seq_threshold=3.0),
    lambda: NeighborTable.from_codebook(torch.randn(4), 2), lambda: NeighborTable.from_codebook(torch.randn(4, 2), 0),
])
def test_bad_configs_raise(make):
    with pytest.raises(ValueError):
        make()


def test_float16_drafts_are_drawn_from_what_is_sent_and_stay_exact():
    """`quantize_draft`: the device draws from the float16 values it sends (normalised), so a draft probability
    that underflows in float16 is never drawn (no infinite p/q), and the exact rule's output follows p."""
    from ciar.collab.protocol import draft_distribution, quantize_draft

    V = 6
    q32 = torch.tensor([0.5, 0.3, 0.2 - 2e-8, 1e-8, 1e-8, 0.0])  # two entries below float16's smallest subnormal
    q_sent, q_used = quantize_draft(q32)
    assert q_sent.dtype == torch.float16 and q_used.dtype == torch.float32
    assert q_used[3] == 0 and q_used[4] == 0 and abs(float(q_used.sum()) - 1) < 1e-6
    assert torch.equal(draft_distribution(q_sent), q_used)
    p = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    drafts = torch.multinomial(q_used.expand(n, V), 1, replacement=True, generator=g)  # [n, 1]
    assert not (drafts == 3).any() and not (drafts == 4).any()
    out = verify_span("exact", drafts, q_used.expand(n, 1, V), p.expand(n, 2, V), g)
    first = torch.where(out.num_accepted == 1, drafts[:, 0], out.next_token)
    freq = torch.bincount(first, minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.01), freq  # 4 sigma of a binomial at n = 40k is ~0.01
