"""Calibrate a device model's CIAR defaults on val prompts and write them into its file (like set_sampling).

    python -m pipelines.calibrate weights/scenes-v2/device.safetensors --target-rate 0.3   # gate, burst, span: the file's
    python -m pipelines.calibrate weights/scenes-v2/device.safetensors --gate lower --burst 4 --span 2 --target-rate 0.3
    python -m pipelines.calibrate --world llamagen.yaml --captions val_captions.json --gate lower --burst 4

For every gate (`--gates`, default: all; `--jobs N` runs N gates at once) the threshold tau that gives `--target-rate`
cloud calls on `--prompts` **val** prompts is found by bisection over real generations
(`ciar.training.calibration`), with the same span, prefix rate and cloud burst as CIAR runs with. The device file's
metadata then holds extra["ciar"] = {gate, taus (one per gate), burst, burst_entropy, span, target_rate,
calibration}
(`ciar.collab.defaults.CIARDefaults`), tensors bit for bit, written atomically. Every entry point (the CLI,
`benchmarks.collab`, `pipelines.evaluate`, the Serve device fleet with `tau: null`) uses it unless told otherwise.
A LlamaGen world (`--world`, `ciar.world_spec`) calibrates its `device_checkpoint` on `--captions` (a COCO-format
file of val captions, the first `--prompts` annotations by image id).

CASCADE's cosine threshold (`--cascade`, the scenes world: it needs the attribute probe):

    python -m pipelines.calibrate weights/scenes-v2/device.safetensors --gates none --cascade --cascade-prompts 96

runs EAGLE-2 (the exact rule) and CASCADE at each of `--cascade-thresholds` on the first `--cascade-prompts` val
prompts (prompt i with seed `seed * 1000003 + i`, the same prompts and seeds for every threshold) and chooses the
lowest threshold whose probe fidelity, and that of every higher threshold, is at least the exact rule's minus
`--cascade-tolerance` (`choose_cascade_threshold`): the most relaxation that costs at most that much fidelity on
val prompts. It is written as extra["ciar"]["cascade_threshold"] with the measurements behind it
(`cascade_calibration`). `--gates none` re-measures no tau: every other value the file holds (gate, taus, target
rate, their calibration record, burst, span) stays as it is; without it the taus are re-calibrated too.

The adaptive policy's starting rates (`--policy-rates`): CIAR at the file's calibrated gate, tau, span and burst on
the first `--policy-prompts` val prompts; the gate's escalation rate and the cloud's acceptance of the span's
first and later drafts are written as extra["ciar"]["policy_rates"] (`ciar_device.policy.CostObserver` starts from
them; a device then follows its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import torch

from ciar.training.calibration import calibrate_tau, val_prompts
from ciar.collab.defaults import EXTRA_KEY, CIARDefaults
from ciar.collab.device import DeviceModel
from ciar.collab.gating import GATES
from ciar.collab.protocol import RuleConfig
from ciar.sim.runtime import make_decoder, make_verifier
from ciar.collab.stats import GenerationStats
from ciar.models.checkpoint import read_model_metadata, update_extra
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args

DEFAULT_GATES = GATES
# CASCADE's candidate thresholds: the scenes cloud's output rows have no pair with a cosine above 0.72 (the paper's
# 0.9 relaxes nothing), 30 % of them a nearest neighbour above 0.6, 97 % one above 0.4
CASCADE_THRESHOLDS = (0.6, 0.5, 0.4, 0.3, 0.2)


def _calibrate_gate(job: tuple) -> tuple[str, dict]:
    """One gate's bisection (a worker process of `--jobs`, or in-process)."""
    world_src, device_path, gate, knobs, target, prompts, seed, threads = job
    torch.set_num_threads(threads)
    world = load_world(world_src)
    device = DeviceModel.load(device_path)
    th = calibrate_tau(world, make_verifier(world), "ciar", {**knobs, "gate": gate}, target, prompts, seed,
                       device_model=device)
    return gate, th


