"""Token datasets on disk shared by the trainers: memory-mapped tokens, caption embeddings and masks of one split.

    data = build_split(root, "train", 20_000, seed, vq, text, cfg, device)   # resumable per stage ("text", "tokens")
    tokens, emb, mask = get_batch(data, idx, device)

The scenes splits are rendered and tokenised here (the cloud's data); `pipelines.onpolicy.load_captions` fills the
"text" stage from a COCO captions file for a LlamaGen or an Anole world. An Anole (Chameleon) cloud conditions on
the prompt's token ids: its captions are stored as int32 ids [N, L] (`caption_layout`), not float16 embeddings, and
read back as int64 (`caption_tensor`).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from tqdm import tqdm

from ciar.data import scenes
from ciar.models.gpt import GPTConfig
from ciar.models.vq import images_to_tensor


def caption_layout(cfg: GPTConfig) -> tuple[tuple[int, ...], type]:
    """How a cloud's captions are stored: (shape of one, dtype): float16 embeddings [L, D], or int32 token ids [L]
    for a Chameleon cloud (its condition is the prompt's ids; float16 would round ids above 2048)."""
    if getattr(cfg, "arch", None) == "chameleon":
        return (cfg.cls_token_num,), np.int32
    return (cfg.cls_token_num, cfg.caption_dim), np.float16


def caption_tensor(a: np.ndarray) -> torch.Tensor:
    """Stored captions -> a tensor: embeddings as float32, token ids as int64."""
    return torch.from_numpy(a.astype(np.int64 if np.issubdtype(a.dtype, np.integer) else np.float32))


class TokenisedScenes:
    """Memory-mapped tokens [N, n_tok] int16, caption embeddings [N, L, D] float16 (or a Chameleon cloud's prompt
    ids [N, L] int32: `cfg` given) and masks [N, L] bool."""

    def __init__(self, root: str, split: str, n: int, n_tok: int, cap_len: int, cap_dim: int, mode: str = "r",
                 cfg: GPTConfig | None = None):
        os.makedirs(root, exist_ok=True)
        self.root, self.split, self.n = root, split, n
        if mode == "w+" and os.path.exists(os.path.join(root, f"{split}_{n}_tokens.npy")):
            mode = "r+"

        def mm(name, dtype, shape):
            return np.lib.format.open_memmap(os.path.join(root, f"{split}_{n}_{name}.npy"), mode=mode, dtype=dtype,
                                             shape=shape if mode == "w+" else None)

        self.tokens = mm("tokens", np.int16, (n, n_tok))
        shape, dtype = caption_layout(cfg) if cfg is not None else ((cap_len, cap_dim), np.float16)
        self.emb = mm("emb", dtype, (n, *shape))
        self.mask = mm("mask", np.bool_, (n, cap_len))

    def _done_path(self, stage: str) -> str:
        return os.path.join(self.root, f"{self.split}_{self.n}.{stage}.done")

    def progress(self, stage: str) -> int:
        path = self._done_path(stage)
        return int(open(path).read()) if os.path.exists(path) else 0

    def mark(self, stage: str, done: int) -> None:
        for a in (self.tokens, self.emb, self.mask):
            a.flush()
        with open(self._done_path(stage), "w") as f:
            f.write(str(done))


def claim_source(root: str, split: str, n: int, source: dict) -> None:
    """What a split's arrays in `root` are made from (`{split}_{n}.source.json`: the scenes' seed, or a captions
    file and its SHA-256), recorded by the first build and checked by later ones: the arrays are named by split and
    size only, so a run with another seed (or captions file) would resume into, or reuse, the other one's rows."""
    from ciar.results import claim_settings

    claim_settings(os.path.join(root, f"{split}_{n}.source.json"), source, f"{root}: the {split} split of {n}",
                   "give another --data-dir, or remove that folder")


@torch.no_grad()
def build_split(root, split, n, seed, vq, text, cfg: GPTConfig, device, chunk=512) -> TokenisedScenes:
    """Fill the arrays of one split: caption embeddings ("text" stage, needs only the text encoder) and image
    tokens ("tokens" stage, needs the tokenizer); either may be None to skip its stage. The scenes are `seed`'s:
    a folder holding the split of another seed (or another captions file's) is refused (`claim_source`)."""
    claim_source(root, split, n, {"source": "scenes", "seed": seed})
    data = TokenisedScenes(root, split, n, cfg.block_size, cfg.cls_token_num, cfg.caption_dim, mode="w+", cfg=cfg)
    for stage, model in (("text", text), ("tokens", vq)):
        start = data.progress(stage)
        if model is None or start >= n:
            continue
        bar = tqdm(total=n, initial=start, desc=f"{stage} {split}", dynamic_ncols=True)
        for s in range(start, n, chunk):
            k = min(chunk, n - s)
            if stage == "tokens":
                images, _ = scenes.batch(split, s, k, seed)
                _, codes = vq.encode(images_to_tensor(images).to(device))
                data.tokens[s:s + k] = codes.flatten(1).cpu().numpy().astype(np.int16)
            else:
                cap = text.encode([scenes.scene_at(split, i, seed).caption for i in range(s, s + k)])
                data.emb[s:s + k] = cap.emb.numpy().astype(data.emb.dtype)
                data.mask[s:s + k] = cap.mask.numpy()
            data.mark(stage, s + k)
            bar.update(k)
        bar.close()
    return data


def get_batch(data: TokenisedScenes, idx: np.ndarray, device):
    idx = np.sort(idx)
    tokens = torch.from_numpy(data.tokens[idx].astype(np.int64)).to(device)
    emb = caption_tensor(data.emb[idx]).to(device)
    mask = torch.from_numpy(data.mask[idx]).to(device)
    return tokens, emb, mask
