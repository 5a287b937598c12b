"""Measure the default world's quality: tokenizer reconstructions and cloud-only generation.

    python -m pipelines.eval_world --split heldout --n 200 --seed 0 --out runs/eval_world.json
    python -m pipelines.eval_world --split val --n 64 --sweep   # choose sampling defaults on val (not held-out)
    python -m pipelines.eval_world --split val --n 64 --sweep --cfg-grid 1.5,2,3 --temperature-grid 1.0,0.9

Reports, on `n` scenes of `split` (rendered references are the ground truth):
- probe accuracy on the rendered references (validity of the instrument);
- tokenizer: PSNR of reconstructions and probe accuracy on them;
- cloud-only generation from the captions: attribute accuracy (probe), FID against the references,
  and a determinism check (the first captions generated twice with the same seeds give identical tokens).
`--sweep` instead generates with every (CFG scale, temperature) of the grids and reports, per setting, the
attribute accuracy with its per-attribute parts and the FID against the references (on a few dozen images FID is
biased upwards; compare settings within one sweep, not with the full runs).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from ciar.data import scenes
from ciar.decoding.generate import generate_cloud
from ciar.decoding.sampling import SamplingParams
from ciar.metrics.fid import fid_between, make_fid
from ciar.metrics.probe import attribute_accuracy, load_probe
from ciar.models.vq import images_to_tensor, tensor_to_images
from ciar.world import load_default_world


@torch.no_grad()
def generate_images(world, captions: list[str], seeds: list[int], params: SamplingParams, batch_size: int = 16):
    """Cloud-only images uint8 [n, H, W, 3] and tokens [n, N]; caption i is generated with seed seeds[i].

    Each caption draws with its own seed (`generate_cloud`'s position-keyed draws), so an image depends only on
    its caption and seed, whatever the batch size.
    """
    images, tokens = [], []
    for s in tqdm(range(0, len(captions), batch_size), desc="generate", dynamic_ncols=True):
        cap = world.text.encode(captions[s:s + batch_size])
        toks = generate_cloud(world.cloud, cap.emb, cap.mask, params, seeds[s:s + batch_size])
        tokens.append(toks)
        images.append(tensor_to_images(world.vq.decode_code(toks)))
    return torch.cat(images).numpy(), torch.cat(tokens)


@torch.no_grad()
def reconstruct(world, images: np.ndarray, batch_size: int = 64):
    recs, psnr = [], []
    for s in range(0, len(images), batch_size):
        x = images_to_tensor(images[s:s + batch_size])
        z_q, _ = world.vq.encode(x)
        rec = tensor_to_images(world.vq.decode(z_q))
        mse = (rec.float() - torch.as_tensor(images[s:s + batch_size]).float()).pow(2).mean(dim=(1, 2, 3))
        psnr.append(10 * torch.log10(255.0 ** 2 / mse.clamp_min(1e-8)))
        recs.append(rec)
    return torch.cat(recs).numpy(), torch.cat(psnr).mean().item()


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.eval_world", description=__doc__.split("\n")[0])
    p.add_argument("--split", default="heldout", choices=sorted(scenes.SPLITS))
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--sweep", action="store_true", help="grid over cfg-scale x temperature (generation only)")
    p.add_argument("--cfg-grid", type=_floats, default=(1.0, 2.0, 3.0, 5.0), help="--sweep: CFG scales, e.g. 1.5,2,3")
    p.add_argument("--temperature-grid", type=_floats, default=(1.0, 0.8, 0.6), help="--sweep: temperatures")
    p.add_argument("--out", default=None)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    world = load_default_world(args.weights) if args.weights else load_default_world()
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    refs, sc = scenes.batch(args.split, 0, args.n, args.seed)
    captions = [s.caption for s in sc]
    seeds = [args.seed * 1_000_003 + i for i in range(args.n)]
    base = world.sampling
    params = SamplingParams(
        cfg_scale=base.cfg_scale if args.cfg_scale is None else args.cfg_scale,
        temperature=base.temperature if args.temperature is None else args.temperature,
        top_k=base.top_k if args.top_k is None else args.top_k,
        top_p=base.top_p,
    )
    report: dict = {"split": args.split, "n": args.n, "seed": args.seed, "weights": world.weights_dir}

    fid = make_fid("scenes", os.path.join(world.weights_dir, "fid_features.safetensors"))
    if args.sweep:
        rows = []
        for cfg_scale in args.cfg_grid:
            for temperature in args.temperature_grid:
                sp = SamplingParams(cfg_scale=cfg_scale, temperature=temperature, top_k=params.top_k,
                                    top_p=params.top_p)
                gen, _ = generate_images(world, captions, seeds, sp, args.batch_size)
                acc = attribute_accuracy(probe, gen, sc)
                rows.append({"cfg_scale": cfg_scale, "temperature": temperature, **acc,
                             "fid_vs_references": fid_between(fid, refs, gen)})
                print(json.dumps(rows[-1]), flush=True)
        report["sweep"] = rows
    else:
        report["probe_on_references"] = attribute_accuracy(probe, refs, sc)
        recs, psnr = reconstruct(world, refs)
        report["tokenizer"] = {"psnr_db": psnr, "probe_on_reconstructions": attribute_accuracy(probe, recs, sc),
                               "fid_vs_references": fid_between(fid, refs, recs)}
        t0 = time.time()
        gen, tokens = generate_images(world, captions, seeds, params, args.batch_size)
        seconds = time.time() - t0
        k = min(args.batch_size, args.n)
        _, again = generate_images(world, captions[:k], seeds[:k], params, args.batch_size)
        report["cloud"] = {
            "sampling": params.__dict__,
            "attribute_accuracy": attribute_accuracy(probe, gen, sc),
            "fid_vs_references": fid_between(fid, refs, gen),
            "deterministic": bool(torch.equal(again, tokens[:k])),
            "seconds": seconds,
            "images_per_s": args.n / seconds,
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
