"""The guards around every load of a model file or folder, which are untrusted input (docs/security.md).

``untrusted_load()`` holds, for the load: the Hugging Face Hub offline (transformers and timm read
``HF_HUB_OFFLINE`` and its siblings; huggingface_hub reads it once, at its import, so its constant is
set too), and every ``torch.load`` forced to the weights-only unpickler (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
wins over a library's own ``weights_only=False``). The checks of what a file holds come first, in
the loaders; this is the net under them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1",
}


@contextlib.contextmanager
def untrusted_load() -> Iterator[None]:
    """No network to the Hub and no full unpickling inside the ``with``; the variables as they were after
    it (a huggingface_hub first imported inside stays offline: it read them at its import)."""
    saved = {name: os.environ.get(name) for name in OFFLINE_ENV}
    # Its opposite would make torch refuse both (it raises when both are set): drop it for the load.
    saved["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    os.environ.update(OFFLINE_ENV)
    hub = sys.modules.get("huggingface_hub.constants")
    hub_offline = getattr(hub, "HF_HUB_OFFLINE", None)
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if hub is not None:
            hub.HF_HUB_OFFLINE = hub_offline
