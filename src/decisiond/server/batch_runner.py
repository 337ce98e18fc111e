"""Running batches (``POST /v1/batches``): each line of the input file through the whole pipeline as the key that
made the batch, answers and errors into the batch's output and error files, progress on the database.

A process's ``BatchRunner`` claims active batches no live process holds (``store.batches``), up to
``batches.max_running`` at once, and renews their leases while it runs them. A batch goes

- ``validating``: every line's ``url`` must be the batch's endpoint, else the batch ``failed`` with one error per
  line at fault (``errors``); then ``in_progress``;
- ``in_progress``: lines are read from the file one at a time and answered ``batches.concurrency`` at once, in the
  route's own dialect, exactly as ``POST <endpoint>`` answers them (``batch_pass``, ``batch_lines``), each leaving its
  usage row (request type ``batch``, the batch's id). Of lines that ask about one input, the first is answered before
  the others start, so that a local engine computes the input once (its prefix cache). A line refused by a rate limit
  (or by a full engine queue: 503 with a retry-after) waits as the refusal says and is asked again: a batch takes what
  the limits leave to interactive traffic. Any other refusal (a budget's 402, a guardrail's block, a bad body) is the
  line's answer, in the error file, and the batch goes on;
- ``finalizing``: the output and error files are written in line order from the stored answers (``batch_output``),
  then the batch is ``completed`` (or ``cancelled``, or ``expired`` — its unanswered lines then in the error file
  as ``batch_expired``) in the transaction that records them.

Exactly once: answered lines are stored with the batch's progress in one transaction (``BatchStore.save``), a group
at a time. A process killed mid-batch leaves its lease to run out (at once on the same host, where the next holder
first writes the dead one's usage journal, and with it the lines it answered: ``batch_takeover``); the next process
answers the lines not stored — some lines twice, then, but their usage rows have fixed ids (``Context.record_id``),
so each line leaves one usage row and is charged once, and its line appears once in the output. Memory stays
bounded: the input is read a line at a time, at most ``concurrency`` lines are in flight, answers go to the database
a group at a time, and the files are written from it a page at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..errors import one_line
from ..gateway.batch_settings import BatchesConfig
from ..gateway.service import Gateway
from ..limits import BATCH_MAX_ERRORS, BATCH_POLL_S
from ..store.batches import BatchStore
from ..store.processes import runner_name
from ..store.tables import BatchJob
from . import files_fs
from .batch_holder import BatchHolder, Stopped
from .batch_output import finalize
from .batch_pass import STOP_GRACE_S, BatchPass
from .batch_takeover import Stopping, replay_dead_holder

log = logging.getLogger("decisiond.batches")

# How often files past their expires_at, and temporary files of interrupted work (``files_fs.sweep``), are deleted.
FILE_EXPIRY_SCAN_S = 60.0


class BatchRunner:
    def __init__(self, gateway: Gateway, store: BatchStore, config: BatchesConfig,
                 clock: Callable[[], float] = time.time):
        self.gateway = gateway
        self.store = store
        self.config = config
        self.clock = clock
        self.name = runner_name()
        self.holder = BatchHolder(store, self.name, clock)
        self._wake = asyncio.Event()
        self._stopping = False
        self._running: dict[str, asyncio.Task[None]] = {}
        # Batches of this process found cancelled by the lease renewal (their lines waiting on a limit stop waiting).
        self._cancelling: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        files_fs.make_folder(self.store.folder)
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        """Look for work now (a batch was made or cancelled here)."""
        self._wake.set()

    async def aclose(self) -> None:
        """Stop: no new line starts; lines in flight get ``STOP_GRACE_S`` to finish; what is answered is stored
        and the leases are given back, so that the next process takes the batches up at once."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._running:
            tasks = list(self._running.values())
            _, late = await asyncio.wait(tasks, timeout=STOP_GRACE_S + 5)
            for task in late:  # their leases are given back as they stop (``_run``)
                task.cancel()
            if late:
                await asyncio.wait(late)

    async def _loop(self) -> None:
        renewed = expired = 0.0
        usage = self.gateway.usage
        if usage is not None:  # a dead process's answered lines reach the database before any line is answered again
            await usage.replayed.wait()
        while not self._stopping:
            try:
                while len(self._running) < self.config.max_running:
                    claimed = await self.store.claim(self.name, self.clock(), self.config.lease_s, set(self._running))
                    if claimed is None:
                        break
                    job, previous = claimed
                    self._running[job.id] = task = asyncio.create_task(self._run(job, previous), name=f"batch {job.id}")
                    task.add_done_callback(self._forget(job.id))
                if self.clock() - renewed >= self.config.lease_s / 3:
                    renewed = self.clock()
                    held, taken = await self.store.renew(list(self._running), self.name,
                                                         renewed + self.config.lease_s)
                    self._cancelling = {ident for ident, status in held.items() if status == "cancelling"}
                    for ident, task in list(self._running.items()):
                        if ident in taken:  # another process runs it now: this one stops
                            task.cancel()
                if self.clock() - expired >= FILE_EXPIRY_SCAN_S:
                    expired = self.clock()
                    await self._expire_files()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database: tried again at the next poll
                log.warning("batch runner: %s", one_line(error))
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(BATCH_POLL_S, self.config.lease_s / 3))

    def _forget(self, batch_id: str) -> Callable[[asyncio.Task[None]], None]:
        """A done callback: the batch's task is no longer running here."""
        def forget(done: asyncio.Task[None]) -> None:
            self._running.pop(batch_id, None)

        return forget

    async def _expire_files(self) -> None:
        """Housekeeping: files past their ``expires_at`` (not while an active batch reads them), answered lines
        left behind by finished batches, and temporary files of interrupted uploads and finalizings."""
        for file_id in await self.store.expired_files(int(self.clock())):
            if not await self.store.in_use(file_id):
                await self.store.delete_file(file_id)
        await self.store.sweep()
        await asyncio.to_thread(files_fs.sweep, self.store.folder)

    async def _run(self, job: BatchJob, previous: str | None = None) -> None:
        """Run the batch claimed from ``previous`` (its holder before, if any) from where it is to its end."""
        try:
            await replay_dead_holder(self.gateway.usage, previous, lambda: self._stopping)
            if job.status in ("validating", "in_progress") and self.clock() >= job.expires_at:
                job = await self.holder.set(job, status="finalizing", finalizing_at=int(self.clock()))
            if job.status == "validating":
                job = await self._validate(job)
            if job.status == "in_progress":
                job = await BatchPass(self.gateway, self.holder, self.config, job, lambda: self._stopping,
                                      lambda: job.id in self._cancelling).run()
            if job.status in ("finalizing", "cancelling"):
                await finalize(self.holder, job)
        except (Stopped, Stopping, asyncio.CancelledError):
            pass
        except Exception:  # a fault: the lease runs out and a process takes the batch up again
            log.exception("batch %s stopped by an error; it is taken up again later", job.id)
        finally:
            if self._stopping:
                with contextlib.suppress(Exception):
                    await self.store.release(job.id, self.name)

    async def _validate(self, job: BatchJob) -> BatchJob:
        """Every line's ``url`` is the batch's endpoint (the file's own shape was checked at upload)."""
        source = await self.store.file(job.input_file_id)
        if source is None:
            return await self.holder.missing(job)

        def scan() -> list[dict[str, Any]]:
            errors: list[dict[str, Any]] = []
            found = 0
            for n, raw in files_fs.request_lines(self.store.path(source)):
                url = orjson.loads(raw).get("url")
                if url != job.endpoint:
                    found += 1
                    if len(errors) < BATCH_MAX_ERRORS:
                        errors.append({"code": "invalid_url", "line": n + 1, "param": "url", "message":
                                       f"the url {str(url)[:100]!r} is not the batch's endpoint {job.endpoint}"})
            if found > len(errors):
                errors[-1]["message"] += f" ({found - len(errors)} more lines like it are not listed)"
            return errors

        errors = await asyncio.to_thread(scan)
        if errors:
            return await self.holder.set(job, status="failed", failed_at=int(self.clock()), errors=errors)
        return await self.holder.set(job, status="in_progress", in_progress_at=int(self.clock()))
