"""Procedural scenes: determinism, split guarantees, rendering, COCO export."""

import json
import os

import numpy as np
import pytest

from ciar.data import scenes


def test_same_index_same_scene_and_image():
    a, b = scenes.scene_at("train", 17, seed=3), scenes.scene_at("train", 17, seed=3)
    assert a == b and a.caption == b.caption
    assert np.array_equal(scenes.render(a), scenes.render(b))
    assert scenes.scene_at("train", 17, seed=4) != a or scenes.scene_at("train", 18, seed=3) != a


def test_splits_keep_heldout_pairs_apart():
    for i in range(300):
        for split in ("train", "val"):
            s = scenes.scene_at(split, i)
            assert all((o.shape, o.color) not in scenes.HELDOUT_PAIRS for o in s.objects)
        h = scenes.scene_at("heldout", i)
        assert any((o.shape, o.color) in scenes.HELDOUT_PAIRS for o in h.objects)


def test_scene_structure():
    for i in range(200):
        s = scenes.scene_at("probe", i)
        assert 1 <= len(s.objects) <= 3
        cells = [o.cell for o in s.objects]
        assert len(set(cells)) == len(cells)
        assert s.caption.endswith(f"on a {s.background} background")
        for o in s.objects:
            assert o.phrase() in s.caption


def test_render_shape_and_objects_visible():
    scene = scenes.Scene((scenes.SceneObject("square", "red", "large", 4),), "black")
    img = scenes.render(scene)
    assert img.shape == (scenes.IMAGE_SIZE, scenes.IMAGE_SIZE, 3) and img.dtype == np.uint8
    c = scenes.IMAGE_SIZE // 2
    assert tuple(img[c, c]) == scenes.COLORS["red"]
    assert tuple(img[1, 1]) == (20, 20, 20)


def test_targets_match_objects():
    s = scenes.scene_at("val", 5)
    t = scenes.targets(s)
    assert (t["shape"] > 0).sum() == len(s.objects)
    for o in s.objects:
        assert t["shape"][o.cell] == scenes.SHAPES.index(o.shape) + 1
        assert t["color"][o.cell] == scenes.COLOR_NAMES.index(o.color)


def test_labels_round_trip():
    s = scenes.scene_at("heldout", 9)
    assert scenes.Scene.from_labels(json.loads(json.dumps(s.labels()))) == s


def test_export_coco_layout(tmp_path):
    assert scenes.main(["export", "--split", "heldout", "--n", "5", "--seed", "0", "--out", str(tmp_path)]) == 0
    coco = json.load(open(tmp_path / "captions.json"))
    assert [im["id"] for im in coco["images"]] == list(range(5))
    assert {a["image_id"] for a in coco["annotations"]} == set(range(5))
    labels = json.load(open(tmp_path / "labels.json"))
    for im, ann in zip(coco["images"], coco["annotations"]):
        assert os.path.isfile(tmp_path / "images" / im["file_name"])
        assert labels[str(im["id"])]["caption"] == ann["caption"] == scenes.scene_at("heldout", im["id"]).caption


def test_export_cli_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        scenes.main(["export", "--split", "nope", "--out", str(tmp_path)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        scenes.main(["export", "--n", "0", "--out", str(tmp_path)])
    assert "--n must be positive" in capsys.readouterr().err
