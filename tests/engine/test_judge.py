"""ciar.engine.judge: the step's batched judge and sampler.

- the per-row sampler equals `logits_to_probs` row by row, to the bit;
- a step's decisions equal each decision made alone (batch independence, ragged spans, mixed settings and rules,
  targets fed over several steps);
- one host read per step;
- distributions (chi-square over many seeds, the real draws: the device's draft draw, the cloud's counter-based
  uniforms): each acceptance rule's first token follows the rule's own target distribution (p for exact; LANTERN's
  and CASCADE's relaxed ones computed in closed form), and a drawn token follows its post-guidance distribution.
"""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ciar.collab.acceptance import NeighborTable
from ciar.collab.protocol import RuleConfig
from ciar.decoding import sampling
from ciar.decoding.sampling import RowSampling, SamplingParams, logits_to_probs, rows_to_probs
from ciar.engine.judge import Draw, Judge, Span
from ciar.engine.transfer import HostPack
from ciar.models.gpt import GPTConfig, build_gpt
from ciar_device import maths

V = 6


def tiny_cloud(vocab=V, seed=0):
    torch.manual_seed(seed)
    return build_gpt(GPTConfig(dim=8, n_layer=1, n_head=2, vocab_size=vocab, cls_token_num=2, block_size=16,
                               caption_dim=4)).eval()


# ------------------------------------------------------------------------------------------- the row sampler
def test_rows_to_probs_equals_logits_to_probs_row_by_row():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    settings = [SamplingParams(), SamplingParams(cfg_scale=4.0), SamplingParams(temperature=0.0),
                SamplingParams(cfg_scale=2.5, temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
                SamplingParams(top_p=0.8), SamplingParams(cfg_scale=7.5, temperature=1.3, top_k=20, top_p=0.9),
                SamplingParams(top_k=vocab + 3), SamplingParams(temperature=1e-30), SamplingParams(top_k=1)]
    cond = torch.randn(len(settings), vocab, generator=g) * 3
    uncond = torch.randn(len(settings), vocab, generator=g) * 3
    has_uncond = torch.tensor([i % 3 != 0 for i in range(len(settings))])
    got = rows_to_probs(cond, RowSampling.of(settings), uncond, has_uncond)
    for r, params in enumerate(settings):
        want = logits_to_probs(cond[r], params, uncond_logits=uncond[r] if has_uncond[r] else None)
        assert torch.equal(got[r], want), (r, params)
    # a batch of one setting is the scalar call on the whole batch
    same = rows_to_probs(cond, RowSampling.of([settings[6]] * len(settings)), uncond)
    assert torch.equal(same, logits_to_probs(cond, settings[6], uncond_logits=uncond))
    # every row that filters keeps the same k (the unsorted top-k path), beside rows that do not filter; with ties
    one_k = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(cfg_scale=3.0, temperature=0.7, top_k=5)] * 3
    rows = RowSampling.of(one_k)
    assert (rows.min_top_k, rows.max_top_k) == (5, 5)
    tied = torch.randint(-3, 4, (len(one_k), vocab), generator=g).float()  # many equal logits: ties at the k-th
    for c in (cond[:len(one_k)], tied):
        got = rows_to_probs(c, rows, uncond[:len(one_k)])
        for r, params in enumerate(one_k):
            assert torch.equal(got[r], logits_to_probs(c[r], params, uncond_logits=uncond[r])), (r, params)


