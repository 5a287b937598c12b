"""The cost model of an operating point (ciar_device.policy): hand-worked cases, the choice and its quality floor,
message sizes from the codec, and the running estimates."""

import math
from dataclasses import replace

import pytest
import torch

from ciar.sim.network import NetworkModel
from ciar.collab.protocol import VerifyReply, VerifyRequest
from ciar_device.policy import (CLOUD_ONLY, CloudStepEstimator, CostHint, CostObserver, Costs, Ewma, LinkEstimator,
                                OperatingPoint, RateEstimator, accepted_drafts, allowed_points, choose, expected_cost,
                                full_accept, reply_bytes, request_bytes)

R = 100  # remaining tokens in the hand-worked cases
# no serialisation time (b = inf), no queue: every number below is worked out by hand in the test's docstring
FOUR_G_CHEAP_CLOUD = Costs(device_step_s=0.001, latency_s=0.050, bandwidth_Bps=math.inf, cloud_step_s=0.002,
                           queue_s=0.0, escalation_rate=0.25, accept_first=0.5, accept_next=0.5, vocab_size=1024)
FIVE_G_DEAR_CLOUD = Costs(device_step_s=0.001, latency_s=0.010, bandwidth_Bps=math.inf, cloud_step_s=0.060,
                          queue_s=0.0, escalation_rate=0.25, accept_first=0.5, accept_next=0.9, vocab_size=1024)


def test_acceptance_terms():
    c = FIVE_G_DEAR_CLOUD  # α1 0.5, α 0.9
    assert full_accept(c, 1) == 0.5 and full_accept(c, 3) == pytest.approx(0.5 * 0.81)
    assert accepted_drafts(c, 1) == pytest.approx(0.5)
    assert accepted_drafts(c, 3) == pytest.approx(0.5 * (1 + 0.9 + 0.81))
    assert accepted_drafts(replace(c, accept_next=1.0), 4) == pytest.approx(2.0)  # α = 1: α1 k


def test_four_g_with_a_cheap_cloud_step_hands_the_image_to_the_cloud():
    """4G (l = 50 ms), t_c = 2 ms, t_d = 1 ms, e = 0.25, α1 = α = 0.5, the calibrated point span 2, burst 4:
    P_full = 0.25, A = 0.75, L = 0.75 + 1 + 4 x 0.75 = 4.75, S = 4, X = 0.1 + 4 x 0.002 = 0.108;
    per drafted position 0.75 x 0.001 + 0.25 x (2 x 0.001 + 0.108) = 0.02825 s for 0.75 + 0.25 x 4.75 = 1.9375 tokens:
    T = 100 x 0.02825 / 1.9375 = 1.4581 s, C = 100 x 0.25 x 4 / 1.9375 = 51.61 steps.
    Cloud-only: 2 x 0.05 + 100 x 0.002 = 0.3 s (100 steps). CIAR is 4.9x slower than handing over."""
    c, calibrated = FOUR_G_CHEAP_CLOUD, OperatingPoint(span=2, burst=4)
    ciar = expected_cost(c, calibrated, R)
    assert ciar.seconds == pytest.approx(100 * 0.02825 / 1.9375) and ciar.cloud_steps == pytest.approx(100 / 1.9375)
    cloud = expected_cost(c, CLOUD_ONLY, R)
    assert cloud.seconds == pytest.approx(0.3) and cloud.cloud_steps == 100
    decision = choose(c, calibrated, R)
    assert decision.point == CLOUD_ONLY and decision.objective_s == pytest.approx(0.3)


def test_five_g_with_an_expensive_cloud_step_drafts_longer_spans():
    """5G (l = 10 ms), t_c = 60 ms (the paper's profile), t_d = 1 ms, e = 0.25, α1 = 0.5, α = 0.9, no burst:
    span 2: A = 0.95, X = 0.02 + 0.06 = 0.08, per position 0.00075 + 0.25 x 0.082 = 0.02125 s for 1.2375 tokens:
    T = 1.7172 s. span 8: A = 0.5 (1 - 0.9^8) / 0.1 = 2.8477, per position 0.00075 + 0.25 x 0.088 = 0.02275 s for
    0.75 + 0.25 x 3.8477 = 1.7119 tokens: T = 1.3289 s. Cloud-only: 0.02 + 100 x 0.06 = 6.02 s."""
    c, calibrated = FIVE_G_DEAR_CLOUD, OperatingPoint(span=2, burst=0)
    assert expected_cost(c, calibrated, R).seconds == pytest.approx(100 * 0.02125 / 1.2375)
    a8 = 5 * (1 - 0.9 ** 8)
    assert expected_cost(c, OperatingPoint(8, 0), R).seconds == pytest.approx(
        100 * 0.02275 / (0.75 + 0.25 * (a8 + 1)))
    assert expected_cost(c, CLOUD_ONLY, R).seconds == pytest.approx(6.02)
    decision = choose(c, calibrated, R, spans=(2, 4, 8), bursts=(0, 4))
    assert decision.point == OperatingPoint(8, 0)  # a burst token costs a 60 ms step: no burst
    assert decision.outlook.seconds == pytest.approx(1.32892, rel=1e-4)
    assert choose(c, calibrated, R).point.span > 8  # the full span range goes further still


