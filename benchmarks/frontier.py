"""The quality-speed frontier: every method's knob swept, side by side on the same held-out prompts and seeds.

    python -m benchmarks.frontier --num-prompts 200 --out benchmarks/results/2026-11-25e/frontier.json
    python -m benchmarks.frontier --methods ciar,code --num-prompts 20 --out runs/frontier.json      # some lines
    python -m benchmarks.frontier --line "adaptive ciar=ciar:tau=6,7.375,9:policy=adaptive" ...       # an extra line

Lines (`--methods`, default all of `LINES`), each around its calibrated or published point:
  ciar     CIAR (the device file's gate), its tau at `TAU_SCALES` x the calibrated one;
  entropy  the entropy gate, its tau at `TAU_SCALES` x its calibrated one;
  code     CoDe, its cloud fraction (the cloud makes the first `prefix_rate` of the tokens);
  lantern  LANTERN, its total-variation budget delta;
  cascade  CASCADE, its cosine threshold (the device file's calibrated one, `python -m pipelines.calibrate --cascade`,
           among them when the file has one; 0.9, the paper's, relaxes nothing on the scenes world: it is EAGLE-2).
`--line "LABEL=METHOD:KNOB=V1,V2[:KNOB=V...]"` adds a line (repeatable): METHOD with KNOB swept, the other knobs
fixed; KNOB is a `CollabConfig` field (`ciar.collab.knobs`) or `rule.<field>` of the method's acceptance rule
(`RuleConfig`), and a field the decoder gains later (e.g. an adaptive policy) works without changing this module.
`--values LINE=V1,V2` replaces a line's values.

Every point and cloud-only run prompt by prompt, interleaved (`benchmarks.collab.run_variants`; prompt i with seed
`seed * 1000003 + i`), on one link (`--network`, 5G by default). Per point: probe fidelity, FID, speedup over
cloud-only at measured compute and under the paper's cost profile (`benchmarks.collab.PAPER_PROFILE`, a
simulation), cloud-call rate. `--checkpoint` saves the tokens and stats every `--checkpoint-every` prompts and a
re-run of the same command resumes from it.

The answer (`equal_fidelity` in the JSON, the last table of the .md): per line, its fastest point whose fidelity is
within `--tolerance` (1 point) of cloud-only's, by each cost regime. Writes the JSON, a Markdown table beside it
(.md) and the plot (.png: fidelity against speedup, one line per method, measured and paper profile side by side).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import torch

from benchmarks.collab import fidelity_checks, load_prompts, paired_fidelity_ci, run_variants, summarize
from ciar.collab.knobs import KNOBS
from ciar.collab.names import METHODS
from ciar.collab.protocol import RuleConfig
from ciar.sim.runtime import make_decoder, make_verifier
from ciar.results import write_results
from ciar.world import load_world
from ciar.world_spec import ScenesWorldSpec, WorldSpecError, add_world_arguments, read_world, world_from_args

TAU_SCALES = (0.8, 1.0, 1.2, 1.4, 1.7)  # a gate's swept taus, x its calibrated one (higher: fewer cloud calls)
CASCADE_THRESHOLDS = (0.6, 0.5, 0.4, 0.3, 0.2)  # the scenes cloud's output rows: no two have cosine above 0.72


@dataclass(frozen=True)
class Line:
    """One line of the frontier: `method` with `knob` at each of `values` and the knobs in `fixed`. `knob` is a
    `CollabConfig` field or `rule.<field>` of the method's acceptance rule."""

    label: str
    method: str
    knob: str
    values: tuple
    fixed: dict = field(default_factory=dict)

    def point_name(self, value) -> str:
        return f"{self.label} {self.knob.removeprefix('rule.')}={value:g}" if isinstance(value, float) \
            else f"{self.label} {self.knob.removeprefix('rule.')}={value}"

    def overrides(self, value, common: dict) -> dict:
        """The method's knobs at one point: `common` (link, slowdowns), `fixed`, and the swept knob."""
        out = {**common, **self.fixed}
        if self.knob.startswith("rule."):
            rule = make_rule(self.method, **{self.knob.removeprefix("rule."): value})
            out["rule"] = rule
        else:
            out[self.knob] = value
        return out


