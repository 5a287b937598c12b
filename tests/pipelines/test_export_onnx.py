"""pipelines.export_onnx + ciar_device.runtime: the ONNX device model and VQ decoder against torch, on the shipped
world (exported once per module, ~10 s).

Tolerances, and what they were measured at (2-core CPU, onnxruntime 1.32, torch 2.13):
- device graphs: max abs diff of center / radius / hidden <= 1e-4 (measured: <= 2.3e-5 for center, <= 8.6e-6 for
  radius, <= 1.2e-5 for hidden, over prefill, 9-token, 1-token and post-rollback feeds, rows 1 and 2);
- VQ decoder: the uint8 image within 1 intensity level of `tensor_to_images(vq.decode_code(...))` (measured: 0
  levels, every pixel equal, on 3 random token grids);
- the device loop on 4 val prompts (CIAR, the world's verifier in process, no network): the same tokens and the
  same `who` trace with the torch device model and with the ONNX graphs (measured: identical on all 4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ciar.collab.device import TorchRuntime
from ciar.models.gpt import apply_rotary_emb
from ciar.models.vq import tensor_to_images
from pipelines import export_onnx as ex

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = os.path.join(REPO, "device")
if CLIENT not in sys.path:  # until the client is installed (`pip install -e client`)
    sys.path.insert(0, CLIENT)

from ciar_device.runtime import DeviceRuntime, ImageDecoder  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def world():
    from ciar.world import load_world

    return load_world(None)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    manifest = ex.export_onnx(None, str(out))
    return str(out), manifest


@pytest.fixture(scope="module")
def runtime(exported):
    return DeviceRuntime(exported[0], threads=1)


def test_rotary_real_is_bit_identical():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 8, 32, generator=g)
    from ciar.models.gpt import precompute_freqs_cis_2d

    freqs = precompute_freqs_cis_2d(12, 32, 10000.0, 40, "identity")[38:45].unsqueeze(0)
    assert torch.equal(ex.rotary_real(x, freqs), apply_rotary_emb(x, freqs))


def _caption(world, seed: int = 0, n_real: int = 11):
    c = world.device_model.config
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(c.cls_token_num, c.caption_dim, generator=g).half()  # float16, as the cloud sends it
    mask = torch.zeros(c.cls_token_num, dtype=torch.bool)
    mask[-n_real:] = True  # left padding
    return emb, mask


def _diff(ref, step) -> list[float]:
    return [float(np.abs(b - a).max()) for a, b in ((ref.center, step.center), (ref.radius, step.radius),
                                                     (ref.hidden, step.hidden))]


@pytest.mark.parametrize("rows", [1, 2])
def test_device_graphs_match_torch(world, runtime, rows):
    """The two runtimes of the device loop side by side: the torch model (`TorchRuntime`) and the export."""
    dev = world.device_model
    emb, mask = _caption(world, seed=rows)
    ref = TorchRuntime(dev)
    first = ref.start(emb.numpy(), mask.numpy(), rows)
    step = runtime.start(emb.numpy(), mask.numpy(), rows)
    assert step.center.shape == (rows, dev.config.vocab_size) and step.center.dtype == np.float32
    assert step.hidden.shape == (rows, dev.config.dim) and (step.radius >= 0).all()
    diffs = {"prefill": _diff(first, step)}
    toks = torch.randint(0, dev.config.vocab_size, (30,), generator=torch.Generator().manual_seed(rows)).tolist()
    diffs["9 tokens"] = _diff(ref.feed(toks[:9], 0), runtime.feed(toks[:9], 0))
    for i in range(9, 14):
        diffs[f"1 token at {i}"] = _diff(ref.feed(toks[i:i + 1], i), runtime.feed(toks[i:i + 1], i))
    ref.rollback(11)
    runtime.rollback(11)  # drop image tokens 11..13, feed other ones there
    diffs["3 tokens after rollback"] = _diff(ref.feed(toks[20:23], 11), runtime.feed(toks[20:23], 11))
    diffs["1 token after"] = _diff(ref.feed(toks[23:24], 14), runtime.feed(toks[23:24], 14))
    worst = max(max(d) for d in diffs.values())
    assert worst <= TOL, diffs


def test_runtime_refuses_bad_calls(world, runtime):
    emb, mask = _caption(world)
    with pytest.raises(ValueError, match="rows"):
        runtime.start(emb.numpy(), mask.numpy(), 3)
    with pytest.raises(ValueError, match="caption_emb"):
        runtime.start(emb[:5].numpy(), mask[:5].numpy(), 1)
    runtime.start(emb.numpy(), mask.numpy(), 2)
    with pytest.raises(ValueError, match="holds 0"):
        runtime.feed([1], 1)  # a hole in the cache
    runtime.feed([1, 2, 3], 0)
    with pytest.raises(ValueError, match="roll back"):
        runtime.rollback(4)
    runtime.rollback(1)
    with pytest.raises(ValueError, match="holds 1"):
        runtime.feed([5], 2)
    with pytest.raises(ValueError, match="token ids"):
        runtime.feed([world.device_model.config.vocab_size], 1)
    n = world.device_model.config.block_size
    with pytest.raises(ValueError, match="runs past"):
        runtime.feed(list(range(n)), 1)


def test_vq_decoder_matches_torch(world, exported):
    dec = ImageDecoder(exported[0])
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        toks = torch.randint(0, world.vq.config.codebook_size, (world.device_model.config.block_size,), generator=g)
        with torch.inference_mode():
            ref = tensor_to_images(world.vq.decode_code(toks[None]))[0].numpy()
        img = dec.decode(toks.numpy())
        assert img.dtype == np.uint8 and img.shape == ref.shape == (48, 48, 3)
        assert np.abs(img.astype(int) - ref.astype(int)).max() <= 1


# ---------------------------------------------------------------------- the device loop on the ONNX graphs
def test_device_loop_same_decisions(world, exported):
    """The simulated phone on either runtime (`ciar.sim.runtime.device_runtime`) makes the same images."""
    from ciar.training.calibration import val_prompts
    from ciar.sim.runtime import device_runtime, make_decoder, make_verifier

    verifier = make_verifier(world)
    prompts = val_prompts(4, seed=7, start=20_000)
    flips = []
    for i, prompt in enumerate(prompts):
        runs = []
        for kind in ("torch", "onnx"):
            rt = device_runtime(kind, world.device_model, world.weights_dir, world.device_file, exported[0])
            # the calibrated point: the two runtimes' own costs would let the adaptive policy choose differently
            d = make_decoder(world, verifier, "ciar", network="none", policy="fixed", runtime=rt)
            runs.append(d.generate(prompt, seed=100 + i, trace=True))
        a, b = runs
        assert a.trace.count("device") > 0 and a.trace.count("cloud") > 0  # both paths exercised
        if not (torch.equal(a.tokens, b.tokens) and a.trace == b.trace):
            first = next(j for j, (x, y) in enumerate(zip(a.trace, b.trace)) if x != y) \
                if a.trace != b.trace else int((a.tokens != b.tokens).nonzero()[0])
            flips.append((prompt, first))
    assert not flips, f"ONNX and torch decided differently (prompt, first differing token): {flips}"


def test_manifest(world, exported):
    out, manifest = exported
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f) == manifest
    dev, c = world.device_model, world.device_model.config
    assert manifest["ciar_defaults"] == dev.ciar_defaults.to_dict()
    assert manifest["ciar_defaults"]["span"] == dev.ciar_defaults.span
    assert (manifest["vocab_size"], manifest["num_tokens"], manifest["grid"], manifest["cls_token_num"],
            manifest["caption_dim"], manifest["dim"], manifest["n_layer"], manifest["n_head"], manifest["head_dim"],
            manifest["max_seq"]) == (c.vocab_size, c.block_size, c.grid_size, c.cls_token_num, c.caption_dim, c.dim,
                                     c.n_layer, c.n_head, c.head_dim, c.cls_token_num + c.block_size)
    assert manifest["image_size"] == world.vq.config.image_size == 48
    s = world.sampling
    assert manifest["sampling"] == {"cfg_scale": s.cfg_scale, "temperature": s.temperature, "top_k": s.top_k,
                                    "top_p": s.top_p}
    assert manifest["prefix_rate"] == 0.06 and manifest["feature_top"] == 8
    for g in manifest["graphs"].values():
        assert ex.file_facts(os.path.join(out, g["file"])) == {k: g[k] for k in ("file", "sha256", "bytes")}
    step = {v["name"]: v for v in manifest["graphs"]["device_step"]["inputs"]}
    assert step["tokens"]["shape"] == ["rows", "T"] and step["tokens"]["dtype"] == "int64"
    assert step["k_cache"]["shape"] == [c.n_layer, "rows", c.n_head, c.cls_token_num + c.block_size, c.head_dim]
    prefill = {v["name"]: v for v in manifest["graphs"]["device_prefill"]["inputs"]}
    assert prefill["caption_emb"]["shape"] == ["rows", c.cls_token_num, c.caption_dim]
    vq_out = manifest["graphs"]["vq_decoder"]["outputs"][0]
    assert vq_out["shape"] == [48, 48, 3] and vq_out["dtype"] == "uint8"
    src = manifest["sources"]
    assert set(src) == {"device", "tokenizer", "cloud"}
    for role, g in src.items():
        assert ex.file_facts(os.path.join(world.weights_dir, g["file"])) == g


def test_runtime_does_not_import_torch():
    env = {**os.environ, "PYTHONPATH": CLIENT}
    code = "import sys; import ciar_device.runtime; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=CLIENT)
    assert r.returncode == 0, r.stderr


def test_a_missing_world_file_is_one_line(tmp_path, capsys):
    """(it was a traceback: the world file is read when the export loads the world, after the arguments' check)"""
    from pipelines.export_onnx import main

    with pytest.raises(SystemExit) as e:
        main(["--world", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith(f"error: world file not found: {tmp_path / 'nope.yaml'}")
    assert "Traceback" not in err and not (tmp_path / "out").exists()
