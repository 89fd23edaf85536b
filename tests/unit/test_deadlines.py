"""Deadlines clients set (service/http/base/deadlines.py) and which one a submission keeps
(service/http/pipeline/submit.py ``Expiry``). Served end to end in tests/e2e/test_abandoned_requests.py."""

from __future__ import annotations

import pytest

from service.errors import ServiceError
from service.http.base.deadlines import (
    ENVOY_TIMEOUT_HEADER,
    TIMEOUT_HEADER,
    ClientDeadline,
    header_deadline,
    parameter_timeout_s,
)
from service.http.grpc.service import grpc_deadline
from service.http.pipeline.submit import Expiry


def raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """As an ASGI scope holds them (uvicorn lowercases the names), with another header among them."""
    return [(b"content-type", b"image/jpeg")] + [(k.encode(), v.encode("utf-8")) for k, v in headers.items()]


def test_the_earliest_header_wins_and_counts_from_receipt() -> None:
    deadline = header_deadline(raw({TIMEOUT_HEADER: "800", ENVOY_TIMEOUT_HEADER: "250"}))
    assert deadline.at == pytest.approx(deadline.received_at + 0.25)
    assert deadline.detail() == f"No answer within the client's 250 ms deadline (the {ENVOY_TIMEOUT_HEADER} header)."


@pytest.mark.parametrize("headers", [{}, {TIMEOUT_HEADER: "0"}, {ENVOY_TIMEOUT_HEADER: " 0 "}])
def test_no_header_or_zero_sets_no_deadline(headers) -> None:
    deadline = header_deadline(raw(headers))
    assert deadline is None or deadline.at is None


@pytest.mark.parametrize("value", ["", "1.5", "-3", "1e3", "²", "9" * 13, "300ms"])
def test_a_header_that_is_not_whole_milliseconds_is_a_400(value) -> None:
    with pytest.raises(ServiceError) as caught:
        header_deadline(raw({TIMEOUT_HEADER: value}))
    assert caught.value.status == 400 and TIMEOUT_HEADER in caught.value.message


def test_the_timeout_parameter_is_microseconds_and_zero_is_none() -> None:
    assert parameter_timeout_s(300_000) == pytest.approx(0.3)
    assert parameter_timeout_s(0) is None and parameter_timeout_s(None) is None


@pytest.mark.parametrize("value", [-1, 1.5, True, "300", [300], 10**16, 10**400])
def test_a_timeout_parameter_that_is_not_a_whole_number_is_a_400(value) -> None:
    with pytest.raises(ServiceError) as caught:
        parameter_timeout_s(value)
    assert caught.value.status == 400 and "'timeout'" in caught.value.message


def test_tighten_keeps_the_earliest() -> None:
    deadline = ClientDeadline(received_at=100.0)
    deadline.tighten(2.0, "a")
    deadline.tighten(5.0, "b")
    deadline.tighten(None, "c")
    assert (deadline.at, deadline.source) == (102.0, "a")
    deadline.tighten(1.0, "d")
    assert (deadline.at, deadline.timeout_s, deadline.source) == (101.0, 1.0, "d")


def test_a_submission_keeps_the_client_deadline_only_when_it_ends_before_the_servers() -> None:
    sooner = ClientDeadline(received_at=100.0)
    sooner.tighten(0.3, "the x-request-timeout-ms header")
    assert Expiry(130.0, 30.0, sooner).at == pytest.approx(100.3)
    later = ClientDeadline(received_at=100.0)
    later.tighten(600.0, "the x-request-timeout-ms header")
    assert Expiry(130.0, 30.0, later).at == 130.0, "capped by --request-timeout-s"
    assert Expiry(130.0, 30.0, ClientDeadline(received_at=100.0)).at == 130.0
    assert Expiry(130.0, 30.0, None).at == 130.0


class CallContext:
    """What ``grpc_deadline`` reads of a grpc.aio ServicerContext."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def test_a_grpc_deadline_is_the_calls_time_remaining() -> None:
    assert grpc_deadline(CallContext(None)).at is None
    deadline = grpc_deadline(CallContext(0.5))
    assert deadline.at == pytest.approx(deadline.received_at + 0.5)
    assert "the gRPC deadline" in deadline.detail()


@pytest.mark.parametrize("python", [(3, 10), (3, 12)], ids=["wait_for (3.10)", "asyncio.timeout"])
def test_within_cuts_a_step_at_the_deadline_and_lets_a_quick_one_finish(monkeypatch, python) -> None:
    """Both ways ``within`` bounds a step: Python 3.10 has no asyncio.timeout (pyproject: >= 3.10)."""
    import asyncio
    import sys
    import time

    from service.errors import DeadlineExceeded
    from service.http.base import deadlines

    if python >= (3, 11) and sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout needs Python 3.11")
    monkeypatch.setattr(deadlines.sys, "version_info", python)

    def soon(seconds: float) -> deadlines.ClientDeadline:
        deadline = deadlines.ClientDeadline()
        deadline.tighten(seconds, "test")
        return deadline

    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        asyncio.run(deadlines.within(soon(0.05), slow()))
    assert time.monotonic() - started < 2
    assert asyncio.run(deadlines.within(soon(5.0), quick())) == "done"
