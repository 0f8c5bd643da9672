#!/usr/bin/env bash
# Build what the tests need (once) and run them: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_engine_env
ensure_torch_env
cd "$JAXSERVE_ROOT"
export JAXSERVE_TORCH_PYTHON="$JAXSERVE_ROOT/.venv-torch/bin/python"
exec "$JAXSERVE_ROOT/.venv/bin/python" -m pytest "$@"