def test_the_compiled_judges_one_summary_gives_every_row_its_own_probabilities():
    """The summary a compiled judge always hands `rows_to_probs` (`Judge._envelope`: temperature and greedy on,
    top-k by the per-row path, top-p as the warm-up had it), so that no setting compiles anew: each row's
    probabilities are those of its own settings, to the bit (here eagerly: the summary, not the compiler, is
    under test)."""
    vocab = 50
    judge = Judge(tiny_cloud(vocab=vocab))
    g = torch.Generator().manual_seed(1)
    no_top_p = [SamplingParams(), SamplingParams(cfg_scale=4.0, top_k=5), SamplingParams(temperature=0.0),
                SamplingParams(cfg_scale=2.5, temperature=0.7), SamplingParams(top_k=1),
                SamplingParams(top_k=vocab - 1), SamplingParams(top_k=vocab + 3), SamplingParams(top_k=12)]
    for top_p, settings in ((False, no_top_p), (True, no_top_p + [SamplingParams(top_p=0.8, top_k=7)])):
        judge.compiled_top_p = top_p
        for single in [[p] for p in settings] + [settings]:  # each setting alone, and all in one batch
            rows = RowSampling.of(single)
            envelope = judge._envelope(RowSampling.summary(single))
            assert envelope[1:] == (top_p, True, True, -1) and 2 <= envelope[0] <= vocab - 1
            c = torch.randn(len(single), vocab, generator=g) * 3
            for logits in (c, c.round()):  # (rounded: ties at the k-th largest value)
                want = rows_to_probs(logits, rows, logits.flip(-1))
                got = rows_to_probs(logits, RowSampling(rows.cfg_scale, rows.temperature, rows.top_k, rows.top_p,
                                                        *envelope), logits.flip(-1))
                assert torch.equal(got, want), single


@pytest.mark.parametrize("packed", [False, True])
def test_host_pack_round_trip(packed):
    """One buffer, every section aligned (what a CUDA step sends by one non-blocking copy), each read back as the
    tensor that went in: dtype, shape and values."""
    pack = HostPack(torch.device("cpu"), pack=packed)
    parts = [torch.arange(5), torch.tensor([0.5, 0.25, 1e-3], dtype=torch.float16), torch.zeros(0, 3),
             torch.tensor([True, False, True]), torch.randn(2, 3, 4), torch.tensor([-2 ** 63, 2 ** 63 - 1])]
    handles = [pack.add(t) for t in parts]
    pack.send()
    for h, t in zip(handles, parts):
        assert pack[h].dtype == t.dtype and pack[h].shape == t.shape and torch.equal(pack[h], t)


def test_keyed_uniforms_equal_the_counter_uniforms():
    """The judge's draws: the (seed, stream) part on the host, the position's on the device, the same bits."""
    from ciar.decoding.sampling import counter_uniform, keyed_uniform, seed_tensor, stream_key

    seeds, positions = [0, 5, -3, 2 ** 64 + 9, 123456789], torch.arange(0, 400, 13)
    for stream in (maths.CLOUD_STREAM, maths.ACCEPT_STREAM, maths.NEXT_STREAM):
        keys = torch.tensor([stream_key(s, stream) for s in seeds])
        assert torch.equal(keyed_uniform(keys[:, None], positions[None, :]),
                           counter_uniform(seed_tensor(seeds)[:, None], stream, positions[None, :]))


def test_span_draws_from_stream_keys_equal_the_counter_draws():
    """`SpanDraws.keyed` (both streams in one call) gives `SpanDraws.counter`'s uniforms to the bit, k = 0 included."""
    from ciar.collab.acceptance import SpanDraws
    from ciar.decoding.sampling import seed_tensor, stream_keys

    seeds, positions = [0, 5, -3, 2 ** 64 + 9, 123456789], torch.tensor([0, 7, 250, 3, 99])
    for k in (0, 1, 4, 9):
        keyed = SpanDraws.keyed(stream_keys(seeds, maths.ACCEPT_STREAM), stream_keys(seeds, maths.NEXT_STREAM),
                                positions, k)
        counter = SpanDraws.counter(seed_tensor(seeds), positions, k)
        assert keyed.accept.shape == (5, k) and keyed.next.shape == (5, k + 1)
        assert torch.equal(keyed.accept, counter.accept) and torch.equal(keyed.next, counter.next)


