"""Giving freed memory back to the system.

glibc's ``malloc`` serves allocations of up to its mmap threshold (128 KiB at first, raised up to 32 MiB as larger
blocks are freed) from heaps it keeps: a freed KV block of a short prompt (a few MiB) becomes a hole in a heap,
reused by later allocations that fit but still counted in the process's RSS. When the prefix cache evicts blocks
for a workload of another shape (short tickets, then long documents), those holes stay while the new blocks are
allocated, and the server's peak RSS grows by up to the cache's budget (benchmarks/ENGINE_NOTES.md).
``release_freed`` asks glibc to return whole free pages (``malloc_trim(0)``); the engine calls it once the prefix
cache has freed a quarter of its budget since the last call (``RELEASE_EVERY``), never when it frees nothing:
holes left by blocks of one shape are reused by the next blocks of that shape, so trimming after every eviction
would only make the allocator fault the same pages in again. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

RELEASE_EVERY = 4  # release once a 1/RELEASE_EVERY of the prefix cache's budget has been evicted


@functools.cache
def _libc() -> Any:
    """glibc, where this process has it (``None`` elsewhere): the C library already loaded into the process, looked
    up without ``ctypes.util.find_library`` (which runs ``ldconfig`` or a compiler in a subprocess)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed() -> bool:
    """Return the heaps' free pages to the system; whether anything was returned (False where unsupported)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc else False
