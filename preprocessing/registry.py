"""Which preprocessing backend to use, chosen by name or by ``auto``."""

from __future__ import annotations

import functools
import logging

import torch

from preprocessing import _defaults
from preprocessing.base import Preprocessor
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)


@functools.cache
def _import_problem(backend: str) -> str | None:
    """Why ``backend``'s libraries cannot be imported here, or ``None``. Imports are tried once."""
    if backend == "dali":
        from preprocessing.dali_backend import dali_problem

        return dali_problem()
    if backend == "cvcuda":
        from preprocessing.cvcuda_backend import cvcuda_problem

        return cvcuda_problem()
    return None


def backend_problem(backend: str, device: torch.device | str) -> str | None:
    """Why ``backend`` cannot run on ``device``, or ``None`` when it can."""
    device = torch.device(device)
    if backend in _defaults.GPU_ONLY_BACKENDS and device.type != "cuda":
        return f"{backend} needs a CUDA device (this one is {device})"
    return _import_problem(backend)


def resolve_preprocess_backend(name: str, device: torch.device | str) -> tuple[str, str]:
    """``(preprocessing backend, reason)`` for ``--preprocess`` (``auto`` or a backend) on ``device``.

    Raises ``ValueError`` for an unknown name or a backend that cannot run on ``device``.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "pil", f"auto on {device}: Pillow, the CPU path"
        skipped = []
        for backend in _defaults.BACKENDS:
            problem = backend_problem(backend, device)
            if problem is None:
                because = f"; skipped {'; '.join(skipped)}" if skipped else ""
                return backend, f"auto on {device}: first usable of {', '.join(_defaults.BACKENDS)}{because}"
            skipped.append(f"{backend}: {problem}")
        raise AssertionError("pil always runs")  # pragma: no cover
    if name not in _defaults.BACKENDS:
        raise ValueError(f"Unknown preprocessing backend {name!r}; choose 'auto' or one of {list(_defaults.BACKENDS)}.")
    problem = backend_problem(name, device)
    if problem:
        raise ValueError(f"--preprocess {name} cannot run here: {problem}. Use --preprocess auto or pil.")
    return name, "chosen explicitly"


def create_preprocessor(
    name: str,
    spec: PreprocessSpec,
    device: torch.device | str,
    *,
    max_batch_size: int = _defaults.DEVICE_MAX_BATCH,
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS,
    decode_threads: int | None = None,
) -> Preprocessor:
    """The backend ``name`` resolves to, built for ``spec`` on ``device``.

    ``decode_threads``: the CPU threads its decoders may use (None: the backend's own default, up to
    the machine's cores); a server gives each worker its share of the cores.

    ``max_batch_size`` is the largest batch the caller will pass; the device backends size their
    buffers (DALI its pipeline) for it. Images whose header claims more than ``max_image_pixels``
    get a 413 before any decoder sees them. With ``auto``, a backend that imports but fails to start
    (say, DALI on a driver too old for its CUDA) is skipped with a warning for the next usable one.
    """
    device = torch.device(device)
    backend, reason = resolve_preprocess_backend(name, device)
    candidates = [backend]
    if name == "auto":
        later = _defaults.BACKENDS[_defaults.BACKENDS.index(backend) + 1 :]
        candidates += [other for other in later if backend_problem(other, device) is None]
    for position, candidate in enumerate(candidates):
        try:
            preprocessor = _construct(candidate, spec, device, max_batch_size, max_image_pixels, decode_threads)
        except Exception as exc:
            if position == len(candidates) - 1:
                raise
            logger.warning(
                "Preprocessing backend %s failed to start on %s (%s); trying %s",
                candidate,
                device,
                exc,
                candidates[position + 1],
            )
            reason = f"{reason}; {candidate} failed to start: {exc}"
            continue
        logger.info("Preprocessing backend: %s (%s)", candidate, reason)
        return preprocessor
    raise AssertionError("unreachable")  # pragma: no cover


def _construct(
    backend: str,
    spec: PreprocessSpec,
    device: torch.device,
    max_batch_size: int,
    max_image_pixels: int,
    decode_threads: int | None,
) -> Preprocessor:
    if backend == "pil":
        from preprocessing.pil_backend import PilPreprocessor

        return PilPreprocessor(spec, device, max_image_pixels=max_image_pixels, num_threads=decode_threads)
    options = {"max_batch_size": max_batch_size, "max_image_pixels": max_image_pixels, "num_threads": decode_threads}
    if backend == "dali":
        from preprocessing.dali_backend import DaliPreprocessor

        return DaliPreprocessor(spec, device, **options)
    if backend == "cvcuda":
        from preprocessing.cvcuda_backend import CvcudaPreprocessor

        return CvcudaPreprocessor(spec, device, **options)
    if backend == "torch":
        from preprocessing.torch_backend import TorchPreprocessor

        return TorchPreprocessor(spec, device, **options)
    raise AssertionError(f"backend {backend!r} is listed but has no constructor")  # pragma: no cover
