#!/usr/bin/env bash
# Build what the tests need (once) and run them: bash scripts/test.sh [pytest args]
#
# With no arguments, the tests that run Pallas Mosaic GPU kernels in GPU interpret mode each get a
# pytest process of their own, after the rest of the suite: in one long process the fresh-clone CI
# hit XLA CPU segfaults while compiling (twice, in unrelated jnp tests after the interpret-mode
# kernel tests; never reproduced in a short process), so interpreter state is kept out of the other
# tests. With arguments, one pytest run with those arguments.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_engine_env
ensure_torch_env
cd "$JAXSERVE_ROOT"
export JAXSERVE_TORCH_PYTHON="$JAXSERVE_ROOT/.venv-torch/bin/python"
py="$JAXSERVE_ROOT/.venv/bin/python"
if [ $# -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi
interpreted=(tests/pallas_kernels/test_gdn_chunked.py tests/pallas_kernels/test_gdn_decode.py
             tests/pallas_kernels/test_paged_attention.py)
rc=0
"$py" -m pytest -p no:cacheprovider tests "${interpreted[@]/#/--ignore=}" -k "not kernel-gdn_decode" || rc=$?
for f in "${interpreted[@]}"; do
  "$py" -m pytest -p no:cacheprovider "$f" || rc=$?
done
"$py" -m pytest -p no:cacheprovider tests/engine/test_runner.py -k "kernel-gdn_decode" || rc=$?
exit $rc
