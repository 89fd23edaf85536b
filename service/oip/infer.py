"""Run a parsed OIP infer request: check every image's header, classify them, fail as a whole if any
fails. Shared by the HTTP routes and the gRPC service."""

from __future__ import annotations

from fastapi import HTTPException

from service.frontend.dispatch import ImageDispatcher
from service.metrics import metrics
from service.oip.tensors import InferCall, OipError, failed_items
from service.rest.parsing import header_error
from service.wire import Answer


async def run_infer(dispatcher: ImageDispatcher, call: InferCall, max_image_pixels: int) -> tuple[list[Answer], float]:
    """Every image's successful ``Answer`` and the total milliseconds; ``OipError`` otherwise.

    Headers are checked first: a request that would fail on a bad header runs none of its images.
    """
    failed_items([header_error(image, max_image_pixels) for image in call.images])
    try:
        answers, total_ms = await dispatcher.classify(call.images, call.worker_top_k)
    except HTTPException as exc:  # shed (503), or more images than could ever be admitted (413)
        raise OipError(exc.status_code, str(exc.detail), dict(exc.headers or {})) from None
    for answer in answers:
        metrics().observe_stages(answer.timings_ms)
    failed_items(answers)
    return answers, total_ms
