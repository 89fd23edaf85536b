"""The requests an inference worker has received and not yet taken, and the ones whose client left.

The HTTP processes name abandoned requests (their client left) on each worker's cancel channel, which overtakes the
request channel: a cancel may come before, or after, the request it names. ``WorkerQueue`` keeps
both: queued requests are dropped as soon as their cancel is read, and a cancel for a request not
received yet waits for it. Uids rise within each HTTP process and each channel keeps its order, so
a cancel for a uid at or below the last one received from that process, that matched nothing, names
a request taken already: it is forgotten.

Requests are taken oldest first, or newest first (``take(newest=True)``: the worker's collector
does so while clients are giving up, service/worker/collector.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from service.wire import QueuedRequest, RequestBatch


class WorkerQueue:
    """Received requests, oldest on the left, and the cancels not matched yet."""

    def __init__(self) -> None:
        self._queued: deque[QueuedRequest] = deque()
        self._cancelled: set[tuple[int, int]] = set()  # (HTTP process, uid)
        self._received_upto: dict[int, int] = {}  # per HTTP process, the last uid received

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, batch: RequestBatch) -> None:
        api_server = batch.api_server
        self._queued.extend(
            QueuedRequest(api_server, uid, request) for uid, request in zip(batch.uids, batch.requests, strict=True)
        )
        if batch.uids:
            self._received_upto[api_server] = batch.uids[-1]

    def take(self, newest: bool = False) -> QueuedRequest:
        return self._queued.pop() if newest else self._queued.popleft()

    def take_expired(self) -> list[QueuedRequest]:
        """The requests whose deadline has passed, wherever they are (deadlines differ from client to
        client, so not only the oldest): taken out, in one pass; the caller answers them."""
        now = time.monotonic()
        expired: list[QueuedRequest] = []
        kept: deque[QueuedRequest] = deque()
        for queued in self._queued:
            (expired if queued.request.expired(now) else kept).append(queued)
        if expired:
            self._queued = kept
        return expired

    def cancel(self, api_server: int, uids: Iterable[int]) -> list[QueuedRequest]:
        """These requests' client left: those of them queued here, now dropped (the caller answers them)."""
        self._cancelled.update((api_server, uid) for uid in uids)
        dropped: list[QueuedRequest] = []
        if self._queued:
            cancelled = self._cancelled
            kept: deque[QueuedRequest] = deque()
            for queued in self._queued:
                (dropped if (queued.api_server, queued.uid) in cancelled else kept).append(queued)
            self._queued = kept
        return dropped

    def abandoned(self, queued: QueuedRequest) -> bool:
        """Whether ``queued`` (just taken) has a cancel: its client left."""
        if not self._cancelled:
            return False
        key = (queued.api_server, queued.uid)
        if key in self._cancelled:
            self._cancelled.discard(key)
            return True
        return False

    def forget_matched(self) -> None:
        """Forget the cancels that can match nothing more: their request was received already and is no
        longer queued here (dropped, or taken: call this after checking the batch taken)."""
        if not self._cancelled:
            return
        queued = {(q.api_server, q.uid) for q in self._queued}
        received = self._received_upto
        self._cancelled = {key for key in self._cancelled if key[1] > received.get(key[0], -1) or key in queued}
