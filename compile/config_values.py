"""Numbers of a saved folder's preprocessing (crop_pct, mean, std), checked as they are read: the
folder is untrusted input, and a 0 or a lone number there must be a refusal naming the file, not a
ZeroDivisionError or a TypeError deep in a load."""

from __future__ import annotations

import math
from typing import cast

from compile.settings_errors import SettingsError

FLAGS_HINT = "Pass --resize-size, --crop-size, --mean, --std and --interpolation to serve it with those instead."


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def crop_fraction(value: object, key: str, where: str, model: str) -> float:
    """``crop_pct``: the share of the resized image the crop keeps, a number in (0, 1]."""
    if not _is_number(value) or not 0 < value <= 1:  # type: ignore[operator]
        raise SettingsError(
            "--model", model, f"{where}: its {key} is {value!r}; it must be a number in (0, 1].", FLAGS_HINT
        )
    return float(value)  # type: ignore[arg-type]


def channel_triplet(
    value: object, key: str, where: str, model: str, positive: bool = False
) -> tuple[float, float, float]:
    """``mean`` or ``std``: one finite number per RGB channel (``positive``: each > 0, for a std)."""
    numbers = list(value) if isinstance(value, (list, tuple)) else []
    if len(numbers) != 3 or not all(_is_number(v) for v in numbers) or (positive and min(numbers) <= 0):
        rule = "three numbers > 0" if positive else "three numbers"
        raise SettingsError(
            "--model", model, f"{where}: its {key} is {value!r}; it must be {rule}, one per RGB channel.", FLAGS_HINT
        )
    return cast("tuple[float, float, float]", tuple(float(v) for v in numbers))
