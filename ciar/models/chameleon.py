"""Chameleon's decoder (Anole-7b) as a cloud model the engine drives exactly like `ciar.models.gpt.GPT`.

    cloud = load_chameleon("/models/Anole-7b-v0.1-hf", cls_token_num=64, dtype=torch.bfloat16)
    cond, mask = cloud.prompt_condition([text_ids])      # [bos] + text + [end-of-turn, begin-of-image], left-padded
    cond, mask, drop = cloud.cfg_condition(cond, mask)   # + the unconditional rows [bos, begin-of-image]
    logits = cloud.prefill(cache, cond, mask, drop)      # [rows, 8192]: image code 0, in code order

`ChameleonGPT` subclasses `GPT` and inherits all of its cached machinery (`forward`, `new_cache`, `forward_cached`
with slots, per-row positions, packing and static steps, `prefill`, `decode`), so the same `KVCache` slots, spans,
CFG rows and chunked prefills work unchanged. Its modules carry the Hugging Face names (`model.layers.N.self_attn.
q_proj`, `...q_norm`, `lm_head`, ...) so that a transformers checkpoint loads strictly (`load_chameleon`), and expose
GPT's attribute names (`attention`, `wqkv`, `wo`, `w1`, ... ) as aliases. What differs from LlamaGen (the facts, read
from transformers' `modeling_chameleon.py`; the code is ours):
- separate bias-free q/k/v/o projections; per-head query/key LayerNorm ("qk-norm"): statistics over head_dim, eps
  1e-5, no affine inside, then `x * weight + bias` with weight/bias [heads, head_dim] (one pair per head); RMSNorm
  (`rms_norm_eps`), SwiGLU `down(silu(gate x) * up x)` of `intermediate_size`; pre-norm blocks (`swin_norm` False,
  Anole's setting; True is refused);
- 1-D RoPE over the whole sequence (prompt included) with theta `rope_theta` (10000 for Chameleon/Anole), in the
  rotate-half convention (pairs (i, i + head_dim/2)). GPT's kernels rotate interleaved pairs (2i, 2i+1), so q and k
  are permuted per head into interleaved order after the qk-norm (`_interleave`): the same rotations, and q.k is
  unchanged because both sides carry the same permutation (v is not permuted);
- one 65,536-token vocabulary for text and image. The ENGINE works in image-code space (0..8191, the VQGAN's codes):
  `config.vocab_size` is the number of codes, `tok_embeddings(codes)` looks up the Chameleon token of each code
  (`image_token_ids[code]`, built from the tokenizer's "IMGIMG" names: `image_token_ids_from_vocabulary_map`), and
  `logits(h)` returns only the image-code columns of `lm_head`, in code order: the image step's mask to the image
  tokens. (Anole's ids are contiguous, 4..8195, so both are views of the weights, not gathers.)

The condition is the prompt as Chameleon token ids [B, cls_token_num] (left-padded with <pad>, masked out of
attention like LlamaGen's caption padding), embedded by the same `embed_tokens`; `cls_token_num` is the padded prompt
length including the begin-of-image marker, so image token i sits at position cls_token_num + i as in LlamaGen, and
the logits at the marker predict image token 0. Positions are absolute in the padded row (a short prompt starts at
its pad count): RoPE depends on position differences only, so this equals an unpadded run up to float rounding.

The text-to-image recipe is Anole's (GAIR-NLP/anole `text2image.py` with its `chameleon/inference/chameleon.py`, which
is Meta's `facebookresearch/chameleon` inference): the prompt is `[<s>] + text + [<reserved08706> (end of turn)]`,
the image decoder appends `<racm3:break>` (begin of image), then 1024 image tokens are drawn with in-batch instruct
CFG over three rows (full prompt; image-only prompt = the prompt's <s>, image and image-marker tokens; unconditional
`[<s>, <racm3:break>]`), guidance_scale_text 3.0 and guidance_scale_image 1.2. A text-only prompt has no image tokens,
so its image-only row IS the unconditional one and the rule reduces to two-row CFG, uncond + 3.0 (cond - uncond):
`cfg_condition` builds exactly those rows (uncond = `[<s>, <racm3:break>]` right-aligned, the rest masked), which is
the engine's two-slot CFG with cfg_scale 3.0 (Anole's sampling: temperature 0.7, top-p 0.9).

The CIAR device for such a cloud is a `ChameleonTrunk` (`ciar.collab.device.DeviceModel.from_cloud`): the first
layer(s) and the final norm, a real [n_codes, dim] image-code table (no 65,536-token table) and the Inter-Head over
the codes, conditioned on the prompt's EMBEDDINGS [cls, dim] (`prompt_embeddings`), which is what the verifier sends
a device as its caption (float16, the wire's caption field, like a LlamaGen world's T5 features).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ciar.models.gpt import GPT, Attention, FeedForward, GPTConfig, RMSNorm, TransformerBlock

QK_NORM_EPS = 1e-5  # transformers' ChameleonLayerNorm uses a fixed eps, not the config's
# Chameleon tokenizer names of the special tokens the recipe uses (facebookresearch/chameleon `vocab.py`)
SPECIAL_TOKEN_NAMES = {"bos_token_id": "<s>", "pad_token_id": "<pad>", "boi_token_id": "<racm3:break>",
                       "eoi_token_id": "<eoss>", "eot_token_id": "<reserved08706>"}
# checkpoint keys that are not decoder parameters: Chameleon's VQ-VAE encoder (the world loads its own tokenizer)
CHAMELEON_IGNORED_KEY_PREFIXES = ("model.vqmodel.",)


@dataclass
class ChameleonConfig(GPTConfig):
    """Chameleon-7b / Anole-7b. GPT's fields keep their meaning (dim, n_layer, n_head, n_kv_head, rope_base, norm_eps,
    cls_token_num = padded prompt length, block_size = image tokens, `vocab_size` = number of IMAGE CODES); the ones
    only LlamaGen uses (caption_dim, cls_rope, ...) are ignored. `model_type` stays "t2i": a masked, left-padded
    condition, which is what GPT's prefill and the runner's `mark_caption` act on."""

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    vocab_size: int = 8192
    cls_token_num: int = 64
    block_size: int = 1024  # 512 px / 16 = 32 x 32 tokens
    token_dropout_p: float = 0.0
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    intermediate_size: int = 11008
    text_vocab_size: int = 65536
    max_position_embeddings: int = 4096
    bos_token_id: int = 0
    pad_token_id: int = 1
    boi_token_id: int = 8197
    eoi_token_id: int = 8196
    eot_token_id: int = 8710
    swin_norm: bool = False
    arch: str = "chameleon"

    def __post_init__(self):
        if self.swin_norm:
            raise ValueError("swin_norm=True (Chameleon-30B's norm placement) is not supported; Anole/Chameleon-7B "
                             "use pre-norm blocks (swin_norm=False)")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"cls_token_num + block_size = {self.seq_len} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}")
        if self.cls_token_num < 2:
            raise ValueError("cls_token_num must hold at least <s> and the begin-of-image marker")

    @property
    def ffn_hidden(self) -> int:
        return self.intermediate_size

    @staticmethod
    def from_dict(d: dict) -> "ChameleonConfig":
        return ChameleonConfig(**d)


def chameleon_config_from_hf(hf: dict, **overrides) -> ChameleonConfig:
    """A transformers `ChameleonConfig` as a dict (`config.json`, or `config.to_dict()`) -> ChameleonConfig.

    The special tokens and the number of image codes come from its `vocabulary_map` when it has one; `overrides`
    set our fields (cls_token_num, block_size, ...). Refuses what this decoder does not implement."""
    def refuse(what):
        raise ValueError(f"Chameleon config: {what} is not supported")

    if hf.get("swin_norm"):
        refuse("swin_norm=True")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        refuse("attention_bias / mlp_bias")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={hf['hidden_act']!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(f"rope type {rope.get('rope_type', rope.get('type'))!r}")
    fields = dict(dim=hf["hidden_size"], n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
                  n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                  intermediate_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-5),
                  rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                  text_vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
                  initializer_range=hf.get("initializer_range", 0.02), attn_dropout_p=hf.get("attention_dropout", 0.0))
    vocab_map = hf.get("vocabulary_map")
    if vocab_map:
        fields["vocab_size"] = len(image_token_ids_from_vocabulary_map(vocab_map))
        for field, name in SPECIAL_TOKEN_NAMES.items():
            if name in vocab_map:
                fields[field] = vocab_map[name]
    else:
        for field in ("bos_token_id", "pad_token_id"):
            if hf.get(field) is not None:
                fields[field] = hf[field]
    return ChameleonConfig(**{**fields, **overrides})


def image_token_ids_from_vocabulary_map(vocab_map: dict[str, int]) -> torch.Tensor:
    """Chameleon's tokenizer vocabulary {name: id} -> LongTensor [n_codes]: the token id of each VQ code, in code
    order. Image tokens are named "IMGIMG" + the code's decimal digits written as letters (A=0 ... J=9) + one closing
    character (transformers' `ChameleonImageVocabularyMapping.img2bpe`, Meta's `VocabTranslation`)."""
    by_code = {}
    for name, token in vocab_map.items():
        if not name.startswith("IMGIMG"):
            continue
        digits = name[len("IMGIMG"):-1]
        if not digits or any(not "A" <= ch <= "J" for ch in digits):
            raise ValueError(f"image token name {name!r} does not spell a code (IMGIMG + letters A-J + one char)")
        by_code[int("".join(str(ord(ch) - ord("A")) for ch in digits))] = token
    if not by_code:
        raise ValueError("the vocabulary map has no IMGIMG image tokens")
    if sorted(by_code) != list(range(len(by_code))):
        raise ValueError(f"the image tokens' codes are not 0..{len(by_code) - 1}")
    return torch.tensor([by_code[c] for c in range(len(by_code))], dtype=torch.long)


def precompute_freqs_cis_1d(seq_len: int, head_dim: int, base: float) -> torch.Tensor:
    """-> [seq_len, head_dim // 2, 2] (cos, sin) of position p and frequency i: p * base ** (-2i / head_dim), the
    angles transformers' default rotary embedding computes (float32, then cos / sin)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _alias(name: str) -> property:
    """GPT's attribute name for a module stored under transformers' name (read-only: the module is registered once)."""
    return property(lambda self: getattr(self, name))


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """[..., heads, D] in rotate-half order (i pairs with i + D/2) -> [..., heads * D] in interleaved order (pairs at
    2i, 2i+1), which `ciar.models.gpt.apply_rotary_emb` rotates."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-3)


class HeadLayerNorm(nn.Module):
    """transformers' ChameleonLayerNorm: LayerNorm over the last dim (head_dim) of [..., heads, head_dim], then each
    head's own weight and bias ([heads, head_dim])."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), None, None, QK_NORM_EPS) * self.weight + self.bias


class ChameleonAttention(Attention):
    """GPT's attention (cache writes, key runs, masks, packing) over Chameleon's projections: `wqkv(x)` gives
    q|k|v as GPT's fused projection does, with the qk-norm applied and q, k in interleaved RoPE order."""

    wo = _alias("o_proj")

    def __init__(self, cfg: ChameleonConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        h, hkv, d = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.dim, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.dim, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.dim, bias=False)
        self.q_norm = HeadLayerNorm(h, d)
        self.k_norm = HeadLayerNorm(hkv, d)
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def wqkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., (H + 2 Hkv) D]: normed q and k (interleaved pair order), then v."""
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_head, d)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv_head, d)))
        return torch.cat([_interleave(q), _interleave(k), self.v_proj(x)], dim=-1)


class ChameleonMLP(FeedForward):
    w1, w3, w2 = _alias("gate_proj"), _alias("up_proj"), _alias("down_proj")

    def __init__(self, cfg: ChameleonConfig):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.ffn_dropout = nn.Dropout(cfg.ffn_dropout_p)


class ChameleonBlock(TransformerBlock):
    attention, feed_forward = _alias("self_attn"), _alias("mlp")
    attention_norm, ffn_norm = _alias("input_layernorm"), _alias("post_attention_layernorm")

    def __init__(self, cfg: ChameleonConfig):
        nn.Module.__init__(self)
        self.self_attn = ChameleonAttention(cfg)
        self.mlp = ChameleonMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)


class CodeEmbedding:
    """`tok_embeddings` of a ChameleonGPT: image codes -> the embeddings of their Chameleon tokens. Not a module (the
    table is registered once, as `model.embed_tokens`); made afresh on each access, so it always reads the current
    weight. `weight` is the whole table (callers read its device and dtype)."""

    def __init__(self, table: nn.Embedding, ids: torch.Tensor, offset: int | None):
        self.weight, self.ids, self.offset = table.weight, ids, offset

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        if self.offset is not None:  # contiguous ids: a view of the table's image rows
            return F.embedding(codes, self.weight[self.offset:self.offset + self.ids.shape[0]])
        return F.embedding(self.ids[codes], self.weight)


def prompt_condition(c, text_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenized prompts (Chameleon BPE ids, no special tokens) -> Anole's conditions `[<s>] + text + [end-of-turn,
    begin-of-image]`, left-padded to cls_token_num: (ids [B, cls] long, mask [B, cls] bool). Reads only the config
    `c` (so a caption stage can run it without the decoder's weights). A prompt that does not fit is refused
    (`CaptionTooLongError`, the caption contract of `ciar.text`)."""
    from ciar.text import CaptionTooLongError

    rows = [[c.bos_token_id, *map(int, t), c.eot_token_id, c.boi_token_id] for t in text_ids]
    longest = max(len(r) for r in rows)
    if longest > c.cls_token_num:
        raise CaptionTooLongError(f"prompt is {longest} tokens long with <s>, end-of-turn and begin-of-image; "
                                  f"the model accepts at most {c.cls_token_num}")
    ids = torch.full((len(rows), c.cls_token_num), c.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), c.cls_token_num, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, c.cls_token_num - len(r):] = torch.tensor(r)
        mask[i, c.cls_token_num - len(r):] = True
    return ids, mask


