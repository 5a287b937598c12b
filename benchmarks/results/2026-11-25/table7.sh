#!/usr/bin/env bash
# Table 7: the device objectives side by side on the same on-policy data, from the same start, for the same steps.
# coverage (ours: KL(guided) + coverage of the guided box) against the paper's Inter-DRO (KL + its four terms),
# and Inter-DRO with each term ablated. Every run: the 2-layer device of commit 6c9d61d as the start, 300 steps x 32
# sequences, lr 1e-3 cosine (30 warm-up), seed 3, 4,000 on-policy train sequences (data seed 3), 256 val sequences
# evaluated under the deployed CFG. Resumable: re-running the script skips finished runs and resumes a cut one.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=runs/table7
mkdir -p "$OUT"
[ -f "$OUT/init_l2.safetensors" ] || git show 6c9d61d:weights/scenes-v2/device_l2.safetensors > "$OUT/init_l2.safetensors"
$PY -m pipelines.onpolicy --split val --n 512 --seed 3 --threads 2
$PY -m pipelines.onpolicy --split train --n 4000 --seed 3 --threads 2
run() {  # name, then objective arguments
  local name=$1; shift
  [ -f "$OUT/$name.metrics.json" ] && return 0
  $PY -m pipelines.train_device --weights weights/scenes-v2 --out "$OUT" --name "$name" --init "$OUT/init_l2.safetensors" \
      --n-layer 2 --steps 300 --batch-size 32 --warmup 30 --seed 3 --num-train 4000 --data-dir data_cache/scenes-v2-s3 \
      --ckpt-dir "$OUT/ckpt-$name" --eval-every 150 --threads 2 "$@"
}
run coverage --objective coverage
run inter_dro --objective inter-dro
for term in anchor lower center upper; do
  run "inter_dro_no_$term" --objective inter-dro --ablate "$term"
done
