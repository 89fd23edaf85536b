"""vision-serve with a sticky CUDA error injected at the device boundary, for the end-to-end tests.

    STICKY_FAULT_FILE=/tmp/fault python -m tests.sticky_device_server --model efficientnet-lite0

CI has no GPU, so it cannot break a CUDA context. This runs the real server, and injects only what a
GPU would do: once the file named by ``STICKY_FAULT_FILE`` exists, the next batch the model runs
fails as after an illegal memory access, the file is removed (one fault per server), and from then
on the worker's device reports itself unusable, as ``preprocessing.device_health`` does on a GPU
whose context broke. Everything else (the worker's exit, the restart, the answers) is the server's
own. The patches are made at import, so the spawned inference workers, which import this module
as their main module, carry them too.

With ``STICKY_FAULT_KIND=device-assert`` on a GPU nothing is faked: the batch runs a kernel that
indexes out of bounds, a device-side assert breaks the worker's CUDA context for real, and the
real check (``preprocessing.device_health``) has to notice.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from service.cli import main
from service.worker import classifier as api
from service.worker import engine

TRIGGER = Path(os.environ.get("STICKY_FAULT_FILE", "/nonexistent/sticky-fault"))
REAL = os.environ.get("STICKY_FAULT_KIND") == "device-assert"
FAULT = "CUDA error: an illegal memory access was encountered"

_broken = False
_run_model = engine.ServedModel.__call__


def _run_or_fail(self: engine.ServedModel, images: torch.Tensor, alone: bool = False) -> torch.Tensor:
    global _broken
    if not _broken and TRIGGER.exists():
        TRIGGER.unlink(missing_ok=True)
        _broken = True
        if REAL:  # out of bounds on the device: a device-side assert, sticky for this context
            images.new_zeros(1)[torch.tensor([images.numel()], device=images.device)].item()
    if _broken:
        raise RuntimeError(FAULT)
    return _run_model(self, images, alone)


def _unusable_device(device: torch.device | str) -> str | None:
    return f"{device}: {FAULT}" if _broken else None


engine.ServedModel.__call__ = _run_or_fail
if not REAL:
    api.unusable_device = _unusable_device

if __name__ == "__main__":
    main()
