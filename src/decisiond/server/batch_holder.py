"""A batch as the process that holds its lease moves it on (``batch_runner``): each change of its state is made
only while this process still holds it, at the database (``store.batches``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..store.batches import BatchStore
from ..store.tables import BatchJob


class Stopped(Exception):
    """The batch is no longer this process's (its lease was lost) or the process is stopping."""


class BatchHolder:
    """The batches' store as seen by the process named ``name`` (``store.processes.runner_name``), on ``clock``."""

    def __init__(self, store: BatchStore, name: str, clock: Callable[[], float] = time.time):
        self.store = store
        self.name = name
        self.clock = clock

    async def set(self, job: BatchJob, **values: Any) -> BatchJob:
        """The batch moved on from the status it has here; when it has meanwhile been cancelled, the batch as it
        now is (``cancelling``); ``Stopped`` when another process holds it."""
        if await self.store.set_state(job.id, self.name, job.status, values):
            for name, value in values.items():
                setattr(job, name, value)
            return job
        return await self.current(job)

    async def current(self, job: BatchJob) -> BatchJob:
        """The batch as the database has it now; ``Stopped`` when another process holds it."""
        now = await self.store.batch(job.id)
        if now is None or now.runner != self.name:
            raise Stopped()
        return now

    async def missing(self, job: BatchJob) -> BatchJob:
        """The batch ``failed``: its input file was deleted before it was done."""
        return await self.set(job, status="failed", failed_at=int(self.clock()), errors=[{
            "code": "file_not_found", "line": None, "param": "input_file_id",
            "message": f"the input file {job.input_file_id} was deleted before the batch was done"}])
