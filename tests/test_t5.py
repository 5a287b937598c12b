"""`ciar.t5.T5CaptionEncoder` on a tiny RANDOM T5 encoder + tokenizer saved with `save_pretrained` (the real folder
format): the same numbers as a direct `T5EncoderModel` call on that folder, rearranged to LlamaGen's left padding;
a caption over max_length refused (the caption contract); LlamaGen's caption cleaning; clear errors; bfloat16."""

import pytest
import torch

from ciar.t5 import T5CaptionEncoder, clean_caption
from ciar.testing import make_tiny_t5

CAPS = ["A red bus parked on a city street.", "two dogs", "A man rides a surfboard on a large wave near the beach."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_t5(str(tmp_path_factory.mktemp("t5") / "flan-t5-tiny"))


def test_same_numbers_as_a_direct_t5_call_left_padded(folder):
    from transformers import AutoTokenizer, T5EncoderModel

    enc = T5CaptionEncoder(folder, max_length=16)
    got = enc.encode(CAPS)
    tok = AutoTokenizer.from_pretrained(folder)
    model = T5EncoderModel.from_pretrained(folder).eval()
    texts = [clean_caption(c) for c in CAPS]
    t = tok(texts, max_length=16, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).last_hidden_state
    for i in range(len(CAPS)):
        n = int(t["attention_mask"][i].sum())
        assert got.mask[i].tolist() == [False] * (16 - n) + [True] * n  # right-aligned real tokens
        assert torch.allclose(got.emb[i, 16 - n:], ref[i, :n], atol=1e-6)  # moved to the end, unchanged
        assert got.emb[i, : 16 - n].abs().sum() == 0  # zeros where padded
        assert int(t["input_ids"][i, n - 1]) == tok.eos_token_id  # the EOS is a real token
    assert enc.count_tokens(CAPS[1]) == 3 and enc.dim == 32 and got.emb.dtype == torch.float32


def test_a_caption_over_max_length_is_refused_never_cut(folder):
    from ciar.text import CaptionTooLongError

    enc = T5CaptionEncoder(folder, max_length=6)
    n = enc.count_tokens(CAPS[2])  # cleaned caption + EOS
    assert n > 6
    with pytest.raises(CaptionTooLongError, match=f"caption is {n} tokens long, the model accepts at most 6"):
        enc.encode([CAPS[1], CAPS[2]])  # the whole batch is refused, naming the long caption
    exact = T5CaptionEncoder(folder, max_length=n).encode([CAPS[2]])  # exactly the positions: accepted, whole
    assert exact.mask.all() and exact.emb.shape == (1, n, 32)
    assert enc.encode([CAPS[1]]).mask.sum() == 3


def test_batches_do_not_change_the_numbers(folder):
    enc = T5CaptionEncoder(folder, max_length=16)
    whole = enc.encode(CAPS)
    one_by_one = [enc.encode([c]) for c in CAPS]
    for i, b in enumerate(one_by_one):
        assert torch.allclose(whole.emb[i], b.emb[0], atol=1e-5) and torch.equal(whole.mask[i], b.mask[0])


@pytest.mark.parametrize("raw,clean", [
    ("A Red Bus", "a red bus"),
    ("see https://example.com/a.jpg now", "see now"),
    ("Fish &amp; chips", "fish chips"),
    ("<b>Bold</b> text", "bold text"),
    ("“Quoted” — fine", '"quoted" - fine'),
    ("a  b\\nc", "a b c"),
    ("photo_of_a_cute_little_cat", "photo of a cute little cat"),
    ("@someone a dog", "a dog"),
    ("'a dog'", "a dog"),
])
def test_caption_cleaning(raw, clean):
    assert clean_caption(raw) == clean


def test_errors_name_the_folder_and_the_caption(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="T5 folder not found: .*absent"):
        T5CaptionEncoder(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        T5CaptionEncoder(str(tmp_path / "empty"))
    enc = T5CaptionEncoder(folder, max_length=8)
    with pytest.raises(ValueError, match="caption 1 is empty"):
        enc.encode(["a dog", "   "])
    with pytest.raises(ValueError, match="dtype must be one of"):
        T5CaptionEncoder(folder, dtype="int8")


def test_bfloat16_runs_on_cpu_close_to_float32(folder):
    full = T5CaptionEncoder(folder, max_length=16).encode(CAPS)
    half = T5CaptionEncoder(folder, max_length=16, dtype="bfloat16").encode(CAPS)
    assert half.emb.dtype == torch.float32 and torch.equal(half.mask, full.mask)
    assert (half.emb - full.emb).abs().max() < 0.1 * full.emb.abs().max()


def test_the_verifier_refuses_a_long_caption_and_keeps_serving(folder):
    """The caption contract on the cloud: a T5 world's open with a caption over the GPT's caption positions fails
    with CaptionTooLongError (the API's 422), frees its slots, and the next open is served."""
    from ciar.collab.protocol import OpenRequest
    from ciar.engine.verifier import CloudVerifier, InProcessCloud
    from ciar.decoding.sampling import SamplingParams
    from ciar.models.gpt import build_gpt
    from ciar.text import CaptionTooLongError

    gpt = build_gpt("GPT-B", n_layer=1, dim=32, n_head=2, caption_dim=32, cls_token_num=8, vocab_size=16,
                    block_size=4).eval()
    cloud = InProcessCloud(CloudVerifier(gpt, T5CaptionEncoder(folder, max_length=8), max_sessions=1))
    params = SamplingParams(cfg_scale=2.0)
    with pytest.raises(CaptionTooLongError, match="at most 8"):
        cloud.open(OpenRequest("long", CAPS[2], 0, params, 2))
    reply = cloud.open(OpenRequest("short", CAPS[1], 0, params, 2))
    assert len(reply.prefix_tokens) == 2 and int(reply.caption_mask.sum()) == 3
