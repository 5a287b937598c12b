"""Loading in the world's dtype: `load_llamagen_gpt(..., dtype=)` casts each checkpoint tensor as it is read (the
model built on the meta device), and `T5CaptionEncoder(dtype=)` hands transformers unread slices when the stored
weights are converted. The weights are those of a float32 load cast afterwards, and no float32 copy of the model is
ever allocated (the unit test counts the bytes every torch op allocates during the load)."""

from __future__ import annotations

import collections

import pytest
import torch
from safetensors.torch import save_file
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ciar.models.checkpoint as checkpoint
from ciar.models.checkpoint import CheckpointMismatchError, load_strict, read_checkpoint
from ciar.models.gpt import GPT_IGNORED_KEY_PREFIXES, build_gpt, load_llamagen_gpt

# a small t2i model in LlamaGen's layout (4x4 grid at 64 px); float32 ~15 MB, its largest tensor 1 MB
SMALL = dict(n_layer=4, dim=256, n_head=4, caption_dim=128, cls_token_num=8, vocab_size=1024)


def _random_gpt(seed: int = 0):
    torch.manual_seed(seed)
    model = build_gpt("GPT-B", block_size=16, **SMALL)
    with torch.no_grad():  # every tensor random (LlamaGen's zero output head and unit norms would hide a mix-up)
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.normal_()
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A LlamaGen-layout checkpoint (`{"model": state_dict}` .pt, float32, with a training step count beside it)."""
    path = tmp_path_factory.mktemp("dtype") / "t2i_small.pt"
    torch.save({"model": _random_gpt().state_dict(), "steps": 7}, path)
    return str(path)


def _load(path, dtype=torch.float32):
    return load_llamagen_gpt(path, "GPT-B", image_size=64, downsample=16, dtype=dtype, **SMALL)


def _eager_float32(path):
    """The load before per-tensor casting: a float32 model, the whole checkpoint read, `load_strict`."""
    model = build_gpt("GPT-B", block_size=16, **SMALL)
    load_strict(model, read_checkpoint(path), ignore_prefixes=GPT_IGNORED_KEY_PREFIXES)
    return model.eval()


def _tensors(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}  # freqs_cis too (not in state_dict)


def test_float32_load_is_bit_identical_to_the_eager_load(ckpt):
    ref, got = _eager_float32(ckpt), _load(ckpt)
    want, have = _tensors(ref), _tensors(got)
    assert want.keys() == have.keys()
    for k, v in want.items():
        assert have[k].dtype == torch.float32 and have[k].is_contiguous() and torch.equal(have[k], v), k
    assert all(p.requires_grad for p in got.parameters()) and not got.training
    assert not any(t.is_meta for t in have.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_load_equals_the_float32_load_cast_afterwards(ckpt, dtype):
    ref = _eager_float32(ckpt).to(dtype)  # what the world did before: float32 load, then .to(gpt_dtype)
    got = _load(ckpt, dtype)
    want, have = _tensors(ref), _tensors(got)
    assert want.keys() == have.keys()
    for k, v in want.items():
        assert have[k].dtype == dtype and torch.equal(have[k], v), k
    assert isinstance(got.tok_embeddings.weight, torch.nn.Parameter) and not got.training
    g = torch.Generator().manual_seed(1)
    idx, cond = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g), torch.randn(2, 8, 128, generator=g)
    with torch.no_grad():
        assert torch.equal(got(idx, cond.to(dtype))[0], ref(idx, cond.to(dtype))[0])


def test_safetensors_and_legacy_checkpoints_load_the_same(ckpt, tmp_path):
    state = read_checkpoint(ckpt)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    torch.save({"model": state}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # read whole
    want = _tensors(_load(ckpt, torch.bfloat16))
    for name in ("m.safetensors", "legacy.pt"):
        have = _tensors(_load(str(tmp_path / name), torch.bfloat16))
        assert all(have[k].dtype == want[k].dtype and torch.equal(have[k], want[k]) for k in want), name


def test_views_of_a_shared_storage_load_as_their_own_values(tmp_path):
    """A checkpoint whose tensors are views (a transposed one, two slices of one storage) loads their values."""
    model = _random_gpt(1)
    state = dict(model.state_dict())
    k1, k2 = "layers.0.attention.wo.weight", "layers.1.attention.wo.weight"
    both = torch.stack([state[k1], state[k2]])  # one storage, two views of it
    state[k1], state[k2] = both[0], both[1]
    state["tok_embeddings.weight"] = state["tok_embeddings.weight"].t().contiguous().t()  # column-major strides
    torch.save({"model": state}, tmp_path / "views.pt")
    got = _load(str(tmp_path / "views.pt"), torch.bfloat16).state_dict()
    for k, v in model.state_dict().items():
        assert got[k].is_contiguous() and torch.equal(got[k], v.to(torch.bfloat16)), k


def test_mismatched_checkpoint_is_refused_before_any_weight_is_read(ckpt, tmp_path, monkeypatch):
    state = read_checkpoint(ckpt)
    state["extra.weight"] = torch.zeros(3)
    del state["norm.weight"]
    state["output.weight"] = torch.zeros(7, 7)
    torch.save({"model": state}, tmp_path / "bad.pt")
    monkeypatch.setattr(checkpoint, "_read_storage", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointMismatchError) as e:
        _load(str(tmp_path / "bad.pt"), torch.bfloat16)
    msg = str(e.value)
    assert "LlamaGen GPT-B model" in msg and "missing keys (1): norm.weight" in msg
    assert "unexpected keys (1): extra.weight" in msg and "output.weight: checkpoint (7, 7) vs model" in msg


class _AllocationCounter(TorchDispatchMode):
    """Bytes of the new CPU storages each torch op returns (an output sharing an input's storage, a view or an
    in-place result, is not new), by dtype. Their total bounds the peak of what was allocated at once."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    self.bytes[t.dtype] += t.untyped_storage().nbytes()
        return out


