"""Run code in the torch reference environment from the engine's test process.

The engine runs on Python 3.12 with JAX; the torch reference (transformers, fla's naive ops) runs
in a separate Python 3.11 environment because the only CPU build of torch on these machines is
torch==2.13.0 for 3.11. Tests therefore talk to torch through a subprocess: they write inputs to
files, run a module of ``tests/reference`` under the torch interpreter, and read its outputs back.

The interpreter is ``$JAXSERVE_TORCH_PYTHON`` or ``<repo>/.venv-torch/bin/python`` (what
``.ci/run`` builds). A missing interpreter is an error, not a skip: CI must run these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def torch_python() -> str:
    path = os.environ.get("JAXSERVE_TORCH_PYTHON") or str(REPO_ROOT / ".venv-torch" / "bin" / "python")
    if not Path(path).exists():
        raise RuntimeError(
            f"torch reference interpreter not found at {path}; run `bash .ci/run` (or set "
            "JAXSERVE_TORCH_PYTHON) to build the Python 3.11 environment described in DEVELOPERS.md"
        )
    return path


def run_torch(module: str, *args: str, timeout: float = 900) -> str:
    """Run ``python -m <module> <args>`` in the torch environment from the repo root.

    Returns stdout; raises with the subprocess's stderr on failure so a broken reference reads
    as a clear test error rather than a mismatch.
    """
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [torch_python(), "-m", module, *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torch reference `{module} {' '.join(args)}` failed:\n{proc.stderr[-4000:]}")
    if proc.stderr:
        sys.stderr.write(proc.stderr[-2000:])
    return proc.stdout
