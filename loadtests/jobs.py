"""What the HTTP fault scenarios send and how: the prompts, links and generation jobs of a run (seeded), and a client
of the generation API that reports each answer as a small dict (plain, streamed, or cut after its first event).
Shared by `loadtests.reliability`, `loadtests.nodeloss` and `loadtests.headloss`, which compare the images a
disturbed run made with an undisturbed run's: the same jobs, so the same images."""

from __future__ import annotations

import json
import random
import time

from ciar.collab.names import NETWORKS as ALL_NETWORKS

PROMPTS = ("a small red circle at the top on a gray background",
           "a large blue square at the center on a black background",
           "a green triangle at the bottom left and a yellow circle at the top right on a white background",
           "a medium purple star at the left on a gray background")
NETWORKS = tuple(n for n in ALL_NETWORKS if n != "none")  # real links only: "none" is an ideal one
# the reliability run drives the simulation knobs (params.link_drop_after): its deployment enables them
DEFAULT_SETS = ("Verifier.idle_timeout_s=10", "args.allow_simulation_params=true")


class Client:
    def __init__(self, url: str, key: str):
        import requests

        self.requests = requests
        self.gen = f"{url}/v1/images/generations"
        self.headers = {"Authorization": f"Bearer {key}"}

    def post(self, body: dict, timeout: float = 600.0) -> dict:
        t0 = time.perf_counter()
        try:
            r = self.requests.post(self.gen, json=body, headers=self.headers, timeout=timeout)
        except self.requests.RequestException as e:
            return {"code": None, "error": type(e).__name__, "latency_s": time.perf_counter() - t0}
        out = {"code": r.status_code, "latency_s": time.perf_counter() - t0,
               "retry_after": r.headers.get("retry-after")}
        try:
            j = r.json()
        except ValueError:
            out["error"] = r.text[:200]
            return out
        if r.status_code == 200:
            st = j["stats"]
            out.update(tokens=j["data"][0].get("tokens"), degraded=bool(st.get("degraded")),
                       resumes=st.get("resumes", 0), total_tokens=st.get("total_tokens"),
                       device_retries=st.get("device_retries", 0))
        else:
            out["error"] = j.get("error", {}).get("message")
        return out

    def stream(self, body: dict, timeout: float = 600.0) -> dict:
        """A streamed generation read to its end: `result` (code 200, its tokens and stats) or `error` (its status);
        with the progress events counted and the latency."""
        t0 = time.perf_counter()
        out: dict = {"code": None, "streamed": True, "progress_events": 0}
        try:
            with self.requests.post(self.gen, json={**body, "stream": True}, headers=self.headers, stream=True,
                                    timeout=timeout) as r:
                if r.status_code != 200:
                    try:
                        msg = r.json().get("error", {}).get("message")
                    except ValueError:
                        msg = r.text[:200]
                    out.update(code=r.status_code, error=msg)
                else:
                    out.update(_read_events(r.iter_lines(decode_unicode=True), out))
        except self.requests.RequestException as e:
            out.update(code=None, error=f"{type(e).__name__}: {str(e)[:120]}")
        out["latency_s"] = time.perf_counter() - t0
        return out

    def stream_and_disconnect(self, body: dict) -> dict:
        """Start a streamed generation, read its first event, and hang up."""
        try:
            with self.requests.post(self.gen, json={**body, "stream": True}, headers=self.headers, stream=True,
                                    timeout=600) as r:
                code = r.status_code
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data: "):
                        break
        except self.requests.RequestException as e:
            return {"code": None, "error": type(e).__name__, "disconnected": True}
        return {"code": code, "disconnected": True}


def _read_events(lines, out: dict) -> dict:
    """Server-sent events up to `result` or `error` -> the fields they give (`out`'s progress count updated)."""
    event = None
    for line in lines:
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            if event == "progress":
                out["progress_events"] += 1
            elif event == "result":
                st = data.get("stats") or {}
                return {"code": 200, "tokens": data["data"][0].get("tokens"), "degraded": bool(st.get("degraded")),
                        "resumes": st.get("resumes", 0), "device_retries": st.get("device_retries", 0)}
            elif event == "error":
                return {"code": data.get("status") or 500, "error": (data.get("error") or {}).get("message")}
    return {"code": None, "error": "stream ended without a result"}


def make_jobs(n: int, seed: int, methods=("ciar", "eagle", "lantern", "cloud")) -> list[dict]:
    """`n` generation requests (tokens, no image), methods in turn, prompts / seeds / links drawn from `seed`."""
    rng = random.Random(seed)
    # CIAR at its fixed point: a disturbed run must make the very images of the undisturbed one, which an adaptive
    # device (its point chosen from the costs it observed) would not promise
    return [{"prompt": rng.choice(PROMPTS), "seed": rng.randrange(1 << 20), "method": methods[i % len(methods)],
             "network": rng.choice(NETWORKS), "response_format": "tokens",
             **({"params": {"policy": "fixed"}} if methods[i % len(methods)] == "ciar" else {})} for i in range(n)]
