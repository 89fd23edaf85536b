"""A small Python client for vision-serve (sync and async, on httpx)."""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from pathlib import Path

import httpx

from service import _defaults

ImageInput = bytes | str | Path


@dataclass(frozen=True)
class Prediction:
    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Classification:
    predictions: list[Prediction]
    model: str
    engine: str
    latency_ms: float  # as seen by the client, network included
    batch_size: int | None  # how many requests shared this one's batch on the server, failed ones included

    @property
    def top1(self) -> Prediction:
        return self.predictions[0]


class ClassifyError(Exception):
    """The server answered with an error status; ``detail`` is its explanation."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def _request_parts(image: ImageInput, top_k: int) -> tuple[bytes, dict[str, str], dict[str, int]]:
    if isinstance(image, (str, Path)):
        path = Path(image)
        data = path.read_bytes()
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    else:
        data, content_type = image, "application/octet-stream"
    return data, {"Content-Type": content_type}, {"top_k": top_k}


def _parse(response: httpx.Response) -> Classification:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        detail = body.get("detail") if isinstance(body, dict) else None
        raise ClassifyError(response.status_code, str(detail or response.text or response.reason_phrase))
    try:
        predictions = [Prediction(p["index"], p["label"], p["probability"]) for p in body["predictions"]]
        model, engine = body["model"], body["engine"]
    except (TypeError, KeyError):
        raise ClassifyError(200, f"Not a vision-serve answer: {response.text[:200]!r}") from None
    batch_size = response.headers.get("X-Batch-Size")
    return Classification(
        predictions=predictions,
        model=model,
        engine=engine,
        latency_ms=response.elapsed.total_seconds() * 1e3,
        batch_size=int(batch_size) if batch_size else None,
    )


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class VisionClient:
    """``with VisionClient(url) as c: c.classify("cat.jpg").top1.label``

    ``api_key``: for a server started with ``--api-key``.
    """

    def __init__(
        self,
        url: str = _defaults.CLIENT_URL,
        *,
        timeout: float = _defaults.CLIENT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=url, timeout=timeout, headers=_auth_headers(api_key))

    def classify(self, image: ImageInput, *, top_k: int = _defaults.TOP_K) -> Classification:
        data, headers, params = _request_parts(image, top_k)
        return _parse(self._http.post("/predict", content=data, headers=headers, params=params))

    def is_ready(self) -> bool:
        """Every inference worker of the server has loaded its model and warmed up."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VisionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncVisionClient:
    """``async with AsyncVisionClient(url) as c: await c.classify(data)``"""

    def __init__(
        self,
        url: str = _defaults.CLIENT_URL,
        *,
        timeout: float = _defaults.CLIENT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, headers=_auth_headers(api_key))

    async def classify(self, image: ImageInput, *, top_k: int = _defaults.TOP_K) -> Classification:
        data, headers, params = _request_parts(image, top_k)
        return _parse(await self._http.post("/predict", content=data, headers=headers, params=params))

    async def is_ready(self) -> bool:
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncVisionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
