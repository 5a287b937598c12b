"""Chameleon / Anole decoder (`ciar.models.chameleon`) against transformers' `ChameleonForConditionalGeneration`.

Tiny random models built with transformers' own config and module (2 layers, width 64, 4 heads over 2 kv heads, rope
theta 500, a 300-token vocabulary whose 64 "IMGIMG" tokens are the image codes), with random qk-norm weights and
biases, are loaded into our class through `load_chameleon`, and our image-code logits are compared with transformers'
at the image tokens' columns (in code order), in float32: a full forward, cached steps, a span after a prefix, CFG
rows and the verifier's model runner. transformers' `forward` sets the image tokens' logits to the dtype's minimum
(its text generation may not emit them), so the reference logits are `lm_head` over its decoder's hidden states.
Each parity assertion names its max abs diff (run with `-s` to see them printed).
"""

from __future__ import annotations

import pytest
import torch

from ciar.engine.runner import ModelRunner, Piece
from ciar.models.checkpoint import CheckpointMismatchError
from ciar.models.chameleon import (ChameleonConfig, ChameleonGPT, chameleon_config_from_hf,
                                   image_token_ids_from_vocabulary_map, load_chameleon)
from ciar.text import CaptionTooLongError

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

N_CODES, TEXT_VOCAB = 64, 300
CLS, BLOCK = 8, 16  # padded prompt length (with <s>, end-of-turn, begin-of-image); image tokens (4 x 4)
TOL = 1e-5
BOS, PAD = 0, 1
EOI, BOI, EOT = 4 + N_CODES, 5 + N_CODES, 6 + N_CODES
TINY_VQ = dict(base_channels=32, channel_multiplier=[1, 1], num_embeddings=N_CODES, embed_dim=8, latent_channels=8,
               resolution=32, attn_resolutions=[])


def code_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(ch)) for ch in str(code)) + "Z"


def vocabulary_map(shuffle: bool) -> dict[str, int]:
    """A tiny Chameleon vocabulary: 4 specials, the image tokens (ids 4..67; in code order, or shuffled), the image
    and turn markers, then text tokens."""
    vm = {"<s>": BOS, "<pad>": PAD, "</s>": 2, "<unk>": 3}
    ids = torch.arange(4, 4 + N_CODES)
    if shuffle:
        ids = ids[torch.randperm(N_CODES, generator=torch.Generator().manual_seed(7))]
    vm.update({code_name(code): int(tok) for code, tok in enumerate(ids)})
    vm.update({"<eoss>": EOI, "<racm3:break>": BOI, "<reserved08706>": EOT, "<image>": 7 + N_CODES})
    vm.update({f"text{i}": i for i in range(8 + N_CODES, TEXT_VOCAB)})
    return vm


def hf_model(shuffle: bool = False, seed: int = 0):
    cfg = transformers.ChameleonConfig(
        vocab_size=TEXT_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-5,
        max_position_embeddings=64, initializer_range=0.1, vocabulary_map=vocabulary_map(shuffle), vq_config=TINY_VQ)
    torch.manual_seed(seed)
    model = transformers.ChameleonForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random qk-norm and RMSNorm affines (their init is ones / zeros)
        for name, p in model.named_parameters():
            if "norm" in name and "vqmodel" not in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model


def ours(hf) -> ChameleonGPT:
    return load_chameleon(hf.state_dict(), hf.config.to_dict(), cls_token_num=CLS, block_size=BLOCK)


@pytest.fixture(scope="module", params=[False, True], ids=["codes-in-order", "codes-shuffled"])
def pair(request):
    hf = hf_model(shuffle=request.param)
    return hf, ours(hf)


def text_ids(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8 + N_CODES, TEXT_VOCAB, (n,), generator=g).tolist() for n in lengths]


