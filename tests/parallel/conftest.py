"""Four host devices for the tensor-parallel tests, forced before JAX starts its CPU backend.

``--xla_force_host_platform_device_count`` is read once, when the backend starts, so this works
only in a pytest process where nothing has used a device yet: scripts/test.sh runs tests/parallel
as its own process. In a process that started JAX earlier with fewer devices the tests skip, saying so.
"""

import os

DEVICES = 4
# LLVM's optimisations off: these tests compile ~30 small programs and run each a few times, so
# compiling is most of their time (about a third less this way); every comparison runs both sides
# under the same flags.
_FLAGS = (f"--xla_force_host_platform_device_count={DEVICES}", "--xla_backend_optimization_level=0")
for _flag in _FLAGS:
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
