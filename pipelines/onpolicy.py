"""On-policy token sequences: images the frozen cloud samples itself, with the world's sampling settings, on disk.

    python -m pipelines.onpolicy --split train --n 12000 --seed 3 --data-dir data_cache/scenes-v2-s3
    python -m pipelines.onpolicy --world llamagen.yaml --captions captions_train2017.json --split train --n 20000 \
        --data-dir data_cache/llamagen-xl       # a LlamaGen world: COCO captions encoded by its T5 (resumable)

The device drafts from the *guided* cloud distribution, so it is distilled on the prefixes the cloud actually
produces under CFG (docs/architecture.md §12.2), not on VQ codes of rendered images. This stage samples one image per
caption of a `TokenisedScenes` split (captions embedded by `pipelines.data.build_split`'s "text" stage) with
`ciar.decoding.generate_cloud` and writes the tokens into a memory-mapped array next to the captions:

    DATA_DIR/onpolicy/{split}_{n}_{tag}.npy      tokens [n, N] int16
    DATA_DIR/onpolicy/{split}_{n}_{tag}.done     how many rows are written (resume point)

`tag` names the cloud file (a digest of its bytes) and the sampling settings, so a new cloud or new settings never
reuse stale sequences; `{split}_{n}_{tag}.seed.json` keeps the seed and chunk they were drawn with, and a run with
another one is refused (it would resume into, or reuse, these rows). Rows are generated in fixed chunks, each from
its own seeded generator (`seed * 1_000_003 + chunk index`), so an interrupted run resumes to the same bytes it
would have written at once.
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
def sample_chunk(cloud: GPT, emb: np.ndarray, mask: np.ndarray, params: SamplingParams, seed: int, index: int,
                 cache=None):
    """One chunk of on-policy sequences: captions emb [k, L, D] / mask [k, L] -> tokens [k, N] int16, from the
    chunk's own seeds (row b of chunk `index`: `((seed * 1_000_003 + index) << 16) + b`, chunks under 65,536
    rows), so any worker produces the same bytes. -> (tokens, cache)."""
    from pipelines.data import caption_tensor

    dev = cloud.tok_embeddings.weight.device
    k = emb.shape[0]
    rows = 2 * k if params.uses_cfg else k
    if cache is None or cache.slots < rows:
        cache = cloud.new_cache(rows)
    base = (seed * 1_000_003 + index) << 16
    toks = generate_cloud(cloud, caption_tensor(emb).to(dev), torch.from_numpy(mask).to(dev), params,
                          [base + b for b in range(k)], cache=cache)
    return toks.cpu().numpy().astype(np.int16), cache


def build_onpolicy(root: str, split: str, captions, cloud: GPT, params: SamplingParams, seed: int, tag: str,
                   chunk: int = CHUNK, progress: bool = True, workers: int = 0, world=None) -> OnPolicyTokens:
    """Sample one image per caption of `captions` (a TokenisedScenes: emb [n, L, D], mask [n, L]) with the cloud;
    resumable (see the module docstring). `workers` > 0: the chunks run on a Ray Data actor pool of that size (each
    actor loads the cloud of `world`, a world source (None: the shipped one); one GPU each when the cluster has GPUs), and the driver writes
    them in order as they arrive, so a large caption set spreads over a cluster and still resumes to the same bytes.
    -> OnPolicyTokens with every row done."""
    from ciar.results import claim_settings

    n, n_tok = captions.n, cloud.config.block_size
    # (the file is named by the cloud and its sampling, not the seed: another seed would resume into these rows)
    claim_settings(os.path.join(root, f"{split}_{n}_{tag}.seed.json"), {"seed": seed, "chunk": chunk},
                   f"{root}: the on-policy {split} sequences of {n} ({tag})", "give another --data-dir, or remove "
                   "that folder")
    out = OnPolicyTokens(root, split, n, n_tok, tag)
    start = out.done
    if start % chunk and start < n:
        raise ValueError(f"{out.done_path}: {start} rows done is not a multiple of the chunk {chunk}")
    bar = tqdm(total=n, initial=start, desc=f"on-policy {split}", dynamic_ncols=True, disable=not progress)
    starts = list(range(start, n, chunk))
    if workers and starts:
        results = _ray_chunks(captions, starts, chunk, n, params, seed, world, workers)
    else:
        results = _local_chunks(captions, starts, chunk, n, cloud, params, seed)
    for s, toks in results:
        out.tokens[s:s + len(toks)] = toks
        out.mark(s + len(toks))
        bar.update(len(toks))
    bar.close()
    return out


def _local_chunks(captions, starts, chunk, n, cloud, params, seed):
    cache = None
    for s in starts:
        k = min(chunk, n - s)
        toks, cache = sample_chunk(cloud, captions.emb[s:s + k], captions.mask[s:s + k], params, seed, s // chunk,
                                   cache)
        yield s, toks


class _ChunkSampler:
    """Ray Data stage: a batch of chunk starts -> their token rows (the actor loads the world's cloud once)."""

    def __init__(self, world, emb_path: str, mask_path: str, params: dict, seed: int, chunk: int, n: int):
        from ciar.world import load_world_cloud

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.set_num_threads(1)
        self.cloud, _ = load_world_cloud(world, dev)
        self.emb = np.load(emb_path, mmap_mode="r")
        self.mask = np.load(mask_path, mmap_mode="r")
        self.params, self.seed, self.chunk, self.n, self.cache = SamplingParams(**params), seed, chunk, n, None

    def __call__(self, batch: dict) -> dict:
        (s,) = batch["start"].tolist()  # batch_size=1: one chunk per call
        k = min(self.chunk, self.n - s)
        toks, self.cache = sample_chunk(self.cloud, self.emb[s:s + k], self.mask[s:s + k], self.params, self.seed,
                                        s // self.chunk, self.cache)
        return {"start": np.array([s]), "tokens": toks[None]}


def _ray_chunks(captions, starts, chunk, n, params, seed, world, workers):
    import ray

    from ciar.world_spec import read_world, spec_dict

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # chunks come back in order: the driver's resume point stays exact
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    ds = ray.data.from_items([{"start": s} for s in starts]).map_batches(
        _ChunkSampler, batch_size=1, num_gpus=gpus, compute=ray.data.ActorPoolStrategy(size=workers),
        fn_constructor_kwargs={"world": spec_dict(read_world(world)), "emb_path": captions.emb.filename,
                               "mask_path": captions.mask.filename, "params": params.to_dict(), "seed": seed,
                               "chunk": chunk, "n": n})
    for row in ds.iter_rows():
        yield int(row["start"]), np.asarray(row["tokens"], dtype=np.int16)


def load_captions(data_dir: str, split: str, n: int, seed: int, world, dev, captions: str | None = None):
    """The caption arrays of one split: the scenes split (the "text" stage of `pipelines.data.build_split`),
    or with `captions` (a COCO-format file) its first `n` images' captions encoded by the world's caption encoder
    (a LlamaGen world's T5), resumable in chunks."""
    from pipelines.data import TokenisedScenes, build_split

    if captions is None:
        return build_split(data_dir, split, n, seed, None, world.text, world.cloud.config, dev)
    from ciar.data.coco import read_coco_captions
    from ciar_device.fetch import sha256_file
    from pipelines.data import claim_source

    claim_source(data_dir, split, n, {"source": os.path.abspath(captions), "sha256": sha256_file(captions)})
    texts = [r["caption"] for r in read_coco_captions(captions, limit=n)]
    if len(texts) < n:
        raise ValueError(f"{captions}: {len(texts)} captions, {n} asked for the {split} split")
    cfg = world.cloud.config
    data = TokenisedScenes(data_dir, split, n, cfg.block_size, cfg.cls_token_num, cfg.caption_dim, mode="w+",
                           cfg=cfg)
    start, chunk = data.progress("text"), 64
    bar = tqdm(total=n, initial=start, desc=f"captions {split}", dynamic_ncols=True, disable=start >= n)
    for s in range(start, n, chunk):
        cap = world.text.encode(texts[s:s + chunk])
        data.emb[s:s + len(cap)] = cap.emb.cpu().numpy().astype(data.emb.dtype)
        data.mask[s:s + len(cap)] = cap.mask.cpu().numpy()
        data.mark("text", s + len(cap))
        bar.update(len(cap))
    bar.close()
    return data


def main(argv=None) -> int:
    from ciar.world import load_world
    from ciar.world_spec import ScenesWorldSpec, add_world_arguments, read_world, spec_dict, world_from_args
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
    p.add_argument("--workers", type=int, default=0, help="Ray Data actors sampling chunks in parallel (one GPU each "
                                                          "on a GPU cluster; 0: in this process)")
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
                         args.seed, tag, workers=args.workers, world=spec_dict(spec))
    print(f"{out.path}: {out.done} sequences")
    return 0


if __name__ == "__main__":
    from pipelines.common import run_main

    raise SystemExit(run_main(main))
