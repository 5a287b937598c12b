"""Wiring for in-process collaborative decoding on a loaded world (CLI, benchmarks, tests).

    verifier = make_verifier(world)                          # cloud side: cloud model + projector + codebook
    decoder = make_decoder(world, verifier, "ciar")          # device side; gate / tau / burst from the device file
    result = decoder.generate(prompt, seed=0)
"""

from __future__ import annotations

from ciar.collab.decoder import CollabDecoder, method_config
from ciar.collab.device import DeviceModel
from ciar.collab.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams


def make_verifier(world, max_sessions: int = 8, projector: bool = True, static: bool | None = None) -> CloudVerifier:
    return CloudVerifier(world.cloud, world.text, max_sessions=max_sessions,
                         projector=world.projector if projector else None, codebook=world.codebook, static=static)


def make_decoder(world, verifier: CloudVerifier, method: str, sampling: SamplingParams | None = None,
                 device_model: DeviceModel | None = None, **overrides) -> CollabDecoder:
    """A decoder for `method` (ciar.collab.decoder.METHODS) with config overrides; uses the world's device model
    unless `device_model` is given. Raises ValueError when the method needs a device model and none is shipped."""
    cfg = method_config(method, **overrides)
    dev = device_model if device_model is not None else world.device_model
    if cfg.method != "cloud" and dev is None:
        raise ValueError(f"method {method!r} needs a device model: {world.weights_dir} has no device.safetensors "
                         f"(train one with `python -m pipelines.train_device`)")
    return CollabDecoder(dev, InProcessCloud(verifier), cfg, sampling or world.sampling,
                         num_tokens=world.cloud.config.block_size)
