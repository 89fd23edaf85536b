"""vision-serve's classifier in a LitServe user's own ``ls.LitServer``: LitServe's request path (its
queues and batched loop), a JSON body ``{"image": "<base64>", "top_k": 5}``, vision-serve's answer.

    import litserve as ls
    from service.settings import ServeSettings, resolve_pipeline_depth
    from service.litserve_api import ClassifierLitAPI

    ls.LitServer(ClassifierLitAPI(ServeSettings(model="efficientnet-lite0")), accelerator="cpu").run()

vision-serve itself does not use it (service/worker/entry.py and loop.py replace LitServe's path).
"""

from __future__ import annotations

import dataclasses

import litserve as ls
from fastapi import HTTPException
from starlette.responses import Response

from service.errors import ServiceError
from service.http.predict.parsing import image_from_json
from service.http.predict.render import render
from service.settings import ServeSettings, resolve_pipeline_depth
from service.wire import Answer, ImageRequest


class ClassifierLitAPI(ls.LitAPI):
    def __init__(self, settings: ServeSettings) -> None:
        super().__init__(max_batch_size=settings.max_batch_size, batch_timeout=settings.batch_timeout_ms / 1000.0)
        self.settings = settings
        self.classifier = None  # set by setup, in the worker

    def setup(self, device: str) -> None:
        from service.worker.classifier import Classifier

        # vision-serve's planner resolves --pipeline-depth 0; under a plain LitServer nothing else does.
        accelerator = "cuda" if str(device).startswith("cuda") else "cpu"
        depth = resolve_pipeline_depth(self.settings.pipeline_depth, accelerator)
        self.classifier = Classifier.load(dataclasses.replace(self.settings, pipeline_depth=depth), device)

    # ``request`` is unannotated on purpose: LitServe reads the annotation to decide what to hand
    # over, and without one it passes the parsed JSON body.
    def decode_request(self, request) -> ImageRequest:
        try:
            image, top_k = image_from_json(request)
        except ServiceError as exc:  # LitServe answers HTTPException with its status; anything else is a 500
            raise HTTPException(exc.status, exc.message) from None
        return ImageRequest(image, top_k)

    def batch(self, inputs: list[ImageRequest]) -> object:
        return self.classifier.prepare(inputs)

    def predict(self, x: object) -> list[Answer] | Answer:
        if isinstance(x, ImageRequest):  # max_batch_size 1: LitServe's loop hands over items one by one
            return self.classifier.run(self.classifier.prepare([x]))[0]
        return self.classifier.run(x)

    def unbatch(self, output: list[Answer]) -> list[Answer]:
        return output

    def encode_response(self, output: Answer) -> Response:
        return render(output)