def cascade_point(world, verifier, device, threshold: float | None, prompts: list[str], scenes: list, seed: int,
                  probe) -> dict:
    """EAGLE-2 (`threshold` None: the exact rule) or CASCADE at `threshold` on `prompts` (prompt i with seed
    `seed * 1000003 + i`): probe fidelity against `scenes` and the verification counters per image."""
    from ciar.metrics.probe import attribute_accuracy
    from ciar.models.vq import tensor_to_images

    method, rule = ("eagle", {}) if threshold is None else \
        ("cascade", {"rule": RuleConfig(rule="cascade", cascade_threshold=threshold)})
    d = make_decoder(world, verifier, method, device_model=device, network="none", **rule)
    tokens, total = [], GenerationStats()
    for i, p in enumerate(prompts):
        r = d.generate(p, seed=seed * 1_000_003 + i)
        tokens.append(r.tokens)
        total = total + r.stats
    with torch.no_grad():
        images = tensor_to_images(world.vq.decode_code(torch.stack(tokens))).numpy()
    n = len(prompts)
    return {"fidelity": attribute_accuracy(probe, images, scenes)["attribute_accuracy"],
            "acceptance_rate": total.acceptance_rate, "mean_accepted_length": total.mean_accepted_length,
            "cloud_requests": total.cloud_requests / n, "cloud_forward_passes": total.cloud_forward_passes / n}


def choose_cascade_threshold(fidelity: dict, exact: float, tolerance: float) -> float | None:
    """The lowest threshold (`fidelity`: threshold -> probe fidelity) whose fidelity, and that of every higher
    threshold, is >= `exact` - `tolerance` (so a noisy pass below a failure is not taken); None when the highest
    already fails."""
    chosen = None
    for t in sorted(fidelity, reverse=True):
        if fidelity[t] < exact - tolerance:
            break
        chosen = t
    return chosen


def load_models(world_src, device_path: str) -> tuple:
    """(world, the device model of `device_path`, a verifier): what the CASCADE and policy measurements run on."""
    world = load_world(world_src)
    return world, DeviceModel.load(device_path), make_verifier(world)


def calibrate_cascade(models: tuple, thresholds, tolerance: float, n: int, seed: int) -> dict:
    """Measure EAGLE-2 and CASCADE at each threshold on `n` val prompts and choose (`choose_cascade_threshold`).
    `models`: `load_models`'s. -> {"threshold": chosen or None, "calibration": the record written beside it}."""
    from ciar.data import scenes as S
    from ciar.metrics.probe import load_probe

    world, device, verifier = models
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    labels = [S.scene_at("val", 10_000 + i, seed) for i in range(n)]  # the scenes of `val_prompts(n, seed)`
    prompts = [s.caption for s in labels]
    exact = cascade_point(world, verifier, device, None, prompts, labels, seed, probe)
    print(f"exact rule (EAGLE-2): fidelity {exact['fidelity']:.4f}, acceptance {exact['acceptance_rate']:.3f}",
          file=sys.stderr)
    points = {}
    for t in thresholds:
        points[t] = cascade_point(world, verifier, device, t, prompts, labels, seed, probe)
        print(f"cascade {t:g}: fidelity {points[t]['fidelity']:.4f}, acceptance {points[t]['acceptance_rate']:.3f}, "
              f"requests {points[t]['cloud_requests']:.1f}", file=sys.stderr)
    chosen = choose_cascade_threshold({t: m["fidelity"] for t, m in points.items()}, exact["fidelity"], tolerance)
    return {"threshold": chosen, "calibration": {
        "prompts": f"scenes:val[10000:{10000 + n}]:seed={seed}",
        "criterion": f"the lowest threshold whose probe fidelity, and that of every higher one, is >= the exact "
                     f"rule's (EAGLE-2, same prompts and seeds) - {tolerance:g}",
        "tolerance": tolerance, "exact": exact, "thresholds": {f"{t:g}": m for t, m in points.items()}}}


