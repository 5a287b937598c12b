"""Trace-driven phones (ciar.capacity.trace): recorded device sessions replayed concurrently give the recorded
replies."""

import asyncio

import numpy as np
import torch

from ciar.sim.decoder import CollabDecoder, method_config
from ciar.engine.core import SchedulerConfig
from ciar.sim.network import NetworkModel
from ciar.capacity.trace import AsyncVerifierClient, TracingClient, load_traces, replay_session, save_traces
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.decoding.sampling import SamplingParams

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)


def _record(tiny_cloud, tiny_device, stub_text, tau):
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    rec = TracingClient(InProcessCloud(verifier))
    n = tiny_cloud.config.block_size
    for i, (method, kw) in enumerate([("ciar", dict(tau=tau, burst=2)), ("ciar", dict(tau=tau, burst=0)),
                                      ("cloud", {})]):
        dec = CollabDecoder(tiny_device, rec, method_config(method, network="none", **kw), PARAMS, num_tokens=n)
        out = dec.generate(f"prompt number {i}", seed=i, session_id=f"rec{i}")
        assert out.tokens.numel() == n
    return rec.sessions


def test_replayed_sessions_match_the_recorded_ones(tiny_cloud, tiny_device, stub_text, median_tau, tmp_path):
    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    assert len(traces) == 3 and traces[0].steps and not traces[2].steps  # CIAR exchanges; cloud-only: one open
    assert any(s.burst_tokens for s in traces[0].steps) or any(s.num_accepted < s.request.draft_tokens.numel()
                                                               for s in traces[0].steps)
    n = tiny_cloud.config.block_size
    assert len(traces[2].prefix_tokens) == n and len(traces[0].prefix_tokens) < n
    save_traces(traces, tmp_path / "t.pt")
    traces = load_traces(tmp_path / "t.pt")

    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=9, scheduler=SchedulerConfig(token_budget=256))
    client = AsyncVerifierClient(verifier)

    async def phones():  # three phones per trace, all at once, on a jittery link
        jobs = [replay_session(t, client, f"phone{k}-{j}", NetworkModel("5g", seed=10 * k + j), device_scale=0.0)
                for j, t in enumerate(traces) for k in range(3)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(phones())
    assert [r.mismatches for r in results] == [0] * 9
    assert [r.exchanges for r in results] == [1 + len(t.steps) for t in traces for _ in range(3)]
    assert max(s["works"] for s in verifier.engine.step_log) > 1  # the phones shared forwards
    assert verifier.num_sessions == 0  # every replayed session was closed


def test_a_mismatch_is_counted_not_hidden(tiny_cloud, tiny_device, stub_text, median_tau):
    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    t = traces[0]
    t.steps[0].next_token = (t.steps[0].next_token + 1) % tiny_cloud.config.vocab_size  # a corrupted record
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    r = asyncio.run(replay_session(t, AsyncVerifierClient(verifier), "x", device_scale=0.0))
    assert r.mismatches >= 1
    assert isinstance(t.steps[0].request.draft_probs, np.ndarray)  # the record as the device sent it, left as it was


def test_a_session_lost_mid_replay_is_resumed_with_identical_replies(tiny_cloud, tiny_device, stub_text, median_tau):
    """The verifier forgets the session (a replica went away, or a new one took the session over): the replayer
    re-creates it from the committed history, as a device does, and every reply still equals the recording."""
    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    t = traces[0]
    assert len(t.steps) >= 3

    class Forgetful(AsyncVerifierClient):
        calls = 0

        async def verify(self, request):
            self.calls += 1
            if self.calls == 3:
                self.verifier.close(request.session_id)
            return await super().verify(request)

    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    r = asyncio.run(replay_session(t, Forgetful(verifier), "x", device_scale=0.0))
    assert r.resumes == 1 and r.mismatches == 0


def _replay_with_recorded_verdicts(cloud, text, traces):
    """Every trace replayed at once on a verifier of `cloud` with the recorded verdicts installed -> (the
    RecordedVerdicts, the ReplayResults)."""
    from ciar.capacity.trace import RecordedVerdicts

    verifier = CloudVerifier(cloud, text, max_sessions=6)
    verdicts = RecordedVerdicts(traces).install(verifier)
    client = AsyncVerifierClient(verifier)

    async def phones():
        return await asyncio.gather(*[replay_session(t, client, f"p{j}", device_scale=0.0)
                                      for j, t in enumerate(traces)])

    return verdicts, asyncio.run(phones())


def test_recorded_verdicts_change_nothing_with_the_recording_weights(tiny_cloud, tiny_device, stub_text, median_tau):
    """With the weights the traces were recorded with, every replaced decision equals the judge's own (the keys by
    seed and image position find the right decisions: nothing changed, nothing unknown)."""
    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    verdicts, results = _replay_with_recorded_verdicts(tiny_cloud, stub_text, traces)
    assert [r.mismatches for r in results] == [0, 0, 0]
    decisions = sum(len(t.prefix_tokens) + len(t.steps) + sum(len(s.burst_tokens) for s in t.steps) for t in traces)
    assert verdicts.replayed >= decisions and verdicts.changed == 0 and verdicts.unrecorded == 0


def test_recorded_verdicts_keep_random_weights_on_the_recorded_course(tiny_cloud, tiny_device, stub_text, median_tau):
    """A cloud of the same shapes with other (random) weights decides otherwise; with the recorded verdicts
    installed its replies still equal the recording, and the replacements that differed are counted."""
    from ciar.models.gpt import build_gpt

    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    torch.manual_seed(7)
    other = build_gpt("scenes-cloud", **{k: getattr(tiny_cloud.config, k) for k in (
        "n_layer", "dim", "n_head", "vocab_size", "cls_token_num", "caption_dim", "block_size")})
    torch.nn.init.normal_(other.output.weight, std=0.3)
    plain = CloudVerifier(other.eval(), stub_text, max_sessions=2)
    assert asyncio.run(replay_session(traces[0], AsyncVerifierClient(plain), "plain", device_scale=0.0)).mismatches
    verdicts, results = _replay_with_recorded_verdicts(other.eval(), stub_text, traces)
    assert [r.mismatches for r in results] == [0, 0, 0]
    assert verdicts.changed > 0 and verdicts.unrecorded == 0


def test_recorded_verdicts_refuse_traces_that_share_a_seed(tiny_cloud, tiny_device, stub_text, median_tau):
    from dataclasses import replace

    import pytest

    from ciar.capacity.trace import RecordedVerdicts

    traces = _record(tiny_cloud, tiny_device, stub_text, median_tau)
    clash = replace(traces[2], open=replace(traces[2].open, seed=traces[0].open.seed))  # cloud-only, other tokens
    with pytest.raises(ValueError, match="distinct seeds"):
        RecordedVerdicts([traces[0], clash])


def _record_windows(tiny_cloud, tiny_device, stub_text, tau):
    """Sessions opened with Jacobi windows: SJD (a cloud-only image by windows) and CIAR with its prefix and bursts
    by windows."""
    verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=2)
    rec = TracingClient(InProcessCloud(verifier))
    n = tiny_cloud.config.block_size
    for i, (method, kw) in enumerate([("sjd", dict(jacobi_window=4)),
                                      ("ciar", dict(tau=tau, burst=3, jacobi_window=4)),
                                      ("ciar", dict(tau=tau, burst=4, burst_entropy=0.9, jacobi_window=3))]):
        dec = CollabDecoder(tiny_device, rec, method_config(method, network="none", **kw), PARAMS, num_tokens=n)
        dec.generate(f"prompt number {i}", seed=10 + i, session_id=f"win{i}")
    return rec.sessions


