"""One-token cached steps of LlamaGen-XL (random weights, built in memory) on this CPU with the keys copied into a
dense block first (`ciar.models.gpt`'s CPU rule before this change, forced here) or read as a view of the cache:
best of 4 timed steps, three alternating rounds per arm. The figures in README.md came from

    python benchmarks/results/2026-11-26c/dense_copy_ab.py --dtype bfloat16 --cases 2:248,2:1016
    python benchmarks/results/2026-11-26c/dense_copy_ab.py --dtype bfloat16 --cases 16:248,16:632,16:1016,2:632
    python benchmarks/results/2026-11-26c/dense_copy_ab.py --dtype float32 --cases 16:184,16:376,16:632,16:1016

(rows:position; one torch thread; the box was shared, load average 4-5 on 2 cores)."""

import argparse
import math
import time

import torch

import ciar.models.gpt as G


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cases", default="2:248,2:1016")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        m = G.build_gpt("GPT-XL", block_size=1024)
    m = m.to_empty(device="cpu").to(dtype)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    c = m.config
    m.freqs_cis = G.precompute_freqs_cis_2d(c.grid_size, c.head_dim, c.rope_base, c.cls_token_num).to(dtype)
    m.eval()
    saved = G._DENSE_DEVICES, G._DENSE_MAX_BYTES
    with torch.inference_mode():
        for case in args.cases.split(","):
            rows, start = (int(x) for x in case.split(":"))
            cache = m.new_cache(rows, max_seq=start + 16)
            cache.key_valid[:] = True
            tok, at = torch.zeros(rows, 1, dtype=torch.long), torch.tensor([start])

            def step():
                m.logits(m.forward_cached(cache, m.tok_embeddings(tok), at, kv_len=start + 1))

            res = {True: [], False: []}
            for copy in (True, False) * 3:
                G._DENSE_DEVICES, G._DENSE_MAX_BYTES = (("cpu",), math.inf) if copy else ((), saved[1])
                step()
                times = []
                for _ in range(4):
                    t = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t)
                res[copy].append(min(times))
            G._DENSE_DEVICES, G._DENSE_MAX_BYTES = saved
            print(f"{args.dtype} {rows} rows, {start + 1} keys: copied {['%.3f' % t for t in res[True]]} best "
                  f"{min(res[True]):.3f} s; view {['%.3f' % t for t in res[False]]} best {min(res[False]):.3f} s")


if __name__ == "__main__":
    main()
