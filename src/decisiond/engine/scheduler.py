"""Batching, admission and fairness across requests: one worker thread owns the backend.

Callers (HTTP handlers through ``asyncio.wrap_future``, or plain threads) submit a job — the prompts of one
request with their label ids — and get a ``Ticket`` whose future yields the answer. Top to bottom:

1. **Admission** (``submit``, in the caller's thread). A job's size is the tokens it makes the model compute
   after prefix sharing (its shared prefix once, plus each prompt's rest). Over ``max_request_tokens`` it is
   refused (400). When the tokens admitted and not yet computed would go over ``max_queued_tokens``, it is
   refused with 503 and a ``retry-after-ms`` estimated from the measured rate, which both SDKs honour; the first
   request so refused keeps a reservation for its retry, so small requests cannot starve a large one. A job
   identical to one still queued or running (an SDK retry of a request whose first attempt timed out) joins it
   instead: one computation, every caller answered.
2. **Batching.** The worker takes the oldest waiting job and, while their sizes stay within ``max_batch_tokens``,
   the jobs queued behind it (waiting at most ``max_wait_s`` for more when it is idle): a *run*. The backend splits
   a run into forward passes within the same budget.
3. **Interleaving.** Runs advance one forward pass at a time (``backend.steps``). The worker steps the run whose
   requests have had the fewest tokens computed so far (least attained service) — unless a run has waited
   ``STARVE_S`` for its next pass. A small request behind a long document is answered after a pass or two, a long
   one still progresses under a stream of small ones, and requests of one size are served in turn (least work left
   first let new small requests overtake older ones again and again: p95 three times p50 under 16 clients). Pass
   sizes: ``_step_budget``; a large run's passes stay short for ``CONTENDED_GRACE_S`` after a small run is
   answered, for the next request of a client that sends one when the last is answered. Small runs start at once,
   at most ``MAX_LARGE_RUNS`` larger ones at a time.
4. **Cancellation.** A caller that gives up cancels its ticket's future (``asyncio`` does this when the HTTP
   handler is cancelled: client gone, deadline passed). A job whose callers have all gone is dropped while queued,
   and a run whose jobs have all gone is stopped between passes — after ``ABANDON_GRACE_S``, so that the retry of
   an SDK whose read timed out joins the work already done instead of starting over. Cancelling never disturbs the
   other jobs of a run.

An error in one job's results (non-finite log-probs) goes to that job only; an error of the backend itself goes to
every job of the run, and the worker lives on. One thread does all model math (``call`` runs other model work
there too): on a CPU, two threads taking turns at forward passes each bring their own math thread pool, and the
pools slow each other down.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ..errors import LimitExceeded, Unavailable
from ..limits import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS
from .backends.base import Backend, Group, PacedBackend, Scored, Steps, check_finite, stepwise

log = logging.getLogger("decisiond.scheduler")

DEFAULT_MAX_WAIT_S = 0.002
# The longest a run waits for its next pass while runs that have had less service go first.
STARVE_S = 1.0
# A large run's passes: max_batch_tokens / CONTENDED_DIVISOR tokens (not under MIN_STEP_TOKENS) while other runs are
# open or waiting; alone, max_batch_tokens / ALONE_DIVISOR (as fast per token on a CPU, a shorter wait for others).
CONTENDED_DIVISOR = 8
ALONE_DIVISOR = 2
# A large run stays in short passes this long after a small run was answered: a client that sends its next small
# request when the last one is answered (a loop over tickets) finds it between two short passes, not behind a long one.
CONTENDED_GRACE_S = 0.25
MIN_STEP_TOKENS = 128
# Each open large run holds its document's KV besides the prefix cache: one at a time bounds the server's memory.
MAX_LARGE_RUNS = 1
# How long the work of a request whose callers have all gone goes on, waiting for a retry to join it (the TypeSafe
# SDK retries a timed-out POST after about 0.5 s, then 1 s, with the same bytes).
ABANDON_GRACE_S = 2.0
# The longest retry-after given: a client then asks again (and, refused, gets a new estimate).
MAX_RETRY_AFTER_MS = 10_000
# How long after its retry-after a refused request's reservation waits for the retry.
RESERVATION_GRACE_S = 2.0
# Until a rate is measured: tokens a second, for retry-after estimates.
_INITIAL_RATE = 2000.0


@dataclass(eq=False)
class Job:
    group: Group
    # The tokens the job computes: its shared prefix once, plus each prompt's rest.
    size: int
    key: tuple[Any, ...]
    waiters: list[Future[Scored]] = field(default_factory=list)
    left_at: float | None = None  # when its last caller cancelled (None while someone waits)
    run: Run | None = None  # the run computing it, once started

    @property
    def future(self) -> Future[Scored]:
        """The first caller's future (for callers that submitted it directly)."""
        return self.waiters[0]


