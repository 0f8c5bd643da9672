# Sourced by scripts/run.sh and scripts/test.sh: build (once) and locate the two environments.
#
#   .venv        Python 3.12, the engine: jax==0.11.2 and the package itself (editable).
#   .venv-torch  Python 3.11, the torch reference for tests: torch==2.13.0 (a CPU wheel on these
#                machines' local disk; anything else pulls GB of CUDA wheels), transformers,
#                einops, and fla's pure-Python sources WITHOUT triton (never install triton there:
#                transformers would then pick fla's GPU kernels and fail on the CPU).
#                transformers[serving] adds `transformers serve` (the probe's reference server).
#
# Each environment is rebuilt only when its recipe (this file, pyproject.toml) changes.
set -euo pipefail

JAXSERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PINS=(torch==2.13.0)
# [serving]: fastapi, uvicorn, openai, accelerate for `transformers serve` (tests/test_probe_reference.py).
REFERENCE_PINS=("transformers[serving]==5.24.0" einops safetensors numpy)
FLA_PINS=(flash-linear-attention==0.6.0 fla-core==0.6.0)

_find_python() {  # $1 = minor version, e.g. 3.12
  local v=$1 cand
  for cand in "${JAXSERVE_PYTHON_BIN:-}" "python$v" "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/$(ls "$(pyenv root)/versions" 2>/dev/null | grep "^$v" | sort -V | tail -1)/bin/python$v")"; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "jaxserve: no Python $v found (install it, or put python$v on PATH)" >&2
  return 1
}

_stamp() { cat "$JAXSERVE_ROOT/scripts/env.sh" "$JAXSERVE_ROOT/pyproject.toml" | sha256sum | cut -c1-16; }

# _ensure_env NAME PYTHON_MINOR INSTALL_FUNCTION: (re)build $JAXSERVE_ROOT/NAME when its recipe changed.
_ensure_env() {
  local venv="$JAXSERVE_ROOT/$1" stamp py
  stamp=$(_stamp)
  if [ -f "$venv/.jaxserve-stamp" ] && [ "$(cat "$venv/.jaxserve-stamp")" = "$stamp" ]; then return 0; fi
  py=$(_find_python "$2")
  echo "jaxserve: building $1 (Python $2) ..." >&2
  "$py" -m venv "$venv"
  "$3" "$venv/bin/pip"
  echo "$stamp" > "$venv/.jaxserve-stamp"
}

_install_engine() {
  "$1" install -q --disable-pip-version-check -e "$JAXSERVE_ROOT[test,server,train]"
}

_install_torch_reference() {
  "$1" install -q --disable-pip-version-check "${TORCH_PINS[@]}"
  "$1" install -q --disable-pip-version-check "${TORCH_PINS[@]}" "${REFERENCE_PINS[@]}"
  "$1" install -q --disable-pip-version-check --no-deps "${FLA_PINS[@]}"
  if "$(dirname "$1")/python" -c "import triton" 2>/dev/null; then
    echo "jaxserve: triton is installed in .venv-torch; remove it (transformers would pick GPU kernels)" >&2
    return 1
  fi
}

ensure_engine_env() { _ensure_env .venv 3.12 _install_engine; }
ensure_torch_env() { _ensure_env .venv-torch 3.11 _install_torch_reference; }
