"""Caption encoder: offline MiniLM, left padding + mask, batching, precomputed (T5-style) embeddings."""

import pytest
import torch

from ciar.text import CaptionBatch, CaptionTooLongError, TextEncoder


@pytest.fixture(scope="module")
def enc():
    return TextEncoder(max_length=40)


def test_left_padded_with_mask(enc):
    b = enc.encode(["a small red circle at the top on a gray background", "a large blue square at the center "
                    "and a small green diamond at the left on a sand and sky background"])
    assert b.emb.shape == (2, 40, 384) and b.mask.shape == (2, 40)
    n = b.mask.sum(1)
    assert n[0] < n[1]
    for i in range(2):  # real tokens are right-aligned, padding is zero
        assert b.mask[i, 40 - n[i]:].all() and not b.mask[i, : 40 - n[i]].any()
        assert b.emb[i, : 40 - n[i]].abs().sum() == 0


def test_batching_does_not_change_embeddings(enc):
    caps = ["a small red circle at the top on a gray background", "a large yellow triangle at the bottom "
            "left and a small orange square at the right on a black background", "a small blue diamond at the "
            "center on a white background"]
    together = enc.encode(caps)
    alone = CaptionBatch.cat([enc.encode([c]) for c in caps])
    assert torch.equal(together.mask, alone.mask)
    assert torch.allclose(together.emb, alone.emb, atol=1e-4)


def test_bad_captions(enc):
    with pytest.raises(ValueError, match="empty"):
        enc.encode(["  "])
    with pytest.raises(CaptionTooLongError, match="caption is 62 tokens long, the model accepts at most 40"):
        enc.encode(["a red circle", "red " * 60])  # [CLS] + 60 + [SEP]: the batch is refused, never cut
    assert enc.count_tokens("red " * 38) == 40 and enc.encode(["red " * 38]).mask.all()  # exactly fits
    with pytest.raises(ValueError, match="surrogate"):  # the tokenizer itself would raise a TypeError
        enc.encode(["a red \ud800 circle"])


def test_precomputed_captions_answer_by_caption():
    from ciar.text import PrecomputedCaptions

    pc = PrecomputedCaptions(max_length=4, dim=8)
    pc.add("a", torch.randn(1, 2, 8))  # LlamaGen's T5 files are [1, n, D]
    pc.add("b", torch.randn(6, 8))
    b = pc.encode(["b", "a"])
    assert b.emb.shape == (2, 4, 8) and b.mask.sum(1).tolist() == [4, 2]
    with pytest.raises(KeyError, match="no precomputed embedding"):
        pc.encode(["c"])
    with pytest.raises(ValueError, match="expects 8"):
        pc.add("d", torch.randn(3, 5))


def test_precomputed_embeddings():
    embs = [torch.randn(3, 16), torch.randn(7, 16)]
    b = CaptionBatch.from_precomputed(embs, max_length=5)
    assert b.emb.shape == (2, 5, 16)
    assert b.mask.sum(1).tolist() == [3, 5]
    assert torch.equal(b.emb[0, 2:], embs[0]) and torch.equal(b.emb[1], embs[1][:5])
