"""Collaborative decoding benchmark: every method side by side on the same prompts and seeds, paper-style tables.

    python -m benchmarks.collab --methods all --num-prompts 200 --network 5g --seed 0 --out runs/collab.json
    python -m benchmarks.collab --captions DIR/captions.json ...        # prompts from a COCO-format export
    python -m benchmarks.collab --world llamagen.yaml --captions captions_val2017.json ...  # a LlamaGen world
    python -m benchmarks.collab --table 2 ...     # gates (U vs entropy / softmax / random) at CIAR's cloud-call rate
    python -m benchmarks.collab --table 3 ...     # discrete top-k set uncertainty (k = 100..400) vs continuous U
    python -m benchmarks.collab --table 8 ...     # 5G / 4G / WiFi: cloud-only, fixed and adaptive CIAR
    python -m benchmarks.collab --sweep tau --values 0.1,0.2,0.3,0.5 ...   # also: rho, span, burst, depth, heads, cascade
    python -m benchmarks.collab --sweep cloud-cost --values 1,2,5,10,20 ...  # speedup vs the cost of a cloud step

Prompts: `--captions FILE` (MS-COCO captions layout, e.g. from `python -m ciar.data.scenes export`; a
`labels.json` and `images/` beside it enable the probe fidelity and FID), or by default the first
`--num-prompts` scenes of the held-out split (seed `--seed`). Prompt i is generated with seed `seed * 1000003 + i`
by every method, and methods are interleaved prompt by prompt so machine-load drift hits all of them alike.

Per method the JSON holds `speedup` (mean end-to-end latency of cloud-only / of the method, both measured in this
run), `steps_compression`, `cloud_call_rate`, `cloud_requests` (per image), `acceptance_rate`,
`mean_accepted_length`, `fidelity` (attribute-probe accuracy), `fid` (scenes FID against the references) and
`latency_s` {device, cloud, comm, total} (per-image means). A Markdown table in the layout of the paper's Table 1
is written next to the JSON (`.md`) and printed.

Thresholds: by default CIAR runs with the device file's calibrated gate, tau and cloud burst
(`python -m pipelines.calibrate`, on val prompts; `ciar.collab.defaults`), and the baseline gates of Table 1 with
their thresholds calibrated there at the same target rate. `--tau` / `--gate` / `--burst` override them;
`--target-rate R` calibrates tau here instead (bisection on `--calib-prompts` val-split prompts, never the
evaluated ones). The JSON records which was used. Table 2/3 gates are calibrated to CIAR's measured cloud-call
rate on the val prompts. CASCADE runs with the device file's cosine threshold (`python -m pipelines.calibrate
--cascade`, chosen on val prompts), else its paper's 0.9; `--cascade-threshold` overrides it.

Cost regimes. Latency is measured compute (device x `--device-slowdown`, cloud x `--cloud-slowdown`) plus the
network model; that is the headline. Two derived views are computed from the same run's counters, no re-run:
`speedup_paper_profile` re-prices every image with the paper's Table 8 simulation (`PAPER_PROFILE`: its cloud cost
per sequential cloud step, its device cost per device step, our network model with its Table 9 links) and is
labelled a simulation wherever it is printed; `--sweep cloud-cost --values F,...` re-prices cloud compute at F x
measured and reports the speedup against the ratio of one cloud step to one round trip, where CIAR crosses
cloud-only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from ciar.training.calibration import bisect_threshold, calibrate_tau, cloud_rate  # noqa: F401 (re-exported)
from ciar.sim.decoder import METHODS
from ciar.collab.defaults import CIARDefaults
from ciar.collab.device import DeviceModel
from ciar.collab.protocol import RuleConfig
from ciar.sim.runtime import RUNTIMES, device_runtime, make_decoder, make_verifier
from ciar.collab.stats import GenerationStats, methods_markdown, summarize_method
from ciar.data import scenes
from ciar.results import write_results
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args


@dataclass
class PromptSet:
    captions: list[str]
    scenes: list | None  # Scene records (probe fidelity) or None
    references: np.ndarray | None  # uint8 [n, H, W, 3] (FID) or None
    source: str


def load_prompts(captions: str | None, n: int, seed: int, split: str = "heldout") -> PromptSet:
    if not captions:
        refs, sc = scenes.batch(split, 0, n, seed)
        return PromptSet([s.caption for s in sc], sc, refs, f"scenes:{split}:seed={seed}")
    from PIL import Image

    from ciar.data.coco import CaptionsError, read_coco_captions

    try:
        anns = read_coco_captions(captions, limit=n)  # the first caption of each image, as pipelines.evaluate
    except CaptionsError as e:
        raise SystemExit(f"error: {e}") from None
    root = os.path.dirname(os.path.abspath(captions))
    labels_path = os.path.join(root, "labels.json")
    sc = refs = None
    if os.path.isfile(labels_path):
        labels = json.load(open(labels_path))
        sc = [scenes.Scene.from_labels(labels[str(a["image_id"])]) for a in anns]
        refs = np.stack([np.asarray(Image.open(os.path.join(root, "images", a["file_name"])).convert("RGB"))
                         for a in anns])
    return PromptSet([a["caption"] for a in anns], sc, refs, captions)


def calibration_prompts(spec, captions: str | None, n_eval: int, n: int, seed: int) -> list[str]:
    """Prompts a threshold may be calibrated on, never the evaluated ones: the scenes val split, or (another world)
    the captions file's annotations after the first `n_eval`."""
    if isinstance(spec, ScenesWorldSpec):
        return [s.caption for s in scenes.batch("val", 10_000, n, seed)[1]]
    from ciar.data.coco import read_coco_captions

    return [r["caption"] for r in read_coco_captions(captions, limit=n, offset=n_eval)]


