"""The tune's answer: a vision-serve config file, checked by the server's own reader before it is kept."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from service.settings import ServeSettings, read_config_file, toml_value


def serve_toml(values: Mapping[str, object], comments: Sequence[str] = ()) -> str:
    """``name = value`` lines of ServeSettings fields under ``# comment`` lines."""
    lines = [f"# {line}".rstrip() for comment in comments for line in comment.splitlines()]
    lines += [f"{name} = {toml_value(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def write_serve_config(path: Path, values: Mapping[str, object], comments: Sequence[str] = ()) -> Path:
    """Write the file (atomically: a reader never sees half of it) and read it back as vision-serve
    does; ``ValueError`` if the server would refuse it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(serve_toml(values, comments))
    try:
        ServeSettings(**read_config_file(staging))
    except ValueError:
        staging.unlink(missing_ok=True)
        raise
    staging.replace(path)
    return path
