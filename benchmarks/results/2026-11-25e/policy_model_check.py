"""The cost model of ciar.collab.policy against measured generations of the shipped world (val prompts, one thread).

    .venv/bin/python benchmarks/results/2026-11-25e/policy_model_check.py 12 \
        benchmarks/results/2026-11-25e/policy_model_check.json > benchmarks/results/2026-11-25e/policy_model_check.md

Per operating point, the model's inputs are measured from the run itself: the device step (device seconds per
forward after the prefill), the cloud step (verify seconds per verify forward; a cloud-only image's open seconds per
forward), the gate's escalation rate (escalations / gated positions), and the acceptance of the first and later
drafts (from each verify's span and accepted count). Three columns per point: measured (seconds and cloud steps
after the open, per image), the model with the run's own inputs (does it count what the decoder does?), and the
model with the escalation and acceptance of the reference point (the shipped one, first row) and this run's step
times (what it predicts for a point before running it; the box's load moves step times between runs, so those are
the run's own). Then what `choose` picks on each link from the reference's inputs, at measured compute and under
the paper's cost profile (59.8 ms per cloud step, 0.076 ms per device step).
"""

import json
import sys
from dataclasses import replace

import torch

from ciar.sim.network import get_profile
from ciar.collab.policy import CLOUD_ONLY, Costs, OperatingPoint, choose, expected_cost
from ciar.sim.runtime import make_decoder, make_verifier
from ciar.engine.verifier import InProcessCloud
from ciar.data.scenes import scene_at
from ciar.world import load_world

POINTS = [("ciar", "5g", {}), ("ciar", "4g", {}), ("ciar", "wifi", {}), ("ciar", "5g", dict(span=8)),
          ("ciar", "5g", dict(burst=0)), ("ciar", "4g", dict(span=4, burst=16)), ("cloud", "5g", {}),
          ("cloud", "4g", {})]
PAPER_PROFILE = dict(device_step_s=0.076e-3, cloud_step_s=59.8e-3)


class RecordingCloud(InProcessCloud):
    """InProcessCloud that keeps every (kind, request, reply)."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.calls = []

    def open(self, request):
        reply = super().open(request)
        self.calls.append(("open", request, reply))
        return reply

    def verify(self, request):
        reply = super().verify(request)
        self.calls.append(("verify", request, reply))
        return reply


def link(network: str) -> tuple[float, float]:
    profile = get_profile(network)
    return profile.rtt_ms / 1000, profile.bandwidth_mbps * 1e6 / 8


def measure(world, verifier, method, network, knobs, prompts):
    """-> (decoder config, Costs measured from the run, remaining tokens, measured seconds and cloud steps after the
    open, per image)."""
    dec = make_decoder(world, verifier, method, network=network, **knobs)
    cloud = dec.client = RecordingCloud(verifier)
    latency, bandwidth = link(network)
    seconds = steps = device_s = device_steps = gated = escalated = remaining = 0
    opens, verifies = [], []
    for i in range(prompts):
        cloud.calls = []
        st = dec.generate(scene_at("val", i).caption, seed=i).stats
        _, open_req, open_rep = cloud.calls[0]
        opens.append(open_rep)
        verifies += [(req, rep) for kind, req, rep in cloud.calls if kind == "verify"]
        if method == "cloud":
            seconds += st.total_s
            steps += st.cloud_forward_passes
            remaining += st.total_tokens
        else:
            seconds += st.total_s - (2 * latency + (open_req.nbytes() + open_rep.nbytes()) / bandwidth
                                     + open_rep.cloud_s)
            steps += st.cloud_forward_passes - open_rep.forward_passes
            remaining += st.total_tokens - st.prefix_tokens
        device_s += st.device_s
        device_steps += st.device_forward_passes - (method != "cloud")  # the prefill is not a step
        gated += st.device_tokens + st.verifications
        escalated += st.verifications
    V = world.cloud.config.vocab_size
    if method == "cloud":
        t_c = sum(o.cloud_s for o in opens) / sum(o.forward_passes for o in opens)
        costs = Costs(0.0, latency, bandwidth, t_c, 0.0, 1.0, 0.0, 0.0, V)
    else:
        accepted = [rep.num_accepted for _, rep in verifies]
        spans = [len(req.draft_tokens) for req, _ in verifies]
        later = sum(min(n, k - 1) for n, k in zip(accepted, spans))  # later drafts judged after an accepted one
        cfg = dec.config
        costs = Costs(device_s / device_steps, latency, bandwidth,
                      sum(rep.cloud_s for _, rep in verifies) / sum(rep.forward_passes for _, rep in verifies), 0.0,
                      escalated / gated, sum(n >= 1 for n in accepted) / len(accepted),
                      sum(max(0, n - 1) for n in accepted) / later if later else 0.0, V,
                      hidden_dim=world.device_model.config.dim if cfg.inter_enhance else 0,
                      feature_dim=2 * cfg.feature_top + 4 if cfg.inter_enhance else 0)
    return dec.config, costs, remaining // prompts, seconds / prompts, steps / prompts


def main(prompts: int, out_json: str) -> None:
    torch.set_num_threads(1)
    world = load_world(None)
    verifier = make_verifier(world, max_sessions=2)
    rows, reference, calibrated = [], None, None  # the first point's costs and point
    for method, network, knobs in POINTS:
        cfg, costs, remaining, seconds, steps = measure(world, verifier, method, network, knobs, prompts)
        point = CLOUD_ONLY if method == "cloud" else OperatingPoint(cfg.span, cfg.burst)
        reference, calibrated = reference or costs, calibrated or point
        own = expected_cost(costs, point, remaining)
        predicted = expected_cost(replace(costs, escalation_rate=reference.escalation_rate,
                                          accept_first=reference.accept_first, accept_next=reference.accept_next),
                                  point, remaining)
        rows.append(dict(method=method, network=network, point=str(point), costs=vars(costs), remaining=remaining,
                         measured_s=seconds, model_s=own.seconds, predicted_s=predicted.seconds,
                         measured_cloud_steps=steps, model_cloud_steps=own.cloud_steps,
                         predicted_cloud_steps=predicted.cloud_steps))
    decisions = []
    for network in ("5g", "wifi", "4g"):
        latency, bandwidth = link(network)
        on_link = replace(reference, latency_s=latency, bandwidth_Bps=bandwidth)
        for profile, costs in (("measured compute", on_link), ("paper profile", replace(on_link, **PAPER_PROFILE))):
            d = choose(costs, calibrated, rows[0]["remaining"])
            decisions.append(dict(network=network, profile=profile, chosen=str(d.point), chosen_s=d.outlook.seconds,
                                  calibrated_s=expected_cost(costs, calibrated, rows[0]["remaining"]).seconds,
                                  cloud_only_s=expected_cost(costs, CLOUD_ONLY, rows[0]["remaining"]).seconds))
    with open(out_json, "w") as f:
        json.dump(dict(prompts=f"scenes val[0:{prompts}], seed = index", rows=rows, decisions=decisions), f, indent=1)
    pct = lambda a, b: f"{100 * (a / b - 1):+.1f} %"  # noqa: E731
    print(f"Shipped world, {prompts} val prompts (seed = index), one thread; seconds and cloud steps per image after "
          f"the open (cloud-only: the whole image, its open).\n")
    print("| method | link | point | t_d ms | t_c ms | e | α1 | α | measured s | model s, own inputs | predicted s "
          "| measured steps | model steps, own inputs | predicted steps |\n" + "|---" * 14 + "|")
    for r in rows:
        c = r["costs"]
        rates = "| – | – | – " if r["method"] == "cloud" else \
            f"| {c['escalation_rate']:.3f} | {c['accept_first']:.3f} | {c['accept_next']:.3f} "
        print(f"| {r['method']} | {r['network']} | {r['point']} | {1e3 * c['device_step_s']:.2f} | "
              f"{1e3 * c['cloud_step_s']:.2f} {rates}| {r['measured_s']:.3f} | {r['model_s']:.3f} "
              f"({pct(r['model_s'], r['measured_s'])}) | {r['predicted_s']:.3f} "
              f"({pct(r['predicted_s'], r['measured_s'])}) | {r['measured_cloud_steps']:.1f} | "
              f"{r['model_cloud_steps']:.1f} ({pct(r['model_cloud_steps'], r['measured_cloud_steps'])}) | "
              f"{r['predicted_cloud_steps']:.1f} ({pct(r['predicted_cloud_steps'], r['measured_cloud_steps'])}) |")
    print(f"\n`choose` from the first row's inputs (calibrated point {calibrated}), {rows[0]['remaining']} tokens "
          f"after the open:\n\n| link | costs | chosen | its s | calibrated s | cloud-only s |\n" + "|---" * 6 + "|")
    for d in decisions:
        print(f"| {d['network']} | {d['profile']} | {d['chosen']} | {d['chosen_s']:.3f} | {d['calibrated_s']:.3f} | "
              f"{d['cloud_only_s']:.3f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
