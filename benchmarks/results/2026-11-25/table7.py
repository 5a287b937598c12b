"""Table 7 from the runs of table7.sh: every objective's last evaluation (256 val sequences, deployed CFG).

    python benchmarks/results/2026-11-25/table7.py runs/table7 > benchmarks/results/2026-11-25/table7.md
"""

import json
import os
import sys

RUNS = [("init", "start: the 2-layer device of commit 6c9d61d (Inter-DRO on VQ codes, 1,200 steps x 16)"),
        ("coverage", "KL + coverage (ours)"), ("inter_dro", "KL + Inter-DRO (paper: anchor, lower, center, upper)"),
        ("inter_dro_no_anchor", "Inter-DRO without anchor"), ("inter_dro_no_lower", "Inter-DRO without lower"),
        ("inter_dro_no_center", "Inter-DRO without center"), ("inter_dro_no_upper", "Inter-DRO without upper")]


def main(folder: str) -> None:
    print("| objective | steps | KL (guided) | TV | top-1 agreement | box covers cloud mass | mean radius | "
          "AUROC rejection: lower / U / entropy / 1-max p | AUROC disagreement: lower / U / entropy / 1-max p |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, label in RUNS:
        path = os.path.join(folder, f"{name}.metrics.json")
        if name == "init":  # python -m pipelines.train_device --eval-only runs/table7/init_l2.safetensors ...
            path = os.path.join(folder, "init.eval.json")
        if not os.path.exists(path):
            print(f"| {label} | not run | | | | | | | |")
            continue
        h = json.load(open(path))
        h = h["history"][-1] if "history" in h else dict(h, step=0)
        rej, dis = h["auroc_rejection"], h["auroc_disagreement"]
        print(f"| {label} | {h['step']} | {h['val_kl_guided']:.3f} | {h['val_tv_guided']:.3f} | "
              f"{h['top1_agreement']:.3f} | {h['box_coverage_of_cloud_mass']:.3f} | {h['radius_mean']:.2f} | "
              f"{rej['lower']:.3f} / {rej['interval']:.3f} / {rej['entropy']:.3f} / {rej['softmax']:.3f} | "
              f"{dis['lower']:.3f} / {dis['interval']:.3f} / {dis['entropy']:.3f} / {dis['softmax']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/table7")
