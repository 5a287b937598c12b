"""A trained CIAR device model on the Hugging Face Hub: written with a model card, pushed to a repository, pulled back
into the Hub cache and named in a world file like any other Hub file (a team distils once and deploys anywhere).

    python -m pipelines.hub_device card runs/xl/device.safetensors --world worlds/llamagen-xl-stage1.yaml --out DIR
    python -m pipelines.hub_device push runs/xl/device.safetensors --repo my-org/ciar-device-llamagen-xl \
        --world worlds/llamagen-xl-stage1.yaml [--private] [--branch main]
    python -m pipelines.hub_device pull hf://my-org/ciar-device-llamagen-xl@COMMIT [--world W] [--out FILE]

What travels is the device file itself (safetensors: the weights, its config, its training facts and the calibrated
CIAR defaults in its metadata: gate, one tau per gate, burst, span, the calibration record; `pipelines.calibrate`)
and a README.md model card generated from that metadata (YAML front matter for the Hub: library `ciar`, the world's
GPT repository as `base_model`). `push` refuses a file that is not a CIAR device model, one with no calibrated
defaults (calibrate it first: a tau depends on the weights) and, with `--world`, one that does not fit the world's
GPT; it prints the world-file line pinned to the commit it made. `pull` resolves an `hf://` reference through the
Hub cache (`ciar.hub`: HF_HOME, HF_TOKEN, HF_HUB_OFFLINE), checks the same things and prints that line; `--out`
copies the file out of the cache (a mounted models volume). Uploads go through huggingface_hub's `HfApi`
(`create_repo`, `upload_folder`; HF_TOKEN or `hf auth login`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile

from ciar.collab.defaults import CIARDefaults
from ciar.hub import HubError, commit_of, human_bytes, is_ref, parse_ref, resolve
from ciar.models.checkpoint import read_model_metadata

DEVICE_FILE = "device.safetensors"
CARD_FILE = "README.md"
TAGS = ["ciar", "text-to-image", "autoregressive", "speculative-decoding", "device-model"]


def HfApi(**kwargs):  # noqa: N802 - huggingface_hub's client, imported when a push needs it
    from huggingface_hub import HfApi as _HfApi

    return _HfApi(**kwargs)


def read_device(path: str) -> dict:
    """A device file's facts -> {path, bytes, sha256, config, extra, defaults (CIARDefaults or None)}. Raises
    ValueError for a file that is not a CIAR device model."""
    try:
        kind, config, extra = read_model_metadata(path)
    except (OSError, ValueError) as e:
        raise ValueError(str(e)) from None
    if kind != "ciar_device":
        raise ValueError(f"{path}: not a CIAR device model (kind {kind!r}; pipelines.train_device writes one)")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"path": path, "bytes": os.path.getsize(path), "sha256": sha.hexdigest(), "config": config,
            "extra": extra, "defaults": CIARDefaults.from_extra(extra, path)}


def require_calibrated(info: dict) -> CIARDefaults:
    """The device's calibrated CIAR defaults; ValueError when it has none (a tau depends on the weights)."""
    d = info["defaults"]
    if d is None or d.tau is None:
        raise ValueError(f"{info['path']}: no calibrated CIAR defaults (gate, tau, burst, span) in its metadata: "
                         f"calibrate it first (python -m pipelines.calibrate {info['path']} ... or --world FILE)")
    return d


def check_fits(info: dict, spec) -> None:
    """ValueError when the device model does not fit the world's cloud model (its codes, image tokens, caption
    positions and width); nothing is loaded (a LlamaGen world's GPT config needs no file)."""
    from ciar.world_spec import AnoleWorldSpec, ScenesWorldSpec, check_anole_device

    if isinstance(spec, AnoleWorldSpec):
        check_anole_device(info["path"], spec.gpt_cfg())
        return
    g = info["config"].get("gpt", {})
    if isinstance(spec, ScenesWorldSpec):
        _, cloud, _ = read_model_metadata(os.path.join(spec.weights_dir(), "cloud.safetensors"))
        want = tuple(cloud.get(k) for k in ("vocab_size", "block_size", "cls_token_num", "caption_dim"))
    else:
        c = spec.gpt_cfg()
        want = (c.vocab_size, c.block_size, c.cls_token_num, c.caption_dim)
    have = tuple(g.get(k) for k in ("vocab_size", "block_size", "cls_token_num", "caption_dim"))
    if have != want:
        raise ValueError(f"{info['path']}: the device model (codes {have[0]}, {have[1]} image tokens, {have[2]} x "
                         f"{have[3]} caption) does not fit {spec.describe()} (codes {want[0]}, {want[1]} image "
                         f"tokens, {want[2]} x {want[3]} caption)")


