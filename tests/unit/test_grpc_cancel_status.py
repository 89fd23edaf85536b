"""How a cancelled gRPC call is counted (service/http/grpc/service.py ``cancelled_status``): a client's
own timer ends its call a little before the server's copy of the deadline passes (by the time the
request took to arrive), so a cancel within CANCEL_SLACK_S of the deadline was the deadline's:
DEADLINE_EXCEEDED and 504. One further off is a client that left: CANCELLED and 499 (issue 64: with the
slack's sign flipped, calls cancelled by their deadline were counted as clients that left)."""

from __future__ import annotations

import time

import grpc
import pytest

from service.http.base.deadlines import CANCEL_SLACK_S, GRPC_DEADLINE, ClientDeadline, ended_by
from service.http.grpc.service import cancelled_status


def deadline_in(seconds: float) -> ClientDeadline:
    deadline = ClientDeadline(received_at=time.monotonic())
    deadline.tighten(seconds, GRPC_DEADLINE)
    return deadline


@pytest.mark.parametrize(
    ("seconds_left", "ended"),
    [
        (-1.0, True),  # long past
        (CANCEL_SLACK_S / 2, True),  # the client's timer, just ahead of the server's copy
        (CANCEL_SLACK_S * 4, False),  # well before the deadline: the client cancelled
        (60.0, False),
    ],
)
def test_a_cancel_within_the_slack_of_the_deadline_was_the_deadlines(seconds_left: float, ended: bool) -> None:
    assert ended_by(time.monotonic() + seconds_left) is ended
    status, code = cancelled_status(deadline_in(seconds_left))
    expected = (504, grpc.StatusCode.DEADLINE_EXCEEDED) if ended else (499, grpc.StatusCode.CANCELLED)
    assert (status, code) == expected


def test_a_call_without_a_deadline_that_is_cancelled_left() -> None:
    assert cancelled_status(ClientDeadline()) == (499, grpc.StatusCode.CANCELLED)
