"""Export a world's device model and VQ decoder to ONNX, for the torch-free device client (`ciar_device.runtime`).

    python -m pipelines.export_onnx                                  # the shipped world -> weights/scenes-v2/onnx/
    python -m pipelines.export_onnx --weights runs/w-v4 --out /tmp/onnx
    python -m pipelines.export_onnx --world llamagen.yaml --out onnx/

Writes three graphs and a manifest into `--out` (default: `<weights folder>/onnx/`, generated, not committed):

    device_prefill.onnx  caption_emb f32 [rows, L, caption_dim], caption_mask bool [rows, L], drop bool [rows]
                         -> center f32 [rows, V], radius f32 [rows, V], hidden f32 [rows, dim],
                            k_cache f32 [n_layer, rows, n_head, max_seq, head_dim], v_cache (same)
    device_step.onnx     tokens int64 [rows, T], start int64 [] (image index of tokens[:, 0]), caption_mask bool
                         [rows, L], k_cache, v_cache -> center, radius, hidden (of the LAST fed position),
                         k_cache_out, v_cache_out (the caches with the T new positions written)
    vq_decoder.onnx      tokens int64 [1, N] -> image uint8 [H, W, 3] (`tensor_to_images(vq.decode_code(...))`)
    manifest.json        sizes, IO contract, sampling, the device's calibrated CIAR defaults, sha256 of every file

L = cls_token_num (captions left-padded, mask True on real tokens), max_seq = cls_token_num + block_size, rows is
1 (no guidance) or 2 (classifier-free guidance: row 0 conditional, row 1 unconditional with drop=True), T is any
1..block_size. The cache is fixed-size: a query at position p sees keys at positions <= p (and valid caption keys),
so entries past a rolled-back position are invisible and get overwritten, exactly as `ciar.models.kv_cache.KVCache`
(rollback is a position pointer on the runtime's side). Everything is float32, as the torch runtime (`ciar.collab.device.TorchRuntime`) runs.

How the graphs follow the torch model: the wrappers below call the model's own modules (caption projector with the
CFG drop, token embedding, each layer's norms, `Attention._qkv` / `_out`, feed-forward, final norm, the Inter-Head
through `DeviceModel._out`). Two things are written here instead of reusing `GPT.forward_cached`: its cache writes
are in-place slice assignments at a Python-int position and its fast paths read positions on the host
(`_consecutive`), which do not export with a tensor position; so the wrapper writes the new keys with `index_copy`
(ScatterND) and builds the same mask as `forward_cached`'s general path over the whole fixed-size cache. And
`apply_rotary_emb` multiplies complex numbers, which the ONNX exporter cannot translate: during export it is
swapped for `rotary_real`, the same four real products (bit-identical in torch; a test checks it).

A Chameleon / Anole device (`ciar.models.chameleon.ChameleonTrunk`) exports through the same wrappers (its blocks
keep GPT's `_qkv` / `_out` interface; its 1-D RoPE table is indexed by the same positions): `caption_emb` is the
prompt's embeddings [rows, L, dim] (caption_dim = dim) and its unconditional row reads only its own
`[<s>, <racm3:break>]` keys, whatever caption_mask says: the prefill takes it from `drop`, the step from the row
(row 1 of 2 is the unconditional one, the runtime's contract), so the runtime passes the same caption mask as for any
world (the manifest's `unconditional_mask` says "own").

Deterministic: re-running writes the same bytes (node metadata with source paths is stripped; the manifest
carries no paths or times). Exporter: `torch.onnx.export(dynamo=True)`, opset 20; about 10 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

import torch
import torch.nn as nn

import ciar.models.gpt as gpt_module
from ciar.sim.decoder import CollabConfig
from ciar.collab.device import DeviceModel
from ciar.models.vq import VQModel, tensor_to_images
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args
from ciar_device.fetch import sha256_file

FORMAT_VERSION = 1
OPSET = 20
ONNX_DIR = "onnx"
PREFILL_FILE, STEP_FILE, VQ_FILE, MANIFEST_FILE = "device_prefill.onnx", "device_step.onnx", "vq_decoder.onnx", \
    "manifest.json"


def rotary_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`ciar.models.gpt.apply_rotary_emb` in real arithmetic (exportable): each interleaved pair (a, b) becomes
    (a cos - b sin, b cos + a sin), in float32. x: [B, T, H, D]; freqs: [B or 1, T, D // 2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, D/2, 2]
    f = freqs.float().unsqueeze(2)  # [B, T, 1, D/2, 2]
    a, b, cos, sin = xs[..., 0], xs[..., 1], f[..., 0], f[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(3).type_as(x)


@contextlib.contextmanager
def exportable_rotary():
    """`Attention._qkv` calls the module-level `apply_rotary_emb`: swap in `rotary_real` while exporting."""
    saved = gpt_module.apply_rotary_emb
    gpt_module.apply_rotary_emb = rotary_real
    try:
        yield
    finally:
        gpt_module.apply_rotary_emb = saved


def _caption_mask(g, caption_mask, drop):
    """The keys each row may read: the caption mask, or for a trunk with its own unconditional prompt
    (`condition_mask`: a Chameleon trunk) the `drop` rows' own."""
    return g.condition_mask(caption_mask, drop) if hasattr(g, "condition_mask") else caption_mask


