"""Load-test plan, without Locust: request mix, scenario schedules, the SLO gate and the summary arithmetic.

`loadtests/locustfile.py` (Locust users and `LoadTestShape`s) and `loadtests/run.py` (the runner) share these plain
functions; importing this module does NOT import Locust (whose import monkey-patches the process with gevent), so
the tests and the runner can use it next to Ray.

Settings come from the environment (the runner sets them for the Locust process):

    CIAR_SCENARIO      steady | ramp | spike (default steady)
    CIAR_USERS         peak number of simulated users (default 4)
    CIAR_DURATION      seconds of load (default 30)
    CIAR_API_KEY       bearer key (default ciar-dev-key)
    CIAR_SLO_MAX_FAIL  highest failure ratio that passes (default 0.0: any failure, a 503 included, fails the run)
    CIAR_SLO_P99_MS    highest p99 latency in ms that passes (default 120000)
    CIAR_LOAD_STATS    file to append one JSON line per response to (optional)
    CIAR_SLO_REPORT    file to write the SLO verdict to as JSON (optional)
    CIAR_LOAD_SEED     seed of the request mix (default 0)
    CIAR_THINK_S       a user waits uniformly 0..this many seconds between requests (default 1.0)
"""

from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import dataclass

GENERATIONS_PATH = "/v1/images/generations"
# mostly CIAR, some baselines; every method here runs on the device fleet of the shipped config
METHOD_MIX = {"ciar": 0.6, "cloud": 0.1, "eagle": 0.1, "lantern": 0.1, "code": 0.1}
NETWORK_MIX = {"5g": 0.4, "4g": 0.3, "wifi": 0.3}
DEFAULTS = {"CIAR_SCENARIO": "steady", "CIAR_USERS": "4", "CIAR_DURATION": "30", "CIAR_API_KEY": "ciar-dev-key",
            "CIAR_SLO_MAX_FAIL": "0.0", "CIAR_SLO_P99_MS": "120000", "CIAR_LOAD_SEED": "0", "CIAR_THINK_S": "1.0"}


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    scenario: str
    users: int
    duration_s: float
    api_key: str
    slo_max_fail: float
    slo_p99_ms: float
    seed: int
    think_s: float
    stats_path: str | None
    slo_report_path: str | None

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Settings":
        env = os.environ if env is None else env

        def get(name: str) -> str:
            return env.get(name) or DEFAULTS[name]

        s = cls(scenario=get("CIAR_SCENARIO").lower(), users=int(get("CIAR_USERS")),
                duration_s=float(get("CIAR_DURATION")), api_key=get("CIAR_API_KEY"),
                slo_max_fail=float(get("CIAR_SLO_MAX_FAIL")), slo_p99_ms=float(get("CIAR_SLO_P99_MS")),
                seed=int(get("CIAR_LOAD_SEED")), think_s=float(get("CIAR_THINK_S")),
                stats_path=env.get("CIAR_LOAD_STATS") or None, slo_report_path=env.get("CIAR_SLO_REPORT") or None)
        if s.scenario not in SCENARIOS:
            raise ValueError(f"CIAR_SCENARIO={s.scenario!r}: expected one of {sorted(SCENARIOS)}")
        if s.users < 1 or s.duration_s <= 0:
            raise ValueError(f"CIAR_USERS must be >= 1 and CIAR_DURATION > 0 (got {s.users}, {s.duration_s})")
        return s


# ---------------------------------------------------------------------------------------------------- request mix
class RequestMaker:
    """Seeded stream of request bodies: a caption of the scenes grammar (`ciar.data.scenes`, val split), a method
    and a network drawn from the weighted mixes, an image seed; `response_format: tokens` keeps answers small."""

    def __init__(self, seed: int = 0, methods: dict[str, float] | None = None,
                 networks: dict[str, float] | None = None):
        self.seed = int(seed)
        self.rng = random.Random(self.seed)
        self.methods = dict(methods or METHOD_MIX)
        self.networks = dict(networks or NETWORK_MIX)
        self.index = 0

    def caption(self, index: int) -> str:
        from ciar.data.scenes import scene_at

        return scene_at("val", index, seed=self.seed).caption

    def next(self) -> dict:
        method = self.rng.choices(list(self.methods), weights=list(self.methods.values()))[0]
        network = self.rng.choices(list(self.networks), weights=list(self.networks.values()))[0]
        body = {"prompt": self.caption(self.index), "seed": self.rng.randrange(2**31), "method": method,
                "network": network, "response_format": "tokens"}
        self.index += 1
        return body


