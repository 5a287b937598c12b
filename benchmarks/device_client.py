"""The torch-free device client (`ciar_device`: ONNX + numpy, over the device endpoint's socket) against the
in-cluster device (the torch `CollabDecoder` in a Device replica), on the same held-out prompts and seeds, through
one running cluster.

    python -m benchmarks.device_client --num-prompts 50 --seeds 0,1 --out runs/device_client.json
    python -m benchmarks.device_client --host http://127.0.0.1:8000 ...     # a cluster that already runs (make serve)
    python -m benchmarks.device_client --browser --num-prompts 20 --seeds 0,1 --out ...   # + the browser device

Without --host the cluster is started here from serve_config.yaml (as loadtests.run does) with the devices' simulated
waits off (`Device.realtime=false`: the decisions do not depend on them) and stopped after. Per seed s and prompt i
(the first --num-prompts scenes of the held-out split), both devices make image seed s * 1000003 + i with method
ciar and the device file's calibrated defaults: the in-cluster device through POST /v1/images/generations
(response_format tokens, network none), the client through `ws://.../v1/device/sessions` with the device model it
downloads from the cluster (GET /v1/device/model), as `python -m ciar_device` does.

With --browser, a third device makes the same images: the playground's browser device (web/src in a Web Worker of
headless chromium, onnxruntime-web on WebAssembly, one thread), driven by `loadtests.playground.browser_generate`,
over the same endpoint with the same downloaded model; its device time is the tab's own (onnxruntime-web + the
page's maths). Every device is compared with the cluster's.

The cluster's phones run the torch runtime, the client and the browser the exported model: every device draws at the
same position-keyed uniforms, so they make the same image wherever their float16 drafts agree, and their figures
differ only by the drafts a runtime's rounding flips (the cluster on the onnx runtime makes the client's images:
tests/device/test_web_loop.py). Noise is measured, not assumed: for each device the same figure under two seeds (different images of
the same prompts), and the paired standard error over prompts of the client-minus-cluster difference. Reported per
device and seed: cloud-call rate, cloud requests per image, fidelity (the attribute probe's accuracy on the decoded
images), device ms per token (the client: onnxruntime + numpy; the cluster: torch, as its stats report it), bytes
up / down per image; and per message type, the client's frames' bytes on the socket beside what the network model
charges for the same messages (`nbytes`; the close is not charged). Writes OUT (JSON) and OUT with .md (tables),
and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import numpy as np

METRICS = ("cloud_call_rate", "cloud_requests", "device_ms_per_token", "bytes_up", "bytes_down")
WARMUP_SEED = 10 ** 9  # a first image per device, not measured: first-call overheads out of the figures


# the in-cluster device at the calibrated point, as the torch-free and browser devices run it
FIXED = {"policy": "fixed"}

def _post(url: str, key: str, body: dict, timeout_s: float = 300.0) -> dict:
    req = urllib.request.Request(f"{url}/v1/images/generations", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["data"][0]


def _per_image(stats: dict) -> dict:
    n = stats["total_tokens"]
    return {"cloud_call_rate": stats["cloud_tokens"] / n, "cloud_requests": stats["cloud_requests"],
            "device_ms_per_token": 1000.0 * stats["device_s"] / n, "bytes_up": stats.get("bytes_up"),
            "bytes_down": stats.get("bytes_down")}


class AccountingClient:
    """The client's CloudClient (a DeviceConnection) that also sums, per message type, what the network model charges
    for each message (`nbytes`), to set beside the bytes its frames really had on the socket (`exchanges`)."""

    def __init__(self, conn):
        self.conn, self.vocab_size, self.exchanges = conn, conn.vocab_size, conn.exchanges
        self.accounted: dict[str, list[int]] = {}  # kind -> [messages, bytes up, bytes down]

    def _add(self, kind: str, up: int, down: int) -> None:
        row = self.accounted.setdefault(kind, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + up, row[2] + down

    def open(self, request):
        reply = self.conn.open(request)
        self._add("OPEN", request.nbytes(), reply.nbytes())
        return reply

    def verify(self, request):
        reply = self.conn.verify(request)
        self._add("VERIFY", request.nbytes(self.vocab_size), reply.nbytes())
        return reply

    def close(self, session_id):
        return self.conn.close(session_id)


def wire_table(exchanges, accounted: dict) -> dict:
    """Per message type: messages, bytes up / down on the socket, and as the network model charges them."""
    out = {}
    for e in exchanges:
        row = out.setdefault(e.kind, {"messages": 0, "wire_up": 0, "wire_down": 0, "accounted_up": None,
                                      "accounted_down": None})
        row["messages"] += 1
        row["wire_up"] += e.up_bytes
        row["wire_down"] += e.down_bytes
    for kind, (n, up, down) in accounted.items():
        if kind in out:
            out[kind].update(accounted_messages=n, accounted_up=up, accounted_down=down)
    return out


def run(http_url: str, api_key: str, device_key: str, prompts: list[str], seeds: list[int],
        browser: bool = False) -> dict:
    """-> {device: {seed: {"tokens": [n, N], "rows": [per-image dicts]}}}; the cluster and the client interleaved
    over the prompts, then (browser) the browser device on the same prompts and seeds."""
    from tqdm import tqdm

    from ciar_device.connection import DeviceConnection
    from ciar_device.fetch import fetch_model
    from ciar_device.loop import generate
    from ciar_device.runtime import DeviceRuntime

    ws_url = "ws" + http_url[len("http"):]
    runtime = DeviceRuntime(fetch_model(ws_url, device_key))
    conn = DeviceConnection(ws_url, device_key, vocab_size=runtime.vocab_size)
    client = AccountingClient(conn)
    devices = ("cluster", "client") + (("browser",) if browser else ())
    out = {d: {s: {"tokens": [], "rows": []} for s in seeds} for d in devices}
    try:
        generate(runtime, conn, prompts[0], seed=WARMUP_SEED, policy="fixed")
        conn.exchanges.clear()
        _post(http_url, api_key, {"prompt": prompts[0], "seed": WARMUP_SEED, "method": "ciar", "network": "none",
                                  "response_format": "tokens", "params": FIXED})
        for s in seeds:
            for i, prompt in enumerate(tqdm(prompts, desc=f"seed {s}", dynamic_ncols=True)):
                seed = s * 1_000_003 + i
                got = _post(http_url, api_key, {"prompt": prompt, "seed": seed, "method": "ciar", "network": "none",
                                                "response_format": "tokens", "params": FIXED})
                out["cluster"][s]["tokens"].append(got["tokens"])
                out["cluster"][s]["rows"].append(_per_image(got["stats"]))
                r = generate(runtime, client, prompt, seed=seed, policy="fixed")  # the cluster's point (FIXED)
                out["client"][s]["tokens"].append(r.tokens.tolist())
                out["client"][s]["rows"].append(_per_image(r.stats))
    finally:
        conn.disconnect()
    out["resumes"] = conn.resumes
    out["wire"] = wire_table(conn.exchanges, client.accounted)
    if browser:
        from loadtests.playground import browser_generate

        jobs = [{"prompt": prompts[0], "seed": WARMUP_SEED}] + \
            [{"prompt": p, "seed": s * 1_000_003 + i} for s in seeds for i, p in enumerate(prompts)]
        for job in jobs:  # the cluster's point (FIXED), as the client's
            job["policy"] = "fixed"
        t = time.time()
        done = browser_generate(http_url, device_key, jobs)[1:]
        print(f"browser device: {len(done)} images in {time.time() - t:.0f} s", flush=True)
        failed = [r["error"] for r in done if "error" in r]
        if failed:
            raise RuntimeError(f"the browser device failed {len(failed)} images, first: {failed[0]}")
        for k, r in enumerate(done):
            s = seeds[k // len(prompts)]
            out["browser"][s]["tokens"].append(r["tokens"])
            out["browser"][s]["rows"].append(_per_image(r["stats"]))
        out["browser_model"] = done[0]["model"]
    return out


def fidelity(world, probe, tokens: list[list[int]], scenes) -> float:
    import torch

    from ciar.metrics.probe import attribute_accuracy
    from ciar.models.vq import tensor_to_images

    with torch.no_grad():
        images = tensor_to_images(world.vq.decode_code(torch.tensor(tokens, dtype=torch.long))).numpy()
    return attribute_accuracy(probe, images, scenes)["attribute_accuracy"]


def summarize(raw: dict, seeds: list[int], fid: dict, devices: tuple[str, ...]) -> dict:
    """Means per device and seed; each other device's difference from the cluster's per seed, with its paired
    standard error over prompts; and each device's seed-to-seed difference (the noise the differences are read
    against)."""
    mean = {d: {s: {m: float(np.mean([r[m] for r in raw[d][s]["rows"]])) if raw[d][s]["rows"][0][m] is not None
                    else None for m in METRICS} | {"fidelity": fid[d][s]} for s in seeds} for d in devices}
    diff = {}
    for dev in devices[1:]:
        diff[dev] = {}
        for s in seeds:
            diff[dev][s] = {}
            for m in ("cloud_call_rate", "cloud_requests"):
                d = np.array([a[m] - b[m] for a, b in zip(raw[dev][s]["rows"], raw["cluster"][s]["rows"])])
                diff[dev][s][m] = {"mean": float(d.mean()), "paired_se": float(d.std(ddof=1) / np.sqrt(len(d)))}
            diff[dev][s]["fidelity"] = {"mean": fid[dev][s] - fid["cluster"][s]}
    noise = {}
    if len(seeds) >= 2:
        a, b = seeds[:2]
        noise = {d: {m: mean[d][a][m] - mean[d][b][m] for m in ("cloud_call_rate", "cloud_requests", "fidelity")}
                 for d in devices}
    return {"mean": mean, "minus_cluster": diff, "seed_to_seed": noise}


def markdown(summary: dict, seeds: list[int], n: int) -> str:
    mean = summary["mean"]
    others = " and ".join(d for d in mean if d != "cluster")
    lines = [f"### In-cluster device vs {others}, {n} held-out prompts per seed\n\n",
             "| device | seed | cloud-call rate | cloud requests / image | fidelity | device ms / token "
             "| bytes up / image | bytes down / image |\n", "|---|---|---|---|---|---|---|---|\n"]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for d in mean:
        for s in seeds:
            r = mean[d][s]
            lines.append(f"| {d} | {s} | {r['cloud_call_rate']:.3f} | {r['cloud_requests']:.2f} | "
                         f"{fmt(r['fidelity'], '.3f')} | {r['device_ms_per_token']:.2f} | "
                         f"{fmt(r['bytes_up'], '.0f')} | {fmt(r['bytes_down'], '.0f')} |\n")
    lines.append("\n| device − cluster | seed | cloud-call rate (± paired s.e.) | cloud requests (± s.e.) "
                 "| fidelity |\n|---|---|---|---|---|\n")
    for dev, per_seed in summary["minus_cluster"].items():
        for s, d in per_seed.items():
            lines.append(f"| {dev} | {s} | {d['cloud_call_rate']['mean']:+.3f} ± {d['cloud_call_rate']['paired_se']:.3f}"
                         f" | {d['cloud_requests']['mean']:+.2f} ± {d['cloud_requests']['paired_se']:.2f} | "
                         f"{d['fidelity']['mean']:+.3f} |\n")
    if summary["seed_to_seed"]:
        lines.append(f"\nNoise, the same device under seed {seeds[0]} minus seed {seeds[1]}: "
                     + "; ".join(f"{d}: cloud-call rate {v['cloud_call_rate']:+.3f}, requests "
                                 f"{v['cloud_requests']:+.2f}, fidelity {v['fidelity']:+.3f}"
                                 for d, v in summary["seed_to_seed"].items()) + "\n")
    return "".join(lines)


def wire_markdown(wire: dict) -> str:
    lines = ["\n### The client's frames on the socket vs what the network model charges\n\n",
             "| message | count | bytes up on the socket | charged | bytes down on the socket | charged |\n",
             "|---|---|---|---|---|---|\n"]
    for kind, r in wire.items():
        charged = lambda v: "not charged" if v is None else str(v)  # noqa: E731
        lines.append(f"| {kind} | {r['messages']} | {r['wire_up']} | {charged(r['accounted_up'])} | {r['wire_down']} "
                     f"| {charged(r['accounted_down'])} |\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--seeds", default="0,1", help="comma list: image seed = seed * 1000003 + prompt index")
    p.add_argument("--host", default=None, help="a running cluster's URL (then nothing is started or stopped)")
    p.add_argument("--config", default=None, help="Serve config (default: serve_config.yaml)")
    p.add_argument("--api-key", default=None, help="bearer key (default: the config's first key)")
    p.add_argument("--device-key", default="ciar-dev-device-key")
    p.add_argument("--browser", action="store_true", help="also the browser device (headless chromium, "
                   "onnxruntime-web: `make test` installs both)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected integers separated by commas")
    if not seeds or args.num_prompts < 2:
        p.error("give at least one seed and --num-prompts >= 2")

    from benchmarks.collab import load_prompts
    from ciar.metrics.probe import load_probe
    from ciar.results import write_results
    from ciar.world import load_world
    from loadtests.run import REPO, Cluster, apply_overrides, client_key, free_port, load_app_config

    ps = load_prompts(None, args.num_prompts, 0)
    cluster = None
    url = args.host
    t0 = time.time()
    try:
        if url is None:
            app = apply_overrides(load_app_config(args.config or os.path.join(REPO, "serve_config.yaml")),
                                  ["Device.realtime=false"])
            cluster = Cluster(app, free_port(), free_port())
            cluster.start()
            url = cluster.url
            api_key = client_key(app, args.api_key)
        else:
            api_key = client_key(None, args.api_key)
        raw = run(url.rstrip("/"), api_key, args.device_key, ps.captions, seeds, browser=args.browser)
    finally:
        if cluster is not None:
            cluster.stop()
    world = load_world(None)
    probe = load_probe(os.path.join(world.weights_dir, "probe.safetensors"))
    devices = ("cluster", "client") + (("browser",) if args.browser else ())
    fid = {d: {s: fidelity(world, probe, raw[d][s]["tokens"], ps.scenes) for s in seeds} for d in devices}
    summary = summarize(raw, seeds, fid, devices)
    result = {"prompts": ps.source, "num_prompts": args.num_prompts, "seeds": seeds, "host": args.host,
              "seconds": time.time() - t0, "client_resumes": raw["resumes"], "wire": raw["wire"],
              "browser_model": raw.get("browser_model"), **summary,
              "per_image": {d: {s: raw[d][s]["rows"] for s in seeds} for d in devices}}
    write_results(args.out, result, markdown(summary, seeds, args.num_prompts) + wire_markdown(raw["wire"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
