"""Drive the playground page (GET /, services/playground.html) in a real headless browser: Debian's chromium through
Playwright (its own browsers are never downloaded). Used by tests/services/test_api.py and to take the screenshots
in docs/:

    python -m loadtests.playground --out docs                  # starts a cluster with the shipped world
    python -m loadtests.playground --host http://127.0.0.1:8000 --api-key ciar-dev-key --out docs

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
          shots: str | None = None, timeout_s: float = 180.0, mid: float = 0.4) -> dict:
    """-> {"status", "state", "previews", "stats": {row: value}, "image_src_prefix", "overlay_cells": {colour
    counts}, "methods", "networks"}; with `shots` (a folder), writes playground-running.png (mid-image) and
    playground-done.png (finished, token map on)."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no chromium found (apt-get install -y chromium; or set CIAR_CHROMIUM)")
    ms = int(timeout_s * 1000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(f"{url.rstrip('/')}/", timeout=ms)
            page.wait_for_function("document.querySelectorAll('#network option').length > 1", timeout=ms)
            methods = page.eval_on_selector_all("#method option", "os => os.map(o => o.value)")
            networks = page.eval_on_selector_all("#network option", "os => os.map(o => o.value)")
            page.fill("#prompt", prompt)
            page.fill("#key", key)
            page.select_option("#method", method)
            page.select_option("#network", network)
            page.fill("#seed", str(seed))
            page.click("#go")
            # a preview on screen past `mid` of the image (the image building up), or the end if it came first
            page.wait_for_function("(document.getElementById('image').src.startsWith('data:image/png') && "
                                   f"document.getElementById('progress').value >= {mid}) || "
                                   "['done', 'error'].includes(document.getElementById('status').dataset.state)",
                                   timeout=ms)
            if shots:
                os.makedirs(shots, exist_ok=True)
                page.screenshot(path=os.path.join(shots, "playground-running.png"), full_page=True)
            page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                                   timeout=ms)
            page.check("#showmap")
            if shots:
                page.screenshot(path=os.path.join(shots, "playground-done.png"), full_page=True)
            return {
                "status": page.inner_text("#status"),
                "state": page.get_attribute("#status", "data-state"),
                "previews": int(page.get_attribute("#status", "data-previews") or 0),
                "stats": dict(page.eval_on_selector_all(
                    "#stats tr", "rows => rows.map(r => [r.dataset.key, r.cells[1].textContent])")),
                "image_src_prefix": page.get_attribute("#image", "src")[:22],
                "overlay_cells": page.evaluate(OVERLAY_COUNT),
                "overlay_visible": page.is_visible("#overlay"),
                "methods": methods, "networks": networks,
            }
        finally:
            browser.close()


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
        shown = drive(url, key, args.prompt, args.method, args.network, args.seed, shots=args.out)
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps(shown, indent=1))
    return 0 if shown["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
