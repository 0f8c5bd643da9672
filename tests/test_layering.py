"""Imports point down (ARCHITECTURE.md, "Imports point down"), checked on the source.

Every ``.py`` file of ``jaxserve/``, ``server/``, ``weights/`` and ``pallas_kernels/`` is parsed (not
imported) and each import is attributed to a *unit*, a row of ARCHITECTURE.md's map. ``ALLOWED``
says which units each unit may import; it must itself be acyclic (a layering), and every import in
the tree must be one of its edges. On top of that:

- the host-side bookkeeping (request, scheduler, policy, the radix cache, ``SamplingParams``) reaches
  no JAX and no model code through its module-level imports (the request type must not pull in the
  models, and the simulator runs the real scheduler without them);
- ``jaxserve.cli`` imports the optional server only inside its command functions.

``EXCEPTIONS`` lists the back edges ARCHITECTURE.md still admits; each must still exist, so the list
shrinks when one is removed.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "server", "weights", "pallas_kernels")

# Module prefix -> unit; the longest matching prefix wins ("jaxserve" matches only the package itself,
# so a new module must be placed in the table).
UNITS = {
    "jaxserve": "jaxserve",  # the package's own __init__
    "jaxserve.sampling_params": "sampling_params",
    "jaxserve.config": "config",
    "jaxserve.tokenizer": "tokenizer",
    "jaxserve.sampler": "sampler",
    "jaxserve.profiling": "profiling",
    "jaxserve.multimodal": "multimodal",
    "jaxserve.cache": "cache",
    "pallas_kernels": "kernels",
    "jaxserve.models": "models",
    "jaxserve.parallel": "parallel",
    "jaxserve.parallel.layout": "layout",
    "weights": "weights",
    "weights.groundtruth": "groundtruth",
    "jaxserve.generate": "generate",
    "jaxserve.engine": "engine",
    "jaxserve.engine.llm": "assembly",
    "jaxserve.engine.flags": "assembly",  # the engine's command-line flags -> EngineArgs
    "server": "server",
    "jaxserve.probe": "probe",
    "jaxserve.bench": "bench",
    "jaxserve.sim": "sim",
    "jaxserve.cli": "cli",
    "jaxserve.replicas": "cli",  # `jaxserve serve-replicas`: a command that reuses serve's parser
}

BOTTOM = {"sampling_params", "config", "tokenizer", "sampler", "profiling"}

# unit -> the units it may import (besides itself and the empty ``jaxserve`` package), bottom up.
ALLOWED: dict[str, set[str]] = {
    "jaxserve": set(),
    **{unit: set() for unit in BOTTOM},
    "multimodal": {"config"},
    "cache": {"config"},
    "kernels": {"config"},
    "layout": set(),  # parallel/layout.py: the sharding arithmetic the models use
    "models": {"kernels", "layout", "config", "multimodal", "profiling"},
    "parallel": {"models", "layout", "config"},  # parallel/tensor.py: a mesh that splits the models
    "weights": {"models", "parallel", "layout", "config", "tokenizer"},  # checkpoints -> the models' params
    "generate": {"models", "sampler", "sampling_params", "config"},  # the reference path, no engine
    "engine": {"cache", "models", "parallel", "multimodal", "sampler", "sampling_params", "tokenizer", "config",
               "profiling"},
    "assembly": {"engine", "weights", "cache", "models", "parallel", "multimodal", "sampling_params", "tokenizer",
                 "config"},  # engine/llm.py: a checkpoint folder -> a wired engine
    "server": {"engine", "assembly", "multimodal", "sampling_params", "tokenizer", "config"},
    "probe": {"groundtruth"},
    "bench": set(),
    "sim": {"engine", "assembly", "cache", "bench", "sampling_params", "config"},
    "groundtruth": {"weights", "generate", "models", "kernels", "sampling_params", "tokenizer", "config",
                    "profiling"},
}
ALLOWED["cli"] = set(ALLOWED) - {"cli"}  # the top: every command may reach anything below it

# Back edges ARCHITECTURE.md admits, to remove rather than copy: (importing module, imported module).
EXCEPTIONS: set[tuple[str, str]] = set()

# Module-level imports of these may reach no module under HEAVY.
HOST_ONLY = ("jaxserve.sampling_params", "jaxserve.engine.request", "jaxserve.engine.scheduler",
             "jaxserve.engine.policy", "jaxserve.cache")
HEAVY = ("jax", "jaxlib", "numpy", "jaxserve.models", "pallas_kernels", "weights")


class Import(NamedTuple):
    importer: str
    target: str
    lazy: bool  # inside a function (runs when called, not when the module is imported)
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    best = None
    for prefix in UNITS:
        within = module == prefix or (prefix != "jaxserve" and module.startswith(prefix + "."))
        if within and (best is None or len(prefix) > len(best)):
            best = prefix
    return UNITS[best] if best else None


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, importer: str, is_package: bool, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _resolve(importer, is_package, node)
    # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _walk(nodes, lazy: bool = False):
    """(node, lazy) for every import among ``nodes`` and below; ``lazy`` once inside a function.
    ``if TYPE_CHECKING:`` bodies are skipped: they never run."""
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _walk(node.orelse, lazy)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        yield from _walk(ast.iter_child_nodes(node),
                         lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def scan(root: Path = ROOT) -> list[Import]:
    files = {p: module_name(p) for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    modules = set(files.values())
    out = []
    for path, mod in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, lazy in _walk(tree.body):
            for target in _targets(node, mod, path.name == "__init__.py", modules):
                out.append(Import(mod, target, lazy, node.lineno))
    return out


IMPORTS = scan()


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def test_every_module_has_a_unit_and_every_unit_a_row():
    homeless = sorted({i.importer for i in IMPORTS if unit_of(i.importer) is None})
    assert not homeless, f"modules without a unit (add them to UNITS): {homeless}"
    assert set(UNITS.values()) == set(ALLOWED)
    assert all(unit_of(i.target) is not None for i in IMPORTS if _ours(i.target)), "a module outside UNITS"


def test_the_allowed_table_is_a_layering():
    """The table has no cycle: a topological order of the units exists."""
    order, done = [], set()
    pending = dict(ALLOWED)
    while pending:
        ready = [u for u, deps in pending.items() if deps - {u} <= done]
        assert ready, f"ALLOWED has a cycle among {sorted(pending)}"
        for u in sorted(ready):
            order.append(u)
            done.add(u)
            del pending[u]
    assert order.index("sampling_params") < order.index("engine") < order.index("assembly") < order.index("cli")


def test_imports_point_down():
    bad = []
    for imp in IMPORTS:
        if not _ours(imp.target) or (imp.importer, imp.target) in EXCEPTIONS:
            continue
        src, dst = unit_of(imp.importer), unit_of(imp.target)
        if dst not in ALLOWED[src] | {src, "jaxserve"}:
            bad.append(f"{imp.importer}:{imp.line} ({src}) imports {imp.target} ({dst})")
    assert not bad, "imports against ARCHITECTURE.md's map:\n" + "\n".join(bad)


def test_no_module_import_cycles():
    """No cycle among modules through module-level imports (a lazy import breaks none at import time)."""
    graph = defaultdict(set)
    for imp in IMPORTS:
        if _ours(imp.target) and not imp.lazy and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_exceptions_still_exist():
    edges = {(i.importer, i.target) for i in IMPORTS}
    assert EXCEPTIONS <= edges, f"removed, so drop from EXCEPTIONS (and ARCHITECTURE.md): {EXCEPTIONS - edges}"


def _closure(start: str) -> set[str]:
    """Modules reached from ``start`` through module-level imports (packages' __init__ included)."""
    graph = defaultdict(set)
    for imp in IMPORTS:
        if not imp.lazy:
            graph[imp.importer].add(imp.target)
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:k]) for k in range(1, len(parts))]  # a module imports its parents
        todo += graph[mod]
    return seen


@pytest.mark.parametrize("module", HOST_ONLY)
def test_host_side_imports_no_jax_or_models(module):
    heavy = sorted(m for m in _closure(module) if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"{module} reaches {heavy} at import time"


def test_cli_imports_the_server_only_inside_commands():
    eager = [i for i in IMPORTS if i.importer == "jaxserve.cli" and unit_of(i.target) == "server" and not i.lazy]
    assert not eager, eager


def test_engine_core_never_imports_weights_or_the_tools():
    """Only the assembly (engine/llm.py) loads checkpoints; probe, bench and sim sit on the engine."""
    bad = [i for i in IMPORTS if unit_of(i.importer) == "engine"
           and unit_of(i.target) in {"weights", "groundtruth", "probe", "bench", "sim", "server", "cli"}]
    assert not bad, bad
