"""The error model (issue 41): each domain kind has one HTTP status and one gRPC code, and the request
path raises kinds by name, never ``ServiceError(<status number>, ...)``."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from service import errors
from service.errors import (
    ClientClosed,
    DeadlineExceeded,
    Internal,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    Unauthorized,
    Unavailable,
    UnprocessableContent,
    UnsupportedMediaType,
    error_of_status,
    http_headers,
)
from service.http.grpc.service import grpc_status

PACKAGE = Path(__file__).resolve().parents[2] / "service"
# Being renamed by another change; converted after it (issue 41).
Code = grpc.StatusCode

# kind: (HTTP status, gRPC code, Retry-After by default)
KINDS: dict[type[ServiceError], tuple[int, grpc.StatusCode, bool]] = {
    InvalidInput: (400, Code.INVALID_ARGUMENT, False),
    Unauthorized: (401, Code.UNAUTHENTICATED, False),
    NotFound: (404, Code.NOT_FOUND, False),
    RequestTimeout: (408, Code.UNKNOWN, False),  # never met over gRPC: it reads no body through read_body
    PayloadTooLarge: (413, Code.RESOURCE_EXHAUSTED, False),
    UnsupportedMediaType: (415, Code.INVALID_ARGUMENT, False),
    UnprocessableContent: (422, Code.INVALID_ARGUMENT, False),
    ClientClosed: (499, Code.CANCELLED, False),
    Internal: (500, Code.INTERNAL, False),
    Unavailable: (503, Code.UNAVAILABLE, True),
    Overloaded: (503, Code.UNAVAILABLE, True),
    DeadlineExceeded: (504, Code.DEADLINE_EXCEEDED, False),
}


def test_every_kind_is_in_the_table() -> None:
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, ServiceError) and not value.__name__.startswith("_")
    }
    assert defined - {ServiceError} == set(KINDS)


@pytest.mark.parametrize(("kind", "expected"), KINDS.items(), ids=lambda v: getattr(v, "__name__", ""))
def test_kind_maps_to_its_http_status_and_grpc_code(
    kind: type[ServiceError], expected: tuple[int, grpc.StatusCode, bool]
) -> None:
    status, code, retry = expected
    error = kind("why")
    assert isinstance(error, ServiceError)
    assert (kind.status, error.status, error.message, grpc_status(error)) == (status, status, "why", code)
    assert (error.retry_after_s is not None) == retry
    # A number from outside the request path (a worker's Answer, the probe) becomes its kind.
    from_number = error_of_status(status, "why")
    assert isinstance(from_number, Unavailable if kind is Overloaded else kind)
    assert (from_number.status, from_number.retry_after_s, grpc_status(from_number)) == (status, None, code)


def test_a_status_no_kind_names_keeps_its_number() -> None:
    error = error_of_status(418, "teapot")
    assert type(error) is ServiceError and error.status == 418 and grpc_status(error) is Code.UNKNOWN


def test_http_headers() -> None:
    assert http_headers(Unauthorized.status, None) == {"WWW-Authenticate": "Bearer"}
    error = Overloaded("full")
    assert http_headers(error.status, error.retry_after_s) == {"Retry-After": "1"}
    assert http_headers(InvalidInput.status, None) == {}


def test_long_messages_are_cut() -> None:
    message = InvalidInput("x" * 10_000).message
    assert len(message) == errors.MAX_ERROR_MESSAGE_CHARS and message.endswith("(cut short)")


def literal_raises(path: Path) -> list[int]:
    """Lines of ``path`` that call ``ServiceError`` itself (a status by number) instead of a kind."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "ServiceError"
    ]


def test_the_request_path_raises_kinds_not_numbers() -> None:
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "errors.py" or path.parent != PACKAGE
        for line in literal_raises(path)
    }
    assert not found, f"raise a kind from service/errors.py instead: {sorted(found)}"


def test_the_scan_finds_a_literal_raise(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from service import errors\nraise errors.ServiceError(\n    400, 'no'\n)\n")
    assert literal_raises(sample) == [2]
