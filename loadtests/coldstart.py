"""The first image after start-up, as a new user meets it: `make serve`, then a request at once, several times.

    python -m loadtests.coldstart --runs 3 --out runs/coldstart        # each run: a cold `make serve`, stopped after

Each run starts the README's command (`make serve`: `serve run serve_config.yaml`) in its own process group and sends
the README's request (`POST /v1/images/generations` with the development key) as soon as the port accepts a
connection, then again after every 503's Retry-After, until an image comes back; /healthz is polled beside it. It
records every answer (status, Retry-After, seconds since start) and stops the cluster (SIGTERM to the group it
started, SIGKILL after a minute). What must hold (issue 36): every answer is the image (200) or a 503 with
Retry-After (the proxy's 404 before the application's routes exist is recorded too), none waits past
`--hang-s` (a hang), and /healthz says 200 only once an image can be served (the first request sent after the first
healthz 200 must be answered 200).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = {"prompt": "a small red circle on a white background", "seed": 5, "method": "ciar",
        "response_format": "b64_json"}


def _post(url: str, key: str, timeout_s: float) -> tuple[int | None, str | None, str]:
    """-> (status or None when no HTTP answer came, Retry-After, a short note)."""
    req = urllib.request.Request(f"{url}/v1/images/generations", data=json.dumps(BODY).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = json.loads(r.read())
            return r.status, None, f"{len(body['data'])} image(s), {body['stats']['cloud_requests']} cloud requests"
    except urllib.error.HTTPError as e:
        try:
            note = json.loads(e.read()).get("error", {}).get("message", "")[:120]
        except Exception:  # noqa: BLE001 - the proxy's own plain-text answers
            note = ""
        return e.code, e.headers.get("Retry-After"), note
    except (ConnectionError, urllib.error.URLError) as e:
        if isinstance(getattr(e, "reason", e), ConnectionRefusedError) or isinstance(e, ConnectionRefusedError):
            return None, None, "refused"
        if "timed out" in str(e):
            return None, None, "hang"
        return None, None, f"{type(e).__name__}: {e}"
    except TimeoutError:
        return None, None, "hang"


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


def wait_port_free(url: str, timeout_s: float = 120.0) -> None:
    """Until nothing answers at `url` for 2 s (the previous run's cluster is gone: a cold start is cold)."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if _health(url) is None:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 2.0:
                return
        else:
            quiet_since = None
        time.sleep(0.2)
    raise RuntimeError(f"something still answers at {url}: stop it before a cold-start run")


def one_run(url: str, key: str, log_path: str, hang_s: float, limit_s: float) -> dict:
    wait_port_free(url)
    t0 = time.monotonic()
    log = open(log_path, "w")
    proc = subprocess.Popen(["make", "serve"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    answers, health, stop = [], [], threading.Event()

    def poll_health():
        last = "unset"
        while not stop.is_set():
            code = _health(url)
            if code != last:
                health.append({"t_s": round(time.monotonic() - t0, 2), "status": code})
                last = code
            time.sleep(0.2)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        while time.monotonic() - t0 < limit_s:
            sent = time.monotonic()
            status, retry, note = _post(url, key, hang_s)
            if status is None and note == "refused":
                time.sleep(0.2)
                continue
            answers.append({"sent_s": round(sent - t0, 2), "took_s": round(time.monotonic() - sent, 2),
                            "status": status, "retry_after": retry, "note": note})
            if status == 200 or note == "hang":
                break
            time.sleep(float(retry) if retry else 1.0)
    finally:
        stop.set()
        poller.join(5)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        wait_port_free(url)
    first_ok = next((h["t_s"] for h in health if h["status"] == 200), None)
    after_ok = [a for a in answers if first_ok is not None and a["sent_s"] >= first_ok]
    return {"answers": answers, "healthz": health, "healthz_200_at_s": first_ok,
            "image": bool(answers) and answers[-1]["status"] == 200,
            "hang": any(a["note"] == "hang" for a in answers),
            "off_contract": [a for a in answers if a["status"] not in (200, 503, 404) or
                             (a["status"] == 503 and not a["retry_after"])],
            "after_healthz_ok": [a["status"] for a in after_ok]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default="ciar-dev-key")
    ap.add_argument("--hang-s", type=float, default=120.0, help="a request unanswered this long is a hang")
    ap.add_argument("--limit-s", type=float, default=300.0, help="give a run up to this long to produce an image")
    ap.add_argument("--out", default="runs/coldstart")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for i in range(args.runs):
        r = one_run(args.url, args.key, os.path.join(args.out, f"serve-{i}.log"), args.hang_s, args.limit_s)
        runs.append(r)
        answers = [(a["status"], a["retry_after"], a["sent_s"], a["took_s"]) for a in r["answers"]]
        print(json.dumps({"run": i, **{k: r[k] for k in ("image", "hang", "healthz_200_at_s", "after_healthz_ok")},
                          "answers": answers}), flush=True)
    ok = all(r["image"] and not r["hang"] and not r["off_contract"] and set(r["after_healthz_ok"]) <= {200}
             for r in runs)
    with open(os.path.join(args.out, "coldstart.json"), "w") as f:
        json.dump({"runs": runs, "ok": ok}, f, indent=1)
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
