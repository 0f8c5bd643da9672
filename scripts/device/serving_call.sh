#!/usr/bin/env bash
# One device call for serving speed (issue: real-size hybrid MoE): the random 6 B qwen3_5_moe
# checkpoint (written once per warm machine into runs/e2e-ck), then the parts named in $PARTS:
#   check    benchmarks/gpu_check.py --suites $CHECK_SUITES (default decode,paged_attention), run while
#            the checkpoint is written
#   hammer   benchmarks/engine_hammer.py (2 rounds) with --kernels $HAMMER_KERNELS, beside the check part; in fp32 at
#            matmul precision highest unless HAMMER_BF16=1 (there a hit must equal its cold answer exactly)
#   kernels  benchmarks/kernels.py --only $KERNEL_SUITES (e.g. gdn_fused,kda_fused) beside fla (--peer-budget
#            $PEER_S, default 90 s), after the check part (a variant the check failed is not timed)
#   moe      the MoE kernel's GPU check and timings (pallas_kernels/moe.py)
#   decode   in-process decode tok/s (sync vs overlapped loop) and a per-kernel breakdown, each kernel
#            named by its JAX ops (benchmarks/decode_profile.py; the programs' HLO in $OUT/decode-hlo.tgz), with $KERNELS (default auto) at $BATCHES (default 1,32);
#            (BATCHES= for none) and the cold prefill steps of $PREFILL_LENS (e.g. 512,2048) first, for every setting of
#            $KERNELS (';'-separated); more flags in $DECODE_ARGS (e.g. --no-scan-layers, --compile-all: the server's
#            ahead-of-time executables);
#            it gets the call's time left (CALL_LIMIT, default 590 s) less $E2E_RESERVE
#   linear   the decode-step dense projections' timings (pallas_kernels/linear_small.py vs XLA's dot; checked by
#            the check part when CHECK_SUITES names linear)
#   memory   decode-step temporaries with every kernel vs jnp (benchmarks/step_memory.py, 4 layers, pools
#            large enough that a copy of one would show: a kernel that copies a pool is >0.5 GiB above jnp)
#   sim      the simulator's GPU cost model and its validation (jaxserve sim validate: calibrate, then a generated
#            shared-prompts trace of $SIM_N requests at $SIM_RATE a second through the engine and the simulator, one
#            engine build), engine flags in $SIM_ARGS; results $OUT/sim-validation.json (cost model, requests, the
#            real run's steps), $OUT/sim-samples.json (the calibration's steps); give it CALL_LIMIT >= 450 on a cold machine
#   load     the checkpoint's load time, weights.load_model against the host layout it replaced
#            (benchmarks/load_time.py; $OUT/load.json)
#   store    the program store on this GPU (benchmarks/program_store_check.py, the default model: fresh compile,
#            JAX's cache, the store; and again with --reserialize: do cache-loaded executables store whole here?)
#   e2e      jaxserve serve + jaxserve bench rows (benchmarks/e2e.py), serve flags in $SERVE_ARGS
# Needs the HTTP wheels for e2e: ../shared/tools/device-wheels.sh httpx httpcore h11 certifi idna; carry .whl.
#   PARTS=moe,decode bash scripts/device/serving_call.sh
# Everything the parts write lands in a work folder, packed at exit into one file, $OUT/${CALL_NAME:-call}.tgz:
# the device tool returns only a few files of $OUT, and a run's logs and records are many (CALL_NAME: several
# runs of this script in one device call, e.g. under other XLA_FLAGS, each their own file).
set -u
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $(( ${CALL_LIMIT:-590} - ($(date +%s) - start) )); }  # seconds left of the device call
RETURN_DIR=$OUT
OUT=$(mktemp -d /tmp/serving-call.XXXXXX)
export OUT
mkdir -p "$RETURN_DIR"
pack=${CALL_NAME:-call}.tgz
trap 'tar czf "$RETURN_DIR/$pack" -C "$OUT" . && echo "packed $(ls "$OUT" | wc -l) files into $pack"' EXIT
parts=",${PARTS:-moe,decode,e2e},"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
if [[ $parts == *,check,* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${CHECK_TIMEOUT:-200} python3 benchmarks/gpu_check.py --suites "${CHECK_SUITES:-decode,paged_attention}" \
    --out "$OUT" > "$OUT/gpu_check.log" 2>&1 &
fi
if [[ $parts == *,hammer,* ]]; then
  hp=(--dtype float32 --precision highest); [ "${HAMMER_BF16:-0}" = 1 ] && hp=()
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${HAMMER_TIMEOUT:-200} python3 benchmarks/engine_hammer.py \
    --out "$OUT/hammer.json" --rounds 2 --time-budget $(( ${HAMMER_TIMEOUT:-200} - 70 )) "${hp[@]}" \
    --kernels "$HAMMER_KERNELS" > "$OUT/hammer.log" 2>&1 &
fi
if [[ $parts == *,decode,* || $parts == *,e2e,* || $parts == *,sim,* || $parts == *,load,* ]] \
    && [ ! -f runs/e2e-ck/model.safetensors ]; then
  t0=$(date +%s)
  python3 -m weights.random_checkpoint --config benchmarks/configs/qwen3_5_moe-6b.json --out runs/e2e-ck
  echo "checkpoint written in $(( $(date +%s) - t0 ))s"
fi
if [[ $parts == *,check,* ]]; then
  wait; echo "gpu check done at $(( $(date +%s) - start ))s"; grep -c '"ok": true' "$OUT/gpu_check.jsonl"
  grep '"ok": false' "$OUT/gpu_check.jsonl" | cut -c1-300; tail -3 "$OUT/gpu_check.log"
  if grep -q '"variant": "moe_small' "$OUT/gpu_check.jsonl" \
      && ! grep '"variant": "moe_small' "$OUT/gpu_check.jsonl" | grep -q '"ok": false'; then
    # the MoE small path (off by default until checked) passed its check: the rest of this call serves with it
    sed -i 's/^SMALL_PATH_ON = .*/SMALL_PATH_ON = True/' pallas_kernels/moe.py; echo "moe small path ON for this call"
  fi
fi
if [[ $parts == *,hammer,* ]]; then
  wait; echo "hammer done at $(( $(date +%s) - start ))s"; tail -6 "$OUT/hammer.log" | cut -c1-400
fi
if [[ $parts == *,kernels,* ]]; then
  timeout ${KERNELS_TIMEOUT:-200} python3 benchmarks/kernels.py --only "$KERNEL_SUITES" --out "$OUT" \
    --peer-budget ${PEER_S:-90} > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; grep "^|" "$OUT/kernels.log" | tail -12 | cut -c1-400
fi
if [[ $parts == *,moe,* ]]; then
  if [[ $parts != *,check,* || ${CHECK_SUITES:-} != *moe* ]]; then  # else the check part ran it
    timeout 120 python3 benchmarks/gpu_check.py --suites moe --out "$OUT" > "$OUT/moe_check.log" 2>&1
    echo "moe check rc=$?"; grep -i "pass\|fail\|error" "$OUT/moe_check.log" | tail -12
  fi
  timeout ${MOE_TIME_TIMEOUT:-150} python3 benchmarks/kernels.py --only moe --no-peer --out "$OUT" > "$OUT/moe_time.log" 2>&1
  echo "moe timing rc=$?"; tail -12 "$OUT/moe_time.log"
fi
if [[ $parts == *,linear,* ]]; then
  timeout ${LINEAR_TIME_TIMEOUT:-120} python3 benchmarks/kernels.py --only linear --no-peer --out "$OUT" > "$OUT/linear_time.log" 2>&1
  echo "linear timing rc=$?"; grep "| linear_small" "$OUT/linear_time.log" | cut -d'|' -f5-10,12-13
fi
if [[ $parts == *,memory,* ]]; then
  for k in auto jnp; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 benchmarks/step_memory.py --layers 4 --kinds decode \
      --max-seqs 2 --kv-tokens 1048576 --slots 301 --kernels $k --label $k --json "$OUT/decode-memory-$k.json" \
      > "$OUT/memory-$k.log" 2>&1 &
  done
  wait; for k in auto jnp; do echo "== decode memory, kernels $k"; grep "^\[" "$OUT/memory-$k.log"; done
fi
if [[ $parts == *,load,* ]]; then
  timeout ${LOAD_TIMEOUT:-200} python3 benchmarks/load_time.py --ckpt runs/e2e-ck --out "$OUT/load.json" > "$OUT/load.log" 2>&1
  echo "load rc=$?"; tail -3 "$OUT/load.log"
fi
if [[ $parts == *,decode,* ]]; then
  timeout ${DECODE_TIMEOUT:-$(( $(left) - ${E2E_RESERVE:-0} ))} python3 benchmarks/decode_profile.py --batches "${BATCHES-1,32}" \
    --kernels "${KERNELS:-auto}" --prefill-lens "${PREFILL_LENS:-}" ${DECODE_ARGS:-} --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; grep -v "^\s*$" "$OUT/decode.log" | tail -14 | cut -c1-600
  (cd "$OUT" && ls decode-*.hlo.txt >/dev/null 2>&1 && tar czf decode-hlo.tgz decode-*.hlo.txt && rm decode-*.hlo.txt)
fi
if [[ $parts == *,sim,* ]]; then
  python3 -m jaxserve.cli sim gen shared-prompts --n ${SIM_N:-150} --rate ${SIM_RATE:-5} --seed 1 --out "$OUT/sim-trace.jsonl"
  # one engine build: validate calibrates the cost model first (its steps into sim-samples.json), then replays the
  # trace through the engine and the simulator; the fitted model is the result's cost_model
  # shellcheck disable=SC2086
  timeout $(left) python3 -m jaxserve.cli sim validate --model runs/e2e-ck --compile-cache /tmp/jax-cache \
    --trace "$OUT/sim-trace.jsonl" --samples "$OUT/sim-samples.json" --out "$OUT/sim-validation.json" ${SIM_ARGS:-} \
    > "$OUT/sim-validate.log" 2>&1
  echo "sim validate rc=$?"; tr '\r' '\n' < "$OUT/sim-validate.log" | grep -a "step programs in\|calibrated" | cut -c1-300
  tail -12 "$OUT/sim-validate.log" | cut -c1-400
fi
if [[ $parts == *,store,* ]]; then
  for flag in "" --reserialize; do
    timeout 300 python3 benchmarks/program_store_check.py $flag --out "$OUT/store${flag:+-reserialize}.json" \
      > "$OUT/store${flag}.log" 2>&1
    echo "store check ${flag:-plain} rc=$?"; tail -4 "$OUT/store${flag}.log" | cut -c1-300
  done
fi
if [[ $parts == *,e2e,* ]]; then
  # shellcheck disable=SC2086
  timeout $(left) python3 benchmarks/e2e.py --out "$OUT/e2e.json" ${E2E_ARGS:-} -- ${SERVE_ARGS:-} > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; grep "^\[e2e" "$OUT/e2e.log" | tail -14 | cut -c1-400
fi
