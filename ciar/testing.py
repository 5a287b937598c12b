"""Helpers for tests: a folder of small RANDOM-weight models in the shipped layout (not a trained world), and the
small random cloud and stub caption encoder of the collaborative-decoding tests (also what a test's engine process
builds: `tests/engine/test_process.py`)."""

from __future__ import annotations

import json
import os
import zlib
from types import SimpleNamespace

import torch

from ciar.models.checkpoint import save_model
from ciar.models.gpt import build_gpt
from ciar.models.vq import build_vq


def write_random_world(folder: str, sampling: dict | None = None, cloud_dtype: torch.dtype = torch.float16,
                       seed: int = 0, with_device: bool = False, ciar_defaults: dict | None = None) -> str:
    """Write `tokenizer.safetensors` (scenes-small) and a 2-layer, 64-wide `cloud.safetensors` into `folder`; with
    `with_device`, also a 1-layer CIAR `device.safetensors` initialised from that cloud (random Inter-Head radii),
    carrying `ciar_defaults` (ciar.collab.defaults.CIARDefaults fields, e.g. a gate and its tau) when given."""
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    vq = build_vq("scenes-small")
    save_model(vq, os.path.join(folder, "tokenizer.safetensors"), vq.config.to_dict(), kind="vq")
    cloud = build_gpt("scenes-cloud", n_layer=2, dim=64, n_head=4)
    torch.nn.init.normal_(cloud.output.weight, std=0.5)  # zero-initialised head would make every token uniform
    extra = {"sampling": sampling} if sampling is not None else {}
    save_model(cloud, os.path.join(folder, "cloud.safetensors"), cloud.config.to_dict(), kind="gpt", extra=extra,
               dtype=cloud_dtype)
    if with_device:
        from ciar.collab.device import DeviceConfig, DeviceModel

        dev = DeviceModel.from_cloud(cloud, DeviceConfig(n_layer=1))
        V = cloud.config.vocab_size
        with torch.no_grad():  # random centers; small radii that vary between positions, so U varies between tokens
            for head in dev.inter_head.heads:
                torch.nn.init.normal_(head.weight[:V], std=0.3)
                torch.nn.init.normal_(head.weight[V:], std=0.15)
                head.bias[:V].zero_()
                head.bias[V:].fill_(-4.0)
        dev.save(os.path.join(folder, "device.safetensors"),
                 extra={"ciar": ciar_defaults} if ciar_defaults is not None else None)
    return str(folder)


# a small LlamaGen-layout t2i GPT (registry GPT-B with these overrides) and VQ-16 tokenizer: 64 px -> 4 x 4 tokens;
# 24 caption positions: the tests' captions fit the tiny T5 (a longer one is refused, ciar.text's caption contract)
LLAMAGEN_SMALL_GPT = dict(n_layer=2, dim=64, n_head=4, caption_dim=32, cls_token_num=24, vocab_size=64)
LLAMAGEN_SMALL_VQ = dict(ch=16, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=1, z_channels=16, codebook_size=64)


