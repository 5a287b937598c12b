"""MS-COCO captions files (`captions_val2017.json` layout), read the same way by every entry point.

    rows = read_coco_captions("annotations/captions_val2017.json", limit=500)
    rows[0]  # {"image_id": 139, "caption": "A woman stands in the dining area at the table.", "file_name": "..."}

One caption per image: the first non-empty annotation of each image, images in id order (real COCO has five
captions per image; the evaluation, the benchmarks and the calibration all see the same prompts). A scenes export
(`python -m ciar.data.scenes export`) has the same layout with one caption per image.
"""

from __future__ import annotations

import json
import os


class CaptionsError(ValueError):
    """A captions file that cannot be read: the message names the file and what is wrong."""


def read_coco_captions(path: str, limit: int | None = None, offset: int = 0) -> list[dict]:
    """-> rows {image_id, caption, file_name}, images `offset .. offset + limit` in id order. Raises CaptionsError."""
    if not os.path.isfile(path):
        raise CaptionsError(f"captions file not found: {path}")
    try:
        with open(path) as f:
            coco = json.load(f)
    except json.JSONDecodeError as e:
        raise CaptionsError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(coco, dict) or not isinstance(coco.get("annotations"), list) \
            or not isinstance(coco.get("images"), list):
        raise CaptionsError(f"{path}: expected the MS-COCO captions layout, an object with 'images' and "
                            f"'annotations' lists")
    files = {}
    for im in coco["images"]:
        if not isinstance(im, dict) or "id" not in im:
            raise CaptionsError(f"{path}: every entry of 'images' needs an 'id'")
        files[im["id"]] = im.get("file_name")
    first: dict = {}
    for k, a in enumerate(coco["annotations"]):
        if not isinstance(a, dict) or "image_id" not in a or not isinstance(a.get("caption"), str):
            raise CaptionsError(f"{path}: annotation {k} needs 'image_id' and a string 'caption'")
        if a["image_id"] not in files:
            raise CaptionsError(f"{path}: annotation {k} names image_id {a['image_id']!r}, which is not in 'images'")
        if a["image_id"] not in first and a["caption"].strip():
            first[a["image_id"]] = a["caption"].strip()
    ids = sorted(first)[offset: offset + limit if limit else None]
    if not ids:
        raise CaptionsError(f"{path}: no captions" + (f" after the first {offset}" if offset else ""))
    return [{"image_id": int(i), "caption": first[i], "file_name": files[i] or ""} for i in ids]
