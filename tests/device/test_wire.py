"""The wire codec (ciar_device.wire): every message type round-trips, its frame is exactly as long as the network
model charges (`nbytes`), and malformed frames fail as WireError and nothing else (a generation carried through the
codec: tests/collab/test_wire_accounting.py)."""

import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciar_device import wire
from ciar_device.wire import (CLOSE, CLOSED, ERROR, HELLO, OPEN, OPEN_REPLY, RESUME, VERIFY, VERIFY_REPLY, WELCOME,
                              CloseReply, CloseRequest, ErrorReply, Frame, Hello, InjectedFeatures, OpenReply,
                              OpenRequest, ResumeRequest, RuleConfig, Sampling, VerifyReply, VerifyRequest, Welcome,
                              WireError, VersionError, decode_frame, encode_frame)

V = 1024
TOKEN = bytes(range(32))


def _rng(seed=0):
    return np.random.default_rng(seed)


def _open(sid="dev-7/s1", prompt="a small blue square at the top left on a white background"):
    return OpenRequest(sid, prompt, 2**40 + 3, Sampling(1.5, 0.9, 100, 0.95), 9,
                       RuleConfig("lantern", 500, 0.2, 0.8, gsd_ranks=3, gsd_prob_gap=0.25, gsd_distance=1.5),
                       jacobi_window=12)


def _messages():
    """One frame of every type, with numpy arrays (what a device holds)."""
    r = _rng()
    probs = r.random((2, V)).astype(np.float16)
    return [
        Frame(HELLO, 1, Hello("ciar-dev-device-key", "ciar-device/0.1")),
        Frame(WELCOME, 1, Welcome("d-1234", 2 << 20, 8, 200.0, 60.0, "ciar", 0.012, 0.004, 0.001)),
        Frame(OPEN, 2, _open()),
        Frame(OPEN_REPLY, 2, OpenReply("s1", r.integers(0, V, 9), r.standard_normal((40, 384)).astype(np.float16),
                                       r.random(40) > 0.3, 0.0123, 10, V, 0.0021), TOKEN),
        Frame(OPEN_REPLY, 3, OpenReply("s1", np.zeros(0, np.int64), None, None, 0.5, 1, V), TOKEN),
        Frame(VERIFY, 4, VerifyRequest("s1", r.integers(0, V, 5), r.integers(0, V, 2), probs,
                                       r.standard_normal((5, 256)).astype(np.float16),
                                       r.standard_normal((5, 20)).astype(np.float16), 4, 0.25), TOKEN),
        Frame(VERIFY, 5, VerifyRequest("s1", np.zeros(0, np.int64), r.integers(0, V, 2), probs, burst=140), TOKEN),
        Frame(VERIFY_REPLY, 4, VerifyReply("s1", 1, 1023, True, 0.004, 7, 3, False, r.integers(0, V, 4), V, 0.0125)),
        Frame(VERIFY_REPLY, 5, VerifyReply("s1", 2, 0, False, 0.004, 1, 1, True, None, V)),
        Frame(RESUME, 6, ResumeRequest(replace(_open(), want_caption=False), r.integers(0, V, 30),
                                       InjectedFeatures(np.array([3, 4, 9]),
                                                        r.standard_normal((3, 256)).astype(np.float16),
                                                        r.standard_normal((3, 20)).astype(np.float16)), V), TOKEN),
        Frame(RESUME, 7, ResumeRequest(_open(), np.zeros(0, np.int64), None, V), TOKEN),
        Frame(CLOSE, 8, CloseRequest("s1"), TOKEN),
        Frame(CLOSED, 8, CloseReply("s1")),
        Frame(ERROR, 9, ErrorReply(503, "no free KV-cache slot; retry later", 2.0, "s1", "")),
    ]


def _size(body):
    return body.nbytes(body.draft_probs.shape[-1]) if isinstance(body, VerifyRequest) else body.nbytes()


