"""ciar_device.loop (the numpy / onnxruntime CIAR device loop) against an in-process cloud (the torch CloudVerifier
behind a numpy adapter), its gate decisions against ciar.collab.gating, and the CLI's argument errors."""

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _np(x):
    return None if x is None else x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _t(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


class NumpyCloud:
    """A CloudClient over an in-process CloudVerifier that speaks numpy, as a DeviceConnection does: requests'
    arrays become torch tensors, replies' tensors numpy (caption embeddings float16, as the wire carries them)."""

    def __init__(self, verifier):
        self.v = verifier
        self.vocab_size = verifier.vocab_size
        self.closed = []

    def open(self, request):
        from ciar.decoding.sampling import SamplingParams

        s = request.sampling
        req = replace(request, sampling=SamplingParams(cfg_scale=s.cfg_scale, temperature=s.temperature,
                                                       top_k=s.top_k, top_p=s.top_p))
        rep = self.v.open_batch([req])[0]
        emb = None if rep.caption_emb is None else _np(rep.caption_emb.to(torch.float16))
        return replace(rep, prefix_tokens=_np(rep.prefix_tokens), caption_emb=emb, caption_mask=_np(rep.caption_mask))

    def verify(self, request):
        req = replace(request, new_tokens=_t(request.new_tokens), draft_tokens=_t(request.draft_tokens),
                      draft_probs=_t(request.draft_probs), device_hidden=_t(request.device_hidden),
                      features=_t(request.features))
        rep = self.v.verify_batch([req])[0]
        return replace(rep, burst_tokens=_np(rep.burst_tokens))

    def close(self, session_id):
        self.closed.append(session_id)
        self.v.close(session_id)


@pytest.fixture(scope="module")
def world():
    from ciar.world import load_world

    return load_world(None)


@pytest.fixture(scope="module")
def cloud(world):
    from ciar.sim.runtime import make_verifier

    return NumpyCloud(make_verifier(world))


@pytest.fixture(scope="module")
def runtime(onnx_dir):
    from ciar_device.runtime import DeviceRuntime

    return DeviceRuntime(onnx_dir)


def _val(n):
    from ciar.data.scenes import scene_at

    return [scene_at("val", i).caption for i in range(n)]


def test_images_complete_and_stats_consistent(runtime, cloud):
    from ciar_device.loop import generate

    n, vocab = runtime.num_tokens, runtime.vocab_size
    rates, seen = [], []
    for i, prompt in enumerate(_val(3)):
        progress = []
        r = generate(runtime, cloud, prompt, seed=i, session_id=f"loop-{i}",
                     on_progress=lambda toks, st: progress.append((len(toks), st["total_tokens"])))
        st = r.stats
        assert r.tokens.dtype == np.int64 and r.tokens.shape == (n,)
        assert r.tokens.min() >= 0 and r.tokens.max() < vocab
        assert len(r.who) == n and set(r.who) <= {"cloud", "device"}
        assert st["total_tokens"] == n
        assert r.who.count("device") == st["device_tokens"] and r.who.count("cloud") == st["cloud_tokens"]
        assert st["cloud_tokens"] + st["device_tokens"] == n
        assert r.who[:st["prefix_tokens"]] == ["cloud"] * st["prefix_tokens"] == ["cloud"] * 9  # ceil(0.06 * 144)
        assert st["cloud_requests"] == st["verifications"] + 1  # the open + one verify per escalation
        assert st["drafted"] <= 2 * st["verifications"] and st["accepted"] <= st["drafted"]
        assert st["cloud_call_rate"] == pytest.approx(st["cloud_tokens"] / n)
        assert st["bytes_up"] > 0 and st["bytes_down"] > 0 and st["device_s"] > 0 and st["cloud_s"] > 0
        assert st["device_ms_per_token"] == pytest.approx(1000 * st["device_s"] / n)
        assert progress[-1] == (n, n) and [p for p, _ in progress] == sorted(p for p, _ in progress)
        assert cloud.closed[-1] == f"loop-{i}"
        rates.append(st["cloud_call_rate"])
        seen.append(r.tokens)
    assert 0.1 <= float(np.mean(rates)) <= 0.7  # calibrated to 0.3 on val prompts (span 2, burst 4)
    # same seed, same session -> the same image (both sides' draws are keyed by seed and position)
    again = generate(runtime, cloud, _val(1)[0], seed=0, session_id="loop-0")
    assert np.array_equal(again.tokens, seen[0])


@pytest.mark.parametrize("gate", ["lower", "interval"])
def test_escalations_are_torch_gate_decisions(runtime, cloud, monkeypatch, gate):
    """Every position the loop scores: its decision (score > tau) equals ciar.collab.gating.gate_scores(...) > tau on
    the same guided box and drafted token; and each escalation is one verify request."""
    from ciar.collab.gating import gate_scores
    from ciar_device import loop

    rows = []
    real = loop.M.gate_score

    def spy(kind, **kw):
        s = real(kind, **kw)
        rows.append((kind, kw["center"].copy(), kw["radius"].copy(), kw["drafted"], s))
        return s

    monkeypatch.setattr(loop.M, "gate_score", spy)
    tau = runtime.manifest["ciar_defaults"]["taus"][gate]
    verifications = 0
    for i, prompt in enumerate(_val(2)):
        verifications += loop.generate(runtime, cloud, prompt, seed=10 + i, gate=gate).stats["verifications"]
    assert rows and all(k == gate for k, *_ in rows)
    escalated = 0
    for _, c, r, x, s in rows:
        ref = float(gate_scores(gate, center=torch.from_numpy(c)[None], radius=torch.from_numpy(r)[None],
                                drafted=torch.tensor([x]), margin=0.0)[0])
        assert (s > tau) == (ref > tau), (s, ref, tau)
        escalated += s > tau
    assert escalated == verifications


def test_config_from_manifest_and_refusals(runtime):
    from ciar_device.loop import loop_config

    m = runtime.manifest
    d = m["ciar_defaults"]
    cfg = loop_config(m)
    assert (cfg.gate, cfg.tau, cfg.span, cfg.burst) == (d["gate"], d["taus"][d["gate"]], d["span"], d["burst"])
    assert cfg.prefix_rate == m["prefix_rate"] and cfg.sampling.cfg_scale == m["sampling"]["cfg_scale"]
    assert loop_config(m, gate="entropy").tau == d["taus"]["entropy"]
    for gate in ("random", "topk"):  # every gate the cluster's devices run, a real device runs too
        assert loop_config(m, gate=gate, tau=0.5).tau == 0.5
    assert loop_config(m, gate="always").tau is None  # EAGLE's: every token verified, no threshold
    with pytest.raises(ValueError, match="not supported"):
        loop_config(m, gate="nope")
    with pytest.raises(ValueError, match="no threshold"):
        loop_config({**m, "ciar_defaults": None})
    with pytest.raises(ValueError, match="span"):
        loop_config(m, span=0)


def test_entropy_gate_runs(runtime, cloud):
    from ciar_device.loop import generate

    r = generate(runtime, cloud, _val(1)[0], seed=3, gate="entropy")
    assert r.tokens.shape == (runtime.num_tokens,) and r.stats["total_tokens"] == runtime.num_tokens


def _cli(*args, cwd=REPO):
    return subprocess.run([PY, "-m", "ciar_device", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


UNREACHABLE = ["--server", "ws://127.0.0.1:1", "--key", "k", "--prompt", "p", "--out", "o.png"]  # (nobody listens)


@pytest.mark.parametrize("args, match", [
    ([], "required"),
    (["--server", "ws://x", "--key", "k", "--prompt", "p"], "--out"),
    (["--server", "ws://x", "--key", "k", "--prompt", "p", "--out", "o.png", "--seed", "abc"], "--seed"),
    (["--server", "ws://x", "--key", "k", "--prompt", " ", "--out", "o.png"], "--prompt is empty"),
    (["--server", "http://x", "--key", "k", "--prompt", "p", "--out", "o.png"], "ws://"),
    (UNREACHABLE, "could not fetch the device model from ws://127.0.0.1:1"),
    (["--server", "ws://x", "--key", "k", "--prompt", "p", "--out", "a-file/o.png", "--model-dir", "."],
     "cannot create folder"),
    (["--server", "ws://x", "--key", "k", "--prompt", "p", "--out", "o.png", "--model-dir", "/nonexistent"],
     "manifest.json"),
    # the CIAR flags, named before the model is fetched (a negative tau went through to the server)
    ([*UNREACHABLE, "--tau", "-1"], "--tau must be a number >= 0, got -1"),
    ([*UNREACHABLE, "--tau", "nan"], "--tau must be a number >= 0"),
    ([*UNREACHABLE, "--span", "0"], "--span must be >= 1, got 0"),
    ([*UNREACHABLE, "--burst", "-2"], "--burst must be >= 0"),
    ([*UNREACHABLE, "--prefix-rate", "2"], "--prefix-rate must be in [0, 1], got 2"),
    ([*UNREACHABLE, "--gate", "nope"], "--gate must be one of interval"),
])
def test_cli_errors_one_line_exit_2(args, match, tmp_path):
    (tmp_path / "a-file").write_text("")  # a folder that cannot be created: its parent is a file
    p = _cli(*args, cwd=str(tmp_path))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m ciar_device: error:") and match in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_cli_unreachable_server_and_bad_gate(onnx_dir, tmp_path):
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = ["--key", "k", "--prompt", "p", "--out", str(tmp_path / "o.png"), "--model-dir", onnx_dir]
    p = _cli("--server", f"ws://127.0.0.1:{port}", *base)
    assert p.returncode == 2 and "cannot reach the server" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = _cli("--server", f"ws://127.0.0.1:{port}", *base, "--gate", "nope")
    assert p.returncode == 2 and "--gate must be one of" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- over a real socket
KEY, SECRET = "loop-test-key", "loop-test-secret"


@pytest.fixture(scope="module")
def server(cloud):
    from services.device_endpoint import DeviceEndpoint
    from services.config import key_digest
    from services.testing import InProcessBackend, loopback_endpoint

    with loopback_endpoint(DeviceEndpoint(InProcessBackend(cloud.v, SECRET), [key_digest(KEY)])) as url:
        yield url


def test_over_the_socket_equals_in_process_and_cli(server, runtime, cloud, onnx_dir, tmp_path, capsys):
    from ciar_device.__main__ import main
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate

    prompt = _val(1)[0]
    ref = generate(runtime, cloud, prompt, seed=5, session_id="sock-5", policy="fixed")
    conn = DeviceConnection(server, KEY, vocab_size=runtime.vocab_size)
    out = generate(runtime, conn, prompt, seed=5, session_id="sock-5", policy="fixed")
    conn.disconnect()
    assert np.array_equal(out.tokens, ref.tokens) and out.who == ref.who
    # the frames' real sizes are the messages' nbytes (the close is not charged)
    assert (out.stats["bytes_up"], out.stats["bytes_down"]) == (ref.stats["bytes_up"], ref.stats["bytes_down"])
    assert not conn.sessions and conn.resumes == 0

    png, stats = tmp_path / "img.png", tmp_path / "stats.json"
    rc = main(["--server", server, "--key", KEY, "--prompt", prompt, "--out", str(png), "--seed", "5",
               "--model-dir", onnx_dir, "--stats", str(stats), "--policy", "fixed"])
    line = capsys.readouterr().out.strip()
    assert rc == 0 and line.startswith(f"wrote {png}: 144 tokens")
    assert "cloud calls" in line and "cloud requests" in line
    import json

    from PIL import Image

    st = json.loads(stats.read_text())
    assert st["tokens"] == ref.tokens.tolist() and st["collab"]["stats"]["total_tokens"] == 144
    size = runtime.manifest["image_size"]
    assert Image.open(png).size == (size, size)

    rc = main(["--server", server, "--key", "wrong-key", "--prompt", prompt, "--out", str(png),
               "--model-dir", onnx_dir])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "error:" in err[0], err


def test_adaptive_over_the_socket_starts_from_the_welcome_and_reports_a_point_that_remakes_the_image(server, runtime,
                                                                                                   cloud):
    """The torch-free device runs the adaptive policy (the default): before its first image it knows the link from
    its handshake, its step from one timed step and the verifier's costs from the WELCOME (the verifier has served
    other images by now); it keeps one observer across its images; and the same request at the reported point with
    the fixed policy makes the same image (or, given to the cloud whole, cloud-only's)."""
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate
    from ciar_device.policy import CostObserver

    conn = DeviceConnection(server, KEY, vocab_size=runtime.vocab_size)
    generate(runtime, conn, _val(3)[2], seed=19, policy="fixed")  # the verifier has served an image
    conn.disconnect()
    hint = conn.cost_hint()  # a new connection: its WELCOME carries the verifier's figures
    assert conn.handshake_s > 0 and hint is not None and hint.span_s > 0 and hint.step_s > 0
    observer = CostObserver(rates=runtime.manifest["ciar_defaults"]["policy_rates"])
    try:
        for i, prompt in enumerate(_val(2)):
            r = generate(runtime, conn, prompt, seed=20 + i, observer=observer)
            st = r.stats
            assert observer.primed and observer.ready and st["est_cloud_step_s"] > 0 and st["est_device_step_s"] > 0
            assert st["handovers"] in (0, 1) and len(r.tokens) == runtime.num_tokens
            fixed = {"prefix_rate": 1.0} if st["handovers"] else {"span": st["span_used"], "burst": st["burst_used"]}
            again = generate(runtime, conn, prompt, seed=20 + i, policy="fixed", **fixed)
            assert np.array_equal(again.tokens, r.tokens)
            assert st["span_used"] >= runtime.manifest["ciar_defaults"]["span"] or st["handovers"]
    finally:
        conn.disconnect()
    assert observer.link.samples >= 2 and observer.cloud.samples >= 1 or observer.cloud_only_streak == 2


class _CloudGoneAfter:
    """Test double: the in-process cloud answers the open and `n` verifies, then raises as a DeviceConnection does
    once its retries are spent (ConnectionError)."""

    def __init__(self, cloud, n):
        self.cloud, self.n, self.vocab_size = cloud, n, cloud.vocab_size
        self.verifies = 0

    def open(self, request):
        return self.cloud.open(request)

    def verify(self, request):
        self.verifies += 1
        if self.verifies > self.n:
            raise ConnectionError("lost the connection 4 times")
        return self.cloud.verify(request)

    def close(self, session_id):  # as a DeviceConnection whose link is gone: best effort, nothing sent
        self.closed = True


def test_link_loss_finishes_on_the_device_degraded(runtime, cloud):
    from ciar_device.loop import generate

    prompt = _val(1)[0]
    ref = generate(runtime, cloud, prompt, seed=2, session_id="gone-ref")
    assert ref.stats["degraded"] == 0 == ref.stats["degraded_tokens"] and ref.stats["verifications"] > 2
    gone = _CloudGoneAfter(cloud, 2)
    r = generate(runtime, gone, prompt, seed=2, session_id="gone")
    assert gone.closed  # every image ends with a close (a transport whose link is gone sends none)
    st, n = r.stats, runtime.num_tokens
    assert r.tokens.shape == (n,) and st["total_tokens"] == n and st["degraded"] == 1
    assert st["verifications"] == 2 and st["cloud_tokens"] + st["device_tokens"] == n
    # everything after the second verify's commit is the device's own, counted as degraded
    first_alone = max(i for i, w in enumerate(r.who) if w == "cloud") + 1
    assert r.who[first_alone:] == ["device"] * (n - first_alone) and st["degraded_tokens"] > 0
    assert np.array_equal(r.tokens[:first_alone], ref.tokens[:first_alone])  # the same until the link went
    cloud.v.close("gone")
    with pytest.raises(ConnectionError, match="lost the connection"):  # the verify's error, not the close's
        generate(runtime, _CloudGoneAfter(cloud, 0), prompt, seed=2, session_id="gone-strict", fallback=False)
    cloud.v.close("gone-strict")


def test_server_gone_mid_image_over_a_real_socket(server, runtime, capsys):
    """The server stops answering mid-image (the connection drops and every reconnect is refused): the loop
    finishes the image alone, marked degraded."""
    from ciar_device.connection import DeviceConnection
    from ciar_device.loop import generate

    conn = DeviceConnection(server, KEY, vocab_size=runtime.vocab_size, retries=2, backoff_s=0.01)

    def vanish(tokens, stats):  # after the first verification: the server is gone
        if stats["verifications"] >= 1 and not conn.url.startswith("ws://127.0.0.1:1/"):
            conn.url = "ws://127.0.0.1:1/v1/device/sessions"  # nothing listens on port 1
            conn.drop()

    r = generate(runtime, conn, _val(2)[1], seed=7, session_id="vanish", on_progress=vanish)
    assert r.stats["degraded"] == 1 and r.stats["degraded_tokens"] > 0
    assert r.stats["total_tokens"] == runtime.num_tokens == len(r.tokens)
