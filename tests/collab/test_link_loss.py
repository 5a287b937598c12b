"""A device that loses the cloud mid-generation finishes the image alone and says so (stats.degraded)."""

import math

import pytest
import torch

from ciar.sim.decoder import CollabDecoder, method_config
from ciar.sim.network import DOWN_TIMEOUTS, LinkDownError, NetworkModel, get_profile
from ciar.collab.protocol import CloudUnreachableError, SessionLostError
from ciar.sim.recovery import RecoveringClient
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)
PROMPT = "a small red circle at the top on a gray background"


def decode(tiny_cloud, tiny_device, stub_text, seed=4, client=None, trace=True, **overrides):
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    client = client or RecoveringClient(InProcessCloud(verifier))
    dec = CollabDecoder(tiny_device, client, method_config("ciar", **overrides), PARAMS,
                        num_tokens=tiny_cloud.config.block_size)
    return dec.generate(PROMPT, seed=seed, trace=trace), verifier, client


def test_network_model_drops_after_n_messages():
    net = NetworkModel(get_profile("4g"), seed=0, drop_after=3)
    for _ in range(3):
        net.transmit(100)
    with pytest.raises(LinkDownError) as e:
        net.transmit(100)
    assert isinstance(e.value, CloudUnreachableError)
    assert e.value.waited_s == pytest.approx(DOWN_TIMEOUTS * get_profile("4g").timeout_s)
    with pytest.raises(ValueError, match="drop_after"):
        NetworkModel("5g", drop_after=-1)


@pytest.mark.parametrize("method", ["ciar", "eagle"])
def test_link_drop_mid_generation_finishes_on_the_device(tiny_cloud, tiny_device, stub_text, median_tau, method):
    tau = {"tau": median_tau} if method == "ciar" else {"gate": "always"}  # eagle-like: every token verified
    ref, _, _ = decode(tiny_cloud, tiny_device, stub_text, network="5g", **tau)
    assert ref.stats.verifications >= 3 and ref.stats.degraded == 0
    # open = 2 messages, each verify 2 more: the link goes down on the third verify's uplink
    got, verifier, client = decode(tiny_cloud, tiny_device, stub_text, network="5g", link_drop_after=6, **tau)
    st = got.stats
    n = tiny_cloud.config.block_size
    assert st.total_tokens == n and got.tokens.numel() == n
    assert st.degraded == 1 and 0 < st.degraded_tokens < n
    assert st.cloud_requests == 3 and st.verifications == 2  # the open and two verifies got through
    # everything decided before the drop is what the undisturbed run decided; the rest is the device's alone
    first = n - st.degraded_tokens
    assert got.tokens[:first].tolist() == ref.tokens[:first].tolist()
    assert got.trace[first:] == ["device"] * st.degraded_tokens
    assert st.comm_s >= DOWN_TIMEOUTS * get_profile("5g").timeout_s
    assert verifier.num_sessions == 0 and not client._sessions  # nothing left behind
    again, _, _ = decode(tiny_cloud, tiny_device, stub_text, network="5g", link_drop_after=6, **tau)
    assert again.tokens.tolist() == got.tokens.tolist()  # a degraded image is still seeded


def test_link_drop_without_fallback_raises(tiny_cloud, tiny_device, stub_text, median_tau):
    with pytest.raises(LinkDownError):
        decode(tiny_cloud, tiny_device, stub_text, tau=median_tau, link_drop_after=4, fallback=False)


@pytest.mark.parametrize("drop_after", [0, 1])
def test_link_down_before_the_open_reply_fails_and_leaves_nothing(tiny_cloud, tiny_device, stub_text, drop_after):
    """No caption encoding without the open's reply: the request fails (the API answers 503); a session the
    cloud opened before its reply was lost is closed, and the client keeps no state."""
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    client = RecoveringClient(InProcessCloud(verifier))
    with pytest.raises(CloudUnreachableError):
        decode(tiny_cloud, tiny_device, stub_text, client=client, link_drop_after=drop_after, tau=1.0)
    assert verifier.num_sessions == 0 and not client._sessions


class GoneCloud(InProcessCloud):
    """Test double: the verifier pool vanishes after `ok` verifies (each later verify finds the session lost and
    every resume fails as a transport's retry budget would)."""

    def __init__(self, verifier, ok: int):
        super().__init__(verifier)
        self.ok, self.calls = ok, 0

    def verify(self, request):
        self.calls += 1
        if self.calls > self.ok:
            raise SessionLostError("replica gone")
        return super().verify(request)

    def resume(self, request, history, injected=None):
        raise CloudUnreachableError("no verifier replica answered")


def test_unreachable_verifier_pool_degrades_instead_of_failing(tiny_cloud, tiny_device, stub_text, median_tau):
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    got, _, _ = decode(tiny_cloud, tiny_device, stub_text, client=RecoveringClient(GoneCloud(verifier, ok=1)),
                       tau=median_tau, network="none")
    st = got.stats
    assert st.degraded == 1 and st.verifications == 1 and st.total_tokens == tiny_cloud.config.block_size
    assert math.isfinite(st.total_s)
    d = st.to_dict()
    assert d["degraded"] == 1 and d["degraded_tokens"] == st.degraded_tokens


def test_link_drop_after_is_validated():
    with pytest.raises(ValueError, match="link_drop_after"):
        method_config("ciar", link_drop_after=-2)
    with pytest.raises(ValueError, match="link_drop_after"):
        method_config("ciar", link_drop_after=1.5)
    assert method_config("ciar", link_drop_after=torch.tensor(3).item()).link_drop_after == 3


def test_link_down_error_pickles_with_its_wait():
    import pickle

    e = pickle.loads(pickle.dumps(LinkDownError("down", waited_s=0.09)))
    assert isinstance(e, CloudUnreachableError) and str(e) == "down" and e.waited_s == 0.09
