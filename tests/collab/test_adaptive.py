"""The adaptive policy (CollabConfig.policy = "adaptive", ciar_device.policy) on the shipped world: each image's
operating point is chosen before its open from the costs the device observed on its earlier images. Where the costs
say so the image goes to the cloud whole (cloud-only's open), where they do not the device drafts; it never verifies
less than the calibrated point (the gate and tau are the fixed policy's; spans and bursts only grow); the point is
in the stats, and the same request with that point as fixed knobs makes the same image. (The model itself:
test_policy.py; the fixed policy's tokens: test_decoder.py.)"""

import math

import pytest
import torch

from ciar.collab.verifier import InProcessCloud


class SpyCloud(InProcessCloud):
    """The in-process cloud, remembering every open and verify request (its span length, burst and hand-over flag)."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.requests, self.opens = [], []

    def open(self, request):
        self.opens.append(request)
        return super().open(request)

    def verify(self, request):
        self.requests.append(request)
        return super().verify(request)


@pytest.fixture(scope="module")
def world():
    from ciar.world import load_world

    torch.set_num_threads(1)
    return load_world(None)


def _decoder(world, **knobs):
    from ciar.collab.decoder import CollabDecoder, method_config
    from ciar.collab.runtime import make_verifier

    cloud = SpyCloud(make_verifier(world))
    dec = CollabDecoder(world.device_model, cloud, method_config("ciar", **knobs), world.sampling,
                        num_tokens=world.cloud.config.block_size)
    return dec, cloud


def _prompts(n):
    from ciar.data.scenes import scene_at

    return [scene_at("val", 40 + i).caption for i in range(n)]


def test_a_slow_link_and_a_cheap_cloud_give_the_image_to_the_cloud(world):
    """4G (50 ms per transmission) against a cloud step a tenth of the measured one (a fast accelerator; the margin
    is several-fold, so the box's load cannot flip it): finishing on the cloud beats ~10 round trips. The first image
    runs at the calibrated point (nothing observed yet) and teaches the device its costs; the next ones go to the
    cloud whole, from the open (no verify)."""
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
            assert st.est_link_latency_s > 0.04 and st.est_cloud_step_s > 0 and st.est_device_step_s > 0
        assert st.queue_s >= 0 and math.isfinite(st.queue_s)
    observer = dec.observers["4g"]
    assert observer.ready and observer.cloud_only_streak == 2
    # after EXPLORE_EVERY images on the cloud, one is drafted at the calibrated point to look at its costs again
    from ciar_device.policy import EXPLORE_EVERY

    observer.cloud_only_streak = EXPLORE_EVERY
    st = dec.generate(_prompts(1)[0], seed=7).stats
    assert st.handovers == st.adapted == 0 and st.verifications > 0 and observer.cloud_only_streak == 0
    assert dec.generate(_prompts(1)[0], seed=8).stats.handovers == 1


def test_a_new_device_chooses_its_first_image_from_the_handshake_its_own_step_and_the_verifiers_hint(world):
    """A verifier that has answered other devices hints its span forward and sampled step (`cost_hint`); a new
    device primes its estimates with it, its handshake's round trip and one timed step of its own, so on 4G with a
    cheap cloud its very first image goes to the cloud whole, and on 5G with a dear one it drafts."""
    from ciar.collab.decoder import CollabDecoder, method_config

    dec, cloud = _decoder(world, policy="fixed")
    assert cloud.cost_hint() is None  # a verifier that has served nothing has nothing to hint
    dec.generate(_prompts(1)[0], seed=0)
    hint = cloud.cost_hint()
    assert hint.span_s > 0 and hint.queue_s >= 0
    assert world.device_model.step_seconds() > 0
    for knobs, cloud_only in (({"network": "4g", "cloud_slowdown": 0.1}, True),
                              ({"network": "5g", "cloud_slowdown": 50.0}, False)):
        new = CollabDecoder(world.device_model, cloud, method_config("ciar", policy="adaptive", **knobs),
                            world.sampling, num_tokens=world.cloud.config.block_size)
        st = new.generate(_prompts(2)[1], seed=3).stats
        assert st.handovers == st.adapted == int(cloud_only), knobs
        link = knobs["network"]
        prior = new.observers[link].link.prior_latency_s
        assert prior > {"4g": 0.04, "5g": 0.005}[link] and st.est_link_latency_s == pytest.approx(prior)
        assert st.est_cloud_step_s == pytest.approx(hint.span_s * knobs["cloud_slowdown"], rel=0.5)


def test_an_expensive_cloud_step_keeps_the_device_drafting_and_never_verifies_less(world):
    """5G with a cloud step 50x the measured one (an LlamaGen-XL-sized cloud): giving an image to the cloud would
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
    from ciar.collab.runtime import make_decoder, make_verifier

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
    from ciar.collab.runtime import make_decoder, make_verifier

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
