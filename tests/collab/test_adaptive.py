"""The adaptive policy (CollabConfig.policy = "adaptive", ciar_device.policy) on the shipped world: each image's
operating point is chosen before its open from the costs the device observed on its earlier images. Where the costs
say so the image goes to the cloud whole (cloud-only's open), where they do not the device drafts; it never verifies
less than the calibrated point (the gate and tau are the fixed policy's; spans and bursts only grow); the point is
in the stats, and the same request with that point as fixed knobs makes the same image. (The model itself:
test_policy.py; the fixed policy's tokens: test_decoder.py.)

The tests of what the policy chooses fix the costs the device observes (`SpyCloud`, `fixed_costs`): the verifier's
forwards and the device's steps are charged at figures measured once on the box these tests were written on, not
timed, so the choice follows from the knobs (the link, the cloud's slowdown) whatever this machine's speed or load
(timed, a loaded box's stalls moved the device's estimates, and with them the choice)."""

import dataclasses
import math
import types

import pytest
import torch

from ciar.engine.verifier import InProcessCloud
from ciar_device.loop import Clock
from ciar_device.policy import CostHint

# the costs measured once on the shipped world (one CPU thread, the box these tests were written on), charged as is
CLOUD_SPAN_S = 0.014  # the verifier's forward that judges a span
CLOUD_STEP_S = 0.0055  # each token the verifier samples itself (a burst's, an open's prefix)
DEVICE_STEP_S = 0.003  # the device's draft, gate and bookkeeping per timed block


class SpyCloud(InProcessCloud):
    """The in-process cloud, remembering every open and verify request (its span length, burst and hand-over flag).
    Its replies and hint report the fixed costs (CLOUD_SPAN_S, CLOUD_STEP_S, no queue wait) instead of the times
    its forwards took here; the tokens are the verifier's own."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.requests, self.opens = [], []

    def open(self, request):
        self.opens.append(request)
        reply = super().open(request)
        return dataclasses.replace(reply, cloud_s=CLOUD_STEP_S * reply.forward_passes, queue_s=0.0)

    def verify(self, request):
        self.requests.append(request)
        reply = super().verify(request)
        return dataclasses.replace(reply, cloud_s=CLOUD_SPAN_S + CLOUD_STEP_S * (reply.forward_passes - 1),
                                   queue_s=0.0)

    def cost_hint(self):
        hint = super().cost_hint()  # None until the verifier has something to hint (not a timing)
        if hint is None:
            return None
        return CostHint(CLOUD_SPAN_S if hint.span_s is not None else None,
                        CLOUD_STEP_S if hint.step_s is not None else None, 0.0)


class FixedClock(Clock):
    """The device's compute clock charging DEVICE_STEP_S per timed block (x its slowdown), not the time it took."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.seconds += DEVICE_STEP_S