def test_both_forms_of_the_non_finite_check_flag_the_same_rows():
    """`non_finite_rows` by the rows' extremes (a CPU's) and by one elementwise test (an accelerator's): the rows with
    a NaN or an infinity anywhere, and only those, whatever else the row holds."""
    from ciar.engine.judge import non_finite_rows

    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(0))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 39] = float("-inf")
    x[4, :] = float("inf")  # a row of one infinity: largest = smallest
    x[5, 7], x[5, 8] = float("inf"), float("-inf")
    x[6, 5], x[6, 6] = float("nan"), float("inf")
    x[7, :] = torch.finfo(torch.float32).max  # finite, however large
    x[8, 0] = torch.finfo(torch.float32).min
    want = torch.tensor([False, True, True, True, True, True, True, False, False])
    y = x.to(torch.bfloat16)  # (an accelerator's logits may be bfloat16: its own largest finite values)
    y[7, :], y[8, 0] = torch.finfo(torch.bfloat16).max, torch.finfo(torch.bfloat16).min
    for by_extremes in (True, False):
        assert torch.equal(non_finite_rows(x, by_extremes), want)
        assert torch.equal(non_finite_rows(y, by_extremes), want)
    assert torch.equal(non_finite_rows(x), want)


# ------------------------------------------------------------------------------------- batch independence
def _spans_and_draws(judge, n_spans=9, n_draws=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    rules = [RuleConfig(), RuleConfig("greedy"), RuleConfig("cascade", cascade_threshold=0.2),
             RuleConfig("lantern", lantern_k=2, lantern_delta=0.2)]
    params = [SamplingParams(), SamplingParams(cfg_scale=3.0, top_k=4), SamplingParams(temperature=0.8, top_p=0.9)]
    spans = []
    for i in range(n_spans):
        k = (0, 1, 3, 4)[i % 4]
        sp = params[i % 3]
        rows = 2 if sp.uses_cfg else 1
        q = torch.softmax(torch.randn(k, V, generator=g), -1).half()
        spans.append(Span(torch.randn(rows, k + 1, V, generator=g) * 2, torch.randint(0, V, (k,), generator=g), q,
                          sp, rules[i % 4], seed=100 + i, position=3 * i,
                          hidden=torch.randn(k + 1, judge.dim, generator=g)))
    draws = [Draw(torch.randn(2 if params[i % 3].uses_cfg else 1, V, generator=g) * 2, params[i % 3], 7 + i, i,
                  stop_entropy=(0.0, 0.9)[i % 2]) for i in range(n_draws)]
    return spans, draws


def test_a_steps_decisions_equal_each_made_alone():
    cloud = tiny_cloud()
    judge = Judge(cloud, codebook=torch.randn(V, 3, generator=torch.Generator().manual_seed(1)))
    spans, draws = _spans_and_draws(judge)
    together = judge.decide(draws, spans)
    assert not together.errors
    for i, s in enumerate(spans):
        alone = judge.decide([], [s])
        assert alone.verdicts == [together.verdicts[i]], i
    for i, d in enumerate(draws):
        alone = judge.decide([d], [])
        assert (alone.tokens, alone.stops) == ([together.tokens[i]], [together.stops[i]]), i
    # reversed order: the same decisions
    rev = judge.decide(draws[::-1], spans[::-1])
    assert rev.verdicts == together.verdicts[::-1] and rev.tokens == together.tokens[::-1]
    assert any(together.stops) and not all(together.stops)  # the entropy stop is decided per row


def test_a_rule_the_verifier_cannot_apply_fails_its_spans_only():
    judge = Judge(tiny_cloud())  # no codebook: LANTERN cannot run
    spans, draws = _spans_and_draws(judge)
    out = judge.decide(draws, spans)
    lantern = {i for i, s in enumerate(spans) if s.rule.rule == "lantern"}
    assert set(out.errors) == lantern
    assert all(out.verdicts[i] is not None for i in range(len(spans)) if i not in lantern)
    assert len(out.tokens) == len(draws)


def test_non_finite_rows_are_named():
    judge = Judge(tiny_cloud())
    step = torch.randn(5, V)
    step[1, 2] = float("nan")
    step[3, 0] = float("-inf")
    step[4, 5] = float("inf")
    assert judge.decide([], [], step).bad == [False, True, False, True, True]


def test_one_host_read_per_step(monkeypatch):
    """Everything the step decides comes back in one transfer: the judge calls `tolist` once and reads no tensor
    on the host in any other way. (Host tensors take host paths that read them, no wait there: the top-k value and
    top-p's sort by numpy, the draws' fallback skipped when no row needs it; an accelerator's tensors never do, and
    nor do they here.)"""
    monkeypatch.setattr(sampling, "_on_host", lambda x: False)
    cloud = tiny_cloud()
    judge = Judge(cloud, codebook=torch.randn(V, 3))
    spans, draws = _spans_and_draws(judge)
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    judge.decide(draws, spans, torch.randn(12, V))
    assert reads == ["tolist"]


# ------------------------------------------------------------------------------------------- distributions
P = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
Q = np.array([0.30, 0.05, 0.25, 0.10, 0.10, 0.20])
TRIALS = 20_000


def _first_tokens(judge, rule: RuleConfig, p=P, q=Q, trials=TRIALS):
    """One-draft spans judged in ONE step, a seed each: the draft drawn as a device draws it (its float16 q, the
    draft stream), the verdict with the cloud's draws. -> the first committed token of each."""
    q_sent, q_used = maths.quantize_draft(q.astype(np.float32))
    logits = torch.log(torch.tensor(p, dtype=torch.float32)).expand(1, 2, V)
    spans = []
    for s in range(trials):
        x = maths.sample(q_used, maths.uniform(s, maths.DRAFT_STREAM, 5))
        spans.append(Span(logits, torch.tensor([x]), torch.from_numpy(q_sent).view(1, V), SamplingParams(), rule,
                          seed=s, position=5))
    out = judge.decide([], spans)
    first = [x if n == 1 else z for s, (n, z, _) in zip(spans, out.verdicts) for x in [int(s.drafts[0])]]
    return np.bincount(first, minlength=V).astype(float), q_used.astype(np.float64)


def _relaxed_target(p, q, accept):
    """First-token distribution of a rule that keeps draft x ~ q with probability accept[x] and otherwise draws
    from the residual normalise(max(0, p - q))."""
    r = np.maximum(p - q, 0)
    r = r / r.sum()
    return q * accept + (1 - (q * accept).sum()) * r


def _assert_follows(counts, target, trials=TRIALS):
    target = target / target.sum()
    keep = target > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], target[keep] * trials).pvalue > 1e-4