def measure_policy_rates(models: tuple, n: int, seed: int) -> dict:
    """CIAR at the device file's calibrated point (fixed policy, no network) on `n` val prompts (`models`:
    `load_models`'s) -> {"rates": escalation_rate / accept_first / accept_next, "calibration": the record written
    beside them}."""
    from ciar_device.policy import CostObserver

    world, device, verifier = models
    observer = CostObserver(decay=1.0)  # a plain average over the prompts
    d = make_decoder(world, verifier, "ciar", device_model=device, network="none", policy="fixed")
    d.observers["none"] = observer
    for i, p in enumerate(val_prompts(n, seed)):
        d.generate(p, seed=seed * 1_000_003 + i)
    rates = {"escalation_rate": observer.escalation.observed, "accept_first": observer.accept_first.observed,
             "accept_next": observer.accept_next.observed}
    trials = {"scored_drafts": observer.escalation.trials, "verifications": observer.accept_first.trials,
              "later_drafts": observer.accept_next.trials}
    return {"rates": {k: round(v, 4) for k, v in rates.items() if v is not None},
            "calibration": {"prompts": f"scenes:val[10000:{10000 + n}]:seed={seed}", "trials": trials,
                            "point": {"gate": d.config.gate, "tau": d.config.tau, "span": d.config.span,
                                      "burst": d.config.burst}}}


def in_hub_cache(path: str) -> bool:
    """Whether `path` lies in a Hugging Face cache (a snapshot file, shared by content with its blob)."""
    parts = os.path.realpath(path).split(os.sep) + os.path.abspath(path).split(os.sep)
    return any(p.startswith(("models--", "datasets--")) for p in parts) and bool({"snapshots", "blobs"} & set(parts))


