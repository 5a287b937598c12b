"""cluster/grafana-dashboard.json against the metrics the code registers: every ciar_* metric is shown, and every
query names a metric that exists (Ray exports custom metrics with the ray_ prefix; histograms as _bucket/_sum/_count)."""

import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGISTER = re.compile(r'metrics\.(Counter|Histogram|Gauge)\(\s*"(ciar_[a-z_]+)"')
QUERY = re.compile(r"\bray_(ciar_[a-z_]+)\b")


def registered() -> dict[str, str]:
    """Every ciar_* metric any module of services/ registers -> its kind."""
    found = {}
    folder = os.path.join(REPO, "services")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                found.update({m: kind for kind, m in REGISTER.findall(f.read())})
    return found


def test_dashboard_shows_every_registered_metric_and_only_those():
    metrics = registered()
    assert len(metrics) >= 10, metrics
    with open(os.path.join(REPO, "cluster", "grafana-dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set()
    for e in exprs:
        for name in QUERY.findall(e):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in metrics, f"the dashboard queries {name}, which no code registers"
            if name != base:
                assert metrics[base] == "Histogram", f"{name}: {base} is a {metrics[base]}, not a histogram"
            used.add(base)
    assert used == set(metrics), f"not on the dashboard: {sorted(set(metrics) - used)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] for p in dash["panels"])