def test_exact_rule_follows_p_with_the_real_draws():
    counts, q = _first_tokens(Judge(tiny_cloud()), RuleConfig())
    _assert_follows(counts, P)
    assert chisquare(counts, q * TRIALS).pvalue < 1e-6  # power: the drafts themselves follow q, not p


def test_lantern_rule_follows_its_relaxed_target():
    codebook = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]])
    judge = Judge(tiny_cloud(), codebook=codebook)
    rule = RuleConfig("lantern", lantern_k=2, lantern_delta=0.4)
    counts, q = _first_tokens(judge, rule)
    nbr = NeighborTable.from_codebook(codebook, 2).indices.numpy()
    moved = []
    for x in range(V):  # the largest prefix sum of p over x's neighbours (distance order) that is <= delta
        prefix = np.cumsum(P[nbr[x]].astype(np.float32))
        moved.append(max([m for m in prefix if m <= 0.4], default=0.0))
    accept = np.minimum(1.0, (P + np.array(moved)) / q)
    _assert_follows(counts, _relaxed_target(P, q, accept))
    assert chisquare(counts, P * TRIALS).pvalue < 1e-6  # and it is not p: the relaxation is measurable


def test_cascade_rule_follows_its_relaxed_target():
    cloud = tiny_cloud()
    with torch.no_grad():  # output rows: tokens 0-1 and 2-3 near each other, 4 and 5 apart from everything
        e = torch.zeros(V, cloud.config.dim)
        e[0, 0], e[1, 0], e[1, 1], e[2, 2], e[3, 2], e[3, 3], e[4, 4], e[5, 5] = 1, 1, 0.3, 1, 1, 0.3, 1, 1
        cloud.output.weight.copy_(e)
    judge = Judge(cloud)
    rule = RuleConfig("cascade", cascade_threshold=0.9)
    counts, q = _first_tokens(judge, rule)
    e = cloud.output.weight.detach().float()
    cos = torch.nn.functional.cosine_similarity(e[:, None], e[None, :], dim=-1).numpy()
    close = cos >= 0.9  # close[x, y]: a rejected x is kept when its replacement y is this close
    a = np.minimum(1.0, P / q)
    r = np.maximum(P - q, 0)
    r = r / r.sum()
    # z is output: kept at once (q a), rejected then kept because its replacement was close, or drawn as a
    # replacement that was not close to the rejected draft
    target = q * a + q * (1 - a) * (close * r[None, :]).sum(1) + ((q * (1 - a))[:, None] * ~close * r[None, :]).sum(0)
    assert (close & ~np.eye(V, dtype=bool)).sum() == 4  # the threshold relaxes the two pairs, nothing else
    _assert_follows(counts, target)


