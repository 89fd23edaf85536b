"""A ``.pt2`` ExportedProgram read without running anything it holds (the file is untrusted input).

``torch.export.load`` runs what the archive tells it to: a weight or constant marked ``use_pickle``
goes to ``torch.load(weights_only=False)``, an opaque constant to ``pickle.loads``, the sample inputs
fall back to ``weights_only=False`` when the safe unpickler refuses them, an AOTInductor member loads
a shared library, each shape expression (``expr_str``) goes to ``sympy.sympify`` (``eval``), and the
program's ``guards_code`` is ``exec``-ed by ``.module()``. ``check_archive`` reads the zip's members
and JSON first and refuses all of these; ``load_exported_program`` then loads with every
``torch.load`` forced to the weights-only unpickler, in case a path is missed here. What is left is
what ``torch.export.save`` writes for a plain model: raw tensor bytes, JSON, and sample inputs that
the weights-only unpickler reads. (Node targets are torch's own verifier's to check: it admits
operators, not arbitrary callables.)
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from compile.offline_loads import untrusted_load
from compile.settings_errors import SettingsError

REEXPORT_FIX = (
    "Re-export it from the model with torch.export.save(torch.export.export(model, (example,), "
    "dynamic_shapes=...), PATH), from plain tensors, on a machine you trust."
)
# What torch.export.save writes inside the archive's root folder; anything else is refused (an
# AOTInductor package's data/aotinductor/ is native code: such a .pt2 is an --artifact, not a model).
ALLOWED_MEMBERS = re.compile(
    r"(archive_format|archive_version|byteorder|version|\.data/version|\.data/serialization_id"
    r"|models/[\w.-]+\.json|data/weights/[\w.-]+|data/constants/[\w.-]+|data/sample_inputs/[\w.-]+\.pt"
    r"|extra/[\w./-]+)"
)
MAX_JSON_BYTES = 256 * 1024 * 1024  # a model.json of a large model is a few MB
# The names sympy.srepr writes for the shape expressions of an export (and those the deserializer adds).
SYMPY_NAMES = frozenset(
    {
        "Symbol",
        "Integer",
        "Rational",
        "Float",
        "Add",
        "Mul",
        "Pow",
        "Mod",
        "Max",
        "Min",
        "Abs",
        "floor",
        "ceiling",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "And",
        "Or",
        "Not",
        "StrictLessThan",
        "StrictGreaterThan",
        "LessThan",
        "GreaterThan",
        "Equality",
        "Unequality",
        "Piecewise",
        "ExprCondPair",
        "true",
        "false",
        "oo",
        "zoo",
        "nan",
        "Infinity",
        "NegativeInfinity",
        "FloorDiv",
        "ModularIndexing",
        "Where",
        "PythonMod",
        "CleanDiv",
        "CeilToInt",
        "FloorToInt",
        "CeilDiv",
        "LShift",
        "RShift",
        "PowByNatural",
        "FloatPow",
        "FloatTrueDiv",
        "IntTrueDiv",
        "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat",
        "TruncToInt",
        "RoundToInt",
        "RoundDecimal",
        "ToFloat",
        "Identity",
        "OpaqueUnaryFn_sqrt",
        "BitwiseFn_bitwise_and",
        "BitwiseFn_bitwise_or",
    }
)
SYMBOL_NAME = re.compile(r"[a-z]+[0-9]+")
PLAIN_STRING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[-+]?[0-9.]+(e[-+]?[0-9]+)?")
# What a guard may say of an input tensor: L['x'].size()[0] <= 64, and the like.
GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim"})
ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
LOGIC = (ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Invert, ast.BitAnd, ast.BitOr)
COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def refusal(path: Path, what: str) -> SettingsError:
    return SettingsError("--model", str(path), f"{path} is refused: {what}; loading it could run code.", REEXPORT_FIX)


def load_exported_program(path: Path):
    """The ``ExportedProgram`` in ``path``, checked (``check_archive``) and loaded without unpickling code."""
    import torch.export

    check_archive(path)
    with untrusted_load():
        return torch.export.load(str(path))


def check_archive(path: Path) -> None:
    """``SettingsError`` if the ``.pt2`` at ``path`` holds anything its load would run (module docstring)."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise SettingsError(
            "--model", str(path), f"Could not read {path} as a torch.export archive (a zip file): {exc}.", REEXPORT_FIX
        ) from None
    with archive:
        members = {}
        for name in archive.namelist():
            root, _, inner = name.partition("/")
            if not root or not inner or not ALLOWED_MEMBERS.fullmatch(inner):
                raise refusal(path, f"it holds {name!r}, which torch.export.save does not write")
            members[inner] = name
        for inner in members:
            if inner.startswith("models/"):
                model = PurePosixPath(inner).stem
                _check_payloads(path, archive, members, model)
                _check_program(path, _read_json(path, archive, members[inner]))
        for inner, name in members.items():
            if inner.startswith("data/sample_inputs/"):
                _check_weights_only(path, archive.read(name), name)


def _read_json(path: Path, archive: zipfile.ZipFile, name: str) -> dict:
    if archive.getinfo(name).file_size > MAX_JSON_BYTES:
        raise refusal(path, f"its {name} is larger than {MAX_JSON_BYTES // 2**20} MiB")
    try:
        data = json.loads(archive.read(name))
    except ValueError as exc:
        raise SettingsError("--model", str(path), f"{path}: its {name} is not JSON ({exc}).", REEXPORT_FIX) from None
    if not isinstance(data, dict):
        raise SettingsError("--model", str(path), f"{path}: its {name} is not a JSON object.", REEXPORT_FIX)
    return data


