"""Parallel decoding on the cloud beside CIAR, in one run: cloud-only, SJD, GSD, CIAR and CIAR + Jacobi.

    python -m benchmarks.parallel --n 200 --networks 5g,4g,wifi --out benchmarks/results/DATE/parallel

The alternative a platform team would weigh against CIAR needs no phone model: training-free speculative Jacobi
decoding on the cloud (SJD, and GSD's grouped acceptance as its relaxed variant; `ciar.engine.works.JacobiWork`).
Every method runs through the same harness and the same engine as every baseline (`ciar.sim.runtime
.make_decoder` over the in-process verifier: the simulated device, the network model, the verifier's works), on the
world's held-out prompts, one image per prompt and seed, methods and links interleaved prompt by prompt. Per method:

- sequential cloud passes per image (what bounds latency on an idle GPU) and cloud requests per image;
- cloud positions per image: every position the verifier's forwards fed for it, both CFG rows (what a saturated
  GPU pays for: a Jacobi pass feeds its whole window), read from the verifier's runner around each image;
- fidelity (the attribute probe) with a paired 95 % bootstrap interval against cloud-only on the same prompts and
  seeds, and FID against the rendered references;
- speedup over cloud-only at measured compute (this CPU, one torch thread) on each link, and under the paper's
  Table 8 profile (a simulation: its cost per sequential cloud step and per device step, `benchmarks.collab
  .PAPER_PROFILE`);
- GPU-priced images/s at saturation (a MODEL, `ciar.capacity.gpu_model.forward_s` on an H100 at LlamaGen-XL's
  shapes, this world's image length): 64 sessions of the method in every forward, each forward as wide as the
  method's mean positions per pass, the image's passes in sequence, with no per-forward overhead (the roofline) and
  with the model's 3 ms (an eager engine); device compute and the network are not in it.

Writes OUT/parallel.json and OUT/parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.collab import PAPER_PROFILE, ci_text, fidelity_checks, load_prompts, paired_fidelity_ci, priced, quality
from ciar.capacity.gpu_model import GPUS, ModelShapes, forward_s
from ciar.collab.stats import summarize_method
from ciar.decoding.jacobi import DEFAULT_WINDOW
from ciar_device.stats import GenerationStats

VARIANTS = {"cloud": ("cloud", {}), "sjd": ("sjd", {}), "gsd": ("gsd", {}), "ciar": ("ciar", {}),
            "ciar + Jacobi": ("ciar", {"jacobi_window": DEFAULT_WINDOW}),
            # at the device file's calibrated point (no adaptive choice, never cloud-only): what the drafting costs
            "ciar fixed": ("ciar", {"policy": "fixed"}),
            "ciar + Jacobi fixed": ("ciar", {"policy": "fixed", "jacobi_window": DEFAULT_WINDOW})}
DEFAULT_VARIANTS = ("cloud", "sjd", "gsd", "ciar", "ciar + Jacobi")
SATURATION_SESSIONS = 64  # sessions in every forward of the GPU-priced figure


def gpu_images_per_s(passes: float, positions: float, image_tokens: int, overhead_s: float,
                     gpu: str = "h100") -> float:
    """Images/s of one replica (a model) when SATURATION_SESSIONS sessions of the method share every forward: each
    forward two CFG rows per session, as wide as the method's positions per pass, reading keys up to mid-image, plus
    `overhead_s` per forward (0: the roofline alone)."""
    shapes = ModelShapes.llamagen_xl()
    width = max(1, round(positions / max(passes, 1) / 2))  # positions count both CFG rows
    keys = shapes.cls_token_num + image_tokens // 2
    step = forward_s(GPUS[gpu], shapes, [(2, width, keys)] * SATURATION_SESSIONS, overhead_s=overhead_s)
    return SATURATION_SESSIONS / (step * passes)


def run(n: int, networks: list[str], seed: int, out: str, variants=DEFAULT_VARIANTS) -> dict:
    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.metrics.fid import make_fid
    from ciar.metrics.probe import load_probe
    from ciar.world import load_world

    torch.set_num_threads(1)
    world = load_world(None)
    ps = load_prompts(None, n, seed)
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    fid_net = make_fid("scenes")
    verifier = make_verifier(world, max_sessions=2)
    if "cloud" not in variants or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: cloud and any of {', '.join(VARIANTS)}")
    chosen = {v: VARIANTS[v] for v in variants}
    runs = {(v, net): make_decoder(world, verifier, m, network=net, **ov)
            for v, (m, ov) in chosen.items() for net in networks}
    for d in runs.values():  # first-call overheads out of the measurement
        d.generate(ps.captions[0], seed=10 ** 9)
    tokens = {k: [] for k in runs}
    stats: dict = {k: [] for k in runs}
    positions: dict = {k: [] for k in runs}
    t0 = time.perf_counter()
    for i in tqdm(range(len(ps.captions)), desc="parallel", dynamic_ncols=True):
        for k, d in runs.items():
            fed = verifier.runner.positions["fed"]
            r = d.generate(ps.captions[i], seed=seed * 1_000_003 + i)
            positions[k].append(verifier.runner.positions["fed"] - fed)
            tokens[k].append(r.tokens)
            stats[k].append(r.stats)
    wall = time.perf_counter() - t0
    image_tokens = world.cloud.config.block_size
    rows, base_checks = {}, None
    for v in chosen:
        first = (v, networks[0])  # tokens and cloud work per link differ only where the adaptive policy reads it
        toks = torch.stack(tokens[first])
        checks = fidelity_checks(world, toks, ps, probe)
        if v == "cloud":
            base_checks = checks
        total = sum(stats[first], GenerationStats())
        passes, pos = total.cloud_forward_passes / n, float(np.mean(positions[first]))
        rows[v] = {**quality(world, toks, ps, probe, fid_net),
                   "fidelity_vs_cloud": None if v == "cloud" else paired_fidelity_ci(base_checks, checks),
                   "cloud_passes_per_image": passes, "cloud_requests_per_image": total.cloud_requests / n,
                   "handed_to_cloud": total.handovers / n,  # images the adaptive policy gave to the cloud
                   "cloud_positions_per_image": pos, "cloud_call_rate": summarize_method(stats[first], None)
                   ["cloud_call_rate"], "paper_profile_s": priced(total, n, PAPER_PROFILE),
                   "gpu_images_per_s": gpu_images_per_s(passes, pos, image_tokens, 0.0),
                   "gpu_images_per_s_3ms": gpu_images_per_s(passes, pos, image_tokens, 3e-3),
                   "latency_s": {net: summarize_method(stats[(v, net)], None)["latency_s"]["total"]
                                 for net in networks}}
    base = rows["cloud"]
    for r in rows.values():
        r["step_compression"] = base["cloud_passes_per_image"] / r["cloud_passes_per_image"]
        r["positions_vs_cloud"] = r["cloud_positions_per_image"] / base["cloud_positions_per_image"]
        r["speedup"] = {net: base["latency_s"][net] / r["latency_s"][net] for net in networks}
        r["speedup_paper_profile"] = base["paper_profile_s"] / r["paper_profile_s"]
        r["gpu_images_per_s_vs_cloud"] = r["gpu_images_per_s"] / base["gpu_images_per_s"]
        r["gpu_images_per_s_3ms_vs_cloud"] = r["gpu_images_per_s_3ms"] / base["gpu_images_per_s_3ms"]
    command = f"python -m benchmarks.parallel --n {n} --networks {','.join(networks)} --seed {seed}"
    if tuple(variants) != DEFAULT_VARIANTS:
        command += f" --variants '{','.join(variants)}'"
    result = {"command": command,
              "prompts": ps.source, "n": n, "image_tokens": image_tokens, "jacobi_window": DEFAULT_WINDOW,
              "wall_s": wall, "rows": rows}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "parallel.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "parallel.md"), "w") as f:
        f.write(markdown(result))
    return result


def markdown(result: dict) -> str:
    nets = list(next(iter(result["rows"].values()))["speedup"])
    lines = [f"# Parallel decoding on the cloud beside CIAR, {result['n']} prompts ({result['prompts']})", "",
             f"`{result['command']}` (Jacobi window {result['jacobi_window']}; one torch thread)", "",
             "| method | cloud passes / image | step compression | cloud requests / image | cloud positions / image |"
             " × cloud's positions | fidelity | Δ fidelity vs cloud [95 % CI] | FID | "
             + " | ".join(f"speedup {n} (this CPU)" for n in nets)
             + " | speedup, paper profile (sim.) | images/s at saturation, H100 roofline (model) | × cloud's | "
             "images/s, + 3 ms a forward (model) | × cloud's |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(nets) + "---|---|---|---|---|"]
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    for m, r in result["rows"].items():
        d = ci_text(r["fidelity_vs_cloud"])
        lines.append(f"| {m} | {r['cloud_passes_per_image']:.1f} | ×{r['step_compression']:.2f} | "
                     f"{r['cloud_requests_per_image']:.1f} | {r['cloud_positions_per_image']:.0f} | "
                     f"×{r['positions_vs_cloud']:.2f} | {f(r['fidelity'], '.3f')} | {d} | {f(r['fid'], '.2f')} | "
                     + " | ".join(f"×{r['speedup'][n]:.2f}" for n in nets)
                     + f" | ×{r['speedup_paper_profile']:.2f} | {r['gpu_images_per_s']:.1f} | "
                     f"×{r['gpu_images_per_s_vs_cloud']:.2f} | {r['gpu_images_per_s_3ms']:.1f} | "
                     f"×{r['gpu_images_per_s_3ms_vs_cloud']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="held-out prompts")
    ap.add_argument("--networks", default="5g,4g,wifi", help="simulated links, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, cloud first (the baseline): any of {', '.join(VARIANTS)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = run(args.n, [s.strip() for s in args.networks.split(",")], args.seed, args.out,
              tuple(v.strip() for v in args.variants.split(",")))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
