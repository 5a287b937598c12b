"""Generate one image with CIAR from a device: the exported device model here, the verifier behind a server.

    python -m ciar_device --server ws://localhost:8000 --key ciar-dev-device-key \
        --prompt "a small red circle at the top on a gray background" --out img.png [--seed 0] [--stats out.json] \
        [--model-dir DIR] [--tau T] [--gate GATE] [--span K] [--burst G] [--prefix-rate R]
        [--threads N]

The device model comes from the server (`GET /v1/device/model`, verified and cached by `ciar_device.fetch`) unless
`--model-dir` names an export folder (`python -m pipelines.export_onnx --out DIR`); the gate, tau, span, burst,
sampling settings and prefix rate default to its manifest's. Bad arguments, an unknown key, an unreachable server
or a server error print one `error:` line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import time

from ciar_device.cli import (OneLineParser, UsageError, check_prompt_and_seed, check_writable, run_command,
                             write_file)

PROG = "python -m ciar_device"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True, help="ws://HOST:PORT of the device endpoint (or its full URL)")
    p.add_argument("--key", required=True, help="device key")
    p.add_argument("--prompt", required=True, help="caption of the image to generate")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--seed", type=int, default=0, help="seed (>= 0)")
    p.add_argument("--model-dir", default=None, help="the device model's export folder (pipelines.export_onnx); "
                   "default: downloaded from the server and cached")
    p.add_argument("--stats", default=None, help="JSON file to write generation statistics to")
    p.add_argument("--tau", type=float, default=None, help="gate threshold (default: the manifest's calibrated one)")
    p.add_argument("--gate", default=None, help="lower | interval | entropy | softmax | random | topk | always | never (default: the "
                   "manifest's calibrated gate)")
    p.add_argument("--span", type=int, default=None, help="drafts per verification (default: the manifest's)")
    p.add_argument("--burst", type=int, default=None, help="cloud burst after a rejection (default: the manifest's)")
    p.add_argument("--prefix-rate", type=float, default=None, help="cloud prefix fraction (default: the manifest's)")
    p.add_argument("--policy", default="adaptive", choices=("adaptive", "fixed"),
                   help="adaptive: the image's span and burst, or cloud-only, chosen from the link's and the "
                        "verifier's costs (default); fixed: the manifest's calibrated span and burst")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads (>= 1)")
    return p


def check_knobs(args: argparse.Namespace) -> None:
    """The CIAR flags given, in the ranges the API accepts, before anything is fetched (UsageError naming the
    flag); the manifest's own defaults are the export's and are checked by `loop_config`."""
    import math

    from ciar_device.loop import LOOP_GATES

    for flag, value, ok, want in (("--tau", args.tau, lambda v: math.isfinite(v) and v >= 0, "a number >= 0"),
                                  ("--span", args.span, lambda v: v >= 1, ">= 1"),
                                  ("--burst", args.burst, lambda v: v >= 0, ">= 0"),
                                  ("--prefix-rate", args.prefix_rate, lambda v: 0 <= v <= 1, "in [0, 1]")):
        if value is not None and not ok(value):
            raise UsageError(f"{flag} must be {want}, got {value:g}")
    if args.gate is not None and args.gate not in LOOP_GATES:
        raise UsageError(f"--gate must be one of {', '.join(LOOP_GATES)}, got {args.gate!r}")


def run(args: argparse.Namespace) -> dict:
    """Generate per `args`; writes the PNG (and stats) and returns the stats dict."""
    check_prompt_and_seed(args.prompt, args.seed)
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    check_knobs(args)
    if not args.server.startswith(("ws://", "wss://")):
        raise UsageError(f"--server must be a ws:// or wss:// URL, got {args.server!r}")
    check_writable(args.out, "--out")
    if args.stats:
        check_writable(args.stats, "--stats")

    from ciar_device.connection import ConnectionRefused, DeviceConnection, ServerError
    from ciar_device.loop import generate, loop_config
    from ciar_device.runtime import DeviceRuntime, ImageDecoder, read_manifest

    if args.model_dir is None:
        from ciar_device.fetch import fetch_model

        try:
            args.model_dir = fetch_model(args.server, args.key)
        except (OSError, RuntimeError, ValueError) as e:
            raise UsageError(f"could not fetch the device model from {args.server}: {e}") from None
    try:
        manifest = read_manifest(args.model_dir)
        cfg = loop_config(manifest, tau=args.tau, gate=args.gate, span=args.span, burst=args.burst,
                          prefix_rate=args.prefix_rate, policy=args.policy)
        runtime = DeviceRuntime(args.model_dir, threads=args.threads)
        decoder = ImageDecoder(args.model_dir, threads=args.threads)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model-dir {args.model_dir!r}: {e}") from None

    conn = DeviceConnection(args.server, args.key, vocab_size=runtime.vocab_size, retries=3)
    t_start = time.perf_counter()
    try:
        try:
            conn.connect()
        except ConnectionRefused as e:
            raise UsageError(f"{conn.url}: {e.reason or 'refused'} (close code {e.code})") from None
        except Exception as e:  # noqa: BLE001 - the socket could not be opened (DNS, refused, timeout)
            raise UsageError(f"cannot reach the server at {conn.url}: {e}") from None
        result = generate(runtime, conn, args.prompt, args.seed, tau=args.tau, gate=args.gate, span=args.span,
                          burst=args.burst, prefix_rate=args.prefix_rate, policy=args.policy)
    except ConnectionRefused as e:
        raise UsageError(f"{conn.url}: {e.reason or 'refused'} (close code {e.code})") from None
    except ServerError as e:
        raise UsageError(f"the server answered {e}") from None
    except (ConnectionError, OSError) as e:
        raise UsageError(f"lost the server at {conn.url}: {e}") from None
    finally:
        conn.disconnect()
    gen_s = time.perf_counter() - t_start
    image = decoder.decode(result.tokens)
    total_s = time.perf_counter() - t_start

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    write_file(args.out, buf.getvalue(), "--out")
    n = int(result.tokens.shape[0])
    config = {"method": "ciar", "gate": cfg.gate, "tau": cfg.tau, "span": cfg.span, "burst": cfg.burst,
              "burst_entropy": cfg.burst_entropy, "prefix_rate": cfg.prefix_rate, "inter_enhance": cfg.inter_enhance,
              "feature_top": cfg.feature_top, "policy": cfg.policy, "network": "real"}
    stats = {"method": "ciar", "prompt": args.prompt, "seed": args.seed, "num_tokens": n, "wall_time_s": gen_s,
             "tokens_per_s": n / gen_s if gen_s > 0 else None, "total_time_s": total_s,
             "sampling": dataclasses.asdict(cfg.sampling),
             "server": conn.url, "model_dir": os.path.abspath(args.model_dir), "tokens": result.tokens.tolist(),
             "collab": {"config": config, "stats": result.stats}}
    if args.stats:
        write_file(args.stats, (json.dumps(stats, indent=1) + "\n").encode(), "--stats")
    return stats


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input or a server-side failure)."""
    args, stats = run_command(PROG, build_parser(), run, argv)
    if args is None:
        return stats
    st, cf = stats["collab"]["stats"], stats["collab"]["config"]
    # the image's operating point: the calibrated one, or what the adaptive policy chose from the observed costs
    point = "the whole image on the cloud" if st["handovers"] else f"span {st['span_used']}, burst {st['burst_used']}"
    how = "chosen from the observed costs" if st["adapted"] else "calibrated"
    print(f"wrote {args.out}: {stats['num_tokens']} tokens in {stats['wall_time_s']:.2f} s "
          f"(method ciar, seed {args.seed}); cloud calls {100 * st['cloud_call_rate']:.1f} %, "
          f"{st['cloud_requests']} cloud requests, measured latency {st['total_s']:.3f} s (device {st['device_s']:.3f} "
          f"s, cloud {st['cloud_s']:.3f} s, comm {st['comm_s']:.3f} s) (gate {cf['gate']}, tau {cf['tau']}; "
          f"{cf['policy']} policy: {point}, {how})")
    if st.get("degraded"):
        print(f"degraded: the server became unreachable mid-image; this device made the last "
              f"{st['degraded_tokens']} tokens alone, without verification")
    return 0


if __name__ == "__main__":
    sys.exit(main())
