"""The floor plan holds: packages import only downward, no import cycles, no folder dominates.

Layers, lowest first. A package may import itself and the packages its row names, nothing
else of pdserve; `proto` (generated gRPC code) is importable by all. The router imports
nothing from the measuring toolkit, the engine nothing from the router or the workers.
Inside the engine, three floors: the kernels (C sources and their bindings) import nothing else
of the engine, the forward paths only the kernels, and the request loop sits on top, with the
scheduler below the forward paths. No engine or sizing module is over 400 lines, and the tests
import no `scripts.` module (what a test runs lives in a package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "sizing": {"protocol"},
    "kv_transfer": set(),
    "engine": {"protocol", "sizing"},
    "checkpoints": set(),
    "worker_runtime": {"protocol", "sizing", "engine"},
    "prefill_worker": {"protocol", "sizing", "engine", "worker_runtime", "kv_transfer"},
    "decode_worker": {"protocol", "sizing", "engine", "worker_runtime", "kv_transfer"},
    "worker_host": {"protocol", "sizing", "engine", "worker_runtime", "kv_transfer", "prefill_worker", "decode_worker"},
    "router": {"protocol", "sizing", "engine", "worker_runtime", "kv_transfer", "prefill_worker", "decode_worker",
               "worker_host", "checkpoints"},
    "client": set(),
    "bench": {"protocol", "sizing", "engine", "router", "client", "checkpoints"},
    "simulate": {"protocol", "sizing", "engine", "worker_runtime", "kv_transfer", "prefill_worker", "decode_worker",
                 "worker_host", "router", "bench"},
    "microbench": {"protocol", "sizing", "engine", "kv_transfer", "worker_runtime", "checkpoints", "router", "bench"},
    "stress": {"protocol", "sizing", "engine", "kv_transfer", "worker_runtime", "router", "client", "bench",
               "checkpoints"},
    "cli": {"protocol", "router", "client", "bench", "checkpoints", "simulate"},
}
PACKAGES = set(ALLOWED) | {"proto"}
MAX_SHARE = 0.35


def _modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports_any(path: Path, names: bool = False) -> set[str]:
    """Every module `path` imports, at any depth; `names`: also module.name for each name taken
    from a module (it may be a submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            if names:
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _imports(path: Path) -> set[str]:
    """pdserve modules `path` imports, at any depth (lazy imports count too)."""
    return {m for m in _imports_any(path, names=True) if m.split(".")[0] in PACKAGES}


MODULES = _modules()
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    allowed = ALLOWED[package] | {package, "proto"}
    upward = sorted(f"{name} -> {dep}" for name, path in MODULES.items() if name.split(".")[0] == package
                    for dep in _imports(path) if dep.split(".")[0] not in allowed)
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_module_import_cycle():
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_folder_holds_more_than_a_third_of_the_source():
    lines = {package: sum(len(p.read_text().splitlines()) for p in (ROOT / package).rglob("*.py")
                          if "_pb2" not in p.name)
             for package in ALLOWED}
    total = sum(lines.values())
    shares = {package: round(n / total, 3) for package, n in lines.items()}
    assert max(shares.values()) <= MAX_SHARE, shares


# the engine's floors: a module of the floor may import the engine modules of the floors named
ENGINE_FLOORS: dict[str, set[str]] = {
    "engine.kernels": {"engine.kernels"},
    "engine.forward": {"engine.forward", "engine.kernels"},
}
LOW_LOOP = ("engine.scheduler", "engine.kv_cache", "engine.request", "engine.sampler", "engine.config",
            "engine.telemetry", "engine.detokenizer")
MAX_LINES = 400


def _floor(module: str) -> str:
    return next((floor for floor in ENGINE_FLOORS if module == floor or module.startswith(floor + ".")), "engine")


@pytest.mark.parametrize("floor", sorted(ENGINE_FLOORS))
def test_the_engine_kernels_and_forward_paths_import_only_downward(floor):
    upward = sorted(f"{name} -> {dep}" for name in MODULES if _floor(name) == floor
                    for dep in GRAPH[name] if dep.startswith("engine.") and _floor(dep) not in ENGINE_FLOORS[floor])
    assert not upward, "imports against the engine's floors:\n" + "\n".join(upward)


def _reach(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in GRAPH[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


@pytest.mark.parametrize("module", LOW_LOOP)
def test_the_scheduler_and_its_records_sit_below_the_forward_paths(module):
    above = sorted(m for m in _reach(module) if _floor(m) == "engine.forward" or m == "engine.model_runner")
    assert not above, f"{module} reaches " + ", ".join(above)


def test_no_engine_or_sizing_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for name, path in MODULES.items() if name.split(".")[0] in ("engine", "sizing")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_test_imports_a_scripts_module():
    found = sorted(f"{path.name}: {dep}" for path in (ROOT / "tests").rglob("*.py")
                   for dep in _imports_any(path) if dep == "scripts" or dep.startswith("scripts."))
    assert not found, found
