"""LlamaGen-compatible VQ tokenizer: checkpoint loading, VQ-16 key layout, shapes, the L2-normalised codebook.

Tests against LlamaGen's own `tokenizer/tokenizer_image/vq_model.py` run only when LLAMAGEN_SRC points at a
LlamaGen checkout (see tests/models/test_gpt.py); the module is loaded from its file path.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from ciar.models.checkpoint import CheckpointMismatchError, load_strict
from ciar.models.vq import VQ_CONFIGS, VQ_IGNORED_KEY_PREFIXES, build_vq, load_llamagen_vq

torch.set_num_threads(1)

# a small tokenizer in the VQ-16 family (32-channel multiples so GroupNorm has LlamaGen's 32 groups)
SMALL = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=32, codebook_size=64)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1)-activation random values for every float entry of the state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point() or "codebook_used" in name:
                continue
            r = torch.randn(t.shape, generator=g)
            if t.dim() == 4:  # conv [out, in, k, k]
                r = r / (t[0].numel()) ** 0.5
            elif t.dim() == 1 and "norm" in name and name.endswith(".weight"):
                r = 1.0 + 0.1 * r
            elif t.dim() == 1:
                r = 0.1 * r
            t.copy_(r)
    return model


def images(b: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def small():
    return randomize_(build_vq("VQ-16", **SMALL)).eval()


# ---------------------------------------------------------------------------------------------------- loading
def llamagen_checkpoint(model) -> dict:
    """What LlamaGen's vq_train.py writes: the model under "model" (with its `codebook_used` usage buffer) next
    to optimizer / discriminator state."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["quantize.codebook_used"] = torch.randint(0, 64, (65536,)).float()
    return {"model": state, "optimizer": {"state": {}, "param_groups": []},
            "discriminator": {"conv.weight": torch.zeros(1)}, "steps": 10}


def test_llamagen_checkpoint_loads(tmp_path, small):
    torch.save(llamagen_checkpoint(small), tmp_path / "vq.pt")
    loaded = load_llamagen_vq(str(tmp_path / "vq.pt"), "VQ-16", **SMALL)
    assert not loaded.training
    want = small.state_dict()
    assert set(loaded.state_dict()) == set(want)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    codes = torch.randint(0, 64, (2, 8, 8))
    with torch.no_grad():
        assert torch.equal(loaded.decode_code(codes), small.decode_code(codes))


@pytest.mark.parametrize("edit, key, kind", [
    ("drop", "decoder.conv_out.bias", "missing"),
    ("add", "encoder.conv_blocks.0.res.0.conv_shortcut.weight", "unexpected"),
    ("reshape", "quantize.embedding.weight", "mis-shaped"),
])
def test_strict_loading_names_the_key(tmp_path, small, edit, key, kind):
    ckpt = llamagen_checkpoint(small)
    state = ckpt["model"]
    if edit == "drop":
        del state[key]
    elif edit == "add":
        state[key] = torch.zeros(32, 32, 3, 3)
    else:
        state[key] = torch.zeros(128, 8)  # a 128-code checkpoint for a 64-code model
    torch.save(ckpt, tmp_path / "vq.pt")
    with pytest.raises(CheckpointMismatchError) as err:
        load_llamagen_vq(str(tmp_path / "vq.pt"), "VQ-16", **SMALL)
    assert key in str(err.value) and kind in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------------- key layout
