"""Locust load test of the CIAR HTTP API (POST /v1/images/generations).

    python -m loadtests.run --users 8 --duration 30 --scenario ramp      # starts a cluster, runs this, summarises
    CIAR_SCENARIO=spike CIAR_USERS=8 CIAR_DURATION=40 \
        locust -f loadtests/locustfile.py --headless -H http://127.0.0.1:8000 --csv out/locust --html out/report.html

Each simulated user is a client of the API making one image at a time: a caption of the scenes grammar, a method
from a weighted mix (mostly ciar; cloud, eagle, lantern, code), a network (5g / 4g / wifi), `response_format:
tokens`. Requests are named per method ("generate ciar", ...); a 503 (overload) is a failure named "generate 503"
and the user then honours Retry-After. The load follows one `LoadTestShape` chosen by $CIAR_SCENARIO (steady, ramp,
spike) with $CIAR_USERS and $CIAR_DURATION. When Locust quits, the SLO gate sets the exit code: 1 when the failure
ratio is above $CIAR_SLO_MAX_FAIL (default 0) or the p99 latency above $CIAR_SLO_P99_MS (default 120000), else 0.
Settings and their defaults: loadtests/plan.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import time

import gevent
from locust import LoadTestShape, between, events, task
from locust.contrib.fasthttp import FastHttpUser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, when run as a file
from loadtests.plan import GENERATIONS_PATH, SCENARIOS, RequestMaker, Settings, response_record, slo_verdict  # noqa

SETTINGS = Settings.from_env()
COLLECTOR: list[dict] = []  # every response's record, in this process (also appended to $CIAR_LOAD_STATS)
_user_ids = itertools.count()
_lock = threading.Lock()
logger = logging.getLogger("ciar.loadtest")


def record(rec: dict) -> None:
    COLLECTOR.append(rec)
    if SETTINGS.stats_path:
        with _lock, open(SETTINGS.stats_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class ImageClient(FastHttpUser):
    wait_time = between(0.0, SETTINGS.think_s)
    network_timeout = 300.0  # a generation can wait in a device queue (services' request_timeout_s is 300 s)
    connection_timeout = 30.0

    def on_start(self) -> None:
        self.maker = RequestMaker(seed=SETTINGS.seed * 100_003 + next(_user_ids))
        self.headers = {"Authorization": f"Bearer {SETTINGS.api_key}"}

    @task
    def generate(self) -> None:
        body = self.maker.next()
        t0 = time.perf_counter()
        retry_after = 0.0
        with self.client.post(GENERATIONS_PATH, json=body, headers=self.headers, name=f"generate {body['method']}",
                              catch_response=True) as resp:
            latency_ms = (time.perf_counter() - t0) * 1000
            status = resp.status_code or 0
            reply = None
            if status == 200:
                try:
                    reply = resp.json()
                    tokens = reply["data"][0]["tokens"]
                    if not tokens or "stats" not in reply:
                        raise ValueError("empty tokens or no stats")
                except Exception as e:  # noqa: BLE001 - a malformed answer is a failure
                    reply = None
                    resp.failure(f"bad 200 answer: {type(e).__name__}: {e}")
                else:
                    resp.success()
            elif status == 503:
                resp.request_meta["name"] = "generate 503"  # overload: its own row, and a failure for the SLO
                retry_after = float(resp.headers.get("Retry-After") or 1)
                resp.failure(f"503 overloaded (Retry-After {retry_after:g} s)")
            else:
                text = (resp.text or "")[:200] if status else str(resp.error)
                resp.failure(f"HTTP {status}: {text}")
            record(response_record(body, status, latency_ms, reply, time.time()))
        if retry_after:
            gevent.sleep(min(retry_after, 10.0))


# ---------------------------------------------------------------------------------------------------- shapes
class _ScenarioShape(LoadTestShape):
    """tick() follows `schedule(run_time, users, duration)` of loadtests.plan (users/duration from the env)."""

    abstract = True  # Locust runs only the concrete class chosen below
    schedule = None

    def __init__(self, users: int | None = None, duration_s: float | None = None):
        super().__init__()
        self.users = users if users is not None else SETTINGS.users
        self.duration_s = duration_s if duration_s is not None else SETTINGS.duration_s

    def tick(self):
        return type(self).schedule(self.get_run_time(), self.users, self.duration_s)


class SteadyShape(_ScenarioShape):
    abstract = True
    schedule = staticmethod(SCENARIOS["steady"])


class RampShape(_ScenarioShape):
    abstract = True
    schedule = staticmethod(SCENARIOS["ramp"])


class SpikeShape(_ScenarioShape):
    abstract = True
    schedule = staticmethod(SCENARIOS["spike"])


SHAPES = {"steady": SteadyShape, "ramp": RampShape, "spike": SpikeShape}


class ScenarioShape(SHAPES[SETTINGS.scenario]):
    """The shape Locust runs: the one named by $CIAR_SCENARIO."""


# ---------------------------------------------------------------------------------------------------- SLO gate
@events.quitting.add_listener
def slo_gate(environment, **_kw) -> None:
    total = environment.stats.total
    p99 = total.get_response_time_percentile(0.99) if total.num_requests else None
    verdict = slo_verdict(total.num_requests, total.num_failures, p99, SETTINGS.slo_max_fail, SETTINGS.slo_p99_ms)
    environment.process_exit_code = verdict["exit_code"]
    if verdict["ok"]:
        logger.info("SLO passed: %d requests, failure ratio %.4f, p99 %s ms", total.num_requests,
                    verdict["failure_ratio"], p99)
    else:
        logger.error("SLO FAILED: %s", "; ".join(verdict["reasons"]))
    print(f"SLO {'passed' if verdict['ok'] else 'FAILED: ' + '; '.join(verdict['reasons'])}", flush=True)
    if SETTINGS.slo_report_path:  # the final totals too (Locust's CSV misses requests that end while stopping)
        with open(SETTINGS.slo_report_path, "w") as f:
            json.dump({**verdict, "totals": locust_totals(environment.stats)}, f, indent=2)


def locust_totals(stats) -> dict:
    """Final figures of Locust's stats, in the layout of loadtests.plan.locust_figures."""
    def entry(e) -> dict:
        pct = {f"p{q}": (e.get_response_time_percentile(q / 100) if e.num_requests else None) for q in (50, 95, 99)}
        return {"requests": e.num_requests, "failures": e.num_failures, "requests_per_s": e.total_rps, **pct,
                "mean": e.avg_response_time if e.num_requests else None,
                "max": e.max_response_time if e.num_requests else None}

    return {"total": entry(stats.total), "by_name": {name: entry(e) for (name, _m), e in stats.entries.items()}}
