"""LlamaGen-compatible GPT: checkpoint loading, key layout, and cached decoding == full forward.

The equivalence tests against LlamaGen's own code run only when LLAMAGEN_SRC points at a LlamaGen checkout
(only its `autoregressive/`, `tokenizer/` and `utils/` folders are needed), e.g.

    mkdir -p /tmp/llamagen
    git -C <LlamaGen repo> archive HEAD autoregressive tokenizer utils | tar -x -C /tmp/llamagen
    LLAMAGEN_SRC=/tmp/llamagen python -m pytest tests/models

Its modules are loaded from their file paths; nothing of LlamaGen is copied into this repository.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from ciar.models.checkpoint import CheckpointMismatchError
from ciar.models.gpt import GPT_CONFIGS, build_gpt, load_llamagen_gpt

torch.set_num_threads(1)

# a small t2i model in LlamaGen's layout (grid 4x4 -> block_size 16, i.e. image_size 64 at downsample 16)
SMALL = dict(n_layer=2, dim=128, n_head=4, caption_dim=64, cls_token_num=8, vocab_size=256)
CLS, L, V = SMALL["cls_token_num"], 16, SMALL["vocab_size"]


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter/buffer of the state dict with O(1)-activation random values (not the zero head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            r = torch.randn(t.shape, generator=g)
            if name.endswith("norm.weight"):
                r = 1.0 + 0.1 * r
            elif name.endswith(".bias"):
                r = 0.1 * r
            elif t.dim() == 2 and "embedding" not in name and "embeddings" not in name:
                r = r / t.shape[1] ** 0.5  # linear [out, in]
            t.copy_(r)
    return model


def small_gpt(seed: int = 0, **kw):
    return randomize_(build_gpt("GPT-B", **{**SMALL, "block_size": L, **kw}), seed).eval()


def left_padded(valid: list[int], n: int) -> torch.Tensor:
    """Caption masks [B, n], padding on the left, `valid[b]` real tokens in row b."""
    return torch.arange(n)[None] >= (n - torch.tensor(valid))[:, None]


def caption(b: int, n: int, dim: int, mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, dim, generator=g) * mask[..., None]  # zeros on padding, as LlamaGen feeds them


def tokens(b: int, n: int, seed: int = 2, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    return small_gpt()


@pytest.fixture(scope="module")
def batch():
    mask = left_padded([CLS, 5, 1], CLS)  # every row padded differently, one row with a single real token
    return caption(3, CLS, SMALL["caption_dim"], mask), mask, tokens(3, L)


# ---------------------------------------------------------------------------------------------------- loading
def _load_small(path, **kw):
    return load_llamagen_gpt(str(path), "GPT-B", image_size=64, downsample=16, **{**SMALL, **kw})


def test_llamagen_checkpoint_round_trips_exactly(tmp_path, model, batch):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "t2i_small.pt"
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]}, "steps": 7}, path)
    loaded = _load_small(path)
    assert not loaded.training
    assert loaded.config.block_size == L and loaded.config.cls_token_num == CLS
    got = loaded.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    cond, mask, idx = batch
    with torch.no_grad():
        assert torch.equal(loaded(idx, cond, mask)[0], model(idx, cond, mask)[0])


def test_half_precision_checkpoint_loads_into_float32(tmp_path, model):
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save({"model": state}, tmp_path / "bf16.pt")
    loaded = _load_small(tmp_path / "bf16.pt")
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, state[k].float()), k


def test_image_size_sets_the_grid_not_the_weights(tmp_path, model):
    """GPT weights do not depend on the resolution: the same file loads at 256 px (16x16) and 512 px (32x32)."""
    torch.save({"model": model.state_dict()}, tmp_path / "m.pt")
    for size, grid in ((256, 16), (512, 32)):
        m = load_llamagen_gpt(str(tmp_path / "m.pt"), "GPT-B", image_size=size, **SMALL)
        assert m.config.block_size == grid * grid and m.config.grid_size == grid
        assert m.freqs_cis.shape == (CLS + grid * grid, SMALL["dim"] // SMALL["n_head"] // 2, 2)


@pytest.mark.parametrize("nesting", ["model", "module", "state_dict", "plain", "ddp-prefix"])
def test_checkpoint_nestings_load(tmp_path, model, nesting):
    state = model.state_dict()
    obj = {
        "model": {"model": state, "steps": 1},
        "module": {"module": state},
        "state_dict": {"state_dict": state, "epoch": 3},
        "plain": dict(state),
        "ddp-prefix": {"model": {"module." + k: v for k, v in state.items()}},
    }[nesting]
    torch.save(obj, tmp_path / "c.pt")
    loaded = _load_small(tmp_path / "c.pt")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


def _expect_mismatch(tmp_path, state, key, kind):
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointMismatchError) as err:
        _load_small(tmp_path / "bad.pt")
    msg = str(err.value)
    assert key in msg and kind in msg, msg


def test_missing_key_is_named(tmp_path, model):
    state = dict(model.state_dict())
    del state["layers.1.ffn_norm.weight"]
    _expect_mismatch(tmp_path, state, "layers.1.ffn_norm.weight", "missing")


def test_unexpected_key_is_named(tmp_path, model):
    state = dict(model.state_dict())
    state["layers.0.attention.wq.weight"] = torch.zeros(128, 128)
    _expect_mismatch(tmp_path, state, "layers.0.attention.wq.weight", "unexpected")


def test_misshaped_key_is_named(tmp_path, model):
    state = dict(model.state_dict())
    state["tok_embeddings.weight"] = torch.zeros(V - 1, SMALL["dim"])
    _expect_mismatch(tmp_path, state, "tok_embeddings.weight", "mis-shaped")


def test_wrong_config_is_refused(tmp_path, model):
    torch.save({"model": model.state_dict()}, tmp_path / "m.pt")
    with pytest.raises(CheckpointMismatchError, match="layers.0.attention.wqkv.weight"):
        _load_small(tmp_path / "m.pt", dim=256)
    with pytest.raises(CheckpointMismatchError, match="layers.2."):  # a 3-layer model misses layer 2
        _load_small(tmp_path / "m.pt", n_layer=3)


def test_ignored_keys_are_accepted(tmp_path, model):
    """Rotary tables and KV-cache buffers (present when a model is saved after `setup_caches`) are not weights."""
    state = dict(model.state_dict())
    hd = SMALL["dim"] // SMALL["n_head"]
    extra = {
        "freqs_cis": torch.randn(CLS + L, hd // 2, 2),
        "causal_mask": torch.ones(2, CLS + L, CLS + L, dtype=torch.bool),
        "layers.0.attention.kv_cache.k_cache": torch.randn(2, 4, CLS + L, hd),
        "layers.0.attention.kv_cache.v_cache": torch.randn(2, 4, CLS + L, hd),
        "layers.1.attention.kv_cache.k_cache": torch.randn(2, 4, CLS + L, hd),
    }
    torch.save({"model": {**state, **extra}}, tmp_path / "m.pt")
    loaded = _load_small(tmp_path / "m.pt")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    # the model keeps its own rotary table
    assert torch.equal(loaded.freqs_cis, model.freqs_cis)


# ---------------------------------------------------------------------------------------------------- key layout
FFN_HIDDEN = {"GPT-B": 2048, "GPT-L": 2816, "GPT-XL": 3584, "GPT-XXL": 4096}
SIZES = {"GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280), "GPT-XXL": (48, 24, 1536)}


def expected_llamagen_layout(n_layer: int, d: int, hidden: int, vocab: int = 16384, model_type: str = "t2i",
                             caption_dim: int = 2048, token_num: int = 120, num_classes: int = 1000):
    """Parameter names -> shapes of a LlamaGen GPT checkpoint, as docs/architecture.md §9 gives them."""
    keys = {"tok_embeddings.weight": (vocab, d), "norm.weight": (d,), "output.weight": (vocab, d)}
    if model_type == "t2i":
        keys.update({"cls_embedding.uncond_embedding": (token_num, caption_dim),
                     "cls_embedding.cap_proj.fc1.weight": (d, caption_dim),
                     "cls_embedding.cap_proj.fc2.weight": (d, d)})
    else:
        keys["cls_embedding.embedding_table.weight"] = (num_classes + 1, d)
    for i in range(n_layer):
        p = f"layers.{i}."
        keys.update({p + "attention.wqkv.weight": (3 * d, d), p + "attention.wo.weight": (d, d),
                     p + "feed_forward.w1.weight": (hidden, d), p + "feed_forward.w3.weight": (hidden, d),
                     p + "feed_forward.w2.weight": (d, hidden),
                     p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
    return keys


def _meta_layout(name: str, **kw) -> dict:
    with torch.device("meta"):
        m = build_gpt(name, **kw)
    return m, {k: tuple(v.shape) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("name", list(SIZES))
def test_t2i_key_layout_matches_llamagen(name):
    n_layer, n_head, d = SIZES[name]
    cfg = GPT_CONFIGS[name]
    assert (cfg.n_layer, cfg.n_head, cfg.dim, cfg.head_dim) == (n_layer, n_head, d, 64)
    assert (cfg.vocab_size, cfg.cls_token_num, cfg.caption_dim, cfg.model_type) == (16384, 120, 2048, "t2i")
    assert cfg.norm_eps == 1e-5 and cfg.ffn_hidden == FFN_HIDDEN[name]
    m, got = _meta_layout(name)
    want = expected_llamagen_layout(n_layer, d, FFN_HIDDEN[name])
    assert got == want, (f"ours only: {sorted(set(got) - set(want))}; LlamaGen only: {sorted(set(want) - set(got))}; "
                         f"shapes: {[(k, got[k], want[k]) for k in set(got) & set(want) if got[k] != want[k]]}")
    # not in checkpoints: the rotary table (non-persistent) and no KV-cache buffers
    assert "freqs_cis" not in got and m.freqs_cis.shape == (120 + 256, 32, 2)


def test_c2i_key_layout_matches_llamagen():
    _, got = _meta_layout("GPT-XL", model_type="c2i", cls_token_num=1)
    assert got == expected_llamagen_layout(36, 1280, 3584, model_type="c2i")


def test_first_condition_positions_have_no_rotation():
    m = build_gpt("GPT-B", **SMALL, block_size=L)
    f = m.freqs_cis
    assert torch.count_nonzero(f[:CLS]) == 0
    # image token 0 sits at grid (0, 0): angle 0 -> cos 1, sin 0; token 1 is (row 0, col 1)
    assert torch.equal(f[CLS, :, 0], torch.ones(f.shape[1])) and torch.count_nonzero(f[CLS, :, 1]) == 0
    half = f.shape[1] // 2
    assert torch.count_nonzero(f[CLS + 1, :half, 1]) == 0 and torch.count_nonzero(f[CLS + 1, half:, 1]) > 0
    assert torch.count_nonzero(f[CLS + 4, :half, 1]) > 0 and torch.count_nonzero(f[CLS + 4, half:, 1]) == 0


# ---------------------------------------------------------------------------------------------------- cached decoding
@torch.no_grad()
def full_logits(model, idx, cond, mask, drop=None):
    """[B, L + 1, V]: entry j is at sequence position cls - 1 + j and predicts image token j."""
    return model(idx, cond, mask, drop)[0]


@torch.no_grad()
def test_token_by_token_decode_equals_full_forward(model, batch):
    cond, mask, idx = batch
    cond2, mask2, drop = model.cfg_condition(cond, mask)  # conditional + unconditional (CFG) rows
    idx2 = torch.cat([idx, idx])
    want = full_logits(model, idx2, cond2, mask2, drop)
    cache = model.new_cache(6)
    got = [model.prefill(cache, cond2, mask2, drop)]
    for i in range(L):
        got.append(model.decode(cache, idx2[:, i:i + 1], torch.tensor([CLS + i]))[:, 0])
    close(torch.stack(got, 1), want)
    assert want.std() > 0.5  # the comparison is not between near-constant logits


@torch.no_grad()
def test_shared_consecutive_positions_take_slices_with_the_same_bits(model, batch, monkeypatch):
    """Positions shared by every row and consecutive (on the CPU: the device's loop, a prefill, one session's CFG
    rows) write the cache by slices and read the rotary table by a slice; with that check switched off the same
    positions go through the general gather/scatter path. Both give the same bits, token by token and in chunks
    (a catch-up after a verification), given as [T] or as [B, T]."""
    import ciar.models.gpt as gpt_mod
    from ciar.models.gpt import _consecutive

    assert _consecutive(torch.arange(CLS, CLS + 3), 100) == CLS
    assert _consecutive(torch.arange(CLS, CLS + 3)[None].expand(2, 3), 100) == CLS  # equal rows
    assert _consecutive(torch.tensor([CLS, CLS + 2]), 100) is None  # not consecutive
    assert _consecutive(torch.tensor([[CLS, CLS + 1], [CLS + 1, CLS + 2]]), 100) is None  # rows differ
    assert _consecutive(torch.arange(98, 101), 100) is None  # past the rotary table: the clamped general path
    cond, mask, idx = batch
    cond2, mask2, drop = model.cfg_condition(cond, mask)
    idx2 = torch.cat([idx, idx])
    b = idx2.shape[0]

    def run(per_row: bool):
        cache = model.new_cache(b)
        outs = [model.prefill(cache, cond2, mask2, drop)]
        for start, stop in [(0, 1), (1, 2), (2, 5), (5, 6), (6, L)]:
            pos = torch.arange(CLS + start, CLS + stop)
            outs.append(model.decode(cache, idx2[:, start:stop], pos[None].expand(b, -1) if per_row else pos)[:, -1])
        return torch.stack(outs, 1), cache

    fast, fast_cache = run(False)
    assert torch.equal(run(True)[0], fast)
    monkeypatch.setattr(gpt_mod, "_consecutive", lambda pos, table: None)
    for per_row in (False, True):
        general, general_cache = run(per_row)
        assert torch.equal(fast, general)
        for k_fast, k_general in zip(fast_cache.k + fast_cache.v, general_cache.k + general_cache.v):
            assert torch.equal(k_fast, k_general)
    assert fast.std() > 0.5


def test_kv_runs_group_consecutive_slots():
    from ciar.models.gpt import kv_runs

    assert kv_runs(None, 4) == [(0, 0, 4)]
    assert kv_runs(torch.tensor([4, 5, 0, 1, 2, 7]), 6) == [(0, 4, 2), (2, 0, 3), (5, 7, 1)]
    assert kv_runs(torch.tensor([3, 2]), 2) == [(0, 3, 1), (1, 2, 1)]  # descending slots are separate runs


@torch.no_grad()
def test_scattered_slots_read_by_runs_or_gather_equal_full_forward(model, batch, monkeypatch):
    """Rows on scattered cache slots (some consecutive, some not, out of order): the zero-copy run reads and the
    per-layer gather give the same logits, equal to a full forward."""
    import ciar.models.gpt as gpt_mod

    cond, mask, idx = batch
    want = full_logits(model, idx, cond, mask)
    slots = torch.tensor([6, 7, 2])  # rows 0-1 one run, row 2 apart and before them

    def decode_all():
        cache = model.new_cache(8)
        got = [model.prefill(cache, cond, mask, slots=slots)]
        got.append(model.decode(cache, idx[:, :4], torch.arange(CLS, CLS + 4), slots)[:, :])
        return torch.cat([got[0][:, None], got[1]], 1)

    by_runs = decode_all()
    monkeypatch.setattr(gpt_mod, "kv_runs", lambda s, b: None if s is not None else [(0, 0, b)])
    by_gather = decode_all()
    close(by_runs, want[:, :5])
    close(by_gather, by_runs, atol=1e-6)


@torch.no_grad()
def test_padded_caption_content_is_ignored(model, batch):
    cond, mask, idx = batch
    noisy = cond + torch.randn(cond.shape, generator=torch.Generator().manual_seed(9)) * (~mask)[..., None]
    close(full_logits(model, idx, noisy, mask), full_logits(model, idx, cond, mask))
    cache = model.new_cache(3)
    close(model.prefill(cache, noisy, mask), full_logits(model, idx, cond, mask)[:, 0])


@torch.no_grad()
def test_chunks_at_per_row_positions_after_rollback(model, batch):
    cond, mask, idx = batch
    want = full_logits(model, idx, cond, mask)
    cache = model.new_cache(3)
    model.prefill(cache, cond, mask)
    # a 10-token draft per row, right up to `starts[r]` and wrong afterwards; then roll back to the accepted prefix
    starts = [2, 7, 0]
    draft = idx[:, :10].clone()
    for r, s in enumerate(starts):
        draft[r, s:] = (draft[r, s:] + 1) % V
    model.decode(cache, draft, torch.arange(CLS, CLS + 10))
    cache.set_length(range(3), CLS + 10)
    for r, s in enumerate(starts):
        cache.rollback(r, CLS + s)
    with pytest.raises(ValueError):
        cache.rollback(0, CLS + 11)
    t = 3
    for _ in range(3):  # three verification chunks of 3 tokens, each row at its own position
        pos = torch.tensor([[CLS + s + j for j in range(t)] for s in starts])  # [B, T]
        chunk = torch.stack([idx[r, s:s + t] for r, s in enumerate(starts)])
        got = model.decode(cache, chunk, pos)
        for r, s in enumerate(starts):
            close(got[r], want[r, s + 1:s + 1 + t])
            cache.set_length(r, CLS + s + t)
        starts = [s + t for s in starts]


@torch.no_grad()
def test_ragged_batch_with_padded_rows(model, batch):
    """Rows at different positions with different numbers of real tokens (padded to one chunk width)."""
    cond, mask, idx = batch
    want = full_logits(model, idx, cond, mask)
    cache = model.new_cache(3)
    model.prefill(cache, cond, mask)
    # row 0: tokens 0..11 one by one; row 1: tokens 0..3; row 2: nothing yet
    for i in range(12):
        rows = [0] if i >= 4 else [0, 1]
        model.decode(cache, idx[rows, i:i + 1], torch.tensor([CLS + i]), slots=torch.tensor(rows))
    done, real = [12, 4, 0], [4, 2, 3]  # tokens already in the cache; real tokens in this chunk (rest padding)
    width = 4
    pos = torch.tensor([[CLS + d + j for j in range(width)] for d in done])
    chunk = torch.stack([torch.cat([idx[r, d:d + n], torch.full((width - n,), 5)]) for r, (d, n) in
                         enumerate(zip(done, real))])
    got = model.decode(cache, chunk, pos)
    for r, (d, n) in enumerate(zip(done, real)):
        close(got[r, :n], want[r, d + 1:d + 1 + n])
    # the next chunk overwrites each row's padding; row 0 runs past the last image position (positions are
    # clamped for the rotary table, the cache has slack) and its real logits are still exact
    done = [d + n for d, n in zip(done, real)]  # [16, 6, 3]
    real = [0, 3, 4]
    pos = torch.tensor([[CLS + d + j for j in range(width)] for d in done])
    chunk = torch.stack([torch.cat([idx[r, d:d + n], torch.full((width - n,), 7)]) for r, (d, n) in
                         enumerate(zip(done, real))])
    got = model.decode(cache, chunk, pos)
    for r, (d, n) in enumerate(zip(done, real)):
        close(got[r, :n], want[r, d + 1:d + 1 + n])


@torch.no_grad()
def test_packed_ragged_batch_equals_dense(model, batch):
    """`packed`: projections and feed-forward on the real tokens only; real positions give what the dense padded
    forward gives (and the full forward), and the cache ends up the same at every real position."""
    cond, mask, idx = batch
    want = full_logits(model, idx, cond, mask)
    done, real, width = [6, 2, 0], [4, 1, 3], 4
    pos = torch.tensor([[CLS + d + j for j in range(width)] for d in done])
    chunk = torch.stack([torch.cat([idx[r, d:d + n], torch.full((width - n,), 5)]) for r, (d, n) in
                         enumerate(zip(done, real))])
    caches = []
    for packed in (None, torch.cat([r * width + torch.arange(n) for r, n in enumerate(real)])):
        cache = model.new_cache(3)
        model.prefill(cache, cond, mask)
        for r, d in enumerate(done):
            if d:
                model.decode(cache, idx[r:r + 1, :d], torch.arange(CLS, CLS + d), slots=torch.tensor([r]))
        h = model.forward_cached(cache, model.tok_embeddings(chunk), pos, packed=packed)
        got = model.logits(h)
        for r, (d, n) in enumerate(zip(done, real)):
            close(got[r, :n], want[r, d + 1:d + 1 + n])
        if packed is not None:
            assert all(float(h[r, n:].abs().sum()) == 0.0 for r, n in enumerate(real))  # padding: zeros
        caches.append(cache)
    for r, (d, n) in enumerate(zip(done, real)):
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            close(a[r, :, :CLS + d + n], b[r, :, :CLS + d + n])


@torch.no_grad()
def test_slots_map_rows_to_noncontiguous_cache_slots(model, batch):
    cond, mask, idx = batch
    want_a = full_logits(model, idx, cond, mask)
    cond_b, mask_b = caption(2, CLS, SMALL["caption_dim"], left_padded([3, 6], CLS), seed=5), left_padded([3, 6], CLS)
    idx_b = tokens(2, L, seed=6)
    want_b = full_logits(model, idx_b, cond_b, mask_b)
    cache = model.new_cache(7)
    slots_a, slots_b = torch.tensor([5, 0, 3]), torch.tensor([6, 2])
    got_a = [model.prefill(cache, cond, mask, slots=slots_a)]
    got_b = [model.prefill(cache, cond_b, mask_b, slots=slots_b)]
    assert [cache.lengths[s] for s in (5, 0, 3, 6, 2)] == [CLS] * 5 and cache.lengths[1] == cache.lengths[4] == 0
    for i in range(0, L, 2):  # the two batches interleave, two tokens at a time
        pos = torch.arange(CLS + i, CLS + i + 2)
        got_a.append(model.decode(cache, idx[:, i:i + 2], pos, slots=slots_a))
        got_b.append(model.decode(cache, idx_b[:, i:i + 2], pos, slots=slots_b))
    close(torch.cat([got_a[0][:, None]] + got_a[1:], 1), want_a)
    close(torch.cat([got_b[0][:, None]] + got_b[1:], 1), want_b)
    for k, v in zip(cache.k, cache.v):  # slots nobody used were never written
        assert k[[1, 4]].count_nonzero() == 0 and v[[1, 4]].count_nonzero() == 0


@torch.no_grad()
# ---------------------------------------------------------------------------------------------------- the fused step
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rms_norm_is_llamagens_three_steps_bit_for_bit(dtype):
    """RMSNorm in low precision normalises with the fused kernel on the float32 upcast: on a CPU the same bits as
    LlamaGen's x * rsqrt(mean(x^2) + eps) in float32, rounded, then scaled."""
    from ciar.models.gpt import RMSNorm

    g = torch.Generator().manual_seed(0)
    for shape in [(4, 1, 64), (3, 7, 1280), (2, 5, 2048)]:
        norm = RMSNorm(shape[-1]).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
        x = (3 * torch.randn(*shape, generator=g)).to(dtype)
        xf = x.float()
        ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight
        assert torch.equal(norm(x), ref)


