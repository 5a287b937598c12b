"""Inter-DRO training of the device model (trunk + Inter-Head) against the frozen cloud, resumable.

    python -m pipelines.train_device --out weights/scenes-v1 --n-layer 1 --steps 1200 --batch-size 16 --seed 0

Data: the tokenised train scenes of `pipelines.train_cloud` (built there, or here if missing). Each step draws a
batch, drops captions with the cloud's `class_dropout_prob` (the same rows for cloud and device, so both the
conditional and the unconditional branch are distilled: CFG-aware), runs the frozen cloud for its distributions
q, and trains the device with `ciar.collab.losses.inter_dro_loss` (anchor, DRO-reweighted lower, center with
KL(q || softmax(c)), upper). Labels y are the data tokens (`--labels data`) or draws from q (`--labels cloud`).
Every loss term can be switched off (`--ablate lower` ...; paper Table 7). With several heads (`--num-heads`),
every head gets its own loss.

The device starts from the cloud's first `--n-layer` layers (`DeviceModel.from_cloud`). Writes
`OUT/device.safetensors` (or `--name`), `OUT/device.metrics.json`: validation CE, KL to the cloud, top-1
agreement with the cloud, and how well each gate score predicts a disagreement (AUROC of U, entropy, 1 - max p).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from ciar.collab.device import DeviceConfig, DeviceModel
from ciar.collab.gating import gate_scores
from ciar.collab.interval import guided_interval
from ciar.collab.losses import LOSS_TERMS, InterDROConfig, inter_dro_loss
from ciar.world import load_default_world
from pipelines.common import cosine_lr, load_training_state, pick_device, save_training_state, seed_everything, set_lr
from pipelines.train_cloud import TokenisedScenes, build_split, get_batch


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of `scores` for the boolean labels `positive` (ties count one half)."""
    scores, positive = scores.double().flatten(), positive.flatten().bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inv = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / counts)[inv]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.no_grad()
