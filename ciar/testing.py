"""Helpers for tests: a folder of small RANDOM-weight models in the shipped layout (not a trained world)."""

from __future__ import annotations

import os

import torch

from ciar.models.checkpoint import save_model
from ciar.models.gpt import build_gpt
from ciar.models.vq import build_vq


def write_random_world(folder: str, sampling: dict | None = None, cloud_dtype: torch.dtype = torch.float16,
                       seed: int = 0, with_device: bool = False) -> str:
    """Write `tokenizer.safetensors` (scenes-small) and a 2-layer, 64-wide `cloud.safetensors` into `folder`; with
    `with_device`, also a 1-layer CIAR `device.safetensors` initialised from that cloud (random Inter-Head radii)."""
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    vq = build_vq("scenes-small")
    save_model(vq, os.path.join(folder, "tokenizer.safetensors"), vq.config.to_dict(), kind="vq")
    cloud = build_gpt("scenes-cloud", n_layer=2, dim=64, n_head=4)
    torch.nn.init.normal_(cloud.output.weight, std=0.5)  # zero-initialised head would make every token uniform
    extra = {"sampling": sampling} if sampling is not None else {}
    save_model(cloud, os.path.join(folder, "cloud.safetensors"), cloud.config.to_dict(), kind="gpt", extra=extra,
               dtype=cloud_dtype)
    if with_device:
        from ciar.collab.device import DeviceConfig, DeviceModel

        dev = DeviceModel.from_cloud(cloud, DeviceConfig(n_layer=1))
        V = cloud.config.vocab_size
        with torch.no_grad():  # random centers; small radii that vary between positions, so U varies between tokens
            for head in dev.inter_head.heads:
                torch.nn.init.normal_(head.weight[:V], std=0.3)
                torch.nn.init.normal_(head.weight[V:], std=0.15)
                head.bias[:V].zero_()
                head.bias[V:].fill_(-4.0)
        dev.save(os.path.join(folder, "device.safetensors"))
    return str(folder)