class ChameleonGPT(GPT):
    """Chameleon's decoder with GPT's interface in image-code space (module docstring)."""

    layers = property(lambda self: self.model.layers)  # where GPT's machinery looks for them
    norm = property(lambda self: self.model.norm)

    def __init__(self, cfg: ChameleonConfig, image_token_ids: torch.Tensor):
        nn.Module.__init__(self)
        ids = torch.as_tensor(image_token_ids, device="cpu").to(torch.long).reshape(-1)  # (CPU under a meta build)
        listed = ids.tolist()
        if len(listed) != cfg.vocab_size:
            raise ValueError(f"{len(listed)} image token ids for vocab_size={cfg.vocab_size} image codes")
        if len(set(listed)) != len(listed) or min(listed) < 0 or max(listed) >= cfg.text_vocab_size:
            raise ValueError(f"image token ids must be distinct ids in [0, {cfg.text_vocab_size})")
        self.config = cfg
        self.model = nn.Module()  # transformers' names: model.embed_tokens / model.layers / model.norm, lm_head
        self.model.embed_tokens = nn.Embedding(cfg.text_vocab_size, cfg.dim)
        self.model.layers = nn.ModuleList(ChameleonBlock(cfg) for _ in range(cfg.n_layer))
        self.model.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.text_vocab_size, bias=False)
        self.output = None  # GPT's head is not used: `logits` reads the image rows of lm_head
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.code_offset = listed[0] if listed == list(range(listed[0], listed[0] + len(listed))) else None
        self.register_buffer("image_token_ids", ids, persistent=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis_1d(cfg.seq_len, cfg.head_dim, cfg.rope_base),
                             persistent=False)
        self.apply(self._init_weights)

    @property
    def tok_embeddings(self) -> CodeEmbedding:
        return CodeEmbedding(self.model.embed_tokens, self.image_token_ids, self.code_offset)

    def _image_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a [text_vocab, dim] table that belong to the image codes, in code order."""
        if self.code_offset is not None:
            return weight[self.code_offset:self.code_offset + self.config.vocab_size]
        return weight.index_select(0, self.image_token_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., dim] -> float32 logits [..., n_codes] of the image tokens, in code order."""
        return F.linear(h, self._image_rows(self.lm_head.weight)).float()

    @property
    def image_head_weight(self) -> torch.Tensor:
        """[n_codes, dim]: the rows of `lm_head` that give the image codes' logits, in code order (what a LlamaGen
        GPT's `output.weight` is: the Inter-Head's initial centers, CASCADE's token vectors)."""
        return self._image_rows(self.lm_head.weight)

    def prompt_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt ids [..., cls] -> their embeddings [..., cls, dim] (`embed_tokens`, no CFG substitution): what a
        device model conditions on (`ChameleonTrunk`; `ciar.collab.device.device_caption`)."""
        return self.model.embed_tokens(ids.to(self.model.embed_tokens.weight.device))

    # ------------------------------------------------------------------ conditioning
    def prompt_condition(self, text_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`prompt_condition` (below) with this model's config."""
        return prompt_condition(self.config, text_ids)

    def unconditional_prompt(self, rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Anole's unconditional CFG row `[<s>, <racm3:break>]`, right-aligned in cls_token_num positions: (ids
        [rows, cls], mask [rows, cls])."""
        c = self.config
        ids = torch.full((rows, c.cls_token_num), c.pad_token_id, dtype=torch.long, device=device)
        ids[:, -2], ids[:, -1] = c.bos_token_id, c.boi_token_id
        mask = torch.zeros(rows, c.cls_token_num, dtype=torch.bool, device=device)
        mask[:, -2:] = True
        return ids, mask

    def condition_mask(self, cond_mask: torch.Tensor | None, drop: torch.Tensor | None) -> torch.Tensor | None:
        """The keys each condition row may read: `cond_mask` [B, cls] (None: every position), with the unconditional
        rows (`drop` [B]) reading only their `[<s>, <racm3:break>]`. None when nothing is masked."""
        if drop is None or not bool(drop.any()):
            return cond_mask
        uncond = self.unconditional_prompt(drop.shape[0], drop.device)[1]
        mask = torch.ones_like(uncond) if cond_mask is None else cond_mask.to(drop.device, torch.bool)
        return torch.where(drop[:, None], uncond, mask)

    def embed_condition(self, cond: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """cond: prompt ids [B, cls_token_num] (integer; see `prompt_condition`); `drop` [B] bool: rows replaced by
        the unconditional prompt. -> [B, cls_token_num, dim]."""
        if cond.is_floating_point() or cond.dim() != 2 or cond.shape[1] != self.config.cls_token_num:
            raise TypeError(f"a Chameleon condition is integer token ids [B, {self.config.cls_token_num}], got "
                            f"{cond.dtype} {tuple(cond.shape)} (ids must not be cast to the model's dtype)")
        if drop is not None and bool(drop.any()):
            cond = torch.where(drop[:, None].to(cond.device), self.unconditional_prompt(cond.shape[0], cond.device)[0],
                               cond)
        return self.model.embed_tokens(cond)

    def cfg_condition(self, cond: torch.Tensor, cond_mask: torch.Tensor | None):
        """Rows [cond..., uncond...] for classifier-free guidance, the uncond rows Anole's `[<s>, <racm3:break>]`
        with their own mask. -> (ids [2B, cls], mask [2B, cls], drop [2B])."""
        b = cond.shape[0]
        drop = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)]).to(cond.device)
        uncond, _ = self.unconditional_prompt(b, cond.device)
        mask = None if cond_mask is None else torch.cat([cond_mask, cond_mask])
        return torch.cat([cond, uncond]), self.condition_mask(mask, drop), drop

    def forward(self, idx, cond, cond_mask=None, drop=None, targets=None, return_hidden=False, extra_emb=None):
        """GPT.forward (logits [B, T + 1, n_codes]) with the unconditional rows' own key mask."""
        return super().forward(idx, cond, self.condition_mask(cond_mask, drop), drop, targets, return_hidden,
                               extra_emb)

    def prefill(self, cache, cond, cond_mask=None, drop=None, slots=None, return_hidden=False):
        """GPT.prefill with the unconditional rows' own key mask."""
        return super().prefill(cache, cond, self.condition_mask(cond_mask, drop), drop, slots, return_hidden)


