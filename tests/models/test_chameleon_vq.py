"""Chameleon / Anole VQGAN (`ciar.models.chameleon_vq`): the encoder against transformers' `ChameleonVQVAE`, the
taming key layout, strict loading of a Lightning `vqgan.ckpt` + `vqgan.yaml`, the config's field errors.

A test against Chameleon's own `chameleon/inference/vqgan.py` (encoder and decoder) runs only when CHAMELEON_SRC
points at a checkout of facebookresearch/chameleon (or GAIR-NLP/anole: the file is the same); the module is loaded
from its file path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch
import yaml

from ciar.models.checkpoint import CheckpointMismatchError, load_strict
from ciar.models.chameleon_vq import (CHAMELEON_VQ, ChameleonVQConfig, ChameleonVQConfigError, ChameleonVQModel,
                                      config_from_hf, from_hf_vqvae_state_dict, load_chameleon_vq,
                                      tensor_to_images_chameleon)

torch.set_num_threads(1)

# tiny: 32-channel multiples (taming's GroupNorm has 32 groups), two levels (downsample 2), 32 px -> 16x16 codes
TINY = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=32, resolution=32, n_embed=64, embed_dim=16)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights with O(1) activations: convs scaled by fan-in, norms near identity, codebook rows ~N(0, 1)."""
    from ciar.testing import randomize_vq_

    return randomize_vq_(model, torch.Generator().manual_seed(seed))