def _base_model(spec) -> str | None:
    """The world's cloud model repository on the Hub (the card's `base_model`), when the world names one."""
    if spec is None:
        return None
    value = getattr(spec, "gpt_checkpoint", None) or getattr(spec, "model", None)
    return parse_ref(value).repo_id if is_ref(value) else None


def model_card(info: dict, spec=None, repo_id: str | None = None) -> str:
    """README.md for the device's repository: Hub metadata (front matter) and what the file is, what it was trained
    for, its calibrated defaults and how a world file names it, all read from the file's metadata."""
    from huggingface_hub import ModelCardData

    d = require_calibrated(info)
    g, dev, extra = info["config"].get("gpt", {}), info["config"].get("device", {}), info["extra"]
    data = ModelCardData(library_name="ciar", tags=TAGS, pipeline_tag="text-to-image", base_model=_base_model(spec))
    world = spec.describe() if spec is not None else extra.get("world", "(not recorded)")
    ref = f"hf://{repo_id}/{DEVICE_FILE}" if repo_id else f"hf://OWNER/REPO/{DEVICE_FILE}"
    taus = ", ".join(f"{gate} {tau:g}" for gate, tau in sorted(d.taus.items()))
    cal = d.calibration or {}
    lines = [
        "---", data.to_yaml().strip(), "---", "",
        f"# CIAR device model for {world}", "",
        "The device half of CIAR (collaborative interval-aware autoregressive decoding): a small model that drafts "
        "image tokens on the device, scores its own uncertainty with an interval head and sends only uncertain spans "
        "to the cloud model for verification. This file only fits the cloud model it was trained for.", "",
        "| | |", "|---|---|",
        f"| file | `{DEVICE_FILE}`, {human_bytes(info['bytes'])}, sha256 `{info['sha256']}` |",
        f"| trained for | {world} |",
        f"| architecture | {g.get('arch', 'llamagen')} trunk, {dev.get('n_layer', g.get('n_layer'))} layer(s), width "
        f"{g.get('dim')}, {dev.get('num_heads', 1)} interval head(s) ({dev.get('combine', 'single')}) |",
        f"| shapes | {g.get('vocab_size')} image codes, {g.get('block_size')} image tokens, "
        f"{g.get('cls_token_num')} caption positions x {g.get('caption_dim', g.get('dim'))} |",
        f"| training | {extra.get('trained_steps', '?')} steps, batch {extra.get('batch_size', '?')}, data "
        f"{extra.get('data', '?')}, objective {extra.get('objective', '?')}, seed {extra.get('seed', '?')} |",
        f"| calibrated defaults | gate `{d.gate}` (tau {d.tau:g}), burst {d.burst}, span {d.span}, target cloud-call "
        f"rate {d.target_rate} |",
        f"| every gate's tau | {taus} |",
        f"| calibrated on | {cal.get('prompts', '?')} (`{cal.get('command', '?')}`) |", "",
        "## Use", "",
        "Name it in a world file (`ciar.world_spec`); pin the commit in production:", "",
        "```yaml", f"device_checkpoint: {ref}", "```", "",
        "then every CIAR entry point takes the world (`python -m ciar.generate --world WORLD --method ciar --prompt "
        "...`, the Serve application's `world` argument); the defaults above travel in the file's metadata and are "
        "used unless a request overrides them. `python -m pipelines.hub_device pull` fetches and checks it.", "",
    ]
    return "\n".join(lines)


def write_card(path: str, out_dir: str, spec=None, repo_id: str | None = None) -> dict:
    """`out_dir` <- device.safetensors (a copy of `path`) + README.md (its model card) -> the device's facts.
    Checks first: a CIAR device model, calibrated, fitting `spec`'s cloud model when a world is given."""
    info = read_device(path)
    require_calibrated(info)
    if spec is not None:
        check_fits(info, spec)
    card = model_card(info, spec, repo_id)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(path, os.path.join(out_dir, DEVICE_FILE))
    with open(os.path.join(out_dir, CARD_FILE), "w") as f:
        f.write(card)
    return info


