"""Issue 40, item 5 ("the RESUME 403"): a device whose socket is cut resumes on a verifier that signs session tokens
with another secret than the one that issued its token. That is what a redeploy does whose config changes the API
keys without $CIAR_SESSION_SECRET (`AppConfig.session_secret` derives the secret from them, the laptop / test
setting), or an operator rotating $CIAR_SESSION_SECRET: Serve replaces the Verifier replicas (new init args), their
sessions are gone, and the device's RESUME carries the token the old secret made. Before the fix the new replica
answered it 403 "invalid session token" and the device's image failed (a 403 is not retried).

Here the endpoint's backend is swapped, between the device's OPEN and its RESUME, for another in-process verifier
with another secret (what the redeploy does), while the device's second VERIFY is in flight and its socket cut
(`ciar.testing.cutting_connection`). The image must finish, bit-identical to an uncut one; a forged token is still
refused."""

import asyncio
import time

import pytest
import torch

KEY = "rotation-device-key"
OLD, NEW = "secret-before-the-redeploy", "secret-after-the-redeploy"


class Redeploy:
    """The Verifier deployment's handle across a redeploy: calls go to `old` until the `at`-th VERIFY arrives, then
    (that VERIFY included) to `new`, a fresh verifier with another secret and none of the old one's sessions."""

    def __init__(self, old, new, at: int):
        self.old, self.new, self.at, self.verifies = old, new, at, 0

    @property
    def current(self):
        return self.new if self.verifies >= self.at else self.old

    async def open(self, request, **kw):
        return await self.current.open(request, **kw)

    async def verify(self, request, **kw):
        self.verifies += 1
        return await self.current.verify(request, **kw)

    async def resume(self, request, history, injected, **kw):
        return await self.current.resume(request, history, injected, **kw)

    async def close(self, **kw):
        return await self.current.close(**kw)

    async def cost_hint(self):
        return await self.current.cost_hint()


def _backend(tiny_cloud, stub_text, secret):
    from ciar.engine.verifier import CloudVerifier
    from services.testing import InProcessBackend

    return InProcessBackend(CloudVerifier(tiny_cloud, stub_text, max_sessions=4), secret)


def _generate(conn, tiny_device, median_tau, sid):
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.decoding.sampling import SamplingParams

    cfg = method_config("ciar", tau=median_tau, gate="interval", burst=2, network="none", policy="fixed")
    dec = CollabDecoder(tiny_device, conn, cfg, SamplingParams(cfg_scale=2.0), num_tokens=36)
    out = dec.generate("a red circle", seed=3, session_id=sid, trace=True)
    conn.disconnect()
    return out


@pytest.fixture(scope="module")
def backends(tiny_cloud, stub_text):
    old, new = _backend(tiny_cloud, stub_text, OLD), _backend(tiny_cloud, stub_text, NEW)
    yield old, new
    old.shutdown()
    new.shutdown()


@pytest.mark.parametrize("cut", [True, False], ids=["socket-cut", "no-cut"])
def test_a_resume_after_a_redeploy_that_changed_the_secret_finishes_the_image(backends, tiny_device, median_tau, cut):
    """With the cut, the device resumes after reconnecting (the flake's path); without, the new verifier answers its
    VERIFY 410 (it does not hold the session) and the device resumes."""
    from ciar.engine.service import session_token
    from ciar.testing import cutting_connection
    from ciar_device.connection import DeviceConnection
    from services.device_endpoint import DeviceEndpoint
    from services.config import key_digest
    from services.testing import loopback_endpoint

    old, new = backends
    with loopback_endpoint(DeviceEndpoint(old, [key_digest(KEY)])) as url:
        conn = DeviceConnection(url, KEY, vocab_size=64, array=torch.from_numpy, backoff_s=0.01)
        reference = _generate(conn, tiny_device, median_tau, "reference")
    assert reference.stats.verifications >= 3 and conn.resumes == 0

    redeploy = Redeploy(old, new, at=2)
    with loopback_endpoint(DeviceEndpoint(redeploy, [key_digest(KEY)])) as url:
        conn = cutting_connection(url, KEY, 64, cuts=(2,) if cut else (), array=torch.from_numpy, backoff_s=0.01)
        resumed = new.resumed
        out = _generate(conn, tiny_device, median_tau, "img")  # before the fix: ServerError 403 on the RESUME
    assert redeploy.verifies > 2 and new.resumed == resumed + 1 and conn.resumes == 1  # resumed on the new one
    assert conn.reconnects == (1 if cut else 0)
    assert torch.equal(out.tokens, reference.tokens) and out.trace == reference.trace
    assert not out.stats.degraded
    end = time.monotonic() + 5.0
    while new.v.num_sessions and time.monotonic() < end:
        time.sleep(0.05)
    assert new.v.num_sessions == 0  # the device's CLOSE, with the old secret's token, closed the resumed session
    # the old verifier's copy is what a replaced replica takes with it; here it lives on: free it
    (scoped,) = old.v.table.sessions
    asyncio.run(old.close(session_id=scoped, device_id=scoped.split("/")[0],
                          token=session_token(OLD, scoped, scoped.split("/")[0])))


