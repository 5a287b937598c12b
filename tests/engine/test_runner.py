"""The model runner (ciar.engine.runner): a static step whose pieces are of both kinds runs as two bucketed forwards."""

import pytest
import torch

from ciar.engine.runner import WIDTH_BUCKETS, ModelRunner, Piece
from ciar.models.gpt import build_gpt


@pytest.fixture(scope="module")
def cloud():
    """A tiny cloud whose caption (24 positions) is a wide piece."""
    torch.manual_seed(0)
    m = build_gpt("scenes-cloud", n_layer=2, dim=64, n_head=4, vocab_size=64, cls_token_num=24, caption_dim=16,
                  block_size=36)
    torch.nn.init.normal_(m.output.weight, std=0.3)
    return m.eval()


def _prefill(runner, cloud, slots, seed):
    c = cloud.config
    emb = torch.randn(1, c.cls_token_num, c.caption_dim, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(c.cls_token_num, dtype=torch.bool)
    mask[:3] = False  # caption padding
    for s in slots:
        runner.mark_caption(s, mask)
    cond = runner.condition(emb.expand(len(slots), -1, -1), torch.tensor([False, True]))
    return Piece(slots=list(slots), start=0, n=c.cls_token_num, emb=cond, want=[c.cls_token_num - 1])


def _span(cloud, slots, n, seed):
    tokens = torch.randint(0, cloud.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Piece(slots=list(slots), start=cloud.config.cls_token_num, n=n, tokens=tokens, want=list(range(n)))


@torch.no_grad()
def test_a_step_of_wide_and_narrow_pieces_runs_as_two_bucketed_forwards(cloud):
    """A prefill chunk (wide) beside a span and a decode (narrow): padded to one width the step was beyond every
    bucket and ran eagerly (dynamic), its narrow rows padded to the prefill's width. Now the narrow pieces and the
    wide one each run a static forward, and every piece's logits are those it gets in a step of its own."""
    assert cloud.config.cls_token_num > WIDTH_BUCKETS[-1]  # a prefill is a wide piece

    def run(together: bool):
        runner = ModelRunner(cloud, slots=8, static=True)
        runner.execute_step([_prefill(runner, cloud, (0, 1), 1), _prefill(runner, cloud, (2, 3), 2)])
        before, fed, computed = dict(runner.steps), runner.positions["fed"], runner.positions["computed"]
        pieces = [_span(cloud, (0, 1), 5, 3), _prefill(runner, cloud, (4, 5), 4), _span(cloud, (2, 3), 1, 5)]
        if together:
            outs = runner.execute_step(pieces).views
        else:
            outs = [runner.execute_step([p]).views[0] for p in pieces]
        return [o[0] for o in outs], {k: runner.steps[k] - before[k] for k in before}, \
            (runner.positions["fed"] - fed, runner.positions["computed"] - computed)

    mixed, steps, positions = run(True)
    alone, _, _ = run(False)
    assert steps == {"dynamic": 0, "static": 2, "graph": 0}  # one forward per kind, both bucketed
    # fed: 2 rows x (5 + 24 + 1); computed: the narrow forward 4 rows x 8 wide, the wide one 2 rows x 32
    assert positions == (60, 4 * 8 + 2 * 32)
    assert [tuple(m.shape) for m in mixed] == [(2, 5, cloud.config.vocab_size), (2, 1, cloud.config.vocab_size),
                                               (2, 1, cloud.config.vocab_size)]
    for m, a in zip(mixed, alone):
        torch.testing.assert_close(m, a, rtol=1e-4, atol=1e-4)


def test_groups_put_narrow_pieces_first_and_keep_their_order():
    pieces = [Piece([0], 0, 40), Piece([1], 9, 1), Piece([2], 0, 17), Piece([3], 9, 16)]
    assert ModelRunner.groups(pieces) == [[1, 3], [0, 2]]
    assert ModelRunner.groups(pieces[1:2]) == [[0]]


@torch.no_grad()
def test_a_pieces_logits_do_not_depend_on_what_shares_its_step():
    """The shipped cloud on this CPU: a session's span gives the same logits, to the bit, alone and beside spans of
    other lengths, and its prefill alone and beside others' (`ciar.models.gpt.batch_invariant`, which the runner
    runs its forwards in; without it the same span differed by 1.2e-5)."""
    from ciar.world import load_default_world

    cloud = load_default_world().cloud.eval()
    c = cloud.config

    def span(k, n):
        tokens = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(100 + k)).tolist()
        return Piece([2 * k, 2 * k + 1], c.cls_token_num, n, tokens=tokens, want=list(range(n)))

    def run(together: bool):
        runner = ModelRunner(cloud, 8)
        prefills = []
        for k in range(4):
            runner.mark_caption(2 * k, None)
            runner.mark_caption(2 * k + 1, None)
            emb = torch.randn(1, c.cls_token_num, c.caption_dim, generator=torch.Generator().manual_seed(k))
            prefills.append(Piece([2 * k, 2 * k + 1], 0, c.cls_token_num, want=[c.cls_token_num - 1],
                                  emb=runner.condition(emb.expand(2, -1, -1), torch.tensor([False, True]))))
        first = runner.execute_step(prefills).outputs[0].logits.clone() if together else \
            [runner.execute_step([p]).outputs[0].logits.clone() for p in prefills][0]
        mine = [span(0, 5)] + ([span(1, 1), span(2, 3), span(3, 7)] if together else [])
        return first, runner.execute_step(mine).outputs[0].logits.clone()

    (prefill_alone, alone), (prefill_with, together) = run(False), run(True)
    assert torch.equal(prefill_alone, prefill_with) and torch.equal(alone, together)


@torch.no_grad()
@pytest.mark.parametrize("pack_inputs", [False, True])
def test_a_packed_static_step_gives_the_unpacked_steps_outputs(cloud, pack_inputs):
    """Spans beside one-token decodes, padded to the span bucket's width: packed (`ModelRunner(pack=True)`: the
    projections and feed-forward on the fed tokens only, padded to a token bucket, the attention on the padded
    layout) the step gives every piece the logits and hidden states of the unpacked step, to the bit on this CPU; the
    projections ran on the bucket's tokens; a step with little padding (spans alone) is not packed."""
    from ciar.engine.runner import packed_bucket

    sizes = []  # the packed index each forward took (its length), None: unpacked

    def run(pack: bool):
        runner = ModelRunner(cloud, slots=12, static=True, pack=pack)
        runner.pack_inputs = pack_inputs
        runner.execute_step([_prefill(runner, cloud, (2 * i, 2 * i + 1), i) for i in range(5)])
        forward = cloud.forward_cached

        def spy(*a, packed=None, **k):
            sizes.append(None if packed is None else int(packed.numel()))
            return forward(*a, packed=packed, **k)

        runner.cloud = type("Spied", (), {"forward_cached": staticmethod(spy),
                                          "__getattr__": lambda self, n: getattr(cloud, n)})()
        c = cloud.config
        decode = [Piece([2 * i, 2 * i + 1], c.cls_token_num, 1, tokens=[7 + i], want=[0]) for i in (1, 2, 4)]
        mixed = runner.execute_step([_span(cloud, (0, 1), 6, 3)] + decode + [_span(cloud, (6, 7), 3, 9)])
        spans = runner.execute_step([_span(cloud, (8, 9), 8, 5)])  # 16 of 16 positions fed: nothing to pack
        return [(o.logits.clone(), o.hidden.clone()) for o in mixed.outputs + spans.outputs], dict(runner.positions)

    plain, plain_positions = run(False)
    assert sizes == [None, None]
    packed, positions = run(True)
    assert sizes == [None, None, 32, None]
    for (lp, hp), (lq, hq) in zip(plain, packed):
        assert torch.equal(lp, lq) and torch.equal(hp, hq)
    fed = 2 * (6 + 3 + 3)  # the mixed step: 24 fed of 10 rows x 8 (bucket 16 x 8 = 128): 32 tokens
    assert packed_bucket(16, 8, fed) == 32 and positions["packed"] == 32 and plain_positions["packed"] == 0
    assert positions["fed"] == plain_positions["fed"] and positions["computed"] == plain_positions["computed"]


def test_packed_buckets():
    from ciar.engine.runner import packed_bucket

    assert packed_bucket(128, 8, 292) == 512  # 50 decodes and 12 spans of CFG rows: 512 of 1,024 positions
    assert packed_bucket(128, 8, 900) is None  # little padding: unpacked
    assert packed_bucket(128, 1, 100) is None and packed_bucket(4, 32, 20) is None  # not a span width
    runner = ModelRunner(build_gpt("scenes-cloud", n_layer=1, dim=32, n_head=2, vocab_size=16, cls_token_num=4,
                                   caption_dim=8, block_size=8), slots=4, static=True, pack=True)
    assert runner.token_buckets(8, 8) == [8, 16, 32] and runner.token_buckets(8, 1) == []
    with pytest.raises(ValueError, match="static"):
        ModelRunner(runner.cloud, slots=4, static=False, pack=True)


def test_consecutive_gives_the_indices_from_each_first_in_order():
    """`consecutive`: a step's row and position indices in a handful of operations, the same as one arange per range."""
    from ciar.engine.runner import consecutive

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 7, (1,), generator=g))
        firsts = torch.randint(0, 60, (n,), generator=g).tolist()
        counts = torch.randint(0, 6, (n,), generator=g).tolist()  # (an empty range too)
        want = torch.cat([torch.arange(f, f + c) for f, c in zip(firsts, counts)])
        assert torch.equal(consecutive(firsts, counts), want)
        c = int(torch.randint(1, 5, (1,), generator=g))
        assert torch.equal(consecutive(firsts, c), torch.cat([torch.arange(f, f + c) for f in firsts]))
