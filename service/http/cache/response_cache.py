"""One HTTP process's response cache: the memory tier in front of the optional Redis tier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from service.http.cache import codec
from service.http.cache.keys import cache_key, model_fingerprint
from service.http.cache.memory import MemoryCache
from service.metrics import metrics
from service.model_info import ModelInfo
from service.repository.table import VersionRoute
from service.settings import ServeSettings
from service.wire import Answer

if TYPE_CHECKING:  # redis is the optional `cache` extra: imported only when a Redis URL is given
    from service.http.cache.redis_store import RedisStore

MIB = 1 << 20


class ResponseCache:
    """Answers by key (keys.py): memory first, then Redis for the misses, in one call. Lookups never
    raise and never wait longer than the Redis timeout."""

    def __init__(self, max_bytes: int, redis: RedisStore | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0 (no cache: make none), got {max_bytes}.")
        self.memory = MemoryCache(max_bytes)
        self.redis = redis
        # This process's own counts (each HTTP process has its own cache): /info shows the process that
        # answered it; the Prometheus counters add up every process.
        self.hits = {"memory": 0, "redis": 0}
        self.misses = 0
        # Values read back that failed the checks against the model and the request (misses too).
        self.rejected = {"memory": 0, "redis": 0}

    @classmethod
    def from_settings(cls, settings: ServeSettings) -> ResponseCache | None:
        """The cache ``settings`` ask for; ``None`` when ``response_cache_mb`` is 0 (off). Makes no
        connection: call it in each HTTP process (Redis is first asked in its event loop)."""
        if settings.response_cache_mb == 0:
            return None
        redis = None
        if settings.response_cache_redis:
            from service.http.cache.redis_store import RedisStore

            redis = RedisStore(
                settings.response_cache_redis,
                timeout_s=settings.response_cache_redis_timeout_ms / 1000,
                ttl_s=settings.response_cache_redis_ttl_s,
            )
        return cls(settings.response_cache_mb * MIB, redis)

    def keys(self, images: Sequence[bytes], route: VersionRoute, top_k: int) -> list[str]:
        """The key of each image's answer from ``route``'s model with ``top_k`` labels."""
        fingerprint = model_fingerprint(route)
        return [cache_key(image, fingerprint, top_k) for image in images]

    async def lookup(self, keys: Sequence[str], model: ModelInfo, top_k: int) -> list[Answer | None]:
        """Each key's cached answer (a new ``Answer`` each time: callers may change its ``timings_ms``),
        ``None`` for a miss; ``keys`` are those of ``model``'s answers with ``top_k`` labels, against
        which every value read back is checked (codec.py): one that fails is a miss, counted."""
        answers: list[Answer | None] = [None] * len(keys)
        memory_hits = redis_hits = 0
        for index, key in enumerate(keys):
            value = self.memory.get(key)
            if value is not None:
                answers[index] = self._checked(value, model, top_k, "memory")
                memory_hits += answers[index] is not None
        missing = [index for index, answer in enumerate(answers) if answer is None]
        if missing and self.redis is not None:
            values = await self.redis.get_many([keys[index] for index in missing])
            for index, value in zip(missing, values, strict=True):
                if value is None:
                    continue
                answer = self._checked(value, model, top_k, "redis")
                if answer is not None:
                    answers[index] = answer
                    self.memory.put(keys[index], value)
                    redis_hits += 1
        self._count(memory_hits, redis_hits, len(keys) - memory_hits - redis_hits)
        return answers

    def store(self, key: str, answer: Answer) -> None:
        """Keep ``answer`` under ``key``: in memory now, in Redis in the background. Only a 200 with
        predictions is kept; any other answer (an error, a shed or expired request) is not."""
        if answer.status_code != 200 or answer.predictions is None:
            return
        value = codec.encode(answer)
        self.memory.put(key, value)
        if self.redis is not None:
            self.redis.put(key, value)

    def stats(self) -> dict:
        """What /info shows. ``hits`` (both tiers) and ``misses`` count this HTTP process's lookups only;
        ``vision_serve_response_cache_*`` in /metrics count every process's."""
        return {
            "max_mb": round(self.memory.max_bytes / MIB, 3),
            "entries": self.memory.entries,
            "bytes": self.memory.bytes_used,
            "hits": sum(self.hits.values()),
            "misses": self.misses,
            "rejected": sum(self.rejected.values()),
            "redis": self.redis.describe() if self.redis is not None else None,
        }

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()

    def _checked(self, value: bytes, model: ModelInfo, top_k: int, tier: str) -> Answer | None:
        answer = codec.decode(value, model, top_k)
        if answer is None:
            self.rejected[tier] += 1
            metrics().cache_rejected_in(tier).inc()
        return answer

    def _count(self, memory_hits: int, redis_hits: int, misses: int) -> None:
        self.hits["memory"] += memory_hits
        self.hits["redis"] += redis_hits
        self.misses += misses
        recorded = metrics()
        if memory_hits:
            recorded.cache_hits_in("memory").inc(memory_hits)
        if redis_hits:
            recorded.cache_hits_in("redis").inc(redis_hits)
        if misses:
            recorded.cache_misses.inc(misses)
