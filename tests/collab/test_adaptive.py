"""The adaptive policy in the device's draft loop (CollabConfig.policy = "adaptive", ciar.collab.policy) on the shipped
world: where the costs say so it hands the rest of the image to the cloud (the hand-over request: the verifier bursts
to the end whether or not the draft was rejected), where they do not it keeps drafting; it never verifies less than
the calibrated point (the gate's decisions are the fixed policy's; spans and bursts only grow); its estimates and
decisions are in the stats. (The model itself: test_policy.py; the fixed policy's tokens: test_decoder.py.)"""

import math

import pytest
import torch

from ciar.collab.verifier import InProcessCloud


class SpyCloud(InProcessCloud):
    """The in-process cloud, remembering every verify request (its span length, burst and hand-over flag)."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.requests = []

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


def test_a_slow_link_and_a_cheap_cloud_hand_the_image_to_the_cloud(world):
    """4G (50 ms per transmission) against a cloud step a tenth of the measured one (a fast accelerator; the margin
    is several-fold, so the box's load cannot flip it): finishing on the cloud beats ~10 more round trips, so the
    device hands over at an escalation; that request is the image's last and completes it."""
    dec, cloud = _decoder(world, policy="adaptive", network="4g", cloud_slowdown=0.1)
    handed = 0
    for i, prompt in enumerate(_prompts(3)):
        cloud.requests.clear()
        out = dec.generate(prompt, seed=i, trace=True)
        st = out.stats
        assert len(out.tokens) == 144 and st.cloud_tokens + st.device_tokens == 144
        if st.handovers:
            handed += 1
            last = cloud.requests[-1]
            assert last.handover and [r.handover for r in cloud.requests].count(True) == 1
            assert st.handover_tokens > 1 and all(w == "cloud" for w in out.trace[-st.handover_tokens:])
            assert last.burst_entropy == 0.0  # the cloud makes every token after it, no early stop
        assert st.est_link_latency_s > 0.04 and st.est_cloud_step_s > 0 and st.est_device_step_s > 0
        assert st.queue_s >= 0 and math.isfinite(st.queue_s)
    assert handed == 3


def test_an_expensive_cloud_step_keeps_the_device_drafting_and_never_verifies_less(world):
    """5G with a cloud step 50x the measured one (an LlamaGen-XL-sized cloud): handing over would cost ~100 cloud
    steps; the device keeps drafting (on this world at the calibrated point: a longer burst costs expensive cloud
    steps and a longer span is rarely accepted). Adaptive changes how an escalation is sent, never which drafts escalate (the
    same gate and threshold as the fixed policy), and every request sends at least the calibrated span (only the
    image's end cuts one) and burst."""
    fixed, _ = _decoder(world, policy="fixed")
    dec, cloud = _decoder(world, policy="adaptive", network="5g", cloud_slowdown=50.0)
    assert (dec.config.gate, dec.config.tau) == (fixed.config.gate, fixed.config.tau)
    span, burst = dec.config.span, dec.config.burst
    for i, prompt in enumerate(_prompts(2)):
        cloud.requests.clear()
        st = dec.generate(prompt, seed=i).stats
        assert st.handovers == 0 and st.verifications == len(cloud.requests) > 0
        assert all(not r.handover and r.burst >= burst for r in cloud.requests)
        assert all(len(r.draft_tokens) >= span for r in cloud.requests[:-1])
        changed = sum(len(r.draft_tokens) > span or r.burst > burst for r in cloud.requests)
        assert st.adapted >= changed  # every request sent at another point is counted (the image's end may cut one)


def test_the_fixed_policy_sends_the_calibrated_point(world):
    dec, cloud = _decoder(world, policy="fixed", network="4g")
    st = dec.generate(_prompts(1)[0], seed=3).stats
    assert st.adapted == st.handovers == 0 and st.est_link_latency_s == 0.0
    assert all(not r.handover and r.burst == dec.config.burst for r in cloud.requests)