def _run_layers(dev: DeviceModel, h, pos, caption_mask, k_cache, v_cache):
    """Embeddings h [rows, T, dim] at sequence positions pos [T] through the trunk over the fixed-size caches
    [n_layer, rows, n_head, max_seq, head_dim] -> (center, radius, hidden) of the last position, new caches."""
    g = dev.gpt
    c = g.config
    rows, max_seq = h.shape[0], k_cache.shape[3]
    freqs = g.freqs_cis[pos].unsqueeze(0)  # [1, T, D/2, 2]
    # GPT.forward_cached's mask (general path) over every cache position: keys at positions <= the query's and not
    # caption padding, the query's own key always
    key_pos = torch.arange(max_seq, device=h.device)
    valid = torch.cat([caption_mask, caption_mask.new_ones(rows, max_seq - c.cls_token_num)], dim=1)  # [rows, S]
    allowed = ((key_pos[None, None, :] <= pos[None, :, None]) & valid[:, None, :]) \
        | (key_pos[None, None, :] == pos[None, :, None])
    mask = torch.where(allowed, 0.0, float("-inf")).to(h.dtype).unsqueeze(1)  # [rows, 1, T, S]
    ks, vs = [], []
    for i, layer in enumerate(g.layers):
        att = layer.attention
        q, k, v = att._qkv(layer.attention_norm(h), freqs)  # q [rows, T, H, D], k/v [rows, T, Hkv, D]
        kc = k_cache[i].index_copy(2, pos, k.transpose(1, 2).to(k_cache.dtype))  # [rows, Hkv, S, D]
        vc = v_cache[i].index_copy(2, pos, v.transpose(1, 2).to(v_cache.dtype))
        ks.append(kc)
        vs.append(vc)
        h = h + att._out(q, kc, vc, mask)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    out = dev._out(g.norm(h[:, -1]), with_heads=False)
    return out.center, out.radius, out.hidden, torch.stack(ks), torch.stack(vs)


class DevicePrefill(nn.Module):
    """`DeviceModel.prefill` on a fresh fixed-size cache: (caption_emb, caption_mask, drop) -> the Inter-Head box and
    hidden state for image token 0, and the caches holding the caption positions (zeros elsewhere)."""

    def __init__(self, dev: DeviceModel, max_seq: int):
        super().__init__()
        self.dev, self.max_seq = dev, max_seq

    def forward(self, caption_emb, caption_mask, drop):
        g = self.dev.gpt
        c = g.config
        h = g.embed_condition(caption_emb, drop)  # [rows, L, dim]; drop rows take the unconditional embedding
        shape = (c.n_layer, h.shape[0], c.kv_heads, self.max_seq, c.head_dim)
        zeros = h.new_zeros(shape)
        pos = torch.arange(c.cls_token_num, device=h.device)
        return _run_layers(self.dev, h, pos, _caption_mask(g, caption_mask, drop), zeros, zeros)


class DeviceStep(nn.Module):
    """`DeviceModel.decode(..., last_only=True)`: feed image tokens [rows, T] at image indices start..start+T-1."""

    def __init__(self, dev: DeviceModel):
        super().__init__()
        self.dev = dev

    def forward(self, tokens, start, caption_mask, k_cache, v_cache):
        g = self.dev.gpt
        pos = start + g.config.cls_token_num + torch.arange(tokens.shape[1], device=tokens.device)
        if hasattr(g, "condition_mask"):  # rows 2: row 1 is the unconditional one (the runtime's contract)
            caption_mask = g.condition_mask(caption_mask, torch.arange(tokens.shape[0], device=tokens.device) == 1)
        return _run_layers(self.dev, g.tok_embeddings(tokens), pos, caption_mask, k_cache, v_cache)


