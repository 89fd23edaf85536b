"""Run a parsed OIP infer request: check every image's header, classify them, fail as a whole if any
fails. Shared by the HTTP routes and the gRPC service."""

from __future__ import annotations

from service.http.base.dispatch import Classified, ImageDispatcher, header_error
from service.http.oip.tensors import InferCall, failed_items
from service.metrics import metrics
from service.repository.table import VersionRoute
from service.request_scope import Departure


async def run_infer(
    dispatcher: ImageDispatcher,
    call: InferCall,
    max_image_pixels: int,
    route: VersionRoute,
    departure: Departure | None = None,
    *,
    pinned: bool = False,
) -> Classified:
    """Every image's successful ``Answer``, the total milliseconds and the version that answered;
    ``ServiceError`` otherwise.

    Headers are checked first: a request that would fail on a bad header runs none of its images.
    ``departure``: the HTTP client's (``ClientClosed`` when it left; gRPC's leave by cancelling the call).
    ``pinned``: the request named ``route``'s version (``ImageDispatcher.classify``).
    """
    failed_items([header_error(image, max_image_pixels) for image in call.images])
    classified = await dispatcher.classify(call.images, call.worker_top_k, route, departure, pinned=pinned)
    for answer in classified.answers:
        metrics().observe_stages(answer.timings_ms)
    failed_items(classified.answers)
    return classified