def run_variants(world, verifier, variants: dict, prompts: list[str], seed: int, desc: str = "generate",
                 done: dict | None = None, on_prompt=None, runtimes: dict | None = None):
    """variants: name -> (method, overrides dict, device model or None). Interleaved over prompts. `runtimes`:
    name -> what runs that variant's device model ("torch" when not named; `ciar.sim.runtime.RUNTIMES`).
    `done` ({name: ([tokens], [GenerationStats])} of the first prompts, e.g. a checkpoint) resumes after them;
    `on_prompt(i, done)` is called after prompt i with everything so far (to checkpoint it).
    -> {name: (tokens [n, N] int64, [GenerationStats])}."""
    runtimes = runtimes or {}

    def runtime(name, method, dev):
        kind = runtimes.get(name, "torch")
        if method == "cloud" or kind == "torch":
            return None
        if dev is not None:
            raise SystemExit(f"{name}: the {kind} runtime runs the world's exported device model only")
        return device_runtime(kind, world.device_model, world.weights_dir, world.device_file)

    decoders = {name: make_decoder(world, verifier, m, device_model=dev, runtime=runtime(name, m, dev), **ov)
                for name, (m, ov, dev) in variants.items()}
    warm = prompts[0]
    for d in decoders.values():  # first-call overheads out of the measurement
        d.generate(warm, seed=10 ** 9)
    out = done or {name: ([], []) for name in variants}
    start = len(next(iter(out.values()))[0])
    for i in tqdm(range(start, len(prompts)), desc=desc, dynamic_ncols=True, initial=start, total=len(prompts)):
        for name, d in decoders.items():
            r = d.generate(prompts[i], seed=seed * 1_000_003 + i)
            out[name][0].append(r.tokens)
            out[name][1].append(r.stats)
        if on_prompt is not None:
            on_prompt(i, out)
    return {name: (torch.stack(t), s) for name, (t, s) in out.items()}


# The paper's Table 8 simulation (LlamaGen-XL, 256 tokens), read off its own figures: CIAR on 5G spends 5102.6 ms
# of cloud compute at x3.00 steps compression (256 / 3.00 = 85.3 sequential cloud steps -> 59.8 ms per step) and
# 13.54 ms of device compute for ~178 locally decided tokens (69.6 % of 256 -> 0.076 ms per device step); the
# links are its Table 9 (our network profiles). A simulation: labelled so wherever it is reported.
PAPER_PROFILE = {"cloud_step_s": 5.1026 / (256 / 3.00), "device_step_s": 13.54e-3 / (0.6956 * 256)}


def priced(total: GenerationStats, n: int, profile: dict) -> float:
    """Mean per-image latency of `total` (n images) re-priced with a per-step cost profile (comm as measured)."""
    return (total.cloud_forward_passes * profile["cloud_step_s"] + total.device_forward_passes
            * profile["device_step_s"] + total.comm_s) / n


def cloud_cost_sweep(results: dict, factors: list[float], network: str) -> list[dict]:
    """Re-price one run's cloud compute at F x measured for each F (device and comm as measured): per F, the cost
    of one cloud step (cloud-only's mean cloud seconds per sequential step x F), its ratio to one round trip of
    `network` (two transmissions' RTT), and each method's speedup over cloud-only at that price."""
    from ciar.sim.network import get_profile

    rtt = 2 * get_profile(network).rtt_ms / 1000.0
    tot = {name: (sum(st, GenerationStats()), len(st)) for name, (_, st) in results.items()}
    base, n_base = tot["cloud"]
    step_s = base.cloud_s / max(base.cloud_forward_passes, 1)
    out = []
    for f in factors:
        lat = {name: (t.device_s + f * t.cloud_s + t.comm_s) / n for name, (t, n) in tot.items()}
        out.append({"cloud_cost_factor": f, "cloud_step_ms": 1000 * f * step_s,
                    "cloud_step_over_round_trip": f * step_s / rtt if rtt else None,
                    "speedup": {name: lat["cloud"] / v for name, v in lat.items() if name != "cloud"}})
    return out