def write_random_clip(folder: str, seed: int = 0) -> str:
    """A tiny RANDOM transformers CLIP folder (model + character-level tokenizer + image processor) for tests."""
    import json

    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.makedirs(folder, exist_ok=True)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({c + "</w>": len(letters) + i for i, c in enumerate(letters)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    tok = CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
    eos = vocab["<|endoftext|>"]
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77,
                                      bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
    torch.manual_seed(seed)
    CLIPModel(cfg).save_pretrained(folder)
    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor  # no torchvision needed
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor
    proc = CLIPProcessor(image_processor=ImageProcessor(size={"shortest_edge": 32},
                                                        crop_size={"height": 32, "width": 32}), tokenizer=tok)
    proc.save_pretrained(folder)
    return folder


def write_random_fid_inception(path: str, seed: int = 0, with_batch_counts: bool = True) -> str:
    """RANDOM weights in the FID Inception file layout (tests only; a conversion's `num_batches_tracked` keys
    included unless `with_batch_counts=False`). Batch-norm statistics are random too, so every op matters."""
    from ciar.metrics.inception import FIDInceptionV3

    g = torch.Generator().manual_seed(seed)
    net = FIDInceptionV3()
    state = {}
    for k, v in net.state_dict().items():
        if k.endswith("conv.weight"):
            fan_in = v[0].numel()
            v = torch.randn(v.shape, generator=g) * (2.0 / fan_in) ** 0.5
        elif k.endswith("running_var"):
            v = torch.rand(v.shape, generator=g) * 0.5 + 0.75
        elif k.endswith(("running_mean", "bn.bias")):
            v = torch.randn(v.shape, generator=g) * 0.1
        elif k.endswith("bn.weight"):
            v = torch.rand(v.shape, generator=g) * 0.5 + 0.75
        else:  # fc
            v = torch.randn(v.shape, generator=g) * 0.02
        state[k] = v.contiguous()
        if with_batch_counts and k.endswith("bn.running_var"):
            state[k[:-len("running_var")] + "num_batches_tracked"] = torch.tensor(0, dtype=torch.long)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(state, path)
    return path


def write_llamagen_checkpoints(folder: str, gpt_config: str, block_size: int, gpt_overrides: dict, image_size: int,
                               vq_overrides: dict, seed: int = 0,
                               names=("t2i.pt", "vq.pt", "device.safetensors")) -> tuple[str, str, str]:
    """RANDOM weights in LlamaGen's checkpoint formats, any size (the registry's `gpt_config` and VQ-16 with
    overrides): a t2i GPT `{"model": state_dict}` .pt (LlamaGen's keys, float32 as its releases), a VQ-16
    `{"model": ...}` .pt, and a 1-layer CIAR device model made from the GPT (small radii) -> the three paths."""
    from ciar.collab.device import DeviceConfig, DeviceModel

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    paths = tuple(os.path.join(folder, n) for n in names)
    gpt = build_gpt(gpt_config, block_size=block_size, **gpt_overrides)
    torch.nn.init.normal_(gpt.output.weight, std=0.5)
    torch.save({"model": gpt.state_dict(), "steps": 0}, paths[0])
    vq = build_vq("VQ-16", image_size=image_size, **vq_overrides)
    torch.save({"model": vq.state_dict()}, paths[1])
    del vq
    dev = DeviceModel.from_cloud(gpt, DeviceConfig(n_layer=1))
    with torch.no_grad():
        for head in dev.inter_head.heads:
            head.bias[gpt.config.vocab_size:].fill_(-4.0)
    dev.save(paths[2])
    return paths


def write_random_llamagen_files(folder: str, image_ids: list[int], seed: int = 0) -> dict:
    """RANDOM-weight stand-ins for the real-model path's local files, in their real formats: a LlamaGen t2i GPT
    checkpoint (`{"model": state_dict}` .pt, LlamaGen's keys), a VQ-16 `.pt`, a CIAR device model for that GPT,
    T5-style caption embeddings `t5/IMAGE_ID.npy` ([1, n, D]), a tiny CLIP folder, FID Inception-v3 weights
    (`inception.pth`, the pt_inception layout) and reference images `images/IMAGE_ID.png`. -> the `--model-config`
    dict (paths relative to `folder`)."""
    import numpy as np
    from PIL import Image

    write_llamagen_checkpoints(folder, "GPT-B", 16, LLAMAGEN_SMALL_GPT, 64, LLAMAGEN_SMALL_VQ, seed=seed,
                               names=("t2i_small.pt", "vq_small.pt", "device.safetensors"))
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "t5"), exist_ok=True)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    for i in image_ids:
        n = int(rng.integers(2, LLAMAGEN_SMALL_GPT["cls_token_num"] + 3))  # some longer than the positions
        np.save(os.path.join(folder, "t5", f"{i}.npy"),
                rng.standard_normal((1, n, LLAMAGEN_SMALL_GPT["caption_dim"])).astype(np.float32))
        Image.fromarray(rng.integers(0, 255, (40 + i % 3 * 8, 56, 3), dtype=np.uint8)).save(
            os.path.join(folder, "images", f"{i}.png"))
    write_random_clip(os.path.join(folder, "clip"), seed)
    write_random_fid_inception(os.path.join(folder, "inception.pth"), seed)
    return {"gpt_checkpoint": "t2i_small.pt", "gpt_config": "GPT-B", "image_size": 64,
            "gpt_overrides": LLAMAGEN_SMALL_GPT, "vq_checkpoint": "vq_small.pt",
            "vq_overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in LLAMAGEN_SMALL_VQ.items()},
            "device_checkpoint": "device.safetensors", "t5_embeddings": "t5", "clip_model": "clip",
            "inception_weights": "inception.pth", "reference_images": "images", "cfg_scale": 2.0, "top_k": 0}


