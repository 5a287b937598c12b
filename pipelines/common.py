"""Shared plumbing for the training pipelines: the common arguments and set-up, seeding, device choice, resumable
checkpoints, progress. Every `pipelines.train_*` main opens with `training_arguments(...)` and `setup(args)`."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ciar.results import SettingsMismatch, claim_settings


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _TrainingParser(argparse.ArgumentParser):
    """`training_arguments`' parser: the shared counts are checked with the rest of the arguments (one line naming
    the flag, exit 2), not deep in a loop (a --batch-size of 0 was a torch error)."""

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        for flag, least in (("steps", 1), ("batch_size", 1), ("ckpt_every", 1), ("warmup", 0), ("threads", 0),
                            ("stop_after", 0), ("seed", 0)):
            value = getattr(ns, flag, None)
            if value is not None and value < least:
                self.error(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
        if not ns.lr >= 0:  # (0 is a run that only carries its --init: a test of the carrying)
            self.error(f"--lr must be >= 0, got {ns.lr}")
        return ns


def training_arguments(prog: str, doc: str | None, *, out: str, steps: int, batch_size: int, lr: float, seed: int,
                       ckpt_dir: str | None, ckpt_every: int = 50, warmup: int | None = None,
                       stop_after: bool = True, out_help: str | None = None,
                       ckpt_help: str | None = None) -> argparse.ArgumentParser:
    """The parser every trainer starts from, holding the arguments they share; the defaults are the trainer's own.

    --out --steps --batch-size --lr [--warmup] --seed --ckpt-dir --ckpt-every --device --threads [--stop-after].
    `warmup=None` leaves --warmup out (a trainer with a fixed warm-up); `stop_after=False` leaves --stop-after out
    (a trainer that always runs to --steps). `--threads` is 0 (torch's default) for every trainer: pass
    `--threads 1` for the single-threaded runs the weight cards record.
    """
    p = _TrainingParser(prog=prog, description=(doc or "").split("\n")[0])
    p.add_argument("--out", default=out, help=out_help)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--ckpt-dir", default=ckpt_dir, help=ckpt_help)
    p.add_argument("--ckpt-every", type=int, default=ckpt_every)
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    if stop_after:
        p.add_argument("--stop-after", type=int, default=0,
                       help="stop this run after N steps (checkpointed; a later run resumes), 0: run to --steps")
    return p


def setup(args: argparse.Namespace) -> torch.device:
    """The set-up every trainer runs after parsing: torch's CPU threads (`--threads`, 0 leaves torch's default),
    every RNG seeded from `--seed`, and the device (`--device`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    return pick_device(args.device)


# a trainer's arguments that say where and how often, not what the run computes (`claim_run` leaves them out; not
# --out: a trainer may read its world there)
EXECUTION_ONLY = frozenset({"ckpt_dir", "ckpt_every", "eval_every", "export_every", "eval_n", "eval_split",
                            "eval_out", "eval_only", "device", "threads", "stop_after", "workers"})


def claim_run(ckpt_dir: str, args: argparse.Namespace | dict) -> None:
    """A trainer's settings (its arguments but EXECUTION_ONLY) in CKPT_DIR/run.json beside its checkpoint: a run
    that resumes the checkpoint must have the settings it was made with (the same command; `--stop-after`,
    `--threads`, ... may differ), or its result is neither run's (SettingsMismatch naming them). Without a
    checkpoint to resume, the run is a new one and records its own."""
    given = args if isinstance(args, dict) else vars(args)
    settings = json.loads(json.dumps({k: v for k, v in given.items() if k not in EXECUTION_ONLY}, default=str))
    path = os.path.join(ckpt_dir, "run.json")
    if not os.path.isfile(os.path.join(ckpt_dir, "state.pt")) and os.path.isfile(path):
        os.remove(path)  # a run that never checkpointed: nothing of it is resumed
    claim_settings(path, settings, f"the checkpoint in {ckpt_dir}",
                   "run the command it was made with to resume it, or give another --ckpt-dir")


def run_main(main) -> int:
    """A trainer's `python -m` entry: main()'s exit code, with a resumable output made with other settings said in
    one line (exit 2) instead of a traceback."""
    try:
        return main()
    except SettingsMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def save_training_state(path: str, step: int, **objects) -> None:
    """Atomically write everything needed to resume (model/optimizer state dicts, RNG states, step)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {"step": step, "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
             "python_rng": random.getstate()}
    for name, obj in objects.items():
        state[name] = obj.state_dict() if hasattr(obj, "state_dict") else obj.clone() if torch.is_tensor(obj) else obj
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_training_state(path: str, **objects) -> int:
    """Restore objects saved by `save_training_state`; returns the step to continue from (0 if no file)."""
    if not os.path.isfile(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=False)
    for name, obj in objects.items():
        if name not in state:
            continue
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(state[name])
        elif isinstance(obj, torch.Tensor):
            obj.copy_(state[name])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"])


def cosine_lr(step: int, total: int, base: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (final_frac + (1 - final_frac) * 0.5 * (1 + np.cos(np.pi * t)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class LoopConfig:
    """What `TrainingLoop` runs: `steps` in all (a resumed run counts from its checkpoint), a cosine learning rate
    from `lr` with `warmup` steps, checkpoints in `ckpt_dir` every `ckpt_every` steps (and at the end), evaluation
    every `eval_every` steps (0: never), an export every `export_every` steps (0: with each checkpoint),
    `stop_after` (stop after that many steps of this run, 0: never), the progress bar's `desc` and the loss parts
    it shows (`postfix`)."""

    ckpt_dir: str
    steps: int
    lr: float
    warmup: int
    desc: str
    ckpt_every: int = 50
    eval_every: int = 0
    export_every: int = 0
    stop_after: int = 0
    postfix: tuple = ("agree", "tv")
    run: dict | None = None  # the trainer's arguments (`from_args`): checked against a resumed checkpoint's

    @classmethod
    def from_args(cls, args: argparse.Namespace, desc: str, **overrides) -> "LoopConfig":
        """The config from a trainer's parsed arguments (`training_arguments` plus its own --eval-every,
        --export-every when it has them); `overrides` win."""
        names = ("ckpt_dir", "steps", "lr", "warmup", "ckpt_every", "eval_every", "export_every", "stop_after")
        found = {n: getattr(args, n) for n in names if hasattr(args, n)}
        return cls(**{"desc": desc, **found, "run": dict(vars(args)), **overrides})


class TrainingLoop:
    """The loop every trainer runs (`LoopConfig` says how long, how often and where): cosine learning rate with
    warm-up, a progress bar with an EMA of the loss, evaluation into a history every `eval_every` steps (and at the
    end), atomic checkpoints (state + history) every `ckpt_every` steps (and at the end), an export every
    `export_every` steps (default: with each checkpoint), and `stop_after` (stop after that many steps of this run;
    the same command resumes).

        loop = TrainingLoop(LoopConfig.from_args(args, desc="device"), opt, {"model": model, "optimizer": opt},
                            evaluate=validate, export=lambda step: model.save(...))
        for step in loop:                         # the learning rate is set; resumed runs start at loop.start
            loss = ...; opt.zero_grad(); loss.backward(); opt.step()
            loop.log(loss.item(), parts)          # EMA, progress bar, the history's train_parts
        if loop.stopped:
            return 0                              # stopped early: run again to resume

    `objects` (name -> state-dict holder or tensor) are what the checkpoint saves and a resumed run restores;
    `evaluate() -> dict` fills the history, `export(step)` writes the run's file, `before_checkpoint()` runs
    before each checkpoint (to flush caches).
    """

    def __init__(self, config: LoopConfig, optimizer: torch.optim.Optimizer, objects: dict, *, evaluate=None,
                 export=None, before_checkpoint=None):
        self.config, self.optimizer, self.objects = config, optimizer, objects
        self.evaluate, self.export, self.before_checkpoint = evaluate, export, before_checkpoint
        self.ckpt = os.path.join(config.ckpt_dir, "state.pt")
        self.hist_path = os.path.join(config.ckpt_dir, "history.json")
        if config.run is not None:
            claim_run(config.ckpt_dir, config.run)
        self.start = load_training_state(self.ckpt, **objects)
        self.history: list[dict] = []
        if self.start and os.path.exists(self.hist_path):
            with open(self.hist_path) as f:
                self.history = json.load(f)
        if self.start:
            print(f"resuming from step {self.start}")
        self.ema: float | None = None
        self.parts: dict = {}
        self.stopped = False
        self.t0 = time.time()
        self._bar = None

    def log(self, loss: float, parts: dict | None = None) -> None:
        self.ema = loss if self.ema is None else 0.98 * self.ema + 0.02 * loss
        self.parts = parts or {}
        shown = {k: f"{self.parts[k]:.3f}" for k in self.config.postfix if k in self.parts}
        self._bar.set_postfix(loss=f"{self.ema:.3f}", **shown)

    def checkpoint(self, done: int) -> None:
        if self.before_checkpoint is not None:
            self.before_checkpoint()
        save_training_state(self.ckpt, done, **self.objects)
        tmp = self.hist_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.history, f)
        os.replace(tmp, self.hist_path)

    def __iter__(self):
        from tqdm import tqdm

        c = self.config
        self._bar = tqdm(range(self.start, c.steps), initial=self.start, total=c.steps, desc=c.desc,
                         dynamic_ncols=True)
        for step in self._bar:
            set_lr(self.optimizer, cosine_lr(step, c.steps, c.lr, c.warmup))
            yield step
            done = step + 1
            last = done == c.steps
            if self.evaluate is not None and c.eval_every and (done % c.eval_every == 0 or last):
                entry = {"step": done, "train_loss_ema": self.ema}
                if self.parts:
                    entry["train_parts"] = self.parts
                self.history.append({**entry, "seconds": time.time() - self.t0, **self.evaluate()})
                print(json.dumps(self.history[-1]), flush=True)
            stopping = bool(c.stop_after) and done - self.start >= c.stop_after
            if done % c.ckpt_every == 0 or last or stopping:
                self.checkpoint(done)
                if self.export is not None and not c.export_every:
                    self.export(done)
            if self.export is not None and c.export_every and (done % c.export_every == 0 or last or stopping):
                self.export(done)
            if stopping and not last:
                print(f"stopped after step {done}; run again to resume")
                self.stopped = True
                return
