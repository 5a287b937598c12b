"""Drive the playground page (GET /, services/playground.html) in a real headless browser: Debian's chromium through
Playwright (its own browsers are never downloaded). Used by tests/services/test_api.py and to take the screenshots
in docs/:

    python -m loadtests.playground --out docs                  # starts a cluster with the shipped world
    python -m loadtests.playground --host http://127.0.0.1:8000 --api-key ciar-dev-key --out docs
    python -m loadtests.playground --device browser --network 5g --out docs   # this tab is the device

`drive(url, key, ...)` opens the page, types the prompt and key, picks the method and network, submits, screenshots
the image mid-way (the first preview past `mid` of the tokens) when `shots` is given, waits for the finished image
and stats, turns the token map on, and returns what the page shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

CHROMIUM = os.environ.get("CIAR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    """The system chromium (CIAR_CHROMIUM, /usr/bin/chromium, or on PATH), or None."""
    if os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


def drive(url: str, key: str, prompt: str, method: str = "ciar", network: str = "5g", seed: int = 0,
          shots: str | None = None, timeout_s: float = 180.0, mid: float = 0.4, device: str = "cluster",
          device_key: str | None = None, prompts: list[tuple[str, int]] | None = None,
          policy: str | None = None) -> dict:
    """-> {"status", "state", "previews", "stats": {row: value}, "image_src_prefix", "overlay_cells": {colour
    counts}, "methods", "networks", "console"}; with `shots` (a folder), writes playground-running.png (mid-image)
    and playground-done.png (finished, token map on).

    device "browser": the page's own tab is the device (a Web Worker on onnxruntime-web, `device_key`), then the
    cluster's device runs the same prompt and seed; "stats" are the tab's figures, "cluster_stats" the cluster
    device's; the screenshots are playground-browser-running.png / -done.png. `prompts` [(prompt, seed), ...]: more
    generations in the same page after the first (the model is downloaded once), each's figures in "more". `policy`
    ("fixed"): the tab's operating point (the page's ?policy=; default adaptive)."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no chromium found (apt-get install -y chromium; or set CIAR_CHROMIUM)")
    ms = int(timeout_s * 1000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning")
                    else None)
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(f"{url.rstrip('/')}/" + (f"?policy={policy}" if policy else ""), timeout=ms)
            page.wait_for_function("document.querySelectorAll('#network option').length > 1", timeout=ms)
            methods = page.eval_on_selector_all("#method option", "os => os.map(o => o.value)")
            networks = page.eval_on_selector_all("#network option", "os => os.map(o => o.value)")
            prefix = "playground"
            if device == "browser":
                page.wait_for_function(BROWSER_CHECKED, timeout=ms)
                if page.is_disabled('#devicemode option[value="browser"]'):
                    return {"state": "unavailable", "status": page.inner_text("#browsernote"), "console": console}
                page.select_option("#devicemode", "browser")
                page.fill("#devkey", device_key or "")
                prefix = "playground-browser"
            page.fill("#key", key)
            if device != "browser":
                page.select_option("#method", method)
            page.select_option("#network", network)
            shown = []
            for i, (text, s) in enumerate([(prompt, seed)] + list(prompts or [])):
                page.fill("#prompt", text)
                page.fill("#seed", str(s))
                page.click("#go")
                if i == 0:
                    # a preview on screen past `mid` of the image (the image building up), or the end if it came first
                    page.wait_for_function("(document.getElementById('image').src.startsWith('data:image/png') && "
                                           f"document.getElementById('progress').value >= {mid}) || "
                                           "['done', 'error'].includes(document.getElementById('status').dataset.state)",
                                           timeout=ms)
                    if shots:
                        os.makedirs(shots, exist_ok=True)
                        page.screenshot(path=os.path.join(shots, f"{prefix}-running.png"), full_page=True)
                page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                                       timeout=ms)
                shown.append(_shown(page))
            page.check("#showmap")
            if shots:
                page.screenshot(path=os.path.join(shots, f"{prefix}-done.png"), full_page=True)
            return dict(shown[0], overlay_cells=shown[0]["overlay"], overlay_visible=page.is_visible("#overlay"),
                        methods=methods, networks=networks, console=console, more=shown[1:])
        finally:
            browser.close()


