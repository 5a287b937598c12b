"""A generation carried through the wire codec (`ciar_device.wire`) in both directions equals the in-process one, and
the bytes the decoder charges the network model are exactly the bytes of the frames."""

import torch

from ciar_device import wire
from ciar_device.wire import (CLOSE, CLOSED, OPEN, OPEN_REPLY, RESUME, VERIFY, VERIFY_REPLY, CloseReply, CloseRequest,
                              Frame, ResumeRequest, decode_frame, encode_frame)

TOKEN = bytes(range(32))
SID = "s-1"


class WireLoopback:
    """A CloudClient that carries every message through the codec in both directions (encode on one side, decode
    on the other, torch on the cloud side as the server decodes it) and counts the bytes."""

    def __init__(self, inner):
        from ciar.decoding.sampling import SamplingParams

        self.inner, self.vocab_size = inner, inner.vocab_size
        self.up = self.down = 0
        self._cloud = dict(array=torch.from_numpy, sampling=SamplingParams)

    def _cross(self, ftype, body, to_cloud: bool):
        data = encode_frame(Frame(ftype, 1, body, TOKEN if ftype in wire.SESSION_TYPES else b""))
        if to_cloud:
            self.up += len(data)
            return decode_frame(data, **self._cloud).body
        self.down += len(data)
        return decode_frame(data, array=torch.from_numpy).body

    def open(self, request):
        reply = self.inner.open(self._cross(OPEN, request, True))
        return self._cross(OPEN_REPLY, reply, False)

    def verify(self, request):
        reply = self.inner.verify(self._cross(VERIFY, request, True))
        return self._cross(VERIFY_REPLY, reply, False)

    def resume(self, request, history, injected=None):
        r = self._cross(RESUME, ResumeRequest(request, history, injected, self.vocab_size), True)
        return self._cross(OPEN_REPLY, self.inner.resume(r.request, r.history, r.injected), False)

    def close(self, session_id):
        self.inner.close(self._cross(CLOSE, CloseRequest(session_id), True).session_id)
        self._cross(CLOSED, CloseReply(session_id), False)


def test_generation_through_the_codec_equals_in_process(tiny_cloud, tiny_device, stub_text, median_tau):
    """CIAR with interval features through the codec: the same tokens as the direct in-process client, and the bytes
    the decoder charged the network model are exactly the bytes that crossed."""
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.engine.verifier import CloudVerifier, InProcessCloud
    from ciar.decoding.sampling import SamplingParams

    params = SamplingParams(cfg_scale=2.0)
    cfg = method_config("ciar", tau=median_tau, gate="interval", burst=2, network="none")
    runs = []
    for wrap in (lambda c: c, WireLoopback):
        verifier = CloudVerifier(tiny_cloud, stub_text, max_sessions=4)
        client = wrap(InProcessCloud(verifier))
        dec = CollabDecoder(tiny_device, client, cfg, params, num_tokens=36)
        runs.append((dec.generate("a red circle", seed=3, session_id=SID, trace=True), client))
    (a, _), (b, loop) = runs
    assert torch.equal(a.tokens, b.tokens) and a.trace == b.trace
    assert b.stats.verifications > 0 and b.stats.device_tokens > 0
    # everything but the close (sent when the image is done, not charged) was charged at its frame's size
    assert b.stats.bytes_up == loop.up - CloseRequest(SID).nbytes()
    assert b.stats.bytes_down == loop.down - CloseReply(SID).nbytes()
    assert (b.stats.bytes_up, b.stats.bytes_down) == (a.stats.bytes_up, a.stats.bytes_down)
