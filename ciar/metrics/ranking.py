"""Ranking quality of a score for a binary event: how well a gate's score predicts where the device is wrong.

    auroc(scores, positive)   # scores [...] float, positive [...] bool -> float in [0, 1] (nan without both classes)
"""

from __future__ import annotations

import torch


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of `scores` for the boolean labels `positive` (ties count one half), via the
    Mann-Whitney rank sum with tied ranks averaged."""
    scores, positive = scores.double().flatten(), positive.flatten().bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    uniq, inv = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / counts)[inv]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
