#!/usr/bin/env bash
# Train (or resume) the ground-truth models on the GPU machine, dense and MoE side by side on one
# GPU, then copy the exports to $OUT and evaluate held-out probes. Resumable: run it again on the
# same machine and both runs continue from their latest orbax checkpoint.
#   bash scripts/device/train_groundtruth.sh DENSE_STEPS MOE_STEPS PROBES TIME_LIMIT_S
set -u
dense_steps=${1:-4000}; moe_steps=${2:-3000}; probes=${3:-40}; limit=${4:-570}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p runs "$OUT"
run() {  # name steps extra-args...
  local name=$1 steps=$2; shift 2
  timeout "$limit" python3 -m weights.groundtruth.train --out "runs/$name" --steps "$steps" --ckpt-every 100 \
    --probes 0 "$@" >> "$OUT/$name.log" 2>&1
  if [ -f "runs/$name/export/model.safetensors" ]; then
    tar czf "$OUT/$name-export.tgz" -C "runs/$name" export  # one file: $OUT returns a few files only
    timeout $((limit - SECONDS)) python3 -c "
import json, sys
from weights.groundtruth.train import evaluate
print(json.dumps({'eval': evaluate('runs/$name/export', $probes, mode='pieces')}), flush=True)
" >> "$OUT/$name.log" 2>&1
  fi
}
run dense "$dense_steps" &
run moe "$moe_steps" --moe &
wait
grep -h '"eval"\|"train"' "$OUT"/*.log | cut -c1-600
