"""Decode + resize + normalize backends behind one interface (``Preprocessor``).

The names below are the public API, what code outside the product (benchmarks/) imports. They load
on first use (PEP 562): ``preprocessing.probe``, ``.spec`` and ``.errors`` import no tensor library,
so the HTTP processes can check image headers without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BACKENDS": "preprocessing._defaults",
    "DALI_MAX_THREADS": "preprocessing._defaults",
    "ImageDecodeError": "preprocessing.errors",
    "ImageError": "preprocessing.errors",
    "PreparedBatch": "preprocessing.base",
    "Preprocessor": "preprocessing.base",
    "PilPreprocessor": "preprocessing.pil_backend",
    "PreprocessSpec": "preprocessing.spec",
    "backend_problem": "preprocessing.registry",
    "create_preprocessor": "preprocessing.registry",
    "resolve_preprocess_backend": "preprocessing.registry",
    "to_rgb": "preprocessing.pil_backend",
}
__all__ = [
    "BACKENDS",
    "DALI_MAX_THREADS",
    "ImageDecodeError",
    "ImageError",
    "PilPreprocessor",
    "PreparedBatch",
    "PreprocessSpec",
    "Preprocessor",
    "backend_problem",
    "create_preprocessor",
    "resolve_preprocess_backend",
    "to_rgb",
]

if TYPE_CHECKING:
    from preprocessing._defaults import BACKENDS, DALI_MAX_THREADS
    from preprocessing.base import PreparedBatch, Preprocessor
    from preprocessing.errors import ImageDecodeError, ImageError
    from preprocessing.pil_backend import PilPreprocessor, to_rgb
    from preprocessing.registry import backend_problem, create_preprocessor, resolve_preprocess_backend
    from preprocessing.spec import PreprocessSpec


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'preprocessing' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
