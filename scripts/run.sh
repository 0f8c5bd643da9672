#!/usr/bin/env bash
# Build the engine environment (once) and run the jaxserve CLI: bash scripts/run.sh generate ...
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_engine_env
exec "$JAXSERVE_ROOT/.venv/bin/jaxserve" "$@"
