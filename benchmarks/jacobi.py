"""Speculative Jacobi decoding (SJD) beside cloud-only decoding, in one run: the training-free alternative to CIAR.

    python -m benchmarks.jacobi --n 200 --windows 8,16,32 --out benchmarks/results/DATE/jacobi

On the world's held-out prompts (the scenes world by default, one image per prompt and seed), per method: sequential
cloud passes per image (cloud-only: one per token after the prefill; `ciar.decoding.jacobi` for SJD), image positions
fed per CFG row (what a saturated accelerator pays for: SJD feeds its whole window every pass), wall seconds per image
on this machine (one torch thread, methods interleaved prompt by prompt), attribute fidelity (the probe) with a paired
95 % bootstrap interval against cloud-only on the same prompts, and FID against the rendered references. SJD is exact
in distribution (tests/decoding/test_jacobi.py), so its fidelity differs from cloud-only's by the draws only.
Writes OUT/jacobi.json and OUT/jacobi.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from benchmarks.collab import ci_text, fidelity_checks, load_prompts, paired_fidelity_ci, quality
from ciar.decoding.generate import generate_cloud
from ciar.decoding.jacobi import generate_sjd


def run(n: int, windows: list[int], seed: int, out: str) -> dict:
    from ciar.metrics.fid import make_fid
    from ciar.metrics.probe import load_probe
    from ciar.world import load_world

    torch.set_num_threads(1)
    world = load_world(None)
    ps = load_prompts(None, n, seed)
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    fid_net = make_fid("scenes")
    names = ["cloud"] + [f"sjd-{w}" for w in windows]
    tokens = {m: [] for m in names}
    passes = {m: [] for m in names}
    positions = {m: [] for m in names}
    seconds = {m: [] for m in names}
    n_img = world.cloud.config.block_size
    for i, prompt in enumerate(ps.captions):
        cap = world.text.encode([prompt])
        for m in names:  # interleaved: the same machine state for every method
            t = time.perf_counter()
            if m == "cloud":
                toks = generate_cloud(world.cloud, cap.emb, cap.mask, world.sampling, seed + i)[0]
                passes[m].append(n_img - 1)
                positions[m].append(n_img - 1)
            else:
                toks, st = generate_sjd(world.cloud, cap.emb, cap.mask, world.sampling, seed + i,
                                        window=int(m.split("-")[1]))
                passes[m].append(st.forwards)
                positions[m].append(st.positions)
            seconds[m].append(time.perf_counter() - t)
            tokens[m].append(toks)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{len(ps.captions)} prompts", flush=True)
    rows = {}
    base_checks = None
    for m in names:
        toks = torch.stack(tokens[m])
        q = quality(world, toks, ps, probe, fid_net)
        checks = fidelity_checks(world, toks, ps, probe)
        if m == "cloud":
            base_checks = checks
        rows[m] = {"passes_per_image": float(np.mean(passes[m])), "positions_per_image": float(np.mean(positions[m])),
                   "seconds_per_image": float(np.mean(seconds[m])), **q,
                   "fidelity_vs_cloud": None if m == "cloud" else paired_fidelity_ci(base_checks, checks)}
    for m, r in rows.items():
        c = rows["cloud"]
        r["step_compression"] = c["passes_per_image"] / r["passes_per_image"]
        r["positions_vs_cloud"] = r["positions_per_image"] / c["positions_per_image"]
        r["speedup_this_cpu"] = c["seconds_per_image"] / r["seconds_per_image"]
    result = {"command": f"python -m benchmarks.jacobi --n {n} --windows {','.join(map(str, windows))} --seed {seed}",
              "prompts": ps.source, "n": n, "image_tokens": n_img, "rows": rows}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "jacobi.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "jacobi.md"), "w") as f:
        f.write(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = [f"# Speculative Jacobi decoding beside cloud-only, {result['n']} prompts ({result['prompts']})", "",
             f"`{result['command']}`", "",
             "| method | passes / image | step compression | positions / image | × cloud's positions | s / image "
             "(this CPU) | speedup (this CPU) | fidelity | Δ fidelity vs cloud [95 % CI] | FID |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in result["rows"].items():
        d = ci_text(r["fidelity_vs_cloud"])
        lines.append(f"| {m} | {r['passes_per_image']:.1f} | ×{r['step_compression']:.2f} | "
                     f"{r['positions_per_image']:.0f} | ×{r['positions_vs_cloud']:.2f} | {r['seconds_per_image']:.3f} | "
                     f"×{r['speedup_this_cpu']:.2f} | {r['fidelity']:.3f} | {d} | {r['fid']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="held-out prompts")
    ap.add_argument("--windows", default="8,16,32", help="SJD windows, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = run(args.n, [int(w) for w in args.windows.split(",")], args.seed, args.out)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