def test_a_cloud_step_price_keeps_the_work_on_the_device():
    """The 4G case with a price of 50 ms per cloud step: cloud-only 0.3 + 100 x 0.05 = 5.3 s against CIAR's
    1.4581 + 51.61 x 0.05 = 4.039 s at its calibrated point (span 2, burst 4), which no other allowed point beats."""
    c, calibrated = FOUR_G_CHEAP_CLOUD, OperatingPoint(span=2, burst=4)
    decision = choose(c, calibrated, R, cloud_step_price_s=0.05)
    assert decision.point == calibrated
    assert decision.objective_s == pytest.approx(100 * 0.02825 / 1.9375 + 0.05 * 100 / 1.9375)
    with pytest.raises(ValueError, match="price"):
        choose(c, calibrated, R, cloud_step_price_s=-1.0)


def test_never_verifies_less_than_the_calibrated_point():
    """Drafts the cloud mostly rejects and an expensive device step make span 1 without a burst the cheapest point,
    but the calibrated point (span 4, burst 2) is the floor: the choice stays at it (cloud-only priced out)."""
    c = replace(FOUR_G_CHEAP_CLOUD, device_step_s=0.05, accept_first=0.1, accept_next=0.1)
    calibrated = OperatingPoint(span=4, burst=2)
    cheaper = expected_cost(c, OperatingPoint(1, 0), R)
    decision = choose(c, calibrated, R, cloud_step_price_s=1.0)
    assert cheaper.seconds + cheaper.cloud_steps < decision.objective_s  # what the floor costs here
    assert decision.point == calibrated
    points = allowed_points(calibrated)
    assert points[0] == calibrated and points[-1] == CLOUD_ONLY
    assert all(p.span >= 4 and p.burst >= 2 for p in points[:-1])
    assert allowed_points(CLOUD_ONLY) == [CLOUD_ONLY]


def test_edges():
    c = FOUR_G_CHEAP_CLOUD
    assert expected_cost(c, OperatingPoint(2, 4), 0).seconds == 0.0
    never = expected_cost(replace(c, escalation_rate=0.0), OperatingPoint(2, 4), R)  # the gate never escalates
    assert never.seconds == pytest.approx(R * 0.001) and never.cloud_steps == 0
    with pytest.raises(ValueError, match="escalation_rate"):
        replace(c, escalation_rate=1.5)
    with pytest.raises(ValueError, match="bandwidth"):
        replace(c, bandwidth_Bps=0.0)
    with pytest.raises(ValueError, match="span"):
        OperatingPoint(span=0)


def test_message_sizes_are_the_codecs_and_cost_bandwidth():
    """B_up and B_down equal the nbytes of real messages; a finite bandwidth adds exactly the bytes' time."""
    V, m, k, hidden, feats = 1024, 3, 2, 256, 20
    c = replace(FOUR_G_CHEAP_CLOUD, vocab_size=V, hidden_dim=hidden, feature_dim=feats)
    req = VerifyRequest("0" * 32, torch.zeros(m, dtype=torch.long), torch.zeros(k, dtype=torch.long),
                        torch.zeros(k, V, dtype=torch.float16), torch.zeros(m, hidden, dtype=torch.float16),
                        torch.zeros(m, feats, dtype=torch.float16))
    assert request_bytes(c, k, m) == req.nbytes(V)
    assert request_bytes(replace(c, hidden_dim=0, feature_dim=0), k, m) == \
        VerifyRequest("0" * 32, req.new_tokens, req.draft_tokens, req.draft_probs).nbytes(V)
    reply = VerifyReply("0" * 32, 1, 5, True, 0.0, 1, burst_tokens=torch.zeros(4, dtype=torch.long), vocab_size=V)
    assert reply_bytes(c, 5) == reply.nbytes()
    bandwidth = 20e6 / 8  # 4G
    slow = replace(c, bandwidth_Bps=bandwidth)
    up, down = request_bytes(c, 0, 7), reply_bytes(c, R)
    assert expected_cost(slow, CLOUD_ONLY, R, pending=7).seconds - expected_cost(c, CLOUD_ONLY, R, pending=7).seconds \
        == pytest.approx((up + down) / bandwidth)


