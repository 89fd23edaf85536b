"""The Open Inference Protocol's infer paths, ``/v2/models/NAME[/versions/V]/infer``, for any name."""

from __future__ import annotations

INFER_PREFIX, INFER_SUFFIX = "/v2/models/", "/infer"


def model_in_path(path: str) -> tuple[str, str | None]:
    """``/v2/models/NAME[/versions/V]/infer`` -> (NAME, V or None)."""
    parts = path.strip("/").split("/")
    return parts[2], (parts[4] if len(parts) > 4 and parts[3] == "versions" else None)


def is_infer_path(path: str) -> bool:
    """``/v2/models/NAME[/versions/V]/infer``, whatever the name."""
    if not (path.startswith(INFER_PREFIX) and path.endswith(INFER_SUFFIX)):
        return False
    parts = path.strip("/").split("/")
    return len(parts) == 4 or (len(parts) == 6 and parts[3] == "versions")
