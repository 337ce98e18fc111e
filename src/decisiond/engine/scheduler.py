"""Batching across requests: one worker thread owns the model and runs batched forward passes.

Callers (HTTP handlers through ``asyncio.wrap_future``, or plain threads) submit a job — the prompts of one
request with their label ids — and get a future. The worker takes the oldest job, then the jobs already queued
(waiting at most ``max_wait_s`` for more) while the batch stays within ``max_batch_tokens`` padded tokens, and runs
them in one forward pass. Under load, requests that arrive during a pass are batched into the next; at low load
nothing waits. The event loop never runs model work.

One thread does all model math (``call`` runs other model work there too): on a CPU, two threads taking turns at
forward passes each bring their own math thread pool, and the pools slow each other down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .packing import PackedRow, split_rows
from .scorer import RowJob, Scorer

log = logging.getLogger("decisiond.scheduler")

# On a CPU a forward pass over ~1,000 tokens is as efficient as it gets: larger batches only add latency and memory.
DEFAULT_MAX_BATCH_TOKENS = 1024
DEFAULT_MAX_ROW_TOKENS = 1024
DEFAULT_MAX_WAIT_S = 0.002


@dataclass
class Job:
    prompts: list[list[int]]
    labels: list[list[int]]
    # Leading tokens every prompt shares that may come from the prefix cache (the chat template's header).
    prefix: tuple[int, ...]
    rows: list[tuple[list[int], PackedRow]]
    future: Future = field(default_factory=Future)

    @property
    def computed_tokens(self) -> int:
        """Tokens this job's own forward work covers: each shared token once, the cached prefix not at all."""
        if not self.rows:
            return sum(len(p) for p in self.prompts)
        return sum(len(row) for _, row in self.rows)


@dataclass
class Call:
    """Other model work, run on the worker between batches."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


@dataclass
class Stats:
    passes: int = 0
    jobs: int = 0
    rows: int = 0
    packed_tokens: int = 0
    padded_tokens: int = 0
    prompt_tokens: int = 0


class Scheduler:
    def __init__(self, scorer: Scorer, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS, max_wait_s: float = DEFAULT_MAX_WAIT_S):
        self.scorer = scorer
        self.max_batch_tokens = max_batch_tokens
        self.max_row_tokens = max_row_tokens
        self.max_wait_s = max_wait_s
        self.stats = Stats()
        self._queue: queue.Queue[Job | Call] = queue.Queue()
        self._carry: Job | Call | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, prompts: Sequence[Sequence[int]], labels: Sequence[Sequence[int]],
               prefix: Sequence[int] = ()) -> Job:
        """Queue one request's prompts; ``job.future`` yields their label log-probs, in prompt order."""
        prompts = [list(p) for p in prompts]
        prefix = tuple(prefix)
        if not self.scorer.packing or not all(len(p) > len(prefix) and tuple(p[:len(prefix)]) == prefix for p in prompts):
            prefix = ()
        rows = split_rows(prompts, self.max_row_tokens, len(prefix)) if self.scorer.packing else []
        job = Job(prompts, [list(x) for x in labels], prefix, rows)
        self._put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread and return its result."""
        task = Call(fn)
        self._put(task)
        return task.future.result()

    def _put(self, item: Job | Call) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="decisiond-scorer", daemon=True)
                self._thread.start()
        self._queue.put(item)

    # ------------------------------------------------------------------------------------ worker

    def _next(self) -> list[Job] | Call:
        first = self._carry or self._queue.get()
        self._carry = None
        if isinstance(first, Call):
            return first
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(item, Call) or item.prefix != first.prefix or self._cost(batch + [item]) > self.max_batch_tokens:
                self._carry = item
                break
            batch.append(item)
        return batch

    @staticmethod
    def _cost(jobs: list[Job]) -> int:
        """Padded tokens of a batch: rows × the longest row."""
        rows = [len(row) for job in jobs for _, row in job.rows]
        return len(rows) * max(rows) if rows else 0

    def _work(self) -> None:
        while True:
            item = self._next()
            items = [item] if isinstance(item, Call) else item
            try:
                if isinstance(item, Call):
                    item.future.set_result(item.fn())
                else:
                    self._execute(item)
            except BaseException as error:  # delivered to the callers; the worker lives on
                for one in items:
                    if not one.future.done():
                        one.future.set_exception(error)

    def _execute(self, batch: list[Job]) -> None:
        self.stats.jobs += len(batch)
        if not self.scorer.packing:
            for job in batch:
                job.future.set_result([self.scorer.reference(p, lab) for p, lab in zip(job.prompts, job.labels)])
                self.stats.passes += len(job.prompts)
            return
        row_jobs, owners = [], []
        for job in batch:
            for members, row in job.rows:
                row_jobs.append(RowJob(row, [job.labels[i] for i in members]))
                owners.append((job, members))
        collected: dict[int, dict[int, list[float]]] = {}
        # A job of many rows (hundreds of questions) is split over several passes, each within the token budget.
        start = 0
        while start < len(row_jobs):
            end = start + 1
            while end < len(row_jobs) and (end + 1 - start) * max(len(r.row) for r in row_jobs[start:end + 1]) \
                    <= self.max_batch_tokens:
                end += 1
            chunk = row_jobs[start:end]
            for (job, members), values in zip(owners[start:end], self.scorer.packed(chunk, batch[0].prefix)):
                collected.setdefault(id(job), {}).update(zip(members, values))
            self.stats.passes += 1
            self.stats.rows += len(chunk)
            self.stats.packed_tokens += sum(len(r.row) for r in chunk)
            self.stats.padded_tokens += len(chunk) * max(len(r.row) for r in chunk)
            start = end
        for job in batch:
            slot = collected[id(job)]
            job.future.set_result([slot[i] for i in range(len(job.prompts))])
        self.stats.prompt_tokens += sum(len(p) for job in batch for p in job.prompts)
