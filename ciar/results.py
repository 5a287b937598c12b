"""A run's results on disk: the JSON report, its Markdown tables beside it, the tables printed; and the settings file
a resumable output keeps (`claim_settings`). Shared by the benchmarks, the load tests and the pipelines (`loadtests`
may not import `benchmarks`: tests/test_layering.py); the standard library only."""

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


class SettingsMismatch(ValueError):
    """A resumable output was made with other settings than this run's (`claim_settings`)."""


def claim_settings(path: str, settings: dict, what: str, fix: str) -> None:
    """The settings a resumable output depends on, kept in the JSON file `path` beside it: written by the first run,
    compared by every later one, which would otherwise take the finished part as its own. `settings` must be
    JSON-ready. Raises SettingsMismatch naming `what` (the output), each setting that differs and `fix`."""
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        differ = sorted(k for k in settings.keys() | before.keys() if settings.get(k) != before.get(k))
        if differ:
            said = "; ".join(f"{k}: {json.dumps(before.get(k))} there, {json.dumps(settings.get(k))} now"
                             for k in differ)
            raise SettingsMismatch(f"{what} was made with other settings ({said}): {fix}")
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(settings, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