def evaluate(device_model: DeviceModel, cloud, data: TokenisedScenes, dev, n: int = 128, batch_size: int = 32) -> dict:
    """Teacher-forced validation on the first n val scenes (conditional rows)."""
    device_model.eval()
    ce, kl, agree, count = 0.0, 0.0, 0.0, 0
    scores = {"interval": [], "entropy": [], "softmax": []}
    disagree = []
    for s in range(0, min(n, data.n), batch_size):
        tokens, emb, mask = get_batch(data, np.arange(s, min(s + batch_size, n, data.n)), dev)
        q = torch.softmax(cloud(tokens[:, :-1], emb, mask)[0], -1)  # [B, N, V]
        out = device_model(tokens[:, :-1], emb, mask)
        logp = torch.log_softmax(out.center, -1)
        ce += float(torch.nn.functional.nll_loss(logp.flatten(0, 1), tokens.flatten(), reduction="sum"))
        kl += float((q * (q.clamp_min(1e-12).log() - logp)).sum())
        dis = out.center.argmax(-1) != q.argmax(-1)
        agree += float((~dis).sum())
        count += tokens.numel()
        c, r = guided_interval(out.center.flatten(0, 1), out.radius.flatten(0, 1))
        probs = torch.softmax(out.center.flatten(0, 1), -1)
        scores["interval"].append(gate_scores("interval", center=c, radius=r))
        scores["entropy"].append(gate_scores("entropy", probs=probs))
        scores["softmax"].append(gate_scores("softmax", probs=probs))
        disagree.append(dis.flatten())
    device_model.train()
    dis = torch.cat(disagree)
    u = torch.cat(scores["interval"])
    return {"val_ce": ce / count, "val_kl_to_cloud": kl / count, "top1_agreement_with_cloud": agree / count,
            "auroc_disagreement": {k: auroc(torch.cat(v), dis) for k, v in scores.items()},
            "u_quantiles": {str(q): float(torch.quantile(u, q)) for q in (0.1, 0.5, 0.7, 0.9)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.train_device", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="weights/scenes-v1")
    p.add_argument("--name", default="device", help="output file stem (OUT/NAME.safetensors)")
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--combine", default="ensemble", choices=["ensemble", "voting"])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--labels", default="data", choices=["data", "cloud"])
    p.add_argument("--ablate", action="append", default=[], choices=list(LOSS_TERMS),
                   help="switch a loss term off (repeatable)")
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--dro-eta", type=float, default=1.0)
    p.add_argument("--num-train", type=int, default=30000)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="data_cache/scenes-v1")
    p.add_argument("--ckpt-dir", default=None, help="default runs/<name>")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many steps of this run (resume later)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    dev = pick_device(args.device)
    ckpt_dir = args.ckpt_dir or os.path.join("runs", args.name)

    world = load_default_world(args.out, device=dev)
    cloud = world.cloud.eval().requires_grad_(False)
    cfg = cloud.config
    train = build_split(args.data_dir, "train", args.num_train, args.seed, world.vq, world.text, cfg, dev)
    val = build_split(args.data_dir, "val", args.num_val, args.seed, world.vq, world.text, cfg, dev)

    dcfg = DeviceConfig(n_layer=args.n_layer, num_heads=args.num_heads, combine=args.combine)
    model = DeviceModel.from_cloud(cloud, dcfg).to(dev).train()
    loss_cfg = InterDROConfig(kl_weight=args.kl_weight, dro_eta=args.dro_eta)
    for term in args.ablate:
        loss_cfg = loss_cfg.ablate(term)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = os.path.join(ckpt_dir, "state.pt")
    start = load_training_state(ckpt, model=model, optimizer=opt)
    hist_path = os.path.join(ckpt_dir, "history.json")
    history = json.load(open(hist_path)) if start and os.path.exists(hist_path) else []
    if start:
        print(f"resuming from step {start}")
    print(f"device model: {sum(p_.numel() for p_ in model.parameters()) / 1e6:.2f}M params, {dcfg}, {loss_cfg}")

    def export(step: int) -> None:
        model.save(os.path.join(args.out, f"{args.name}.safetensors"), dtype=torch.float16, extra={
            "trained_steps": step, "batch_size": args.batch_size, "labels": args.labels, "seed": args.seed,
            "loss": vars(loss_cfg) if hasattr(loss_cfg, "__dict__") else str(loss_cfg)})

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=args.name, dynamic_ncols=True)
    t0, ema = time.time(), None
    for step in bar:
        set_lr(opt, cosine_lr(step, args.steps, args.lr, args.warmup))
        rng = np.random.default_rng([args.seed, step])
        tokens, emb, mask = get_batch(train, rng.choice(train.n, args.batch_size, replace=False), dev)
        drop = torch.from_numpy(rng.random(args.batch_size) < cfg.class_dropout_prob).to(dev)
        with torch.no_grad():
            q = torch.softmax(cloud(tokens[:, :-1], emb, mask, drop=drop)[0], -1)  # [B, N, V]
            if args.labels == "cloud":
                g = torch.Generator(device=q.device).manual_seed(args.seed * 1_000_003 + step)
                y = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(tokens.shape)
            else:
                y = tokens
        out = model(tokens[:, :-1], emb, mask, drop=drop, with_heads=args.num_heads > 1)
        heads = out.heads if out.heads is not None else (out.center[None], out.radius[None])
        loss, parts = 0.0, {}
        for c_h, r_h in zip(*heads):
            l_h, parts = inter_dro_loss(c_h.flatten(0, 1), r_h.flatten(0, 1), y.flatten(), q.flatten(0, 1), loss_cfg)
            loss = loss + l_h
        loss = loss / heads[0].shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            history.append({"step": done, "train_loss_ema": ema, **{k: float(v) for k, v in parts.items()},
                            **evaluate(model, cloud, val, dev)})
            print(json.dumps(history[-1]), flush=True)
        stopping = args.stop_after and done - start >= args.stop_after
        if done % args.ckpt_every == 0 or done == args.steps or stopping:
            save_training_state(ckpt, done, model=model, optimizer=opt)
            with open(hist_path, "w") as f:
                json.dump(history, f)
        if stopping:
            export(done)
            print(f"stopped after step {done}; run again to resume")
            return 0
    export(args.steps)
    metrics = {"command_args": vars(args), "params": sum(p_.numel() for p_ in model.parameters()),
               "history": history, "train_seconds_this_run": time.time() - t0}
    with open(os.path.join(args.out, f"{args.name}.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(history[-1] if history else {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