def test_ewma():
    e = Ewma(weight=0.5, prior=3.0)
    assert e.value == 3.0
    assert e.update(10.0) == 10.0  # the first sample is the estimate
    assert e.update(20.0) == pytest.approx((0.5 * 10 * 0.5 + 0.5 * 20) / (0.5 * 0.5 + 0.5))
    for _ in range(60):
        e.update(1.0)
    assert e.value == pytest.approx(1.0)
    with pytest.raises(ValueError):
        Ewma(weight=0.0)


@pytest.mark.parametrize("profile, latency_s, bandwidth_Bps", [("4g", 0.050, 20e6 / 8), ("5g", 0.010, 300e6 / 8)])
def test_link_estimator_recovers_the_simulated_link(profile, latency_s, bandwidth_Bps):
    """Fed the network model's own exchanges (requests of varying sizes, small replies), the fit finds its latency
    and bandwidth exactly; with jitter, it predicts an exchange's link time within 2 % (on 5G the bytes' time is
    below the jitter, and a noisy slope may leave the bandwidth at its prior: it then matters little)."""
    sizes = [(400 + 700 * (i % 5) + 2100 * (i % 3), 60) for i in range(40)]
    est = LinkEstimator(prior_latency_s=1.0, prior_bandwidth_Bps=1.0)
    assert (est.latency_s, est.bandwidth_Bps) == (1.0, 1.0)
    net = NetworkModel(profile, seed=0)
    for up, down in sizes:
        est.observe(up, down, net.round_trip(up, down).total_s)
    assert est.latency_s == pytest.approx(latency_s, rel=1e-6)
    assert est.bandwidth_Bps == pytest.approx(bandwidth_Bps, rel=1e-6)
    jittery, net = LinkEstimator(), NetworkModel(f"{profile}:jitter_ms=0.5", seed=1)
    for up, down in sizes * 5:
        jittery.observe(up, down, net.round_trip(up, down).total_s)
    for up, down in sizes[:5]:
        mean_s = 2 * (latency_s + 0.0004) + (up + down) / bandwidth_Bps  # E|N(0, 0.5 ms)| = 0.4 ms per transmission
        assert 2 * jittery.latency_s + (up + down) / jittery.bandwidth_Bps == pytest.approx(mean_s, rel=0.02)


def test_link_estimator_without_a_spread_of_sizes_keeps_its_prior_bandwidth():
    est = LinkEstimator(prior_bandwidth_Bps=1e6)
    for _ in range(5):
        est.observe(1000, 50, 0.1 + 1050 / 1e6)
    assert est.bandwidth_Bps == 1e6 and est.latency_s == pytest.approx(0.05)


def test_a_decode_step_apart_from_the_span_forward():
    """t_s prices the tokens the cloud samples itself: a hand-over costs t_c + (R - 1) t_s, an exchange t_c plus
    t_s per expected burst token (hand-worked on the 5G case: P_full(2) = 0.45, burst 4 -> 2.2 expected tokens)."""
    c = replace(FIVE_G_DEAR_CLOUD, decode_step_s=0.010)
    assert expected_cost(c, CLOUD_ONLY, R).seconds == pytest.approx(2 * 0.010 + 0.060 + 99 * 0.010)
    e, k = 0.25, 2
    exchange = 2 * 0.010 + 0.060 + 0.010 * 4 * (1 - 0.45)
    per_position = (1 - e) * 0.001 + e * (k * 0.001 + exchange)
    tokens = (1 - e) + e * (accepted_drafts(c, k) + 1 + 4 * (1 - 0.45))
    assert expected_cost(c, OperatingPoint(2, 4), R).seconds == pytest.approx(R * per_position / tokens)
    assert Costs(**{**FIVE_G_DEAR_CLOUD.__dict__, "decode_step_s": None}).decode_step_s == 0.060  # default: t_c
    # chosen before the open, cloud-only rides on the open: no exchange of its own, R sampled steps
    assert expected_cost(c, CLOUD_ONLY, R, at_open=True).seconds == pytest.approx(R * 0.010)
    assert expected_cost(replace(c, bandwidth_Bps=1e6), CLOUD_ONLY, R, at_open=True).seconds == \
        pytest.approx(R * 0.010 + reply_bytes(c, R) / 1e6)


