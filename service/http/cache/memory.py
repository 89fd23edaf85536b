"""The per-process tier: a least-recently-used map of key -> encoded answer, bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict

# What one entry costs beyond its key's and value's characters: the two bytes/str objects' headers, the
# OrderedDict's node and hash slot (about 50 + 33 + 100 bytes on 64-bit CPython), rounded up.
ENTRY_OVERHEAD_BYTES = 200


class MemoryCache:
    """A byte-bounded LRU. Synchronous and O(1) per call: one HTTP process's event loop owns it."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: nothing is kept), got {max_bytes}.")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def cost(key: str, value: bytes) -> int:
        return len(key) + len(value) + ENTRY_OVERHEAD_BYTES

    def get(self, key: str) -> bytes | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used entries to stay within
        ``max_bytes``; a value that alone would not fit is not kept (and the entries stay)."""
        cost = self.cost(key, value)
        if cost > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= self.cost(key, old)
        while self._bytes + cost > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self._bytes -= self.cost(evicted_key, evicted)
        self._entries[key] = value
        self._bytes += cost

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes
