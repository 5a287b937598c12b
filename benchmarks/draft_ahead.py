"""Drafting while a verification is in flight: how often the device's guess of the reply holds, and what it could
save (issue 29 item 3). A measurement, not a feature: the device loop does not draft ahead.

    python -m benchmarks.draft_ahead --num-prompts 50 --out benchmarks/results/DATE/draft_ahead.json

While a VERIFY is on the link the device is idle for a round trip. To use that time it must guess the reply and
draft on from the guess; the drafts count only when the guess holds. A reply commits the accepted drafts, then the
cloud's next token z (a correction after a rejection, else the bonus token), then a burst after a rejection. The
only guess that leaves the device anything to draft from is "every draft accepted and z = the device's own most
likely token there" (a rejection is followed by the cloud's correction and burst, which the device cannot know).
When it holds, the tokens the device would have drafted ahead are kept up to its next escalation (the gate still
decides each), at most one round trip's worth.

For each held-out prompt (CIAR at the device file's calibrated point, fixed policy, the link of `--network`), at
each reply whose drafts were all accepted, the device's distribution at z's position is computed (feeding the last
draft, which the commit re-feeds anyway: the tokens do not change) and compared with z. Reported:
  all_accepted     share of verifications whose every draft was accepted
  guess_holds      share of verifications where, besides, z is the device's argmax (the guess holds)
  p_device_z       the device's mean probability of z at those replies (a sampled guess would hold this often)
  saved_s          per image, an upper bound of the time drafting ahead saves: per hit, min(the device tokens
                   kept locally after z before the next cloud token, a round trip / the device step) device steps
  share            saved_s / the image's seconds at the same point (measured compute + the network model)
Prompt i runs with seed `seed * 1000003 + i`, as in `benchmarks.collab`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.collab import load_prompts
from ciar.sim.network import get_profile
from ciar.sim.runtime import make_decoder, make_verifier
from ciar.results import write_results
from ciar.world import load_world
from ciar_device import loop as L
from ciar_device import maths as M


class GuessRecorder:
    """Wraps the device loop's commit (`ciar_device.loop._Image.commit`): before a reply whose drafts were all
    accepted is committed, the device's output at the next token's position (its last draft fed) is compared with the
    cloud's next token."""

    def __init__(self):
        self.records: list[dict] = []  # per verification: all accepted, guess holds, p_device(z), z's position
        self._commit = L._Image.commit

    def __enter__(self):
        recorder = self

        def commit(gen, span, reply):
            start, k = len(gen.tokens), len(span)
            row = {"all_accepted": reply.num_accepted == k, "holds": False, "p_device_z": None,
                   "position": start + k}
            if row["all_accepted"] and start + k < gen.n_total:
                gen.feed([span[-1]], start + k - 1)  # the commit rolls back and re-feeds from here
                c, p = gen.step.center, gen.cfg.sampling
                q = M.logits_to_probs(c[0], p, uncond_logits=c[1] if gen.cfg.cfg_rows == 2 else None)
                row["holds"] = int(q.argmax()) == int(reply.next_token)
                row["p_device_z"] = float(q[int(reply.next_token)])
            recorder.records.append(row)
            return recorder._commit(gen, span, reply)

        L._Image.commit = commit
        return self

    def __exit__(self, *exc):
        L._Image.commit = self._commit


def local_run_after(who: list[str], position: int) -> int:
    """Device tokens in a row after `position` (z's): what drafting ahead from a held guess would have kept."""
    n = 0
    for w in who[position + 1:]:
        if w != "device":
            break
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.draft_ahead", description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--network", default="5g,4g", help="comma list of links")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    world = load_world(None)
    verifier = make_verifier(world)
    prompts = load_prompts(None, args.num_prompts, args.seed).captions
    t0 = time.time()
    report = {"num_prompts": len(prompts), "seed": args.seed, "links": {}}
    lines = ["### Drafting while a verification is in flight: how often the guess holds (measured)\n",
             "| link | verifications / image | all accepted | guess holds | p_device(z) | saved / image, upper bound "
             "| share of the image's time |\n", "|---|---|---|---|---|---|---|\n"]
    for net in args.network.split(","):
        rtt = 2 * get_profile(net).rtt_ms / 1000.0
        dec = make_decoder(world, verifier, "ciar", network=net, policy="fixed")
        dec.generate(prompts[0], seed=10 ** 9)  # first-call overheads out
        rows, saved, seconds = [], [], []
        with GuessRecorder() as rec:
            for i, prompt in enumerate(tqdm(prompts, desc=net, dynamic_ncols=True)):
                rec.records.clear()
                r = dec.generate(prompt, seed=args.seed * 1_000_003 + i, trace=True)
                step = r.stats.device_s / max(1, r.stats.device_forward_passes)
                cap = int(rtt / step) if step > 0 else 0
                saved.append(sum(min(local_run_after(r.trace, x["position"]), cap) * step
                                 for x in rec.records if x["holds"]))
                seconds.append(r.stats.total_s)
                rows += rec.records
        n = max(1, len(rows))
        held = [x for x in rows if x["all_accepted"] and x["p_device_z"] is not None]
        link = {"verifications_per_image": len(rows) / len(prompts),
                "all_accepted": sum(x["all_accepted"] for x in rows) / n,
                "guess_holds": sum(x["holds"] for x in rows) / n,
                "p_device_z": float(np.mean([x["p_device_z"] for x in held])) if held else None,
                "saved_s_per_image": float(np.mean(saved)), "seconds_per_image": float(np.mean(seconds))}
        link["share"] = link["saved_s_per_image"] / link["seconds_per_image"]
        report["links"][net] = link
        pz = "–" if link["p_device_z"] is None else f"{link['p_device_z']:.3f}"
        lines.append(f"| {net} | {link['verifications_per_image']:.1f} | {link['all_accepted']:.3f} | "
                     f"{link['guess_holds']:.3f} | {pz} | {1000 * link['saved_s_per_image']:.1f} ms | "
                     f"{100 * link['share']:.1f} % |\n")
    report["seconds"] = time.time() - t0
    write_results(args.out, report, "".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