def _check_payloads(path: Path, archive: zipfile.ZipFile, members: dict[str, str], model: str) -> None:
    """Weights and constants stored as raw tensor bytes, none pickled, and no legacy pickled state dict."""
    for kind in ("weights", "constants"):
        if f"data/{kind}/{model}.pt" in members:
            raise refusal(path, f"its {kind} are one pickle (data/{kind}/{model}.pt, the legacy format)")
        config_name = members.get(f"data/{kind}/{model}_{kind}_config.json")
        if config_name is None:
            continue
        config = _read_json(path, archive, config_name).get("config", {})
        for fqn, payload in config.items() if isinstance(config, dict) else ():
            if not isinstance(payload, dict):
                raise refusal(path, f"{config_name} describes {fqn!r} in no known form")
            if payload.get("use_pickle"):
                raise refusal(path, f"its {kind[:-1]} {fqn!r} is stored as a pickle")
            if kind == "constants" and not str(payload.get("path_name", "")).startswith("tensor_"):
                raise refusal(path, f"its constant {fqn!r} is a pickled object, not a tensor")


def _check_program(path: Path, program: dict) -> None:
    for guard in program.get("guards_code") or ():
        if not isinstance(guard, str) or not _is_plain_guard(guard):
            raise refusal(path, f"its guards_code {str(guard)[:80]!r} is not a plain shape check")
    for expression in _strings_under(program, "expr_str"):
        if not _is_plain_expression(expression):
            raise refusal(path, f"its shape expression {expression[:80]!r} is not plain arithmetic")


def _strings_under(data: object, key: str) -> Iterator[str]:
    """Every value of ``key`` anywhere in ``data`` (the shape expressions sit deep in the graph)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for name, value in item.items():
                if name == key:
                    yield value if isinstance(value, str) else repr(value)
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _parsed(text: str) -> ast.Expression | None:
    if "\n" in text or "\r" in text or "#" in text:
        return None  # text spliced into generated code must stay on its line
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None


def _is_plain(text: str, leaf: Callable[[ast.AST, Callable[[ast.AST], bool]], bool], binary: tuple) -> bool:
    """Whether ``text`` is one expression of operators (``binary`` ones, logic and comparisons) over
    what ``leaf(node, plain)`` admits, where ``plain`` checks a node below it the same way."""
    tree = _parsed(text)
    if tree is None:
        return False

    def plain(node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp):
            return isinstance(node.op, binary) and plain(node.left) and plain(node.right)
        if isinstance(node, ast.UnaryOp):
            return isinstance(node.op, LOGIC) and plain(node.operand)
        if isinstance(node, ast.BoolOp):
            return all(plain(value) for value in node.values)
        if isinstance(node, ast.Compare):
            return all(isinstance(op, COMPARISONS) for op in node.ops) and all(
                plain(n) for n in (node.left, *node.comparators)
            )
        return leaf(node, plain)

    return plain(tree.body)


def _sympy_leaf(node: ast.AST, plain: Callable[[ast.AST], bool]) -> bool:
    """Numbers, symbols, and calls of sympy's names on them (sympify evaluates the text: a name like
    ``__import__`` or an attribute would be Python)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (bool, int, float)) or (
            isinstance(node.value, str) and PLAIN_STRING.fullmatch(node.value) is not None
        )
    if isinstance(node, ast.Name):
        return node.id in SYMPY_NAMES or SYMBOL_NAME.fullmatch(node.id) is not None
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Name)
            and node.func.id in SYMPY_NAMES
            and all(plain(arg) for arg in node.args)
            and all(k.arg is not None and k.arg.isidentifier() and plain(k.value) for k in node.keywords)
        )
    return False


def _guard_leaf(node: ast.AST, plain: Callable[[ast.AST], bool]) -> bool:
    """Numbers and the inputs' sizes and strides (``L['x'].size()[0]``): nothing else is called."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (bool, int, float)) or (
            isinstance(node.value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", node.value) is not None
        )
    if isinstance(node, ast.Name):
        return node.id in ("L", "inf")
    if isinstance(node, ast.Subscript):
        return plain(node.value) and plain(node.slice)
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in GUARD_METHODS
            and plain(node.func.value)
            and all(plain(arg) for arg in node.args)
            and not node.keywords
        )
    return False


def _is_plain_expression(text: str) -> bool:
    """A sympy expression as srepr writes it: sympy's calls on numbers and symbols, nothing else."""
    return _is_plain(text, _sympy_leaf, ARITHMETIC + LOGIC)


def _is_plain_guard(text: str) -> bool:
    """A guard on the inputs' shapes (``L['x'].size()[0] <= 64``): compared numbers, nothing called but
    a tensor's size and stride (``.module()`` executes the text)."""
    return _is_plain(text, _guard_leaf, ARITHMETIC)


def _check_weights_only(path: Path, data: bytes, name: str) -> None:
    """The sample inputs, read by the weights-only unpickler (torch's own load falls back to the full one)."""
    import torch

    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's UnpicklingError, or whatever a garbled file raises
        raise refusal(path, f"its {name} is a pickle of more than tensors ({str(exc).splitlines()[0][:200]})") from None