def pixels(b: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def tiny():
    return randomize(ChameleonVQModel(ChameleonVQConfig(**TINY, attn_resolutions=(16,)))).eval()


# ---------------------------------------------------------------------------------------------------- layout
def test_default_config_is_chameleons():
    c = CHAMELEON_VQ
    assert (c.ch, c.ch_mult, c.num_res_blocks, c.attn_resolutions, c.z_channels) == (128, (1, 1, 2, 2, 4), 2, (), 256)
    assert (c.n_embed, c.embed_dim, c.resolution, c.downsample, c.grid_size) == (8192, 256, 512, 16, 32)
    with torch.device("meta"):
        m = ChameleonVQModel()
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert len(shapes) == 293 and sum(torch.Size(s).numel() for s in shapes.values()) == 68_718_467
    # taming names: levels indexed by resolution level in both halves, the decoder's with num_res_blocks + 1 resnets
    assert shapes["encoder.down.4.block.1.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["encoder.down.2.block.0.nin_shortcut.weight"] == (256, 128, 1, 1)
    assert shapes["encoder.down.3.downsample.conv.weight"] == (256, 256, 3, 3)
    assert "encoder.down.4.downsample.conv.weight" not in shapes
    assert shapes["decoder.up.4.block.2.conv1.weight"] == (512, 512, 3, 3)
    assert shapes["decoder.up.3.block.0.nin_shortcut.weight"] == (256, 512, 1, 1)
    assert shapes["decoder.up.1.upsample.conv.weight"] == (128, 128, 3, 3)
    assert "decoder.up.0.upsample.conv.weight" not in shapes
    assert shapes["decoder.mid.attn_1.proj_out.weight"] == (512, 512, 1, 1)
    assert not any(".attn.0." in k for k in shapes)  # attn_resolutions: []: attention in the middle blocks only
    assert shapes["quantize.embedding.weight"] == (8192, 256) and shapes["post_quant_conv.weight"] == (256, 256, 1, 1)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3) and shapes["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert all(g.num_groups == 32 and g.eps == 1e-6 for g in m.modules() if isinstance(g, torch.nn.GroupNorm))


@torch.no_grad()
def test_round_trip_shapes(tiny):
    x = pixels(2, 32)
    z_q, codes = tiny.encode(x)
    assert z_q.shape == (2, 16, 16, 16) and codes.shape == (2, 16, 16) and codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < 64 and len(codes.unique()) > 1
    y = tiny.decode_code(codes.flatten(1))
    assert y.shape == (2, 3, 32, 32) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert torch.equal(tiny.decode_code(codes), y)
    torch.testing.assert_close(tiny.decode(z_q), y, atol=1e-5, rtol=1e-5)
    assert torch.equal(tiny.quantize(tiny.quantize.lookup(codes))[1], codes)  # a code quantises to itself
    # a non-square image: 32x48 px -> 16x24 codes, flat codes shaped by `grid`
    _, c2 = tiny.encode(torch.rand(1, 3, 32, 48) * 2 - 1)
    assert c2.shape == (1, 16, 24) and tiny.decode_code(c2.flatten(1), grid=(16, 24)).shape == (1, 3, 32, 48)
    with pytest.raises(ValueError, match="16x16"):
        tiny.decode_code(c2.flatten(1), grid=16)
    img = tensor_to_images_chameleon(torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5))
    assert img.shape == (1, 1, 5, 3) and img[0, 0, :, 0].tolist() == [0, 0, 127, 254, 255]  # truncated, not rounded


# ---------------------------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("attn_resolutions", [[], [16]])
@torch.no_grad()
def test_encoder_matches_transformers(attn_resolutions):
    from transformers import ChameleonVQVAEConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

    hc = ChameleonVQVAEConfig(base_channels=32, channel_multiplier=[1, 2], num_res_blocks=1, latent_channels=32,
                              resolution=32, num_embeddings=64, embed_dim=16, attn_resolutions=attn_resolutions)
    hf = randomize(ChameleonVQVAE(hc), seed=5).eval()
    ours = ChameleonVQModel(config_from_hf(hc)).eval()
    assert ours.config == ChameleonVQConfig(**TINY, attn_resolutions=tuple(attn_resolutions))
    # nested as in ChameleonForConditionalGeneration: the language model's keys are dropped, the prefix removed
    nested = {f"model.vqmodel.{k}": v for k, v in hf.state_dict().items()}
    nested["model.embed_tokens.weight"] = torch.zeros(2)
    mapped = from_hf_vqvae_state_dict(nested)
    assert mapped.keys() == from_hf_vqvae_state_dict(hf.state_dict()).keys() == hf.state_dict().keys()
    load_strict(ours, mapped, ignore_prefixes=("decoder.",), what="tiny VQGAN")

    x = pixels(3, 32, seed=7)
    want = hf.quant_conv(hf.encoder(x))
    got = ours.encode_latents(x)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, diff
    out = hf.encode(x)
    z_q, codes = ours.encode(x)
    assert torch.equal(codes.flatten(), out.image_tokens)  # HF: [B*h*w] in raster order per image
    assert (z_q - out.quantized_last_hidden_state).abs().max() <= 1e-5
    assert len(codes.unique()) > 8


# ---------------------------------------------------------------------------------------------------- loading
def yaml_doc(cfg: ChameleonVQConfig) -> dict:
    """`tokenizer/vqgan.yaml`'s nesting (taming's VQModel config, with the training loss and checkpoint path)."""
    dd = {"double_z": False, "z_channels": cfg.z_channels, "resolution": cfg.resolution, "in_channels": cfg.in_channels,
          "out_ch": cfg.out_ch, "ch": cfg.ch, "ch_mult": list(cfg.ch_mult), "num_res_blocks": cfg.num_res_blocks,
          "attn_resolutions": list(cfg.attn_resolutions), "dropout": cfg.dropout}
    return {"model": {"base_learning_rate": 4.5e-06, "target": "taming.models.vqgan.VQModel",
                      "params": {"embed_dim": cfg.embed_dim, "n_embed": cfg.n_embed, "ddconfig": dd,
                                 "ckpt_path": "/checkpoint/vqgan/last.ckpt",
                                 "lossconfig": {"target": "taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator",
                                                "params": {"disc_start": 0, "disc_weight": 0.8}}}}}


def lightning_ckpt(model: ChameleonVQModel) -> dict:
    """What PyTorch Lightning writes for taming's VQModel: the weights (with the LPIPS / discriminator loss module
    under "loss.") in "state_dict", next to optimizer and loop state."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["loss.logvar"] = torch.zeros(())
    state["loss.perceptual_loss.net.slice1.0.weight"] = torch.zeros(64, 3, 3, 3)
    state["loss.discriminator.main.0.weight"] = torch.zeros(64, 3, 4, 4)
    return {"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "1.9.0", "state_dict": state,
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": ""}},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 1e-4}]}],
            "lr_schedulers": []}


def write_files(tmp_path, ckpt: dict, doc: dict) -> tuple[str, str]:
    torch.save(ckpt, tmp_path / "vqgan.ckpt")
    (tmp_path / "vqgan.yaml").write_text(yaml.safe_dump(doc))
    return str(tmp_path / "vqgan.ckpt"), str(tmp_path / "vqgan.yaml")


@torch.no_grad()
def test_lightning_checkpoint_loads(tmp_path, tiny):
    paths = write_files(tmp_path, lightning_ckpt(tiny), yaml_doc(tiny.config))
    vq = load_chameleon_vq(*paths)
    assert not vq.training and vq.config == tiny.config
    want = tiny.state_dict()
    assert vq.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in vq.state_dict().items())
    codes = torch.randint(0, 64, (2, 256))
    assert torch.equal(vq.decode_code(codes), tiny.decode_code(codes))
    half = load_chameleon_vq(*paths, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.quantize.embedding.weight, want["quantize.embedding.weight"].bfloat16())


def _put(value):
    return lambda state, key: state.__setitem__(key, value)


@pytest.mark.parametrize("key, kind, edit", [
    ("decoder.up.0.block.1.conv2.weight", "missing", lambda state, key: state.pop(key)),
    ("encoder.down.0.attn.0.q.weight", "unexpected", _put(torch.zeros(32, 32, 1, 1))),
    ("quantize.embedding.weight", "mis-shaped", _put(torch.zeros(8192, 16))),  # 8192 codes for a 64-code config
])
def test_strict_loading_names_the_key(tmp_path, tiny, key, kind, edit):
    ckpt = lightning_ckpt(tiny)
    edit(ckpt["state_dict"], key)
    with pytest.raises(CheckpointMismatchError) as err:
        load_chameleon_vq(*write_files(tmp_path, ckpt, yaml_doc(tiny.config)))
    assert key in str(err.value) and kind in str(err.value), str(err.value)


def test_checkpoint_without_weights_or_with_objects(tmp_path, tiny):
    doc = yaml_doc(tiny.config)
    with pytest.raises(CheckpointMismatchError, match="state_dict"):
        load_chameleon_vq(*write_files(tmp_path, {"epoch": 1, "weights": lightning_ckpt(tiny)["state_dict"]}, doc))
    ckpt = lightning_ckpt(tiny) | {"hyper_parameters": Hparams(lr=1e-4)}
    with pytest.raises(CheckpointMismatchError, match="weights_only=True.*Hparams"):
        load_chameleon_vq(*write_files(tmp_path, ckpt, doc))


@dataclass
class Hparams:  # a Python object in a Lightning checkpoint: refused by weights_only unpickling
    lr: float


def test_missing_files_are_named(tmp_path, tiny):
    ckpt, yml = write_files(tmp_path, lightning_ckpt(tiny), yaml_doc(tiny.config))
    with pytest.raises(FileNotFoundError, match="ckpt_path"):
        load_chameleon_vq(str(tmp_path / "nope.ckpt"), yml)
    with pytest.raises(FileNotFoundError, match="yaml_path"):
        load_chameleon_vq(ckpt, str(tmp_path / "nope.yaml"))


# ---------------------------------------------------------------------------------------------------- yaml fields
def edited(doc: dict, path: str, value=...) -> dict:
    doc = yaml.safe_load(yaml.safe_dump(doc))
    *parents, last = path.split(".")
    d = doc
    for p in parents:
        d = d[p]
    if value is ...:
        del d[last]
    else:
        d[last] = value
    return doc


@pytest.mark.parametrize("path, value, message", [
    ("model.params.n_embed", ..., "missing field 'model.params.n_embed'"),
    ("model.params.ddconfig.ch_mult", ..., "missing field 'model.params.ddconfig.ch_mult'"),
    ("model.params", ..., "missing field 'model.params'"),
    ("model.params.ddconfig.double_z", True, "'model.params.ddconfig.double_z' = True"),
    ("model.params.ddconfig.attn_type", "linear", "'model.params.ddconfig.attn_type'"),
    ("model.params.ddconfig.flash", True, "unknown fields in 'model.params.ddconfig': ['flash']"),
    ("model.params.remap", "used.npy", "'model.params.remap'"),
    ("model.params.codebook_l2", True, "unknown fields in 'model.params': ['codebook_l2']"),
    ("model.target", "taming.models.vqgan.GumbelVQ", "'model.target'"),
    ("model.params.ddconfig.ch", 48, "'ch'"),
    ("model.params.ddconfig.resolution", 33, "'resolution'"),
    ("model.params.embed_dim", "256", "'embed_dim'"),
])
def test_yaml_errors_name_the_field(tiny, path, value, message):
    with pytest.raises(ChameleonVQConfigError) as err:
        ChameleonVQConfig.from_yaml_dict(edited(yaml_doc(tiny.config), path, value))
    assert message in str(err.value), str(err.value)


def test_yaml_round_trip(tiny):
    assert ChameleonVQConfig.from_yaml_dict(yaml_doc(CHAMELEON_VQ)) == CHAMELEON_VQ
    assert ChameleonVQConfig.from_yaml_dict(yaml_doc(tiny.config)) == tiny.config
    assert ChameleonVQConfig.from_dict(tiny.config.to_dict()) == tiny.config


# ---------------------------------------------------------------------------------------------------- Chameleon's code
def _chameleon_vqgan():
    src = os.environ.get("CHAMELEON_SRC")
    path = os.path.join(src or "", "chameleon", "inference", "vqgan.py")
    if not src or not os.path.isfile(path):
        pytest.skip("CHAMELEON_SRC (a facebookresearch/chameleon checkout) not set")
    spec = importlib.util.spec_from_file_location("chameleon_vqgan_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("attn_resolutions", [(), (16,)])
@torch.no_grad()
def test_matches_chameleons_vqgan(attn_resolutions):
    ref_mod = _chameleon_vqgan()
    cfg = ChameleonVQConfig(**TINY, attn_resolutions=attn_resolutions)
    ours = randomize(ChameleonVQModel(cfg), seed=11).eval()
    dd = yaml_doc(cfg)["model"]["params"]["ddconfig"]
    ref = ref_mod.VQModel(ddconfig=dd, n_embed=cfg.n_embed, embed_dim=cfg.embed_dim).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)  # the same names and shapes, both ways
    x = pixels(2, 32, seed=13)
    quant, _, (_, _, idx) = ref.encode(x)
    z_q, codes = ours.encode(x)
    assert torch.equal(codes.flatten(), idx.flatten()) and (z_q - quant).abs().max() <= 1e-5
    emb = ref.quantize.get_codebook_entry(codes.flatten(), (2, 16, 16, cfg.embed_dim))
    want = ref.decode(emb)
    got = ours.decode_code(codes.flatten(1))
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