TINY_T5_WORDS = ("a an the of on in at with and to by next near two three small large big red blue green yellow white "
                 "black orange brown pink purple gray man woman dog cat bus car street city park plate table glass "
                 "kitchen giraffe tree laptop desk window children kite kites beach frisbee pasta wine surfboard wave "
                 "refrigerator parked play plays standing rides flying sitting tall wooden sunny photo number circle "
                 "square triangle top bottom left right middle background").split()


def make_tiny_t5(folder: str, d_model: int = 32, num_layers: int = 2, num_heads: int = 2, seed: int = 0,
                 config: dict | None = None, dtype: torch.dtype = torch.float32) -> str:
    """A tiny RANDOM-weight `T5EncoderModel` and a real fast tokenizer (T5's special tokens <pad>=0, </s>=1, <unk>=2,
    an EOS appended to every caption; a word-level vocabulary built in code, no sentencepiece, no network), saved
    with `save_pretrained` into `folder` so `AutoTokenizer` / `T5EncoderModel.from_pretrained(folder)` load them as
    a real flan-t5 folder. `config` (T5Config fields, e.g. flan-t5-xl's) replaces the tiny sizes, `dtype` the
    weights' type (built in it). -> folder."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in TINY_T5_WORDS + [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="right", model_max_length=512)
    torch.manual_seed(seed)
    cfg = T5Config(**(config or dict(vocab_size=len(vocab), d_model=d_model, d_kv=d_model // num_heads,
                                     d_ff=2 * d_model, num_layers=num_layers, num_heads=num_heads,
                                     relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                                     eos_token_id=1, decoder_start_token_id=0)))
    model = T5EncoderModel._from_config(cfg, dtype=dtype).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def cutting_connection(url: str, key: str, vocab_size: int, cuts=(), **kw):
    """A `ciar_device.connection.DeviceConnection` that cuts its socket right after sending the verifies numbered in
    `cuts` (1-based), before their replies arrive: the connection drops with a request in flight, as in a tunnel
    (fault injection for the resumption tests and the device-channel fuzz run)."""
    import time

    from ciar_device import wire
    from ciar_device.connection import DeviceConnection, _Dropped

    class CuttingConnection(DeviceConnection):
        def __init__(self):
            super().__init__(url, key, vocab_size, **kw)
            self.cuts, self.verifies = set(cuts), 0

        def _exchange(self, ftype, body, token=b""):
            if ftype == wire.VERIFY:
                self.verifies += 1
                if self.verifies in self.cuts:
                    self.connect()
                    self.ws.send(wire.encode_frame(wire.Frame(wire.VERIFY, 0xFFFFFFFF, body, token)))
                    time.sleep(0.05)  # let it reach the server: the verify may be applied, its reply is lost
                    self.drop()
                    raise _Dropped("cut by the test")
            return super()._exchange(ftype, body, token)

    return CuttingConnection()


# ---------------------------------------------------------------------------------------------------- Anole
# a tiny Anole world: a 2-layer, 64-wide Chameleon decoder over 64 image codes, a 32 px VQGAN of downsampling 8
# (4 x 4 = 16 image tokens), 24 prompt positions; the BPE tokenizer knows TINY_T5_WORDS as whole words
ANOLE_TINY = dict(n_codes=64, text_vocab=512, image_size=32, cls_token_num=24)
ANOLE_TINY_VQ = dict(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[], z_channels=16,
                     resolution=32, in_channels=3, out_ch=3, dropout=0.0)
ANOLE_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}


def anole_code_name(code: int) -> str:
    """Chameleon's name of image code `code`: "IMGIMG" + its decimal digits as letters A-J + "Z"."""
    return "IMGIMG" + "".join(chr(ord("A") + int(ch)) for ch in str(code)) + "Z"