def expected_vq_layout(ch=128, ch_mult=(1, 1, 2, 2, 4), nres=2, z=256, n_e=16384, e_dim=8) -> dict:
    """Parameter names -> shapes of LlamaGen's VQ (taming-style conv encoder/decoder), from its architecture."""
    keys = {}

    def conv(p, cin, cout, k):
        keys[p + ".weight"], keys[p + ".bias"] = (cout, cin, k, k), (cout,)

    def norm(p, c):
        keys[p + ".weight"], keys[p + ".bias"] = (c,), (c,)

    def res(p, cin, cout):
        norm(p + ".norm1", cin), conv(p + ".conv1", cin, cout, 3), norm(p + ".norm2", cout)
        conv(p + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(p + ".nin_shortcut", cin, cout, 1)

    def attn(p, c):
        norm(p + ".norm", c)
        for m in ("q", "k", "v", "proj_out"):
            conv(f"{p}.{m}", c, c, 1)

    last = len(ch_mult) - 1
    conv("encoder.conv_in", 3, ch, 3)
    cin = ch
    for lvl, m in enumerate(ch_mult):
        for i in range(nres):
            res(f"encoder.conv_blocks.{lvl}.res.{i}", cin, ch * m)
            cin = ch * m
            if lvl == last:
                attn(f"encoder.conv_blocks.{lvl}.attn.{i}", cin)
        if lvl != last:
            conv(f"encoder.conv_blocks.{lvl}.downsample.conv", cin, cin, 3)
    res("encoder.mid.0", cin, cin), attn("encoder.mid.1", cin), res("encoder.mid.2", cin, cin)
    norm("encoder.norm_out", cin), conv("encoder.conv_out", cin, z, 3)

    cin = ch * ch_mult[-1]
    conv("decoder.conv_in", z, cin, 3)
    res("decoder.mid.0", cin, cin), attn("decoder.mid.1", cin), res("decoder.mid.2", cin, cin)
    for j, lvl in enumerate(reversed(range(len(ch_mult)))):
        for i in range(nres + 1):
            res(f"decoder.conv_blocks.{j}.res.{i}", cin, ch * ch_mult[lvl])
            cin = ch * ch_mult[lvl]
            if lvl == last:
                attn(f"decoder.conv_blocks.{j}.attn.{i}", cin)
        if lvl != 0:
            conv(f"decoder.conv_blocks.{j}.upsample.conv", cin, cin, 3)
    norm("decoder.norm_out", cin), conv("decoder.conv_out", cin, 3, 3)

    keys["quantize.embedding.weight"] = (n_e, e_dim)
    conv("quant_conv", z, e_dim, 1), conv("post_quant_conv", e_dim, z, 1)
    return keys


def _meta_vq(name="VQ-16", **kw):
    with torch.device("meta"):
        m = build_vq(name, **kw)
    return m, {k: tuple(v.shape) for k, v in m.state_dict().items()}


def test_vq16_config_and_key_layout():
    cfg = VQ_CONFIGS["VQ-16"]
    assert (cfg.codebook_size, cfg.codebook_embed_dim, cfg.codebook_l2_norm) == (16384, 8, True)
    assert (cfg.ch, tuple(cfg.ch_mult), cfg.z_channels, cfg.num_res_blocks, cfg.downsample) == (128, (1, 1, 2, 2, 4),
                                                                                              256, 2, 16)
    m, got = _meta_vq()
    want = expected_vq_layout()
    assert got == want, (f"ours only: {sorted(set(got) - set(want))}; LlamaGen only: {sorted(set(want) - set(got))}; "
                         f"shapes: {[(k, got[k], want[k]) for k in set(got) & set(want) if got[k] != want[k]]}")
    assert all(mod.num_groups == 32 and mod.eps == 1e-6 for mod in m.modules() if isinstance(mod, torch.nn.GroupNorm))


def test_vq8_key_layout():
    _, got = _meta_vq("VQ-8")
    assert got == expected_vq_layout(ch_mult=(1, 2, 2, 4))


# ---------------------------------------------------------------------------------------------------- behaviour
@torch.no_grad()
def test_scenes_small_round_trip_shapes():
    vq = randomize_(build_vq("scenes-small"), seed=2).eval()
    cfg = vq.config
    assert (cfg.image_size, cfg.downsample, cfg.grid_size, cfg.codebook_size) == (48, 4, 12, 1024)
    x = images(2, 48)
    z_q, codes = vq.encode(x)
    assert z_q.shape == (2, 8, 12, 12) and codes.shape == (2, 12, 12) and codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < 1024
    y = vq.decode_code(codes.flatten(1))
    assert y.shape == (2, 3, 48, 48) and y.dtype == torch.float32
    assert torch.equal(vq.decode_code(codes), y)  # [B, h, w] and [B, h*w] codes are the same thing
    torch.testing.assert_close(vq.decode(z_q), y, atol=1e-5, rtol=1e-5)  # z_q is the looked-up code
    # quantising a looked-up code returns the same code
    again = vq.quantize(vq.quantize.lookup(codes))[1]
    assert torch.equal(again, codes)
    rec, codes2, losses, _ = vq(x)
    assert rec.shape == x.shape and torch.equal(codes2, codes) and set(losses) == {"codebook", "commit"}


@torch.no_grad()
def test_codebook_is_l2_normalised():
    vq = randomize_(build_vq("VQ-16", **SMALL), seed=3).eval()
    w = vq.quantize.embedding.weight
    assert w.norm(dim=-1).std() > 0.1  # stored rows are not unit vectors here
    cb = vq.quantize.codebook()
    torch.testing.assert_close(cb.norm(dim=-1), torch.ones(64))
    codes = torch.randint(0, 64, (2, 4, 4))
    torch.testing.assert_close(vq.quantize.lookup(codes).norm(dim=1), torch.ones(2, 4, 4))
    x = images(2, 16, seed=4)
    z_q, c = vq.encode(x)
    torch.testing.assert_close(z_q.norm(dim=1), torch.ones(2, 8, 8))
    # the nearest code is the nearest direction: scaling stored rows changes nothing
    ref_dec = vq.decode_code(codes)
    w.mul_(torch.rand(64, 1, generator=torch.Generator().manual_seed(5)) * 10 + 0.1)
    assert torch.equal(vq.encode(x)[1], c)
    torch.testing.assert_close(vq.decode_code(codes), ref_dec, atol=1e-5, rtol=1e-5)
    # the codes are the cosine-nearest codebook rows of the projected encoder output
    h = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)
    assert torch.equal(torch.einsum("bchw,nc->bnhw", h, cb).argmax(1), c)
    # a fresh quantiser starts on the unit sphere too (LlamaGen normalises at init)
    torch.testing.assert_close(build_vq("scenes-small").quantize.embedding.weight.norm(dim=-1), torch.ones(1024))


