"""The requests an HTTP process has sent (or is about to send) to the workers and that no worker has
answered yet: held, whether or not anybody still waits for their answer.

A request is held from its submit until its fate is known: its worker answers it (every request a
worker receives is answered once, also one it drops: service/transport/channels.py), it is taken
out of a message not sent yet, its send fails, or its worker is failed or dropped. Only then does its
admission slot come back (``release``, the gate's: service/http/base/admission.py), so that what
``--max-queue`` admits bounds what is buffered on the way to the workers, whatever the deadlines: a
client that had its 504, or left, does not make room for another image while its own still waits in
a worker's pipe.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from service.metrics import metrics
from service.wire import Answer


class HeldRequests:
    """By uid: each held request's worker and the future its submitter awaits (done already once the
    submitter stopped waiting: a 504, a client that left); and how many each worker holds, and each
    worker process (``per_process``: the workers of a shared process share its cores)."""

    def __init__(self) -> None:
        self.release: Callable[[int], None] | None = None  # the admission gate's, set by the request pipeline
        self._entries: dict[int, tuple[int, int, asyncio.Future[Answer]]] = {}
        self.per_worker: defaultdict[int, int] = defaultdict(int)
        self.per_process: defaultdict[int, int] = defaultdict(int)
        # Worker id -> its process's pid, from the routing table (service/repository/table.py); a
        # worker not in it counts as a process of its own (keyed by its negated id, never a pid).
        self.process_of: dict[int, int] = {}

    def process(self, worker_id: int) -> int:
        return self.process_of.get(worker_id, -1 - worker_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, uid: int) -> bool:
        return uid in self._entries

    def add(self, uid: int, worker_id: int, future: asyncio.Future[Answer]) -> None:
        process = self.process(worker_id)  # kept: the table may move the worker before its answer
        self._entries[uid] = (worker_id, process, future)
        self.per_worker[worker_id] += 1
        self.per_process[process] += 1

    def worker_of(self, uid: int) -> int | None:
        entry = self._entries.get(uid)
        return None if entry is None else entry[0]

    def take(self, uid: int) -> asyncio.Future[Answer] | None:
        """``uid`` is held no more: its future, or ``None`` if it was not held. The caller ``let_go``es it."""
        entry = self._entries.pop(uid, None)
        if entry is None:
            return None
        worker_id, process, future = entry
        self.per_worker[worker_id] -= 1
        self.per_process[process] -= 1
        return future

    def settle(self, uid: int, answer: Answer) -> bool:
        """``uid``'s fate is known (``answer``): its submitter gets ``answer`` if it still waits; whether
        it was held (the caller ``let_go``es it)."""
        future = self.take(uid)
        if future is None:
            return False  # not held (any more): its worker was failed first
        if not future.done():
            future.set_result(answer)
        elif answer.batch_size:
            # Its client already had an answer (504, 503 for a dead worker) or left: the image was
            # decoded and run for nobody.
            metrics().images_unclaimed.inc()
        return True

    def settle_worker(self, worker_id: int, answer: Answer) -> int:
        """Settle every request ``worker_id`` holds with ``answer``; how many (for ``let_go``)."""
        uids = [uid for uid, (worker, _, _) in self._entries.items() if worker == worker_id]
        for uid in uids:
            self.settle(uid, answer)
        self.per_worker.pop(worker_id, None)
        return len(uids)

    def let_go(self, count: int) -> None:
        """``count`` requests are held no more: their admission slots come back."""
        release = self.release
        if count and release is not None:
            release(count)

    def clear(self) -> None:
        """Hold nothing (the sockets are gone)."""
        count = len(self._entries)
        self._entries.clear()
        self.per_worker.clear()
        self.per_process.clear()
        self.let_go(count)
