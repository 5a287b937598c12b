"""The page's wire codec (web/src/wire.js, under node) against the protocol's definition (ciar_device.wire): the
frames a device sends are byte-identical to Python's for the same messages, the frames it receives decode to the same
fields, and malformed frames are refused naming the field."""

import numpy as np
import pytest
from test_wire import TOKEN, V, _messages

from ciar_device import wire
from ciar_device.wire import (CLOSE, CLOSED, ERROR, HELLO, OPEN, OPEN_REPLY, RESUME, VERIFY, VERIFY_REPLY, WELCOME,
                              Frame, VerifyReply, encode_frame)

SENT = (HELLO, OPEN, VERIFY, RESUME, CLOSE)
RECEIVED = (WELCOME, OPEN_REPLY, VERIFY_REPLY, CLOSED, ERROR)


def _ids(a) -> list[int]:
    return [int(t) for t in np.asarray(a).reshape(-1)]


def _bits(a) -> list[int]:
    return np.ascontiguousarray(np.asarray(a, np.float16)).view(np.uint16).reshape(-1).tolist()


def _open_body(r) -> dict:
    s, rule = r.sampling, r.rule
    return {"session_id": r.session_id, "prompt": r.prompt, "seed": r.seed,
            "sampling": {"cfg_scale": s.cfg_scale, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p},
            "prefix_len": r.prefix_len, "jacobi_window": r.jacobi_window, "want_caption": r.want_caption,
            "rule": {"rule": rule.rule, "lantern_k": rule.lantern_k, "lantern_delta": rule.lantern_delta,
                     "cascade_threshold": rule.cascade_threshold, "gsd_ranks": rule.gsd_ranks,
                     "gsd_prob_gap": rule.gsd_prob_gap, "gsd_distance": rule.gsd_distance}}


def _js_frame(f: Frame) -> dict:
    """A device's frame as the page's modules hold it."""
    b = f.body
    if f.type == HELLO:
        body = {"key": b.key, "client": b.client}
    elif f.type == OPEN:
        body = _open_body(b)
    elif f.type == VERIFY:
        body = {"session_id": b.session_id, "vocab_size": int(b.draft_probs.shape[1]), "new_tokens": _ids(b.new_tokens),
                "draft_tokens": _ids(b.draft_tokens), "draft_probs": _bits(b.draft_probs),
                "burst": b.burst, "burst_entropy": b.burst_entropy}
        for name in ("device_hidden", "features"):
            a = getattr(b, name)
            body[name] = None if a is None else {"dim": int(a.shape[1]), "bits": _bits(a)}
    elif f.type == RESUME:
        inj = b.injected
        body = {"request": _open_body(b.request), "vocab_size": b.vocab_size, "history": _ids(b.history),
                "injected": None if inj is None else {
                    "positions": _ids(inj.positions), "hidden_dim": int(inj.device_hidden.shape[1]),
                    "hidden": _bits(inj.device_hidden), "feature_dim": int(inj.features.shape[1]),
                    "features": _bits(inj.features)}}
    else:
        body = {"session_id": b.session_id}
    return {"type": f.type, "requestId": f.request_id, "body": body, "token": list(f.token) if f.token else None}


def test_sent_frames_are_byte_identical_to_pythons(node):
    frames = [f for f in _messages() if f.type in SENT]
    assert {f.type for f in frames} == set(SENT)
    out = node("encode", {"frames": [_js_frame(f) for f in frames]})
    for f, got in zip(frames, out):
        assert got == encode_frame(f).hex(), f.name


def test_received_frames_decode_to_the_same_fields(node):
    frames = [f for f in _messages() if f.type in RECEIVED]
    assert {f.type for f in frames} == set(RECEIVED)
    out = node("decode", {"frames": [encode_frame(f).hex() for f in frames]})
    for f, got in zip(frames, out):
        b = f.body
        assert got["type"] == f.type and got["requestId"] == f.request_id and got["name"] == f.name
        d = got["body"]
        if f.type == OPEN_REPLY:
            assert got["token"] == list(TOKEN)
            assert d["prefix_tokens"] == _ids(b.prefix_tokens) and d["cloud_s"] == b.cloud_s
            assert d["forward_passes"] == b.forward_passes and d["vocab_size"] == b.vocab_size
            if b.caption_emb is None:
                assert d["caption_emb"] is None and d["caption_mask"] is None
            else:
                assert d["caption_shape"] == list(b.caption_emb.shape) and d["caption_emb"] == _bits(b.caption_emb)
                assert d["caption_mask"] == np.asarray(b.caption_mask).tolist()
        elif f.type == VERIFY_REPLY:
            for k in ("session_id", "num_accepted", "next_token", "recovered", "resumed", "cloud_s", "queue_s",
                      "batch_size", "forward_passes", "vocab_size"):
                assert d[k] == getattr(b, k), k
            assert d["burst_tokens"] == (_ids(b.burst_tokens) if b.num_burst else [])
        else:
            for k, v in d.items():
                assert v == getattr(b, k), k


def test_malformed_frames_are_refused_naming_the_field(node):
    ok = encode_frame(Frame(VERIFY_REPLY, 3, VerifyReply("s1", 1, 5, False, 0.01, 1, 1, False, np.array([1, 2]), V)))
    bad_id = encode_frame(Frame(VERIFY_REPLY, 3, VerifyReply("s1", 0, 5, False, 0.01, 1, 1, False,
                                                            np.array([999]), 1000)))
    bad_id = bad_id[:-2] + (1023).to_bytes(2, "little")  # 10 bits for V = 1000: an id past the vocabulary
    cases = {
        "header": ok[:5],
        "version": ok[:2] + bytes([wire.PROTOCOL_VERSION + 1]) + ok[3:],
        "body": ok + b"\0",
        "burst_tokens": bad_id,
        "verify_reply": ok[:20],
        "type": encode_frame(Frame(OPEN, 1, _messages()[2].body)),  # a device never receives an OPEN
    }
    out = node("decode", {"frames": [c.hex() for c in cases.values()]})
    for field, got in zip(cases, out):
        assert got.get("field") == field, (field, got)
    assert "bad magic" in node("decode", {"frames": [(b"XX" + ok[2:]).hex()]})[0]["error"]