def test_greedy_rule_is_deterministic():
    counts, _ = _first_tokens(Judge(tiny_cloud()), RuleConfig("greedy"), trials=2000)
    assert counts[int(np.argmax(P))] == 2000


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(cfg_scale=3.0, top_k=4),
                                    SamplingParams(temperature=0.7, top_p=0.85)])
def test_drawn_tokens_follow_their_distribution(params):
    judge = Judge(tiny_cloud())
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 if params.uses_cfg else 1, V, generator=g) * 1.5
    draws = [Draw(logits, params, seed=s, position=11) for s in range(TRIALS)]
    out = judge.decide(draws, [])
    target = logits_to_probs(logits[0], params, uncond_logits=logits[1] if params.uses_cfg else None).double()
    _assert_follows(np.bincount(out.tokens, minlength=V).astype(float), target.numpy())
    # position-keyed: another position draws other tokens, the same position the same ones
    assert judge.decide(draws[:50], []).tokens == out.tokens[:50]
    moved = [Draw(logits, params, seed=s, position=12) for s in range(50)]
    assert judge.decide(moved, []).tokens != out.tokens[:50]
    assert not math.isnan(float(target.sum()))


# ------------------------------------------------------------------------------------------- a burst round's stop
def _round(rows_p: list[np.ndarray], drafts: list[int], q: list[np.ndarray], stop_entropy: float) -> Span:
    """A Jacobi round of a cloud burst on hand-made distributions (one row, no guidance)."""
    from ciar.engine.judge import Jacobi

    logits = torch.log(torch.tensor(np.stack(rows_p), dtype=torch.float32).clamp_min(1e-30))[None]  # [1, k+1, V]
    return Span(logits, torch.tensor(drafts), None, SamplingParams(), RuleConfig(), seed=4, position=7,
                jacobi=Jacobi(torch.tensor(np.stack(q), dtype=torch.float32), window=len(drafts),
                              stop_entropy=stop_entropy))


