"""Threshold calibration (ciar.training.calibration): the bisection behind --target-rate, pipelines.calibrate and the
gate matching."""

import math

from ciar.training.calibration import bisect_threshold


def _rate_of(scores):
    """Cloud-call rate of a gate that escalates the scores above tau (falls as tau grows, like the real runs)."""
    return lambda tau: sum(s > tau for s in scores) / len(scores)


def test_reaches_target_on_a_spread_scale():
    scores = [i / 1000 for i in range(1000)]  # uniform on [0, 1)
    tau, rate = bisect_threshold(_rate_of(scores), 0.3)
    assert abs(rate - 0.3) <= 0.005
    assert 0.69 <= tau <= 0.71


def test_grows_the_bracket_for_unbounded_scores():
    scores = [10.0 * i for i in range(1000)]  # normalised-U-like scale, up to ~1e4
    tau, rate = bisect_threshold(_rate_of(scores), 0.3)
    assert abs(rate - 0.3) <= 0.005
    assert tau > 1.0


def test_resolves_a_narrow_saturated_band():
    # a top-k set gate at k = 200: 60 % of the scores crowd into [199/200, 1); 8 halvings of [0, 1] cannot tell them
    # apart (the old calibration stopped at tau = 1 with no escalation at all)
    k = 200
    band = [(k - 1 + f / 600) / k for f in range(600)]
    scores = [i / 1000 for i in range(400)] + band
    tau, rate = bisect_threshold(_rate_of(scores), 0.3)
    assert abs(rate - 0.3) <= 0.005
    assert (k - 1) / k < tau < 1.0


def test_unreachable_target_returns_the_closest_rate():
    scores = [0.5] * 10  # every token escalates below 0.5 and none above: 0.3 cannot be hit
    tau, rate = bisect_threshold(_rate_of(scores), 0.3)
    assert rate in (0.0, 1.0)
    assert math.isfinite(tau)