def _tiny_chameleon_vocabulary(n_codes: int, words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A vocabulary in Chameleon's layout (specials 0-3, the image tokens from 4 in code order, then <eoss>,
    <racm3:break>, the end-of-turn <reserved08706>, then text) with byte-free BPE text pieces: "▁" + characters, and
    merges that make each of `words` one token. -> (vocabulary, merges)."""
    vocab = dict(ANOLE_SPECIALS)
    vocab.update({anole_code_name(c): 4 + c for c in range(n_codes)})
    for name in ("<eoss>", "<racm3:break>", "<reserved08706>"):
        vocab[name] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz0123456789.,'-":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in words:
        pieces = ["▁"] + list(word)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            joined = pair[0] + pair[1]
            if joined not in vocab:
                vocab[joined] = len(vocab)
                merges.append(pair)
            pieces = [joined] + pieces[2:]
    return vocab, merges


def write_chameleon_tokenizer(path: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> str:
    """A Chameleon-style tokenizer.json built with `tokenizers` (BPE with "▁" word starts, lowercased; the special
    and image tokens registered as special tokens, as Chameleon's file has them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    specials = [n for n in vocab if n.startswith("<") or n.startswith("IMGIMG")]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials])
    tok.save(path)
    return path


def randomize_vq_(model: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """Random weights with O(1) activations for a VQ model, in place: convs scaled by fan-in, norms near identity,
    codebook rows ~N(0, 1), drawn from `generator` in state-dict order."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            r = torch.randn(t.shape, generator=generator)
            if t.dim() == 4:
                r /= t[0].numel() ** 0.5
            elif t.dim() == 1:
                r = 1.0 + 0.1 * r if ("norm" in name and name.endswith("weight")) else 0.1 * r
            t.copy_(r)
    return model


def write_coco_captions(path, captions: list[str], first_id: int = 1) -> str:
    """A COCO captions file (`images` + `annotations`) for `captions`, image ids from `first_id`. -> its path."""
    images = [{"id": first_id + i, "file_name": f"{first_id + i}.jpg"} for i in range(len(captions))]
    anns = [{"id": 100 + i, "image_id": first_id + i, "caption": c} for i, c in enumerate(captions)]
    with open(path, "w") as f:
        json.dump({"images": images, "annotations": anns}, f)
    return str(path)


def write_random_anole_files(folder: str, seed: int = 0, with_device: bool = True, n_layer: int = 2,
                             cls_token_num: int = ANOLE_TINY["cls_token_num"]) -> dict:
    """RANDOM-weight stand-ins for an Anole world's files, in their real layouts:
    `anole-hf/` a transformers folder saved from a tiny `ChameleonForConditionalGeneration` (config.json with its
    vocabulary_map of 64 IMGIMG image tokens, model.safetensors, and a tokenizer.json built with `tokenizers` over
    the same vocabulary), `tokenizer/vqgan.ckpt` + `vqgan.yaml` (a tiny taming VQGAN as a Lightning checkpoint,
    32 px -> 4 x 4 codes of 64) and, with `with_device`, a 1-layer CIAR `device.safetensors` made from the decoder
    (`DeviceModel.from_cloud`, small radii). -> the world file's fields (paths relative to `folder`)."""
    import yaml
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from ciar.models.chameleon_vq import ChameleonVQConfig, ChameleonVQModel

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.makedirs(folder, exist_ok=True)
    n_codes, text_vocab = ANOLE_TINY["n_codes"], ANOLE_TINY["text_vocab"]
    vocab, merges = _tiny_chameleon_vocabulary(n_codes, TINY_T5_WORDS)
    if len(vocab) > text_vocab:
        raise ValueError(f"the tiny vocabulary has {len(vocab)} tokens > {text_vocab}")
    model_dir = os.path.join(folder, "anole-hf")
    os.makedirs(model_dir, exist_ok=True)
    grid = ANOLE_TINY["image_size"] // 2 ** (len(ANOLE_TINY_VQ["ch_mult"]) - 1)
    cfg = ChameleonConfig(
        vocab_size=text_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max(64, cls_token_num + grid * grid), initializer_range=0.1, vocabulary_map=vocab,
        vq_config=dict(base_channels=32, channel_multiplier=[1, 1], num_embeddings=n_codes, embed_dim=8,
                       latent_channels=8, resolution=32, attn_resolutions=[]),
        bos_token_id=vocab["<s>"], pad_token_id=vocab["<pad>"], eos_token_id=vocab["</s>"])
    torch.manual_seed(seed)
    hf = ChameleonForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random norm affines (init: ones / zeros), a sharper head over the image rows
        for name, p in hf.named_parameters():
            if "norm" in name and "vqmodel" not in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        hf.lm_head.weight[4:4 + n_codes] = torch.randn(n_codes, 64, generator=g) * 0.5
    hf.save_pretrained(model_dir)
    write_chameleon_tokenizer(os.path.join(model_dir, "tokenizer.json"), vocab, merges)

    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    vq_cfg = ChameleonVQConfig(**ANOLE_TINY_VQ, n_embed=n_codes, embed_dim=8)
    vq = randomize_vq_(ChameleonVQModel(vq_cfg), g)
    torch.save({"epoch": 0, "global_step": 0, "state_dict": vq.state_dict()},
               os.path.join(folder, "tokenizer", "vqgan.ckpt"))
    dd = {"double_z": False, **{k: v for k, v in ANOLE_TINY_VQ.items()}}
    with open(os.path.join(folder, "tokenizer", "vqgan.yaml"), "w") as f:
        yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel",
                                  "params": {"embed_dim": 8, "n_embed": n_codes, "ddconfig": dd,
                                             "lossconfig": {"target": "taming.modules.losses.vqperceptual."
                                                                      "VQLPIPSWithDiscriminator"}}}}, f)
    fields = {"kind": "anole", "model": "anole-hf", "cls_token_num": cls_token_num,
              "image_size": ANOLE_TINY["image_size"], "vq_checkpoint": "tokenizer/vqgan.ckpt",
              "vq_yaml": "tokenizer/vqgan.yaml"}
    if with_device:
        from ciar.models.chameleon import load_chameleon

        cloud = load_chameleon(model_dir, cls_token_num=cls_token_num, block_size=grid * grid)
        fields["device_checkpoint"] = _write_anole_device(folder, cloud, n_codes)
    return fields


