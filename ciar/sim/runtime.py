"""Wiring for in-process collaborative decoding on a loaded world (CLI, benchmarks, tests).

    verifier = make_verifier(world)                          # cloud side: cloud model + projector + codebook
    decoder = make_decoder(world, verifier, "ciar")          # device side; gate / tau / burst from the device file
    result = decoder.generate(prompt, seed=0)
    onnx = make_decoder(world, verifier, "ciar", runtime=device_runtime("onnx", world.device_model,
                                                                        world.weights_dir, world.device_file))

A simulated device runs its model on one of two runtimes (`RUNTIMES`): "torch" (`ciar.collab.device.TorchRuntime`)
or "onnx", the exported model real phones run (`ciar_device.runtime.DeviceRuntime` on `<weights>/onnx`, written by
`python -m pipelines.export_onnx`; refused when it was exported from another device file).
"""

from __future__ import annotations

import json
import os

from ciar.sim.decoder import CollabDecoder, method_config
from ciar.collab.device import DeviceModel, TorchRuntime
from ciar.collab.names import CLOUD_METHODS
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams
from ciar_device.fetch import sha256_file


def make_verifier(world, max_sessions: int = 8, projector: bool = True, static: bool | None = None,
                  fused: bool = False) -> CloudVerifier:
    return CloudVerifier(world.cloud, world.text, max_sessions=max_sessions,
                         projector=world.projector if projector else None, codebook=world.codebook, static=static,
                         fused=fused)


RUNTIMES = ("torch", "onnx")


def device_runtime(kind: str, device_model: DeviceModel, weights_dir: str, device_file: str | None,
                   onnx_dir: str | None = None):
    """The runtime a simulated device runs its model on: "torch" (the loaded model) or "onnx" (the export in
    `onnx_dir`, default `<weights_dir>/onnx`, one CPU thread). ValueError for an unknown kind; FileNotFoundError /
    ValueError naming the fix when the export is missing or was made from another device file than `device_file`."""
    if kind == "torch":
        return TorchRuntime(device_model)
    if kind != "onnx":
        raise ValueError(f"device runtime must be one of {', '.join(RUNTIMES)}, got {kind!r}")
    from ciar_device.runtime import MANIFEST, DeviceRuntime

    onnx_dir = onnx_dir or os.path.join(weights_dir, "onnx")
    path = os.path.join(onnx_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: the onnx device runtime needs the exported model "
                                f"(`python -m pipelines.export_onnx`, or `make onnx`)")
    if device_file is not None and not exported_from(onnx_dir, device_file):
        raise ValueError(f"{onnx_dir} was exported from another device model than {device_file}: re-export it "
                         f"(`python -m pipelines.export_onnx`, or `make onnx`)")
    return DeviceRuntime(onnx_dir, threads=1)


def exported_from(onnx_dir: str, device_file: str) -> bool:
    """Whether the export in `onnx_dir` (its manifest's sources) was made from this device file (by its SHA-256)."""
    from ciar_device.runtime import MANIFEST

    try:
        with open(os.path.join(onnx_dir, MANIFEST)) as f:
            exported = (json.load(f).get("sources") or {}).get("device", {}).get("sha256")
    except (OSError, ValueError):
        return False
    return exported is not None and exported == sha256_file(device_file)


def make_decoder(world, verifier: CloudVerifier, method: str, sampling: SamplingParams | None = None,
                 device_model: DeviceModel | None = None, runtime=None, **overrides) -> CollabDecoder:
    """A decoder for `method` (ciar.sim.decoder.METHODS) with config overrides; uses the world's device model
    unless `device_model` is given, on `runtime` (`device_runtime`; default: the model on torch). Raises ValueError
    when the method needs a device model and none is shipped."""
    cfg = method_config(method, **overrides)
    dev = device_model if device_model is not None else world.device_model
    if cfg.method not in CLOUD_METHODS and dev is None:
        raise ValueError(f"method {method!r} needs a device model: {world.weights_dir} has no device.safetensors "
                         f"(train one with `python -m pipelines.train_device`)")
    return CollabDecoder(dev, InProcessCloud(verifier), cfg, sampling or world.sampling,
                         num_tokens=world.cloud.config.block_size, runtime=runtime)
