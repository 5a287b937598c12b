"""Measuring instruments of the default world: attribute probe and scene FID."""

import json
import os

import numpy as np
import pytest
import torch
from torchmetrics.image.fid import FrechetInceptionDistance

from ciar.data import scenes
from ciar.metrics.fid import FeatureNetConfig, SceneFeatureNet, fid_between, load_feature_net, make_fid
from ciar.metrics.probe import (AttributeProbe, ProbeConfig, attribute_accuracy, load_probe, scene_targets,
                                to_model_input)
from ciar.models.checkpoint import read_model_file
from pipelines import train_probes

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def heldout64():
    return scenes.batch("heldout", 0, 64, 0)


class StubProbe(torch.nn.Module):
    """Returns one-hot logits for given per-cell targets, consuming them in order (as `predict` batches)."""

    def __init__(self, targets):
        super().__init__()
        self.t = targets
        self.cursor = 0
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, images):
        n = len(images)
        sl = slice(self.cursor, self.cursor + n)
        self.cursor += n
        big = lambda t, k: torch.nn.functional.one_hot(t[sl].clamp_min(0), k).float() * 10  # noqa: E731
        return {"shape": big(self.t["shape"], 5), "color": big(self.t["color"], 6), "size": big(self.t["size"], 2),
                "background": big(self.t["background"], 5)}


def _scene(*objects, background="gray"):
    return scenes.Scene(tuple(scenes.SceneObject(*o) for o in objects), background)


def test_probe_output_shapes_and_inputs():
    torch.manual_seed(0)
    probe = AttributeProbe(ProbeConfig()).eval()
    images, _ = scenes.batch("probe", 0, 4, 0)
    out = probe(images)  # uint8 [B, 48, 48, 3]
    assert out["shape"].shape == (4, 9, 5) and out["color"].shape == (4, 9, 6)
    assert out["size"].shape == (4, 9, 2) and out["background"].shape == (4, 5)
    x = to_model_input(images)
    assert x.shape == (4, 3, 48, 48) and x.dtype == torch.float32 and -1 <= x.min() and x.max() <= 1
    assert torch.allclose(probe(x)["shape"], out["shape"])  # float [-1, 1] NCHW gives the same answer
    assert torch.equal(to_model_input(torch.as_tensor(images).permute(0, 3, 1, 2)), x)  # uint8 NCHW too
    assert probe(torch.zeros(2, 96, 96, 3, dtype=torch.uint8))["shape"].shape == (2, 9, 5)  # resized


def test_stub_with_exact_targets_scores_one():
    sc = [scenes.scene_at("heldout", i) for i in range(40)]
    images = np.zeros((40, 48, 48, 3), np.uint8)
    rep = attribute_accuracy(StubProbe(scene_targets(sc)), images, sc, batch_size=16)
    for k in ("attribute_accuracy", "shape_accuracy", "color_accuracy", "size_accuracy", "position_accuracy",
              "background_accuracy", "image_all_correct"):
        assert rep[k] == 1.0, k
    assert rep["spurious_objects"] == 0 and rep["num_images"] == 40
    assert rep["num_objects"] == sum(len(s.objects) for s in sc)
    # labels() dicts are accepted as well as Scene objects
    rep2 = attribute_accuracy(StubProbe(scene_targets(sc)), images, [s.labels() for s in sc])
    assert rep2 == rep


def test_wrong_cell_is_wrong_position_and_spurious():
    truth = [_scene(("circle", "red", "small", 0), ("square", "blue", "large", 4))]
    seen = [_scene(("circle", "red", "small", 1), ("square", "blue", "large", 4))]  # circle drawn one cell right
    rep = attribute_accuracy(StubProbe(scene_targets(seen)), np.zeros((1, 48, 48, 3), np.uint8), truth)
    assert rep["position_accuracy"] == 0.5
    assert rep["shape_accuracy"] == rep["color_accuracy"] == rep["size_accuracy"] == 0.5
    assert rep["attribute_accuracy"] == 0.5
    assert rep["spurious_objects"] == 1 and rep["background_accuracy"] == 1.0 and rep["image_all_correct"] == 0.0


def test_wrong_attributes_counted_separately():
    truth = [_scene(("triangle", "green", "small", 8), background="white")]
    seen = [_scene(("triangle", "orange", "large", 8), background="black")]
    rep = attribute_accuracy(StubProbe(scene_targets(seen)), np.zeros((1, 48, 48, 3), np.uint8), truth)
    assert rep["position_accuracy"] == rep["shape_accuracy"] == 1.0
    assert rep["color_accuracy"] == rep["size_accuracy"] == 0.0
    assert rep["attribute_accuracy"] == 0.5 and rep["background_accuracy"] == 0.0 and rep["spurious_objects"] == 0


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError):
        attribute_accuracy(StubProbe(scene_targets([])), np.zeros((2, 48, 48, 3), np.uint8),
                           [scenes.scene_at("val", 0)])