@pytest.fixture
def fixed_costs(monkeypatch, world):
    """Every cost a device observes fixed: its timed blocks (FixedClock), its one timed step before its first image,
    and the wall time of an in-process call, which the link is charged for beyond the reply's cloud seconds (none:
    the link is the network model's alone). The verifier's costs: `SpyCloud`."""
    monkeypatch.setattr("ciar.sim.decoder.Clock", FixedClock)
    monkeypatch.setattr("ciar.sim.decoder.time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    monkeypatch.setattr(world.device_model, "step_seconds", lambda rows=1, repeats=3: DEVICE_STEP_S)


@pytest.fixture(scope="module")
def world():
    from ciar.world import load_world

    torch.set_num_threads(1)
    return load_world(None)


def _decoder(world, **knobs):
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.sim.runtime import make_verifier

    cloud = SpyCloud(make_verifier(world))
    dec = CollabDecoder(world.device_model, cloud, method_config("ciar", **knobs), world.sampling,
                        num_tokens=world.cloud.config.block_size)
    return dec, cloud


def _prompts(n):
    from ciar.data.scenes import scene_at

    return [scene_at("val", 40 + i).caption for i in range(n)]


def test_a_slow_link_and_a_cheap_cloud_give_the_image_to_the_cloud(world, fixed_costs):
    """4G (50 ms per transmission) against a cloud step a tenth of the fixed one (a fast accelerator): finishing on
    the cloud beats ~10 round trips. The first image runs at the calibrated point (nothing observed yet) and teaches
    the device its costs; the next ones go to the cloud whole, from the open (no verify)."""
    dec, cloud = _decoder(world, policy="adaptive", network="4g", cloud_slowdown=0.1)
    for i, prompt in enumerate(_prompts(3)):
        cloud.requests.clear()
        cloud.opens.clear()
        out = dec.generate(prompt, seed=i, trace=True)
        st = out.stats
        assert len(out.tokens) == 144 and st.cloud_tokens + st.device_tokens == 144
        if i == 0:
            assert st.handovers == st.adapted == 0 and st.verifications == len(cloud.requests) > 0
            assert (st.span_used, st.burst_used) == (dec.config.span, dec.config.burst)
        else:
            assert st.handovers == st.adapted == 1 and not cloud.requests
            assert cloud.opens[0].prefix_len == 144 and not cloud.opens[0].want_caption
            assert out.trace == ["cloud"] * 144
            assert st.est_link_latency_s > 0.04 and st.est_cloud_step_s == pytest.approx(0.1 * CLOUD_SPAN_S)
            assert st.est_device_step_s > 0
        assert st.queue_s >= 0 and math.isfinite(st.queue_s)
    observer = dec.observers["4g"]
    assert observer.ready and observer.cloud_only_streak == 2
    # after EXPLORE_EVERY images on the cloud, one is drafted at the calibrated point to look at its costs again
    from ciar_device.policy import EXPLORE_EVERY

    observer.cloud_only_streak = EXPLORE_EVERY
    st = dec.generate(_prompts(1)[0], seed=7).stats
    assert st.handovers == st.adapted == 0 and st.verifications > 0 and observer.cloud_only_streak == 0
    assert dec.generate(_prompts(1)[0], seed=8).stats.handovers == 1


def test_a_new_device_chooses_its_first_image_from_the_handshake_its_own_step_and_the_verifiers_hint(world,
                                                                                                      fixed_costs):
    """A verifier that has answered other devices hints its span forward and sampled step (`cost_hint`); a new
    device primes its estimates with it, its handshake's round trip and one timed step of its own, so on 4G with a
    cheap cloud its very first image goes to the cloud whole, and on 5G with a dear one it drafts."""
    from ciar.sim.decoder import CollabDecoder, method_config

    dec, cloud = _decoder(world, policy="fixed")
    assert cloud.cost_hint() is None  # a verifier that has served nothing has nothing to hint
    dec.generate(_prompts(1)[0], seed=0)
    hint = cloud.cost_hint()
    assert hint.span_s == CLOUD_SPAN_S and hint.queue_s == 0.0
    measured = cloud.verifier.cost_hint()  # what the verifier timed here (the spy reports the fixed figures)
    assert measured.span_s > 0 and measured.queue_s >= 0
    assert type(world.device_model).step_seconds(world.device_model) > 0  # timed (fixed_costs patched the instance)
    for knobs, cloud_only in (({"network": "4g", "cloud_slowdown": 0.1}, True),
                              ({"network": "5g", "cloud_slowdown": 50.0}, False)):
        new = CollabDecoder(world.device_model, cloud, method_config("ciar", policy="adaptive", **knobs),
                            world.sampling, num_tokens=world.cloud.config.block_size)
        st = new.generate(_prompts(2)[1], seed=3).stats
        assert st.handovers == st.adapted == int(cloud_only), knobs
        link = knobs["network"]
        prior = new.observers[link].link.prior_latency_s
        assert prior > {"4g": 0.04, "5g": 0.005}[link] and st.est_link_latency_s == pytest.approx(prior)
        assert st.est_cloud_step_s == pytest.approx(hint.span_s * knobs["cloud_slowdown"])  # the hint, scaled
        assert st.est_device_step_s == pytest.approx(DEVICE_STEP_S)  # its one timed step


def test_an_expensive_cloud_step_keeps_the_device_drafting_and_never_verifies_less(world, fixed_costs):
    """5G with a cloud step 50x the fixed one (an LlamaGen-XL-sized cloud): giving an image to the cloud would
    cost ~135 cloud steps; the device drafts. Adaptive changes how an escalation is sent, never which drafts escalate
    (the fixed policy's gate and threshold), and every request of an image goes at its one point: a span and burst
    at least the calibrated ones (only the image's end cuts a span)."""
    fixed, _ = _decoder(world, policy="fixed")
    dec, cloud = _decoder(world, policy="adaptive", network="5g", cloud_slowdown=50.0)
    assert (dec.config.gate, dec.config.tau) == (fixed.config.gate, fixed.config.tau)
    span, burst = dec.config.span, dec.config.burst
    for i, prompt in enumerate(_prompts(3)):
        cloud.requests.clear()
        st = dec.generate(prompt, seed=i).stats
        assert st.handovers == 0 and st.verifications == len(cloud.requests) > 0
        assert st.span_used >= span and st.burst_used >= burst and st.adapted == int((st.span_used, st.burst_used)
                                                                                     != (span, burst))
        assert all(r.burst == st.burst_used for r in cloud.requests)
        assert all(len(r.draft_tokens) == st.span_used for r in cloud.requests[:-1])


def test_the_reported_point_makes_the_same_image_again(world):
    """Reproducibility: an adaptive image equals the fixed policy's image at the point its stats report (same
    prompt and seed); an image given to the cloud whole equals cloud-only's open (prefix_rate 1)."""
    from ciar.sim.runtime import make_decoder, make_verifier

    verifier = make_verifier(world)
    prompt = _prompts(1)[0]
    for knobs in ({"network": "5g", "cloud_slowdown": 50.0}, {"network": "4g", "cloud_slowdown": 0.1}):
        dec = make_decoder(world, verifier, "ciar", policy="adaptive", **knobs)
        dec.generate(_prompts(2)[1], seed=99)  # the device observes its costs
        out = dec.generate(prompt, seed=5)
        st = out.stats
        again = make_decoder(world, verifier, "ciar", policy="fixed", **knobs,
                             **({"prefix_rate": 1.0} if st.handovers else {"span": st.span_used,
                                                                            "burst": st.burst_used}))
        assert torch.equal(again.generate(prompt, seed=5).tokens, out.tokens)


def test_the_fixed_policy_sends_the_calibrated_point(world):
    dec, cloud = _decoder(world, policy="fixed", network="4g")
    for seed in (3, 4):  # the second image too: what the device observed does not move it
        st = dec.generate(_prompts(1)[0], seed=seed).stats
        assert st.adapted == st.handovers == 0 and st.est_link_latency_s == 0.0
        assert (st.span_used, st.burst_used) == (dec.config.span, dec.config.burst)
    assert all(r.burst == dec.config.burst for r in cloud.requests)


def test_graceful_degradation_raises_tau_within_its_budget_and_says_so(world):
    """Off by default. With a verifier limit every reply exceeds (1 µs per exchange), the first image (nothing
    observed) runs at the calibrated tau, the next ones at tau x overload_tau_factor: no more cloud calls than at the
    calibrated tau, the stats say so, and the same request at tau_used makes the same image."""
    from ciar.sim.runtime import make_decoder, make_verifier

    verifier = make_verifier(world)
    dec = make_decoder(world, verifier, "ciar", policy="fixed")
    assert dec.config.overload_verifier_s is None
    assert dec.generate(_prompts(1)[0], seed=0).stats.overloaded == 0
    dec = make_decoder(world, verifier, "ciar", policy="fixed", overload_verifier_s=1e-6, overload_tau_factor=1.5)
    tau = dec.config.tau
    first = dec.generate(_prompts(1)[0], seed=0).stats
    assert first.overloaded == 0 and first.tau_used == tau
    calibrated = make_decoder(world, verifier, "ciar", policy="fixed").generate(_prompts(2)[1], seed=1)
    out = dec.generate(_prompts(2)[1], seed=1)
    assert out.stats.overloaded == 1 and out.stats.tau_used == pytest.approx(1.5 * tau)
    assert out.stats.cloud_tokens <= calibrated.stats.cloud_tokens
    again = make_decoder(world, verifier, "ciar", policy="fixed", tau=out.stats.tau_used)
    assert torch.equal(again.generate(_prompts(2)[1], seed=1).tokens, out.tokens)
