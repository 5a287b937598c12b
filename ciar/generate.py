"""Generate one image from a caption with the default world, another weights folder, or a LlamaGen world file
(`--world`, `ciar.world_spec`: LlamaGen GPT + VQ + a local T5 folder + the device model trained for that GPT).

    python -m ciar.generate --prompt "a small red circle at the top on a gray background" --method cloud \
        --seed 0 --out out.png [--stats out.json] [--cfg-scale 3 --temperature 1 --top-k 0 --top-p 1] \
        [--world FILE | --weights DIR] [--device cpu|cuda] [--threads N]

Methods: `cloud` (the cloud model samples every token; the reference) and the collaborative methods of
`ciar.sim.decoder` (`ciar`, `eagle`, `lantern`, `cascade`, `code`, `entropy`, `softmax`, `random`, `topk`),
which need the weights folder's `device.safetensors`; `--gate`, `--tau`, `--burst`, `--span`, `--prefix-rate` and
`--network` set their knobs (gate, tau, burst and span default to the device file's calibrated values,
`python -m pipelines.calibrate`), and `--stats` then also holds the collaboration stats (cloud-call rate,
requests, latency split).
Sampling settings default to the
weights folder's own (`cloud.safetensors` metadata); each flag overrides one field. The same prompt, seed,
settings and device give a byte-identical PNG. `--stats` writes a JSON with the method, prompt, seed, number of
tokens, token-generation wall time and tokens/s, the end-to-end time (caption encoding + generation + VQ
decoding), the sampling settings used and the token ids.

Bad input (empty or too-long prompt, negative seed, out-of-range sampling values, unwritable output path,
missing weights) prints one `error:` line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
import time

from ciar.collab.names import CLOUD_METHODS, METHODS, NETWORKS  # torch-free: bad arguments fail before torch loads
from ciar.world_spec import add_world_arguments, world_from_args
from ciar_device.cli import (OneLineParser, UsageError, check_prompt_and_seed, check_writable, run_command,
                             write_file)

PROG = "python -m ciar.generate"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--prompt", required=True, help="caption of the image to generate")
    p.add_argument("--method", default="cloud", choices=METHODS, help="decoding method (default: cloud)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (>= 0)")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--stats", default=None, help="JSON file to write generation statistics to")
    p.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale (>= 1)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (1 = all)")
    p.add_argument("--tau", type=float, default=None,
                   help="collaborative methods: gate threshold (default: the device file's calibrated one)")
    p.add_argument("--gate", default=None, help="ciar: the gate (default: the device file's calibrated gate)")
    p.add_argument("--burst", type=int, default=None,
                   help="ciar: cloud burst g after a rejection (default: the device file's)")
    p.add_argument("--span", type=int, default=None, help="collaborative methods: drafts per verification")
    p.add_argument("--prefix-rate", type=float, default=None, help="collaborative methods: cloud prefix fraction")
    p.add_argument("--network", default=None,
                   help=f"collaborative methods: {' | '.join(NETWORKS)} (NAME:key=value,... for options)")
    add_world_arguments(p)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    return p


def run(args: argparse.Namespace) -> dict:
    """Generate per `args` (already parsed); writes the PNG (and stats) and returns the stats dict."""
    check_prompt_and_seed(args.prompt, args.seed)
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0, got {args.threads}")
    overrides = {k: v for k, v in (("cfg_scale", args.cfg_scale), ("temperature", args.temperature),
                                   ("top_k", args.top_k), ("top_p", args.top_p)) if v is not None}

    import torch  # deferred: argument errors are reported without paying for the import

    from ciar.decoding.generate import generate_cloud
    from ciar.decoding.sampling import SamplingParams
    from ciar.models.vq import tensor_to_images
    from ciar.text import CaptionTooLongError
    from ciar.world import load_world

    try:
        SamplingParams(**overrides)  # checks the given fields before anything is loaded
    except ValueError as e:
        raise UsageError(f"bad sampling setting: {e}") from None
    if args.network is not None:  # checked whatever the method (cloud-only ignores it, as the API validates it)
        from ciar.sim.network import get_profile

        try:
            get_profile(args.network)
        except ValueError as e:
            raise UsageError(f"--network: {e}") from None
    check_writable(args.out, "--out")
    if args.stats:
        check_writable(args.stats, "--stats")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr for our own messages
    try:
        world = load_world(world_from_args(args), device=args.device, need_device=args.method not in CLOUD_METHODS,
                           need_text=True)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    params = dataclasses.replace(world.sampling, **overrides)

    t_start = time.perf_counter()
    try:
        cap = world.text.encode([args.prompt])
    except CaptionTooLongError as e:
        raise UsageError(str(e)) from None
    collab = None
    _sync(args.device)
    t_gen = time.perf_counter()
    if args.method == "cloud":
        tokens = generate_cloud(world.cloud, cap.emb, cap.mask, params, args.seed)  # [1, N]
    else:
        from ciar.sim.runtime import make_decoder, make_verifier

        knobs = {k: v for k, v in (("tau", args.tau), ("span", args.span), ("prefix_rate", args.prefix_rate),
                                   ("network", args.network), ("gate", args.gate), ("burst", args.burst))
                 if v is not None}
        try:
            dec = make_decoder(world, make_verifier(world, max_sessions=1), args.method, sampling=params, **knobs)
        except (ValueError, KeyError) as e:
            raise UsageError(str(e).strip("'\"")) from None
        result = dec.generate(args.prompt, seed=args.seed)
        tokens = result.tokens.unsqueeze(0).to(args.device)
        collab = {"config": dec.config.to_dict(), "stats": result.stats.to_dict()}
    _sync(args.device)
    gen_s = time.perf_counter() - t_gen
    with torch.no_grad():
        image = tensor_to_images(world.vq.decode_code(tokens))[0].cpu().numpy()  # [H, W, 3] uint8
    total_s = time.perf_counter() - t_start

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    write_file(args.out, buf.getvalue(), "--out")
    n = tokens.shape[1]
    stats = {"method": args.method, "prompt": args.prompt, "seed": args.seed, "num_tokens": n,
             "wall_time_s": gen_s, "tokens_per_s": n / gen_s if gen_s > 0 else None, "total_time_s": total_s,
             "sampling": params.to_dict(), "device": args.device, "weights": world.weights_dir,
             "tokens": tokens[0].tolist()}
    if collab is not None:
        stats["collab"] = collab
    if args.stats:
        write_file(args.stats, (json.dumps(stats, indent=1) + "\n").encode(), "--stats")
    return stats


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input)."""
    args, stats = run_command(PROG, build_parser(), run, argv)
    if args is None:
        return stats
    line = f"wrote {args.out}: {stats['num_tokens']} tokens in {stats['wall_time_s']:.2f} s " \
           f"(method {args.method}, seed {args.seed})"
    if "collab" in stats:
        st, cf = stats["collab"]["stats"], stats["collab"]["config"]
        line += (f"; cloud calls {100 * st['cloud_call_rate']:.1f} %, {st['cloud_requests']} cloud requests, "
                 f"simulated latency {st['total_s']:.3f} s on {cf['network']} (gate {cf['gate']}, tau {cf['tau']}, "
                 f"burst {cf['burst']}, span {cf['span']})")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
