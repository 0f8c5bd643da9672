#!/usr/bin/env bash
# Train (or resume) ground-truth models on the GPU machine, several runs side by side on one GPU
# (a 7M-parameter model leaves most of an H200 idle: two runs side by side each kept ~90 % of
# their solo speed in session 3). Each run stops after TRAIN_S seconds of training (checkpoint +
# export, even if short of its steps); its export comes back as one tarball in $OUT, its log as
# $OUT/NAME.log, followed by weights.groundtruth.needle_attention's look at its attention heads
# (NEEDLE_ATTENTION=0 skips it), and with PROBES > 0 held-out probes (PROBES per kind of PROBE_KINDS,
# on each of PROBE_SEEDS, PROBE_PARALLEL seeds at a time, default 1: 18 processes side by side spent
# a whole call compiling in session 12; default: all kinds, the standard seed) are evaluated on the
# GPU afterwards, in fp32 at full matmul
# precision, and so are the exports named in BASELINES (their logs: $OUT/baseline-PATH.log, the
# path's slashes as dashes). With no run specs (TRAIN_S 0) the call only evaluates BASELINES.
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
left() {  # seconds left before CALL_LIMIT_S, at least 1 (`timeout 0` would mean no limit at all)
  local s=$((limit - SECONDS)); echo $((s > 0 ? s : 1))
}
run() {  # name extra-args (one string, word-split)
  local name=$1 extra=$2
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" python3 -m weights.groundtruth.train --out "runs/$name" --ckpt-every 200 \
    --time-limit "$train_s" --probes 0 ${TRAIN_ARGS:-} $extra >> "$OUT/$name.log" 2>&1
  if [ -f "runs/$name/export/model.safetensors" ]; then
    tar czf "$OUT/$name-export.tgz" -C "runs/$name" export  # one file: $OUT returns a few files only
    # where the attention heads look on short needles (weights/groundtruth/needle_attention.py)
    [ "${NEEDLE_ATTENTION:-1}" = 0 ] ||
      timeout -k 10 "$(left)" python3 -m weights.groundtruth.needle_attention "runs/$name/export" >> "$OUT/$name.log" 2>&1
    probe "runs/$name/export" >> "$OUT/$name.log" 2>&1
  fi
}
probe() {  # export dir: PROBES per kind on each of PROBE_SEEDS (a process each), on the GPU in fp32 at full precision
  [ "$probes" -gt 0 ] || return 0
  local seed n=0
  for seed in ${PROBE_SEEDS:-standard}; do
    if [ "$n" -ge "${PROBE_PARALLEL:-1}" ]; then wait -n; n=$((n - 1)); fi
    n=$((n + 1))
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 10 "$(left)" python3 -c "
import json, sys, time
from weights.groundtruth import tasks
from weights.groundtruth.evaluate import evaluate
seed = tasks.PROBE_SEED if sys.argv[3] == 'standard' else int(sys.argv[3])
misses, t0 = [], time.time()
r = evaluate(sys.argv[1], $probes, mode='pieces', seed=seed, misses=misses, kinds=tuple(sys.argv[2].split()))
print(json.dumps({'export': sys.argv[1], 'seed': seed, 'eval': r, 'wall_s': round(time.time() - t0), 'misses': misses}), flush=True)
" "$1" "${PROBE_KINDS:-arithmetic needle recall}" "$seed" &
  done
  wait
}
log_name() { echo "baseline-$(echo "$1" | tr / -).log"; }
for spec in "$@"; do
  run "${spec%%=*}" "${spec#*=}" &
done
for dir in ${BASELINES:-}; do  # exports to score beside the runs (the model they start from)
  probe "$dir" > "$OUT/$(log_name "$dir")" 2>&1 &
done
wait
[ "${KEEP_CACHE:-0}" = 1 ] && [ -d runs/jax_cache ] && tar czf "$OUT/jax-cache.tgz" -C runs jax_cache
for spec in "$@"; do
  n=${spec%%=*}
  echo "== $n"; grep 'step .*/' "$OUT/$n.log" | tail -n 14 | cut -c1-200
  grep -h '"eval"\|"train"\|"profile"\|"first_token_right"\|Error' "$OUT/$n.log" | cut -c1-600
done
for dir in ${BASELINES:-}; do
  echo "== baseline $dir"; grep -h '"eval"\|Error' "$OUT/$(log_name "$dir")" | cut -c1-400
done