def unconditional_mask(rows: int, cls_token_num: int, device=None) -> torch.Tensor:
    """[rows, cls] bool: the keys of Anole's unconditional row `[<s>, <racm3:break>]`, right-aligned."""
    mask = torch.zeros(rows, cls_token_num, dtype=torch.bool, device=device)
    mask[:, -2:] = True
    return mask


class PromptEmbedding(nn.Module):
    """A device trunk's condition: the cloud's embeddings of the prompt ids ([B, cls, dim], `ChameleonGPT.
    prompt_embeddings`, what the verifier sends a device as its caption), with the unconditional prompt's embeddings
    (`uncond_embedding` [cls, dim], a buffer saved with the device; `[<s>, <racm3:break>]` right-aligned, pad rows
    elsewhere, which its mask hides) standing in for a dropped row. No parameters: the trunk's first layer is the
    cloud's, so its input is the cloud's embedding space."""

    def __init__(self, cls_token_num: int, dim: int):
        super().__init__()
        self.register_buffer("uncond_embedding", torch.zeros(cls_token_num, dim))

    def forward(self, caption: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return caption


class ChameleonTrunk(GPT):
    """The CIAR device's trunk for a Chameleon / Anole cloud: the cloud's first `n_layer` blocks (qk-norm, 1-D
    rotate-half RoPE over the whole sequence: `ChameleonBlock`, the same keys under `layers.N`), its final norm, and
    image-code space only: `tok_embeddings` is a real [n_codes, dim] table (the cloud's image rows, in code order;
    8192 x 4096 for Anole, not the 65,536-token table), no text vocabulary. The condition is FLOAT: the prompt's
    embeddings [B, cls, dim] (`PromptEmbedding`), so a device needs no text table and the device wire carries the
    caption as float16 embeddings like a LlamaGen world's; the unconditional row reads only its own two keys
    (`condition_mask`, as `ChameleonGPT`). `config.caption_dim` is `dim`. GPT's cached machinery (prefill, decode,
    slots, rollback) runs unchanged; the Inter-Head (`ciar.collab.device.DeviceModel`) is its output."""

    def __init__(self, cfg: ChameleonConfig):
        nn.Module.__init__(self)
        if cfg.caption_dim != cfg.dim:
            raise ValueError(f"a Chameleon device trunk conditions on the prompt's embeddings: caption_dim must be "
                             f"dim ({cfg.dim}), got {cfg.caption_dim}")
        self.config = cfg
        self.cls_embedding = PromptEmbedding(cfg.cls_token_num, cfg.dim)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(ChameleonBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if cfg.lm_head else None
        self.register_buffer("freqs_cis", precompute_freqs_cis_1d(cfg.seq_len, cfg.head_dim, cfg.rope_base),
                             persistent=False)
        self.apply(self._init_weights)

    def condition_mask(self, cond_mask: torch.Tensor | None, drop: torch.Tensor | None) -> torch.Tensor | None:
        """`ChameleonGPT.condition_mask` without a decision on the values, in boolean algebra (it exports to ONNX,
        whose runtime has no boolean Where): the rows `drop` marks read only their `[<s>, <racm3:break>]`."""
        if drop is None:
            return cond_mask
        uncond = unconditional_mask(drop.shape[0], self.config.cls_token_num, drop.device)
        mask = torch.ones_like(uncond) if cond_mask is None else cond_mask.to(drop.device, torch.bool)
        d = drop[:, None].to(torch.bool)
        return (d & uncond) | (~d & mask)

    def embed_condition(self, cond: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """cond: the prompt's embeddings [B, cls, dim] (float); `drop` [B]: rows given the unconditional prompt."""
        if not cond.is_floating_point():
            raise TypeError("a Chameleon device trunk takes the prompt's embeddings [B, cls, dim], not token ids "
                            "(ChameleonGPT.prompt_embeddings; ciar.collab.device.device_caption)")
        return self.cls_embedding(cond, drop)

    def forward(self, idx, cond, cond_mask=None, drop=None, targets=None, return_hidden=False, extra_emb=None):
        return super().forward(idx, cond, self.condition_mask(cond_mask, drop), drop, targets, return_hidden,
                               extra_emb)

    def prefill(self, cache, cond, cond_mask=None, drop=None, slots=None, return_hidden=False):
        return super().prefill(cache, cond, self.condition_mask(cond_mask, drop), drop, slots, return_hidden)

    @torch.no_grad()
    def copy_from(self, cloud: ChameleonGPT) -> "ChameleonTrunk":
        """Layer-dropped initialisation: the cloud's first `n_layer` blocks and final norm, its image rows of
        `embed_tokens` (code order) and its embeddings of the unconditional prompt."""
        if not isinstance(cloud, ChameleonGPT):
            raise TypeError(f"expected a ChameleonGPT, got {type(cloud).__name__}")
        for mine, theirs in zip(self.layers, cloud.model.layers):
            mine.load_state_dict(theirs.state_dict())
        self.norm.load_state_dict(cloud.model.norm.state_dict())
        codes = torch.arange(self.config.vocab_size, device=cloud.model.embed_tokens.weight.device)
        self.tok_embeddings.weight.copy_(cloud.tok_embeddings(codes))
        ids, _ = cloud.unconditional_prompt(1, codes.device)
        self.cls_embedding.uncond_embedding.copy_(cloud.prompt_embeddings(ids)[0])
        return self


def _stored(state: dict) -> dict:
    from ciar.models.checkpoint import StoredTensor

    bad = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise TypeError(f"state dict values must be tensors: {bad[:5]}")
    return {k: StoredTensor(tuple(v.shape), v.dtype, (lambda v=v: v)) for k, v in state.items()}


def load_chameleon(source, config: ChameleonConfig | dict | None = None, image_token_ids: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32, **overrides) -> ChameleonGPT:
    """Load a Chameleon / Anole decoder in transformers' layout strictly, its weights in `dtype`.

    `source`: a state dict ({name: tensor}), a checkpoint file (.safetensors, or a torch file), or a transformers
    model folder (`config.json` + `*.safetensors` shards, or `pytorch_model*.bin`). `config`: a ChameleonConfig, or a
    transformers config dict (default: the folder's config.json); `overrides` set fields (cls_token_num, block_size).
    `image_token_ids` [n_codes]: the Chameleon id of each image code (default: from the config's vocabulary_map).
    Raises `CheckpointMismatchError` naming every missing, unexpected or mis-shaped key (Chameleon's VQ-VAE,
    `model.vqmodel.*`, is ignored). Built on the meta device and read one tensor at a time, as `load_llamagen_gpt`."""
    import contextlib
    import glob
    import itertools

    from ciar.models.checkpoint import load_cast, load_strict, open_checkpoint

    files = None
    if isinstance(source, (str, os.PathLike)):
        source = os.fspath(source)
        if os.path.isdir(source):
            if config is None:
                with open(os.path.join(source, "config.json")) as f:
                    config = json.load(f)
            files = sorted(glob.glob(os.path.join(source, "*.safetensors"))) or \
                sorted(glob.glob(os.path.join(source, "pytorch_model*.bin")))
            if not files:
                raise FileNotFoundError(f"{source}: no *.safetensors or pytorch_model*.bin weights")
        else:
            files = [source]
    if config is None:
        raise ValueError("load_chameleon needs a config (a ChameleonConfig or transformers' config dict)")
    hf = config if isinstance(config, dict) else None
    cfg = chameleon_config_from_hf(hf, **overrides) if hf is not None else replace(config, **overrides)
    if image_token_ids is None:
        if not (hf and hf.get("vocabulary_map")):
            raise ValueError("image_token_ids not given and the config has no vocabulary_map")
        image_token_ids = image_token_ids_from_vocabulary_map(hf["vocabulary_map"])
    with torch.device("meta"):
        model = ChameleonGPT(cfg, image_token_ids)
    what = "Chameleon decoder"
    with contextlib.ExitStack() as stack:
        stored = _stored(source) if files is None else {}
        for path in files or ():
            stored.update(stack.enter_context(open_checkpoint(path)))
        load_strict(model, {k: v.placeholder() for k, v in stored.items()},
                    ignore_prefixes=CHAMELEON_IGNORED_KEY_PREFIXES, what=what)
        load_cast(model, stored, dtype, ignore_prefixes=CHAMELEON_IGNORED_KEY_PREFIXES, what=what)
    model.freqs_cis = precompute_freqs_cis_1d(cfg.seq_len, cfg.head_dim, cfg.rope_base).to(dtype)
    unset = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unset:
        raise RuntimeError(f"{what}: neither in the checkpoint nor computed on load: {unset}")
    return model.eval()
