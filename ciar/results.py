"""A run's results on disk: the JSON report, its Markdown tables beside it, the tables printed. Shared by the
benchmarks and the load tests (`loadtests` may not import `benchmarks`: tests/test_layering.py); the standard
library only."""

from __future__ import annotations

import json
import os


def write_results(out: str, report: dict, md: str) -> None:
    """A benchmark's results: the JSON at `out`, its Markdown tables beside it (.md), and the tables printed."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