def test_recorded_verdicts_replay_jacobi_rounds_on_the_recorded_course(tiny_cloud, tiny_device, stub_text, median_tau):
    """Rounds by Jacobi windows keep the recorded tokens and forwards: with the recording's weights and with random
    ones (the rounds' split between forwards is the replay's own; the device never saw it)."""
    from ciar.models.gpt import build_gpt

    traces = _record_windows(tiny_cloud, tiny_device, stub_text, median_tau)
    recorded = [t.open_passes + sum(s.forward_passes for s in t.steps) for t in traces]
    assert traces[0].open.jacobi_window == 4 and recorded[0] < tiny_cloud.config.block_size  # windows at work
    assert any(len(s.burst_tokens) > s.forward_passes - 1 for t in traces[1:] for s in t.steps)  # bursts by windows
    torch.manual_seed(7)
    other = build_gpt("scenes-cloud", **{k: getattr(tiny_cloud.config, k) for k in (
        "n_layer", "dim", "n_head", "vocab_size", "cls_token_num", "caption_dim", "block_size")})
    torch.nn.init.normal_(other.output.weight, std=0.3)
    for cloud in (tiny_cloud, other.eval()):
        verdicts, results = _replay_with_recorded_verdicts(cloud, stub_text, traces)
        assert [r.mismatches for r in results] == [0, 0, 0]
        assert [r.forward_passes for r in results] == recorded
        assert verdicts.unrecorded == 0 and verdicts.replayed > 0


def test_jacobi_rounds_are_split_evenly_between_the_recorded_forwards():
    from ciar.capacity.trace import _split_rounds

    assert _split_rounds(9, 4, first_one=True) == [(1, False), (3, False), (3, False), (2, False)]
    assert _split_rounds(5, 2) == [(3, False), (2, False)]
    assert _split_rounds(4, 2, stop=True) == [(4, False), (0, True)]  # the stop round takes none
    assert _split_rounds(2, 1, stop=True) == [(2, True)]  # the round that stopped took two
    assert _split_rounds(2, 4) is None and _split_rounds(3, 0) is None  # counts that cannot be
