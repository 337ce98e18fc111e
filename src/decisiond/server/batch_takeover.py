"""Taking a batch over from a process of this host that died holding it (``BatchStore.claim`` takes its lease at
once): before any of its lines runs, the dead process's usage journal is written (``UsageWriter.replay_orphans``).

The lines a process answered in its last moments may be in its journal only: their records carry their answers,
which the usage writer stores as the batch's answered lines in the transaction that inserts their usage rows. Written
first, they are skipped by the new holder; not written, they would be asked again (the upstream asked twice), and in
a narrow race the output could keep an answer other than the one charged (the new answer finalized before the old
record, replayed later, is inserted and charged). The background scan for dead processes' journals runs only every
``USAGE_ORPHAN_SCAN_S``; this does not wait for it.

A holder on another host leaves its journal there (its host's processes write it); its lease runs out after
``batches.lease_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..errors import one_line
from ..gateway.usage_writer import UsageWriter
from ..limits import USAGE_RETRY_MAX_S
from ..store.processes import dead_pid

log = logging.getLogger("decisiond.batches")


class Stopping(Exception):
    """The process stops before the dead holder's journal could be written: the batch is left to the next one."""


async def replay_dead_holder(usage: UsageWriter | None, previous: str | None, stopping: Callable[[], bool]) -> None:
    """When ``previous`` (the holder a batch was claimed from) is a dead process of this host, return once its
    journal is in the database; tried again, with a growing pause, while the database refuses it (the batch's lease
    is renewed meanwhile). ``Stopping`` when ``stopping()`` turns true first. Nothing to do for a live, remote or
    absent holder, or without a journal."""
    pid = dead_pid(previous)
    if pid is None or usage is None:
        return
    pause = 0.25
    while True:
        try:
            await usage.replay_orphans(pid)
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if stopping():
                raise Stopping() from None
            log.warning("the usage journal of a dead batch holder is not written yet; retrying",
                        extra={"pid": pid, "retry_in_s": pause, "error": one_line(error)})
        await asyncio.sleep(pause)
        pause = min(pause * 2, USAGE_RETRY_MAX_S)