def codes(b: int, n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, N_CODES, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_code_logits(hf, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' image-code logits [B, S, n_codes] (unmasked lm_head) of token ids [B, S]; with a key mask
    [B, S] the positions are the absolute ones of the padded row (as ours)."""
    kw = {}
    if mask is not None:
        kw = dict(attention_mask=mask.long(), position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    h = hf.model(input_ids=ids, **kw).last_hidden_state
    return hf.lm_head(h)[..., hf.model.vocabulary_mapping.convert_img2bpe(torch.arange(N_CODES)).long()]


def sequence(model: ChameleonGPT, cond: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    return torch.cat([cond, model.image_token_ids[image]], dim=1)


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> float:
    diff = (got - want).abs().max().item()
    print(f"[chameleon parity] {name}: max abs diff {diff:.3e}")
    assert diff <= tol, f"{name}: max abs diff {diff:.3e} > {tol}"
    return diff


def test_the_code_mapping_and_config_are_transformers_own():
    for shuffle in (False, True):
        vm = vocabulary_map(shuffle)
        want = transformers.models.chameleon.modeling_chameleon.ChameleonImageVocabularyMapping(vm).img2bpe
        ids = image_token_ids_from_vocabulary_map(vm)
        assert ids.tolist() == [want[c] for c in range(N_CODES)]
    cfg = chameleon_config_from_hf(hf_model().config.to_dict(), cls_token_num=CLS, block_size=BLOCK)
    assert (cfg.dim, cfg.n_layer, cfg.n_head, cfg.kv_heads, cfg.ffn_hidden) == (64, 2, 4, 2, 96)
    assert (cfg.rope_base, cfg.vocab_size, cfg.text_vocab_size) == (500.0, N_CODES, TEXT_VOCAB)
    assert (cfg.bos_token_id, cfg.pad_token_id, cfg.boi_token_id, cfg.eot_token_id) == (BOS, PAD, BOI, EOT)
    assert ChameleonConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="swin_norm"):
        chameleon_config_from_hf({**hf_model().config.to_dict(), "swin_norm": True})


@torch.no_grad()
def test_full_forward_matches_transformers(pair):
    hf, model = pair
    cond, mask = model.prompt_condition(text_ids([CLS - 3, CLS - 3]))  # full-length prompts: no padding
    assert bool(mask.all()) and cond[0, 0] == BOS and cond[0, -2:].tolist() == [EOT, BOI]
    image = codes(2, BLOCK)
    logits, _ = model(image, cond, mask)  # [B, BLOCK + 1, n_codes]: position j predicts image token j
    assert logits.shape == (2, BLOCK + 1, N_CODES)
    want = hf_code_logits(hf, sequence(model, cond, image))[:, CLS - 1:]
    check("full forward", logits, want)


@torch.no_grad()
def test_left_padded_prompts_match_transformers(pair):
    """A short prompt left-padded and masked: equal to transformers given the same mask and positions, and (RoPE is
    relative) to the unpadded prompt at positions from 0 up to rounding."""
    hf, model = pair
    cond, mask = model.prompt_condition(text_ids([CLS - 3, 2]))
    assert mask[1].tolist() == [False] * (CLS - 5) + [True] * 5
    image = codes(2, BLOCK)
    logits, _ = model(image, cond, mask)
    seq = sequence(model, cond, image)
    full_mask = torch.cat([mask, torch.ones(2, BLOCK, dtype=torch.bool)], 1)
    check("left-padded prompt, same positions", logits, hf_code_logits(hf, seq, full_mask)[:, CLS - 1:])
    unpadded = seq[1:, CLS - 5:]
    check("left-padded prompt vs unpadded (RoPE shift)", logits[1:], hf_code_logits(hf, unpadded)[:, 4:], tol=1e-4)


@torch.no_grad()
def test_cached_steps_match_transformers(pair):
    """Prefill the prompt, then one image token at a time through the KV cache."""
    hf, model = pair
    cond, mask = model.prompt_condition(text_ids([CLS - 3, 3]))
    image = codes(2, BLOCK)
    full_mask = torch.cat([mask, torch.ones(2, BLOCK, dtype=torch.bool)], 1)
    want = hf_code_logits(hf, sequence(model, cond, image), full_mask)[:, CLS - 1:]
    cache = model.new_cache(2)
    got = [model.prefill(cache, cond, mask)]
    for i in range(BLOCK):
        got.append(model.decode(cache, image[:, i:i + 1], torch.tensor([CLS + i]))[:, 0])
    check("cached one token at a time", torch.stack(got, 1), want)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_a_span_after_a_prefix_matches_transformers(pair, static):
    """The verifier's call: rows at different committed lengths, on swapped cache slots, each feeding a span of
    several positions at its own positions, in one forward."""
    hf, model = pair
    cond, mask = model.prompt_condition(text_ids([CLS - 3, 4]))
    image = codes(2, BLOCK)
    full_mask = torch.cat([mask, torch.ones(2, BLOCK, dtype=torch.bool)], 1)
    want = hf_code_logits(hf, sequence(model, cond, image), full_mask)
    cache = model.new_cache(2)
    slots = torch.tensor([1, 0])
    model.prefill(cache, cond, mask, slots=slots)
    prefix = [6, 3]  # committed image tokens per row before the span
    width = 4
    for r, (s, n) in enumerate(zip(slots.tolist(), prefix)):
        model.decode(cache, image[r:r + 1, :n], torch.arange(CLS, CLS + n), slots=torch.tensor([s]))
    pos = torch.stack([CLS + n + torch.arange(width) for n in prefix])  # [2, width] per-row positions
    toks = torch.stack([image[r, n:n + width] for r, n in enumerate(prefix)])
    h = model.forward_cached(cache, model.tok_embeddings(toks), pos, slots, kv_len=CLS + BLOCK if static else None,
                             static=static)
    got = model.logits(h)
    ref = torch.stack([want[r, CLS + n:CLS + n + width] for r, n in enumerate(prefix)])
    check(f"span after a prefix ({'static' if static else 'dynamic'})", got, ref)


@torch.no_grad()
def test_cfg_rows_are_the_prompt_and_anoles_unconditional_prompt(pair):
    hf, model = pair
    cond, mask = model.prompt_condition(text_ids([CLS - 3, 2]))
    rows, row_mask, drop = model.cfg_condition(cond, mask)
    assert drop.tolist() == [False, False, True, True]
    assert rows[2:, -2:].tolist() == [[BOS, BOI]] * 2 and bool((rows[2:, :-2] == PAD).all())
    assert row_mask[2:].tolist() == [[False] * (CLS - 2) + [True, True]] * 2
    assert torch.equal(model.embed_condition(cond, drop[2:]), model.embed_condition(rows[2:]))
    image = codes(4, 3)
    image[2:] = image[:2]  # CFG rows feed the same tokens
    cache = model.new_cache(4)
    got = [model.prefill(cache, rows, row_mask, drop)]
    for i in range(image.shape[1]):
        got.append(model.decode(cache, image[:, i:i + 1], torch.tensor([CLS + i]))[:, 0])
    got = torch.stack(got, 1)  # [4, 4, n_codes]
    plain = model.new_cache(2)
    check("CFG cond rows vs a prefill without CFG", got[:2, 0], model.prefill(plain, cond, mask))
    full_mask = torch.cat([row_mask, torch.ones(4, image.shape[1], dtype=torch.bool)], 1)
    check("CFG rows (cond + uncond)", got, hf_code_logits(hf, sequence(model, rows, image), full_mask)[:, CLS - 1:])
    bos_boi = sequence(model, torch.tensor([[BOS, BOI]] * 2), image[2:])  # Anole's uncond prompt, unpadded
    check("uncond row vs unpadded [<s>, begin-of-image]", got[2:], hf_code_logits(hf, bos_boi)[:, 1:], tol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_the_model_runner_drives_it(pair, static):
    """`ModelRunner` with two CFG sessions: a chunked prefill of one beside the other's, a decode step, then a span
    (the verify) of one session beside a decode of the other; every wanted logit equals transformers'."""
    hf, model = pair
    runner = ModelRunner(model, slots=4, static=static)
    cond, mask = model.prompt_condition(text_ids([CLS - 3, 3]))
    sessions = []
    for i in range(2):  # session i: slots (2i cond, 2i + 1 uncond)
        rows, row_mask, drop = model.cfg_condition(cond[i:i + 1], mask[i:i + 1])
        for j, slot in enumerate((2 * i, 2 * i + 1)):
            runner.mark_caption(slot, row_mask[j])
        sessions.append(dict(slots=[2 * i, 2 * i + 1], emb=model.embed_condition(rows, drop), ids=rows,
                             mask=row_mask))
    image = codes(2, 6)
    a, b = sessions
    half = CLS // 2
    out = runner.execute_step([Piece(a["slots"], 0, half, emb=a["emb"][:, :half]),
                               Piece(b["slots"], 0, CLS, emb=b["emb"], want=[CLS - 1])]).views
    got = {("b", 0): out[1][0][:, 0]}
    out = runner.execute_step([Piece(a["slots"], half, CLS - half, emb=a["emb"][:, half:], want=[CLS - half - 1]),
                               Piece(b["slots"], CLS, 1, tokens=[int(image[1, 0])], want=[0])]).views
    got[("a", 0)], got[("b", 1)] = out[0][0][:, 0], out[1][0][:, 0]
    out = runner.execute_step([Piece(a["slots"], CLS, 5, tokens=image[0, :5].tolist(), want=[0, 1, 2, 3, 4]),
                               Piece(b["slots"], CLS + 1, 1, tokens=[int(image[1, 1])], want=[0])]).views
    for k in range(5):
        got[("a", k + 1)] = out[0][0][:, k]
    got[("b", 2)] = out[1][0][:, 0]
    for name, s, row in (("a", a, 0), ("b", b, 1)):
        seq = sequence(model, s["ids"], image[row:row + 1].expand(2, -1))
        full_mask = torch.cat([s["mask"], torch.ones(2, image.shape[1], dtype=torch.bool)], 1)
        want = hf_code_logits(hf, seq, full_mask)[:, CLS - 1:]
        steps = sorted(k for (n, k) in got if n == name)
        check(f"runner ({'static' if static else 'dynamic'}) session {name}",
              torch.stack([got[(name, k)] for k in steps], 1), want[:, steps])
    assert runner.steps["static" if static else "dynamic"] == 3


def test_the_loader_names_every_key_that_does_not_fit():
    hf = hf_model()
    state = dict(hf.state_dict())
    assert any(k.startswith("model.vqmodel.") for k in state)  # ignored by name: the world loads its own VQGAN
    del state["model.layers.1.self_attn.k_norm.bias"]
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    with pytest.raises(CheckpointMismatchError) as err:
        load_chameleon(state, hf.config.to_dict(), cls_token_num=CLS, block_size=BLOCK)
    msg = str(err.value)
    assert "missing keys (1): model.layers.1.self_attn.k_norm.bias" in msg
    assert "model.layers.0.mlp.up_proj.weight: checkpoint (95, 64) vs model (96, 64)" in msg
    assert "unexpected keys (1): model.layers.0.self_attn.rotary_emb.inv_freq" in msg


@torch.no_grad()
def test_a_transformers_folder_loads_in_bfloat16(tmp_path):
    hf = hf_model(seed=4)
    hf.save_pretrained(tmp_path)
    model = load_chameleon(tmp_path, cls_token_num=CLS, block_size=BLOCK, dtype=torch.bfloat16)
    ref = ours(hf)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model.image_token_ids.dtype == torch.long
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(torch.bfloat16)), k
    cond, mask = ref.prompt_condition(text_ids([3]))
    logits, _ = model(codes(1, BLOCK), cond, mask)
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_refusals():
    hf = hf_model()
    model = ours(hf)
    with pytest.raises(CaptionTooLongError, match="at most 8"):
        model.prompt_condition(text_ids([CLS - 2]))
    with pytest.raises(TypeError, match="integer token ids"):
        model.embed_condition(torch.zeros(1, CLS))  # e.g. ids cast to the model's dtype by a caption path
    with pytest.raises(ValueError, match="swin_norm"):
        ChameleonConfig(swin_norm=True)
    with pytest.raises(ValueError, match="image token ids"):
        ChameleonGPT(chameleon_config_from_hf(hf.config.to_dict(), cls_token_num=CLS, block_size=BLOCK),
                     torch.zeros(N_CODES, dtype=torch.long))
