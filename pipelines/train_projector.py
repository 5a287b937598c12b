"""Train the interval-feature projector (CIAR's interval-enhanced decoding) with the cloud and device frozen.

    python -m pipelines.train_projector --out weights/scenes-v2 --steps 400 --batch-size 16 --seed 3 \
        --data-dir data_cache/scenes-v2-s3

What it learns (our reading of the paper's "distribution alignment"; docs/architecture.md §7): during collaborative
decoding the cloud catches up on tokens the device accepted locally, and those can differ from what the cloud
would have chosen. Each training sequence is an on-policy cloud sequence (`--data onpolicy`, the device's
distillation set; `--data data`: VQ codes of rendered scenes) in which every image token is, with probability
`--local-rate`, replaced by a draw from the device's *guided* distribution at that position (teacher-forced
device, both CFG rows, as deployed) and marked "accepted locally": those positions carry `proj(device hidden,
interval features of the guided box)` added to the cloud's input embedding (both CFG rows, as the verifier adds
it). The loss is the frozen cloud's guided cross-entropy on the tokens that were not replaced, i.e.
the projector learns to tell the cloud how far to trust each locally accepted token so its predictions stay
aligned. The output layer starts at zero (= "w/o Inter-Enhance"); validation reports the cloud's CE on
corrupted sequences with and without the projector.

Writes `OUT/projector.safetensors` and `OUT/projector.metrics.json`.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from ciar.collab.device import DeviceModel, device_caption
from ciar.collab.interval import guided_interval, interval_feature_dim, interval_features
from ciar.training.losses import guided_logp
from ciar.collab.projector import IntervalProjector, ProjectorConfig
from ciar.decoding.sampling import logits_to_probs
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args
from pipelines.common import LoopConfig, TrainingLoop, setup, training_arguments
from pipelines.train_device import load_sequences, rows


def corrupt(device_model: DeviceModel, tokens, emb, mask, params, rate: float, gen: torch.Generator, top: int):
    """Replace tokens by device draws as deployment makes them: both CFG rows, the *guided* draft distribution and
    the guided box's interval features (what `CollabDecoder` sends). -> (mixed tokens [B, N], local [B, N] bool,
    device hidden of the conditional rows [B, N, d], features [B, N, F])."""
    with torch.no_grad():
        idx, e, m, drop, g = rows(tokens, emb, mask, params)
        out = device_model(idx, e, m, drop=drop)  # [G*B, N, ...]: position j predicts token j
        b = tokens.shape[0]
        cc, rc = out.center[:b], out.radius[:b]
        cu, ru = (out.center[b:], out.radius[b:]) if g == 2 else (None, None)
        q = logits_to_probs(cc, params, uncond_logits=cu)
        draws = torch.multinomial(q.flatten(0, 1).cpu(), 1, generator=gen).view(tokens.shape).to(tokens.device)
        local = torch.rand(tokens.shape, generator=gen).to(tokens.device) < rate
        mixed = torch.where(local, draws, tokens)
        c, r = guided_interval(cc, rc, cu, ru, cfg_scale=params.cfg_scale, temperature=params.temperature or 1.0)
        feats = interval_features(c, r, top=top)
    return mixed, local, out.hidden[:b], feats


def cloud_ce(cloud, projector, mixed, local, hidden, feats, tokens, emb, mask, params):
    """The cloud's guided CE (both CFG rows, the projection added to both, as the verifier does) on the tokens that
    were not replaced (position j+1 predicted from the mixed context up to j)."""
    idx, e, m, drop, g = rows(mixed, emb, mask, params)
    extra = None
    if projector is not None:
        extra = projector(hidden, feats) * local[..., None].to(hidden.dtype)  # [B, N, dim]
        extra = extra[:, :-1].repeat(g, 1, 1)
    logits, _ = cloud(idx, e, m, drop=drop, extra_emb=extra)  # [G*B, N, V]
    b = mixed.shape[0]
    logp = guided_logp(logits[:b], logits[b:] if g == 2 else None, params)
    keep = ~local  # targets the device did not make
    keep[:, 0] = False  # token 0 has no context to align
    return F.nll_loss(logp[keep], tokens[keep])


def main(argv=None) -> int:
    p = training_arguments("python -m pipelines.train_projector", __doc__, out="weights/scenes-v2", steps=400,
                           batch_size=16, lr=1e-3, warmup=30, seed=3, ckpt_dir="runs/projector", stop_after=False,
                           out_help="output folder (and the scenes world read, unless --world / --weights)")
    add_world_arguments(p)
    p.add_argument("--device-file", default=None, help="device model (default: the world's; a relative path is "
                                                       "taken in --out)")
    p.add_argument("--captions", default=None, help="COCO-format training captions (a LlamaGen world)")
    p.add_argument("--val-captions", default=None, help="COCO-format val captions (a LlamaGen world)")
    p.add_argument("--local-rate", type=float, default=0.7, help="fraction of tokens replaced by device draws")
    p.add_argument("--feature-top", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--data", default="onpolicy", choices=["onpolicy", "data"])
    p.add_argument("--num-train", type=int, default=12000)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--data-dir", default="data_cache/scenes-v2-s3")
    args = p.parse_args(argv)
    dev = setup(args)

    try:
        spec = read_world(world_from_args(args) or args.out, need_device=args.device_file is None, need_text=True)
    except WorldSpecError as e:
        p.error(str(e))
    llamagen = not isinstance(spec, ScenesWorldSpec)  # (or an Anole world: captions files too)
    if llamagen and not (args.captions and args.val_captions):
        p.error("a LlamaGen or Anole world trains on --captions and --val-captions (COCO-format files)")
    world = load_world(spec, device=dev)
    cloud = world.cloud.eval().requires_grad_(False)
    device_model = (world.device_model if args.device_file is None else
                    DeviceModel.load(os.path.join(args.out, args.device_file), device=dev)).requires_grad_(False)
    cfg = cloud.config
    params = world.sampling
    os.makedirs(args.out, exist_ok=True)
    train = load_sequences(args.data, "train", args.num_train, args.seed, args.data_dir, world, dev,
                           teacher_cache=False, captions=args.captions if llamagen else None)
    val = load_sequences("onpolicy", "val", args.num_val, args.seed, args.data_dir, world, dev, teacher_cache=False,
                         captions=args.val_captions if llamagen else None)

    pcfg = ProjectorConfig(device_dim=device_model.config.dim, cloud_dim=cfg.dim,
                           feature_dim=interval_feature_dim(args.feature_top), feature_top=args.feature_top,
                           hidden=args.hidden, standardize=True)
    projector = IntervalProjector(pcfg).to(dev).train()
    opt = torch.optim.AdamW(projector.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def validate(n: int = 128) -> dict:
        projector.eval()
        n = min(n, val.n)
        gen = torch.Generator().manual_seed(12345)
        with_p, without = [], []
        with torch.no_grad():
            for s in range(0, n, 32):
                tokens, emb, mask = val.batch(np.arange(s, min(s + 32, n)))
                mixed, local, hidden, feats = corrupt(device_model, tokens, device_caption(cloud, emb), mask, params,
                                                      args.local_rate, gen, args.feature_top)
                with_p.append(float(cloud_ce(cloud, projector, mixed, local, hidden, feats, tokens, emb, mask,
                                             params)))
                without.append(float(cloud_ce(cloud, None, mixed, local, hidden, feats, tokens, emb, mask, params)))
        projector.train()
        return {"val_ce_with_projector": float(np.mean(with_p)), "val_ce_without_projector": float(np.mean(without))}

    loop = TrainingLoop(LoopConfig.from_args(args, desc="projector"), opt, {"model": projector, "optimizer": opt})
    for step in loop:
        rng = np.random.default_rng([args.seed, step])
        tokens, emb, mask = train.batch(rng.choice(train.n, args.batch_size, replace=False))
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        mixed, local, hidden, feats = corrupt(device_model, tokens, device_caption(cloud, emb), mask, params,
                                              args.local_rate, gen, args.feature_top)
        loss = cloud_ce(cloud, projector, mixed, local, hidden, feats, tokens, emb, mask, params)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(projector.parameters(), 1.0)
        opt.step()
        loop.log(loss.item())
    metrics = {"command_args": vars(args), "steps": args.steps, **validate(),
               "train_seconds_this_run": time.time() - loop.t0}
    projector.save(os.path.join(args.out, "projector.safetensors"), extra={
        "trained_steps": args.steps, "seed": args.seed, "data": args.data, "device_file": args.device_file or "the world's device model",
        "features": "guided box, CFG rows as deployed; Omega and U_norm through log1p"})
    with open(os.path.join(args.out, "projector.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    from pipelines.common import run_main

    raise SystemExit(run_main(main))
