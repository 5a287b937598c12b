"""Every message of the device protocol is safe to send again after a lost reply (docs/architecture.md §5, "Retry
semantics"), on real sockets: the device (`ciar_device.connection.DeviceConnection` under a simulated phone's loop) talks to the
endpoint through `services.testing.CuttingProxy`, which cuts the connection at one frame of one type in one direction,
either after relaying it ("deliver") or instead ("drop"). For every frame of an image the image must be bit-identical
to an uninterrupted one, and afterwards the verifier must hold no session and the endpoint count none.

The endpoint's verifier is `services.testing.InProcessBackend`: the Verifier deployment's own calls
(`ciar.engine.service.VerifierService`) on a CloudVerifier in this process."""

import time

import pytest
import torch

from ciar_device import wire

KEY, SECRET = "retry-device-key", "retry-secret"
VERIFY_CUT = ("up", wire.VERIFY, 2, "drop")  # a verify lost on its way: the device then RESUMEs

# (rules, what the cut exercises); each case runs in both modes where the mode is not fixed
CUTS = {
    "HELLO": [("up", wire.HELLO, 1)],
    "WELCOME": [("down", wire.WELCOME, 1)],
    "OPEN": [("up", wire.OPEN, 1)],
    "OPEN_REPLY": [("down", wire.OPEN_REPLY, 1)],
    "VERIFY": [("up", wire.VERIFY, 2)],
    "VERIFY_REPLY": [("down", wire.VERIFY_REPLY, 2)],
    "RESUME": [VERIFY_CUT, ("up", wire.RESUME, 1)],
    "RESUME_REPLY": [VERIFY_CUT, ("down", wire.OPEN_REPLY, 2)],  # the resume's OPEN_REPLY (the open's is the 1st)
    "CLOSE": [("up", wire.CLOSE, 1)],
    "CLOSED": [("down", wire.CLOSED, 1)],
}


@pytest.fixture(scope="module")
def server(tiny_cloud, stub_text):
    from ciar.engine.verifier import CloudVerifier
    from services.device_endpoint import DeviceEndpoint
    from services.config import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    backend = InProcessBackend(CloudVerifier(tiny_cloud, stub_text, max_sessions=4), SECRET)
    endpoint = DeviceEndpoint(backend, [key_digest(KEY)])
    with loopback_endpoint(endpoint) as url:
        yield url, endpoint, backend


def _generate(url, tiny_device, median_tau, sid="img"):
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.decoding.sampling import SamplingParams
    from ciar_device.connection import DeviceConnection

    conn = DeviceConnection(url, KEY, vocab_size=64, array=torch.from_numpy, backoff_s=0.01)
    cfg = method_config("ciar", tau=median_tau, gate="interval", burst=2, network="none", policy="fixed")
    dec = CollabDecoder(tiny_device, conn, cfg, SamplingParams(cfg_scale=2.0), num_tokens=36)
    out = dec.generate("a red circle", seed=3, session_id=sid, trace=True)
    conn.disconnect()
    return out, conn


def _held(endpoint, backend) -> tuple[int, int]:
    """(sessions the verifier holds, sessions the endpoint counts for any device), once the cut's aftermath settled."""
    deadline = time.monotonic() + 5.0
    while True:
        counted = sum(dev.live(1e9) for dev in endpoint.devices.values())
        held = backend.v.num_sessions
        if (held, counted) == (0, 0) or time.monotonic() > deadline:
            return held, counted
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(server, tiny_device, median_tau):
    url, endpoint, backend = server
    out, conn = _generate(url, tiny_device, median_tau, sid="reference")
    assert out.stats.verifications >= 3 and conn.reconnects == 0 and conn.resumes == 0
    assert _held(endpoint, backend) == (0, 0)
    return out


@pytest.mark.parametrize("mode", ["deliver", "drop"])
@pytest.mark.parametrize("frame", list(CUTS))
def test_a_cut_at_any_frame_leaves_the_image_and_nothing_behind(server, reference, tiny_device, median_tau, frame,
                                                                mode):
    from services.testing import CuttingProxy

    url, endpoint, backend = server
    rules = [r if len(r) == 4 else (*r, mode) for r in CUTS[frame]]
    with CuttingProxy(url, rules) as proxy:
        out, conn = _generate(proxy.url, tiny_device, median_tau, sid=f"{frame}-{mode}")
    assert proxy.fired == rules, (proxy.fired, proxy.frames)  # the cut happened where it was asked
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace
    assert not out.stats.degraded
    if mode == "drop" and frame not in ("HELLO", "WELCOME"):  # a lost frame cost the device a connection each
        assert conn.reconnects == len(rules)
    assert _held(endpoint, backend) == (0, 0), f"a session leaked after a cut at {frame} ({mode})"


