"""Train the default world's VQ tokenizer on procedural scenes (train split), resumable.

    python -m pipelines.train_tokenizer --out weights/scenes-v1 --steps 2500 --batch-size 32 --seed 0

Writes `OUT/tokenizer.safetensors` (config in the metadata) and `OUT/tokenizer.metrics.json`; training state
for resuming lives in `--ckpt-dir` (default `runs/tokenizer`). Images are rendered on the fly: batch b of step s
holds train-split scenes s*B .. s*B+B-1, so a resumed run sees exactly the data the uninterrupted run would.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ciar.data import scenes
from ciar.models.checkpoint import save_model
from ciar.models.vq import build_vq, images_to_tensor
from pipelines.common import (claim_run, cosine_lr, load_training_state, save_training_state, set_lr, setup,
                              training_arguments)


@torch.no_grad()
def evaluate(vq, device, split: str = "val", n: int = 256, seed: int = 0) -> dict:
    """PSNR (dB, on [0, 255]) of reconstructions and codebook usage on `n` scenes of `split`."""
    vq.eval()
    images, _ = scenes.batch(split, 0, n, seed)
    x = images_to_tensor(images).to(device)
    mse, used = [], torch.zeros(vq.config.codebook_size, dtype=torch.bool)
    for i in range(0, n, 64):
        z_q, codes = vq.encode(x[i:i + 64])
        rec = vq.decode(z_q).clamp(-1, 1)
        mse.append(((rec - x[i:i + 64]) * 127.5).pow(2).mean(dim=(1, 2, 3)).cpu())
        used[codes.flatten().unique().cpu()] = True
    mse = torch.cat(mse)
    psnr = (10 * torch.log10(255.0 ** 2 / mse.clamp_min(1e-8))).mean().item()
    vq.train()
    return {"psnr_db": psnr, "codebook_used": int(used.sum()), "codebook_size": vq.config.codebook_size}


def edge_weights(x: torch.Tensor, weight: float) -> torch.Tensor:
    """1 on flat regions, 1 + weight on and next to colour edges: [B, 1, H, W]. Small objects are a tiny share of
    the pixels, so an unweighted loss spends the codebook on backgrounds and blurs shapes into blobs."""
    gx = (x[..., :, 1:] - x[..., :, :-1]).abs().amax(1, keepdim=True)
    gy = (x[..., 1:, :] - x[..., :-1, :]).abs().amax(1, keepdim=True)
    g = F.pad(gx, (0, 1, 0, 0)) + F.pad(gy, (0, 0, 0, 1))
    edges = F.max_pool2d((g > 0.05).float(), 3, stride=1, padding=1)
    return 1.0 + weight * edges


def reconstruction_loss(rec: torch.Tensor, x: torch.Tensor, edge_weight: float) -> torch.Tensor:
    if edge_weight <= 0:
        return F.mse_loss(rec, x) + F.l1_loss(rec, x)
    w = edge_weights(x, edge_weight)
    err = (rec - x).pow(2) + (rec - x).abs()
    return (w * err).mean() / w.mean()


def main(argv=None) -> int:
    p = training_arguments("python -m pipelines.train_tokenizer", __doc__, out="weights/scenes-v1", steps=2500,
                           batch_size=32, lr=1e-3, seed=0, ckpt_dir="runs/tokenizer", ckpt_every=100)
    p.add_argument("--config", default="scenes-small")
    p.add_argument("--restart-every", type=int, default=100, help="re-seed unused codes every N steps (0: never)")
    p.add_argument("--edge-weight", type=float, default=10.0, help="extra loss weight on colour edges (0: off)")
    args = p.parse_args(argv)
    device = setup(args)

    vq = build_vq(args.config).to(device)
    opt = torch.optim.AdamW(vq.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    claim_run(args.ckpt_dir, args)
    ckpt = os.path.join(args.ckpt_dir, "state.pt")
    usage = torch.zeros(vq.config.codebook_size, device=device)  # code counts since the last dead-code restart
    start = load_training_state(ckpt, model=vq, optimizer=opt, usage=usage)
    if start:
        print(f"resuming from step {start}")
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="tokenizer", dynamic_ncols=True)
    t0 = time.time()
    for step in bar:
        set_lr(opt, cosine_lr(step, args.steps, args.lr, warmup=100))
        images, _ = scenes.batch("train", step * args.batch_size, args.batch_size, args.seed)
        x = images_to_tensor(images).to(device)
        rec, codes, losses, flat = vq(x)
        rec_loss = reconstruction_loss(rec, x, args.edge_weight)
        loss = rec_loss + losses["codebook"] + losses["commit"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vq.parameters(), 1.0)
        opt.step()
        usage += torch.bincount(codes.flatten(), minlength=vq.config.codebook_size)
        if args.restart_every and (step + 1) % args.restart_every == 0 and step < 0.8 * args.steps:
            dead = (usage == 0).nonzero().flatten()
            if len(dead):  # re-seed dead codes with current encoder outputs (keeps the large vocabulary in use)
                pick = torch.randint(len(flat), (len(dead),), device=device)
                vq.quantize.embedding.weight.data[dead] = flat[pick].detach()
            bar.set_postfix(rec=f"{rec_loss.item():.4f}", dead=len(dead))
            usage.zero_()
        stopping = args.stop_after and step + 1 - start >= args.stop_after
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps or stopping:
            save_training_state(ckpt, step + 1, model=vq, optimizer=opt, usage=usage)
        if stopping:
            print(f"stopped after step {step + 1}; run again to resume")
            return 0
    metrics = evaluate(vq, device)
    metrics.update(steps=args.steps, batch_size=args.batch_size, seed=args.seed, train_seconds_this_run=time.time() - t0)
    print(json.dumps(metrics))
    os.makedirs(args.out, exist_ok=True)
    save_model(vq.cpu(), os.path.join(args.out, "tokenizer.safetensors"), vq.config.to_dict(), kind="vq")
    with open(os.path.join(args.out, "tokenizer.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
