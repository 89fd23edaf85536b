"""Whether a device can still run work after an error: a sticky CUDA error ends a process's use of it.

After an illegal address, a device-side assert, a launch failure and the like, every later CUDA call
of the process fails with the same error: its CUDA context is broken and only a new process gets a
working one. Catching such an error and going on, as a worker does for one bad batch, would answer
every later request with an error. So code that catches errors on a device asks ``unusable_device``
after a failure; an error that left the device working (out of memory, a bad input) returns ``None``.

The check runs work on the device rather than matching error messages, which change between CUDA,
cuDNN, cuBLAS and library versions: a synchronize (which reports a pending asynchronous error) and
one small kernel whose result is copied back.
"""

from __future__ import annotations

import torch

from preprocessing.errors import DeviceUnusable

__all__ = ["DeviceUnusable", "unusable_device"]


def unusable_device(device: torch.device | str) -> str | None:
    """Why ``device`` can no longer run work in this process, or ``None`` if it can (always on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).cpu()
    except Exception as exc:  # torch.AcceleratorError or RuntimeError, by torch version
        lines = str(exc).strip().splitlines()
        return f"{device}: {lines[0] if lines else type(exc).__name__}"
    return None
