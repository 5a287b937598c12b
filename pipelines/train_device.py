"""Distil the device model (trunk + Inter-Head) from the frozen cloud, on the cloud's own guided samples; resumable.

    python -m pipelines.train_device --out weights/scenes-v2 --n-layer 1 --steps 6000 --batch-size 32 --seed 3 \
        --data-dir data_cache/scenes-v2-s3

The device drafts from the *guided* cloud distribution (CFG -> temperature -> top-k/p), so that is what it is
distilled towards (docs/architecture.md §10, §12.2):

- **Data** (`--data onpolicy`, the default): token sequences the cloud sampled itself with the world's sampling
  settings (`pipelines.onpolicy`, cached to disk, built here when missing) for captions of the scenes train split;
  `--data data` uses the VQ codes of the rendered scenes instead (`pipelines.data.build_split`).
- **Rows**: every sequence runs as a conditional and an unconditional row through the frozen cloud and the device,
  as at decoding time, so the guided box and the guided distributions are the ones the deployed device sees.
- **Objective** (`--objective`): `coverage` (ours, `ciar.training.losses.distill_loss`): KL(guided cloud || guided
  device) + the coverage loss that trains the guided radius to hold the cloud's log-probabilities of the tokens
  that carry mass, at a price per unit of width; `inter-dro` (the paper): the same KL with the paper's Inter-DRO
  terms on the guided box instead of coverage (labels = the sequence's tokens). `--ablate TERM` switches any term off
  (Table 7: `--objective inter-dro --ablate lower` ...).

The device starts from the cloud's first `--n-layer` layers (`DeviceModel.from_cloud`). Every `--eval-every` steps
it is measured on on-policy **val** sequences under the deployed sampling settings (`evaluate`): guided KL and
total variation to the cloud, top-1 agreement, coverage of the cloud's mass by the box, and each gate's AUROC for
the positions where the device disagrees with the cloud and where the exact rule rejects its draft. Writes
`OUT/NAME.safetensors` (with its training facts in the metadata) and `OUT/NAME.metrics.json` (the curves).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, replace

import numpy as np
import torch

from ciar.collab.device import DeviceConfig, DeviceModel, device_caption
from ciar.collab.gating import gate_scores
from ciar.collab.interval import guided_interval, interval_uncertainty
from ciar.training.losses import (DISTILL_TERMS, LOSS_TERMS, DistillConfig, InterDROConfig, distill_loss, guided_logp,
                                kl_rows, truncate)
from ciar.decoding.sampling import SamplingParams, logits_to_probs
from ciar.metrics.ranking import auroc
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args
from pipelines.common import LoopConfig, TrainingLoop, setup, training_arguments
from pipelines.onpolicy import build_onpolicy, load_captions, onpolicy_tag

OBJECTIVES = ("coverage", "inter-dro")
EVAL_GATES = ("interval", "interval_margin", "lower", "entropy", "softmax", "draft")


def distill_config(objective: str, ablate: list[str], dro_eta: float = 1.0, kl_weight: float = 1.0) -> DistillConfig:
    """The objective's DistillConfig with `ablate`d terms (DISTILL_TERMS, or LOSS_TERMS of the Inter-DRO part)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    cfg = DistillConfig() if objective == "coverage" else DistillConfig(coverage=0.0, inter_dro=1.0)
    dro = InterDROConfig(dro_eta=dro_eta, kl_weight=0.0)  # the KL is distill's own term
    for term in ablate:
        if term in DISTILL_TERMS:
            cfg = cfg.ablate(term)
        elif term in LOSS_TERMS:
            dro = dro.ablate(term)
        else:
            raise ValueError(f"unknown term {term!r}; known: {', '.join(DISTILL_TERMS + LOSS_TERMS)}")
    return replace(cfg, kl=cfg.kl * kl_weight, dro=dro)


def rows(tokens: torch.Tensor, emb: torch.Tensor, mask: torch.Tensor, params: SamplingParams):
    """A batch as the decoder runs it: [cond..., uncond...] rows with CFG, else the conditional rows alone.
    -> (idx [R, N-1], emb [R, L, D] (an Anole world: ids [R, L]), mask [R, L], drop [R] or None, number of row
    groups 2 or 1)."""
    if not params.uses_cfg:
        return tokens[:, :-1], emb, mask, None, 1
    b = tokens.shape[0]
    drop = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)]).to(tokens.device)
    return tokens[:, :-1].repeat(2, 1), torch.cat([emb, emb]), mask.repeat(2, 1), drop, 2  # (emb: [B, L, D] or ids)


