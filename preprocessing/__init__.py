"""Decode + resize + normalize backends behind one interface (``Preprocessor``).

The names below load on first use (PEP 562): ``preprocessing.probe``, ``.spec`` and ``.errors``
import no tensor library, so the HTTP processes can check image headers without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ImageDecodeError": "preprocessing.errors",
    "ImageError": "preprocessing.errors",
    "PreparedBatch": "preprocessing.base",
    "Preprocessor": "preprocessing.base",
    "PreprocessSpec": "preprocessing.spec",
    "create_preprocessor": "preprocessing.registry",
    "resolve_preprocess_backend": "preprocessing.registry",
}
__all__ = [
    "ImageDecodeError",
    "ImageError",
    "PreparedBatch",
    "PreprocessSpec",
    "Preprocessor",
    "create_preprocessor",
    "resolve_preprocess_backend",
]

if TYPE_CHECKING:
    from preprocessing.base import PreparedBatch, Preprocessor
    from preprocessing.errors import ImageDecodeError, ImageError
    from preprocessing.registry import create_preprocessor, resolve_preprocess_backend
    from preprocessing.spec import PreprocessSpec


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'preprocessing' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
