"""Calibrate a device model's CIAR defaults on val prompts and write them into its file (like set_sampling).

    python -m pipelines.calibrate weights/scenes-v2/device.safetensors --target-rate 0.3   # gate, burst, span: the file's
    python -m pipelines.calibrate weights/scenes-v2/device.safetensors --gate lower --burst 4 --span 2 --target-rate 0.3
    python -m pipelines.calibrate --world llamagen.yaml --captions val_captions.json --gate lower --burst 4

For every gate (`--gates`, default: all; `--jobs N` runs N gates at once) the threshold tau that gives `--target-rate`
cloud calls on `--prompts` **val** prompts is found by bisection over real generations
(`ciar.collab.calibration`), with the same span, prefix rate and cloud burst as CIAR runs with. The device file's
metadata then holds extra["ciar"] = {gate, taus (one per gate), burst, burst_entropy, span, target_rate,
calibration}
(`ciar.collab.defaults.CIARDefaults`), tensors bit for bit, written atomically. Every entry point (the CLI,
`benchmarks.collab`, `pipelines.evaluate`, the Serve device fleet with `tau: null`) uses it unless told otherwise.
A LlamaGen world (`--world`, `ciar.world_spec`) calibrates its `device_checkpoint` on `--captions` (a COCO-format
file of val captions, the first `--prompts` annotations by image id).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ciar.collab.calibration import calibrate_tau, val_prompts
from ciar.collab.defaults import EXTRA_KEY, CIARDefaults
from ciar.collab.device import DeviceModel
from ciar.collab.gating import GATES
from ciar.collab.runtime import make_verifier
from ciar.models.checkpoint import read_model_metadata, update_extra
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args

DEFAULT_GATES = GATES


def _calibrate_gate(job: tuple) -> tuple[str, dict]:
    """One gate's bisection (a worker process of `--jobs`, or in-process)."""
    world_src, device_path, gate, knobs, target, prompts, seed, threads = job
    torch.set_num_threads(threads)
    world = load_world(world_src)
    device = DeviceModel.load(device_path)
    th = calibrate_tau(world, make_verifier(world), "ciar", {**knobs, "gate": gate}, target, prompts, seed,
                       device_model=device)
    return gate, th


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("device", nargs="?", default=None,
                   help="device model file to calibrate (default: the world's; its folder is the scenes world unless "
                        "--weights / --world)")
    add_world_arguments(p)
    p.add_argument("--captions", default=None, help="COCO-format val captions (needed by a LlamaGen world; default "
                                                    "for the scenes world: its val split)")
    p.add_argument("--gate", default=None, choices=GATES,
                   help="CIAR's own gate (default: the device file's, else lower)")
    p.add_argument("--gates", default=",".join(DEFAULT_GATES), help="gates to calibrate (comma list)")
    p.add_argument("--target-rate", type=float, default=0.3)
    p.add_argument("--burst", type=int, default=None, help="cloud burst g CIAR runs with (0: the paper's CIAR; "
                   "default: the device file's)")
    p.add_argument("--burst-entropy", type=float, default=None, help="adaptive burst stop (default: the device file's)")
    p.add_argument("--span", type=int, default=None, help="draft tokens per verification CIAR runs with (written "
                   "with the taus: a threshold holds for the span it was calibrated at; default: the device file's)")
    p.add_argument("--prompts", type=int, default=48, help="val prompts (16 gave a rate 2-5 points under the one on other "
                   "prompts: an easy sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="gates calibrated in parallel processes")
    p.add_argument("--dry-run", action="store_true", help="print the result, leave the file as it is")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gates = [g.strip() for g in args.gates.split(",") if g.strip()]
    bad = [g for g in gates if g not in GATES]
    if bad:
        p.error(f"unknown gates {bad}; known: {', '.join(GATES)}")
    if not 0.0 < args.target_rate < 1.0:
        p.error("--target-rate must be in (0, 1)")
    if args.device is not None and not os.path.isfile(args.device):
        p.error(f"device file not found: {args.device}")
    source = world_from_args(args)
    if source is None and args.device is not None:
        source = os.path.dirname(os.path.abspath(args.device))  # the device file's folder is its scenes world
    try:
        spec = read_world(source, need_device=args.device is None, need_text=True)
    except WorldSpecError as e:
        p.error(str(e))
    if args.device is None:
        args.device = spec.file("device.safetensors", spec.device_checkpoint) if isinstance(spec, ScenesWorldSpec) \
            else spec.path(spec.device_checkpoint)
    if args.captions:
        from ciar.data.coco import read_coco_captions

        prompts = [r["caption"] for r in read_coco_captions(args.captions, limit=args.prompts)]
        where = f"{args.captions}[:{len(prompts)}]"
    elif isinstance(spec, ScenesWorldSpec):
        prompts = val_prompts(args.prompts, args.seed)
        where = f"scenes:val[10000:{10000 + len(prompts)}]:seed={args.seed}"
    else:
        p.error("a LlamaGen world calibrates on --captions (a COCO-format file of val captions)")
    weights = source
    # the knobs not given keep the device file's (a re-calibration changes only what it is told to), else the
    # built-in defaults (ciar.collab.defaults)
    current = CIARDefaults.from_extra(read_model_metadata(args.device)[2], args.device) or CIARDefaults()
    for name in ("gate", "burst", "burst_entropy", "span"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(current, name))
    if args.gate not in gates:
        gates.insert(0, args.gate)
    if args.span < 1:
        p.error("--span must be >= 1")
    knobs = {"burst": args.burst, "burst_entropy": args.burst_entropy, "span": args.span}
    t0 = time.time()
    jobs = [(weights, args.device, g, knobs, args.target_rate, prompts, args.seed, args.threads) for g in gates]
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_calibrate_gate, jobs))
    else:
        results = [_calibrate_gate(j) for j in jobs]
    taus, rates = {}, {}
    for g, th in results:
        taus[g], rates[g] = th["tau"], th["calibration_rate"]
        print(f"{g}: tau {th['tau']:.6g} -> cloud-call rate {th['calibration_rate']:.4f} on {len(prompts)} val "
              f"prompts", file=sys.stderr)
    defaults = CIARDefaults(gate=args.gate, taus=taus, burst=args.burst, burst_entropy=args.burst_entropy,
                            span=args.span, target_rate=args.target_rate, calibration={
                                "prompts": where,
                                "measured_rates": rates, "seconds": round(time.time() - t0, 1),
                                "command": "python -m pipelines.calibrate " + " ".join(argv or sys.argv[1:])})
    if args.dry_run:
        print(defaults.to_dict())
        return 0
    update_extra(args.device, {EXTRA_KEY: defaults.to_dict()})
    print(f"{args.device}: ciar defaults {defaults.to_dict()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