def test_a_burst_round_stops_at_its_first_confident_position_among_the_taken():
    """The entropy stop of a cloud burst by Jacobi rounds: the round ends before the first position, among those
    whose token the round takes (the kept drafts and the next token), whose entropy / log V is at or below the
    burst's threshold, as a burst of one token a forward would stop there; a confident position past a rejection
    does not stop it (that token is never taken); no threshold, no stop."""
    flat = np.full(V, 1.0 / V)  # entropy 1
    sure = np.array([0.95, 0.01, 0.01, 0.01, 0.01, 0.01])  # entropy / log 6 ~ 0.16
    judge = Judge(tiny_cloud())
    # drafts drawn from the target itself (q = p): always kept; the third position is confident
    kept = _round([flat, flat, sure, flat], [1, 2, 0], [flat, flat, sure], 0.5)
    # the second draft has no mass under p: rejected there; the confident third position is never reached
    never = np.array([0.2, 0.2, 0.0, 0.2, 0.2, 0.2])
    rejected = _round([flat, never, sure, flat], [1, 2, 0], [flat, np.eye(V)[2], sure], 0.5)
    out = judge.decide([], [kept, rejected, _round([flat, flat, sure, flat], [1, 2, 0], [flat, flat, sure], 0.1),
                            _round([flat, flat, sure, flat], [1, 2, 0], [flat, flat, sure], 0.0)])
    assert not out.errors
    assert out.verdicts[0][0] == 3 and out.span_stops.get(0) == 2  # two drafts taken, then the stop
    assert out.verdicts[1][0] == 1 and 1 not in out.span_stops
    assert out.verdicts[2][0] == 3 and 2 not in out.span_stops  # 0.16 is above a 0.1 threshold
    assert 3 not in out.span_stops
    assert set(out.redrafts) == {0, 1, 2, 3}  # every round drafts its next window
    uniform = _round([flat, flat], [3], [flat], 1.0)  # a threshold of 1 stops at once: nothing taken
    assert judge.decide([], [uniform]).span_stops == {0: 0}


def test_the_gsd_group_travels_in_the_sessions_rule():
    """GSD's group thresholds are the session's (`RuleConfig.gsd_*`, sent in its OPEN): a group of the draft alone
    (ranks 0) is the exact rule; wide thresholds accept more drafts than the exact rule; a bad value fails only
    those spans, naming the field."""
    from dataclasses import replace

    judge = Judge(tiny_cloud())
    spans, _ = _spans_and_draws(judge, n_spans=24)
    spans = [replace(s, rule=RuleConfig(), hidden=None) for s in spans]
    exact = judge.decide([], spans).verdicts
    alone = judge.decide([], [replace(s, rule=RuleConfig("gsd", gsd_ranks=0)) for s in spans])
    assert alone.verdicts == exact and not alone.errors
    wide = judge.decide([], [replace(s, rule=RuleConfig("gsd", gsd_ranks=V, gsd_prob_gap=1.0, gsd_distance=1e9))
                             for s in spans]).verdicts
    assert sum(v[0] for v in wide) > sum(v[0] for v in exact)
    bad = judge.decide([], [replace(spans[0], rule=RuleConfig("gsd", gsd_prob_gap=-1.0)), spans[1]])
    assert set(bad.errors) == {0} and "prob_gap" in str(bad.errors[0]) and bad.verdicts[1] == exact[1]


# ------------------------------------------------------------------------------------------- the compiled judge
@pytest.mark.slow  # ~1 min of compilations on a 2-core CPU (cold); make test runs the judge compiled in the GPU suite's
# tiny compiled_judge section (tests/benchmarks/test_gpu_suite.py)
def test_a_compiled_judge_decides_as_the_eager_one():
    """`Judge(compiled=True)`: the draws and the exact and greedy rules' spans by `torch.compile`d functions (here
    inductor's CPU code), beside rules it leaves eager, spans of one length and of several, draws with and without
    an entropy stop, a lone draw and a lone span (each computed twice, as one of two rows): the same decisions as
    the eager judge's on these seeded inputs (its probabilities may differ in the last bits, which none of these
    draws falls within)."""
    cloud = tiny_cloud(vocab=50)
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(cfg_scale=3.0), SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=9, top_p=0.9)]

    def span(k, rule, i):
        q = torch.softmax(torch.randn(k, 50, generator=g), -1).half()
        return Span(torch.randn(2, k + 1, 50, generator=g) * 2, torch.randint(0, 50, (k,), generator=g), q,
                    params[i % 2], rule, seed=40 + i, position=2 * i)

    steps = [  # (draws, spans) of four steps: one length; several lengths and rules; a lone draw; a lone span
        ([Draw(torch.randn(2, 50, generator=g) * 2, params[i % 2], i, 5 + i, stop_entropy=0.0) for i in range(6)],
         [span(4, RuleConfig(), i) for i in range(5)]),
        ([Draw(torch.randn(2, 50, generator=g) * 2, params[i % 2], i, 9, stop_entropy=0.95) for i in range(4)],
         [span(k, RuleConfig(), i) for i, k in enumerate((2, 4, 1, 4))] +
         [span(2, RuleConfig("greedy"), i) for i in range(3)] +
         [span(3, RuleConfig("cascade", cascade_threshold=0.2), i) for i in range(2)]),
        ([Draw(torch.randn(2, 50, generator=g) * 2, params[0], 1, 3)], []),
        ([], [span(3, RuleConfig(), 9)]),
    ]
    eager, compiled = Judge(cloud), Judge(cloud, compiled=True)
    for draws, spans in steps:
        want, got = eager.decide(draws, spans), compiled.decide(draws, spans)
        assert not want.errors and not got.errors
        assert (got.tokens, got.stops, got.verdicts) == (want.tokens, want.stops, want.verdicts)
    assert any(want.stops for want in [eager.decide(*steps[1])])  # the stop is exercised