def _write_anole_device(folder: str, cloud, n_codes: int) -> str:
    """A 1-layer CIAR device model made from the Chameleon decoder `cloud` (small radii on the image codes) ->
    its file name in `folder`."""
    from ciar.collab.device import DeviceConfig, DeviceModel

    dev = DeviceModel.from_cloud(cloud, DeviceConfig(n_layer=1))
    with torch.no_grad():
        for head in dev.inter_head.heads:
            head.bias[n_codes:].fill_(-4.0)
    dev.save(os.path.join(folder, "device.safetensors"))
    return "device.safetensors"


# ---------------------------------------------------------------------------------------------------- Anole, sharded
# Anole-7b's shapes: transformers' `ChameleonConfig` defaults are Chameleon-7B's (32 layers x 4096, FFN 11008, 32 heads,
# 32 KV heads, a 65,536-token vocabulary, 4,096 positions; its VQ encoder's config too), the VQGAN is
# `ChameleonVQConfig`'s defaults (ch 128, ch_mult [1, 1, 2, 2, 4], 2 res blocks, z / embed 256, 8,192 codes, 512 px),
# 128 prompt positions as worlds/anole-7b.yaml, three bfloat16 shards as leloy/Anole-7b-v0.1-hf
ANOLE_7B_SHAPES = dict(n_codes=8192, text_config={}, vq_config={}, cls_token_num=128, shards=3)
# the same files at tiny sizes (ANOLE_TINY's decoder and VQGAN: 4 x 4 image tokens at 32 px), two shards; 40 prompt
# positions: benchmarks.real_scale's captions fit the stand-in tokenizer
ANOLE_TINY_SHAPES = dict(
    n_codes=ANOLE_TINY["n_codes"], cls_token_num=40, shards=2,
    text_config=dict(vocab_size=ANOLE_TINY["text_vocab"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     vq_config=dict(base_channels=32, channel_multiplier=[1, 1], num_embeddings=ANOLE_TINY["n_codes"],
                                    embed_dim=8, latent_channels=8, resolution=32, attn_resolutions=[])),
    vq_config=dict(ANOLE_TINY_VQ, n_embed=ANOLE_TINY["n_codes"], embed_dim=8))
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}