@dataclass(eq=False)
class Ticket:
    """One caller's claim on a job: its own future, cancellable without touching the other callers'."""

    job: Job
    future: Future[Scored]
    joined: bool = False  # another caller's identical request was already queued or computing
    submitted: float = field(default_factory=time.monotonic)  # for its traces: its wait is run.started - submitted

    @property
    def group(self) -> Group:
        return self.job.group


@dataclass(frozen=True)
class RetryReservation:
    """Room kept for the retry of the first request refused for room: its job ``key``, its ``size`` in tokens, and
    when the reservation lapses (``time.monotonic()``)."""

    key: tuple[Any, ...]
    size: int
    expires: float


@dataclass
class Call:
    """Other model work, run on the worker between passes."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass(eq=False)
class Run:
    jobs: list[Job]
    steps: Steps
    size: int
    done: int = 0
    last: float = field(default_factory=time.monotonic)
    # When it started and ended (``time.monotonic()``, on the worker) and its forward passes: read by traces.
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    passes: int = 0


@dataclass
class Stats:
    """The scheduler's counters. A *run* is a batch of jobs handed to the backend at once; a *step* is one of its
    forward passes (the backend counts its own passes in ``backends.transformers.Stats.passes``)."""

    runs: int = 0  # runs completed
    jobs: int = 0  # jobs answered
    joined: int = 0  # submissions that joined an identical job
    cancelled: int = 0  # jobs dropped or stopped because every caller had gone
    refused: int = 0  # submissions refused by admission control
    steps: int = 0  # steps taken
    prompt_tokens: int = 0  # prompt tokens of answered jobs


class Scheduler:
    def __init__(self, backend: Backend, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS, abandon_grace_s: float | None = None):
        if max_queued_tokens < max_request_tokens:
            raise ValueError(f"max_queued_tokens ({max_queued_tokens}) must be at least max_request_tokens "
                             f"({max_request_tokens})")
        self.backend = backend
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_request_tokens = max_request_tokens
        self.max_queued_tokens = max_queued_tokens
        self.abandon_grace_s = ABANDON_GRACE_S if abandon_grace_s is None else abandon_grace_s
        self.stats = Stats()
        self.queued_tokens = 0  # admitted and not yet answered, dropped or stopped
        self.rate = _INITIAL_RATE  # tokens a second, measured over passes
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._calls: deque[Call] = deque()
        self._running: list[Run] = []
        self._inflight: dict[tuple[Any, ...], Job] = {}
        # The request refused first, whose retry is admitted before others.
        self._reservation: RetryReservation | None = None
        self._thread: threading.Thread | None = None
        self._small_answered_at = -math.inf  # when a small run last finished (``_step_budget``)

    @property
    def waiting(self) -> int:
        """Jobs admitted and not yet started."""
        return len(self._waiting)

    # ------------------------------------------------------------------------------------ callers

    def submit(self, prompts: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> Ticket:
        """Queue one request's prompts; ``ticket.future`` yields a ``Scored`` (label log-probs in prompt order).
        Raises ``DecisionError`` when admission control refuses it."""
        rows = [list(p) for p in prompts]
        size = work_tokens(rows)
        if size > self.max_request_tokens:
            self.stats.refused += 1
            raise LimitExceeded(
                f"this request needs {size:,} tokens of model work after prefix sharing, over this server's limit "
                f"of {self.max_request_tokens:,} tokens a request (--max-request-tokens); send fewer questions or "
                "a shorter input", code="request_too_large")
        key = (tuple(map(tuple, rows)), tuple(map(tuple, labels)))
        future: Future[Scored] = Future()
        with self._lock:
            job = self._inflight.get(key)
            joined = job is not None
            if job is not None:
                self.stats.joined += 1
                job.left_at = None  # a retry of a request its client gave up on: the work goes on
            else:
                self._admit(key, size)
                job = Job(Group(rows, [list(x) for x in labels]), size, key)
                self._inflight[key] = job
                self.queued_tokens += size
                self._waiting.append(job)
            job.waiters.append(future)
            self._wake()
        future.add_done_callback(lambda f: self._cancelled(job) if f.cancelled() else None)
        return Ticket(job, future, joined)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread and return its result."""
        task = Call(fn)
        with self._lock:
            self._calls.append(task)
            self._wake()
        return task.future.result()

    def _admit(self, key: tuple[Any, ...], size: int) -> None:
        """Room for ``size`` more tokens, or a 503. The first request refused for room holds a reservation until its
        retry (the same prompts) comes back: others are admitted only into the room it leaves, so a large request
        is not starved by a stream of small ones."""
        now = time.monotonic()
        reserved = self._reservation
        if reserved is not None and (reserved.expires < now or reserved.key == key):
            self._reservation = reserved = None
        kept = reserved.size if reserved else 0
        room = self.max_queued_tokens - self.queued_tokens - kept
        if size <= room or not (self.queued_tokens or reserved):
            return
        self.stats.refused += 1
        # Until enough is computed for the reservation and this request both to fit.
        short = self.queued_tokens + kept + size - self.max_queued_tokens
        wait_ms = int(min(MAX_RETRY_AFTER_MS, max(100, 1000 * short / max(self.rate, 1.0))))
        if reserved is None:
            self._reservation = RetryReservation(key, size, now + wait_ms / 1000 + RESERVATION_GRACE_S)
        raise Unavailable(
            f"the local model is busy: {self.queued_tokens:,} tokens of work are queued and this request adds "
            f"{size:,}, over this server's limit of {self.max_queued_tokens:,} (--max-queued-tokens); retry in "
            f"about {wait_ms / 1000:.1f} s", code="server_overloaded", status=503, type="api_error",
            headers={"retry-after-ms": str(wait_ms), "Retry-After": str(max(1, round(wait_ms / 1000)))})

    def _cancelled(self, job: Job) -> None:
        with self._lock:
            if job.left_at is not None or not all(f.cancelled() for f in job.waiters):
                return
            job.left_at = time.monotonic()
            if self.abandon_grace_s <= 0 and job in self._waiting:  # never started: its tokens are free at once
                self._waiting.remove(job)
                self._release(job)
                self.stats.cancelled += 1

    def _expired(self, job: Job, now: float) -> bool:
        """Every caller has gone, and no retry has joined within the grace period."""
        return job.left_at is not None and now - job.left_at >= self.abandon_grace_s

    def _release(self, job: Job) -> None:
        self.queued_tokens -= job.size
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]

    def _wake(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="decisiond-scorer", daemon=True)
            self._thread.start()
        self._lock.notify()

    # ------------------------------------------------------------------------------------ worker

    def _work(self) -> None:
        while True:
            call, run = self._next()
            if call is not None:
                _deliver(call.future, call.fn)
            if run is not None:
                self._step(run)

    def _next(self) -> tuple[Call | None, Run | None]:
        """A call to make, and the run to step (starting a new one from the waiting jobs when allowed)."""
        with self._lock:
            while not (self._calls or self._waiting or self._running):
                self._lock.wait()
            if self._calls:
                return self._calls.popleft(), None
            if self._waiting and not self._running:
                # Idle: give concurrent callers a moment to join the batch.
                deadline = time.monotonic() + self.max_wait_s
                while (left := deadline - time.monotonic()) > 0 and \
                        sum(j.size for j in self._waiting) < self.max_batch_tokens:
                    self._lock.wait(left)
            now = time.monotonic()
            for job in [j for j in self._waiting if self._expired(j, now)]:  # nobody waits: never started
                self._waiting.remove(job)
                self._release(job)
                self.stats.cancelled += 1
            self._start_runs()
            for run in list(self._running):
                if all(self._expired(job, now) for job in run.jobs):  # nobody waits: stop between passes
                    self._running.remove(run)
                    for job in run.jobs:
                        self.stats.cancelled += 1
                        self._release(job)
                    try:
                        run.steps.close()
                    except Exception:  # a backend's clean-up failing must not stop the worker
                        log.exception("a stopped run did not close cleanly")
            if not self._running:
                return None, None
            oldest = min(self._running, key=lambda r: r.last)
            if now - oldest.last > STARVE_S:  # aging: nothing waits longer than this for its next pass
                run = oldest
            else:  # least attained service: the run whose requests have had the fewest tokens computed so far
                run = min(self._running, key=lambda r: (r.done / len(r.jobs), r.last))
            if isinstance(self.backend, PacedBackend):
                self.backend.step_budget = self._step_budget(run)
            return None, run

    def _large(self, size: int) -> bool:
        """Whether a job or run of ``size`` tokens is large: more than one pass (a document)."""
        return size > self.max_batch_tokens

    def _step_budget(self, run: Run) -> int:
        """The tokens of ``run``'s next pass (a ``PacedBackend``). A run within one pass takes it
        whole: each pass reads all the weights once, so cutting a small request into short passes pays for that
        several times (benchmarks/SCHEDULER.md). A large run (a document)
        goes in short passes while other runs are open or waiting, or a small one was answered a moment ago (its
        client's next request may be on its way), so that they wait for one short pass only."""
        if not self._large(run.size):
            return self.max_batch_tokens
        recently = time.monotonic() - self._small_answered_at < CONTENDED_GRACE_S
        if len(self._running) > 1 or self._waiting or recently:
            return min(self.max_batch_tokens, max(MIN_STEP_TOKENS, self.max_batch_tokens // CONTENDED_DIVISOR))
        return max(MIN_STEP_TOKENS, self.max_batch_tokens // ALONE_DIVISOR)

    def _start_runs(self) -> None:
        """Waiting jobs into runs: small runs at once, large ones while fewer than ``MAX_LARGE_RUNS`` are open."""
        while self._waiting:
            large = sum(1 for r in self._running if self._large(r.size))
            if self._large(self._waiting[0].size) and large >= MAX_LARGE_RUNS:
                # The large job at the head waits for its turn; the small ones behind it go, batched as usual.
                batch: list[Job] = []
                size = 0
                for job in [j for j in self._waiting if not self._large(j.size)]:
                    if batch and size + job.size > self.max_batch_tokens:
                        break
                    self._waiting.remove(job)
                    batch.append(job)
                    size += job.size
                if not batch:
                    return
            else:
                batch = [self._waiting.popleft()]
                size = batch[0].size
                while self._waiting and size + self._waiting[0].size <= self.max_batch_tokens:
                    job = self._waiting.popleft()
                    batch.append(job)
                    size += job.size
            run = Run(batch, stepwise(self.backend, [j.group for j in batch]), size)
            for job in batch:
                job.run = run
            self._running.append(run)

    def _step(self, run: Run) -> None:
        """One pass of ``run``; its last pass ends the steps with the answers (``base.Steps``), delivered at once."""
        started = time.monotonic()
        run.passes += 1  # a step is one forward pass (the last one returns the answers)
        try:
            tokens = next(run.steps)
        except StopIteration as finished:
            scored = finished.value
            if isinstance(scored, list):
                self._count(sum(getattr(s, "computed_tokens", 0) for s in scored) - run.done, started)
            self._finish(run, scored)
            return
        except BaseException as error:  # delivered to the callers; the worker lives on
            self._finish(run, error)
            return
        run.done += tokens
        run.last = time.monotonic()
        self._count(tokens, started)

    def _count(self, tokens: int, started: float) -> None:
        elapsed = time.monotonic() - started
        self.stats.steps += 1
        if tokens > 0 and elapsed > 0:
            self.rate = 0.8 * self.rate + 0.2 * tokens / elapsed

    def _finish(self, run: Run, outcome: list[Scored] | BaseException) -> None:
        run.finished = time.monotonic()
        with self._lock:
            self._running.remove(run)
            if not self._large(run.size):
                self._small_answered_at = time.monotonic()
            for job in run.jobs:
                self._release(job)
            if not isinstance(outcome, BaseException):
                self.stats.runs += 1
                self.stats.jobs += len(run.jobs)
                self.stats.prompt_tokens += sum(len(p) for job in run.jobs for p in job.group.prompts)
        if not isinstance(outcome, BaseException) and len(outcome) != len(run.jobs):
            outcome = RuntimeError(f"the backend answered {len(outcome)} of {len(run.jobs)} requests")
        for i, job in enumerate(run.jobs):
            for future in job.waiters:
                if isinstance(outcome, BaseException):
                    _deliver(future, _raise(outcome))
                else:
                    _deliver(future, functools.partial(_checked, outcome[i]))


def work_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """The tokens a job makes the model compute: its prompts' shared prefix once, plus each prompt's rest (what
    admission control counts)."""
    shared = len(os.path.commonprefix([list(p) for p in prompts])) if prompts else 0
    return shared + sum(len(p) - shared for p in prompts)


def _checked(scored: Scored) -> Scored:
    check_finite(scored)
    return scored


def _raise(error: BaseException) -> Callable[[], Any]:
    def fail() -> Any:
        raise error
    return fail


def _deliver(future: Future[Any], fn: Callable[[], Any]) -> None:
    """The value of ``fn()``, or its error, to ``future`` — unless its caller has cancelled it meanwhile."""
    try:
        value = fn()
    except BaseException as error:
        try:
            future.set_exception(error)
        except InvalidStateError:
            pass
    else:
        try:
            future.set_result(value)
        except InvalidStateError:
            pass
