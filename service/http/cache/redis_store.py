"""The shared tier: Redis, asked with a bounded timeout and left alone after a failure.

One ``MGET`` per lookup under ``asyncio.wait_for``: a slow, stalled or dead Redis is a miss within the
timeout, never an error or a stall of the request. Writes are fire-and-forget ``SET ... EX ttl``, at most
``MAX_WRITES_IN_FLIGHT`` at a time (more are dropped: a cache may forget). After any failure the
breaker (breaker.py) makes no call at all for ``retry_after_s``.

The client is made on first use, in the running event loop: each HTTP process is forked from the main
process, and a client made before the fork would share its sockets with the other processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service import _defaults
from service.http.cache.breaker import Breaker
from service.metrics import metrics

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
MAX_WRITES_IN_FLIGHT = 64
# Beyond this many lookups waiting on Redis in one process, more are misses without a call: the pool's
# connections (one per call in flight) stay bounded, and a burst never meets "too many connections".
MAX_LOOKUPS_IN_FLIGHT = 128
# The sockets' own timeouts, which bound the background writes (a lookup is bounded by timeout_s): at
# least this long, so a write across a busy network is not cut at a lookup's few milliseconds.
MIN_SOCKET_TIMEOUT_S = 0.5
TIMEOUTS = (asyncio.TimeoutError, TimeoutError, redis.exceptions.TimeoutError)


def redacted_url(url: str) -> str:
    """``url`` with any password (``redis://user:PASSWORD@host``, ``?password=...``) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        credentials, host = netloc.rsplit("@", 1)
        user = credentials.split(":", 1)[0] if ":" in credentials else ""
        netloc = f"{user}:***@{host}" if ":" in credentials else f"***@{host}" if credentials else netloc
    query = [(name, "***" if name.lower() == "password" else value) for name, value in parse_qsl(parts.query, True)]
    if netloc == parts.netloc and all(value != "***" for _, value in query):
        return url
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    shown += f"?{urlencode(query, safe='*/')}" if query else ""
    return shown + (f"#{parts.fragment}" if parts.fragment else "")


class RedisStore:
    """Encoded answers in a Redis several replicas share. ``get_many`` and ``put`` never raise."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        ttl_s: float,
        retry_after_s: float = _defaults.RESPONSE_CACHE_REDIS_RETRY_AFTER_S,
    ) -> None:
        if urlsplit(url).scheme not in SCHEMES:
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {redacted_url(url)!r}.")
        if timeout_s <= 0 or ttl_s <= 0:
            raise ValueError(f"timeout_s and ttl_s must be > 0, got {timeout_s} and {ttl_s}.")
        self._url = url
        self.timeout_s = timeout_s
        self.ttl_ms = max(1, round(ttl_s * 1000))  # PX: a fractional TTL is kept
        self._breaker = Breaker(retry_after_s)
        self._client: redis.asyncio.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writes: set[asyncio.Task] = set()
        self._lookups = 0
        self.errors = 0  # failed calls in this process

    def _connected(self) -> redis.asyncio.Redis:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # first use, or a new loop (tests): a new pool
            socket_timeout = max(self.timeout_s, MIN_SOCKET_TIMEOUT_S)
            self._client = redis.asyncio.from_url(
                self._url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 0),  # no retry: a failure is a miss, and the breaker decides when to try
                max_connections=MAX_LOOKUPS_IN_FLIGHT + MAX_WRITES_IN_FLIGHT,
            )
            self._loop = loop
        return self._client

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, ``None`` where Redis has none; all ``None`` on any failure or after
        ``timeout_s``, and without a call while the breaker is open."""
        if not keys or self._lookups >= MAX_LOOKUPS_IN_FLIGHT or not self._breaker.allows():
            return [None] * len(keys)
        self._lookups += 1
        try:
            values = await asyncio.wait_for(self._connected().mget(list(keys)), self.timeout_s)
        except Exception as exc:  # any failure is a miss: the cache must never fail a request
            self._failed(exc, "lookup")
            return [None] * len(keys)
        finally:
            self._lookups -= 1
        self._succeeded()
        if not isinstance(values, list) or len(values) != len(keys):  # not what MGET answers: nothing usable
            return [None] * len(keys)
        return [value if isinstance(value, bytes) else None for value in values]

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` for the TTL, in the background; dropped while the breaker is open,
        outside an event loop, or when ``MAX_WRITES_IN_FLIGHT`` writes are already under way."""
        if len(self._writes) >= MAX_WRITES_IN_FLIGHT or not self._breaker.closed:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._write(key, value))
        except RuntimeError:  # no running loop
            return
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    async def _write(self, key: str, value: bytes) -> None:
        try:
            await self._connected().set(key, value, px=self.ttl_ms)
        except Exception as exc:  # nobody awaits this task: a failure is counted and logged, never raised
            self._failed(exc, "write")
        else:
            self._succeeded()

    def _failed(self, exc: Exception, call: str) -> None:
        reason = "timeout" if isinstance(exc, TIMEOUTS) else "error"
        self.errors += 1
        metrics().cache_redis_errors.labels(reason=reason).inc()
        if self._breaker.failed():  # once per outage, not per call
            log.warning(
                "Response cache: Redis %s failed (%s: %s); answering without Redis, next try in %.3g s.",
                call,
                reason,
                str(exc) or type(exc).__name__,
                self._breaker.retry_after_s,
            )

    def _succeeded(self) -> None:
        if self._breaker.succeeded():
            log.info("Response cache: Redis answers again.")

    @property
    def healthy(self) -> bool:
        """Whether the last call succeeded (or none was made yet): the breaker is closed."""
        return self._breaker.closed

    def describe(self) -> dict:
        """What /info shows: the URL without its password, whether Redis is used now, errors so far."""
        return {"url": redacted_url(self._url), "healthy": self.healthy, "errors": self.errors}

    async def close(self) -> None:
        """Drop the writes under way and close the connections (only in the loop that opened them)."""
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()
        self._loop = None