def test_a_repeated_open_is_answered_as_the_first_and_a_conflicting_one_is_refused(server):
    """The verifier's side of a lost OPEN_REPLY, without a socket: the same device's same OPEN gets the first reply
    again (no forward), another request under the same id or another device's OPEN is a conflict (409 on the socket),
    and once the session moved on (a VERIFY) even the same OPEN is."""
    import asyncio

    from ciar.collab.protocol import SessionConflictError, VerifyRequest
    from ciar.decoding.sampling import SamplingParams
    from ciar_device.wire import OpenRequest

    _, _, backend = server
    req = OpenRequest("dup", "a red circle", 7, SamplingParams(cfg_scale=2.0), 2)

    async def run():
        # the first OPEN and its repeat in flight together: one session, one set of forwards, the same reply
        (a, tok_a), (b, tok_b) = await asyncio.gather(backend.open(req, session_id="dup", device_id="d1"),
                                                      backend.open(req, session_id="dup", device_id="d1"))
        assert a is b and tok_a == tok_b and backend.v.num_sessions == 1
        await backend.stepper.settled()  # nothing else of the engine's (an earlier test's close) still to step
        passes = backend.v.engine.steps
        c, _ = await backend.open(req, session_id="dup", device_id="d1")  # after it completed: replayed, no forward
        assert c is a and backend.v.engine.steps == passes
        for other, device in ((OpenRequest("dup", "a blue square", 7, SamplingParams(cfg_scale=2.0), 2), "d1"),
                              (req, "d2")):
            with pytest.raises(SessionConflictError):
                await backend.open(other, session_id="dup", device_id=device)
        empty = torch.zeros(0, dtype=torch.long)
        await backend.verify(VerifyRequest("dup", empty, empty, torch.zeros(0, 64, dtype=torch.float16)),
                             session_id="dup", device_id="d1", token=tok_a)
        with pytest.raises(SessionConflictError, match="moved on"):
            await backend.open(req, session_id="dup", device_id="d1")
        await backend.close(session_id="dup", device_id="d1", token=tok_a)
        await backend.stepper.settled()  # the close is answered at once and applied on the engine's thread

    asyncio.run(run())
    assert backend.v.num_sessions == 0


def test_a_caller_that_goes_away_withdraws_its_open(server):
    """A cancelled OPEN (its handle call cancelled, its socket cut) frees the session it was building."""
    import asyncio

    from ciar.decoding.sampling import SamplingParams
    from ciar_device.wire import OpenRequest

    _, _, backend = server
    req = OpenRequest("gone", "a red circle", 7, SamplingParams(cfg_scale=2.0), 30)  # 30 prefix tokens: 30 forwards

    async def run():
        task = asyncio.ensure_future(backend.open(req, session_id="gone", device_id="d1"))
        while backend.v.num_sessions == 0:  # admitted: its session exists and is being built
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        steps = backend.v.engine.steps
        # the withdrawal is applied on the engine's thread, then one step drops the finished work from the active
        # list; a second barrier comes after that step (commands are applied between steps)
        await backend.stepper.settled()
        await backend.stepper.settled()
        return steps

    steps = asyncio.run(run())
    assert backend.v.num_sessions == 0 and not backend.v.engine.busy and backend.v.engine.steps <= steps + 1


def test_failed_forwards_are_sent_again_and_the_image_is_unchanged(server, reference, tiny_device, median_tau):
    """Faults inside the verifier's forward (issue 40, item 3; FAULT INJECTION: the model runner's `execute_step` raises
    an out-of-memory error on two steps of the image): the device is answered 503 with a retry-after (or 410 when a
    burst step failed after its verdict), sends again (or resumes), and the image is the uninterrupted one; the
    verifier counts the faults and holds nothing afterwards."""
    url, endpoint, backend = server
    runner = backend.v.runner
    real, calls = runner.execute_step, [0]
    limits = endpoint.limits
    endpoint.limits = type(limits)(**{**limits.__dict__, "retry_after_s": 0.01})  # (no 2 s waits in the test)

    def failing(pieces):
        calls[0] += 1
        if calls[0] in (2, 5):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(pieces)

    runner.execute_step = failing
    before = dict(backend.v.engine.faults)
    try:
        out, conn = _generate(url, tiny_device, median_tau, sid="forward-faults")
    finally:
        runner.execute_step, endpoint.limits = real, limits
    assert calls[0] > 5 and backend.v.engine.faults.get("OutOfMemoryError", 0) - before.get("OutOfMemoryError", 0) == 2
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace and not out.stats.degraded
    assert _held(endpoint, backend) == (0, 0)
