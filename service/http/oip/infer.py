"""Run a parsed OIP infer request: check every image's header, classify them, fail as a whole if any
fails. Shared by the HTTP routes and the gRPC service."""

from __future__ import annotations

from service.http.base.departure import Departure
from service.http.base.dispatch import ImageDispatcher, header_error
from service.http.oip.tensors import InferCall, failed_items
from service.metrics import metrics
from service.repository.table import VersionRoute
from service.wire import Answer


async def run_infer(
    dispatcher: ImageDispatcher,
    call: InferCall,
    max_image_pixels: int,
    route: VersionRoute,
    departure: Departure | None = None,
) -> tuple[list[Answer], float]:
    """Every image's successful ``Answer`` and the total milliseconds; ``ServiceError`` otherwise.

    Headers are checked first: a request that would fail on a bad header runs none of its images.
    ``departure``: the HTTP client's (``ClientClosed`` when it left; gRPC's leave by cancelling the call).
    """
    failed_items([header_error(image, max_image_pixels) for image in call.images])
    answers, total_ms = await dispatcher.classify(call.images, call.worker_top_k, route, departure)
    for answer in answers:
        metrics().observe_stages(answer.timings_ms)
    failed_items(answers)
    return answers, total_ms