def make_rule(method: str, **fields) -> RuleConfig:
    """The acceptance rule of `method`'s preset with `fields` changed (e.g. LANTERN's delta)."""
    from ciar.sim.decoder import method_config

    return RuleConfig(**{**vars(method_config(method).rule), **fields})


def parse_value(knob: str, text: str):
    """A swept value as its knob takes it: the knob table's type, a rule field's type (RuleConfig's default), else
    int, float or the text itself (a knob the decoder gained after this module)."""
    text = text.strip()
    name = knob.removeprefix("rule.")
    kind = type(getattr(RuleConfig(), name)) if knob.startswith("rule.") and hasattr(RuleConfig(), name) \
        else KNOBS[knob].kind if knob in KNOBS else None
    if kind is bool:
        return text.lower() in ("1", "true", "yes")
    if kind is not None:
        return kind(text)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_line(spec: str) -> Line:
    """"LABEL=METHOD:KNOB=V1,V2[:KNOB=V...]" -> Line (the first KNOB is swept, the others fixed)."""
    label, sep, rest = spec.partition("=")
    parts = rest.split(":")
    if not sep or len(parts) < 2 or any("=" not in p for p in parts[1:]):
        raise ValueError(f"--line {spec!r}: expected LABEL=METHOD:KNOB=V1,V2[:KNOB=V...]")
    method = parts[0].strip()
    if method not in METHODS:
        raise ValueError(f"--line {spec!r}: unknown method {method!r}; known: {', '.join(METHODS)}")
    knobs = [p.split("=", 1) for p in parts[1:]]
    swept, values = knobs[0][0].strip(), tuple(parse_value(knobs[0][0].strip(), v) for v in knobs[0][1].split(","))
    fixed = {k.strip(): parse_value(k.strip(), v) for k, v in knobs[1:]}
    return Line(label.strip(), method, swept, values, fixed)


def default_lines(defaults) -> dict[str, Line]:
    """The built-in lines around the device file's calibrated values (`CIARDefaults`, or None: no CIAR / entropy
    line can be centred)."""
    lines = {}
    if defaults is not None and defaults.tau is not None:
        lines["ciar"] = Line("ciar", "ciar", "tau", tuple(round(s * defaults.tau, 4) for s in TAU_SCALES))
    if defaults is not None and "entropy" in defaults.taus:
        lines["entropy"] = Line("entropy", "entropy", "tau",
                                tuple(round(s * defaults.taus["entropy"], 4) for s in TAU_SCALES))
    lines["code"] = Line("code", "code", "prefix_rate", (0.2, 0.3, 0.45, 0.6, 0.8))
    lines["lantern"] = Line("lantern", "lantern", "rule.lantern_delta", (0.05, 0.15, 0.3))
    calibrated = getattr(defaults, "cascade_threshold", None)
    thresholds = sorted(set(CASCADE_THRESHOLDS) | ({calibrated} if calibrated is not None else set()), reverse=True)
    lines["cascade"] = Line("cascade", "cascade", "rule.cascade_threshold", tuple(thresholds))
    return lines


def assemble(rows: dict, points: dict, base: str = "cloud") -> dict:
    """rows: `benchmarks.collab.summarize`'s {name: row}; points: {name: (line label, knob, value)}. -> {line label:
    [point, ...] in the order of the line's values}, each point {name, knob, value, fidelity, fid, speedup,
    speedup_paper_profile, cloud_call_rate, fidelity_vs_base (the paired difference and its interval, when the row
    has one)}, plus `base` as its own one-point line."""
    keys = ("fidelity", "fid", "speedup", "speedup_paper_profile", "cloud_call_rate", "fidelity_vs_base")
    out: dict = {base: [{"name": base, "knob": None, "value": None, **{k: rows[base].get(k) for k in keys}}]}
    for name, (label, knob, value) in points.items():
        out.setdefault(label, []).append({"name": name, "knob": knob, "value": value,
                                          **{k: rows[name].get(k) for k in keys}})
    return out


