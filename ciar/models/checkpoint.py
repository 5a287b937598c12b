"""Reading and writing model weights.

- Our own weights: safetensors files with the model's config stored as JSON in the metadata (`save_model`,
  `load_model_file`), so a weight file is self-describing.
- Foreign checkpoints (LlamaGen `.pt`): `read_checkpoint` unwraps the usual nesting ("model", "module",
  "state_dict") and `load_strict` loads with an explicit ignore list, naming every missing, unexpected or
  mis-shaped key in one readable error. Never `strict=False`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle

import torch
from safetensors.torch import load_file, safe_open, save_file


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: lists the offending keys."""


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.endswith(".safetensors"):
        return load_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # LlamaGen's training scripts store their argparse.Namespace next to the weights
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "module", "state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict):
        raise CheckpointMismatchError(f"{path}: expected a state dict, found {type(obj).__name__}")
    # DDP / compiled-model prefixes
    prefixes = ("module.", "_orig_mod.")
    return {next((k[len(p):] for p in prefixes if k.startswith(p)), k): v for k, v in obj.items()}


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], ignore_prefixes=(), what: str = "model") -> None:
    """Load `state` into `model`; every key must match in name and shape except those under `ignore_prefixes`."""
    ignored = lambda k: any(k.startswith(p) for p in ignore_prefixes)  # noqa: E731
    own = {k: v for k, v in model.state_dict().items() if not ignored(k)}
    theirs = {k: v for k, v in state.items() if not ignored(k)}
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    shapes = sorted(
        f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(theirs) if theirs[k].shape != own[k].shape
    )
    if missing or unexpected or shapes:
        parts = [f"checkpoint does not fit the {what}:"]
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", shapes)):
            if items:
                shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
                parts.append(f"  {label} ({len(items)}): {shown}")
        raise CheckpointMismatchError("\n".join(parts))
    result = model.load_state_dict({k: v.to(own[k].dtype) for k, v in theirs.items()}, strict=False)
    leftover = [k for k in result.missing_keys if not ignored(k)]
    if leftover or result.unexpected_keys:  # cannot happen after the checks above; keep the guarantee explicit
        raise CheckpointMismatchError(f"{what}: missing {leftover}, unexpected {result.unexpected_keys}")


def save_model(model: torch.nn.Module, path: str, config: dict, kind: str, extra: dict | None = None,
               dtype: torch.dtype | None = None) -> None:
    """Write `model`'s parameters and persistent buffers to `path` (safetensors) with its config as metadata."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous()
    meta = {"kind": kind, "config": json.dumps(config)}
    if extra:
        meta["extra"] = json.dumps(extra)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def read_model_metadata(path: str) -> tuple[str, dict, dict]:
    """-> (kind, config dict, extra dict) of a file written by `save_model`, without reading its tensors."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weight file not found: {path}")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise CheckpointMismatchError(f"{path}: no config in the safetensors metadata (not written by ciar?)")
    return meta.get("kind", ""), json.loads(meta["config"]), json.loads(meta.get("extra", "{}"))


def read_model_file(path: str) -> tuple[dict[str, torch.Tensor], str, dict, dict]:
    """-> (state dict, kind, config dict, extra dict) of a file written by `save_model`."""
    kind, config, extra = read_model_metadata(path)
    return load_file(path), kind, config, extra


def update_extra(path: str, set_items: dict, drop: tuple[str, ...] = ()) -> dict:
    """Rewrite the `extra` metadata of a file written by `save_model` (keys in `set_items` set, keys in `drop`
    removed), tensors bit for bit, atomically (temp file + rename). -> the new extra dict."""
    kind, config, extra = read_model_metadata(path)
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    for k in drop:
        extra.pop(k, None)
    extra.update(set_items)
    meta["extra"] = json.dumps(extra)
    tmp = path + ".tmp"
    save_file(load_file(path), tmp, metadata=meta)
    os.replace(tmp, path)
    return extra