def test_rotary_factors_once_equal_the_table_per_call(model):
    from ciar.models.gpt import apply_rotary_emb, rotary_factors

    x = torch.randn(3, 5, 6, model.config.head_dim, generator=torch.Generator().manual_seed(0))
    freqs = model.freqs_cis[10:15][None].expand(3, -1, -1, -1)
    assert torch.equal(apply_rotary_emb(x, rotary_factors(freqs)), apply_rotary_emb(x, freqs))


def test_a_fused_feed_forward_is_one_gemm_over_the_same_weights_and_unfuses():
    from ciar.models.gpt import fuse_feed_forward

    m = small_gpt()
    keys = list(m.state_dict())
    ff = m.layers[0].feed_forward
    x = torch.randn(2, 7, SMALL["dim"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ff(x)
        w1 = ff.w1.weight.clone()
        fuse_feed_forward(m)
        assert ff.w13 is not None and ff.w13.shape == (2 * w1.shape[0], w1.shape[1])
        assert ff.w1.weight.data_ptr() == ff.w13.data_ptr() and torch.equal(ff.w1.weight, w1)  # views: no copy
        assert ff.w3.weight.data_ptr() == ff.w13[w1.shape[0]:].data_ptr()
        assert list(m.state_dict()) == keys  # the same parameters by name
        close(ff(x), before)
        fuse_feed_forward(m, False)
        assert ff.w13 is None and ff.w1.weight.data_ptr() != ff.w3.weight.data_ptr() and torch.equal(ff.w1.weight, w1)
        assert torch.equal(ff(x), before)


def _static_step(model, cache, block=None, packed=None):
    rows, width, kv = 4, 2, CLS + 9
    h = torch.randn(rows, width, SMALL["dim"], generator=torch.Generator().manual_seed(3))
    pos = torch.arange(kv - width, kv)[None].expand(rows, width).contiguous()
    return model.forward_cached(cache, h, pos, torch.arange(rows), kv_len=kv, static=True, block=block,
                                packed=packed)


# a packed static step: the positions of rows 0 and 2 (rows 1 and 3 stand for padding: their keys are written as
# zeros, which rows 0 and 2 never read), then spare entries naming one of those (a token bucket of 6)
PACKED = torch.tensor([0, 1, 4, 5, 5, 5])


def test_a_packed_static_step_gives_the_fed_positions_of_the_unpacked_one(model):
    """`GPT.forward_cached(static=True, packed=...)`, eagerly and through a block function: the fed positions'
    states are the unpacked step's (the projections of one row do not see the others'), the rest zeros."""
    from ciar.models.gpt import _static_packed_block

    with torch.no_grad():
        ref = _static_step(model, model.new_cache(4)).reshape(8, -1)
        for block in (None, _static_packed_block):
            got = _static_step(model, model.new_cache(4), block, PACKED).reshape(8, -1)
            close(got[PACKED], ref[PACKED])
            assert torch.equal(got[[2, 3, 6, 7]], torch.zeros(4, got.shape[-1]))


def test_a_block_function_runs_static_forwards_only(model):
    from ciar.models.gpt import TransformerBlock

    calls = []

    def block(layer, x, freqs, mask, k, v, slot_idx, pos, kv_len):
        calls.append(freqs.shape)
        return TransformerBlock.forward_cached(layer, x, freqs, mask, k, v, slot_idx, pos, None, kv_len)

    with torch.no_grad():
        cache = model.new_cache(4)
        ref = _static_step(model, cache)
        assert torch.equal(_static_step(model, model.new_cache(4), block), ref)
        assert len(calls) == SMALL["n_layer"]
        with pytest.raises(ValueError, match="static"):
            model.forward_cached(cache, torch.zeros(1, 1, SMALL["dim"]), torch.tensor([CLS]), block=block)


@pytest.mark.slow
def test_the_compiled_block_matches_the_eager_one(model):
    """torch.compile's block (what CUDA's fused steps capture; here inductor's CPU code): float32 logits to
    rounding, RoPE in real arithmetic."""
    from ciar.models.gpt import compiled_block

    with torch.no_grad():
        close(_static_step(model, model.new_cache(4), compiled_block()), _static_step(model, model.new_cache(4)))
        close(_static_step(model, model.new_cache(4), compiled_block(packed=True), PACKED),
              _static_step(model, model.new_cache(4), None, PACKED))


def test_c2i_cached_decode_equals_full_forward():
    m = small_gpt(seed=3, model_type="c2i", cls_token_num=1, num_classes=10)
    labels, idx = torch.tensor([3, 0, 9]), tokens(3, L, seed=4)
    drop = torch.tensor([False, False, True])
    want = full_logits(m, idx, labels, None, drop)
    cache = m.new_cache(3)
    got = [m.prefill(cache, labels, None, drop)]
    got += list(m.decode(cache, idx, torch.arange(1, 1 + L)).unbind(1))
    close(torch.stack(got, 1), want)


# ---------------------------------------------------------------------------------------------------- LlamaGen itself
def _load_llamagen_module(relpath: str, name: str):
    src = os.environ.get("LLAMAGEN_SRC")
    if not src:
        pytest.skip("LLAMAGEN_SRC is not set: point it at a LlamaGen checkout to compare with its own code")
    path = os.path.join(src, relpath)
    if not os.path.isfile(path):
        pytest.fail(f"LLAMAGEN_SRC={src} has no {relpath}")
    saved = {k: sys.modules.get(k) for k in ("utils", "utils.drop_path")}
    sys.path.insert(0, src)  # gpt.py imports utils.drop_path from the LlamaGen root
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(src)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


@pytest.fixture(scope="module")
def llamagen():
    return (_load_llamagen_module("autoregressive/models/gpt.py", "llamagen_gpt"),
            _load_llamagen_module("autoregressive/models/generate.py", "llamagen_generate"))


# LlamaGen's caption embedder always holds 120 unconditional tokens, so these tests use cls_token_num=120
LG_SMALL = dict(n_layer=2, dim=128, n_head=4, caption_dim=64, vocab_size=256, block_size=16)
LG_CLS = 120


def _llamagen_pair(llamagen, tmp_path, model_type="t2i", **kw):
    """A LlamaGen Transformer with random weights, and ours loaded from its checkpoint by `load_llamagen_gpt`."""
    lg, _ = llamagen
    args = {**LG_SMALL, "model_type": model_type, "cls_token_num": LG_CLS if model_type == "t2i" else 1, **kw}
    torch.manual_seed(0)
    ref = randomize_(lg.Transformer(lg.ModelArgs(**args)), seed=11).eval()
    torch.save({"model": ref.state_dict(), "steps": 0}, tmp_path / "lg.pt")
    over = {k: v for k, v in args.items() if k != "block_size"}
    ours = load_llamagen_gpt(str(tmp_path / "lg.pt"), "GPT-B", image_size=64, downsample=16, **over)
    return ref, ours


def _llamagen_causal_mask_as_generate(ref, emb_masks):
    """What LlamaGen's `generate` does to the causal mask after `setup_caches` (left-padded caption keys off,
    diagonal on)."""
    t = emb_masks.shape[1]
    ref.causal_mask[:, :, :t] = ref.causal_mask[:, :, :t] * emb_masks.unsqueeze(1)
    eye = torch.eye(ref.causal_mask.size(1), ref.causal_mask.size(2))
    ref.causal_mask[:] = ref.causal_mask * (1 - eye) + eye


class _CpuLinspace(torch.overrides.TorchFunctionMode):
    """LlamaGen's Transformer calls `.item()` on a `torch.linspace` (drop-path rates): keep that one on the CPU
    while everything else is built on the meta device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.linspace:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def test_key_layout_equals_llamagen_source(llamagen):
    lg, _ = llamagen
    for name, model_type in (("GPT-XL", "t2i"), ("GPT-B", "c2i")):
        n_layer, n_head, d = SIZES[name]
        args = dict(n_layer=n_layer, n_head=n_head, dim=d, model_type=model_type)
        if model_type == "t2i":
            args.update(caption_dim=2048, cls_token_num=120)
        with torch.device("meta"), _CpuLinspace():  # no real allocation of GPT-XL
            ref = lg.Transformer(lg.ModelArgs(**args))
        want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        _, got = _meta_layout(name, **({} if model_type == "t2i" else dict(model_type="c2i", cls_token_num=1)))
        assert got == want, (f"{name} {model_type}: ours only {sorted(set(got) - set(want))}; "
                             f"LlamaGen only {sorted(set(want) - set(got))}")


@torch.no_grad()
def test_t2i_logits_equal_llamagen(llamagen, tmp_path):
    ref, ours = _llamagen_pair(llamagen, tmp_path)
    b = 2
    emb_masks = left_padded([LG_CLS, 17], LG_CLS)
    cond = caption(b, LG_CLS, LG_SMALL["caption_dim"], emb_masks)
    idx = tokens(b, L)
    # CFG batch as LlamaGen's generate builds it: [cond; uncond_embedding], masks repeated
    cond_null = torch.zeros_like(cond) + ref.cls_embedding.uncond_embedding
    ref_cond, masks2 = torch.cat([cond, cond_null]), torch.cat([emb_masks, emb_masks])
    our_cond, our_mask, drop = ours.cfg_condition(cond, emb_masks)
    idx2 = torch.cat([idx, idx])
    s = LG_CLS + L

    # full forward: LlamaGen in eval mode with an explicit mask built as generate builds it
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool))[None].repeat(2 * b, 1, 1)
    mask[:, :, :LG_CLS] &= masks2[:, None, :]
    mask |= torch.eye(s, dtype=torch.bool)
    want = ref(idx2, ref_cond, input_pos=torch.arange(s), mask=mask[:, None])[0][:, LG_CLS - 1:]
    got = ours(idx2, our_cond, our_mask, drop)[0]
    full_diff = (got - want).abs().max().item()
    close(got, want)

    # cached: LlamaGen's setup_caches + generate's mask, prefill then one token at a time
    ref.setup_caches(max_batch_size=2 * b, max_seq_length=s, dtype=torch.float32)
    _llamagen_causal_mask_as_generate(ref, masks2)
    want_c = [ref(None, ref_cond, input_pos=torch.arange(LG_CLS))[0][:, -1]]
    cache = ours.new_cache(2 * b)
    got_c = [ours.prefill(cache, our_cond, our_mask, drop)]
    for i in range(L):
        pos = torch.tensor([LG_CLS + i])
        want_c.append(ref(idx2[:, i:i + 1], None, input_pos=pos)[0][:, -1])
        got_c.append(ours.decode(cache, idx2[:, i:i + 1], pos)[:, -1])
    got_c, want_c = torch.stack(got_c, 1), torch.stack(want_c, 1)
    cached_diff = (got_c - want_c).abs().max().item()
    print(f"\nt2i vs LlamaGen: full forward max|diff| {full_diff:.3g}, cached {cached_diff:.3g} "
          f"(logit scale {want.abs().max().item():.3g})")
    close(got_c, want_c)
    close(got_c, want)


@torch.no_grad()
def test_greedy_generation_equals_llamagen_generate(llamagen, tmp_path):
    _, gen = llamagen
    ref, ours = _llamagen_pair(llamagen, tmp_path)
    b, scale = 2, 4.0
    emb_masks = left_padded([30, 64], LG_CLS)
    cond = caption(b, LG_CLS, LG_SMALL["caption_dim"], emb_masks, seed=21)
    want = gen.generate(ref, cond, L, emb_masks, cfg_scale=scale, temperature=1.0, top_k=0, top_p=1.0,
                        sample_logits=False).long()

    cond2, mask2, drop = ours.cfg_condition(cond, emb_masks)
    cache = ours.new_cache(2 * b)
    logits = ours.prefill(cache, cond2, mask2, drop)
    out = []
    for i in range(L):
        guided = logits[b:] + (logits[:b] - logits[b:]) * scale
        tok = guided.argmax(-1)
        out.append(tok)
        if i < L - 1:
            logits = ours.decode(cache, torch.cat([tok, tok])[:, None], torch.tensor([LG_CLS + i]))[:, -1]
    got = torch.stack(out, 1)
    assert torch.equal(got, want)
    assert len(set(got.flatten().tolist())) > 3


@torch.no_grad()
def test_c2i_logits_equal_llamagen(llamagen, tmp_path):
    ref, ours = _llamagen_pair(llamagen, tmp_path, model_type="c2i", num_classes=10)
    labels, idx = torch.tensor([4, 10]), tokens(2, L, seed=8)  # 10 = the unconditional label
    s = 1 + L
    want = ref(idx, labels, input_pos=torch.arange(s))[0]
    got = ours(idx, labels)[0]
    full_diff = (got - want).abs().max().item()
    close(got, want)
    ref.setup_caches(max_batch_size=2, max_seq_length=s, dtype=torch.float32)
    want_c = [ref(None, labels, input_pos=torch.arange(1))[0][:, -1]]
    cache = ours.new_cache(2)
    got_c = [ours.prefill(cache, labels)]
    for i in range(L):
        pos = torch.tensor([1 + i])
        want_c.append(ref(idx[:, i:i + 1], None, input_pos=pos)[0][:, -1])
        got_c.append(ours.decode(cache, idx[:, i:i + 1], pos)[:, -1])
    got_c, want_c = torch.stack(got_c, 1), torch.stack(want_c, 1)
    print(f"\nc2i vs LlamaGen: full forward max|diff| {full_diff:.3g}, cached "
          f"{(got_c - want_c).abs().max().item():.3g}")
    close(got_c, want_c)


def test_cached_decoding_on_cuda_switches_cudnn_attention_off_and_elsewhere_leaves_it():
    """cuDNN's attention kernels were not bit-repeatable on an H100 in bf16 (ciar.models.gpt.repeatable_attention):
    every KV cache made for a CUDA model switches them off; a CPU model leaves torch's flag as it was."""
    from ciar.models.gpt import build_gpt, repeatable_attention

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        build_gpt("scenes-cloud").new_cache(2)
        repeatable_attention("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        repeatable_attention(torch.device("cuda", 0))  # (the flag is global; no GPU is needed to set it)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
