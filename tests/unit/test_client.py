"""How the client reads answers, including ones that are not what it expects."""

from __future__ import annotations

import httpx
import pytest

from service.client.vision_client import ClassifyError, _parse

REQUEST = httpx.Request("POST", "http://127.0.0.1:8000/predict")


@pytest.mark.parametrize(
    ("status", "content", "detail"),
    [
        (415, b'{"detail": "The data is not an image"}', "The data is not an image"),
        (500, b"[1, 2]", "[1, 2]"),  # JSON, but not an object
        (502, b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),  # a proxy's page
        (503, b"", "Service Unavailable"),
    ],
)
def test_error_answers_become_classify_errors(status: int, content: bytes, detail: str) -> None:
    with pytest.raises(ClassifyError) as caught:
        _parse(httpx.Response(status, content=content, request=REQUEST))
    assert caught.value.status_code == status and caught.value.detail == detail


@pytest.mark.parametrize("content", [b"hello", b'{"unexpected": true}', b"[]"])
def test_a_200_that_is_not_a_vision_serve_answer(content: bytes) -> None:
    with pytest.raises(ClassifyError, match="Not a vision-serve answer"):
        _parse(httpx.Response(200, content=content, request=REQUEST))


def test_the_clients_own_defaults_agree_with_the_servers() -> None:
    """The client imports nothing of the server (no torch on a client machine), so it keeps copies of
    what it must agree on: the default address, top_k and its bound, and the variable names."""
    from service import _defaults as server
    from service.client import _defaults as client
    from service.settings import env_var

    assert f"http://{server.HOST}:{server.PORT}" == client.URL
    assert (client.TOP_K, client.MAX_TOP_K) == (server.TOP_K, server.MAX_TOP_K)
    assert (env_var("api_key"), env_var("port")) == (client.API_KEY_ENV, client.PORT_ENV)