def test_cloud_step_estimator_separates_the_span_forward_from_the_sampled_steps():
    est = CloudStepEstimator(weight=1.0)  # the latest sample is the estimate
    assert est.steps() is None
    est.observe(0.050, 10, verify=False)  # a short open (CIAR's prefix): the mean per forward only
    assert est.steps() == pytest.approx((0.005, 0.005)) and est.samples == 0
    est.observe(0.046, 5)  # a verify with a burst before any span forward was seen alone: t_s still unknown
    assert est.steps() == pytest.approx((0.0092, 0.0092))
    est.observe(0.030, 1)  # a span forward alone: t_c
    est.observe(0.030 + 4 * 0.004, 5)  # then a burst of 4 steps: t_s = (cloud_s - t_c) / 4
    assert est.steps() == pytest.approx((0.030, 0.004)) and est.samples == 3
    est.observe(145 * 0.006, 145, verify=False)  # a cloud-only open: its steps are sampled ones
    assert est.steps() == pytest.approx((0.030, 0.006))
    # the tokens the cloud made, when the reply says: one a forward changes nothing; a burst whose entropy stop
    # spent a forward that made no token is priced per forward; by Jacobi windows (more tokens than forwards), per
    # token: what a token costs there
    est.observe(0.030 + 4 * 0.004, 5, tokens=4)
    assert est.steps() == pytest.approx((0.030, 0.004))
    est.observe(0.030 + 4 * 0.004, 5, tokens=3)
    assert est.steps() == pytest.approx((0.030, 0.004))
    est.observe(0.030 + 2 * 0.006, 3, tokens=8)  # 8 burst tokens in 2 rounds of 6 ms
    assert est.steps() == pytest.approx((0.030, 0.0015))
    est.observe(43 * 0.006, 43, verify=False, tokens=144)  # a Jacobi cloud-only open: 144 tokens in 43 forwards
    assert est.steps() == pytest.approx((0.030, 43 * 0.006 / 144))
    est.observe(10 * 0.006, 10, verify=False, tokens=9)  # a short open stays out, by windows or not
    assert est.steps() == pytest.approx((0.030, 43 * 0.006 / 144))


def test_rate_estimator_starts_at_its_prior_and_follows_the_device():
    r = RateEstimator(0.15, 8.0, decay=1.0)
    assert r.value == 0.15
    for i in range(92):
        r.observe(float(i % 4 == 0))  # 23 of 92
    assert r.value == pytest.approx((23 + 0.15 * 8) / 100)
    decaying = RateEstimator(0.5, 4.0, decay=0.99)
    for _ in range(2000):
        decaying.observe(0.0)
    assert decaying.value == pytest.approx(0.5 * 4 / (4 + 1 / (1 - 0.99)), rel=1e-3)  # the counts saturate at 100


def test_cost_observer_feeds_the_model_and_an_open_counts_towards_the_mean_step():
    obs = CostObserver()
    assert not obs.ready and obs.cloud_steps() == (0.0, 0.0)
    obs.observe_exchange(300, 2000, 0.100, 0.050, 10, 0.0, verify=False)  # an open: 5 ms per forward
    assert obs.cloud_steps() == pytest.approx((0.005, 0.005)) and not obs.ready
    obs.observe_exchange(9000, 60, 0.101, 0.007, 1, 0.002, verify=True)
    obs.device_step.update(0.0015)
    obs.observe_verdict(span=2, accepted=2)
    t_c, t_s = obs.cloud_steps()
    assert obs.ready and t_c == pytest.approx(0.007) and 0.005 < t_s < 0.007  # t_s: the mean per forward so far
    c = obs.costs(1024, hidden_dim=8, feature_dim=4)
    assert (c.device_step_s, c.queue_s, c.vocab_size, c.hidden_dim) == (0.0015, 0.002, 1024, 8)
    assert c.accept_first > CostObserver.ACCEPT_PRIOR[0] and c.escalation_rate == CostObserver.ESCALATION_PRIOR[0]
    assert obs.costs(1024, device_step_s=0.003).device_step_s == 0.003


