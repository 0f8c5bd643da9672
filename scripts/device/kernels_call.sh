#!/usr/bin/env bash
# One device call for the kernels (issue 6) when the decode suite already passed the GPU check
# (its rows in benchmarks/results/gpu-check-h200.jsonl): phase A checks the other kernels
# and runs the engine hammer with kernels wired in (fp32 GDN kernels, hit must equal cold exactly;
# bf16 with every kernel), side by side (correctness only); phase B times every suite on a quiet
# GPU. Everything lands in $W, tarred into $OUT/kernels-call.tgz (one file: $OUT returns few).
#   [CHECK_SUITES=paged_attention,chunked,conv1d] [SUITES=decode,paged_attention,chunked,conv1d] [PEER_S=200] \
#     bash scripts/device/kernels_call.sh [PHASE_A_S] [PHASE_B_S]
# (fla compiles its varlen chunk kernels slowly: its child process gets up to PEER_S seconds per suite)
set -u
a_s=${1:-220}; b_s=${2:-300}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
W=runs/kernels-call; mkdir -p "$W/check" "$OUT"
export KERNELS_HLO_DIR=$W/hlo  # the chunked suite writes its compiled HLO there (fusion names -> ops)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl > "$W/pip.log" 2>&1
  export PYTHONPATH=$HOME/site
fi
timeout "$a_s" python3 benchmarks/gpu_check.py --out "$W/check" --suites "${CHECK_SUITES:-paged_attention,chunked,conv1d}" > "$W/gpu_check.log" 2>&1 &
timeout "$a_s" python3 benchmarks/engine_hammer.py --out "$W/hammer-kernels-fp32.json" --rounds 2 \
  --time-budget $((a_s - 70)) --dtype float32 --precision highest --kernels gdn_prefill,gdn_decode > "$W/hammer-fp32.log" 2>&1 &
timeout "$a_s" python3 benchmarks/engine_hammer.py --out "$W/hammer-kernels-bf16.json" --rounds 2 \
  --time-budget $((a_s - 70)) --kernels pallas > "$W/hammer-bf16.log" 2>&1 &
wait
{ grep "\"kernel\": \"[a-z]*_decode\"" benchmarks/results/gpu-check-h200.jsonl; cat "$W/check/gpu_check.jsonl"; } > "$W/gpu_check.jsonl"
echo "phase A done at ${SECONDS}s"; grep -c '"ok": true' "$W/gpu_check.jsonl"; grep -c '"ok": false' "$W/gpu_check.jsonl"
timeout "$b_s" python3 benchmarks/kernels.py --only "${SUITES:-decode,paged_attention,chunked,conv1d}" --out "$W" --peer-budget "${PEER_S:-200}" \
  --time-budget $((b_s - 20)) > "$W/kernels.log" 2>&1
echo "phase B rc=$? at ${SECONDS}s"
tar czf "$OUT/kernels-call.tgz" -C runs kernels-call
tail -40 "$W/kernels.log"
