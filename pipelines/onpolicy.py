"""On-policy token sequences: images the frozen cloud samples itself, with the world's sampling settings, on disk.

    python -m pipelines.onpolicy --split train --n 12000 --seed 3 --data-dir data_cache/scenes-v2-s3
    python -m pipelines.onpolicy --world llamagen.yaml --captions captions_train2017.json --split train --n 20000 \
        --data-dir data_cache/llamagen-xl       # a LlamaGen world: COCO captions encoded by its T5 (resumable)

The device drafts from the *guided* cloud distribution, so it is distilled on the prefixes the cloud actually
produces under CFG (DESIGN.md section 4), not on VQ codes of rendered images. This stage samples one image per
caption of a `TokenisedScenes` split (captions embedded by `pipelines.data.build_split`'s "text" stage) with
`ciar.decoding.generate_cloud` and writes the tokens into a memory-mapped array next to the captions:

    DATA_DIR/onpolicy/{split}_{n}_{tag}.npy      tokens [n, N] int16
    DATA_DIR/onpolicy/{split}_{n}_{tag}.done     how many rows are written (resume point)

`tag` names the cloud file (a digest of its bytes) and the sampling settings, so a new cloud or new settings never
reuse stale sequences. Rows are generated in fixed chunks, each from its own seeded generator
(`seed * 1_000_003 + chunk index`), so an interrupted run resumes to the same bytes it would have written at once.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
import torch
from tqdm import tqdm

from ciar.decoding.generate import generate_cloud
from ciar.decoding.sampling import SamplingParams
from ciar.models.gpt import GPT

CHUNK = 32  # captions per generation batch (fastest per image on 2 CPU cores: 4.7 img/s vs 3.1 at 64, 1 thread)


DIGEST_LIMIT = 256 << 20  # larger files (a LlamaGen-XL checkpoint) are named by path, size and mtime, not bytes


def file_digest(path: str, n: int = 12) -> str:
    h = hashlib.sha256()
    st = os.stat(path)
    if st.st_size > DIGEST_LIMIT:
        h.update(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()[:n]
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:n]


def onpolicy_tag(cloud_path: str, params: SamplingParams) -> str:
    p = params
    return f"{file_digest(cloud_path)}_cfg{p.cfg_scale:g}_t{p.temperature:g}_k{p.top_k}_p{p.top_p:g}"


class OnPolicyTokens:
    """tokens [n, N] int16 (memory-mapped), `done` rows valid; created or reopened by `build_onpolicy`."""

    def __init__(self, root: str, split: str, n: int, n_tok: int, tag: str):
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, f"{split}_{n}_{tag}.npy")
        self.done_path = self.path[:-4] + ".done"
        mode = "r+" if os.path.exists(self.path) else "w+"
        self.tokens = np.lib.format.open_memmap(self.path, mode=mode, dtype=np.int16,
                                                shape=(n, n_tok) if mode == "w+" else None)
        if self.tokens.shape != (n, n_tok):
            raise ValueError(f"{self.path}: shape {self.tokens.shape}, expected {(n, n_tok)}")
        self.n = n

    @property
    def done(self) -> int:
        return int(open(self.done_path).read()) if os.path.exists(self.done_path) else 0

    def mark(self, done: int) -> None:
        self.tokens.flush()
        tmp = self.done_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(done))
        os.replace(tmp, self.done_path)


@torch.no_grad()
def build_onpolicy(root: str, split: str, captions, cloud: GPT, params: SamplingParams, seed: int, tag: str,
                   chunk: int = CHUNK, progress: bool = True) -> OnPolicyTokens:
    """Sample one image per caption of `captions` (a TokenisedScenes: emb [n, L, D], mask [n, L]) with the cloud;
    resumable (see the module docstring). -> OnPolicyTokens with every row done."""
    n, n_tok = captions.n, cloud.config.block_size
    out = OnPolicyTokens(root, split, n, n_tok, tag)
    start = out.done
    if start % chunk and start < n:
        raise ValueError(f"{out.done_path}: {start} rows done is not a multiple of the chunk {chunk}")
    dev = cloud.tok_embeddings.weight.device
    bar = tqdm(total=n, initial=start, desc=f"on-policy {split}", dynamic_ncols=True, disable=not progress)
    cache = None
    for s in range(start, n, chunk):
        k = min(chunk, n - s)
        emb = torch.from_numpy(captions.emb[s:s + k].astype(np.float32)).to(dev)
        mask = torch.from_numpy(captions.mask[s:s + k]).to(dev)
        rows = 2 * k if params.uses_cfg else k
        if cache is None or cache.slots < rows:
            cache = cloud.new_cache(rows)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + s // chunk)
        toks = generate_cloud(cloud, emb, mask, params, gen, cache=cache)
        out.tokens[s:s + k] = toks.cpu().numpy().astype(np.int16)
        out.mark(s + k)
        bar.update(k)
    bar.close()
    return out


def load_captions(data_dir: str, split: str, n: int, seed: int, world, dev, captions: str | None = None):
    """The caption arrays of one split: the scenes split (the "text" stage of `pipelines.data.build_split`),
    or with `captions` (a COCO-format file) its first `n` images' captions encoded by the world's caption encoder
    (a LlamaGen world's T5), resumable in chunks."""
    from pipelines.data import TokenisedScenes, build_split

    if captions is None:
        return build_split(data_dir, split, n, seed, None, world.text, world.cloud.config, dev)
    from ciar.data.coco import read_coco_captions

    texts = [r["caption"] for r in read_coco_captions(captions, limit=n)]
    if len(texts) < n:
        raise ValueError(f"{captions}: {len(texts)} captions, {n} asked for the {split} split")
    cfg = world.cloud.config
    data = TokenisedScenes(data_dir, split, n, cfg.block_size, cfg.cls_token_num, cfg.caption_dim, mode="w+")
    start, chunk = data.progress("text"), 64
    bar = tqdm(total=n, initial=start, desc=f"captions {split}", dynamic_ncols=True, disable=start >= n)
    for s in range(start, n, chunk):
        cap = world.text.encode(texts[s:s + chunk])
        data.emb[s:s + len(cap)] = cap.emb.cpu().numpy().astype(np.float16)
        data.mask[s:s + len(cap)] = cap.mask.cpu().numpy()
        data.mark("text", s + len(cap))
        bar.update(len(cap))
    bar.close()
    return data


def main(argv=None) -> int:
    from ciar.world import load_world
    from ciar.world_spec import ScenesWorldSpec, add_world_arguments, read_world, world_from_args
    from pipelines.common import pick_device

    p = argparse.ArgumentParser(prog="python -m pipelines.onpolicy", description=__doc__.split("\n")[0])
    add_world_arguments(p)
    p.add_argument("--captions", default=None, help="COCO-format captions of this split (a LlamaGen world; default: "
                                                    "the scenes split)")
    p.add_argument("--split", default="train", choices=["train", "val", "heldout"])
    p.add_argument("--n", type=int, default=12000)
    p.add_argument("--seed", type=int, default=3, help="scene data seed and generation seed")
    p.add_argument("--data-dir", default="data_cache/scenes-v2-s3")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = pick_device(args.device)
    spec = read_world(world_from_args(args), need_text=True)
    if args.captions is None and not isinstance(spec, ScenesWorldSpec):
        p.error("a LlamaGen world samples on --captions (a COCO-format captions file)")
    world = load_world(spec, device=dev)
    caps = load_captions(args.data_dir, args.split, args.n, args.seed, world, dev, args.captions)
    tag = onpolicy_tag(world.cloud_file, world.sampling)
    out = build_onpolicy(os.path.join(args.data_dir, "onpolicy"), args.split, caps, world.cloud, world.sampling,
                         args.seed, tag)
    print(f"{out.path}: {out.done} sequences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