def write_safetensors_streamed(path: str, entries: list[tuple[str, tuple, torch.dtype]], produce,
                               metadata: dict | None = None) -> int:
    """Write a safetensors file one tensor at a time (memory: one tensor, not the file): `entries` (name, shape,
    dtype) in file order, `produce(name)` -> that tensor's values as an iterable of contiguous tensors of its dtype
    whose bytes, one after the other, are the tensor's (row-major). The format: an 8-byte little-endian header
    length, the JSON header (each tensor's dtype, shape and data offsets, `__metadata__`) padded with spaces to 8
    bytes, then the data. -> bytes of tensor data written."""
    import struct

    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for name, shape, dtype in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            want, wrote = header[name]["data_offsets"][1] - header[name]["data_offsets"][0], 0
            for piece in produce(name):
                if piece.dtype != dtype:
                    raise TypeError(f"{name}: produced {piece.dtype}, declared {dtype}")
                data = piece.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data)
                wrote += data.nbytes
            if wrote != want:
                raise ValueError(f"{name}: produced {wrote} bytes, declared {want}")
    return offset


class _RandomWeights:
    """Deterministic random values for a decoder's tensors, made on demand, tensor by tensor: a norm's weight
    1 + 0.1 N(0, 1) and any bias 0.1 N(0, 1) (each its own seeded generator), every other tensor a slice of one
    seeded pool of N(0, 0.02^2) bfloat16 samples (the config's initializer_range) at a random offset, wrapping round
    the pool: 14 GB of Anole weights are then written at disk speed, not at the speed of a normal sampler."""

    def __init__(self, shapes: dict[str, tuple], seed: int, dtype: torch.dtype, pool: int = 2 ** 25):
        self.shapes, self.seed, self.dtype = shapes, seed, dtype
        self.index = {name: i for i, name in enumerate(shapes)}
        largest = max(torch.Size(s).numel() for s in shapes.values())
        g = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(min(pool, largest), generator=g) * 0.02).to(dtype)

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.index[name] + 1)

    def pieces(self, name: str):
        shape, g = self.shapes[name], self._generator(name)
        n = torch.Size(shape).numel()
        if name.endswith("bias") or ("norm" in name and name.endswith("weight")):
            r = torch.randn(n, generator=g)
            yield ((1.0 + 0.1 * r) if name.endswith("weight") else 0.1 * r).to(self.dtype)
            return
        at = int(torch.randint(0, self.pool.numel(), (1,), generator=g))
        while n > 0:
            piece = self.pool[at:at + n]
            yield piece
            n -= piece.numel()
            at = 0

    def tensor(self, name: str) -> torch.Tensor:
        return torch.cat(list(self.pieces(name))).view(self.shapes[name])


