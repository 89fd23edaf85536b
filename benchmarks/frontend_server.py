"""vision-serve with its decoder and model replaced by no-ops: what the front end alone can carry.

    python -m benchmarks.frontend_server --port 8200 --api-servers 2 [any vision-serve flag]

Everything else is the production path: body parsing and limits, the header probe, admission,
deadlines, the worker watch, the batch loop, top-k on 1,000 logits, JSON answers, metrics and the
access log. The decoder answers a batch of 1x1 images without reading the bytes, and the model
returns zero logits, so the rate measured is what a GPU fast enough to cost nothing would leave.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.settings import ServeSettings

logger = logging.getLogger(__name__)


def refuse_artifact(settings: ServeSettings) -> str | None:
    if settings.artifact:
        return "--artifact: the front-end benchmark serves no engine; drop it."
    return None


def main(argv: Sequence[str] | None = None) -> int:
    # The workers alone import the no-op model (service/testing/noop.py): this process, and the HTTP
    # processes forked from it, stay torch-free as vision-serve's own do.
    from service.testing import NOOP_MODEL, serve_model

    return serve_model(argv, NOOP_MODEL, "python -m benchmarks.frontend_server", refuse=refuse_artifact)


if __name__ == "__main__":
    sys.exit(main())