def browser_generate(url: str, device_key: str, jobs: list[dict], timeout_s: float = 600.0) -> list[dict]:
    """The browser device without the page's form: chromium opens the playground and runs its Web Worker
    (/web/device/worker.js, the same code the page uses) on each job {"prompt", "seed", "policy"?} in turn (policy:
    "adaptive", the worker's default, or "fixed", the calibrated point), without previews;
    -> per job {"tokens", "who", "stats", "model"} or {"error"}. The model is downloaded once (the first job's
    figures include no download: `stats` times the loop only)."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no chromium found (apt-get install -y chromium; or set CIAR_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(timeout_s * 1000)
            page.goto(f"{url.rstrip('/')}/")
            return page.evaluate(WORKER_JOBS, {"jobs": jobs, "key": device_key})
        finally:
            browser.close()


WORKER_JOBS = """async ({jobs, key}) => {
  const worker = new Worker("/web/device/worker.js", {type: "module"});
  const out = [];
  for (const job of jobs) {
    out.push(await new Promise((resolve) => {
      worker.onmessage = ({data}) => {
        if (data.type === "result") resolve({tokens: data.tokens, who: data.who, stats: data.stats, model: data.model});
        else if (data.type === "error") resolve({error: data.message});
      };
      worker.onerror = (e) => resolve({error: e.message || "the worker failed"});
      worker.postMessage({type: "generate", key, prompt: job.prompt, seed: job.seed, policy: job.policy,
                          previews: false});
    }));
  }
  worker.terminate();
  return out;
}"""


# whether the page has checked that this tab can be the device (the option enabled, or the reason shown)
BROWSER_CHECKED = """() => !document.querySelector('#devicemode option[value="browser"]').disabled ||
  !document.getElementById('browsernote').classList.contains('hidden')"""


def _shown(page) -> dict:
    """What the page shows after one generation: status, previews, both stats columns, the image, the token map."""
    columns = page.eval_on_selector_all("#stats tr", "rows => rows.filter(r => r.dataset.key).map(r => "
                                        "[r.dataset.key, ...Array.from(r.cells).slice(1).map(c => c.textContent)])")
    return {
        "status": page.inner_text("#status"),
        "state": page.get_attribute("#status", "data-state"),
        "previews": int(page.get_attribute("#status", "data-previews") or 0),
        "stats": {k: v[0] for k, *v in columns},
        "cluster_stats": {k: v[1] for k, *v in columns if len(v) > 1},
        "image_src_prefix": (page.get_attribute("#image", "src") or "")[:22],
        "overlay": page.evaluate(OVERLAY_COUNT),
    }


# counts the overlay's cells by colour (sampled at each cell's centre): {"device": n, "cloud": m}
OVERLAY_COUNT = """() => {
  const c = document.getElementById('overlay'), ctx = c.getContext('2d');
  const n = document.querySelectorAll('#stats tr').length ? Number(
      document.querySelector('#stats tr[data-key="tokens"]').cells[1].textContent) : 0;
  const grid = Math.round(Math.sqrt(n)), cell = c.width / grid, out = {device: 0, cloud: 0, none: 0};
  for (let i = 0; i < n; i++) {
    const px = ctx.getImageData(Math.floor((i % grid + 0.5) * cell), Math.floor((Math.floor(i / grid) + 0.5) * cell),
                                1, 1).data;
    if (px[3] === 0) out.none++; else if (px[1] > px[0]) out.device++; else out.cloud++;
  }
  return out;
}"""


def main(argv: list[str] | None = None) -> int:
    from loadtests.devices import DEVICE_KEY
    from loadtests.run import REPO, Cluster, apply_overrides, client_key, free_port, load_app_config, use_key

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs", help="folder of the screenshots")
    p.add_argument("--host", default=None, help="a running cluster's URL (then nothing is started or stopped)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--config", default=os.path.join(REPO, "serve_config.yaml"))
    p.add_argument("--prompt", default="a large red circle at the center and a small yellow square at the top "
                   "left on a blue background")
    p.add_argument("--method", default="ciar")
    p.add_argument("--network", default="4g")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cluster", "browser"), default="cluster",
                   help="who drafts: the cluster's device, or the page's own tab (onnxruntime-web, `make web`)")
    p.add_argument("--device-key", default=os.environ.get("CIAR_DEVICE_KEY", DEVICE_KEY),
                   help="the browser device's key (default: the development device key)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="as in loadtests.run (e.g. Device.preview_every=8)")
    args = p.parse_args(argv)
    cluster = None
    try:
        if args.host is None:
            app = apply_overrides(load_app_config(args.config), args.sets)
            if args.api_key:
                use_key(app, args.api_key)
            key = client_key(app, args.api_key)
            cluster = Cluster(app, free_port(), free_port())
            cluster.start()
            url = cluster.url
        else:
            url, key = args.host, client_key(None, args.api_key)
        shown = drive(url, key, args.prompt, args.method, args.network, args.seed, shots=args.out,
                      device=args.device, device_key=args.device_key)
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps(shown, indent=1))
    return 0 if shown["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
