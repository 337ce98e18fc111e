"""One pass over an ``in_progress`` batch's input (``batch_runner``): the lines not answered yet, read one at a time
and answered ``batches.concurrency`` at once (``batch_lines``), stored a group at a time with the batch's progress
(``BatchStore.save``), until the input ends, the batch is cancelled or expires, or the process stops.

Of lines that ask about one input, the first is answered alone and the others once it is, so that the engine
computes the input once and takes it from its prefix cache for them (packed together, each would compute it again).
Lines are keyed by a digest of the body without its questions (``batch_lines.input_key``); the last ``WARM_INPUTS``
inputs answered are remembered (their lines wait for nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson

from ..errors import DecisionError
from ..gateway.batch_settings import BatchesConfig
from ..gateway.service import Gateway
from ..gateway.types import Caller
from ..limits import BATCH_FLUSH_LINES, BATCH_FLUSH_S, BATCH_MAX_AHEAD
from ..store.batches import Result
from ..store.tables import BatchJob
from .batch_holder import BatchHolder, Stopped
from .batch_lines import ENDPOINTS, answer_line, caller_of, input_key, line_result, request_id
from .middleware import INTERNAL_ERROR
from .routes import DecisionRoute

log = logging.getLogger("decisiond.batches")

# How often a running batch reads its key again (a revoked key's lines are refused from then on).
CALLER_CHECK_S = 5.0
# Inputs a running batch remembers as computed.
WARM_INPUTS = 4096
# How long a stopping runner lets the lines in flight finish before it cancels them.
STOP_GRACE_S = 5.0


class AnsweredLines:
    """The line numbers already answered, from an ascending iterator of them, asked in ascending order whether
    they hold a given one."""

    def __init__(self, lines: AsyncIterator[int]):
        self.lines = lines
        self.head: int | None = -1

    async def has(self, n: int) -> bool:
        while self.head is not None and self.head < n:
            self.head = await anext(self.lines, None)
        return self.head == n


class BatchPass:
    """One pass over ``job``'s unanswered lines, as the process of ``holder`` runs it. ``stopping()``: the process
    is stopping; ``cancelled()``: the batch was found cancelled meanwhile (its lines waiting on a limit stop)."""

    def __init__(self, gateway: Gateway, holder: BatchHolder, config: BatchesConfig, job: BatchJob,
                 stopping: Callable[[], bool], cancelled: Callable[[], bool]):
        self.gateway, self.holder, self.job = gateway, holder, job
        self.stopping, self.cancelled = stopping, cancelled
        self.slots = asyncio.Semaphore(config.concurrency)
        self.pending: set[int] = set()  # lines in flight
        self.abandoned: set[int] = set()  # lines stopped unanswered (stopping, cancelled, expired): not done
        self.tasks: set[asyncio.Task[None]] = set()
        self.answered: list[Result] = []  # answered lines not stored yet
        self.progress = asyncio.Event()  # a line is done
        self.cursor = job.next_line  # the line after the last one read
        self.status = job.status  # the batch's status at the last store
        self.flushed = time.monotonic()
        self.first: dict[bytes, asyncio.Future[None]] = {}  # inputs whose first line is being answered
        self.warm: OrderedDict[bytes, None] = OrderedDict()  # inputs computed

    def going(self) -> bool:
        """Whether lines may still start (or go on waiting out a limit)."""
        return not (self.stopping() or self.status == "cancelling" or self.cancelled()
                    or self.holder.clock() >= self.job.expires_at)

    async def run(self) -> BatchJob:
        """Answer the lines not answered yet, storing them a group at a time; then ``finalizing`` — or the batch as
        it is when it was cancelled meanwhile (``cancelling``). ``Stopped`` when the process stops."""
        job, holder = self.job, self.holder
        source = await holder.store.file(job.input_file_id)
        if source is None:
            return await holder.missing(job)
        try:
            read_all = await self._read(holder.store.path(source), ENDPOINTS[job.endpoint])
            await self._drain()
            await self._flush()
        except BaseException:
            for task in self.tasks:
                task.cancel()
            raise
        if self.stopping():
            raise Stopped()
        if self.status == "cancelling" or self.cancelled():
            return await holder.current(job)
        if (read_all and not self.abandoned) or holder.clock() >= job.expires_at:
            return await holder.set(job, status="finalizing", finalizing_at=int(holder.clock()))
        return job

    async def _read(self, path: Path, route: DecisionRoute) -> bool:
        """Start a task for each line not answered yet, a slot at a time; whether the whole input was read."""
        job = self.job
        done = AnsweredLines(self.holder.store.done_lines(job.id, job.next_line))
        caller = await caller_of(self.gateway, job)
        checked = time.monotonic()
        with path.open("rb") as file:
            for n, raw in enumerate(file):
                if n < job.next_line or await done.has(n) or not raw.strip():
                    self.cursor = n + 1
                    continue
                await self._within_reach(n)
                if not await self._slot():
                    return False
                if time.monotonic() - checked >= CALLER_CHECK_S:  # a key revoked meanwhile is seen
                    checked, caller = time.monotonic(), await caller_of(self.gateway, job)
                self.pending.add(n)
                self.cursor = n + 1
                task = asyncio.create_task(self._answer(n, raw, caller, route))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        return True

    async def _within_reach(self, n: int) -> None:
        """Waits while line ``n`` is too far past the oldest line in flight: a slow line holds the stored progress
        back, and the lines answered past it are bounded, so that what a restart reads back (``done_lines``) stays
        small."""
        while self.pending and n - min(self.pending) >= BATCH_MAX_AHEAD and self.going():
            self.progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.progress.wait(), BATCH_FLUSH_S)

    async def _slot(self) -> bool:
        """A slot for a line, looking every ``BATCH_FLUSH_S`` meanwhile at what was answered (stored) and whether to
        go on (a stop, a cancel, the window's end do not wait for a slot); False when the pass is to end."""
        slot = False
        while self.going():
            try:
                slot = bool(await asyncio.wait_for(self.slots.acquire(), BATCH_FLUSH_S))
            except asyncio.TimeoutError:
                pass
            if self.answered and (len(self.answered) >= BATCH_FLUSH_LINES
                                  or time.monotonic() - self.flushed >= BATCH_FLUSH_S):
                await self._flush()
            if slot:
                break
        if not slot or not self.going():
            if slot:
                self.slots.release()
            return False
        return True

    async def _drain(self) -> None:
        """Waits for the lines in flight, storing what they answer; a stopping process gives them
        ``STOP_GRACE_S``, then cancels them."""
        while self.tasks:
            _, late = await asyncio.wait(set(self.tasks), timeout=BATCH_FLUSH_S)
            if self.answered:
                await self._flush()  # also tells of a cancel, which stops the lines that wait on a limit
            if late and self.stopping():
                _, late = await asyncio.wait(late, timeout=STOP_GRACE_S)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late)

    async def _flush(self) -> None:
        """The lines answered so far stored, with the progress before the first line not done; the batch's status
        as stored (``cancelling`` once cancelled). ``Stopped`` when another process holds the batch."""
        group = list(self.answered)
        self.answered.clear()
        self.flushed = time.monotonic()
        saved = await self.holder.store.save(self.job.id, self.holder.name, group,
                                             min(self.pending | self.abandoned, default=self.cursor))
        if saved is None:
            raise Stopped()
        self.status = saved

    async def _answer(self, n: int, raw: bytes, caller: Caller | DecisionError, route: DecisionRoute) -> None:
        """Line ``n`` answered (after the first line of its input), its answer kept for the next store; a line
        stopped unanswered is abandoned (not done)."""
        item: dict[str, Any] = {}
        key: bytes | None = None
        mine: asyncio.Future[None] | None = None
        result: Result | None = None
        try:
            item = orjson.loads(raw)  # checked at upload: an object with a custom_id and an object body
            key = input_key(item["body"])
            mine = await self._after_first(key)
            result = await answer_line(self.gateway, self.job, route, n, item, caller, self.going)
        except Stopped:  # stopped while the line waited out a limit: left for later
            pass
        except Exception:  # a fault outside the pipeline (which answers its own): the line's answer is a 500
            log.exception("batch %s line %d", self.job.id, n + 1)
            status_code, body = route.early_error(INTERNAL_ERROR, None)
            result = line_result(n, request_id(self.job.id, n), item.get("custom_id"), status_code, body, None)
        finally:
            if mine is not None and key is not None:
                self._warmed(key, mine)
            if result is not None:
                self.answered.append(result)
            else:  # cancelled or stopped: not done, so the stored progress stays before it
                self.abandoned.add(n)
            self.pending.discard(n)
            self.slots.release()
            self.progress.set()

    async def _after_first(self, key: bytes | None) -> asyncio.Future[None] | None:
        """Waits for the first line of input ``key`` when another is it; the future to settle when this line is
        the first (None otherwise)."""
        if key is None or key in self.warm:
            return None
        ahead = self.first.get(key)
        if ahead is None:
            self.first[key] = mine = asyncio.get_running_loop().create_future()
            return mine
        await asyncio.shield(ahead)
        return None

    def _warmed(self, key: bytes, mine: asyncio.Future[None]) -> None:
        """The first line of input ``key`` is done: the lines waiting for it go on, and the input is warm."""
        mine.set_result(None)
        self.first.pop(key, None)
        self.warm[key] = None
        if len(self.warm) > WARM_INPUTS:
            self.warm.popitem(last=False)