def cloud_cost_markdown(sweep: list[dict]) -> str:
    names = list(sweep[0]["speedup"]) if sweep else []
    lines = ["### Speedup over cloud-only vs the cost of a cloud step (re-priced from one run)\n",
             "| cloud step x | cloud step (ms) | step / round trip | " + " | ".join(names) + " |\n",
             "|---|---|---|" + "---|" * len(names) + "\n"]
    for r in sweep:
        ratio = "–" if r["cloud_step_over_round_trip"] is None else f"{r['cloud_step_over_round_trip']:.2f}"
        lines.append(f"| {r['cloud_cost_factor']:g} | {r['cloud_step_ms']:.2f} | {ratio} | "
                     + " | ".join(f"x{r['speedup'][n]:.2f}" for n in names) + " |\n")
    return "".join(lines)


def decode_images(world, tokens: torch.Tensor) -> np.ndarray:
    """tokens [n, N] -> images [n, H, W, 3] uint8 (the world's VQ decoder, 64 at a time)."""
    from ciar.models.vq import tensor_to_images

    imgs = []
    with torch.no_grad():
        for s in range(0, len(tokens), 64):
            imgs.append(tensor_to_images(world.vq.decode_code(tokens[s:s + 64])))
    return torch.cat(imgs).numpy()


def quality(world, tokens: torch.Tensor, ps: PromptSet, probe, fid_net) -> dict:
    from ciar.metrics.fid import fid_between
    from ciar.metrics.probe import attribute_accuracy

    images = decode_images(world, tokens)
    out = {"fidelity": None, "fid": None}
    if ps.scenes is not None and probe is not None:
        out["fidelity"] = attribute_accuracy(probe, images, ps.scenes)["attribute_accuracy"]
    if ps.references is not None and fid_net is not None:
        out["fid"] = fid_between(fid_net, ps.references, images)
    return out


def fidelity_checks(world, tokens: torch.Tensor, ps: PromptSet, probe) -> tuple[np.ndarray, np.ndarray]:
    """Per image (prompt): the probe's checks right and made (`ciar.metrics.probe.checks_per_image`); their sums'
    ratio is the row's fidelity."""
    from ciar.metrics.probe import checks_per_image, predict, scene_targets

    right, made = checks_per_image(predict(probe, decode_images(world, tokens)), scene_targets(ps.scenes))
    return np.asarray(right), np.asarray(made)


def ci_text(ci: dict | None) -> str:
    """A `paired_fidelity_ci` as a table cell: "+0.004 [-0.017, +0.026]" ("–" for the baseline itself)."""
    return "–" if ci is None else f"{ci['diff']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]"


