"""A device's first image: what the adaptive policy chooses before the device has drafted anything (issue 29).

    python -m benchmarks.first_image --num-prompts 30 --out benchmarks/results/DATE/first_image.json

A phone that asks for one image has observed nothing of its costs. The adaptive policy primes its estimates before
the open (`ciar_device.policy.CostObserver.prime`): half the round trip of its connection's handshake (HELLO and
WELCOME through its link's network model), one timed step of its own, and the verifier's recent span forward,
sampled step and queue wait (`CloudVerifier.cost_hint`, which WELCOME carries to a device on the network). This
runs each held-out prompt as the first image of a new device (a new decoder and observer per image; the step is
timed before the image, outside its time) on each link, with cloud-only, CIAR at its fixed calibrated point and
adaptive CIAR side by side (interleaved), against one verifier that has served a warm-up image of each (so it has a
hint, as a running cluster does). `--no-prime` runs the adaptive devices without priming (the policy before it:
a first image at the calibrated point) for comparison.

Reported per link: each method's mean seconds per image (measured compute + the network model, busy-box noise
alike for all three), the speedup over cloud-only, the share of first images adaptive CIAR gave to the cloud whole,
and whether every adaptive image equals the fixed image or cloud-only's (it must: a first image runs at the
calibrated point or goes to the cloud whole, the same request and seed). Prompt i runs with seed
`seed * 1000003 + i`, as in `benchmarks.collab`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from benchmarks.collab import load_prompts
from ciar.sim.runtime import make_decoder, make_verifier
from ciar.results import write_results
from ciar.world import load_world
from ciar_device.policy import CostObserver

LINKS = ("5g", "wifi", "4g")
METHODS = {"cloud-only": ("cloud", {}), "fixed CIAR": ("ciar", {"policy": "fixed"}),
           "adaptive CIAR": ("ciar", {"policy": "adaptive"})}


def run(world, verifier, prompts: list[str], seed: int, links=LINKS, prime: bool = True) -> dict:
    """-> {link: {method: [per-image dict]}}: each prompt the first image of a new device, methods interleaved."""
    for method, knobs in METHODS.values():  # first-call overheads out, and the verifier's hint in
        make_decoder(world, verifier, method, **knobs).generate(prompts[0], seed=10 ** 9)
    out = {link: {name: [] for name in METHODS} for link in links}
    for i in tqdm(range(len(prompts)), desc="first images", dynamic_ncols=True):
        for link in links:
            for name, (method, knobs) in METHODS.items():
                dec = make_decoder(world, verifier, method, network=link, **knobs)
                if not prime:  # an observer primed with nothing: no handshake, step or hint known
                    dec.observers[link] = unprimed = CostObserver(rates=world.device_model.ciar_defaults.policy_rates)
                    unprimed.prime()
                r = dec.generate(prompts[i], seed=seed * 1_000_003 + i)
                st = r.stats
                out[link][name].append({"seconds": st.total_s, "handover": st.handovers, "adapted": st.adapted,
                                        "cloud_requests": st.cloud_requests, "tokens": r.tokens.tolist()})
    return out


def summary(results: dict) -> dict:
    rows = {}
    for link, by_method in results.items():
        base = statistics.mean(r["seconds"] for r in by_method["cloud-only"])
        row = {name: {"seconds": statistics.mean(r["seconds"] for r in imgs),
                      "speedup": base / statistics.mean(r["seconds"] for r in imgs)}
               for name, imgs in by_method.items()}
        adaptive = by_method["adaptive CIAR"]
        row["to_cloud"] = statistics.mean(r["handover"] for r in adaptive)
        row["reproduces"] = all(a["tokens"] == (c["tokens"] if a["handover"] else f["tokens"])
                                for a, f, c in zip(adaptive, by_method["fixed CIAR"], by_method["cloud-only"]))
        rows[link] = row
    return rows


def markdown(rows: dict, n: int, prime: bool) -> str:
    out = [f"### A device's first image ({n} held-out prompts, each the first image of a new device"
           f"{'' if prime else ', adaptive devices not primed'})\n\n",
           "| link | cloud-only s | fixed CIAR s (speedup) | adaptive CIAR s (speedup) | first images to the cloud | "
           "adaptive = fixed or cloud-only image |\n|---|---|---|---|---|---|\n"]
    for link, r in rows.items():
        c, f, a = r["cloud-only"], r["fixed CIAR"], r["adaptive CIAR"]
        out.append(f"| {link} | {c['seconds']:.3f} | {f['seconds']:.3f} (x{f['speedup']:.2f}) | "
                   f"{a['seconds']:.3f} (x{a['speedup']:.2f}) | {100 * r['to_cloud']:.0f} % | "
                   f"{'yes' if r['reproduces'] else 'NO'} |\n")
    return "".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_image", description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--no-prime", action="store_true", help="adaptive devices without the handshake, step and hint")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    links = tuple(x.strip() for x in args.links.split(",") if x.strip())
    world = load_world(None)
    verifier = make_verifier(world)
    ps = load_prompts(None, args.num_prompts, args.seed)
    t0 = time.time()
    results = run(world, verifier, ps.captions, args.seed, links, prime=not args.no_prime)
    rows = summary(results)
    report = {"prompts": ps.source, "num_prompts": len(ps.captions), "seed": args.seed, "primed": not args.no_prime,
              "weights": world.weights_dir, "rows": rows, "seconds": time.time() - t0,
              "images": {link: {m: [{k: v for k, v in r.items() if k != "tokens"} for r in imgs]
                                for m, imgs in by.items()} for link, by in results.items()}}
    write_results(args.out, report, markdown(rows, len(ps.captions), not args.no_prime))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
