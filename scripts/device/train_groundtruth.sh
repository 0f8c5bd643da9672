#!/usr/bin/env bash
# Train (or resume) ground-truth models on the GPU machine, several runs side by side on one GPU
# (a 7M-parameter model leaves most of an H200 idle: two runs side by side each kept ~90 % of
# their solo speed in session 3). Each run stops after TRAIN_S seconds of training (checkpoint +
# export, even if short of its steps); its export comes back as one tarball in $OUT, its log as
# $OUT/NAME.log, followed by weights.groundtruth.needle_attention's look at its attention heads, and
# with PROBES > 0 held-out probes are evaluated on the GPU afterwards.
# Rerun on the same (still warm) machine with the same specs to continue from the checkpoints; a
# fresh machine starts over, so size TRAIN_S to the call and keep the exports that come back.
#   [PROBES=0] [TRAIN_ARGS=...] bash scripts/device/train_groundtruth.sh TRAIN_S CALL_LIMIT_S 'NAME=train.py args' ...
# e.g.  bash scripts/device/train_groundtruth.sh 480 570 'dense=--steps 3000 --init-from weights/default --seed 1' \
#         'moe=--steps 3000 --moe --init-from weights/moe --seed 1'
# TRAIN_ARGS go to every run (e.g. "--batch-tokens 65536 --data-workers 3"). Runs share the XLA
# compilation cache runs/jax_cache (same model shape: compiled once); KEEP_CACHE=1 also returns it as
# $OUT/jax-cache.tgz: unpack it into runs/ here and name runs/jax_cache in the next call's carry
# (a fresh machine otherwise spends 85-125 s of each run compiling).
set -u
train_s=${1:?TRAIN_S}; limit=${2:?CALL_LIMIT_S}; shift 2
probes=${PROBES:-0}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p runs "$OUT"
run() {  # name extra-args (one string, word-split)
  local name=$1 extra=$2
  # shellcheck disable=SC2086
  timeout "$limit" python3 -m weights.groundtruth.train --out "runs/$name" --ckpt-every 200 \
    --time-limit "$train_s" --probes 0 ${TRAIN_ARGS:-} $extra >> "$OUT/$name.log" 2>&1
  if [ -f "runs/$name/export/model.safetensors" ]; then
    tar czf "$OUT/$name-export.tgz" -C "runs/$name" export  # one file: $OUT returns a few files only
    # where the attention heads look on short needles (weights/groundtruth/needle_attention.py)
    timeout $((limit - SECONDS)) python3 -m weights.groundtruth.needle_attention "runs/$name/export" >> "$OUT/$name.log" 2>&1
    [ "$probes" -gt 0 ] || return 0
    timeout $((limit - SECONDS)) python3 -c "
import json
from weights.groundtruth.train import evaluate
print(json.dumps({'eval': evaluate('runs/$name/export', $probes, mode='pieces')}), flush=True)
" >> "$OUT/$name.log" 2>&1
  fi
}
for spec in "$@"; do
  run "${spec%%=*}" "${spec#*=}" &
done
wait
[ "${KEEP_CACHE:-0}" = 1 ] && [ -d runs/jax_cache ] && tar czf "$OUT/jax-cache.tgz" -C runs jax_cache
for spec in "$@"; do
  n=${spec%%=*}
  echo "== $n"; grep 'step .*/' "$OUT/$n.log" | tail -n 14 | cut -c1-200
  grep -h '"eval"\|"train"\|"profile"\|"first_token_right"\|Error' "$OUT/$n.log" | cut -c1-600
done