def equal_fidelity(lines: dict, tolerance: float, base: str = "cloud") -> dict:
    """Per cost regime ("speedup": measured compute, "speedup_paper_profile": the simulation) and line, the fastest
    point whose fidelity is >= `base`'s - `tolerance` (None when no point is), and the fastest line overall."""
    floor = lines[base][0]["fidelity"] - tolerance
    out = {"base_fidelity": lines[base][0]["fidelity"], "tolerance": tolerance, "fidelity_floor": floor}
    for key in ("speedup", "speedup_paper_profile"):
        best = {}
        for label, pts in lines.items():
            if label == base:
                continue
            ok = [p for p in pts if p["fidelity"] is not None and p["fidelity"] >= floor and p[key] is not None]
            best[label] = max(ok, key=lambda p: p[key]) if ok else None
        found = {k: v for k, v in best.items() if v is not None}
        out[key] = {"per_line": best, "fastest": max(found, key=lambda k: found[k][key]) if found else None}
    return out


def frontier_markdown(lines: dict, answer: dict, title: str) -> str:
    """The frontier as a table (one row per point, lines in order) and the equal-fidelity answer."""
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    def vs_base(p) -> str:  # points of fidelity against cloud-only, with its 95 % paired bootstrap interval
        ci = p.get("fidelity_vs_base")
        return "–" if not ci else f"{100 * ci['diff']:+.1f} [{100 * ci['lo']:+.1f}, {100 * ci['hi']:+.1f}]"

    out = [f"### {title}\n\n", "| Line | Knob | Value | Fidelity (↑) | vs cloud-only, pt [95 % CI] | FID (↓) | "
           "Speedup, measured | Speedup, paper profile (sim.) | Cloud-call rate |\n"
           "|---|---|---|---|---|---|---|---|---|\n"]
    for label, pts in lines.items():
        for p in pts:
            out.append(f"| {label} | {p['knob'] or '–'} | {f(p['value'], 'g')} | {f(p['fidelity'], '.4f')} | "
                       f"{vs_base(p)} | {f(p['fid'], '.3f')} | x{f(p['speedup'], '.2f')} | "
                       f"x{f(p['speedup_paper_profile'], '.2f')} | "
                       f"{f(None if p['cloud_call_rate'] is None else 100 * p['cloud_call_rate'], '.2f')}% |\n")
    out.append(f"\n### At equal fidelity: fidelity >= {answer['fidelity_floor']:.4f} (cloud-only "
               f"{answer['base_fidelity']:.4f} - {answer['tolerance']:g})\n\n"
               "| Line | Measured compute: fastest point | Fidelity / FID | Speedup | Paper profile (sim.): fastest "
               "point | Fidelity / FID | Speedup |\n|---|---|---|---|---|---|---|\n")
    measured, paper = answer["speedup"], answer["speedup_paper_profile"]
    for label in measured["per_line"]:
        m, s = measured["per_line"][label], paper["per_line"][label]
        quality = lambda p: f"{p['fidelity']:.4f} / {f(p['fid'], '.3f')}" if p else "–"  # noqa: E731
        out.append(f"| {label} | {m['name'] if m else 'none within the tolerance'} | {quality(m)} | "
                   f"{'x' + format(m['speedup'], '.2f') if m else '–'} | {s['name'] if s else 'none'} | {quality(s)} | "
                   f"{'x' + format(s['speedup_paper_profile'], '.2f') if s else '–'} |\n")
    out.append(f"\nFastest at equal fidelity: **{measured['fastest']}** at measured compute, "
               f"**{paper['fastest']}** under the paper's profile (a simulation).\n")
    return "".join(out)


