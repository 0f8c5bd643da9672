#!/usr/bin/env bash
# Train (or resume) the ground-truth models on the GPU machine, dense and MoE side by side on one
# GPU; each run stops after TRAIN_S seconds of training (checkpoint + export, even if short of its
# steps), then its export comes back as one tarball in $OUT and held-out probes are evaluated.
# Rerun on the same (still warm) machine with the same STEPS to continue from the checkpoints; a
# fresh machine starts over, so size TRAIN_S to the call and keep the exports that come back.
#   bash scripts/device/train_groundtruth.sh DENSE_STEPS MOE_STEPS PROBES TRAIN_S CALL_LIMIT_S
# PROBES 0 skips the evaluation. Extra train.py arguments: both runs $TRAIN_ARGS, one run
# $DENSE_ARGS / $MOE_ARGS (e.g. MOE_ARGS="--init-from weights/moe" to continue from a committed
# export on a fresh machine); logs go to $LOG_DIR (default $OUT), exports to $OUT.
set -u
dense_steps=${1:-12000}; moe_steps=${2:-12000}; probes=${3:-40}; train_s=${4:-420}; limit=${5:-570}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
log_dir=${LOG_DIR:-$OUT}
mkdir -p runs "$OUT" "$log_dir"
run() {  # name steps extra-args...
  local name=$1 steps=$2; shift 2
  timeout "$limit" python3 -m weights.groundtruth.train --out "runs/$name" --steps "$steps" --ckpt-every 200 \
    --time-limit "$train_s" --probes 0 ${TRAIN_ARGS:-} "$@" >> "$log_dir/$name.log" 2>&1
  if [ -f "runs/$name/export/model.safetensors" ]; then
    tar czf "$OUT/$name-export.tgz" -C "runs/$name" export  # one file: $OUT returns a few files only
    [ "$probes" -gt 0 ] || return 0
    timeout $((limit - SECONDS)) python3 -c "
import json
from weights.groundtruth.train import evaluate
print(json.dumps({'eval': evaluate('runs/$name/export', $probes, mode='pieces')}), flush=True)
" >> "$log_dir/$name.log" 2>&1
  fi
}
run dense "$dense_steps" ${DENSE_ARGS:-} &
run moe "$moe_steps" --moe ${MOE_ARGS:-} &
wait
grep -h '"eval"\|"train"' "$log_dir"/*.log | cut -c1-600
