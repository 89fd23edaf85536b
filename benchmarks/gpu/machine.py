"""What the lent GPU machine has, what travels to it, and whether the stand-in venv matches it.

    python -m benchmarks.gpu.machine check              # the lists: every runtime dependency is there or carried
    .standin/bin/python -m benchmarks.gpu.machine check --installed   # and this interpreter holds nothing more

A server that imports a module the machine lacks fails there after a device-minute or two (it did:
``simplejpeg``, a runtime dependency that was neither on the machine nor carried). Three files say
what is where: ``machine.txt`` (the machine's image), ``carry.txt`` (the wheels a run carries)
and ``standin.txt`` (the stand-in venv of dry runs, a subset of the image). Standard library
only: the stand-in and the GPU machine run it before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parent
MACHINE_LIST = GPU / "machine.txt"
CARRY_LIST = GPU / "carry.txt"
STANDIN_LIST = GPU / "standin.txt"
PYPROJECT = GPU.parents[1] / "pyproject.toml"
# In every venv and never imported by the project; and the project itself, whose source tree is on
# the path (its egg-info too, where a development venv installed it editable).
TOOLING = frozenset({"pip", "wheel", "vision-serve"})
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503: ``Pillow``, ``pillow`` and ``PIL_low`` spellings compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    """The distribution a requirement line names (``foo[bar]>=1; python_version<'3.11'`` -> ``foo``)."""
    line = line.split("#", 1)[0]
    match = _NAME.match(line)
    return normalize(match.group(1)) if match else None


def read_names(path: Path) -> list[str]:
    """The distributions a list file names, one per line, comments and versions aside."""
    return [name for line in path.read_text().splitlines() if (name := requirement_name(line))]


def runtime_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """The project's own runtime dependencies (no extras) that apply to Python 3.12, the machine's."""
    import tomllib  # 3.11+: the stand-in and the machine have 3.12; the check runs there and in CI

    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [name for line in dependencies if "python_version < '3.11'" not in line and (name := requirement_name(line))]


def list_problems(machine: list[str], carried: list[str], standin: list[str], runtime: list[str]) -> list[str]:
    """What would fail on the machine, or make a dry run pass that the machine would fail."""
    on_machine = set(machine)
    problems = [
        f"{name}: a runtime dependency (pyproject.toml) that the GPU machine lacks and no run carries: add it "
        f"to {CARRY_LIST.name} with the version CI tests, and what it needs that the machine lacks"
        for name in runtime
        if name not in on_machine and name not in carried
    ]
    problems += [
        f"{name}: in {STANDIN_LIST.name} but not on the GPU machine ({MACHINE_LIST.name}): a dry run with it "
        "would hide an import that fails there; carry it instead"
        for name in standin
        if name not in on_machine
    ]
    return problems


def installed_problems(machine: list[str], carried: list[str]) -> list[str]:
    """Distributions this interpreter holds that neither the machine nor the carry has."""
    allowed = set(machine) | set(carried) | TOOLING
    installed = {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    return [
        f"{name}: installed here but not on the GPU machine: rebuild the stand-in (bash benchmarks/gpu/standin.sh)"
        for name in sorted(installed - allowed)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="the lists against each other (and, with --installed, this venv)")
    check.add_argument("--installed", action="store_true", help="also: this interpreter holds only the machine's")
    args = parser.parse_args(argv)
    machine, carried = read_names(MACHINE_LIST), read_names(CARRY_LIST)
    problems = list_problems(machine, carried, read_names(STANDIN_LIST), runtime_dependencies())
    if args.installed:
        problems += installed_problems(machine, carried)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