# ---------------------------------------------------------------------------------------------------- scenarios
# schedule(t, users, duration_s) -> (user_count, spawn_rate) or None (stop); t in seconds since the test started


def steady(t: float, users: int, duration_s: float) -> tuple[int, float] | None:
    """All `users` within about two seconds, held for the whole duration."""
    if t >= duration_s:
        return None
    return users, max(1.0, users / 2.0)


def ramp(t: float, users: int, duration_s: float) -> tuple[int, float] | None:
    """A staircase of up to 4 equal steps over the first 75 % of the duration up to `users`, then held."""
    if t >= duration_s:
        return None
    steps = max(1, min(users, 4))
    step_len = 0.75 * duration_s / steps
    k = min(steps, int(t // step_len) + 1)
    return max(1, math.ceil(users * k / steps)), max(1.0, users / steps)


def spike(t: float, users: int, duration_s: float) -> tuple[int, float] | None:
    """A quarter of the users (at least one), a jump to all `users` from 30 % to 60 % of the duration (spawned in
    about a second), then back to the baseline."""
    if t >= duration_s:
        return None
    base = max(1, round(users / 4))
    rate = float(max(1, users))
    if 0.3 * duration_s <= t < 0.6 * duration_s:
        return users, rate
    return base, rate


SCENARIOS = {"steady": steady, "ramp": ramp, "spike": spike}


# ---------------------------------------------------------------------------------------------------- SLO gate
def slo_verdict(num_requests: int, num_failures: int, p99_ms: float | None, max_fail_ratio: float = 0.0,
                max_p99_ms: float = 120_000.0) -> dict:
    """The SLO gate: fails when no request completed, when the failure ratio (503s included) is above
    `max_fail_ratio`, or when the p99 latency is above `max_p99_ms`. -> {"ok", "exit_code", "reasons", ...}."""
    reasons = []
    ratio = num_failures / num_requests if num_requests else 0.0
    if num_requests == 0:
        reasons.append("no request completed")
    if ratio > max_fail_ratio:
        reasons.append(f"failure ratio {ratio:.4f} ({num_failures}/{num_requests}) > {max_fail_ratio}")
    if p99_ms is not None and not math.isnan(p99_ms) and p99_ms > max_p99_ms:
        reasons.append(f"p99 latency {p99_ms:.0f} ms > {max_p99_ms:.0f} ms")
    return {"ok": not reasons, "exit_code": 1 if reasons else 0, "reasons": reasons, "requests": num_requests,
            "failures": num_failures, "failure_ratio": ratio, "p99_ms": p99_ms, "max_fail_ratio": max_fail_ratio,
            "max_p99_ms": max_p99_ms}


# ---------------------------------------------------------------------------------------------------- summary
def response_record(body: dict, status: int, latency_ms: float, reply: dict | None, t: float) -> dict:
    """One line of CIAR_LOAD_STATS: what was asked, what came back, and the server's stats of a success."""
    rec = {"t": t, "method": body.get("method"), "network": body.get("network"), "status": status,
           "ok": status == 200 and reply is not None, "latency_ms": latency_ms}
    st = (reply or {}).get("stats") or {}
    if st:
        vbs = st.get("verifier_batch_size") or {}
        rec.update({"cloud_requests": st.get("cloud_requests"), "total_tokens": st.get("total_tokens"),
                    "total_s": st.get("total_s"), "wall_s": st.get("wall_s"), "device_id": st.get("device_id"),
                    "vbs_mean": vbs.get("mean"), "vbs_max": vbs.get("max"), "vbs_count": vbs.get("count")})
    return rec


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    s = sorted(v for v in values if v is not None)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def mean(values) -> float | None:
    """Mean of the values that are not None; None for none."""
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def summarise_responses(records: list[dict]) -> dict:
    """Per-response figures: cloud calls per image, server-side latency parts, batch sizes seen by the devices."""
    ok = [r for r in records if r.get("ok")]
    per_method = {}
    for m in sorted({r["method"] for r in records if r.get("method")}):
        rs = [r for r in records if r.get("method") == m]
        good = [r for r in rs if r.get("ok")]
        per_method[m] = {"requests": len(rs), "images": len(good),
                         "cloud_calls_per_image": mean(r.get("cloud_requests") for r in good),
                         "latency_p50_ms": percentile([r["latency_ms"] for r in good], 50)}
    weighted = [(r["vbs_mean"], r.get("vbs_count") or 0) for r in ok if r.get("vbs_mean") is not None]
    n = sum(c for _, c in weighted)
    status = {}
    for r in records:
        status[str(r.get("status"))] = status.get(str(r.get("status")), 0) + 1
    return {"responses": len(records), "images": len(ok), "status_counts": status,
            "cloud_calls_per_image": mean(r.get("cloud_requests") for r in ok),
            "server_total_s": {"p50": percentile([r.get("total_s") for r in ok], 50),
                               "mean": mean(r.get("total_s") for r in ok)},
            "server_wall_s": {"p50": percentile([r.get("wall_s") for r in ok], 50),
                              "p99": percentile([r.get("wall_s") for r in ok], 99),
                              "mean": mean(r.get("wall_s") for r in ok)},
            "verifier_batch_size_seen_by_devices": {
                "mean": sum(m * c for m, c in weighted) / n if n else None,
                "max": max((r["vbs_max"] for r in ok if r.get("vbs_max") is not None), default=None)},
            "devices_used": len({r.get("device_id") for r in ok if r.get("device_id")}),
            "per_method": per_method}


def hist_mean(hist: dict) -> float | None:
    """Mean batch size of a {batch_size: forward_passes} histogram (keys may be strings)."""
    total = sum(int(v) for v in hist.values())
    return sum(int(k) * int(v) for k, v in hist.items()) / total if total else None


def merge_hists(hists: list[dict]) -> dict:
    out: dict[int, int] = {}
    for h in hists:
        for k, v in h.items():
            out[int(k)] = out.get(int(k), 0) + int(v)
    return {str(k): out[k] for k in sorted(out)}


def _num(x: str) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def read_locust_stats(path: str) -> dict[str, dict]:
    """Locust's `<prefix>_stats.csv` -> {name: row with numbers}; the total is under "Aggregated"."""
    rows = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows[row["Name"]] = {k: (_num(v) if k not in ("Type", "Name") else v) for k, v in row.items()}
    return rows


def figures(totals: dict) -> dict:
    """Summary figures from Locust totals {"total": {...}, "by_name": {name: {...}}} (the layout the locustfile
    writes into $CIAR_SLO_REPORT, or `csv_totals` of the stats CSV): counts, failure ratio, requests/s (Locust's:
    requests / (last response - first request)), images/s (the successful share of it), latency percentiles."""
    t = totals.get("total") or {}
    n, fails = int(t.get("requests") or 0), int(t.get("failures") or 0)
    rps = t.get("requests_per_s") or 0.0
    return {"requests": n, "failures": fails, "failure_ratio": fails / n if n else 0.0,
            "requests_per_s": rps, "images_per_s": rps * (n - fails) / n if n else 0.0,
            "latency_ms": {k: t.get(k) for k in ("p50", "p95", "p99", "mean", "max")},
            "by_name": {name: {"requests": int(e.get("requests") or 0), "failures": int(e.get("failures") or 0),
                               "p50_ms": e.get("p50"), "p99_ms": e.get("p99")}
                        for name, e in (totals.get("by_name") or {}).items()}}


def csv_totals(rows: dict[str, dict]) -> dict:
    """Locust's stats table (`read_locust_stats`) in the layout of `figures`."""
    def entry(r: dict) -> dict:
        return {"requests": r.get("Request Count"), "failures": r.get("Failure Count"),
                "requests_per_s": r.get("Requests/s"), "p50": r.get("50%"), "p95": r.get("95%"),
                "p99": r.get("99%"), "mean": r.get("Average Response Time"), "max": r.get("Max Response Time")}

    return {"total": entry(rows.get("Aggregated") or {}),
            "by_name": {name: entry(r) for name, r in rows.items() if name != "Aggregated"}}
