"""The engine's two kinds of cache, both bounded and thread-safe.

- ``Lru``: a few entries keyed by client-controlled values (``chat_template_kwargs``, rendered questions): a
  client that sends a new value each time can fill it, so it holds at most ``entries`` values.
- ``PrefixCache``: values (a backend's KV cache) keyed by token sequences and bounded in bytes, least recently
  used out first. A lookup returns the entry that shares the longest prefix with the asked tokens, with the length
  shared: the first ``m`` tokens of an entry's KV cache depend only on those ``m`` tokens, so any shared prefix is
  reusable, not only exact matches. Entries may share memory (a document's KV under several extensions of it):
  each shared part is counted once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")


class Lru(Generic[V]):
    def __init__(self, entries: int):
        self.entries = entries
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            found = self._data.get(key)
            if found is not None:
                self._data.move_to_end(key)
            return found

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.entries:
                self._data.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The cached value, else ``make()`` (run outside the lock: two threads may both make it, once each)."""
        found = self.get(key)
        if found is None:
            found = make()
            self.put(key, found)
        return found

    def items(self) -> list[tuple[Hashable, V]]:
        """The entries, least recently used first (a copy: the cache may change meanwhile)."""
        with self._lock:
            return list(self._data.items())

    def __len__(self) -> int:
        return len(self._data)


def default_prefix_cache_bytes(weight_bytes: int, kv_bytes_per_token: int, context_length: int) -> int:
    """The prefix cache's default budget, sized for the model, not the machine: the KV cache of one full context
    window, at most half the weights' bytes (SmolLM2-135M in float32: 8,192 tokens × 45 KiB would be 360 MiB, so
    half of its 513 MiB of weights, 257 MiB: about 5,700 cached tokens, two or three ~2,000-token documents).
    Whatever the cache holds, the server holds in memory besides the weights; ``--prefix-cache-mb`` changes it."""
    return max(0, min(kv_bytes_per_token * context_length, weight_bytes // 2))


@dataclass
class _Part:
    """A part of the cached values' memory: its ``size`` in bytes and how many values hold it."""

    size: int
    holders: int = 0


class PrefixCache:
    """Least recently used values keyed by token prefixes, at most ``max_bytes`` in all.

    A value's memory is given as parts (``(id, bytes)``): values that share a part (prefixes of one document, each
    extended by its own question) count it once, and it is freed from the count when the last value holding it is
    evicted."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0  # bytes freed since the owner last took the count (``take_evicted``); read freely
        # key -> (tokens as an array for fast comparison, value, its parts)
        self._data: OrderedDict[tuple[int, ...], tuple[np.ndarray, Any, list[tuple[Hashable, int]]]] = OrderedDict()
        self._parts: dict[Hashable, _Part] = {}
        self._lock = threading.Lock()

    def longest(self, tokens: Sequence[int]) -> tuple[int, Any]:
        """``(m, value)``: the entry sharing the longest prefix with ``tokens`` (the most recently used of equals) and
        the ``m`` tokens shared; ``(0, None)`` when none shares a token. The entry counts as used only when the
        match covers at least half of it: every prompt shares the chat header with every entry, and refreshing
        whichever entry a header-only match lands on would keep that one forever and evict the others."""
        query = np.asarray(tokens, dtype=np.int64)
        best, best_key = 0, None
        with self._lock:
            for key, (array, _, _) in self._data.items():
                shared = _shared(array, query)
                if shared and shared >= best:
                    best, best_key = shared, key
            if best_key is None:
                return 0, None
            if 2 * best >= len(best_key):
                self._data.move_to_end(best_key)
            return best, self._data[best_key][1]

    def put(self, tokens: Sequence[int], value: Any, parts: Sequence[tuple[Hashable, int]]) -> bool:
        """Store ``value`` for ``tokens``, evicting least recently used entries to stay within the budget. Entries
        whose tokens are a prefix of ``tokens`` are dropped (the new one serves them); nothing is stored when an
        entry already extends ``tokens``. Returns whether it was stored."""
        key = tuple(tokens)
        if sum(size for _, size in parts) > self.max_bytes or not key:
            return False
        array = np.asarray(key, dtype=np.int64)
        with self._lock:
            replaced = []
            for other, (other_array, _, _) in self._data.items():
                shared = _shared(other_array, array)
                if shared == len(key):  # an entry holds these tokens already
                    self._data.move_to_end(other)
                    return False
                if shared == len(other):
                    replaced.append(other)
            self._data[key] = (array, value, list(parts))
            for part, size in parts:
                counted = self._parts.setdefault(part, _Part(size))
                counted.holders += 1
                self.bytes += size if counted.holders == 1 else 0
            for other in replaced:  # after the new entry holds its parts: the parts they share are not freed
                self._drop(other)
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._data)))
            return True

    def make_room(self, nbytes: int) -> None:
        """Evict least recently used entries until ``nbytes`` more fit the budget: called before a new block of KV
        is allocated, so that the block being computed (cached when done) is within the budget already."""
        with self._lock:
            while self._data and self.bytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._data)))

    def _drop(self, key: tuple[int, ...]) -> None:
        _, _, parts = self._data.pop(key)
        for part, size in parts:
            counted = self._parts[part]
            counted.holders -= 1
            if not counted.holders:
                del self._parts[part]
                self.bytes -= size
                self.evicted += size

    def take_evicted(self) -> int:
        """The bytes freed since the last call: parts no entry holds any longer (the owner then returns freed memory
        to the system)."""
        with self._lock:
            evicted, self.evicted = self.evicted, 0
            return evicted

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._parts.clear()
            self.evicted += self.bytes
            self.bytes = 0


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