def split_rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[G*B, N, V] -> [G, B*N, V]."""
    return x.reshape(groups, -1, x.shape[-1])


class SequenceSet:
    """Token sequences [n, N] (on-policy or data codes) with their caption arrays and a teacher cache.

    The teacher cache holds the cloud's `guided_logp` of every position, float16 [n, N, V] on disk
    (`teacher_path`), filled on first use of a row (`teacher`): a sequence is seen many times over a long run and the
    8-layer cloud's two CFG rows cost ~2x the 1-layer device's forward and backward, so each row pays for the cloud
    once. Values are a pure function of the row, so a resumed run reads what it would have computed.
    """

    def __init__(self, tokens: np.ndarray, captions, dev, teacher_path: str | None = None, vocab_size: int = 0):
        self.tokens, self.captions, self.dev, self.n = tokens, captions, dev, tokens.shape[0]
        self.cache = self.filled = None
        if teacher_path is not None:
            mode = "r+" if os.path.exists(teacher_path) else "w+"
            shape = (self.n, tokens.shape[1], vocab_size)
            self.cache = np.lib.format.open_memmap(teacher_path, mode=mode, dtype=np.float16,
                                                   shape=shape if mode == "w+" else None)
            if self.cache.shape != shape:
                raise ValueError(f"{teacher_path}: shape {self.cache.shape}, expected {shape}")
            self.filled_path = teacher_path[:-4] + ".filled.npy"
            self.filled = (np.load(self.filled_path) if os.path.exists(self.filled_path)
                           else np.zeros(self.n, dtype=np.bool_))

    def batch(self, idx: np.ndarray):
        idx = np.sort(idx)
        from pipelines.data import caption_tensor

        t = torch.from_numpy(self.tokens[idx].astype(np.int64)).to(self.dev)
        emb = caption_tensor(self.captions.emb[idx]).to(self.dev)  # embeddings, or an Anole prompt's ids
        mask = torch.from_numpy(self.captions.mask[idx]).to(self.dev)
        return t, emb, mask

    @torch.no_grad()
    def teacher(self, cloud, idx: np.ndarray, params: SamplingParams) -> torch.Tensor:
        """The cloud's guided log-probabilities of rows `idx` (sorted), [len(idx) * N, V] float32."""
        idx = np.sort(idx)
        if self.cache is None:
            return _teacher_logp(cloud, *self.batch(idx), params)
        missing = idx[~self.filled[idx]]
        if len(missing):
            self.cache[missing] = _teacher_logp(cloud, *self.batch(missing), params).view(
                len(missing), self.tokens.shape[1], -1).cpu().numpy().astype(np.float16)
            self.filled[missing] = True
        return torch.from_numpy(self.cache[idx].astype(np.float32)).to(self.dev).flatten(0, 1)

    def flush(self) -> None:
        """Make the filled rows durable (called with each checkpoint)."""
        if self.cache is not None:
            self.cache.flush()
            tmp = self.filled_path + ".tmp.npy"
            np.save(tmp, self.filled)
            os.replace(tmp, self.filled_path)


def _teacher_logp(cloud, tokens, emb, mask, params: SamplingParams) -> torch.Tensor:
    idx, e, m, drop, g = rows(tokens, emb, mask, params)
    lc = split_rows(cloud(idx, e, m, drop=drop)[0], g)
    return guided_logp(lc[0], lc[1] if g == 2 else None, params)


