"""LlamaGen-XL Stage II (512 px, 32 x 32 = 1,024 image tokens): its world file, its checkpoint's shapes, and every
part that sizes itself by the image at 1,024 tokens (tiny widths, the real token count): the verifier and its
runner (dynamic and static steps), a session lost late in the image and resumed, the device wire codec and the
endpoint's frame limit, the scheduler's prefill steps, the preview cadence and the GPU capacity model's shapes."""

import os

import numpy as np
import pytest
import torch
import yaml

from ciar.sim.decoder import CollabDecoder, method_config
from ciar.sim.recovery import RecoveringClient
from ciar.engine.verifier import CloudVerifier, InProcessCloud
from ciar.models.gpt import build_gpt, load_llamagen_gpt
from ciar.testing import LLAMAGEN_SMALL_GPT, LLAMAGEN_SMALL_VQ, make_tiny_t5, write_llamagen_checkpoints
from ciar.world import load_device_side, load_world
from ciar.world_spec import LlamaGenWorldSpec, WorldSpecError, read_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE1 = os.path.join(REPO, "worlds", "llamagen-xl-stage1.yaml")
STAGE2 = os.path.join(REPO, "worlds", "llamagen-xl-stage2.yaml")
PROMPT = "a red bus on a city street"


def test_the_stage2_world_file_validates_and_names_stage2s_shapes(tmp_path):
    spec = read_world(STAGE2, check=False)
    assert isinstance(spec, LlamaGenWorldSpec) and spec.image_size == 512 and spec.gpt_config == "GPT-XL"
    assert os.path.basename(spec.gpt_checkpoint) == "t2i_XL_stage2_512.pt"
    stage1 = read_world(STAGE1, check=False)
    assert spec.vq_checkpoint == stage1.vq_checkpoint and spec.text_encoder == stage1.text_encoder  # shared files
    assert spec.sampling == stage1.sampling  # LlamaGen's sample_t2i.py defaults at both sizes
    assert spec.device_checkpoint != stage1.device_checkpoint  # a device model per GPT and token count
    c = spec.gpt_cfg()
    assert (c.block_size, c.grid_size, c.cls_token_num, c.seq_len) == (1024, 32, 120, 1144)
    # `check` (every named file and folder present) on the file's own fields, its /mnt/models paths under tmp_path
    with open(STAGE2) as f:
        data = yaml.safe_load(f)
    for field in LlamaGenWorldSpec.FILES + LlamaGenWorldSpec.FOLDERS:
        if data.get(field):
            path = tmp_path / data[field].lstrip("/")
            data[field] = str(path)
            if field in LlamaGenWorldSpec.FOLDERS:
                path.mkdir(parents=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"")
    local = tmp_path / "stage2.yaml"
    local.write_text(yaml.safe_dump(data))
    assert read_world(str(local), need_device=True, need_text=True).image_size == 512
    os.remove(data["gpt_checkpoint"])
    with pytest.raises(WorldSpecError, match="gpt_checkpoint: file not found"):
        read_world(str(local))


def test_gpt_xl_weights_do_not_depend_on_the_token_count():
    """Nothing a LlamaGen checkpoint stores is sized by the image: Stage II's file has Stage I's keys and shapes,
    and the rotary table (never stored) is computed for 120 + 1,024 positions."""
    with torch.device("meta"):
        s1, s2 = build_gpt("GPT-XL", block_size=256), build_gpt("GPT-XL", block_size=1024)
    assert {k: v.shape for k, v in s1.state_dict().items()} == {k: v.shape for k, v in s2.state_dict().items()}
    assert "freqs_cis" not in s2.state_dict()
    assert s1.freqs_cis.shape[0] == 120 + 256 and s2.freqs_cis.shape[0] == 120 + 1024