def plot(lines: dict, path: str, title: str, base: str = "cloud") -> None:
    """Fidelity against speedup, one line per method; measured compute and the paper's profile side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, what in zip(axes, ("speedup", "speedup_paper_profile"),
                             ("measured compute", "paper's cost profile (simulation)")):
        for label, pts in lines.items():
            pts = sorted((p for p in pts if p[key] is not None and p["fidelity"] is not None), key=lambda p: p[key])
            style = dict(marker="*", markersize=14, linestyle="none", color="black") if label == base \
                else dict(marker="o")
            ax.plot([p[key] for p in pts], [p["fidelity"] for p in pts], label=label, **style)
        ax.axvline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"speedup over cloud-only, {what}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("probe fidelity (attribute accuracy)")
    axes[1].legend(loc="lower left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="all", help="comma list of the built-in lines (ciar, entropy, code, lantern, "
                                                    "cascade) or 'all'")
    p.add_argument("--line", action="append", default=[], help="an extra line: LABEL=METHOD:KNOB=V1,V2[:KNOB=V...]")
    p.add_argument("--values", action="append", default=[], help="LINE=V1,V2: a line's swept values")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--network", default="5g")
    p.add_argument("--seed", type=int, default=0)
    add_world_arguments(p)
    p.add_argument("--tolerance", type=float, default=0.01, help="fidelity below cloud-only's that counts as equal")
    p.add_argument("--checkpoint", default=None, help="tokens and stats so far (resumed by the same command)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        spec = read_world(world_from_args(args), need_device=True, need_text=True)
    except WorldSpecError as e:
        raise SystemExit(f"error: {e}") from None
    if not isinstance(spec, ScenesWorldSpec):
        p.error("the frontier needs the scenes world's probe and FID features")
    world = load_world(spec)
    verifier = make_verifier(world)
    lines = default_lines(world.device_model.ciar_defaults)
    if args.methods != "all":
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        if any(m not in lines for m in wanted):
            p.error(f"unknown lines {[m for m in wanted if m not in lines]}; built in: {', '.join(lines)}")
        lines = {m: lines[m] for m in wanted}
    try:
        for spec_text in args.line:
            line = parse_line(spec_text)
            lines[line.label] = line
        for spec_text in args.values:
            label, _, values = spec_text.partition("=")
            line = lines[label.strip()]
            lines[line.label] = Line(line.label, line.method, line.knob,
                                     tuple(parse_value(line.knob, v) for v in values.split(",")), line.fixed)
    except (ValueError, KeyError) as e:
        p.error(str(e))

    common = {"network": args.network}
    variants: dict = {"cloud": ("cloud", dict(common), None)}
    points = {}
    for line in lines.values():
        for v in line.values:
            variants[line.point_name(v)] = (line.method, line.overrides(v, common), None)
            points[line.point_name(v)] = (line.label, line.knob, v)
    ps = load_prompts(None, args.num_prompts, args.seed)
    t0 = time.time()
    done = None
    if args.checkpoint:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    if args.checkpoint and os.path.isfile(args.checkpoint):
        done = torch.load(args.checkpoint, weights_only=False)
        if set(done) != set(variants):
            p.error(f"{args.checkpoint} holds other points: {sorted(done)}")
        done = {k: (t[:len(ps.captions)], s[:len(ps.captions)]) for k, (t, s) in done.items()}  # a shorter run

    def save(i: int, out: dict) -> None:
        if args.checkpoint and ((i + 1) % args.checkpoint_every == 0 or i + 1 == len(ps.captions)):
            torch.save(out, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)

    results = run_variants(world, verifier, variants, ps.captions, args.seed, desc="frontier", done=done,
                           on_prompt=save)
    from ciar.metrics.fid import make_fid
    from ciar.metrics.probe import load_probe

    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    fid_net = make_fid("scenes", os.path.join(world.weights_dir, "fid_features.safetensors"))
    rows = summarize(results, "cloud", world, ps, probe, fid_net)
    checks = {name: fidelity_checks(world, tokens, ps, probe) for name, (tokens, _) in results.items()}
    for name in points:  # paired with cloud-only on the same prompts and seeds
        rows[name]["fidelity_vs_base"] = paired_fidelity_ci(checks["cloud"], checks[name], seed=args.seed)
    frontier = assemble(rows, points)
    answer = equal_fidelity(frontier, args.tolerance)
    title = f"Quality-speed frontier ({args.network}, {len(ps.captions)} held-out prompts)"
    report = {"prompts": ps.source, "num_prompts": len(ps.captions), "seed": args.seed, "network": args.network,
              "weights": world.weights_dir, "sampling": world.sampling.to_dict(),
              "lines": {k: {"method": v.method, "knob": v.knob, "values": list(v.values), "fixed": v.fixed}
                        for k, v in lines.items()},
              "frontier": frontier, "equal_fidelity": answer, "methods": rows,
              "configs": {name: make_decoder(world, verifier, m, device_model=dev, **ov).config.to_dict()
                          for name, (m, ov, dev) in variants.items()},
              "seconds": time.time() - t0}
    write_results(args.out, report, frontier_markdown(frontier, answer, title))
    plot(frontier, os.path.splitext(args.out)[0] + ".png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