def test_shipped_probe_reads_heldout_references(weights_dir, heldout64):
    path = os.path.join(weights_dir, "probe.safetensors")
    if not os.path.isfile(path):
        pytest.skip(f"{path} absent: train it with `python -m pipelines.train_probes --out weights/scenes-v1`")
    probe = load_probe(path)
    images, sc = heldout64
    rep = attribute_accuracy(probe, images, sc)
    assert rep["attribute_accuracy"] >= 0.95, rep
    assert rep["background_accuracy"] >= 0.95, rep


def _feature_net(weights_dir):
    path = os.path.join(weights_dir, "fid_features.safetensors")
    if os.path.isfile(path):
        return load_feature_net(path), True
    torch.manual_seed(0)
    return SceneFeatureNet(FeatureNetConfig()).freeze(), False


def test_feature_net_is_a_torchmetrics_custom_extractor(weights_dir):
    net, _ = _feature_net(weights_dir)
    assert net.num_features == 128
    fid = FrechetInceptionDistance(feature=net, normalize=False)
    images, _ = scenes.batch("val", 0, 3, 0)
    u8 = torch.as_tensor(images).permute(0, 3, 1, 2).contiguous()
    f = net(u8)
    assert f.shape == (3, 128) and f.dtype == torch.float32
    assert torch.allclose(net(torch.as_tensor(images)), f)  # NHWC uint8 too
    assert torch.allclose(net(u8.float() / 255), f, atol=1e-5)  # float [0, 1] (torchmetrics normalize=True)
    fid.train()
    assert not net.training and not any(p.requires_grad for p in net.parameters())  # stays frozen


def test_fid_identical_near_zero_and_corrupted_larger(weights_dir, heldout64):
    net, trained = _feature_net(weights_dir)
    fid = FrechetInceptionDistance(feature=net, normalize=False)
    images, _ = heldout64
    same = fid_between(fid, images, images.copy())
    assert abs(same) < 1e-2, same
    if not trained:
        pytest.skip("fid_features.safetensors absent: corruption sensitivity needs the trained feature network")
    other, _ = scenes.batch("heldout", 64, 64, 0)
    base = fid_between(fid, images, other)  # disjoint reference sets: finite-sample floor
    blurred = fid_between(fid, images, train_probes.corrupt_blur(other, 0.8))
    shifted = fid_between(fid, images, train_probes.corrupt_color(other, (12, 0, -12)))
    assert abs(same) < 1e-3 * base, (same, base)
    assert blurred > 2 * base and shifted > 2 * base, (base, blurred, shifted)


def test_make_fid(weights_dir):
    with pytest.raises(ValueError):
        make_fid("nonsense")
    if os.path.isfile(os.path.join(weights_dir, "fid_features.safetensors")):
        fid = make_fid("scenes", os.path.join(weights_dir, "fid_features.safetensors"))
        images, _ = scenes.batch("val", 0, 8, 0)
        assert fid_between(fid, images, images) == pytest.approx(0.0, abs=1e-2)
    with pytest.raises(FileNotFoundError, match="pt_inception"):  # the Inception kind: tests/metrics/test_inception.py
        make_fid("inception", "/nonexistent/pt_inception.pth")


def test_train_probes_resume_is_exact(tmp_path):
    common = ["--steps", "3", "--batch-size", "4", "--ckpt-every", "1", "--eval-n", "8", "--threads", "1",
              "--device", "cpu"]
    train_probes.main(common + ["--out", str(tmp_path / "a"), "--ckpt-dir", str(tmp_path / "ca")])
    b = common + ["--out", str(tmp_path / "b"), "--ckpt-dir", str(tmp_path / "cb")]
    train_probes.main(b + ["--stop-after", "2"])
    assert torch.load(tmp_path / "cb" / "state.pt", weights_only=False)["step"] == 2
    train_probes.main(b)
    for name in ("probe.safetensors", "fid_features.safetensors"):
        a, kind, _, _ = read_model_file(str(tmp_path / "a" / name))
        bb, _, _, _ = read_model_file(str(tmp_path / "b" / name))
        assert all(torch.equal(a[k], bb[k]) for k in a), name
    assert kind == "scene_fid_features"
    metrics = json.load(open(tmp_path / "a" / "probe.metrics.json"))
    assert 0 <= metrics["probe_heldout"]["attribute_accuracy"] <= 1 and "heldout_vs_heldout_disjoint" in metrics["fid"]
