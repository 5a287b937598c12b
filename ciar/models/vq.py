"""VQ image tokenizer in LlamaGen's VQ architecture family (conv encoder/decoder, L2-normalised codebook).

The module layout and parameter names follow LlamaGen's `vq_model.py` so that `vq_ds16_*.pt` checkpoints load
strictly (`load_llamagen_vq`); the code is our own. Images are float tensors in [-1, 1], channels first.

    vq = build_vq("scenes-small")
    quant, codes = vq.encode(images)          # codes: [B, h, w] int64
    images = vq.decode_code(codes.flatten(1)) # [B, 3, H, W] in [-1, 1]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VQConfig:
    image_size: int = 256
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    commit_loss_beta: float = 0.25
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    z_channels: int = 256
    dropout_p: float = 0.0

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.downsample

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"] = list(self.ch_mult)
        return d

    @staticmethod
    def from_dict(d: dict) -> "VQConfig":
        d = dict(d)
        d["ch_mult"] = tuple(d["ch_mult"])
        return VQConfig(**d)


VQ_CONFIGS: dict[str, VQConfig] = {
    # default world: 48 px, downsample 4 -> 12x12 = 144 tokens, 1024 codes
    "scenes-small": VQConfig(image_size=48, codebook_size=1024, codebook_embed_dim=8, ch=16, ch_mult=(1, 2, 4),
                             num_res_blocks=1, z_channels=64),
    # LlamaGen's tokenizers
    "VQ-16": VQConfig(ch_mult=(1, 1, 2, 2, 4)),
    "VQ-8": VQConfig(ch_mult=(1, 2, 2, 4)),
}


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32 if channels % 32 == 0 else 1, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the spatial positions."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (m(y).reshape(b, 1, c, h * w).transpose(2, 3) for m in (self.q, self.k, self.v))  # [b,1,hw,c]
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(2, 3).reshape(b, c, h, w))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding keeps exact halving


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig, in_channels: int = 3):
        super().__init__()
        ch, mult, nres = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        cin = ch
        for level, m in enumerate(mult):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(nres):
                block.res.append(ResnetBlock(cin, ch * m, cfg.dropout_p))
                cin = ch * m
                if level == len(mult) - 1:
                    block.attn.append(AttnBlock(cin))
            if level != len(mult) - 1:
                block.downsample = Downsample(cin)
            self.conv_blocks.append(block)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin, cfg.dropout_p), AttnBlock(cin), ResnetBlock(cin, cin, cfg.dropout_p)])
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            for i, res in enumerate(block.res):
                h = res(h)
                if len(block.attn):
                    h = block.attn[i](h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig, out_channels: int = 3):
        super().__init__()
        ch, mult, nres = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
        cin = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, cin, 3, padding=1)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin, cfg.dropout_p), AttnBlock(cin), ResnetBlock(cin, cin, cfg.dropout_p)])
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(mult))):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(nres + 1):
                block.res.append(ResnetBlock(cin, ch * mult[level], cfg.dropout_p))
                cin = ch * mult[level]
                if level == len(mult) - 1:
                    block.attn.append(AttnBlock(cin))
            if level != 0:
                block.upsample = Upsample(cin)
            self.conv_blocks.append(block)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, out_channels, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for block in self.conv_blocks:
            for i, res in enumerate(block.res):
                h = res(h)
                if len(block.attn):
                    h = block.attn[i](h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest-code quantiser; with `l2_norm` both latents and codes live on the unit sphere."""

    def __init__(self, n_e: int, e_dim: int, beta: float, l2_norm: bool):
        super().__init__()
        self.n_e, self.e_dim, self.beta, self.l2_norm = n_e, e_dim, beta, l2_norm
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)
        if l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, dim=-1)

    def codebook(self) -> torch.Tensor:  # [n_e, e_dim]
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def forward(self, z: torch.Tensor):
        """z: [B, e_dim, h, w] -> (z_q straight-through [B, e_dim, h, w], codes [B, h, w], losses dict)."""
        z = z.permute(0, 2, 3, 1)  # [B, h, w, e]
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        flat = z.reshape(-1, self.e_dim)
        emb = self.codebook()
        d = flat.pow(2).sum(1, keepdim=True) + emb.pow(2).sum(1)[None] - 2 * flat @ emb.t()  # [N, n_e]
        codes = d.argmin(dim=1)
        z_q = emb[codes].view_as(z)
        losses = {
            "codebook": F.mse_loss(z_q, z.detach()),
            "commit": self.beta * F.mse_loss(z_q.detach(), z),
        }
        z_q = z + (z_q - z).detach()
        return z_q.permute(0, 3, 1, 2).contiguous(), codes.view(z.shape[:3]), losses, flat

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, h, w] -> [B, e_dim, h, w]."""
        return self.codebook()[codes].permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.codebook_embed_dim, cfg.commit_loss_beta, cfg.codebook_l2_norm)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    @property
    def grid_size(self) -> int:
        return self.config.grid_size

    def encode(self, x: torch.Tensor):
        """x: [B, 3, H, W] in [-1, 1] -> (quantised latents [B, e, h, w], codes [B, h, w])."""
        z_q, codes, _, _ = self.quantize(self.quant_conv(self.encoder(x)))
        return z_q, codes

    def decode(self, z_q: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z_q))

    def decode_code(self, codes: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        """codes: [B, h*w] or [B, h, w] int -> images [B, 3, H, W] in roughly [-1, 1]."""
        if codes.dim() == 2:
            g = grid or int(round(codes.shape[1] ** 0.5))
            codes = codes.view(codes.shape[0], g, g)
        return self.decode(self.quantize.lookup(codes.long()))

    def forward(self, x: torch.Tensor):
        z_q, codes, losses, flat = self.quantize(self.quant_conv(self.encoder(x)))
        return self.decode(z_q), codes, losses, flat


def build_vq(name_or_cfg: str | VQConfig = "scenes-small", **overrides) -> VQModel:
    cfg = VQ_CONFIGS[name_or_cfg] if isinstance(name_or_cfg, str) else name_or_cfg
    if overrides:
        cfg = VQConfig(**{**cfg.to_dict(), **overrides, "ch_mult": tuple(overrides.get("ch_mult", cfg.ch_mult))})
    return VQModel(cfg)


# LlamaGen checkpoints carry training-only state next to the model; these keys are not part of the tokenizer.
VQ_IGNORED_KEY_PREFIXES = ("quantize.codebook_used",)


def load_llamagen_vq(path: str, config: str = "VQ-16", **overrides) -> VQModel:
    """Load a LlamaGen `vq_ds*.pt` checkpoint strictly (see `ciar.models.checkpoint.load_strict`)."""
    from ciar.models.checkpoint import load_strict, read_checkpoint

    model = build_vq(config, **overrides)
    load_strict(model, read_checkpoint(path), ignore_prefixes=VQ_IGNORED_KEY_PREFIXES, what=f"LlamaGen {config} tokenizer")
    return model.eval()


def images_to_tensor(images_uint8) -> torch.Tensor:
    """uint8 [B, H, W, 3] (numpy or tensor) -> float [B, 3, H, W] in [-1, 1]."""
    x = torch.as_tensor(images_uint8)
    return x.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def tensor_to_images(x: torch.Tensor) -> torch.Tensor:
    """float [B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3]."""
    return x.clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