@pytest.mark.slow  # ~30 s of compilations on a 2-core CPU (cold)
def test_a_warmed_compiled_judge_takes_any_setting_without_compiling_and_alone_or_not():
    """A compiled judge warmed with one setting (`Judge.warm`, as a Verifier starts) then decides steps whose
    draws and spans bring other settings (another guidance scale, top-k 1 / 5 / 100 / none / over the vocabulary,
    a temperature, greedy, top-p; a span of another rule): no compilation after the warm-up (top-p and the other
    rule computed eagerly: the warm-up had neither), the eager judge's decisions, and each request's decisions the
    same alone and beside the others."""
    from torch._dynamo.utils import counters

    vocab = 64
    cloud = tiny_cloud(vocab=vocab)
    compiled, eager = Judge(cloud, compiled=True), Judge(cloud)
    assert compiled.warm(SamplingParams(cfg_scale=4.0), span=4) == 3
    graphs = counters["stats"]["unique_graphs"]
    settings = [SamplingParams(cfg_scale=2.0), SamplingParams(cfg_scale=4.0, top_k=100),
                SamplingParams(cfg_scale=4.0, top_k=1), SamplingParams(temperature=0.7, top_k=5),
                SamplingParams(cfg_scale=3.0, top_p=0.9), SamplingParams(cfg_scale=4.0, temperature=0.0),
                SamplingParams(top_k=vocab + 1)]
    assert [compiled.compiles(p) for p in settings] == [True, True, True, True, False, True, True]
    assert compiled.compiles(settings[0], "exact") and not compiled.compiles(settings[0], "greedy")  # not warmed
    g = torch.Generator().manual_seed(5)

    def span(k, params, i, rule=RuleConfig()):
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1).half()
        return Span(torch.randn(2, k + 1, vocab, generator=g) * 3, torch.randint(0, vocab, (k,), generator=g), q,
                    params, rule, seed=60 + i, position=i)

    draws = [Draw(torch.randn(2, vocab, generator=g) * 3, p, i, 4 + i, stop_entropy=0.3)
             for i, p in enumerate(settings)]
    spans = [span(4, p, i) for i, p in enumerate(settings)] + [span(2, settings[1], 9, RuleConfig("greedy"))]
    together = compiled.decide(draws, spans)
    assert (together.tokens, together.stops, together.verdicts) == \
        tuple(getattr(eager.decide(draws, spans), f) for f in ("tokens", "stops", "verdicts"))
    for i, d in enumerate(draws):  # alone (a lone draw and a lone span: each as one of two rows)
        alone = compiled.decide([d], [spans[i]])
        assert (alone.tokens[0], alone.stops[0], alone.verdicts[0]) == \
            (together.tokens[i], together.stops[i], together.verdicts[i]), settings[i]
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up made every compilation these needed