@torch.no_grad()
def evaluate(device_model: DeviceModel, cloud, data: SequenceSet, params: SamplingParams, n: int = 256,
             batch_size: int = 16, seed: int = 0) -> dict:
    """Teacher-forced on the first n sequences of `data`, both CFG rows, under the deployed sampling `params`.

    Per image position: p = the cloud's guided distribution, q = the device's (`logits_to_probs` of its centers),
    the guided box (`guided_interval`), and a draft x ~ q (seeded). Labels: *disagreement* (argmax q != argmax p)
    and *rejection* (the exact rule rejects x: a uniform draw above p(x)/q(x)). Gates: `interval` (the paper's U,
    tight bounds), `interval_margin` (U after the paper's 1 % safety margin), `lower` (-log p_lo[x]), `entropy` and
    `softmax` (of q), and for reference `draft` (1 - q(x), the drafted token's own probability, no box).
    -> dict of the means and AUROCs.
    """
    was = device_model.training
    device_model.eval()
    gen = torch.Generator().manual_seed(seed)
    kl = tv = agree = covered = count = 0.0
    scores = {g: [] for g in EVAL_GATES}
    disagree, reject, radius = [], [], []
    for s in range(0, min(n, data.n), batch_size):
        tokens, emb, mask = data.batch(np.arange(s, min(s + batch_size, n, data.n)))
        idx, e, m, drop, g = rows(tokens, emb, mask, params)
        p = truncate(data.teacher(cloud, np.arange(s, s + len(tokens)), params), params)  # [M, V]
        out = device_model(idx, device_caption(cloud, e), m, drop=drop)
        dc, dr = split_rows(out.center, g), split_rows(out.radius, g)
        q = logits_to_probs(dc[0], params, uncond_logits=dc[1] if g == 2 else None)
        temp = params.temperature or 1.0
        if g == 2:
            c, r = guided_interval(dc[0], dr[0], dc[1], dr[1], cfg_scale=params.cfg_scale, temperature=temp)
        else:
            c, r = guided_interval(dc[0], dr[0], temperature=temp)
        logq = torch.log(q.clamp_min(1e-30))
        kl += float(kl_rows(p, logq).sum())
        tv += float(0.5 * (p - q).abs().sum())
        dis = q.argmax(-1) != p.argmax(-1)
        agree += float((~dis).sum())
        count += p.shape[0]
        x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        ratio = p.gather(-1, x[:, None]).squeeze(-1) / q.gather(-1, x[:, None]).squeeze(-1).clamp_min(1e-30)
        rej = torch.rand(x.shape, generator=gen) >= ratio.clamp(max=1.0)
        lg = torch.log_softmax(c, -1)
        lp = torch.log(p.clamp_min(1e-30))
        inside = ((lg - lp).abs() <= r) & (p > 0)
        covered += float((inside * p).sum())
        for chunk in torch.split(torch.arange(p.shape[0]), 1024):
            cc, rr = c[chunk], r[chunk]
            scores["interval"].append(gate_scores("interval", center=cc, radius=rr))
            scores["interval_margin"].append(interval_uncertainty(cc, rr, margin=0.01))
            scores["lower"].append(gate_scores("lower", center=cc, radius=rr, drafted=x[chunk]))
        scores["entropy"].append(gate_scores("entropy", probs=q))
        scores["softmax"].append(gate_scores("softmax", probs=q))
        scores["draft"].append(1.0 - q.gather(-1, x[:, None]).squeeze(-1))
        disagree.append(dis)
        reject.append(rej)
        radius.append(r.mean(-1))
    device_model.train(was)
    dis, rej = torch.cat(disagree), torch.cat(reject)
    cat = {k: torch.cat(v) for k, v in scores.items()}
    return {"val_kl_guided": kl / count, "val_tv_guided": tv / count, "top1_agreement": agree / count,
            "rejection_rate": float(rej.float().mean()), "box_coverage_of_cloud_mass": covered / count,
            "radius_mean": float(torch.cat(radius).mean()),
            "auroc_disagreement": {k: auroc(v, dis) for k, v in cat.items()},
            "auroc_rejection": {k: auroc(v, rej) for k, v in cat.items()},
            "score_quantiles": {k: {str(qq): float(torch.quantile(v.double(), qq)) for qq in (0.5, 0.7, 0.9)}
                                for k, v in cat.items() if k in ("interval", "lower")}}


def load_sequences(kind: str, split: str, n: int, seed: int, data_dir: str, world, dev,
                   teacher_cache: bool = True, captions: str | None = None) -> SequenceSet:
    """On-policy sequences of the world's cloud (built when missing) or the scenes' VQ codes, with captions and
    the teacher cache next to them (named after the cloud file and the sampling settings). `captions`: a
    COCO-format file whose first `n` captions this split samples on (a LlamaGen world; default: the scenes split)."""
    tag = onpolicy_tag(world.cloud_file, world.sampling)
    vocab = world.cloud.config.vocab_size
    if kind == "onpolicy":
        caps = load_captions(data_dir, split, n, seed, world, dev, captions)
        toks = build_onpolicy(os.path.join(data_dir, "onpolicy"), split, caps, world.cloud, world.sampling, seed, tag)
        return SequenceSet(toks.tokens, caps, dev, toks.path[:-4] + ".teacher.npy" if teacher_cache else None, vocab)
    if captions is not None:
        raise ValueError("--data data (VQ codes of images) exists for the scenes world only; use --data onpolicy")
    from pipelines.data import build_split

    data = build_split(data_dir, split, n, seed, world.vq, world.text, world.cloud.config, dev)
    path = os.path.join(data_dir, f"{split}_{n}_data_{tag}.teacher.npy") if teacher_cache else None
    return SequenceSet(data.tokens, data, dev, path, vocab)


