"""What travels to the GPU machine in each run, sized so that every run fits the run tool's limit.

    python -m benchmarks.gpu.carry split STREAM INDEX   # cut the pack stream into .carry/NN parts
    python -m benchmarks.gpu.carry plan                 # each run's payload; exit 1 if one does not fit

A run carries the working tree (tracked files and untracked ones git does not ignore) plus the
ignored paths it names, 64 MiB in all. The first session came within a megabyte of that (the tree,
the core wheels and a 40 MiB part together), so every run here keeps ``MARGIN`` free: the core
wheels travel alone in the first run, and each part is cut to what is left beside the tree.
Standard library only (benchmarks/gpu/pack.sh calls it; see ../shared/GPU.md).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20
CARRY_LIMIT = 64 * MiB
MARGIN = 8 * MiB
# The headline run (tree + .carry/core) stays well under the limit: its margin is the one spare run.
HEADLINE_LIMIT = 40 * MiB
REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".carry"


def tree_bytes(repo: Path = REPO) -> int:
    """The size of what travels with every run: tracked files plus untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    paths = (repo / name for name in listed.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def part_bytes(tree: int) -> int:
    """The largest part that fits one run beside the tree, with the margin left free."""
    size = CARRY_LIMIT - MARGIN - tree
    if size <= 0:
        raise ValueError(f"the working tree alone is {tree / MiB:.1f} MiB: no room to carry anything in a run")
    return size


def split(stream: Path, index: Path, carry: Path, tree: int) -> list[Path]:
    """``stream`` in parts ``carry/01/chunk.01``, ``carry/02/chunk.02``..., each with a copy of ``index``."""
    size = part_bytes(tree) - index.stat().st_size  # the index travels in every part too
    if size <= 0:
        raise ValueError("no room for a part beside the working tree and the stream's index")
    parts = []
    with stream.open("rb") as source:
        while chunk := source.read(size):
            folder = carry / f"{len(parts) + 1:02d}"
            folder.mkdir(parents=True)
            (folder / f"chunk.{len(parts) + 1:02d}").write_bytes(chunk)
            shutil.copy(index, folder / "stream.txt")
            parts.append(folder)
    return parts


def plan(carry: Path, tree: int) -> list[tuple[str, int]]:
    """``(what the run carries, its payload in bytes)`` for each run: the core wheels, then each part."""
    runs = []
    if (carry / "core").is_dir():
        runs.append((".carry/core", tree + folder_bytes(carry / "core")))
    for part in sorted(carry.glob("[0-9][0-9]")):
        runs.append((f".carry/{part.name}", tree + folder_bytes(part)))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", help="cut the pack stream into .carry/NN parts")
    cut.add_argument("stream", type=Path)
    cut.add_argument("index", type=Path, help="stream.txt: name, size, sha256 of each pack in the stream")
    commands.add_parser("plan", help="each run's payload against the limit")
    args = parser.parse_args(argv)
    tree = tree_bytes()
    if args.command == "split":
        for part in split(args.stream, args.index, CARRY, tree):
            print(f"{part.relative_to(REPO)}: {folder_bytes(part) / MiB:.1f} MiB")
        return 0
    fits = True
    limit = CARRY_LIMIT - MARGIN
    print(
        f"working tree {tree / MiB:.1f} MiB; each run at most {limit / MiB:.0f} MiB ({MARGIN / MiB:.0f} MiB kept "
        f"free), the headline's at most {HEADLINE_LIMIT / MiB:.0f} MiB"
    )
    for number, (carried, payload) in enumerate(plan(CARRY, tree), 1):
        run_limit = HEADLINE_LIMIT if carried == ".carry/core" else limit
        verdict = "ok" if payload <= run_limit else "TOO BIG"
        fits = fits and payload <= run_limit
        print(f"  run {number}: tree + {carried} = {payload / MiB:.1f} MiB  {verdict}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