def write_sharded_random_anole_files(folder: str, shapes: dict | None = None, seed: int = 0, with_device: bool = True,
                                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """RANDOM-weight stand-ins for an Anole world's files in their real layouts, at any size (`shapes`:
    ANOLE_7B_SHAPES, the default, or ANOLE_TINY_SHAPES), written without holding the model: `anole-hf/` a
    transformers folder as `save_pretrained` shards it (config.json from transformers' `ChameleonConfig` with the
    shapes' `text_config` over its Chameleon-7B defaults and a vocabulary_map naming `n_codes` IMGIMG image tokens
    from id 4; `model-0000K-of-0000N.safetensors` in `dtype` split at tensor boundaries into `shards` files of about
    equal size, with `model.safetensors.index.json`; every key and shape of `ChameleonForConditionalGeneration`,
    built on the meta device, the VQ encoder `model.vqmodel.*` included; tokenizer.json, a Chameleon-style BPE
    stand-in over the same vocabulary that knows TINY_T5_WORDS), `tokenizer/vqgan.ckpt` + `vqgan.yaml` (the VQGAN at
    `vq_config` over `ChameleonVQConfig`'s Chameleon defaults, built whole: tens of MB) and, with `with_device`, a
    1-layer CIAR `device.safetensors` made from the decoder's first layer (the same values: `DeviceModel.from_cloud`
    on a 1-layer decoder loaded from those tensors). The values: `_RandomWeights`. -> the world file's fields
    (paths relative to `folder`; no `gpt_dtype`)."""
    import yaml
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from ciar.models.chameleon_vq import ChameleonVQConfig, ChameleonVQModel

    shapes = shapes or ANOLE_7B_SHAPES
    hf_logging.set_verbosity_error()
    os.makedirs(folder, exist_ok=True)
    n_codes = shapes["n_codes"]
    vocab, merges = _tiny_chameleon_vocabulary(n_codes, TINY_T5_WORDS)
    vq_cfg = ChameleonVQConfig(**shapes.get("vq_config", {}))
    if vq_cfg.n_embed != n_codes:
        raise ValueError(f"the VQGAN has {vq_cfg.n_embed} codes, the vocabulary {n_codes} image tokens")
    grid = vq_cfg.resolution // vq_cfg.downsample
    cfg = ChameleonConfig(**{**shapes.get("text_config", {}), "vocabulary_map": vocab, "bos_token_id": vocab["<s>"],
                             "pad_token_id": vocab["<pad>"], "eos_token_id": vocab["</s>"]})
    if len(vocab) > cfg.vocab_size:
        raise ValueError(f"the stand-in vocabulary has {len(vocab)} tokens > {cfg.vocab_size}")
    cfg.architectures = ["ChameleonForConditionalGeneration"]
    with torch.device("meta"):  # transformers' own keys and shapes, nothing allocated
        layout = {k: tuple(v.shape) for k, v in ChameleonForConditionalGeneration(cfg).state_dict().items()}
    model_dir = os.path.join(folder, "anole-hf")
    os.makedirs(model_dir, exist_ok=True)
    cfg.save_pretrained(model_dir)
    write_chameleon_tokenizer(os.path.join(model_dir, "tokenizer.json"), vocab, merges)

    values = _RandomWeights(layout, seed, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = {k: torch.Size(s).numel() * size for k, s in layout.items()}
    n_shards, total = max(1, int(shapes.get("shards", 1))), sum(nbytes.values())
    groups, running = [[] for _ in range(n_shards)], 0
    for k in layout:  # in transformers' key order, cut where the running size passes each k / n_shards of the total
        groups[min(n_shards - 1, running * n_shards // total)].append(k)
        running += nbytes[k]
    weight_map = {}
    for i, keys in enumerate(g for g in groups if g):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        write_safetensors_streamed(os.path.join(model_dir, name), [(k, layout[k], dtype) for k in keys],
                                   values.pieces)
        weight_map.update({k: name for k in keys})
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    vq = randomize_vq_(ChameleonVQModel(vq_cfg), torch.Generator().manual_seed(seed + 1))
    torch.save({"epoch": 0, "global_step": 0, "state_dict": vq.state_dict()},
               os.path.join(folder, "tokenizer", "vqgan.ckpt"))
    del vq
    dd = {"double_z": False, "z_channels": vq_cfg.z_channels, "resolution": vq_cfg.resolution,
          "in_channels": vq_cfg.in_channels, "out_ch": vq_cfg.out_ch, "ch": vq_cfg.ch, "ch_mult": list(vq_cfg.ch_mult),
          "num_res_blocks": vq_cfg.num_res_blocks, "attn_resolutions": list(vq_cfg.attn_resolutions),
          "dropout": vq_cfg.dropout}
    with open(os.path.join(folder, "tokenizer", "vqgan.yaml"), "w") as f:
        yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel",
                                  "params": {"embed_dim": vq_cfg.embed_dim, "n_embed": vq_cfg.n_embed, "ddconfig": dd,
                                             "lossconfig": {"target": "taming.modules.losses.vqperceptual."
                                                                      "VQLPIPSWithDiscriminator"}}}}, f)
    fields = {"kind": "anole", "model": "anole-hf", "cls_token_num": shapes["cls_token_num"],
              "image_size": vq_cfg.resolution, "vq_checkpoint": "tokenizer/vqgan.ckpt",
              "vq_yaml": "tokenizer/vqgan.yaml"}
    if with_device:
        from ciar.models.chameleon import load_chameleon

        first = ("model.embed_tokens.", "model.layers.0.", "model.norm.", "lm_head.")
        state = {k: values.tensor(k) for k in layout if k.startswith(first)}
        cloud = load_chameleon(state, config={**cfg.to_dict(), "num_hidden_layers": 1}, dtype=dtype,
                               cls_token_num=shapes["cls_token_num"], block_size=grid * grid)
        del state
        fields["device_checkpoint"] = _write_anole_device(folder, cloud, n_codes)
    return fields


CAPTION_LEN, CAPTION_DIM = 8, 16


class StubTextEncoder:
    """Test double for ciar.text.TextEncoder: a deterministic pseudo-embedding per prompt (crc32-seeded)."""

    dim = CAPTION_DIM

    def encode(self, prompts):
        emb = torch.zeros(len(prompts), CAPTION_LEN, CAPTION_DIM)
        mask = torch.zeros(len(prompts), CAPTION_LEN, dtype=torch.bool)
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
            n = min(CAPTION_LEN, max(1, len(p.split())))
            emb[i, CAPTION_LEN - n:] = torch.randn(n, CAPTION_DIM, generator=g)
            mask[i, CAPTION_LEN - n:] = True  # left padding, as the real encoder
        return SimpleNamespace(emb=emb, mask=mask)


def tiny_cloud_model():
    """A 2-layer, 64-wide RANDOM cloud GPT over 64 codes (36 image positions, `StubTextEncoder`'s captions), its head
    random (a zero-initialised head would make every token uniform)."""
    torch.manual_seed(0)
    m = build_gpt("scenes-cloud", n_layer=2, dim=64, n_head=4, vocab_size=64, cls_token_num=CAPTION_LEN,
                  caption_dim=CAPTION_DIM, block_size=36)
    torch.nn.init.normal_(m.output.weight, std=0.3)
    return m.eval()
