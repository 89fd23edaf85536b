"""Decode + resize + normalize backends behind one interface (``Preprocessor``)."""

from preprocessing.base import ImageDecodeError, ImageError, PreparedBatch, Preprocessor
from preprocessing.registry import available_backends, create_preprocessor, resolve_backend
from preprocessing.spec import PreprocessSpec

__all__ = [
    "ImageDecodeError",
    "ImageError",
    "PreparedBatch",
    "PreprocessSpec",
    "Preprocessor",
    "available_backends",
    "create_preprocessor",
    "resolve_backend",
]
