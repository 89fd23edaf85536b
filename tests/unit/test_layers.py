"""The modules of ``service/`` (issue 41) and of ``compile/`` (issue 54) form layers: no import runs
back up, and there is no import cycle, type-only imports (``if TYPE_CHECKING:``) and imports inside
functions included.

Read from the source with ``ast``, so nothing is imported. Each package's ``LAYERS`` is its design: a
module may import its own layer and the layers below it; within a layer the graph must still be
acyclic.
"""

from __future__ import annotations

import ast
import graphlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A prefix names a module or a whole subpackage; the longest matching prefix wins.
SERVICE_LAYERS: list[tuple[str, ...]] = [
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
        "service.tracing",
    ),
    ("service.transport", "service.repository"),
    # what every protocol of an HTTP process shares; the guard of its connections (uvicorn's internals),
    # which leaves each request's Departure in its scope (http/base/request_scope.py) for the request path
    (
        "service.worker",
        "service.http.base",
        "service.http.cache",
        "service.http.connection",
        "service.http.fast_routes",
    ),
    # one request's way through an HTTP process: calls base/ and cache/ in order, never called back
    ("service.http.pipeline",),
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

COMPILE_LAYERS: list[tuple[str, ...]] = [
    # leaves: defaults, the refusal of a setting, logs, the machine, the libraries' versions, where
    # engines are unpacked, the guards of untrusted model files (the load's, ONNX external data, a
    # folder's numbers)
    (
        "compile._defaults",
        "compile.settings_errors",
        "compile.versions",
        "compile.devices",
        "compile.libstdcxx",
        "compile.json_logs",
        "compile.torch_logging",
        "compile.progress",
        "compile.unpacking",
        "compile.offline_loads",
        "compile.onnx_external_data",
        "compile.config_values",
    ),
    # what a compile is asked and what it records: flags, settings, the model request, the manifest
    (
        "compile.cli_flags",
        "compile.preprocess_flags",
        "compile.model_request",
        "compile.settings",
        "compile.manifest",
        "compile.labels",
        "compile.pt2_archive",
        "compile.model_files",
        "compile.timm_support",
        "compile.hf_processors",
    ),
    # what an engine is and its batch-dynamic export: below both the quantizers and the backends
    ("compile.engine", "compile.batch_export"),
    # where a model comes from: the catalog, a model file, a saved folder or hub, its weights
    ("compile.catalog", "compile.pretrained_folders", "compile.model_source", "compile.weights"),
    # the calibration sets and the quantizers, which the backends call and which never call them
    ("compile.quantization",),
    ("compile.backends",),
    # around the engine: the accuracy gate and its photos, the Triton export, whether an artifact runs here
    ("compile.sample_photos", "compile.gate", "compile.triton_repository", "compile.compat"),
    ("compile.build",),
    ("compile.cli",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """Every module of ``modules`` that ``name`` imports, anywhere in its file."""
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
            submodules = {f"{origin}.{alias.name}" for alias in node.names} & modules
            # `from service.client import _defaults` imports the submodule, not the package's names.
            found.update(submodules or {origin})
    return {m for m in found if m in modules and m != name}


@dataclass
class Package:
    """One package's modules, their imports among themselves, and its layers."""

    name: str
    layers: list[tuple[str, ...]]
    outside: tuple[str, ...] = ()  # prefixes that have no layer on purpose (the client)
    modules: dict[str, Path] = field(init=False)
    graph: dict[str, set[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.modules = {module_name(path): path for path in (ROOT / self.name).rglob("*.py")}
        names = set(self.modules)
        self.graph = {name: imported_modules(name, path, names) for name, path in self.modules.items()}

    def layer_of(self, name: str) -> int | None:
        best, rank = "", None
        for index, prefixes in enumerate(self.layers):
            for prefix in prefixes:
                if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                    best, rank = prefix, index
        return rank

    def is_outside(self, name: str) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in self.outside)

    def upward_imports(self, graph: dict[str, set[str]]) -> list[str]:
        return [
            f"{module} (layer {self.layer_of(module)}) imports {target} (layer {self.layer_of(target)})"
            for module, targets in graph.items()
            for target in targets
            if (low := self.layer_of(module)) is not None and (high := self.layer_of(target)) is not None and high > low
        ]


SERVICE = Package("service", SERVICE_LAYERS, outside=(CLIENT,))
COMPILE = Package("compile", COMPILE_LAYERS)
PACKAGES = pytest.mark.parametrize("package", [SERVICE, COMPILE], ids=lambda package: package.name)


@PACKAGES
def test_every_module_has_a_layer(package: Package) -> None:
    unplaced = [m for m in package.modules if m != package.name and not package.is_outside(m)]
    # A package whose __init__ imports nothing (a docstring) needs no place.
    unplaced = [
        m
        for m in unplaced
        if package.layer_of(m) is None and (package.graph[m] or package.modules[m].name != "__init__.py")
    ]
    assert not unplaced, f"add these to {package.name.upper()}_LAYERS in {Path(__file__).name}: {unplaced}"


@PACKAGES
def test_no_import_runs_back_up(package: Package) -> None:
    upward = package.upward_imports(package.graph)
    assert not upward, "\n".join(upward)


@PACKAGES
def test_there_is_no_import_cycle(package: Package) -> None:
    try:
        graphlib.TopologicalSorter(package.graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_the_client_imports_nothing_of_the_server() -> None:
    client = [m for m in SERVICE.modules if SERVICE.is_outside(m)]
    server = sorted({t for m in client for t in SERVICE.graph[m] if not SERVICE.is_outside(t)})
    assert not server, f"the client imports server modules: {server}"
    assert client and all(SERVICE.layer_of(t) is None for t in client)


@pytest.mark.parametrize(
    ("package", "importer", "imported", "upward", "cycle"),
    [
        # The protocols call the pipeline, which calls base/: base/ importing it back would run up a
        # layer. errors -> wire closes a cycle (wire imports errors).
        (
            SERVICE,
            "service.http.predict.routes",
            "service.http.pipeline.pipeline",
            {"service.http.base.limits": {"service.http.pipeline.pipeline"}},
            {"service.errors": {"service.wire"}},
        ),
        # The backends call the quantizers; a quantizer importing a backend is what issue 54 removed.
        (
            COMPILE,
            "compile.backends.inductor",
            "compile.quantization.pt2e",
            {"compile.quantization.pt2e": {"compile.backends.base"}},
            {"compile._defaults": {"compile.settings"}},
        ),
    ],
    ids=["service", "compile"],
)
def test_the_checks_see_an_upward_import_and_a_cycle(
    package: Package, importer: str, imported: str, upward: dict[str, set[str]], cycle: dict[str, set[str]]
) -> None:
    """The tests above pass only if the graph is read right: a known edge is found, and a planted
    upward import and a planted cycle are caught."""
    assert imported in package.graph[importer]
    assert package.layer_of(importer) > package.layer_of(imported)
    planted = {module: package.graph[module] | targets for module, targets in upward.items()}
    assert package.upward_imports(planted), f"a planted upward import is not seen: {upward}"
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({**package.graph, **cycle}).prepare()


MAX_CLASS_LINES = 150


def test_no_class_in_service_passes_150_lines() -> None:
    """A class that grows past this does more than one job (issue 41): split it by job, as the model
    pool (service/supervisor/pool/) and the worker's loop (service/worker/) were."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in SERVICE.modules.items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, long
