"""Shared plumbing for the training pipelines: seeding, device choice, resumable checkpoints, progress."""

from __future__ import annotations

import os
import random

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
