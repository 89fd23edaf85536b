"""``benchmarks/`` imports the product through a small public surface only (issue 54), so that a
refactor of the worker, the transport or compile-trt's modules cannot break a benchmark unseen.

Read from the source with ``ast``, as tests/unit/test_layers.py reads ``service/``: every import of
``service``, ``compile`` or ``preprocessing`` in ``benchmarks/`` (function-level ones included) must
name a module of ``SURFACE``, and every name imported from it must be one that module provides.
Tests may import benchmarks and anything else; docs/development.md#what-benchmarks-may-import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PRODUCT = ("service", "compile", "preprocessing")

# What benchmarks may import, and why each is public.
SURFACE: dict[str, str] = {
    "service.client": "the client, as users call the server",
    "service.client.launcher": "vision-serve as a child process: ServerProcess, free_port",
    "service.tune.loadgen": "the load generator (vision-tune loads its servers with it)",
    "service.tune.images": "the benchmark photos the load generator sends",
    "service.wire": "the wire types between the HTTP processes and the workers",
    "service.settings": "the server's settings and config files, as users write them",
    "service.testing": "the hooks: a server with the no-op model, and the internal units micro-benchmarks measure",
    "compile": "compile-trt's public API (its __all__): catalog, weights, backends, gate, manifest",
    "preprocessing": "the preprocessing backends' public API (its __all__)",
}


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def product_imports(source: str, filename: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` for each import of a product module in ``source``; ``from X import
    sub`` where ``X.sub`` is a module counts as an import of ``X.sub``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] in PRODUCT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in PRODUCT:
                continue
            names = []
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if module_file(submodule):
                    found.append((node.lineno, submodule, []))
                else:
                    names.append(alias.name)
            if names:
                found.append((node.lineno, node.module, names))
    return sorted(found)


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _target_names(target: ast.expr) -> list[str]:
    """``A = ...`` binds A, ``A, B = ...`` binds both; ``a.b = ...`` and ``a[k] = ...`` bind nothing."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in _target_names(element)]
    return _target_names(target.value) if isinstance(target, ast.Starred) else []


def _bound_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(name for target in node.targets for name in _target_names(target))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Try) or (isinstance(node, ast.If) and not _is_type_checking(node)):
            # a TYPE_CHECKING block's names exist for a type checker only
            names |= _bound_names(node.body) | _bound_names(node.orelse)
    return names


def lazy_exports(path: Path) -> dict[str, str]:
    """A package's ``_EXPORTS`` table (names loaded on first use, PEP 562), or ``{}``."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]:
            return ast.literal_eval(node.value)
    return {}


def provided_names(module: str) -> set[str]:
    """What ``from module import name`` finds: names bound at its top level, and its lazy exports."""
    path = module_file(module)
    assert path, f"no module {module}"
    return _bound_names(ast.parse(path.read_text(), str(path)).body) | lazy_exports(path).keys()


def surface_problems(source: str, filename: str) -> list[str]:
    problems = []
    for line, module, names in product_imports(source, filename):
        where = f"{filename}:{line}"
        if module not in SURFACE:
            problems.append(f"{where} imports {module}, not in the benchmarks' surface")
            continue
        missing = sorted(set(names) - provided_names(module))
        if missing:
            problems.append(f"{where} imports {missing} from {module}, which does not provide them")
    return problems


def test_benchmarks_import_only_the_public_surface() -> None:
    problems = [
        problem
        for path in sorted(BENCHMARKS.rglob("*.py"))
        for problem in surface_problems(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems) + "\nsee docs/development.md#what-benchmarks-may-import"


def test_every_lazy_export_of_the_surface_resolves() -> None:
    """A lazy package names where each export lives; a refactor that moves one must move the line:
    each target module provides the name, and ``__all__`` lists exactly the exports."""
    lazy = {m: lazy_exports(module_file(m)) for m in SURFACE if lazy_exports(module_file(m))}
    assert {"compile", "preprocessing", "service.testing"} <= lazy.keys()
    wrong = [
        f"{module}.{name} -> {target}"
        for module, exports in lazy.items()
        for name, target in exports.items()
        if not module_file(target) or name not in provided_names(target)
    ]
    assert not wrong, f"exported names their module does not provide: {wrong}"
    for module, exports in lazy.items():
        tree = ast.parse(module_file(module).read_text())
        (listed,) = [
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"]
        ]
        assert sorted(listed) == sorted(exports), module


def test_the_surface_modules_exist() -> None:
    assert all(module_file(m) for m in SURFACE), [m for m in SURFACE if not module_file(m)]


def test_the_check_sees_a_private_import_and_a_missing_name() -> None:
    """The test above passes only if imports are read right: a known import is found, and planted
    private imports (a module, a submodule by ``from``, a plain import, one in a function) and a name
    the surface does not provide are each caught."""
    found = product_imports((BENCHMARKS / "experiments.py").read_text(), "experiments.py")
    assert any(module == "service.tune.loadgen" and "LoadSpec" in names for _, module, names in found)
    planted = "\n".join(
        [
            "from service.worker.runner import BatchRunner",
            "from compile import _defaults",
            "import service.transport.channels",
            "def f():",
            "    from preprocessing.registry import backend_problem",
            "from service.testing import NoSuchHook",
            "from service.tune.loadgen import LoadSpec",
            "from compile import get_model_entry",
            "from tests.bad_inputs import bad_inputs",
        ]
    )
    problems = surface_problems(planted, "planted.py")
    assert [p.split(" ")[0] for p in problems] == [f"planted.py:{n}" for n in (1, 2, 3, 5, 6)], problems
    assert "service.worker.runner, not in" in problems[0] and "compile._defaults, not in" in problems[1]
    assert "['NoSuchHook'] from service.testing" in problems[4]
