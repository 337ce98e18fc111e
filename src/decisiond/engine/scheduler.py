"""Batching across requests: one worker thread owns the backend and hands it batches of requests.

Callers (HTTP handlers through ``asyncio.wrap_future``, or plain threads) submit a job — the prompts of one
request with their label ids — and get a future. The worker takes the oldest job, then the jobs already queued
(waiting at most ``max_wait_s`` for more) while their estimated size stays within ``max_batch_tokens``, and gives
them to the backend together; the backend splits the work into forward passes within the same budget. Under load,
requests that arrive during a batch join the next; at low load nothing waits. The event loop never runs model
work, and submitting does no more than a common-prefix scan (callers submit from a worker thread).

A job is marked running when the worker takes it: a caller that gives up (a cancelled HTTP request) before then
is skipped, and one that gives up later can no longer cancel the future, so delivering a batch's results never
fails. An error in one job's results (non-finite log-probs) goes to that job only; an error of the backend itself
goes to every job of the batch, and the worker lives on.

One thread does all model math (``call`` runs other model work there too): on a CPU, two threads taking turns at
forward passes each bring their own math thread pool, and the pools slow each other down.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .backend import Backend, Group, Scored, check_finite
from .backends.transformers import DEFAULT_MAX_BATCH_TOKENS

log = logging.getLogger("decisiond.scheduler")

DEFAULT_MAX_WAIT_S = 0.002


@dataclass
class Job:
    group: Group
    # An upper bound of the tokens the job computes: its shared prefix once, plus each prompt's rest.
    size: int
    future: Future[Any] = field(default_factory=Future)  # -> Scored


@dataclass
class Call:
    """Other model work, run on the worker between batches."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass
class Stats:
    batches: int = 0
    jobs: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0

    @property
    def passes(self) -> int:  # the old name: batches handed to the backend
        return self.batches


class Scheduler:
    def __init__(self, backend: Backend, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S):
        self.backend = backend
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.stats = Stats()
        self._queue: queue.Queue[Job | Call] = queue.Queue()
        self._carry: Job | Call | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, prompts: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> Job:
        """Queue one request's prompts; ``job.future`` yields a ``Scored`` (label log-probs in prompt order)."""
        rows = [list(p) for p in prompts]
        shared = len(os.path.commonprefix(rows)) if rows else 0
        job = Job(Group(rows, [list(x) for x in labels]), shared + sum(len(p) - shared for p in rows))
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

    def _take(self, item: Job | Call) -> bool:
        """Mark ``item`` running; False when its caller has cancelled it (it is then dropped)."""
        if item.future.set_running_or_notify_cancel():
            return True
        self.stats.cancelled += 1
        return False

    def _next(self) -> list[Job] | Call:
        while True:
            first = self._carry or self._queue.get()
            self._carry = None
            if self._take(first):
                break
        if isinstance(first, Call):
            return first
        batch, size = [first], first.size
        deadline = time.monotonic() + self.max_wait_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(item, Call) or size + item.size > self.max_batch_tokens:
                self._carry = item
                break
            if self._take(item):
                batch.append(item)
                size += item.size
        return batch

    def _work(self) -> None:
        while True:
            item = self._next()
            if isinstance(item, Call):
                _deliver(item.future, item.fn)
                continue
            try:
                scored = self.backend.score([job.group for job in item])
            except BaseException as error:  # delivered to the callers; the worker lives on
                for job in item:
                    job.future.set_exception(error)
                continue
            self.stats.batches += 1
            self.stats.jobs += len(item)
            self.stats.prompt_tokens += sum(len(p) for job in item for p in job.group.prompts)
            for job, result in zip(item, scored):
                _deliver(job.future, functools.partial(_checked, result))


def _checked(scored: Scored) -> Scored:
    check_finite(scored)
    return scored


def _deliver(future: Future[Any], fn: Callable[[], Any]) -> None:
    """The value of ``fn()``, or its error, to a running future (which can no longer be cancelled)."""
    try:
        value = fn()
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(value)