def test_tokens_of_this_secret_are_checked_and_of_another_one_recognised(backends):
    """The verifier's side, without a socket: a forged or mangled token is refused (403) whatever key id it shows;
    a token another secret made for this very session and device cannot be checked here: VERIFY and CLOSE treat
    the session as not held by it (410 / nothing to close), a RESUME with it re-creates the session, and from
    then on that token drives the session on this verifier."""
    from ciar.collab.protocol import SessionLostError, SessionTokenError, VerifyRequest
    from ciar.engine.service import session_token
    from ciar.decoding.sampling import SamplingParams
    from ciar_device.wire import OpenRequest

    old, new = backends
    req = OpenRequest("rot", "a red circle", 7, SamplingParams(cfg_scale=2.0), 2)
    empty = torch.zeros(0, dtype=torch.long)
    verify = VerifyRequest("rot", empty, empty, torch.zeros(0, 64, dtype=torch.float16))

    async def run():
        reply, mine = await old.open(req, session_id="rot", device_id="d1")
        assert len(bytes.fromhex(mine)) == 32 and mine == session_token(OLD, "rot", "d1")
        history = torch.as_tensor(reply.prefix_tokens).reshape(-1)
        # forged: this generation's key id with a wrong MAC, a random token, a zero one, another session's
        forged = mine[:16] + ("0" if mine[16] != "0" else "1") + mine[17:]
        for token in (forged, "ab" * 32, "00" * 32, "", session_token(OLD, "other", "d1"),
                      session_token(OLD, "rot", "d2")):
            with pytest.raises(SessionTokenError):
                await old.verify(verify, session_id="rot", device_id="d1", token=token)
        # another generation's token: the right session, not checkable by this secret
        with pytest.raises(SessionLostError):
            await new.verify(verify, session_id="rot", device_id="d1", token=mine)
        await new.close(session_id="rot", device_id="d1", token=mine)  # nothing held: nothing to do
        for token in ("ab" * 32, session_token(OLD, "other", "d1"), session_token(OLD, "rot", "d2")):
            with pytest.raises(SessionTokenError):  # not even for a RESUME: not a token of this session and device
                await new.resume(req, history, None, session_id="rot", device_id="d1", token=token)
        await new.resume(req, history, None, session_id="rot", device_id="d1", token=mine)
        await new.verify(verify, session_id="rot", device_id="d1", token=mine)  # adopted with the session
        theirs = session_token(NEW, "rot", "d1")
        await new.verify(verify, session_id="rot", device_id="d1", token=theirs)  # this generation's, as always
        await new.close(session_id="rot", device_id="d1", token=mine)
        await old.close(session_id="rot", device_id="d1", token=mine)
        await new.stepper.settled()
        await old.stepper.settled()
        with pytest.raises(SessionLostError):  # closed: the adopted token does not bring it back
            await new.verify(verify, session_id="rot", device_id="d1", token=mine)

    asyncio.run(run())
    assert old.v.num_sessions == new.v.num_sessions == 0