def test_a_512px_checkpoint_loads_strictly_with_lamagens_extra_buffers(tmp_path):
    """A checkpoint saved with LlamaGen's non-parameter tensors at Stage II's length (its rotary table, a KV cache
    set up for 1,144 positions) loads at image_size 512 and computes what the saved model computes, to the last
    image token."""
    torch.manual_seed(0)
    src = build_gpt("GPT-B", block_size=1024, **LLAMAGEN_SMALL_GPT).eval()
    torch.nn.init.normal_(src.output.weight, std=0.5)
    c = src.config
    state = dict(src.state_dict())
    state["freqs_cis"] = src.freqs_cis.clone()  # [cls + 1024, head_dim / 2, 2]
    state["layers.0.attention.kv_cache.k_cache"] = torch.zeros(2, c.n_head, 1144, c.head_dim)
    state["layers.0.attention.kv_cache.v_cache"] = torch.zeros(2, c.n_head, 1144, c.head_dim)
    path = tmp_path / "t2i_XL_stage2_512.pt"
    torch.save({"model": state}, path)
    got = load_llamagen_gpt(str(path), "GPT-B", image_size=512, **LLAMAGEN_SMALL_GPT)
    assert got.config.block_size == 1024 and got.freqs_cis.shape[0] == c.cls_token_num + 1024
    assert torch.equal(got.freqs_cis, src.freqs_cis)
    idx = torch.randint(0, c.vocab_size, (1, 1023), generator=torch.Generator().manual_seed(1))
    cond = torch.randn(1, c.cls_token_num, c.caption_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = src(idx, cond)
        have, _ = got(idx, cond)
    assert have.shape == (1, 1024, c.vocab_size) and torch.equal(have, want)


@pytest.fixture(scope="module")
def world1024(tmp_path_factory):
    """A tiny LlamaGen world at Stage II's token count: 512 px, 32 x 32 tokens, tiny widths, runtime T5."""
    root = tmp_path_factory.mktemp("stage2-tiny")
    gpt, vq, device = write_llamagen_checkpoints(str(root), "GPT-B", 1024, LLAMAGEN_SMALL_GPT, 512, LLAMAGEN_SMALL_VQ,
                                                 names=("t2i_XL_stage2_512.pt", "vq.pt", "device.safetensors"))
    spec = {"kind": "llamagen", "gpt_checkpoint": gpt, "gpt_config": "GPT-B", "gpt_overrides": LLAMAGEN_SMALL_GPT,
            "image_size": 512, "vq_checkpoint": vq, "device_checkpoint": device,
            "vq_overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in LLAMAGEN_SMALL_VQ.items()},
            "text_encoder": make_tiny_t5(str(root / "t5"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"]),
            "sampling": {"cfg_scale": 2.0, "top_k": 0}}
    return spec, load_world(spec)


def test_the_world_and_the_device_side_at_1024_tokens(world1024, tmp_path):
    spec, world = world1024
    assert world.cloud.config.block_size == 1024 and world.vq.config.image_size == 512
    side = load_device_side(spec)
    assert side.num_tokens == 1024 and side.device_model.config.block_size == 1024
    assert side.vq.decode_code(torch.zeros(1, 1024, dtype=torch.long)).shape[-2:] == (512, 512)
    # a device model made for 256 tokens (Stage I's) is refused at Stage II, naming the mismatch
    _, _, dev256 = write_llamagen_checkpoints(str(tmp_path), "GPT-B", 256, LLAMAGEN_SMALL_GPT, 256, LLAMAGEN_SMALL_VQ,
                                              names=("g.pt", "v.pt", "device256.safetensors"))
    with pytest.raises(WorldSpecError, match="256 tokens"):
        load_world({**spec, "device_checkpoint": dev256})


def _images(world, method, static=None, **knobs):
    verifier = CloudVerifier(world.cloud, world.text, max_sessions=2, codebook=world.codebook, static=static)
    cfg = method_config(method, network="none", **knobs)
    return CollabDecoder(world.device_model, InProcessCloud(verifier), cfg, world.sampling,
                         num_tokens=1024).generate(PROMPT, seed=3)


@pytest.mark.timeout(300)
def test_1024_token_images_through_the_verifier_dynamic_and_static(world1024):
    """Cloud-only (one OPEN of 1,024 sampled tokens) and CIAR through the verifier; the static steps (the GPU
    path's buckets: 120 caption + a quarter .. all of the 1,024 image keys) give the same tokens as dynamic ones."""
    _, world = world1024
    knobs = {"gate": "lower", "tau": 0.5, "span": 4, "burst": 2, "policy": "fixed"}
    for method, kw in (("cloud", {}), ("ciar", knobs)):
        dyn = _images(world, method, **kw)
        assert dyn.tokens.shape == (1024,) and int(dyn.tokens.max()) < world.cloud.config.vocab_size
        assert dyn.stats.total_tokens == 1024
        if method == "ciar":
            assert dyn.stats.verifications > 10 and dyn.stats.device_tokens > 0
        assert torch.equal(_images(world, method, static=True, **kw).tokens, dyn.tokens), method


class LateLoss(InProcessCloud):
    """The verifier replica is lost (replaced by a fresh one) at the first verify of a session holding >= 900
    committed tokens: the device resumes with ~900 tokens of history and their interval features."""

    def __init__(self, make):
        super().__init__(make())
        self.make, self.lost_at, self.resumed = make, None, []

    def verify(self, request):
        s = self.verifier.table.sessions.get(request.session_id)
        if self.lost_at is None and s is not None and len(s.tokens) >= 900:
            self.lost_at = len(s.tokens)
            self.verifier = self.make()
        return super().verify(request)

    def resume(self, request, history, injected=None):
        self.resumed.append((int(history.numel()), 0 if injected is None else int(injected.positions.numel())))
        return super().resume(request, history, injected)


@pytest.mark.timeout(300)
def test_a_session_lost_near_position_1000_resumes_to_the_same_image(world1024):
    _, world = world1024
    cfg = method_config("ciar", network="none", gate="lower", tau=0.5, span=4, burst=2, policy="fixed")

    def make():
        return CloudVerifier(world.cloud, world.text, max_sessions=2, codebook=world.codebook)

    ref = CollabDecoder(world.device_model, InProcessCloud(make()), cfg, world.sampling,
                        num_tokens=1024).generate(PROMPT, seed=5)
    flaky = LateLoss(make)
    got = CollabDecoder(world.device_model, RecoveringClient(flaky), cfg, world.sampling,
                        num_tokens=1024).generate(PROMPT, seed=5)
    assert flaky.lost_at is not None and flaky.lost_at >= 900
    (history, injected), = flaky.resumed
    assert history >= 900 and injected > 0  # the history's locally accepted tokens came with their features
    assert got.stats.resumes == 1 and torch.equal(got.tokens, ref.tokens)


def test_the_device_wire_at_1024_tokens():
    """Counts and positions are u16 on the wire: 1,024 tokens, positions up to 1,022 and a 1,024-token cloud-only
    prefix round-trip; a device's largest frame at Stage II (a VERIFY of ~1,000 locally accepted tokens' interval
    features, or a RESUME of the whole history) fits the endpoint's default limit, which 2 MiB did not."""
    from ciar_device import wire
    from ciar_device.wire import (OPEN_REPLY, RESUME, VERIFY, Frame, InjectedFeatures, OpenReply, OpenRequest,
                                  ResumeRequest, Sampling, VerifyRequest, decode_frame, encode_frame)

    from services.config import DeviceEndpointConfig

    V, d, F, N = 16384, 1280, 20, 1024
    rng = np.random.default_rng(0)
    tok = b"t" * wire.TOKEN_BYTES
    sid = "s" * 32
    m, k = N - 32, 32
    probs = rng.random((k, V)).astype(np.float16)
    req = VerifyRequest(sid, rng.integers(0, V, m), rng.integers(0, V, k), probs,
                        rng.standard_normal((m, d)).astype(np.float16), rng.standard_normal((m, F)).astype(np.float16),
                        burst=2)
    data = encode_frame(Frame(VERIFY, 7, req, tok))
    assert len(data) == req.nbytes(V) > 2 << 20
    back = decode_frame(data).body
    assert np.array_equal(back.new_tokens, req.new_tokens) and np.array_equal(back.draft_tokens, req.draft_tokens)
    assert np.array_equal(back.device_hidden, req.device_hidden) and np.array_equal(back.draft_probs, probs)
    history = rng.integers(0, V, N)
    pos = np.arange(0, N - 1, 2)  # indices into history[:-1], up to 1,022
    inj = InjectedFeatures(pos, rng.standard_normal((len(pos), d)).astype(np.float16),
                           rng.standard_normal((len(pos), F)).astype(np.float16))
    res = ResumeRequest(OpenRequest(sid, PROMPT, 1, Sampling(7.5, 1.0, 1000, 1.0), 0), history, inj, V)
    data = encode_frame(Frame(RESUME, 8, res, tok))
    assert len(data) == res.nbytes()
    back = decode_frame(data).body
    assert np.array_equal(back.history, history) and np.array_equal(back.injected.positions, pos)
    rep = OpenReply(sid, rng.integers(0, V, N), rng.standard_normal((120, 2048)).astype(np.float16),
                    np.arange(120) >= 100, 1.0, N, V)
    back = decode_frame(encode_frame(Frame(OPEN_REPLY, 9, rep, tok))).body
    assert np.array_equal(back.prefix_tokens, rep.prefix_tokens) and back.forward_passes == N
    largest = wire.largest_frame_bytes(N, V, d, F)
    assert len(encode_frame(Frame(VERIFY, 7, req, tok))) <= largest
    assert 2 << 20 < largest <= DeviceEndpointConfig().max_frame_bytes
    assert wire.largest_frame_bytes(256, V, d, F) < 2 << 20  # Stage I fitted the old limit


def test_prefill_steps_at_1024_positions():
    """A resume of a whole Stage II image (120 caption + 1,023 history positions, 2 CFG rows) under the default
    scheduler: one caption chunk, then two history chunks of 512 (the 1,024-position budget over 2 rows); beside
    busy sessions it gets prefill_chunk-sized pieces."""
    from benchmarks.real_scale import prefill_steps
    from ciar.engine.scheduler import SchedulerConfig

    alone = prefill_steps(120, 1024, SchedulerConfig())
    assert alone["open"] == {"steps": 1, "widest": 120, "positions": 120}
    assert alone["resume"] == {"steps": 3, "widest": 512, "positions": 1143}
    busy = prefill_steps(120, 1024, SchedulerConfig(), busy=8)
    assert busy["resume"]["steps"] > 3 and busy["resume"]["widest"] <= 64
    gpu = prefill_steps(120, 1024, SchedulerConfig(token_budget=16384, prefill_chunk=120))
    assert gpu["resume"]["steps"] == 2


def test_previews_and_the_capacity_model_scale_with_the_image():
    from ciar.capacity.gpu_model import ModelShapes
    from services.config import MAX_PREVIEWS, DeviceLiveConfig

    live = DeviceLiveConfig()
    assert [live.preview_tokens(n) for n in (144, 256, 1024)] == [24, 24, 64]  # <= 16 whole-image decodes
    assert -(-1024 // live.preview_tokens(1024)) <= MAX_PREVIEWS
    assert DeviceLiveConfig(preview_every=100).preview_tokens(1024) == 100
    s1, s2 = ModelShapes.llamagen_xl(), ModelShapes.llamagen_xl(512)
    assert (s1.block_size, s2.block_size) == (256, 1024) and s1.weight_params == s2.weight_params
    assert s2.session_bytes() == s1.session_bytes() * (120 + 1024 + 16) // (120 + 256 + 16)