def plot_history(history: list[dict], path: str, title: str = "") -> None:
    """The card's curves (PNG): guided KL / TV / top-1 agreement, and each gate's AUROC for rejections and for
    disagreements, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("val_kl_guided", "KL(guided cloud || guided device)"), ("val_tv_guided", "total variation"),
                       ("top1_agreement", "top-1 agreement")):
        ax[0].plot(steps, [h[key] for h in history], marker="o", label=label)
    ax[0].set_xlabel("step")
    ax[0].legend()
    for i, which in ((1, "auroc_rejection"), (2, "auroc_disagreement")):
        for gate in history[-1][which]:
            ax[i].plot(steps, [h[which][gate] for h in history], marker=".", label=gate)
        ax[i].set_title(f"{which.replace('_', ' ')} (val, deployed CFG)")
        ax[i].set_xlabel("step")
        ax[i].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def eval_only(args, world, dev) -> int:
    """The gate AUROC table of one device file on on-policy sequences (the cloud's own samples, deployed CFG)."""
    model = DeviceModel.load(args.eval_only, device=dev)
    data = load_sequences("onpolicy", args.eval_split, args.eval_n, args.seed, args.data_dir, world, dev,
                          captions=args.val_captions)
    res = {"device_file": args.eval_only, "split": args.eval_split, "sequences": args.eval_n, "seed": args.seed,
           "sampling": world.sampling.to_dict(),
           **evaluate(model, world.cloud, data, world.sampling, n=args.eval_n)}
    data.flush()
    text = json.dumps(res, indent=2)
    if args.eval_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.eval_out)), exist_ok=True)
        with open(args.eval_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def main(argv=None) -> int:
    p = training_arguments("python -m pipelines.train_device", __doc__, out="weights/scenes-v2", steps=6000,
                           batch_size=32, lr=1e-3, warmup=100, seed=3, ckpt_dir=None, ckpt_help="default runs/<name>",
                           out_help="output folder (and the scenes world read, unless --world / --weights)")
    add_world_arguments(p)
    p.add_argument("--captions", default=None, help="COCO-format training captions (a LlamaGen world)")
    p.add_argument("--val-captions", default=None, help="COCO-format val captions (a LlamaGen world)")
    p.add_argument("--teacher-cache", default="auto", choices=["auto", "on", "off"],
                   help="keep the cloud's guided log-probs on disk (auto: when the cache is <= 16 GB; a LlamaGen "
                        "vocabulary of 16384 codes makes it 8 MB per sequence)")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"],
                   help="bfloat16 autocast (auto: on CUDA)")
    p.add_argument("--name", default="device", help="output file stem (OUT/NAME.safetensors)")
    p.add_argument("--init", default=None, help="start from this device file (same depth and heads) instead of the "
                   "cloud's first layers")
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--combine", default="ensemble", choices=["ensemble", "voting"])
    p.add_argument("--data", default="onpolicy", choices=["onpolicy", "data"])
    p.add_argument("--objective", default="coverage", choices=OBJECTIVES)
    p.add_argument("--ablate", action="append", default=[], choices=list(DISTILL_TERMS + LOSS_TERMS),
                   help="switch a loss term off (repeatable)")
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--dro-eta", type=float, default=1.0)
    p.add_argument("--num-train", type=int, default=12000)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--eval-n", type=int, default=256, help="val sequences per evaluation")
    p.add_argument("--data-dir", default="data_cache/scenes-v2-s3")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-only", default=None, metavar="DEVICE_FILE",
                   help="no training: measure this device file on on-policy sequences of --eval-split (the gate "
                        "AUROC table) and write --eval-out")
    p.add_argument("--eval-split", default="val", choices=["val", "heldout"])
    p.add_argument("--eval-out", default=None)
    args = p.parse_args(argv)
    dev = setup(args)
    ckpt_dir = args.ckpt_dir or os.path.join("runs", args.name)
    loss_cfg = distill_config(args.objective, args.ablate, args.dro_eta, args.kl_weight)

    try:
        spec = read_world(world_from_args(args) or args.out, need_text=True)
    except WorldSpecError as e:
        p.error(str(e))
    scenes_world = isinstance(spec, ScenesWorldSpec)
    if not scenes_world and not ((args.captions or args.eval_only) and args.val_captions):
        p.error("a LlamaGen world distils on --captions and --val-captions (COCO-format files; --eval-only reads "
                "--val-captions)")
    world = load_world(spec, device=dev)
    cloud = world.cloud.eval().requires_grad_(False)
    params = world.sampling
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if (args.amp == "bf16" or args.amp == "auto" and
                                                             dev.type == "cuda") else contextlib.nullcontext()
    if args.eval_only:
        return eval_only(args, world, dev)
    cfg = cloud.config
    per_seq = cfg.block_size * cfg.vocab_size * 2  # float16 bytes of one sequence's teacher log-probs
    cache = args.teacher_cache == "on" or (args.teacher_cache == "auto" and
                                            per_seq * (args.num_train + args.num_val) <= 16 << 30)
    os.makedirs(args.out, exist_ok=True)
    train = load_sequences(args.data, "train", args.num_train, args.seed, args.data_dir, world, dev, cache,
                           None if scenes_world else args.captions)
    val = load_sequences("onpolicy", "val", args.num_val, args.seed, args.data_dir, world, dev, cache,
                         None if scenes_world else args.val_captions)

    dcfg = DeviceConfig(n_layer=args.n_layer, num_heads=args.num_heads, combine=args.combine)
    model = DeviceModel.from_cloud(cloud, dcfg).to(dev).train()
    if args.init:
        init = DeviceModel.load(args.init, device=dev)
        if init.device_config != dcfg or init.config != model.config:
            raise SystemExit(f"--init {args.init}: its config {init.device_config} differs from this run's {dcfg}")
        model.load_state_dict(init.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def export(step: int) -> None:
        model.save(os.path.join(args.out, f"{args.name}.safetensors"), dtype=torch.float16, extra={
            "trained_steps": step, "batch_size": args.batch_size, "data": args.data, "objective": args.objective,
            "seed": args.seed, "loss": asdict(loss_cfg), "sampling": params.to_dict(), "world": spec.describe(),
            "init": os.path.basename(args.init) if args.init else "cloud layers"})

    def flush() -> None:
        train.flush()
        val.flush()

    loop = TrainingLoop(LoopConfig.from_args(args, desc=args.name, ckpt_dir=ckpt_dir), opt,
                        {"model": model, "optimizer": opt}, export=export, before_checkpoint=flush,
                        evaluate=lambda: evaluate(model, cloud, val, params, n=args.eval_n))
    print(f"device model: {sum(p_.numel() for p_ in model.parameters()) / 1e6:.2f}M params, {dcfg}, {loss_cfg}, "
          f"sampling {params}")
    for step in loop:
        rng = np.random.default_rng([args.seed, step])
        pick = rng.choice(train.n, args.batch_size, replace=False)
        tokens, emb, mask = train.batch(pick)
        with amp:
            logp = train.teacher(cloud, pick, params).float()  # [B*N, V]
            idx, e, m, drop, g = rows(tokens, emb, mask, params)
            out = model(idx, device_caption(cloud, e), m, drop=drop, with_heads=args.num_heads > 1)
        heads = out.heads if out.heads is not None else (out.center[None], out.radius[None])
        loss, parts = 0.0, {}
        for c_h, r_h in zip(*heads):
            l_h, parts = distill_loss(split_rows(c_h, g), split_rows(r_h, g), logp, params,
                                      targets=tokens.flatten(), config=loss_cfg)
            loss = loss + l_h
        loss = loss / heads[0].shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loop.log(loss.item(), parts)
    if loop.stopped:
        return 0
    history = loop.history
    metrics = {"command_args": vars(args), "params": sum(p_.numel() for p_ in model.parameters()),
               "history": history, "train_seconds_last_run": time.time() - loop.t0}
    with open(os.path.join(args.out, f"{args.name}.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    if history:
        plot_history(history, os.path.join(args.out, f"{args.name}.curves.png"), f"{args.name}: {args.objective}, "
                     f"{args.n_layer} layer(s), {args.steps} steps x {args.batch_size}")
    print(json.dumps(history[-1] if history else {}))
    return 0


if __name__ == "__main__":
    from pipelines.common import run_main

    raise SystemExit(run_main(main))
