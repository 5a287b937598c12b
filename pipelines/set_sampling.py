"""Set the sampling defaults stored in a cloud weight file (`extra["sampling"]`); its tensors stay bit for bit.

    python -m pipelines.set_sampling weights/scenes-v2/cloud.safetensors --cfg-scale 1.5 \
        --chosen-by "eval_world --split val --n 64 --sweep --cfg-grid 1.5,2,3,4 --temperature-grid 1.0,0.9"

Fields not given keep their current value. The new defaults are validated (`SamplingParams`) before anything is
written, and the file is replaced atomically, so a bad value leaves it as it was. `--chosen-by` records how the
setting was chosen (`extra["sampling_chosen_by"]`, next to the file's other training facts); without it, an
earlier note is dropped with the setting it described.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ciar.models.checkpoint import read_model_metadata
from ciar.world import sampling_from_extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.set_sampling", description=__doc__.split("\n")[0])
    p.add_argument("path", help="a cloud.safetensors written by pipelines.train_cloud")
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--chosen-by", default=None, help="how the setting was chosen (stored in the metadata)")
    args = p.parse_args(argv)

    try:
        kind, _, extra = read_model_metadata(args.path)
        if kind != "gpt":
            raise ValueError(f"{args.path}: expected a cloud ('gpt') weight file, found kind {kind!r}")
        old = sampling_from_extra(extra, args.path)
        given = {k: v for k, v in (("cfg_scale", args.cfg_scale), ("temperature", args.temperature),
                                   ("top_k", args.top_k), ("top_p", args.top_p)) if v is not None}
        if not given:
            raise ValueError("nothing to set: give --cfg-scale, --temperature, --top-k and/or --top-p")
        new = replace(old, **given)  # validates
    except (OSError, ValueError) as e:
        p.error(str(e))

    with safe_open(args.path, framework="pt") as f:
        meta = dict(f.metadata())
    extra["sampling"] = asdict(new)
    extra.pop("sampling_chosen_by", None)  # a note about the old setting would now be wrong
    if args.chosen_by:
        extra["sampling_chosen_by"] = args.chosen_by
    meta["extra"] = json.dumps(extra)
    tmp = args.path + ".tmp"
    save_file(load_file(args.path), tmp, metadata=meta)
    os.replace(tmp, args.path)
    print(f"{args.path}: sampling {asdict(old)} -> {asdict(new)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