# ---------------------------------------------------------------------------------------------------- LlamaGen itself
@pytest.fixture(scope="module")
def llamagen_vq():
    src = os.environ.get("LLAMAGEN_SRC")
    if not src:
        pytest.skip("LLAMAGEN_SRC is not set: point it at a LlamaGen checkout to compare with its own code")
    path = os.path.join(src, "tokenizer/tokenizer_image/vq_model.py")
    if not os.path.isfile(path):
        pytest.fail(f"LLAMAGEN_SRC={src} has no tokenizer/tokenizer_image/vq_model.py")
    spec = importlib.util.spec_from_file_location("llamagen_vq_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vq_key_layout_equals_llamagen_source(llamagen_vq):
    for name, ctor in (("VQ-16", llamagen_vq.VQ_16), ("VQ-8", llamagen_vq.VQ_8)):
        with torch.device("meta"):
            ref = ctor()
        want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        assert want.pop("quantize.codebook_used") == (65536,)
        assert "quantize.codebook_used".startswith(VQ_IGNORED_KEY_PREFIXES)
        _, got = _meta_vq(name)
        assert got == want, (f"{name}: ours only {sorted(set(got) - set(want))}; "
                             f"LlamaGen only {sorted(set(want) - set(got))}")


def _report(what, got, want):
    print(f"\nVQ vs LlamaGen {what}: max|diff| {(got - want).abs().max().item():.3g} "
          f"(scale {want.abs().max().item():.3g})")


@torch.no_grad()
def test_small_vq_checkpoint_from_llamagen_loads_and_matches(llamagen_vq, tmp_path):
    """A LlamaGen VQModel (its ch is fixed at 128; smaller levels, z and codebook) saved as its trainer does."""
    args = llamagen_vq.ModelArgs(encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2], z_channels=64, codebook_size=128)
    torch.manual_seed(0)
    ref = randomize_(llamagen_vq.VQModel(args), seed=6).eval()
    torch.save({"model": ref.state_dict(), "steps": 1}, tmp_path / "vq.pt")
    ours = load_llamagen_vq(str(tmp_path / "vq.pt"), "VQ-16", ch_mult=(1, 2), z_channels=64, codebook_size=128)
    x = images(2, 16, seed=7)
    q_ref, _, (_, _, idx_ref) = ref.encode(x)
    q, codes = ours.encode(x)
    assert torch.equal(codes.flatten(), idx_ref)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    codes = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(8))
    want = ref.decode_code(codes, (2, 8, 8, 8))
    got = ours.decode_code(codes)
    _report("small decode_code", got, want)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_vq16_outputs_equal_llamagen(llamagen_vq):
    """The real VQ-16 architecture on random weights, 32x32 images (2x2 codes), encode and decode_code."""
    with torch.device("meta"):
        ref, ours = llamagen_vq.VQ_16(), build_vq("VQ-16")
    ref, ours = ref.to_empty(device="cpu"), ours.to_empty(device="cpu")  # skip two slow random inits
    randomize_(ref, seed=9).eval()
    ref.quantize.codebook_used.zero_()
    load_strict(ours, ref.state_dict(), ignore_prefixes=VQ_IGNORED_KEY_PREFIXES)
    ours.eval()
    x = images(2, 32, seed=10)
    q_ref, _, (_, _, idx_ref) = ref.encode(x)
    q, codes = ours.encode(x)
    assert codes.shape == (2, 2, 2) and torch.equal(codes.flatten(), idx_ref)
    _report("VQ-16 encode (quantised latents)", q, q_ref)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    # pre-quantisation latents too (the encoder itself, not only the argmin)
    torch.testing.assert_close(ours.quant_conv(ours.encoder(x)), ref.quant_conv(ref.encoder(x)), atol=1e-4, rtol=1e-4)
    codes = torch.randint(0, 16384, (2, 4), generator=torch.Generator().manual_seed(11))
    want = ref.decode_code(codes, (2, 8, 2, 2))
    got = ours.decode_code(codes)
    assert got.shape == (2, 3, 32, 32)
    _report("VQ-16 decode_code", got, want)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