def test_unit_bfloat16_load_never_allocates_a_float32_copy(ckpt, monkeypatch):
    """Unit test (allocation counting, no timing, no RSS): a bfloat16 load allocates the bfloat16 model, one read
    buffer the size of the largest float32 tensor, and the small rotary table: never the float32 model, and never
    the whole checkpoint (the eager readers are patched to fail)."""
    f32 = {k: v.nbytes for k, v in read_checkpoint(ckpt).items() if isinstance(v, torch.Tensor)}
    model_f32, largest = sum(f32.values()), max(f32.values())

    with _AllocationCounter() as sanity:  # the counter sees allocations: a float32 model built the usual way
        build_gpt("GPT-B", block_size=16, **SMALL)
    assert sanity.bytes[torch.float32] >= model_f32

    def meta_only_load(*args, **kwargs):
        assert kwargs.get("map_location") == "meta", "torch.load read the checkpoint's data"
        return real_load(*args, **kwargs)

    real_load = torch.load
    monkeypatch.setattr(torch, "load", meta_only_load)
    monkeypatch.setattr(checkpoint, "read_checkpoint", lambda *a, **k: pytest.fail("the whole checkpoint was read"))
    reads = []
    real_read = checkpoint._read_storage
    monkeypatch.setattr(checkpoint, "_read_storage", lambda *a: reads.append(real_read(*a)) or reads[-1])
    with _AllocationCounter() as counted:
        model = _load(ckpt, torch.bfloat16)

    model_bf16 = sum(t.nbytes for t in _tensors(model).values())
    rope = model.freqs_cis.numel() * 4
    assert len(reads) == len(f32) and {r.dtype for r in reads} == {torch.float32}
    assert len({r.untyped_storage().data_ptr() for r in reads}) == 1  # every tensor read into the one buffer
    assert counted.bytes[torch.uint8] == largest  # that buffer: the largest tensor's bytes
    assert counted.bytes[torch.float32] <= 8 * rope < largest  # only the rotary table's computation
    assert counted.bytes[torch.bfloat16] == model_bf16
    assert sum(counted.bytes.values()) <= model_bf16 + largest + 8 * rope < model_f32


# ------------------------------------------------------------------------------------------------------------- T5
@pytest.fixture(scope="module")
def t5_float32(tmp_path_factory):
    from ciar.testing import make_tiny_t5

    return make_tiny_t5(str(tmp_path_factory.mktemp("t5") / "t5"), dtype=torch.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_t5_weights_equal_transformers_own_load(t5_float32, dtype):
    """float32 weights loaded as bfloat16 / float16 (positional reads, slices handed to transformers) are
    transformers' own `from_pretrained(torch_dtype=)` weights: the same types (float16 keeps T5's `wo` in float32)
    and values, the embedding still tied."""
    from transformers import T5EncoderModel

    from ciar.t5 import DTYPES, T5CaptionEncoder

    want = T5EncoderModel.from_pretrained(t5_float32, local_files_only=True, torch_dtype=DTYPES[dtype]).state_dict()
    enc = T5CaptionEncoder(t5_float32, max_length=8, dtype=dtype)
    have = enc.model.state_dict()
    assert want.keys() == have.keys()
    for k, v in want.items():
        assert have[k].dtype == v.dtype and torch.equal(have[k], v), k
    assert enc.model.shared.weight.data_ptr() == enc.model.encoder.embed_tokens.weight.data_ptr()


def test_unit_t5_reads_positionally_only_when_it_converts(t5_float32, tmp_path):
    """Stored float32: a bfloat16 load takes the positional readers; a float32 one (nothing to convert) and a
    bfloat16 folder loaded as bfloat16 keep transformers' own memory-mapped load."""
    from ciar.testing import make_tiny_t5
    from ciar.t5 import _positional_readers, _safetensors_files

    files = _safetensors_files(t5_float32)
    readers = _positional_readers(files, torch.bfloat16)
    assert readers is not None and len(readers) == 1
    for f in readers:
        f.__exit__(None, None, None)
    assert _positional_readers(files, torch.float32) is None
    bf16 = make_tiny_t5(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert _positional_readers(_safetensors_files(bf16), torch.bfloat16) is None
    assert _safetensors_files(str(tmp_path)) is None
