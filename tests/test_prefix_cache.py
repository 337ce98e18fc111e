"""The prefix cache on its own: bounded in bytes of distinct parts, least recently used out first, and a lookup that
matches only a few tokens of an entry (the chat header every prompt shares) does not count as using it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from decisiond.engine.prefix_cache import PrefixCache, default_prefix_cache_bytes

HEADER = [1, 2, 3]


def doc(n: int, length: int = 20) -> list[int]:
    return HEADER + [1000 * n + i for i in range(length)]


def test_bounded_in_bytes_least_recently_used_first():
    cache = PrefixCache(max_bytes=250)
    for n in range(3):
        assert cache.put(doc(n), f"kv{n}", [(f"block{n}", 100)])
    assert cache.bytes == 200 and len(cache) == 2  # the first document went out
    assert cache.longest(doc(0))[0] == len(HEADER)
    assert cache.longest(doc(1) + [7]) == (len(doc(1)), "kv1")  # used: now the most recent
    cache.put(doc(3), "kv3", [("block3", 100)])
    assert cache.longest(doc(2))[0] == len(HEADER) and cache.longest(doc(1))[1] == "kv1"
    assert not cache.put(doc(4), "kv4", [("block4", 300)])  # larger than the whole budget: not stored


def test_a_header_only_match_does_not_keep_an_entry():
    cache = PrefixCache(max_bytes=250)
    cache.put(doc(0), "kv0", [("block0", 100)])
    cache.put(doc(1), "kv1", [("block1", 100)])
    for n in range(5, 9):  # new documents: each lookup matches the header of some entry
        assert cache.longest(doc(n))[0] == len(HEADER)
        cache.put(doc(n), f"kv{n}", [(f"block{n}", 100)])
    assert len(cache) == 2 and cache.longest(doc(8))[1] == "kv8" and cache.longest(doc(7))[1] == "kv7"


def test_shared_parts_count_once_and_go_with_the_last_holder():
    cache = PrefixCache(max_bytes=1215)
    cache.put(doc(0) + [50, 51], "q1", [("document", 400), ("q1", 10)])
    cache.put(doc(0) + [60, 61], "q2", [("document", 400), ("q2", 10)])
    assert cache.bytes == 420 and len(cache) == 2
    cache.put(doc(1), "other", [("other", 400)])
    cache.put(doc(2), "third", [("third", 400)])  # over the budget: q1 out, the document stays for q2
    assert cache.bytes == 1210 and len(cache) == 3 and cache.longest(doc(0) + [60, 61])[1] == "q2"
    for n in (3, 4, 5):  # "other", "third", then q2 go: the document's bytes with q2, its last holder
        cache.put(doc(n), n, [(n, 400)])
    assert cache.bytes == 1200 and cache.longest(doc(0))[0] == len(HEADER)


def test_an_extension_replaces_its_prefix():
    cache = PrefixCache(max_bytes=1000)
    cache.put(doc(0), "short", [("a", 100)])
    cache.put(doc(0) + [5, 6], "long", [("a", 100), ("b", 10)])
    assert len(cache) == 1 and cache.bytes == 110
    assert not cache.put(doc(0), "again", [("c", 100)])  # an entry holds these tokens already


def test_default_budget_is_sized_for_the_model():
    mib = 2**20
    # SmolLM2-135M in float32: 513 MiB of weights, 45 KiB of KV a token, 8,192 tokens of context.
    assert default_prefix_cache_bytes(513 * mib, 46080, 8192) == 513 * mib // 2
    # A short context: its whole KV.
    assert default_prefix_cache_bytes(513 * mib, 46080, 2048) == 46080 * 2048


def test_evicted_bytes_are_counted_once_per_part_released():
    cache = PrefixCache(max_bytes=1000)
    cache.put(doc(0) + [50], "q1", [("document", 400), ("q1", 10)])
    cache.put(doc(0) + [60], "q2", [("document", 400), ("q2", 10)])
    assert cache.take_evicted() == 0
    cache.make_room(585)  # q1 goes, the document stays with q2
    assert cache.take_evicted() == 10 and cache.take_evicted() == 0
    cache.make_room(1000)  # q2 goes and with it the document
    assert cache.take_evicted() == 410 and cache.bytes == 0
    cache.put(doc(1) + [70], "q3", [("other", 300)])
    cache.clear()  # what a clear lets go counts as evicted too
    assert cache.take_evicted() == 300 and cache.bytes == 0


RELEASE_CHECK = r"""
import sys
from decisiond.engine.memory import release_freed

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

warm = bytearray(2**20); del warm            # glibc raises its mmap threshold: 1 MiB blocks now come from the heap
blocks = [bytearray(b"x" * 2**20) for _ in range(400)]
del blocks[::2]                               # 200 MiB of holes between live blocks: no heap top to trim
before = rss_mib()
released = release_freed()
print(released, before, rss_mib())
"""


def test_memory_freed_between_live_blocks_goes_back_to_the_system():
    """What the engine relies on after the prefix cache evicts blocks (engine/memory.py): holes in glibc's heaps
    count in RSS until ``release_freed`` returns their pages."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heaps: Linux only")
    out = subprocess.run([sys.executable, "-c", RELEASE_CHECK], capture_output=True, text=True, check=True).stdout
    released, before, after = out.split()
    assert released == "True" and float(before) - float(after) > 150, out


def test_an_entry_replaced_by_its_extension_frees_only_what_the_extension_does_not_hold():
    cache = PrefixCache(max_bytes=1000)
    cache.put(doc(0), "document", [("document", 400)])
    cache.put(doc(0) + [50], "asked", [("document", 400), ("tail", 10)])  # replaces the document's entry
    assert len(cache) == 1 and cache.bytes == 410
    assert cache.take_evicted() == 0  # nothing was freed: the extension holds the document's block


def test_a_prefix_cache_of_size_zero_never_trims(tiny, monkeypatch):
    """``--prefix-cache-mb 0`` turns the cache off: it holds nothing, frees nothing, and ``malloc_trim`` never runs."""
    from decisiond.engine.backends import transformers as backend_module
    from decisiond.engine.backends.base import Group

    trims: list[int] = []
    monkeypatch.setattr(backend_module, "release_freed", lambda: trims.append(1) or True)
    backend = backend_module.TransformersBackend(tiny.model, "tiny", 64, prefix_cache_bytes=0)
    document = list(range(100, 300))
    backend.score([Group([document + [7, 8], document + [9]], [[5, 6], [5, 6]]), Group([[1, 2, 3]], [[5, 6]])])
    assert backend.stats.passes > 3 and trims == []


def test_glibc_is_found_without_a_subprocess(monkeypatch):
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc: Linux only")
    from decisiond.engine import memory

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess was started to find the C library")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    memory._libc.cache_clear()
    try:
        assert memory._libc() is not None and memory.release_freed() in (True, False)
    finally:
        memory._libc.cache_clear()
