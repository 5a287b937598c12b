"""Train the default world's cloud model (LlamaGen GPT, t2i) on tokenised procedural scenes, resumable.

    python -m pipelines.train_cloud --out weights/scenes-v1 --num-train 30000 --steps 3000 --batch-size 16 --seed 0

Two stages, both resumable:
1. Data: render `--num-train` train-split scenes (and 512 val scenes), tokenise them with the shipped tokenizer
   (`OUT/tokenizer.safetensors`) and encode their captions with the text encoder; stored as memory-mapped arrays
   under `--data-dir` (chunked; an interrupted build continues where it stopped).
2. Training: AdamW with warmup + cosine decay, caption dropout for classifier-free guidance, checkpoints every
   `--ckpt-every` steps in `--ckpt-dir`. Batches are drawn by a generator seeded with (seed, step), so a resumed run
   sees exactly the batches of an uninterrupted one.
Writes `OUT/cloud.safetensors` (config + sampling defaults in the metadata) and `OUT/cloud.metrics.json`.

`--init FILE` starts a NEW run (fresh optimizer and schedule) from the weights of an exported `cloud.safetensors`
of the same config, e.g. to continue training the shipped model in stretches when its run directory is gone; the
export records the file and the steps it had been trained for.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from pipelines.data import TokenisedScenes, build_split, get_batch  # noqa: F401 - TokenisedScenes: re-exported
from ciar.models.checkpoint import read_model_file, save_model
from ciar.models.gpt import GPTConfig, build_gpt, gpt_config
from ciar.models.vq import VQConfig, VQModel
from ciar.text import TextEncoder
from pipelines.common import LoopConfig, TrainingLoop, setup, training_arguments


@torch.no_grad()
def val_loss(model, data: TokenisedScenes, device, batch_size=64) -> float:
    model.eval()
    losses = []
    for s in range(0, data.n, batch_size):
        tokens, emb, mask = get_batch(data, np.arange(s, min(s + batch_size, data.n)), device)
        _, loss = model(tokens[:, :-1], emb, mask, targets=tokens)
        losses.append(loss.item() * len(tokens))
    model.train()
    return sum(losses) / data.n


def parse_overrides(items: list[str]) -> dict:
    fields = GPTConfig.__dataclass_fields__
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set expects FIELD=VALUE with FIELD one of {sorted(fields)}; got {item!r}")
        out[key] = type(getattr(GPTConfig(), key) if getattr(GPTConfig(), key) is not None else 0)(value)
    return out


def init_from(path: str, cfg: GPTConfig, model=None) -> dict:
    """Check that an exported cloud model file has config `cfg`, and load its weights into `model` when given (a
    resumed run only checks). -> {"file", "steps"}: what the run's exports record."""
    from ciar.models.checkpoint import load_strict, read_model_metadata

    kind, file_cfg, extra = read_model_metadata(path)  # the checks need no tensors
    if kind != "gpt":
        raise SystemExit(f"--init {path}: expected a cloud model file (kind 'gpt'), found {kind!r}")
    if GPTConfig.from_dict(file_cfg) != cfg:
        raise SystemExit(f"--init {path}: its config differs from --config/--set: {file_cfg} vs {cfg.to_dict()}")
    if model is not None:
        state = read_model_file(path)[0]
        load_strict(model, {k: v.float() for k, v in state.items()}, what="cloud model")
    return {"file": os.path.abspath(path), "steps": (extra or {}).get("trained_steps")}


def main(argv=None) -> int:
    p = training_arguments("python -m pipelines.train_cloud", __doc__, out="weights/scenes-v1", steps=3000,
                           batch_size=16, lr=1e-3, warmup=100, seed=0, ckpt_dir="runs/cloud")
    p.add_argument("--config", default="scenes-cloud")
    p.add_argument("--num-train", type=int, default=30000)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--data-dir", default="data_cache/scenes-v1")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--export-every", type=int, default=250, help="also write OUT/cloud.safetensors every N steps")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a GPTConfig field of --config, e.g. --set n_layer=2 (repeatable)")
    p.add_argument("--init", default=None, metavar="FILE",
                   help="start a new run from the weights of this cloud.safetensors (same config)")
    p.add_argument("--prepare-text-only", action="store_true",
                   help="only encode the captions (can run before the tokenizer exists), then exit")
    args = p.parse_args(argv)
    device = setup(args)

    cfg = gpt_config(args.config, **parse_overrides(args.set))
    text = TextEncoder(max_length=cfg.cls_token_num, device=device)
    if args.prepare_text_only:
        for split, n in (("train", args.num_train), ("val", args.num_val)):
            build_split(args.data_dir, split, n, args.seed, None, text, cfg, device)
        return 0
    state, kind, vq_cfg, _ = read_model_file(os.path.join(args.out, "tokenizer.safetensors"))
    vq = VQModel(VQConfig.from_dict(vq_cfg))
    vq.load_state_dict({k: v.float() for k, v in state.items()})
    vq.to(device).eval()
    if (vq.config.grid_size ** 2, vq.config.codebook_size) != (cfg.block_size, cfg.vocab_size):
        raise SystemExit(f"tokenizer ({vq.config.grid_size}^2 tokens, {vq.config.codebook_size} codes) does not "
                         f"match config {args.config} ({cfg.block_size} tokens, {cfg.vocab_size} codes)")
    train = build_split(args.data_dir, "train", args.num_train, args.seed, vq, text, cfg, device)
    val = build_split(args.data_dir, "val", args.num_val, args.seed, vq, text, cfg, device)
    del vq, text

    model = build_gpt(cfg).to(device)
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    def export(step):
        extra = {"sampling": {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
                 "trained_steps": step, "batch_size": args.batch_size, "num_train": args.num_train, "seed": args.seed}
        if init:
            extra["init"] = init
        save_model(model, os.path.join(args.out, "cloud.safetensors"), cfg.to_dict(), kind="gpt", extra=extra,
                   dtype=torch.float16)

    loop = TrainingLoop(LoopConfig.from_args(args, desc="cloud"), opt, {"model": model, "optimizer": opt},
                        evaluate=lambda: {"val_loss": val_loss(model, val, device)}, export=export)
    # a new run may start from an exported model; a resumed one (the loop restored its state) only checks the file
    init = init_from(args.init, cfg, model=None if loop.start else model) if args.init else None
    if init and not loop.start:
        print(f"initialised from {args.init} ({init['steps']} steps)")
    print(f"cloud model: {sum(p_.numel() for p_ in model.parameters()) / 1e6:.2f}M params, {cfg}")
    model.train()
    for step in loop:
        rng = np.random.default_rng([args.seed, step])
        tokens, emb, mask = get_batch(train, rng.choice(train.n, args.batch_size, replace=False), device)
        drop = torch.from_numpy(rng.random(args.batch_size) < cfg.class_dropout_prob).to(device)
        _, loss = model(tokens[:, :-1], emb, mask, drop=drop, targets=tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loop.log(loss.item())
    if loop.stopped:
        return 0
    metrics = {"steps": args.steps, "batch_size": args.batch_size, "num_train": args.num_train, "seed": args.seed,
               "history": loop.history, "train_seconds_this_run": time.time() - loop.t0}
    with open(os.path.join(args.out, "cloud.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    from pipelines.common import run_main

    raise SystemExit(run_main(main))