def refuse_hub_cache(p: argparse.ArgumentParser, device: str) -> None:
    """Calibration rewrites the device file's metadata in place: never a file of the Hugging Face cache."""
    if in_hub_cache(device):
        p.error(f"{device} is a file of the Hugging Face cache (an hf:// device): calibration writes its defaults "
                "into the file; copy it out first (python -m pipelines.hub_device pull REF --out FILE) and "
                "calibrate the copy")


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
    p.add_argument("--gates", default=",".join(DEFAULT_GATES),
                   help="gates to calibrate (comma list; 'none': no tau, the file's taus and knobs stay)")
    p.add_argument("--target-rate", type=float, default=None, help="cloud-call rate the taus give (default 0.3)")
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
    p.add_argument("--cascade", action="store_true", help="also choose CASCADE's cosine threshold (scenes world)")
    p.add_argument("--cascade-thresholds", default=",".join(f"{t:g}" for t in CASCADE_THRESHOLDS),
                   help="CASCADE's candidate thresholds (comma list)")
    p.add_argument("--cascade-tolerance", type=float, default=0.01,
                   help="probe fidelity CASCADE may lose against the exact rule on the val prompts")
    p.add_argument("--cascade-prompts", type=int, default=96, help="val prompts CASCADE's threshold is chosen on")
    p.add_argument("--policy-rates", action="store_true", help="also measure the adaptive policy's starting rates "
                   "at the calibrated point (scenes world)")
    p.add_argument("--policy-prompts", type=int, default=48, help="val prompts the policy's rates are measured on")
    p.add_argument("--dry-run", action="store_true", help="print the result, leave the file as it is")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gates = [] if args.gates.strip() == "none" else [g.strip() for g in args.gates.split(",") if g.strip()]
    bad = [g for g in gates if g not in GATES]
    if bad:
        p.error(f"unknown gates {bad}; known: {', '.join(GATES)}")
    if not gates:
        if not (args.cascade or args.policy_rates):
            p.error("--gates none calibrates nothing without --cascade or --policy-rates")
        given = [k for k in ("gate", "burst", "burst_entropy", "span", "target_rate") if getattr(args, k) is not None]
        if given:
            p.error(f"--gates none keeps the file's taus, so it takes none of {given} (the taus hold only for the "
                    f"knobs they were measured at)")
    if args.target_rate is None:
        args.target_rate = 0.3
    if not 0.0 < args.target_rate < 1.0:
        p.error("--target-rate must be in (0, 1)")
    try:
        cascade_grid = [float(t) for t in args.cascade_thresholds.split(",") if t.strip()]
    except ValueError:
        p.error(f"--cascade-thresholds must be a comma list of numbers, got {args.cascade_thresholds!r}")
    if args.cascade and (not cascade_grid or any(not -1.0 <= t <= 1.0 for t in cascade_grid)):
        p.error("--cascade-thresholds must be cosines in [-1, 1]")
    if args.device is not None and not os.path.isfile(args.device):
        p.error(f"device file not found: {args.device}")
    if args.device is not None:
        refuse_hub_cache(p, args.device)
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
    refuse_hub_cache(p, args.device)
    if args.captions:
        from ciar.data.coco import read_coco_captions

        prompts = [r["caption"] for r in read_coco_captions(args.captions, limit=args.prompts)]
        where = f"{args.captions}[:{len(prompts)}]"
    elif isinstance(spec, ScenesWorldSpec):
        prompts = val_prompts(args.prompts, args.seed)
        where = f"scenes:val[10000:{10000 + len(prompts)}]:seed={args.seed}"
    else:
        p.error("a LlamaGen world calibrates on --captions (a COCO-format file of val captions)")
    if args.cascade and not isinstance(spec, ScenesWorldSpec):
        p.error("--cascade measures probe fidelity: the scenes world only")
    if args.policy_rates and not isinstance(spec, ScenesWorldSpec):
        p.error("--policy-rates runs on the scenes world's val prompts only")
    weights = source
    command = "python -m pipelines.calibrate " + " ".join(argv or sys.argv[1:])
    # the knobs not given keep the device file's (a re-calibration changes only what it is told to), else the
    # built-in defaults (ciar.collab.defaults)
    current = CIARDefaults.from_extra(read_model_metadata(args.device)[2], args.device) or CIARDefaults()
    defaults = current
    if gates:
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
        defaults = replace(current, gate=args.gate, taus=taus, burst=args.burst, burst_entropy=args.burst_entropy,
                           span=args.span, target_rate=args.target_rate, calibration={
                               "prompts": where, "measured_rates": rates, "seconds": round(time.time() - t0, 1),
                               "command": command})
    models = load_models(weights, args.device) if args.cascade or args.policy_rates else None  # loaded once
    if args.cascade:
        t0 = time.time()
        chosen = calibrate_cascade(models, cascade_grid, args.cascade_tolerance, args.cascade_prompts, args.seed)
        print(f"cascade: threshold {chosen['threshold']}" if chosen["threshold"] is not None else
              f"cascade: every candidate loses more than {args.cascade_tolerance:g}: none written (the paper's "
              f"{RuleConfig().cascade_threshold} applies)", file=sys.stderr)
        defaults = replace(defaults, cascade_threshold=chosen["threshold"], cascade_calibration={
            **chosen["calibration"], "seconds": round(time.time() - t0, 1), "command": command})
    if args.policy_rates:
        t0 = time.time()
        measured = measure_policy_rates(models, args.policy_prompts, args.seed)
        print(f"policy rates: {measured['rates']}", file=sys.stderr)
        defaults = replace(defaults, policy_rates=measured["rates"], policy_calibration={
            **measured["calibration"], "seconds": round(time.time() - t0, 1), "command": command})
    if args.dry_run:
        print(defaults.to_dict())
        return 0
    update_extra(args.device, {EXTRA_KEY: defaults.to_dict()})
    print(f"{args.device}: ciar defaults {defaults.to_dict()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