def _equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and np.array_equal(np.asarray(a), np.asarray(b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a).__name__ == type(b).__name__ and all(
            _equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, float):
        return a == pytest.approx(b)
    return a == b


@pytest.mark.parametrize("frame", _messages(), ids=lambda f: f.name)
def test_every_message_round_trips_at_its_accounted_size(frame):
    data = encode_frame(frame)
    assert len(data) == _size(frame.body), "the network model must charge the bytes the socket carries"
    back = decode_frame(data)
    assert back.type == frame.type and back.request_id == frame.request_id
    assert back.token == (frame.token if frame.type in wire.SESSION_TYPES else b"")
    assert _equal(frame.body, back.body), back.body


def test_torch_tensors_in_and_out():
    """The cluster encodes torch tensors and decodes into torch (array=, sampling=): the same bytes as numpy."""
    from ciar.decoding.sampling import SamplingParams

    frame = _messages()[5]
    b = frame.body
    tb = VerifyRequest(b.session_id, torch.from_numpy(b.new_tokens), torch.from_numpy(b.draft_tokens),
                       torch.from_numpy(b.draft_probs), torch.from_numpy(b.device_hidden),
                       torch.from_numpy(b.features), b.burst, b.burst_entropy)
    assert encode_frame(replace(frame, body=tb)) == encode_frame(frame)
    back = decode_frame(encode_frame(frame), array=torch.from_numpy)
    assert isinstance(back.body.draft_probs, torch.Tensor) and back.body.draft_probs.dtype == torch.float16
    assert back.body.new_tokens.dtype == torch.int64
    opened = decode_frame(encode_frame(_messages()[2]), sampling=SamplingParams)
    assert opened.body.sampling == SamplingParams(1.5, 0.9, 100, 0.95)


def test_float16_and_bitpacking_are_exact():
    """Draft distributions cross as the same float16 bits; token ids at ceil(log2 V) bits, every id of V."""
    q = torch.softmax(torch.randn(3, V), -1).half()
    back = decode_frame(encode_frame(Frame(VERIFY, 1, VerifyRequest("s", torch.zeros(0, dtype=torch.long),
                                                                     torch.arange(3), q), TOKEN)))
    assert np.array_equal(back.body.draft_probs.view(np.uint16), q.numpy().view(np.uint16))
    for vocab in (2, 3, 1024, 1025, 16384):
        ids = np.arange(vocab)
        rep = VerifyReply("s", 0, 0, True, 0.0, 1, 1, False, ids[: min(vocab, 60000)], vocab)
        out = decode_frame(encode_frame(Frame(VERIFY_REPLY, 1, rep))).body
        assert np.array_equal(out.burst_tokens, rep.burst_tokens)
    assert wire.token_bytes(8, 1024) == 10 and wire.token_bytes(1, 16384) == 2 and wire.token_bytes(0, 1024) == 0


def test_other_version_and_garbage_are_refused():
    data = bytearray(encode_frame(_messages()[0]))
    old = wire.PROTOCOL_VERSION - 1  # the previous version (4: no GSD group in OPEN)
    data[2] = old
    with pytest.raises(VersionError, match=f"version {old}.*speaks version {wire.PROTOCOL_VERSION}") as e:
        decode_frame(bytes(data))
    assert e.value.version == old
    with pytest.raises(WireError, match="bad magic"):
        decode_frame(b"XX" + bytes(data[2:]))
    with pytest.raises(WireError, match="truncated"):
        decode_frame(b"CI\x01")
    with pytest.raises(WireError, match="unknown frame type"):
        decode_frame(struct.pack("<2sBBI", b"CI", wire.PROTOCOL_VERSION, 99, 0))
    ok = encode_frame(_messages()[5])
    with pytest.raises(WireError, match="trailing"):
        decode_frame(ok + b"\x00")
    with pytest.raises(WireError, match="truncated"):
        decode_frame(ok[:-1])


def test_values_that_do_not_fit_are_refused_when_encoding():
    with pytest.raises(WireError, match="token ids"):
        encode_frame(Frame(VERIFY, 1, VerifyRequest("s", np.array([V]), np.zeros(1, np.int64),
                                                    np.ones((1, V), np.float16)), TOKEN))
    with pytest.raises(WireError, match="too long"):
        encode_frame(Frame(CLOSE, 1, CloseRequest("x" * 300), TOKEN))
    with pytest.raises(WireError, match="OPEN carries a OpenRequest, got Hello"):
        encode_frame(Frame(OPEN, 1, Hello("k")))


def test_decoded_values_are_checked():
    """Non-finite or negative draft probabilities, token ids >= V: WireError naming the field."""
    frame = _messages()[6]
    bad = replace(frame.body, draft_probs=np.full((2, V), np.inf, np.float16))
    with pytest.raises(WireError) as e:
        decode_frame(encode_frame(replace(frame, body=bad)))
    assert e.value.field == "draft_probs"
    neg = replace(frame.body, draft_probs=-np.ones((2, V), np.float16))
    with pytest.raises(WireError, match=">= 0"):
        decode_frame(encode_frame(replace(frame, body=neg)))
    # a vocabulary of 1000 packs ids at 10 bits: 1023 fits the bits but not the vocabulary
    data = bytearray(encode_frame(Frame(VERIFY_REPLY, 1, VerifyReply("s", 0, 0, True, 0.0, 1, 1, False,
                                                                     np.array([999]), 1000))))
    data[-2:] = struct.pack("<H", 1023)
    with pytest.raises(WireError, match=r"\[0, 1000\)"):
        decode_frame(bytes(data))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_frames_fail_cleanly(data):
    """Random bytes and valid frames with bytes flipped, cut or appended: decode returns a Frame or raises WireError,
    never another exception."""
    frames = [encode_frame(f) for f in _messages()]
    base = bytearray(data.draw(st.sampled_from(frames)))
    op = data.draw(st.sampled_from(["flip", "cut", "append", "random"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(base) - 1))
            base[i] = data.draw(st.integers(0, 255))
    elif op == "cut":
        base = base[:data.draw(st.integers(0, len(base) - 1))]
    elif op == "append":
        base += data.draw(st.binary(min_size=1, max_size=64))
    else:
        base = bytearray(b"CI\x01" + data.draw(st.binary(max_size=200)))
    try:
        decode_frame(bytes(base))
    except WireError:
        pass


def test_codec_imports_neither_torch_nor_ray():
    code = "import sys, ciar_device.wire; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