def test_the_margin_keeps_the_calibrated_point_near_a_tie():
    """Cloud-only 5 % cheaper than the calibrated point: taken without a margin, not with a 10 % one; 20 % cheaper:
    taken with either."""
    c, cal = FOUR_G_CHEAP_CLOUD, OperatingPoint(2, 0)
    calibrated_s = expected_cost(c, cal, R).seconds
    for saving, with_margin in ((0.05, cal), (0.20, CLOUD_ONLY)):
        step = (1 - saving) * calibrated_s / R  # cloud-only at open: R steps
        costs = replace(c, cloud_step_s=step, decode_step_s=step)
        costs = replace(costs, cloud_step_s=c.cloud_step_s)  # the span forward keeps its price
        assert choose(costs, cal, R, spans=[2], bursts=[0], at_open=True).point == CLOUD_ONLY
        assert choose(costs, cal, R, spans=[2], bursts=[0], at_open=True, margin=0.10).point == with_margin
    with pytest.raises(ValueError):
        choose(c, cal, R, margin=1.0)


def test_a_clipped_ewma_bounds_one_stall_and_follows_a_real_change():
    e, plain = Ewma(weight=0.2, clip=3.0), Ewma(weight=0.2)
    for _ in range(5):
        e.update(0.006), plain.update(0.006)
    e.update(0.300)  # one stalled step: counted as 3x the estimate, not 50x
    assert e.value == pytest.approx(plain.update(0.018))
    for _ in range(30):
        e.update(0.050)  # the verifier got slower for real
    assert e.value == pytest.approx(0.050, rel=0.01)
    with pytest.raises(ValueError):
        Ewma(clip=1.0)


def test_a_primed_observer_is_ready_before_its_first_image_and_its_observations_replace_the_priors():
    """What a device knows before drafting (the handshake's round trip, a timed step, the verifier's hint) is enough
    to choose its first image; each estimate then follows the device's own observations."""
    obs = CostObserver()
    obs.prime(latency_s=0.05, device_step_s=0.002, hint=CostHint(span_s=0.010, step_s=0.004, queue_s=0.001))
    assert obs.ready
    c = obs.costs(1024)
    assert (c.latency_s, c.device_step_s, c.cloud_step_s, c.decode_step_s, c.queue_s) == \
        pytest.approx((0.05, 0.002, 0.010, 0.004, 0.001))
    obs.observe_exchange(9000, 60, 0.030, 0.020, 1, 0.0, verify=True)  # a verify reply: t_c 20 ms, 15 ms on the link
    obs.device_step.update(0.003)
    c = obs.costs(1024)
    assert c.cloud_step_s == pytest.approx(0.020) and c.decode_step_s == pytest.approx(0.004)  # t_s: still the hint
    assert c.latency_s == pytest.approx(0.015) and c.device_step_s == pytest.approx(0.003) and c.queue_s == 0.0
    # a hint without a sampled step: t_s falls back to t_c; without any hint or reply the device is not ready
    hinted = CloudStepEstimator()
    hinted.prime(CostHint(span_s=0.01))
    assert hinted.steps() == (0.01, 0.01)
    unready = CostObserver()
    unready.prime(latency_s=0.05, device_step_s=0.002)
    assert not unready.ready
    assert CostHint(0.01, 0.002, 0.5).scaled(10.0) == CostHint(0.1, 0.02, 0.5)  # compute scales, the queue does not


def test_exploration_looks_at_drafting_again_less_often_while_the_cloud_stays_cheaper():
    """Costs that keep the device on the cloud: the calibrated point is tried after EXPLORE_EVERY images in a row on
    the cloud, then after twice as many each time (up to EXPLORE_MAX); drafting by choice starts the count over."""
    from ciar_device.policy import EXPLORE_EVERY, EXPLORE_MAX

    cal = OperatingPoint(2, 4)
    cloud_cheap = replace(FOUR_G_CHEAP_CLOUD, cloud_step_s=0.0001, decode_step_s=0.0001)
    obs = CostObserver()
    looks = [i for i in range(2000) if obs.decide(cloud_cheap, cal, R).point == cal]
    gaps = [b - a - 1 for a, b in zip([-1] + looks, looks)]
    assert EXPLORE_MAX == 16 * EXPLORE_EVERY and gaps[:6] == [EXPLORE_EVERY * 2 ** i for i in range(5)] + [EXPLORE_MAX]
    assert obs.decide(FIVE_G_DEAR_CLOUD, cal, R).point != CLOUD_ONLY  # drafting pays: chosen, the count starts over
    assert obs.explore_after == EXPLORE_EVERY and obs.cloud_only_streak == 0
    first = [i for i in range(EXPLORE_EVERY + 1) if obs.decide(cloud_cheap, cal, R).point == cal]
    assert first == [EXPLORE_EVERY]
