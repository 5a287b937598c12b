"""Side-by-side summaries of per-image `GenerationStats` (the struct lives with the device loop that fills it,
`ciar_device.stats`, so that every device, torch-free ones included, accounts the same way; docs/architecture.md §8).

    total = sum(per_image_stats, GenerationStats())          # aggregate over images
    row = summarize_method(per_image_stats, base_total_s)     # one method's row of a table
"""

from __future__ import annotations

import math

from ciar_device.stats import STATS_FIELDS, GenerationStats  # noqa: F401


def _finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def summarize_method(per_image: list[GenerationStats], base_total_s: float | None) -> dict:
    """One method's row of a side-by-side table, from its per-image stats (every benchmark and the evaluation use
    this): speedup against `base_total_s` (cloud-only's mean end-to-end seconds per image, same run), steps
    compression, cloud-call rate, requests / forwards / burst tokens per image, acceptance, mean accepted length,
    the per-image latency split and bytes."""
    total, n = sum(per_image, GenerationStats()), len(per_image)
    lat = {"device": total.device_s / n, "cloud": total.cloud_s / n, "comm": total.comm_s / n,
           "total": total.total_s / n}
    return {
        "num_samples": n,
        "speedup": base_total_s / lat["total"] if base_total_s else None,
        "steps_compression": _finite(total.steps_compression),
        "cloud_call_rate": _finite(total.cloud_call_rate),
        "cloud_requests": total.cloud_requests / n,
        "cloud_forward_passes": total.cloud_forward_passes / n,
        "burst_tokens": total.burst_tokens / n,
        "acceptance_rate": _finite(total.acceptance_rate),
        "mean_accepted_length": _finite(total.mean_accepted_length),
        "latency_s": lat,
        "bytes_up": total.bytes_up / n, "bytes_down": total.bytes_down / n,
    }


def methods_markdown(rows: dict, title: str) -> str:
    """The side-by-side table (the layout of the paper's Table 1) of `summarize_method` rows plus quality columns
    (`fidelity`, `fid`, optional `speedup_paper_profile`: its column only where some row has it; the evaluation
    pipeline measures, it does not simulate)."""
    paper = any(r.get("speedup_paper_profile") is not None for r in rows.values())
    cols = ["Method", "Fidelity (↑)", "FID (↓)", "Speedup"] + (["Speedup, paper profile (sim.)"] if paper else []) + \
        ["Steps", "Cloud call", "Requests", "Accept", "Device s", "Cloud s", "Comm s"]
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    x = lambda v: "–" if v is None else f"x{v:.2f}"  # noqa: E731
    lines = [f"### {title}\n", "| " + " | ".join(cols) + " |\n", "|---" * len(cols) + "|\n"]
    for name, r in rows.items():
        lat = r["latency_s"]
        cells = [name, f(r.get("fidelity"), ".4f"), f(r.get("fid"), ".3f"), x(r["speedup"])] + \
            ([x(r.get("speedup_paper_profile"))] if paper else []) + \
            [x(r["steps_compression"]), f"{f(100 * r['cloud_call_rate'], '.2f')}%", f"{r['cloud_requests']:.1f}",
             f(r["acceptance_rate"], ".3f"), f"{lat['device']:.4f}", f"{lat['cloud']:.4f}", f"{lat['comm']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |\n")
    return "".join(lines)