def push(path: str, repo_id: str, spec=None, private: bool | None = None, branch: str | None = None,
         token: str | None = None) -> str:
    """Write the device file and its card into `repo_id` (created if missing) in one commit -> the commit's hash."""
    with tempfile.TemporaryDirectory(prefix="ciar-device-") as staging:
        info = write_card(path, staging, spec, repo_id)
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        d = info["defaults"]
        commit = api.upload_folder(repo_id=repo_id, folder_path=staging, repo_type="model", revision=branch,
                                   commit_message=f"CIAR device model (gate {d.gate}, tau {d.tau:g}, burst {d.burst}, "
                                                  f"span {d.span}), sha256 {info['sha256'][:12]}")
    return commit.oid


def pull(ref: str, spec=None, out: str | None = None) -> dict:
    """Resolve `ref` (hf://OWNER/REPO[@REV][/FILE], FILE default device.safetensors) into the Hub cache and check it
    (a calibrated CIAR device model, fitting `spec`); `out`: also copy it there -> the device's facts (+ `ref`, the
    reference pinned to the commit it came from)."""
    r = parse_ref(ref)
    if not r.path:
        r = parse_ref(f"{ref.rstrip('/')}/{DEVICE_FILE}")
    path = resolve(r, "file")
    info = read_device(path)
    require_calibrated(info)
    if spec is not None:
        check_fits(info, spec)
    commit = commit_of(path)
    info["ref"] = f"hf://{'datasets/' if r.repo_type == 'dataset' else ''}{r.repo_id}@{commit or r.rev}/{r.path}"
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        shutil.copyfile(path, out)
        info["copied_to"] = out
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.hub_device", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("card", help="write device.safetensors + its model card into a folder (what push uploads)")
    c.add_argument("device", help="a calibrated device.safetensors (pipelines.train_device + pipelines.calibrate)")
    c.add_argument("--out", required=True, help="folder to write")
    c.add_argument("--repo", default=None, help="the repository the card names (OWNER/NAME)")
    u = sub.add_parser("push", help="push a device model and its card to a Hub repository")
    u.add_argument("device")
    u.add_argument("--repo", required=True, help="OWNER/NAME (created if missing)")
    u.add_argument("--private", action="store_true", help="create the repository private")
    u.add_argument("--branch", default=None, help="branch to commit to (default: main)")
    d = sub.add_parser("pull", help="fetch a device model into the Hub cache, check it and print its world line")
    d.add_argument("ref", help="hf://OWNER/REPO[@REVISION][/FILE] (FILE: device.safetensors)")
    d.add_argument("--out", default=None, help="also copy the file here (a mounted models volume)")
    for q in (c, u, d):
        q.add_argument("--world", default=None, help="the world it was trained for: checked to fit, named in the card")
    args = p.parse_args(argv)

    try:
        spec = None
        if args.world:
            from ciar.world_spec import read_world

            spec = read_world(args.world, check=False)
        if args.command == "card":
            info = write_card(args.device, args.out, spec, args.repo)
            print(f"{args.out}: {DEVICE_FILE} ({human_bytes(info['bytes'])}) + {CARD_FILE}")
        elif args.command == "push":
            commit = push(args.device, args.repo, spec, private=args.private or None, branch=args.branch)
            print(f"pushed {args.device} to {args.repo}@{commit}; in a world file:")
            print(f"device_checkpoint: hf://{args.repo}@{commit}/{DEVICE_FILE}")
        else:
            info = pull(args.ref, spec, args.out)
            dd = info["defaults"]
            print(f"{info['path']} ({human_bytes(info['bytes'])}): gate {dd.gate}, tau {dd.tau:g}, burst {dd.burst}, "
                  f"span {dd.span}{'; copied to ' + info['copied_to'] if info.get('copied_to') else ''}",
                  file=sys.stderr)
            print(f"device_checkpoint: {info['ref']}")
    except (ValueError, HubError, OSError) as e:  # WorldSpecError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - huggingface_hub's upload errors (HTTP, auth) as one line
        print(f"error: {args.command}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
