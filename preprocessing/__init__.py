"""Decode + resize + normalize backends behind one interface (``Preprocessor``)."""

from preprocessing.base import ImageDecodeError, ImageError, PreparedBatch, Preprocessor
from preprocessing.registry import create_preprocessor, resolve_preprocess_backend
from preprocessing.spec import PreprocessSpec

__all__ = [
    "ImageDecodeError",
    "ImageError",
    "PreparedBatch",
    "PreprocessSpec",
    "Preprocessor",
    "create_preprocessor",
    "resolve_preprocess_backend",
]
