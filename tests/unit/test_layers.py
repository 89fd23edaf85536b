"""The modules of ``service/`` form layers (issue 41): no import runs back up, and there is no import
cycle, type-only imports (``if TYPE_CHECKING:``) and imports inside functions included.

Read from the source with ``ast``, so nothing is imported. ``LAYERS`` is the design: a module may
import its own layer and the layers below it; within a layer the graph must still be acyclic.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "service"

# Lowest first. A prefix names a module or a whole subpackage; the longest matching prefix wins.
LAYERS: list[tuple[str, ...]] = [
    # shared by every process
    (
        "service._defaults",
        "service.errors",
        "service.logs",
        "service.heap",
        "service.parent_watch",
        "service.model_info",
        "service.wire",
        "service.metrics",
        "service.settings",
        "service.litserve_bridge",
        "service.uvicorn_bridge",
        "service.http.base.departure",  # set by the connection (uvicorn_bridge), read by the dispatcher
        "service.tracing",
    ),
    ("service.transport", "service.repository"),
    ("service.worker", "service.http.base", "service.http.cache"),
    ("service.http.predict", "service.http.oip"),
    ("service.http.grpc",),
    ("service.http.process", "service.http.routes", "service.supervisor.planning"),
    # the model pool (workers, restarts, routing table, repository calls), then the server that runs it
    ("service.supervisor.pool",),
    ("service.supervisor",),
    ("service.cli", "service.litserve_api", "service.demo"),
    # vision-tune, a process of its own that starts compile-trt and servers: nothing of the server imports it
    ("service.tune",),
    # hooks for benchmarks/ (tests/unit/test_benchmark_surface.py): nothing of the product imports them
    ("service.testing",),
]
# The client runs in the caller's process: it imports nothing of the server.
CLIENT = "service.client"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(name: str, path: Path) -> set[str]:
    """Every ``service`` module ``name`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            submodules = {f"{origin}.{alias.name}" for alias in node.names} & MODULES.keys()
            # `from service.client import _defaults` imports the submodule, not the package's names.
            found.update(submodules or {origin})
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def layer_of(name: str) -> int | None:
    best, rank = "", None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, index
    return rank


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if m not in ("service", CLIENT) and not m.startswith(CLIENT + ".")]
    # A package whose __init__ imports nothing (a docstring) needs no place.
    unplaced = [m for m in unplaced if layer_of(m) is None and (GRAPH[m] or MODULES[m].name != "__init__.py")]
    assert not unplaced, f"add these to LAYERS in {Path(__file__).name}: {unplaced}"


def test_no_import_runs_back_up() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(module) is not None and layer_of(target) is not None and layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_there_is_no_import_cycle() -> None:
    try:
        graphlib.TopologicalSorter(GRAPH).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_the_client_imports_nothing_of_the_server() -> None:
    client = [m for m in MODULES if m == CLIENT or m.startswith(CLIENT + ".")]
    server = sorted({t for m in client for t in GRAPH[m] if not (t == CLIENT or t.startswith(CLIENT + "."))})
    assert not server, f"the client imports server modules: {server}"
    assert client and all(layer_of(t) is None for t in client)


def test_the_checks_see_an_upward_import_and_a_cycle() -> None:
    """The tests above pass only if the graph is read right: a known edge is found, and a planted
    cycle is caught."""
    assert "service.http.base.dispatch" in GRAPH["service.http.predict.routes"]
    assert layer_of("service.http.predict.routes") > layer_of("service.http.base.dispatch")
    planted = {**GRAPH, "service.errors": {"service.wire"}}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(planted).prepare()


MAX_CLASS_LINES = 150


def test_no_class_in_service_passes_150_lines() -> None:
    """A class that grows past this does more than one job (issue 41): split it by job, as the model
    pool (service/supervisor/pool/) and the worker's loop (service/worker/) were."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, long
