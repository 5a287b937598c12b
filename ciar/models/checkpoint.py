"""Reading and writing model weights.

- Our own weights: safetensors files with the model's config stored as JSON in the metadata (`save_model`,
  `load_model_file`), so a weight file is self-describing.
- Foreign checkpoints (LlamaGen `.pt`): `read_checkpoint` unwraps the usual nesting ("model", "module",
  "state_dict") and `load_strict` loads with an explicit ignore list, naming every missing, unexpected or
  mis-shaped key in one readable error. Never `strict=False`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, safe_open, save_file


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: lists the offending keys."""


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.endswith(".safetensors"):
        return load_file(path)
    return _torch_state(path, "cpu")


def _torch_state(path: str, map_location: str) -> dict:
    """The state dict of a torch checkpoint: LlamaGen's argparse.Namespace beside the weights allowed, the "model" /
    "module" / "state_dict" nesting and DDP / compiled-model prefixes removed. `map_location="meta"` reads the pickle
    only (each storage's offset in the file noted: `_checkpoint_offset`)."""
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # LlamaGen's training scripts store their argparse.Namespace next to the weights
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location=map_location, weights_only=True)
    for key in ("model", "module", "state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict):
        raise CheckpointMismatchError(f"{path}: expected a state dict, found {type(obj).__name__}")
    prefixes = ("module.", "_orig_mod.")
    return {next((k[len(p):] for p in prefixes if k.startswith(p)), k): v for k, v in obj.items()}


def _under(key: str, prefixes: tuple) -> bool:
    return any(key.startswith(p) for p in prefixes)


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], ignore_prefixes=(), what: str = "model") -> None:
    """Load `state` into `model`; every key must match in name and shape except those under `ignore_prefixes`."""
    ignored = functools.partial(_under, prefixes=tuple(ignore_prefixes))
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


# ---------------------------------------------------------------------------------------------------- loading in a dtype
@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor not read yet: its shape and type (None: not a tensor, or a type without a torch name
    here); `read()` -> its values, to copy before the next `read()` of the checkpoint (they may live in one buffer
    reused for every tensor), and read once."""

    shape: tuple
    dtype: torch.dtype | None
    read: object  # () -> torch.Tensor

    def placeholder(self) -> torch.Tensor:
        """A meta tensor of this shape: what `load_strict` checks, with no data."""
        return torch.empty(self.shape, dtype=self.dtype or torch.float32, device="meta")


# safetensors' type names -> torch's
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def open_checkpoint(path: str):
    """Context manager: what `read_checkpoint(path)` returns, as {name: StoredTensor} with nothing read yet.

    A safetensors file is read through `safe_open` with positional reads (no memory map: the pages of a mapped file
    that a load touches count in the process's resident set until it is closed); a torch zip file (LlamaGen's .pt) is
    unpickled with shapes only (`_torch_state(path, "meta")`: each storage's offset in the file) and a tensor's storage read from
    its offset, into one buffer reused for every tensor, when asked. A file that cannot be read so (torch's legacy
    format, a big-endian file, a torch that gives no offsets) is read whole by `read_checkpoint`, each tensor handed
    over once (and dropped from the dict).
    """
    import contextlib

    @contextlib.contextmanager
    def opened():
        if path.endswith(".safetensors") and os.path.isfile(path):
            try:
                f = safe_open(path, framework="pt", backend="pread")
            except TypeError:  # an older safetensors: memory-mapped only
                f = safe_open(path, framework="pt")
            with f:
                yield {k: StoredTensor(tuple(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype()),
                                       functools.partial(f.get_tensor, k))
                       for k, s in ((k, f.get_slice(k)) for k in f.keys())}
            return
        if _offsets_readable(path):
            shapes = _torch_state(path, "meta")  # the tensors as meta tensors, each storage's offset noted
            if all(getattr(v.untyped_storage(), "_checkpoint_offset", None) is not None
                   for v in shapes.values() if isinstance(v, torch.Tensor)):
                # one buffer for every storage read, sized for the largest and allocated before the model's
                # tensors: a new one per tensor, freed between the model's, leaves holes the allocator keeps
                # (a bfloat16 GPT-XL then peaked ~0.9 GB above its size)
                scratch = torch.empty(max((v.untyped_storage().nbytes() for v in shapes.values()
                                           if isinstance(v, torch.Tensor)), default=0), dtype=torch.uint8)
                with open(path, "rb") as f:
                    yield {k: StoredTensor(tuple(v.shape), v.dtype,
                                           functools.partial(_read_storage, f, v, path, scratch))
                           if isinstance(v, torch.Tensor) else _not_a_tensor(v) for k, v in shapes.items()}
                return
        state = read_checkpoint(path)
        yield {k: StoredTensor(tuple(v.shape), v.dtype, functools.partial(state.pop, k))
               if isinstance(v, torch.Tensor) else _not_a_tensor(v) for k, v in state.items()}

    return opened()


def _not_a_tensor(value) -> StoredTensor:
    return StoredTensor((), None, lambda: value)  # load_strict names its key (unexpected, or mis-shaped)


def _offsets_readable(path: str) -> bool:
    """A torch zip checkpoint whose storages can be read raw from their offsets on this machine (little-endian)."""
    import sys
    import zipfile

    if sys.byteorder != "little" or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return all(z.read(n) == b"little" for n in z.namelist() if n.rsplit("/", 1)[-1] == "byteorder")


def _read_storage(f, meta: torch.Tensor, path: str, scratch: torch.Tensor) -> torch.Tensor:
    """The values of a meta tensor of `_torch_state(path, "meta")`: its storage's bytes read from their offset in `f` into the
    start of `scratch` (a view of it: valid until the next read)."""
    storage = meta.untyped_storage()
    raw = scratch[:storage.nbytes()]
    f.seek(storage._checkpoint_offset)
    if f.readinto(memoryview(raw.numpy())) != raw.numel():
        raise CheckpointMismatchError(f"{path}: a tensor's data ends before its {raw.numel()} bytes (truncated file?)")
    return raw.view(meta.dtype).as_strided(meta.shape, meta.stride(), meta.storage_offset())


def load_cast(model: torch.nn.Module, stored: dict, dtype: torch.dtype, ignore_prefixes=(), what: str = "model") -> None:
    """Read `stored` ({name: StoredTensor}, checked by `load_strict` first) into `model`, built on the meta device,
    one tensor at a time: each is converted to the model's type (as `load_strict` does), a floating one then to
    `dtype` (as `.to(dtype)` does), into a new contiguous tensor before the next is read; then all are assigned."""
    ignored = functools.partial(_under, prefixes=tuple(ignore_prefixes))
    own = model.state_dict()
    loaded = {}
    for k, entry in stored.items():
        if ignored(k):
            continue
        want = own[k].dtype
        # the destination first: a source that is a new tensor (safetensors), read after it, is then freed at the
        # top of the heap and its memory serves the next pair (the other way round, freed sources leave holes)
        out = torch.empty(entry.shape, dtype=dtype if want.is_floating_point else want)
        src = entry.read()
        out.copy_(src if src.dtype == want else src.to(want))
        loaded[k] = out
        del src
    result = model.load_state_dict(loaded, strict=False, assign=True)
    leftover = [k for k in result.missing_keys if not ignored(k)]
    if leftover or result.unexpected_keys:  # cannot happen after load_strict's checks; keep the guarantee explicit
        raise CheckpointMismatchError(f"{what}: missing {leftover}, unexpected {result.unexpected_keys}")
