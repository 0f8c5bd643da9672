#!/usr/bin/env bash
# One device call for serving speed (issue: real-size hybrid MoE): the random 6 B qwen3_5_moe
# checkpoint (written once per warm machine into runs/e2e-ck), then the parts named in $PARTS:
#   moe      the MoE kernel's GPU check and timings (pallas_kernels/moe.py)
#   decode   in-process decode tok/s (sync vs overlapped loop) and a per-kernel breakdown
#            (benchmarks/decode_profile.py), with $KERNELS (default auto)
#   e2e      jaxserve serve + jaxserve bench rows (benchmarks/e2e.py), serve flags in $SERVE_ARGS
# Needs the HTTP wheels for e2e: ../shared/tools/device-wheels.sh httpx httpcore h11 certifi idna; carry .whl.
#   PARTS=moe,decode bash scripts/device/serving_call.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
parts=",${PARTS:-moe,decode,e2e},"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
if [ ! -f runs/e2e-ck/model.safetensors ]; then
  t0=$(date +%s)
  python3 -m weights.random_checkpoint --config benchmarks/configs/qwen3_5_moe-6b.json --out runs/e2e-ck
  echo "checkpoint written in $(( $(date +%s) - t0 ))s"
fi
if [[ $parts == *,moe,* ]]; then
  timeout 120 python3 benchmarks/gpu_check.py --suites moe --out "$OUT" > "$OUT/moe_check.log" 2>&1
  echo "moe check rc=$?"; grep -i "pass\|fail\|error" "$OUT/moe_check.log" | tail -12
  timeout 150 python3 benchmarks/kernels.py --only moe --no-peer --out "$OUT" > "$OUT/moe_time.log" 2>&1
  echo "moe timing rc=$?"; tail -12 "$OUT/moe_time.log"
fi
if [[ $parts == *,decode,* ]]; then
  timeout ${DECODE_TIMEOUT:-330} python3 benchmarks/decode_profile.py --kernels "${KERNELS:-auto}" --out "$OUT/decode.json" \
    > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; grep -v "^\s*$" "$OUT/decode.log" | tail -14 | cut -c1-600
fi
if [[ $parts == *,e2e,* ]]; then
  # shellcheck disable=SC2086
  timeout 500 python3 benchmarks/e2e.py --out "$OUT/e2e.json" ${E2E_ARGS:-} -- ${SERVE_ARGS:-} > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; grep "^\[e2e" "$OUT/e2e.log" | tail -14 | cut -c1-400
fi
