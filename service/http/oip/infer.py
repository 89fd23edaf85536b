"""The Open Inference Protocol's infer call through the request pipeline (service/http/pipeline/),
shared by the HTTP routes and the gRPC service: a call any of whose images fails, fails as a whole."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from service.http.base.deadlines import TIMEOUT_PARAMETER, ClientDeadline
from service.http.base.request_scope import Departure
from service.http.oip.tensors import InferCall, failed_items
from service.http.pipeline.ask import Ask, Outcome
from service.http.pipeline.pipeline import RequestPipeline
from service.metrics import metrics
from service.wire import Answer


def any_fails_all(call: InferCall, refused: list[Answer | None]) -> None:
    """The protocol's rule for images refused by their checks: a call that would fail on a bad header
    runs none of its images."""
    failed_items(refused)


async def run_infer(
    pipeline: RequestPipeline,
    model: str,
    version: str | None,
    parse: Callable[[], Awaitable[InferCall]],
    departure: Departure | None = None,
    deadline: ClientDeadline | None = None,
) -> Outcome[InferCall]:
    """The call's ``Outcome``, every answer a success; ``ServiceError`` otherwise. ``version``: named,
    the call is pinned to it. ``departure``: the HTTP client's (``ClientClosed`` when it left; gRPC's
    leave by cancelling the call). ``deadline``: what the headers or the gRPC deadline set; the
    call's ``timeout`` parameter tightens it."""
    deadline = deadline or ClientDeadline()

    async def parse_with_timeout() -> InferCall:
        call = await parse()
        deadline.tighten(call.timeout_s, f"the '{TIMEOUT_PARAMETER}' parameter")
        return call

    ask = Ask(model, version, departure, on_refused=any_fails_all, deadline=deadline)
    outcome = await pipeline.run(ask, parse_with_timeout)
    for answer in outcome.answers:
        metrics().observe_stages(answer.timings_ms)
    failed_items(outcome.answers)
    return outcome
