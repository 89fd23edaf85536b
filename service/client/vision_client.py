"""A small Python client for vision-serve (sync and async, on httpx)."""

from __future__ import annotations

import mimetypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.client import _defaults

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
    # The model's whole output before its activation, one float per class in index order: only when
    # asked for (``logits=True``), else None.
    logits: list[float] | None = None

    @property
    def top1(self) -> Prediction:
        return self.predictions[0]


class ClassifyError(Exception):
    """The server answered with an error status; ``detail`` is its explanation."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def _file(image: ImageInput) -> tuple[str, bytes, str]:
    """(file name, bytes, content type) of an image given as a path or as bytes."""
    if isinstance(image, (str, Path)):
        path = Path(image)
        return path.name, path.read_bytes(), mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return "image", image, "application/octet-stream"


def _query(top_k: int, logits: bool) -> dict[str, int | str]:
    """The query string: ``logits`` only when asked, so a plain request stays the cacheable one."""
    return {"top_k": top_k, "logits": "true"} if logits else {"top_k": top_k}


def _request_parts(image: ImageInput, top_k: int, logits: bool) -> tuple[bytes, dict[str, str], dict]:
    _, data, content_type = _file(image)
    return data, {"Content-Type": content_type}, _query(top_k, logits)


def _many_parts(images: Sequence[ImageInput], top_k: int, logits: bool) -> dict:
    """One multipart request with an ``image`` field per image (httpx's ``files`` and ``data``)."""
    if not images:
        raise ValueError("classify_many needs at least one image.")
    files = [("image", _file(image)) for image in images]
    params = {"logits": "true"} if logits else {}
    return {"files": files, "data": {"top_k": str(top_k)}, "params": params}


def _body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


def _classification(item: object, response: httpx.Response, batch_size: int | None) -> Classification:
    try:
        predictions = [Prediction(p["index"], p["label"], p["probability"]) for p in item["predictions"]]
        model, engine = item["model"], item["engine"]
        logits = [float(value) for value in item["logits"]] if "logits" in item else None
    except (TypeError, KeyError, ValueError):
        raise ClassifyError(200, f"Not a vision-serve answer: {response.text[:200]!r}") from None
    return Classification(
        predictions=predictions,
        model=model,
        engine=engine,
        latency_ms=response.elapsed.total_seconds() * 1e3,
        batch_size=batch_size,
        logits=logits,
    )


def _parse(response: httpx.Response) -> Classification:
    body = _body(response)
    if response.status_code != 200:
        detail = body.get("detail") if isinstance(body, dict) else None
        raise ClassifyError(response.status_code, str(detail or response.text or response.reason_phrase))
    batch_size = response.headers.get("X-Batch-Size")
    return _classification(body, response, int(batch_size) if batch_size else None)


def _parse_many(response: httpx.Response, count: int) -> list[Classification | ClassifyError]:
    """Each image's outcome; the request's own failure (overload, limits) raises ``ClassifyError``."""
    if count == 1:  # one image is answered in the single-image form
        try:
            return [_parse(response)]
        except ClassifyError as exc:
            if exc.status_code >= 500 or exc.status_code == 401:  # the request's failure, not the image's
                raise
            return [exc]
    body = _body(response)
    if response.status_code != 200:
        detail = body.get("detail") if isinstance(body, dict) else None
        raise ClassifyError(response.status_code, str(detail or response.text or response.reason_phrase))
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or len(results) != count:
        raise ClassifyError(200, f"Not a vision-serve answer for {count} images: {response.text[:200]!r}")
    outcomes: list[Classification | ClassifyError] = []
    for item in results:
        status = item.get("status_code") if isinstance(item, dict) else None
        if status == 200:
            outcomes.append(_classification(item, response, None))
        elif isinstance(status, int):
            outcomes.append(ClassifyError(status, str(item.get("detail", ""))))
        else:
            outcomes.append(ClassifyError(200, f"Not a vision-serve result: {item!r:.200}"))
    return outcomes


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class VisionClient:
    """``with VisionClient(url) as c: c.classify("cat.jpg").top1.label``

    ``api_key``: for a server started with ``--api-key``.
    """

    def __init__(
        self,
        url: str = _defaults.URL,
        *,
        timeout: float = _defaults.TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=url, timeout=timeout, headers=_auth_headers(api_key))

    def classify(self, image: ImageInput, *, top_k: int = _defaults.TOP_K, logits: bool = False) -> Classification:
        """``logits``: also the model's whole output (``Classification.logits``); such a request
        bypasses the server's response cache."""
        data, headers, params = _request_parts(image, top_k, logits)
        return _parse(self._http.post("/predict", content=data, headers=headers, params=params))

    def classify_many(
        self, images: Sequence[ImageInput], *, top_k: int = _defaults.TOP_K, logits: bool = False
    ) -> list[Classification | ClassifyError]:
        """Several images in one request: each image's ``Classification`` or its own ``ClassifyError``,
        in order. Raises ``ClassifyError`` when the request as a whole fails (overload, limits, key)."""
        return _parse_many(self._http.post("/predict", **_many_parts(images, top_k, logits)), len(images))

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
        url: str = _defaults.URL,
        *,
        timeout: float = _defaults.TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, headers=_auth_headers(api_key))

    async def classify(
        self, image: ImageInput, *, top_k: int = _defaults.TOP_K, logits: bool = False
    ) -> Classification:
        """As ``VisionClient.classify``."""
        data, headers, params = _request_parts(image, top_k, logits)
        return _parse(await self._http.post("/predict", content=data, headers=headers, params=params))

    async def classify_many(
        self, images: Sequence[ImageInput], *, top_k: int = _defaults.TOP_K, logits: bool = False
    ) -> list[Classification | ClassifyError]:
        """As ``VisionClient.classify_many``."""
        return _parse_many(await self._http.post("/predict", **_many_parts(images, top_k, logits)), len(images))

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