def paired_fidelity_ci(base: tuple, other: tuple, n_boot: int = 2000, seed: int = 0,
                       level: float = 0.95) -> dict:
    """`other`'s fidelity minus `base`'s on the same prompts and seeds (each a `fidelity_checks` pair), with a
    paired bootstrap interval over the prompts (`n_boot` resamples, seeded): a difference whose interval holds 0 is
    within the prompts' noise. -> {"diff", "lo", "hi"} in fidelity units."""
    (rb, mb), (ro, mo) = base, other
    if len(rb) != len(ro):
        raise ValueError(f"paired comparison of {len(rb)} and {len(ro)} prompts")
    diff = ro.sum() / mo.sum() - rb.sum() / mb.sum()
    idx = np.random.default_rng(seed).integers(0, len(rb), (n_boot, len(rb)))
    boot = ro[idx].sum(1) / mo[idx].sum(1) - rb[idx].sum(1) / mb[idx].sum(1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return {"diff": float(diff), "lo": float(lo), "hi": float(hi)}


def summarize(results: dict, base: str, world, ps: PromptSet, probe, fid_net) -> dict:
    """`ciar.collab.stats.summarize_method` per variant, plus the paper-profile pricing and the quality columns."""
    rows = {}
    base_total = np.mean([s.total_s for s in results[base][1]]) if base in results else None
    base_paper = priced(sum(results[base][1], GenerationStats()), len(results[base][1]), PAPER_PROFILE) \
        if base in results else None
    for name, (tokens, stats) in results.items():
        paper = priced(sum(stats, GenerationStats()), len(stats), PAPER_PROFILE)
        rows[name] = {**summarize_method(stats, base_total),
                      "speedup_paper_profile": (base_paper / paper) if base_paper else None,
                      "latency_paper_profile_s": paper, **quality(world, tokens, ps, probe, fid_net)}
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collab", description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="all", help=f"comma list of {','.join(METHODS)} or 'all'")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--captions", default=None, help="COCO captions.json (default: held-out scenes)")
    p.add_argument("--network", default="5g")
    p.add_argument("--seed", type=int, default=0)
    add_world_arguments(p)
    p.add_argument("--tau", type=float, default=None,
                   help="CIAR threshold on its gate's scale (default: the device file's calibrated one)")
    p.add_argument("--gate", default=None, help="CIAR's gate (default: the device file's calibrated gate)")
    p.add_argument("--burst", type=int, default=None, help="cloud burst g (default: the device file's)")
    p.add_argument("--target-rate", type=float, default=None, help="calibrate CIAR's tau to this cloud-call rate")
    p.add_argument("--span", type=int, default=None)
    p.add_argument("--policy", choices=["adaptive", "fixed"], default=None,
                   help="CIAR's operating point (default: the knob's, adaptive; Tables 2/3 and 8 set their own)")
    p.add_argument("--cascade-threshold", type=float, default=None,
                   help="CASCADE's cosine threshold (default: the device file's, else the paper's 0.9)")
    p.add_argument("--prefix-rate", type=float, default=None)
    p.add_argument("--device-slowdown", type=float, default=1.0)
    p.add_argument("--cloud-slowdown", type=float, default=1.0,
                   help="multiply measured cloud compute (emulate a larger cloud model; 1 = as measured)")
    p.add_argument("--calib-prompts", type=int, default=16)
    p.add_argument("--table", type=int, choices=[1, 2, 3, 8], default=1)
    p.add_argument("--sweep", choices=["tau", "rho", "span", "burst", "depth", "heads", "cascade", "cloud-cost"],
                   default=None,
                   help="cascade: CASCADE's cosine-similarity threshold (RuleConfig.cascade_threshold)")
    p.add_argument("--values", default=None, help="comma list for --sweep (depth: layer counts; heads: counts)")
    p.add_argument("--combine", default="ensemble", choices=["ensemble", "voting"], help="for --sweep heads")
    p.add_argument("--no-inter-enhance-ablation", action="store_true",
                   help="table 1: skip the 'ciar w/o Inter-Enhance' row")
    p.add_argument("--costs", default="measured,paper",
                   help="table 8: cloud cost regimes (measured: this box's; paper: the paper's LlamaGen-XL step)")
    p.add_argument("--loads", default="idle,saturated", help="table 8: verifier loads (saturated: x --saturation)")
    p.add_argument("--saturation", type=float, default=SATURATION_FACTOR,
                   help="table 8: a saturated verifier's step as a factor on an idle one's (default: the capacity "
                        "run's, %(default).2f)")
    p.add_argument("--device-runtime", default="torch",
                   help=f"what runs the device models: {' or '.join(RUNTIMES)} (onnx: the export real phones run, "
                        f"<weights>/onnx); table 8 takes both, 'torch,onnx', side by side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p


@dataclass
class Run:
    """What every variant of one benchmark run shares: the world, its verifier, the prompts (evaluated and
    calibration), the knobs every method gets (`common`: network, slowdowns, span) and CIAR's (`ciar`: those plus
    its gate, tau, burst, prefix rate), and the report being written."""

    args: argparse.Namespace
    world: object
    verifier: object
    prompts: PromptSet
    calib: list[str]
    common: dict
    ciar: dict
    report: dict
    runtimes: tuple = ("torch",)  # --device-runtime: what runs the device models
    runtime_of: dict = field(default_factory=dict)  # variant name -> its runtime (the run's only one when not named)


def ciar_knobs(args, world, verifier, calib: list[str], report: dict) -> tuple[dict, dict]:
    """-> (the knobs every method gets, CIAR's knobs); records how CIAR's threshold was chosen in `report`."""
    common = {"network": args.network, "device_slowdown": args.device_slowdown, "cloud_slowdown": args.cloud_slowdown}
    if args.span:
        common["span"] = args.span
    ciar_ov = dict(common)
    if args.prefix_rate is not None:
        ciar_ov["prefix_rate"] = args.prefix_rate
    if args.gate is not None:
        ciar_ov["gate"] = args.gate
    if args.burst is not None:
        ciar_ov["burst"] = args.burst
    if args.policy is not None:
        ciar_ov["policy"] = args.policy
    defaults = world.device_model.ciar_defaults
    if args.target_rate is not None:
        report["ciar_threshold"] = calibrate_tau(world, verifier, "ciar", ciar_ov, args.target_rate, calib, args.seed)
        ciar_ov["tau"] = report["ciar_threshold"]["tau"]
    elif args.tau is not None:
        ciar_ov["tau"] = args.tau
        report["ciar_threshold"] = {"tau": ciar_ov["tau"], "mode": "raw"}
    else:
        try:
            resolved = make_decoder(world, verifier, "ciar", **ciar_ov).config
        except ValueError as e:
            raise SystemExit(f"{e} (or give --tau / --target-rate)") from None
        report["ciar_threshold"] = {"tau": resolved.tau, "gate": resolved.gate, "burst": resolved.burst,
                                    "mode": "device file (python -m pipelines.calibrate on val prompts)",
                                    "calibration": defaults.calibration if defaults else None}
    return common, ciar_ov


def cascade_rule(args, world, report: dict) -> RuleConfig:
    """CASCADE's acceptance rule: `--cascade-threshold`, else the device file's threshold (chosen on val prompts),
    else the paper's; records which in `report`."""
    defaults = world.device_model.ciar_defaults or CIARDefaults()
    threshold = defaults.cascade_threshold_or(args.cascade_threshold)
    report["cascade_threshold"] = {
        "threshold": threshold,
        "mode": "raw" if args.cascade_threshold is not None else
        "device file (python -m pipelines.calibrate --cascade on val prompts)" if defaults.cascade_threshold
        is not None else "the paper's (the device file has none)",
        "calibration": defaults.cascade_calibration or None}
    return RuleConfig(rule="cascade", cascade_threshold=threshold)


def sweep_variants(run: Run, values: list[str]) -> dict:
    """--sweep: one CIAR (or CASCADE) variant per value, beside cloud-only (cloud-cost: CIAR, EAGLE, LANTERN once,
    re-priced afterwards)."""
    args, common, ciar_ov, world = run.args, run.common, run.ciar, run.world
    variants: dict = {"cloud": ("cloud", dict(common), None)}
    if args.sweep == "cloud-cost":
        return {**variants, "ciar": ("ciar", dict(ciar_ov), None), "eagle": ("eagle", dict(common), None),
                "lantern": ("lantern", dict(common), None)}
    for v in values:
        if args.sweep == "cascade":
            variants[f"cascade threshold={v}"] = ("cascade", {**common, "rule": RuleConfig(
                rule="cascade", cascade_threshold=float(v))}, None)
        elif args.sweep in ("tau", "rho", "span", "burst"):
            key = {"tau": "tau", "rho": "prefix_rate", "span": "span", "burst": "burst"}[args.sweep]
            val = int(v) if key in ("span", "burst") else float(v)
            variants[f"ciar {args.sweep}={v}"] = ("ciar", {**ciar_ov, key: val}, None)
        else:
            name = f"device_l{v}" if args.sweep == "depth" else f"device_h{v}_{args.combine}"
            path = os.path.join(world.weights_dir, f"{name}.safetensors")
            dc = world.device_model.device_config
            if int(v) == (dc.n_layer if args.sweep == "depth" else dc.num_heads) and not os.path.isfile(path):
                # the shipped device model (device.safetensors) is this point of the sweep
                variants[f"ciar {args.sweep}={v}"] = ("ciar", dict(ciar_ov), None)
                continue
            if not os.path.isfile(path):
                raise SystemExit(f"missing {path}: train it with `python -m pipelines.train_device --name {name} "
                                 + ("--n-layer " + v if args.sweep == "depth" else f"--num-heads {v} --combine "
                                    f"{args.combine}") + "`")
            variants[f"ciar {args.sweep}={v}"] = ("ciar", dict(ciar_ov), DeviceModel.load(path))
    return variants


def table1_variants(run: Run, methods: list[str]) -> dict:
    """Table 1: every method; the baseline gates calibrated to CIAR's target rate when one is given; CIAR's
    ablations (w/o Inter-Enhance, no burst, the paper's U gate)."""
    args, common, ciar_ov, world, verifier = run.args, run.common, run.ciar, run.world, run.verifier
    variants: dict = {"cloud": ("cloud", dict(common), None)}
    run.report["gate_thresholds"] = {}
    for m in methods:
        if m == "cloud":
            continue
        if m in ("entropy", "softmax", "random", "topk"):
            # each gate has its own score scale: calibrated to the same target cloud-call rate as CIAR (never
            # CIAR's tau); without --target-rate, the method's preset threshold
            ov = {k: v for k, v in ciar_ov.items() if k not in ("tau", "gate")}
            if args.target_rate is not None:
                th = calibrate_tau(world, verifier, m, ov, args.target_rate, run.calib, args.seed)
                run.report["gate_thresholds"][m] = th
                ov["tau"] = th["tau"]
        else:
            ov = dict(ciar_ov) if m == "ciar" else dict(common)
        if m == "cascade":
            ov["rule"] = cascade_rule(args, world, run.report)
        variants[m] = (m, ov, None)
    if "ciar" in methods and not args.no_inter_enhance_ablation:
        variants["ciar w/o Inter-Enhance"] = ("ciar", {**ciar_ov, "inter_enhance": False}, None)
    if "ciar" in methods:
        resolved = make_decoder(world, verifier, "ciar", **ciar_ov).config
        if resolved.burst:  # the paper's CIAR: the same gate and threshold, no cloud burst
            variants["ciar g=0 (no burst)"] = ("ciar", {**ciar_ov, "burst": 0}, None)
        if resolved.gate != "interval" and "tau" not in ciar_ov:  # the paper's U at its own calibrated tau
            variants["ciar gate=interval (paper U)"] = ("ciar", {**ciar_ov, "gate": "interval"}, None)
    return variants


def gate_table_variants(run: Run, table: int) -> dict:
    """Tables 2 and 3: other gates (2) or discrete top-k sets (3), each calibrated to CIAR's own cloud-call rate on
    the calibration prompts."""
    args, world, verifier = run.args, run.world, run.verifier
    ciar_ov = {**run.ciar, "policy": "fixed"}  # gates compared at the calibrated point: the threshold decides
    variants: dict = {"cloud": ("cloud", dict(run.common), None)}
    rate = cloud_rate(world, verifier, "ciar", ciar_ov, run.calib, args.seed)
    run.report["ciar_calibration_rate"] = rate
    variants["ciar"] = ("ciar", ciar_ov, None)
    own = make_decoder(world, verifier, "ciar", **ciar_ov).config.gate
    gates = [("random", {}), ("entropy", {}), ("softmax", {})] + \
        [("ciar", {"gate": g}) for g in ("interval", "lower") if g != own] if table == 2 else \
        [("topk", {"topk": k}) for k in (100, 200, 300, 400)]
    run.report["gate_thresholds"] = {}
    for g, extra in gates:
        name = {"topk": f"topk k={extra.get('topk')}", "ciar": f"ciar gate={extra.get('gate')}"}.get(g, g)
        ov = {k: v for k, v in {**{k: v for k, v in ciar_ov.items() if k != "gate"}, **extra}.items()
              if k != "tau"}
        th = calibrate_tau(world, verifier, g, ov, rate, run.calib, args.seed)
        run.report["gate_thresholds"][name] = th
        variants[name] = (g, {**ov, "tau": th["tau"]}, None)
    return variants


NETWORKS = ("5g", "wifi", "4g")
TABLE8_METHODS = {"cloud": ("cloud", {}), "ciar": ("ciar", {"policy": "fixed"}),
                  "ciar adaptive": ("ciar", {"policy": "adaptive"})}
# a saturated verifier, as a factor on its step: the capacity run's saturation point (benchmarks/results/2026-11-25/
# capacity: cloud-only images at 32 phones take 5.00 s against 0.645 s at one phone, 144 sequential steps each)
SATURATION_FACTOR = (32 / 6.398) / (1 / 1.549)


@dataclass(frozen=True)
class Regime:
    """One cost regime of Table 8: the cloud's step (`costs`: as measured, or the paper's profile) times a verifier
    load (`load`: idle 1, saturated `--saturation`). `cloud_factor` multiplies the measured cloud seconds (the
    decoders' `cloud_slowdown`), so an adaptive device observes the regime's costs as it would on such a system."""

    costs: str
    load: str
    cloud_factor: float
    load_factor: float

    @property
    def name(self) -> str:
        return f"{self.costs} {self.load}"


def measured_cloud_step_s(world, verifier, prompt: str, n: int = 3) -> float:
    """The median of `n` cloud-only images' cloud seconds per sequential forward on this box, now."""
    d = make_decoder(world, verifier, "cloud", network="none")
    per = []
    for i in range(n):
        st = d.generate(prompt, seed=10 ** 9 + i).stats
        per.append(st.cloud_s / max(1, st.cloud_forward_passes))
    return float(np.median(per))


def table8_regimes(run: Run) -> list[Regime]:
    """`--costs` x `--loads` (measured / paper x idle / saturated); the paper's cloud step is reached by a factor
    on the measured one (recorded in the report)."""
    args = run.args
    costs, loads = args.costs.split(","), args.loads.split(",")
    factor = {"measured": 1.0}
    if "paper" in costs:
        step = measured_cloud_step_s(run.world, run.verifier, run.prompts.captions[0])
        factor["paper"] = PAPER_PROFILE["cloud_step_s"] / step
        run.report["paper_cloud_factor"] = {"measured_cloud_step_s": step, "factor": factor["paper"]}
    load = {"idle": 1.0, "saturated": args.saturation}
    run.report["regimes"] = {"costs": costs, "loads": loads, "saturation_factor": args.saturation}
    return [Regime(c, l, factor[c] * load[l] * args.cloud_slowdown, load[l]) for c in costs for l in loads]


def table8_methods(run: Run) -> dict:
    """Table 8's methods: label -> (method, knobs, device runtime); with several `--device-runtime`s each CIAR row
    once per runtime ("ciar [onnx]")."""
    several = len(run.runtimes) > 1
    out = {}
    for label, (method, knobs) in TABLE8_METHODS.items():
        for kind in (["torch"] if method == "cloud" else run.runtimes):
            out[f"{label} [{kind}]" if several and method != "cloud" else label] = (method, knobs, kind)
    return out


def network_variants(run: Run) -> dict:
    """Table 8: cloud-only, CIAR at its fixed (calibrated) point and CIAR with the adaptive policy on each link, in
    each cost regime (`table8_regimes`), on each device runtime."""
    variants: dict = {}
    regimes = table8_regimes(run)
    run.report["table8_regimes"] = {r.name: r.__dict__ for r in regimes}  # in order
    for regime in regimes:
        for net in NETWORKS:
            for label, (method, knobs, kind) in table8_methods(run).items():
                base = run.common if method == "cloud" else run.ciar
                name = f"{label} | {net} | {regime.name}"
                variants[name] = (method, {**base, **knobs, "network": net, "cloud_slowdown": regime.cloud_factor},
                                  None)
                run.runtime_of[name] = kind
    return variants


def table8_rows(run: Run, results: dict, quality_of) -> tuple[dict, str]:
    """Per link and regime, each method's seconds per image (measured: the run's accounted time with the regime's
    cloud factor; paper: the paper's per-step profile x the load, `priced`), speedup over cloud-only, fidelity, FID,
    cloud-call rate, requests, and the share of images the adaptive policy gave to the cloud whole or ran at another
    point than the calibrated one. -> (rows, Markdown)."""
    rows: dict = {}
    lines = ["### Table 8 — cloud-only, fixed CIAR and adaptive CIAR by link, cloud cost and verifier load\n",
             "Seconds per image: measured compute (x the regime's cloud factor) + the network model; the paper "
             "regime re-prices every step with the paper's LlamaGen-XL profile x the load (a simulation).\n",
             "| link | cloud cost | verifier | method | s / image | speedup | fidelity | FID | cloud call | requests "
             "| to the cloud | adapted |\n", "|---|---|---|---|---|---|---|---|---|---|---|---|\n"]
    for name, regime in run.report["table8_regimes"].items():
        costs, load, load_factor = regime["costs"], regime["load"], regime["load_factor"]
        profile = {"cloud_step_s": PAPER_PROFILE["cloud_step_s"] * load_factor,
                   "device_step_s": PAPER_PROFILE["device_step_s"]}
        for net in NETWORKS:
            cell = {label: results[f"{label} | {net} | {name}"] for label in table8_methods(run)
                    if f"{label} | {net} | {name}" in results}
            seconds = {label: (priced(sum(st, GenerationStats()), len(st), profile) if costs == "paper"
                               else float(np.mean([x.total_s for x in st]))) for label, (_, st) in cell.items()}
            for label, (tokens, st) in cell.items():
                total, n = sum(st, GenerationStats()), len(st)
                row = {**summarize_method(st, None), **quality_of(tokens), "link": net, "costs": costs, "load": load,
                       "seconds_per_image": seconds[label], "speedup": seconds["cloud"] / seconds[label],
                       "handovers": total.handovers / n, "adapted": total.adapted / n}
                rows[f"{label} | {net} | {name}"] = row
                fid = "–" if row["fid"] is None else f"{row['fid']:.2f}"
                fidelity = "–" if row["fidelity"] is None else f"{row['fidelity']:.3f}"
                lines.append(f"| {net} | {costs} | {load} | {label} | {row['seconds_per_image']:.3f} | "
                             f"x{row['speedup']:.2f} | {fidelity} | {fid} | {row['cloud_call_rate']:.3f} | "
                             f"{row['cloud_requests']:.1f} | {row['handovers']:.2f} | {row['adapted']:.1f} |\n")
    return rows, "".join(lines)


def build_variants(run: Run, fail) -> tuple[dict, str]:
    """-> ({name: (method, knobs, device model or None)}, the table's title) for the run's table or sweep;
    `fail(message)` reports a bad command line."""
    args = run.args
    if args.sweep:
        values = [v for v in (args.values or "").split(",") if v]
        if not values:
            fail("--sweep needs --values")
        return sweep_variants(run, values), f"Sweep of {args.sweep}"
    if args.table == 1:
        methods = METHODS if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            fail(f"unknown methods {bad}; known: {', '.join(METHODS)}")
        return table1_variants(run, methods), \
            f"Table 1 — methods side by side ({args.network}, {len(run.prompts.captions)} prompts)"
    if args.table in (2, 3):
        return gate_table_variants(run, args.table), ("Table 2 — gating at CIAR's cloud-call rate" if args.table == 2
                                                      else "Table 3 — discrete top-k set vs continuous interval")
    return network_variants(run), "Table 8 — latency breakdown by network"


def score(run: Run, spec, results: dict) -> tuple[dict, str]:
    """Each variant's row (`summarize`, against cloud-only on the same link), and the cloud-cost re-pricing where
    the run asks for it. -> (rows, extra Markdown)."""
    from ciar.metrics.fid import make_fid
    from ciar.metrics.probe import load_probe

    args, world, ps = run.args, run.world, run.prompts
    scenes_world = isinstance(spec, ScenesWorldSpec)  # the probe and FID features belong to the scenes world
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors")) \
        if ps.scenes is not None and scenes_world else None
    fid_net = make_fid("scenes", os.path.join(world.weights_dir, "fid_features.safetensors")) \
        if ps.references is not None and scenes_world else None
    if args.sweep == "cloud-cost" or (args.table == 1 and not args.sweep):
        rows = summarize(results, "cloud", world, ps, probe, fid_net)
        factors = [float(v) for v in args.values.split(",") if v] if args.sweep else [1, 2, 5, 10, 20, 50]
        run.report["cloud_cost_sweep"] = cloud_cost_sweep(results, factors, args.network)
        return rows, cloud_cost_markdown(run.report["cloud_cost_sweep"])
    if args.table == 8 and not args.sweep:
        return table8_rows(run, results, lambda tokens: quality(world, tokens, ps, probe, fid_net))
    return summarize(results, "cloud", world, ps, probe, fid_net), ""


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.num_prompts <= 0:
        p.error("--num-prompts must be positive")
    try:
        spec = read_world(world_from_args(args), need_device=True, need_text=True)
    except WorldSpecError as e:
        raise SystemExit(f"error: {e}") from None
    if not isinstance(spec, ScenesWorldSpec) and not args.captions:
        raise SystemExit("error: a LlamaGen world needs --captions (a COCO-format captions file)")

    world = load_world(spec)
    verifier = make_verifier(world)
    ps = load_prompts(args.captions, args.num_prompts, args.seed)
    calib = calibration_prompts(spec, args.captions, args.num_prompts, args.calib_prompts, args.seed)
    report: dict = {"prompts": ps.source, "num_prompts": len(ps.captions), "seed": args.seed,
                    "network": args.network, "device_slowdown": args.device_slowdown,
                    "cloud_slowdown": args.cloud_slowdown, "sampling": world.sampling.to_dict(),
                    "weights": world.weights_dir}
    t0 = time.time()
    common, ciar_ov = ciar_knobs(args, world, verifier, calib, report)
    runtimes = tuple(k.strip() for k in args.device_runtime.split(",") if k.strip())
    if not runtimes or any(k not in RUNTIMES for k in runtimes) or len(set(runtimes)) < len(runtimes):
        p.error(f"--device-runtime: one or more of {', '.join(RUNTIMES)}, got {args.device_runtime!r}")
    if len(runtimes) > 1 and (args.table != 8 or args.sweep):
        p.error("--device-runtime with several runtimes needs --table 8")
    report["device_runtimes"] = list(runtimes)
    run = Run(args, world, verifier, ps, calib, common, ciar_ov, report, runtimes)
    variants, title = build_variants(run, p.error)
    runtime_of = {name: run.runtime_of.get(name, runtimes[0]) for name in variants}
    results = run_variants(world, verifier, variants, ps.captions, args.seed, runtimes=runtime_of)
    rows, md_extra = score(run, spec, results)
    report["methods"] = rows
    report["configs"] = {name: make_decoder(world, verifier, m, device_model=dev, **ov).config.to_dict()
                         for name, (m, ov, dev) in variants.items()}
    report["seconds"] = time.time() - t0
    table8 = args.table == 8 and not args.sweep  # its own grid (table8_rows)
    md = md_extra if table8 else methods_markdown(rows, title) + ("\n" + md_extra if md_extra else "")
    write_results(args.out, report, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
