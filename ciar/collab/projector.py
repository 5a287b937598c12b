"""Interval-feature projector: device hidden state + interval summary -> a vector added to the cloud's input
embedding of each locally accepted token when the cloud catches up (CIAR's interval-enhanced decoding).

    proj = IntervalProjector(ProjectorConfig(device_dim=256, cloud_dim=256, feature_dim=interval_feature_dim(8)))
    extra = proj(device_hidden, interval_features)      # [..., cloud_dim]
    logits = cloud.decode(cache, tokens, pos, extra_emb=extra * accepted_locally[..., None])

`h = block(e(x_t) + proj(f_t))` (docs/architecture.md §7). The output layer starts at zero, so an untrained
projector is exactly "w/o Inter-Enhance"; it is trained with the cloud frozen (`pipelines.train_projector`).
Files: `projector.safetensors` (kind "ciar_projector").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ciar.models.checkpoint import load_strict, read_model_file, save_model

PROJECTOR_KIND = "ciar_projector"


@dataclass
class ProjectorConfig:
    device_dim: int = 256
    cloud_dim: int = 256
    feature_dim: int = 20  # interval_feature_dim(top) of ciar.collab.interval
    feature_top: int = 8  # the `top` the features were computed with
    hidden: int = 256
    standardize: bool = False  # log1p of the features' Omega and U_norm columns before the LayerNorm (files since v3)

    def to_dict(self) -> dict:
        return asdict(self)


def standardize_features(features: torch.Tensor, top: int) -> torch.Tensor:
    """`interval_features` [..., 2 top + 4] -> the same with Omega and U_norm replaced by log1p of themselves.

    Raw Omega is O(1..V) and U_norm runs into the thousands while every other entry (and the hidden state) is O(1):
    one LayerNorm over the concatenation then sees almost nothing but U. log1p brings both to O(1..10)."""
    out = features.clone()
    for j in (2 * top, 2 * top + 2):  # Omega, U_norm (layout of ciar.collab.interval.interval_features)
        out[..., j] = torch.log1p(features[..., j].clamp(min=0.0))
    return out


class IntervalProjector(nn.Module):
    def __init__(self, config: ProjectorConfig):
        super().__init__()
        self.config = config
        self.norm = nn.LayerNorm(config.device_dim + config.feature_dim)
        self.fc1 = nn.Linear(config.device_dim + config.feature_dim, config.hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(config.hidden, config.cloud_dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden [..., device_dim], features [..., feature_dim] (`interval_features` as the device sends them)
        -> [..., cloud_dim] (dtype of fc1)."""
        features = features.float()  # float16 as the device sends them: log1p below in float32
        if self.config.standardize:
            features = standardize_features(features, self.config.feature_top)
        x = torch.cat([hidden.to(self.fc1.weight.dtype), features.to(self.fc1.weight.dtype)], dim=-1)
        return self.fc2(self.act(self.fc1(self.norm(x))))

    def save(self, path: str, extra: dict | None = None) -> None:
        save_model(self, path, self.config.to_dict(), kind=PROJECTOR_KIND, extra=extra)

    @classmethod
    def load(cls, path: str, device: str | torch.device = "cpu") -> "IntervalProjector":
        state, kind, cfg, _ = read_model_file(path)
        if kind != PROJECTOR_KIND:
            raise ValueError(f"{path}: expected a {PROJECTOR_KIND!r} file, found kind {kind!r}")
        model = cls(ProjectorConfig(**cfg))
        load_strict(model, {k: v.float() for k, v in state.items()}, what=f"projector ({path})")
        return model.to(device).eval()
