"""Shared plumbing for the training pipelines: seeding, device choice, resumable checkpoints, progress."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


class TrainingLoop:
    """The loop every trainer runs: cosine learning rate with warm-up, a progress bar with an EMA of the loss,
    evaluation into a history every `eval_every` steps (and at the end), atomic checkpoints (state + history) every
    `ckpt_every` steps (and at the end), an export every `export_every` steps (default: with each checkpoint), and
    `stop_after` (stop after that many steps of this run; the same command resumes).

        loop = TrainingLoop(ckpt_dir, args.steps, opt, lr=args.lr, warmup=args.warmup, desc="device",
                            objects={"model": model, "optimizer": opt}, eval_every=500, evaluate=validate,
                            export=lambda step: model.save(...), stop_after=args.stop_after)
        for step in loop:                         # the learning rate is set; resumed runs start at loop.start
            loss = ...; opt.zero_grad(); loss.backward(); opt.step()
            loop.log(loss.item(), parts)          # EMA, progress bar, the history's train_parts
        if loop.stopped:
            return 0                              # stopped early: run again to resume
    """

    def __init__(self, ckpt_dir: str, steps: int, optimizer: torch.optim.Optimizer, *, lr: float, warmup: int,
                 desc: str, objects: dict, ckpt_every: int = 50, eval_every: int = 0, export_every: int = 0,
                 evaluate=None, export=None, before_checkpoint=None, stop_after: int = 0, postfix=("agree", "tv")):
        self.steps, self.optimizer, self.lr, self.warmup, self.desc = steps, optimizer, lr, warmup, desc
        self.objects, self.ckpt_every, self.eval_every, self.export_every = objects, ckpt_every, eval_every, export_every
        self.evaluate, self.export, self.before_checkpoint = evaluate, export, before_checkpoint
        self.stop_after, self.postfix = stop_after, postfix
        self.ckpt = os.path.join(ckpt_dir, "state.pt")
        self.hist_path = os.path.join(ckpt_dir, "history.json")
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
        shown = {k: f"{self.parts[k]:.3f}" for k in self.postfix if k in self.parts}
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

        self._bar = tqdm(range(self.start, self.steps), initial=self.start, total=self.steps, desc=self.desc,
                         dynamic_ncols=True)
        for step in self._bar:
            set_lr(self.optimizer, cosine_lr(step, self.steps, self.lr, self.warmup))
            yield step
            done = step + 1
            last = done == self.steps
            if self.evaluate is not None and self.eval_every and (done % self.eval_every == 0 or last):
                entry = {"step": done, "train_loss_ema": self.ema}
                if self.parts:
                    entry["train_parts"] = self.parts
                self.history.append({**entry, "seconds": time.time() - self.t0, **self.evaluate()})
                print(json.dumps(self.history[-1]), flush=True)
            stopping = bool(self.stop_after) and done - self.start >= self.stop_after
            if done % self.ckpt_every == 0 or last or stopping:
                self.checkpoint(done)
                if self.export is not None and not self.export_every:
                    self.export(done)
            if self.export is not None and self.export_every and (done % self.export_every == 0 or last or stopping):
                self.export(done)
            if stopping and not last:
                print(f"stopped after step {done}; run again to resume")
                self.stopped = True
                return
