"""The images' pip requirements, read from pyproject.toml: no hand-copied list that can drift.

    python3 deploy/docker/requirements.py --extras demo,timm --without torch,torchvision
    python3 deploy/docker/requirements.py --only torch,torchvision          # pyproject's torch range
    python3 deploy/docker/requirements.py --installed torch,torchvision     # constraints: keep these
    python3 deploy/docker/requirements.py --image gpu > deploy/docker/requirements-gpu.txt
    python3 deploy/docker/requirements.py --image gpu --check deploy/docker/requirements-gpu.txt

Both Dockerfiles run it while they build (it needs only Python >= 3.11, or tomli). Dockerfile.gpu
installs the committed requirements-gpu.txt, so that what its image holds can be read and diffed;
tests/unit/test_image_requirements.py fails when that file no longer matches pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "vision-serve"

# What each image installs besides its base's own packages. The GPU image keeps the NGC base's torch,
# torchvision and Torch-TensorRT (built for its TensorRT), so they are left out of its file.
IMAGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpu": (
        ("offline", "onnx-gpu", "gpu", "timm", "tune", "tensorrt-quant", "cache", "tracing"),
        ("torch", "torchvision"),
    ),
}
HEADER = """\
# Generated from pyproject.toml; do not edit. Regenerate with:
#   python3 deploy/docker/requirements.py --image {image} > deploy/docker/requirements-{image}.txt
# (tests/unit/test_image_requirements.py checks it). Left out, the base image's own: {without}.
"""


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name (Torch_TensorRT == torch-tensorrt)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a requirement string names, without extras, version or marker."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"Cannot read a package name from requirement {requirement!r}.")
    return canonical(match.group(1))


def self_extras(requirement: str) -> list[str] | None:
    """The extras of a ``vision-serve[a,b]`` requirement (the project naming its own extras), else None."""
    match = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*\[([^\]]*)\]\s*", requirement)
    if not match or canonical(match.group(1)) != PROJECT:
        return None
    return [extra.strip() for extra in match.group(2).split(",") if extra.strip()]


def load_project(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    """The [project] table of pyproject.toml."""
    with pyproject.open("rb") as file:
        return tomllib.load(file)["project"]


def requirements(project: dict, extras: list[str], without: set[str] = frozenset()) -> list[str]:
    """The project's dependencies plus those of ``extras`` (expanded through the project's own
    ``vision-serve[...]`` references), in pyproject's order, each once, minus the names in ``without``."""
    optional = project.get("optional-dependencies", {})
    result: list[str] = []
    seen_extras: set[str] = set()

    def add(items: list[str]) -> None:
        for item in items:
            nested = self_extras(item)
            if nested is not None:
                for extra in nested:
                    add_extra(extra)
            elif requirement_name(item) not in without and item not in result:
                result.append(item)

    def add_extra(extra: str) -> None:
        if extra in seen_extras:
            return
        if extra not in optional:
            known = ", ".join(sorted(optional))
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {known}).")
        seen_extras.add(extra)
        add(optional[extra])

    add(project.get("dependencies", []))
    for extra in extras:
        add_extra(extra)
    return result


def only(project: dict, names: set[str]) -> list[str]:
    """The project's own requirements on ``names`` (e.g. its torch range), from its dependencies."""
    found = [item for item in project.get("dependencies", []) if requirement_name(item) in names]
    missing = names - {requirement_name(item) for item in found}
    if missing:
        raise SystemExit(f"pyproject.toml's dependencies do not name {', '.join(sorted(missing))}.")
    return found


def installed(names: set[str]) -> list[str]:
    """``name==version`` of each of ``names`` installed in this Python: constraints that keep them."""
    pins = []
    for name in sorted(names):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return pins


def image_file(project: dict, image: str) -> str:
    """The committed requirements file of ``image``: the header, then one requirement a line."""
    extras, without = IMAGES[image]
    lines = requirements(project, list(extras), {canonical(name) for name in without})
    return HEADER.format(image=image, without=", ".join(without)) + "".join(f"{line}\n" for line in lines)


def names_of(value: str) -> set[str]:
    return {canonical(name) for name in value.split(",") if name.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--extras", help="comma-separated extras to add to the dependencies ('' for none)")
    what.add_argument("--only", help="print only pyproject's requirements on these packages")
    what.add_argument("--installed", help="print name==version of these packages as installed here")
    what.add_argument("--image", choices=sorted(IMAGES), help="print an image's committed requirements file")
    parser.add_argument("--without", default="", help="comma-separated packages to leave out (with --extras)")
    parser.add_argument("--check", metavar="FILE", help="with --image: exit 1 if FILE differs from what is printed")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args(argv)

    if args.installed is not None:
        lines = installed(names_of(args.installed))
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        return 0
    project = load_project(args.pyproject)
    if args.image:
        text = image_file(project, args.image)
        if args.check:
            if Path(args.check).read_text() != text:
                print(
                    f"{args.check} does not match pyproject.toml: regenerate it with "
                    f"python3 deploy/docker/requirements.py --image {args.image} > {args.check}",
                    file=sys.stderr,
                )
                return 1
            return 0
        sys.stdout.write(text)
        return 0
    if args.only is not None:
        lines = only(project, names_of(args.only))
    else:
        extras = [extra.strip() for extra in args.extras.split(",") if extra.strip()]
        lines = requirements(project, extras, names_of(args.without))
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
