"""The FID Inception-v3 (`ciar.metrics.inception`) on RANDOM weights in the real file layout: bit-exact with
torch-fidelity's own implementation of the graph, the TensorFlow 1.x resize, strict loading with named keys, and
FID through torchmetrics.

The reference comparison imports torch-fidelity's Inception module from `.venv/reference` (`make test` installs the
package there without its torchvision dependency and keeps it off sys.path, so torchmetrics never sees it), or
from `$CIAR_REFERENCE_DIR`."""

import importlib
import os
import sys
import types

import pytest
import torch

from ciar.metrics.fid import fid_between, make_fid
from ciar.metrics.inception import FIDInceptionV3, load_fid_inception, read_inception_state, tf1_resize_bilinear
from ciar.models.checkpoint import CheckpointMismatchError
from ciar.testing import write_random_fid_inception

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE_DIR = os.environ.get("CIAR_REFERENCE_DIR", os.path.join(REPO, ".venv", "reference"))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_random_fid_inception(str(tmp_path_factory.mktemp("inception") / "pt_inception-random.pth"), seed=3)


@pytest.fixture
def torch_fidelity_inception():
    """torch-fidelity's FeatureExtractorInceptionV3 class, imported without running the package's __init__ (which
    needs torchvision). Function scope: the stub package must leave sys.modules before anything else (torchmetrics
    probes for torch_fidelity) runs."""
    pkg_dir = os.path.join(REFERENCE_DIR, "torch_fidelity")
    if not os.path.isdir(pkg_dir):
        pytest.skip(f"torch-fidelity is not in {REFERENCE_DIR}: run `make test` (or `pip install --no-deps "
                    f"--target DIR torch-fidelity==0.4.0` and set CIAR_REFERENCE_DIR=DIR)")
    saved = {k: v for k, v in sys.modules.items() if k == "torch_fidelity" or k.startswith("torch_fidelity.")}
    stub = types.ModuleType("torch_fidelity")
    stub.__path__ = [pkg_dir]
    sys.modules["torch_fidelity"] = stub
    try:
        yield importlib.import_module("torch_fidelity.feature_extractor_inceptionv3").FeatureExtractorInceptionV3
    finally:
        for k in [k for k in sys.modules if k == "torch_fidelity" or k.startswith("torch_fidelity.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_features_are_bit_exact_with_torch_fidelity(weights, torch_fidelity_inception):
    ref = torch_fidelity_inception("inception-v3-compat", ["64", "192", "768", "2048"],
                                   feature_extractor_weights_path=weights)
    g = torch.Generator().manual_seed(0)
    # a small square (upsampled), a non-square photo size, and exactly 299 (no resize)
    for shape in ((2, 3, 48, 48), (1, 3, 200, 256), (1, 3, 299, 299)):
        x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        expected = ref(x)
        for dim, want in zip((64, 192, 768, 2048), expected):
            got = load_fid_inception(weights, feature=dim)(x)
            assert got.dtype == torch.float32 and got.shape == (shape[0], dim)
            assert torch.equal(got, want), (shape, dim, (got - want).abs().max().item())
    assert want.abs().max() > 0.5  # random batch-norm statistics keep the features far from zero


def test_tf1_resize_samples_without_half_pixel_centres():
    x = torch.tensor([[0.0, 10.0], [20.0, 30.0]]).view(1, 1, 2, 2)
    # destination i samples source i * 2 / 4 = 0, 0.5, 1, 1.5 (the last clamps to the edge)
    want = torch.tensor([[0.0, 5.0, 10.0, 10.0], [10.0, 15.0, 20.0, 20.0], [20.0, 25.0, 30.0, 30.0],
                         [20.0, 25.0, 30.0, 30.0]])
    assert torch.equal(tf1_resize_bilinear(x, 4)[0, 0], want)
    y = torch.rand(2, 3, 7, 7)
    assert torch.equal(tf1_resize_bilinear(y, 7), y)
    # PyTorch's bilinear (half-pixel centres) is a different function
    assert not torch.allclose(torch.nn.functional.interpolate(x, size=4, mode="bilinear", align_corners=False)[0, 0],
                              want)


def test_loading_accepts_both_conversions_and_is_deterministic(weights, tmp_path):
    plain = write_random_fid_inception(str(tmp_path / "plain.pth"), seed=3, with_batch_counts=False)
    wrapped = str(tmp_path / "wrapped.pth")
    torch.save({"state_dict": torch.load(weights, weights_only=True)}, wrapped)
    x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    a = load_fid_inception(weights)(x)
    assert torch.equal(a, load_fid_inception(plain)(x))
    assert torch.equal(a, load_fid_inception(wrapped)(x))
    assert torch.equal(a, load_fid_inception(weights)(x))
    assert not any(p.requires_grad for p in load_fid_inception(weights).parameters())


def test_a_wrong_file_is_refused_with_the_keys_named(weights, tmp_path):
    state = torch.load(weights, weights_only=True)
    broken = dict(state)
    del broken["Mixed_6c.branch7x7dbl_3.conv.weight"]
    broken["Mixed_7c.branch_pool.conv.weight"] = torch.zeros(192, 2048, 3, 3)
    broken["AuxLogits.fc.weight"] = torch.zeros(1000, 768)
    torch.save(broken, tmp_path / "broken.pth")
    with pytest.raises(CheckpointMismatchError) as e:
        load_fid_inception(str(tmp_path / "broken.pth"))
    msg = str(e.value)
    assert "Mixed_6c.branch7x7dbl_3.conv.weight" in msg and "AuxLogits.fc.weight" in msg
    assert "Mixed_7c.branch_pool.conv.weight: checkpoint (192, 2048, 3, 3) vs model (192, 2048, 1, 1)" in msg
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        load_fid_inception(str(tmp_path / "nowhere.pth"))
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="junk.pth"):
        read_inception_state(str(tmp_path / "junk.pth"))
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="state dict"):
        read_inception_state(str(tmp_path / "list.pth"))
    with pytest.raises(ValueError, match="feature"):
        FIDInceptionV3(feature=1000)
    with pytest.raises(ValueError, match="uint8"):
        FIDInceptionV3()(torch.rand(1, 3, 32, 32))


def test_fid_through_torchmetrics(weights):
    fid = make_fid("inception", weights, feature=64)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, (6, 3, 40, 40), generator=g, dtype=torch.uint8)
    dark = torch.randint(0, 60, (6, 3, 40, 40), generator=g, dtype=torch.uint8)
    assert fid_between(fid, a, a) == pytest.approx(0.0, abs=1e-3)
    assert fid_between(fid, a, dark) > 1e-2
    with pytest.raises(ValueError, match="weights_path"):
        make_fid("inception", None)
