"""Which preprocessing backend to use, chosen by name or by `auto`."""

from __future__ import annotations

import logging

import torch

from preprocessing import _defaults
from preprocessing.base import Preprocessor
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)


def available_backends() -> tuple[str, ...]:
    return _defaults.BACKENDS


def resolve_backend(name: str, device: torch.device | str) -> tuple[str, str]:
    """``(backend, reason)`` for a requested name (``auto`` or a backend) on ``device``."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cpu":
            return "pil", "auto on a CPU device: Pillow is the CPU path"
        return "pil", f"auto on {device}: no GPU preprocessing backend is built yet, Pillow decodes on the CPU"
    if name not in _defaults.BACKENDS:
        raise ValueError(f"Unknown preprocessing backend {name!r}; choose 'auto' or one of {list(_defaults.BACKENDS)}.")
    return name, "chosen explicitly"


def create_preprocessor(name: str, spec: PreprocessSpec, device: torch.device | str) -> Preprocessor:
    backend, reason = resolve_backend(name, device)
    logger.info("Preprocessing backend: %s (%s)", backend, reason)
    if backend == "pil":
        from preprocessing.pil_backend import PilPreprocessor

        return PilPreprocessor(spec, device)
    raise AssertionError(f"backend {backend!r} is listed but has no constructor")  # pragma: no cover
