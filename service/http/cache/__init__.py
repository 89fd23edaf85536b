"""The response cache: a classification already answered is answered again without decoding the image
or running the model.

Consulted before any decode, keyed on the image's bytes (its sha256), the model version that answers
(a fingerprint of its name, version and ``ModelInfo``) and ``top_k`` (keys.py): a model swapped or
reloaded never answers from its predecessor's entries. What is kept is the model's answer (predictions,
model, engine) as compact JSON (codec.py, never pickle), which each protocol renders in its own form.

Two tiers (response_cache.py):

- memory (memory.py): per HTTP process, a least-recently-used map bounded in bytes
  (``--response-cache-mb``; 0: no cache at all);
- Redis (redis_store.py), optional (``--response-cache-redis``): shared by the processes and replicas.
  One ``MGET`` per lookup with a bounded timeout (``--response-cache-redis-timeout-ms``); a slow,
  stalled or dead Redis is a miss, never an error or a stall, and after a failure it is not asked for
  ``RESPONSE_CACHE_REDIS_RETRY_AFTER_S`` (breaker.py). Writes are fire-and-forget with a TTL
  (``--response-cache-redis-ttl-s``).

Only 200 answers are kept; an error is never cached. A hit is counted per image by tier
(``vision_serve_response_cache_hits_total{tier}``), a miss in ``..._misses_total``, a failed Redis call
in ``..._redis_errors_total{reason}``.
"""

from service.http.cache.response_cache import ResponseCache

__all__ = ["ResponseCache"]
