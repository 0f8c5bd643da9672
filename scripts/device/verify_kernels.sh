#!/usr/bin/env bash
# First device call of a session with kernel changes: the GPU check of every kernel at model
# shapes, then the seed's hammer through the engine with the kernels wired in: fp32 at highest
# precision with the GDN kernels (hit must equal cold exactly; the attention kernel takes bf16/fp16
# only) and bf16 with every kernel (--kernels pallas). A kernel joins jaxserve/models/backends.AUTO_ON_GPU
# (the default path) only after both pass. Then run benchmarks/kernels.py for the speed table. Needs the fla wheels
# carried for the peers (../shared/tools/device-wheels.sh says how); without them peers are skipped.
#   bash scripts/device/verify_kernels.sh [SUITES]     (default decode,paged_attention,chunked)
set -u
suites=${1:-decode,paged_attention,chunked}
mkdir -p "$OUT"
[ -d .whl ] && pip install -q --no-deps .whl/*.whl >> "$OUT/pip.log" 2>&1
timeout 200 python3 benchmarks/gpu_check.py --out "$OUT" --suites "$suites" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?"; tail -5 "$OUT/gpu_check.log"
timeout 150 python3 benchmarks/engine_hammer.py --out "$OUT/hammer-kernels-fp32.json" --rounds 2 --time-budget 90 \
  --dtype float32 --precision highest --kernels gdn_prefill,gdn_decode > "$OUT/hammer-fp32.log" 2>&1
echo "hammer fp32 rc=$?"; tail -4 "$OUT/hammer-fp32.log"
timeout 150 python3 benchmarks/engine_hammer.py --out "$OUT/hammer-kernels-bf16.json" --rounds 2 --time-budget 90 \
  --kernels pallas > "$OUT/hammer-bf16.log" 2>&1
echo "hammer bf16 rc=$?"; tail -4 "$OUT/hammer-bf16.log"
