"""The engine's two kinds of cache, both bounded and thread-safe.

- ``Lru``: a few entries keyed by client-controlled values (``chat_template_kwargs``, rendered questions): a
  client that sends a new value each time can fill it, so it holds at most ``entries`` values.
- ``PrefixCache``: values (a backend's KV cache) keyed by token sequences and bounded in bytes. A lookup returns
  the entry that shares the longest prefix with the asked tokens, with the length shared: the first ``m`` tokens
  of an entry's KV cache depend only on those ``m`` tokens, so any shared prefix is reusable, not only exact
  matches.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
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

    def __len__(self) -> int:
        return len(self._data)


def default_prefix_cache_bytes() -> int:
    """A sixteenth of the machine's memory, at most 2 GiB."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return min(memory // 16, 2 << 30)


class PrefixCache:
    """Least recently used values keyed by token prefixes, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        # key -> (tokens as an array for fast comparison, value, size in bytes)
        self._data: OrderedDict[tuple[int, ...], tuple[np.ndarray, Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def longest(self, tokens: Sequence[int]) -> tuple[int, Any]:
        """``(m, value)``: the entry sharing the longest prefix with ``tokens`` and the ``m`` tokens shared; ``(0,
        None)`` when none shares a token."""
        query = np.asarray(tokens, dtype=np.int64)
        best, best_key = 0, None
        with self._lock:
            for key, (array, _, _) in self._data.items():
                shared = _shared(array, query)
                if shared > best:
                    best, best_key = shared, key
            if best_key is None:
                return 0, None
            self._data.move_to_end(best_key)
            return best, self._data[best_key][1]

    def put(self, tokens: Sequence[int], value: Any, nbytes: int) -> bool:
        """Store ``value`` for ``tokens``, evicting least recently used entries to stay within the budget. Entries
        whose tokens are a prefix of ``tokens`` are dropped (the new one serves them); nothing is stored when an
        entry already extends ``tokens``. Returns whether it was stored."""
        key = tuple(tokens)
        if nbytes > self.max_bytes or not key:
            return False
        array = np.asarray(key, dtype=np.int64)
        with self._lock:
            for other, (other_array, _, size) in list(self._data.items()):
                shared = _shared(other_array, array)
                if shared == len(key):  # an entry holds these tokens already
                    self._data.move_to_end(other)
                    return False
                if shared == len(other):
                    del self._data[other]
                    self.bytes -= size
            self._data[key] = (array, value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, _, size) = self._data.popitem(last=False)
                self.bytes -= size
            return True

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.bytes = 0


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
