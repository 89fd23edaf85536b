"""The uvicorn versions the connection guard was checked against: importing this refuses any other,
saying how to move to it. Every module of the package that touches uvicorn's internals imports it."""

from __future__ import annotations

import uvicorn

# The versions this package was checked against, as pyproject.toml pins them: [oldest, first not supported).
SUPPORTED_UVICORN = ((0, 30), (0, 55))


def check_uvicorn_version(installed: str) -> None:
    low, high = SUPPORTED_UVICORN
    release = tuple(int(part) for part in installed.split(".")[:2] if part.isdigit())
    if not low <= release < high:
        raise ImportError(
            f"vision-serve subclasses uvicorn's HttpToolsProtocol, checked against uvicorn>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}, but {installed} is installed: pip install 'uvicorn>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}'. To move to a new version, run tests/unit/test_uvicorn_bridge.py against it "
            "and fix service/http/connection/."
        )


check_uvicorn_version(uvicorn.__version__)
