"""The top_k rule every protocol shares: which values are a top_k (each protocol words its own
refusal)."""

from __future__ import annotations

from service import _defaults


def top_k_value(raw: object, text_allowed: bool) -> int | None:
    """``raw`` as a top_k (1..MAX_TOP_K), or ``None`` if it is not one. ``text_allowed``: digits in a
    string count (a query or form field); JSON values must be numbers. Each protocol words its own
    refusal (its status and message are part of its contract)."""
    value = None
    # True/False are ints in Python, and int() also reads "1_0" and non-ASCII digits: none is a top_k.
    # The length check comes first: int() of a 5,000-digit string raises (Python's digit limit).
    text = raw.strip() if text_allowed and isinstance(raw, str) else ""
    if text and len(text) <= len(str(_defaults.MAX_TOP_K)) and text.isascii() and text.isdigit():
        value = int(text)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif text_allowed and isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    return value if value is not None and 1 <= value <= _defaults.MAX_TOP_K else None
