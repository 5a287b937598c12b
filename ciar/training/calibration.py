"""Threshold calibration: the tau of a gate that gives a target cloud-call rate, measured by real generations.

    tau, rate = bisect_threshold(lambda t: rate_at(t), target=0.3)
    th = calibrate_tau(world, verifier, "ciar", {"gate": "lower", "burst": 4}, 0.3, val_prompts, seed=0)

The cloud-call rate is not the gate's escalation rate (the prefix, the span after each escalation, recovered and
burst tokens all count), so thresholds are found by running the decoder on calibration prompts (**val** prompts,
never the evaluated ones) and bisecting. Used by `python -m pipelines.calibrate` (which writes the result into the
device file, `ciar.collab.defaults`) and by `benchmarks.collab` (Tables 2/3 match every gate to CIAR's rate).
"""

from __future__ import annotations

from ciar.sim.decoder import GATED_METHODS
from ciar.sim.runtime import make_decoder
from ciar.collab.stats import GenerationStats


def val_prompts(n: int, seed: int = 0, start: int = 10_000) -> list[str]:
    """The calibration prompts: `n` captions of the scenes **val** split from index `start` (disjoint from the
    evaluation's held-out split and from the val scenes the device was checked on)."""
    from ciar.data import scenes

    return [scenes.scene_at("val", start + i, seed).caption for i in range(n)]


def cloud_rate(world, verifier, method, overrides, prompts, seed, device_model=None) -> float:
    """Cloud-call rate of `method` with `overrides` over `prompts` (prompt i with seed `seed * 1000003 + i`). A gated
    method runs at its fixed point unless `overrides` says otherwise: a threshold belongs to the calibrated span
    and burst (the adaptive policy may give images to the cloud whole, which says nothing about the gate)."""
    if method in GATED_METHODS:
        overrides = {"policy": "fixed", **overrides}
    d = make_decoder(world, verifier, method, device_model=device_model, **overrides)
    total = GenerationStats()
    for i, p in enumerate(prompts):
        total = total + d.generate(p, seed=seed * 1_000_003 + i).stats
    return total.cloud_call_rate


def bisect_threshold(rate_at, target: float, iters: int = 24, tol: float = 0.005) -> tuple[float, float]:
    """Threshold tau whose cloud-call rate `rate_at(tau)` is closest to `target` (the rate falls as tau grows).

    The bracket starts at [0, 1] and grows x4 until the rate at its top is <= target; bisection then runs until a
    rate lands within `tol` of the target or `iters` steps are spent. Gates whose scores crowd into a narrow band
    need the long run: the top-k set score of a saturated set lies in [(k-1)/k, 1), 0.005 wide at k = 200, which
    8 halvings of [0, 1] never resolve. -> (tau, its rate)."""
    lo, hi = 0.0, 1.0
    r_hi = rate_at(hi)
    while r_hi > target and hi < 1e6:
        lo, hi = hi, hi * 4
        r_hi = rate_at(hi)
    best = (abs(r_hi - target), hi, r_hi)
    for _ in range(iters):
        if best[0] <= tol:
            break
        mid = (lo + hi) / 2
        r = rate_at(mid)
        best = min(best, (abs(r - target), mid, r))
        if r > target:
            lo = mid
        else:
            hi = mid
    return best[1], best[2]


def calibrate_tau(world, verifier, method, overrides, target: float, prompts, seed, device_model=None) -> dict:
    """Bisection on tau (`bisect_threshold`) so the cloud-call rate on `prompts` is close to `target`."""
    tau, rate = bisect_threshold(
        lambda t: cloud_rate(world, verifier, method, {**overrides, "tau": t}, prompts, seed, device_model), target)
    return {"tau": tau, "calibration_rate": rate, "target_rate": target, "calibration_prompts": len(prompts)}
