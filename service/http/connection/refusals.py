"""What the connection guard allows (the flags' limits and its own bounds) and what it answers, as
raw HTTP, when it refuses a connection's request before closing it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from service import _defaults

# Header lines in one request (Apache's LimitRequestFields is 100): thousands of tiny headers cost
# the server a Python object each.
MAX_HEADER_FIELDS = 256
# A chunked body: this many chunks are free; beyond, their mean size must be at least
# MIN_MEAN_CHUNK_BYTES, since every chunk costs the server two Python calls whatever its size.
FREE_CHUNKS = 1024
MIN_MEAN_CHUNK_BYTES = 256
# Bytes of a chunked body's framing (sizes, extensions, line ends) beyond its data: extensions are
# never read by the server, so a client that sends megabytes of them only burns its parser.
FRAMING_ALLOWANCE_BYTES = 64 * 1024
FRAMING_BYTES_PER_CHUNK = 32


@dataclass(frozen=True)
class ConnectionLimits:
    """The flags of the same names; the keep-alive timeout is uvicorn's own (``timeout_keep_alive``)."""

    max_header_bytes: int = _defaults.MAX_HEADER_BYTES
    header_timeout_s: float = _defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = _defaults.BODY_TIMEOUT_S


@dataclass(frozen=True)
class Refusal:
    """What the guard answers (when it may) before it closes a connection: ``wire`` is the response."""

    status: int
    detail: str
    wire: bytes


def refusal(status: int, reason: str, detail: str) -> Refusal:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return Refusal(status, detail, head.encode("latin-1") + body)


class Refused(Exception):
    """Raised from a parser callback to stop parsing; httptools re-raises it as a parser error, which
    uvicorn answers through ``send_400_response``, where the guard sends its own refusal instead."""


@dataclass(frozen=True)
class ConnectionRefusals:
    """Every refusal of a request on a connection under ``limits``, built once per server."""

    header_timeout: Refusal
    body_timeout: Refusal
    too_large: Refusal
    too_many_fields: Refusal
    tiny_chunks: Refusal
    heavy_framing: Refusal

    @classmethod
    def under(cls, limits: ConnectionLimits) -> ConnectionRefusals:
        return cls(
            header_timeout=refusal(
                408,
                "Request Timeout",
                f"The request's headers did not arrive within {limits.header_timeout_s:g} s (server flag "
                "--header-timeout-s).",
            ),
            body_timeout=refusal(
                408,
                "Request Timeout",
                f"The request's body did not arrive within {limits.body_timeout_s:g} s (server flag --body-timeout-s).",
            ),
            too_large=refusal(
                431,
                "Request Header Fields Too Large",
                f"The request's headers are larger than {limits.max_header_bytes:,} bytes (server flag "
                "--max-header-bytes).",
            ),
            too_many_fields=refusal(
                431, "Request Header Fields Too Large", f"The request has more than {MAX_HEADER_FIELDS} header lines."
            ),
            tiny_chunks=refusal(
                400,
                "Bad Request",
                f"The chunked body's chunks are smaller than {MIN_MEAN_CHUNK_BYTES} bytes on average; send larger "
                "chunks or a Content-Length body.",
            ),
            heavy_framing=refusal(
                400,
                "Bad Request",
                "The chunked body's framing (chunk sizes and extensions) is far larger than its data; drop the "
                "extensions.",
            ),
        )