class VQDecode(nn.Module):
    """tokens [1, N] -> uint8 [H, W, 3]: `tensor_to_images(vq.decode_code(tokens))[0]`."""

    def __init__(self, vq: VQModel, grid: int):
        super().__init__()
        self.vq, self.grid = vq, grid

    def forward(self, tokens):
        return tensor_to_images(self.vq.decode_code(tokens, self.grid))[0]


def _strip(model_bytes: bytes) -> bytes:
    """Drop the exporter's per-node metadata (source file paths, FX names) and doc strings: smaller files, and the
    same bytes wherever the export runs."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del model.metadata_props[:]
    model.doc_string = ""
    model.graph.doc_string = ""
    return model.SerializeToString()


def _export(module: nn.Module, args: tuple, names_in: list[str], names_out: list[str], dynamic: dict,
            path: str) -> None:
    import logging
    import warnings

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" and the like
    with torch.no_grad(), exportable_rotary(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's FutureWarnings and dynamic-axis renaming notes
        prog = torch.onnx.export(module.eval(), args, dynamo=True, opset_version=OPSET, input_names=names_in,
                                 output_names=names_out, dynamic_shapes=dynamic, external_data=False,
                                 optimize=True, verbose=False)
    data = _strip(prog.model_proto.SerializeToString())
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def file_facts(path: str) -> dict:
    """{"file": basename, "sha256", "bytes"} of a file."""
    return {"file": os.path.basename(path), "sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def _io(path: str) -> dict:
    """The inputs and outputs of an ONNX file: [{name, shape (ints, or names of dynamic dims), dtype}]."""
    import onnx

    model = onnx.load(path, load_external_data=False)

    def one(v):
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        return {"name": v.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name}

    return {"inputs": [one(v) for v in model.graph.input], "outputs": [one(v) for v in model.graph.output]}


def source_files(world=None) -> dict:
    """The weight files the export reads: role -> path (the cloud file of a scenes world carries its sampling)."""
    spec = read_world(world, need_device=True)
    if isinstance(spec, ScenesWorldSpec):
        folder = spec.weights_dir()
        return {"device": spec.device_file(),
                "tokenizer": os.path.join(folder, "tokenizer.safetensors"),
                "cloud": os.path.join(folder, "cloud.safetensors")}
    return {"device": spec.device_file(), "tokenizer": spec.path(spec.vq_checkpoint)}


def export_onnx(world=None, out_dir: str | None = None, log=None) -> dict:
    """Export the world's device model and VQ decoder into `out_dir` (default `<weights folder>/onnx`);
    -> the manifest (also written as manifest.json)."""
    from ciar.world import load_device_side

    t0 = time.perf_counter()
    side = load_device_side(world)
    dev, vq = side.device_model.float().eval(), side.vq.float().eval()
    dc = dev.device_config
    if dc.num_heads > 1 and dc.combine == "voting":
        raise ValueError("a voting Inter-Head ensemble needs the per-head boxes, which the graphs do not output; "
                         "export an ensemble (combine='ensemble') device")
    c = dev.config
    if c.model_type != "t2i":
        raise ValueError(f"only text-to-image device models export (model_type {c.model_type!r})")
    out_dir = os.path.abspath(out_dir or os.path.join(side.weights_dir, ONNX_DIR))
    os.makedirs(out_dir, exist_ok=True)
    L, max_seq, grid = c.cls_token_num, c.cls_token_num + c.block_size, c.grid_size
    say = log or (lambda *_: None)

    rows, steps = torch.export.Dim("rows", min=1, max=2), torch.export.Dim("T", min=1, max=c.block_size)
    cache = torch.zeros(c.n_layer, 2, c.kv_heads, max_seq, c.head_dim)
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[:, :3] = False
    # traced with 2 rows and 3 tokens: a dynamic dim traced at size 1 would be fixed silently
    _export(DevicePrefill(dev, max_seq), (torch.randn(2, L, c.caption_dim), mask, torch.tensor([False, True])),
            ["caption_emb", "caption_mask", "drop"], ["center", "radius", "hidden", "k_cache", "v_cache"],
            {"caption_emb": {0: rows}, "caption_mask": {0: rows}, "drop": {0: rows}},
            os.path.join(out_dir, PREFILL_FILE))
    say(f"{PREFILL_FILE}: {time.perf_counter() - t0:.1f} s")
    _export(DeviceStep(dev), (torch.randint(0, c.vocab_size, (2, 3)), torch.tensor(5), mask, cache, cache.clone()),
            ["tokens", "start", "caption_mask", "k_cache", "v_cache"],
            ["center", "radius", "hidden", "k_cache_out", "v_cache_out"],
            {"tokens": {0: rows, 1: steps}, "start": None, "caption_mask": {0: rows}, "k_cache": {1: rows},
             "v_cache": {1: rows}}, os.path.join(out_dir, STEP_FILE))
    say(f"{STEP_FILE}: {time.perf_counter() - t0:.1f} s")
    _export(VQDecode(vq, grid), (torch.randint(0, c.vocab_size, (1, c.block_size)),), ["tokens"], ["image"], None,
            os.path.join(out_dir, VQ_FILE))
    say(f"{VQ_FILE}: {time.perf_counter() - t0:.1f} s")

    image_size = grid * vq.config.downsample
    s = side.sampling
    graphs = {}
    for key, name in (("device_prefill", PREFILL_FILE), ("device_step", STEP_FILE), ("vq_decoder", VQ_FILE)):
        path = os.path.join(out_dir, name)
        graphs[key] = {**file_facts(path), **_io(path)}
    collab = CollabConfig()
    own_uncond = hasattr(dev.gpt, "condition_mask")  # a Chameleon trunk: caption = the prompt's embeddings
    manifest = {
        "format_version": FORMAT_VERSION,
        "opset": OPSET,
        "vocab_size": c.vocab_size,
        "num_tokens": c.block_size,
        "grid": grid,
        "image_size": image_size,
        "image": {"shape": [image_size, image_size, 3], "dtype": "uint8"},
        "cls_token_num": L,
        "caption_dim": c.caption_dim,
        "caption_padding": "left",  # mask True on the caption's real tokens, which sit at the end
        "dim": c.dim,
        "n_layer": c.n_layer,
        "n_head": c.kv_heads,
        "head_dim": c.head_dim,
        "max_seq": max_seq,
        "cache_shape": [c.n_layer, "rows", c.kv_heads, max_seq, c.head_dim],
        "rows": {"1": "no guidance", "2": "classifier-free guidance: row 0 conditional, row 1 unconditional "
                                          + ("(drop=True; it reads its own [<s>, <racm3:break>] keys, whatever the "
                                             "caption mask)" if own_uncond else "(drop=True, caption mask kept)")},
        "inter_head": {"num_heads": dc.num_heads, "combine": dc.combine, "max_radius": dc.max_radius},
        "sampling": {"cfg_scale": s.cfg_scale, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p},
        "ciar_defaults": dev.ciar_defaults.to_dict() if dev.ciar_defaults is not None else None,
        "prefix_rate": collab.prefix_rate,
        "feature_top": collab.feature_top,
        "graphs": graphs,
        "sources": {role: file_facts(path) for role, path in source_files(world).items()},
    }
    if own_uncond:
        manifest["caption"] = "the prompt's embeddings (the verifier's OPEN_REPLY caption of a Chameleon world)"
        manifest["unconditional_mask"] = "own"
    path = os.path.join(out_dir, MANIFEST_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
    say(f"{out_dir}: {len(graphs)} graphs + {MANIFEST_FILE} in {time.perf_counter() - t0:.1f} s")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.export_onnx", description=__doc__.split("\n")[0])
    add_world_arguments(p)
    p.add_argument("--out", default=None, help="output folder (default: <weights folder>/onnx)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        world = world_from_args(args)
        manifest = export_onnx(world, args.out, log=lambda m: print(m, file=sys.stderr))
    except (WorldSpecError, FileNotFoundError, ValueError) as e:  # (a world file read when the export loads it)
        p.error(str(e))
    for key, g in manifest["graphs"].items():
        print(f"{key}: {g['file']} {g['bytes'] / 1e6:.1f} MB sha256 {g['sha256'][:16]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
