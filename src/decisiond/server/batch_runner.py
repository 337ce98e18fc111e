"""Running batches (``POST /v1/batches``): each line of the input file through the whole pipeline as the key that
made the batch, answers and errors into the batch's output and error files, progress on the database.

A process's ``BatchRunner`` claims active batches no live process holds (``store.batches``), up to
``batches.max_running`` at once, and renews their leases while it runs them. A batch goes

- ``validating``: every line's ``url`` must be the batch's endpoint, else the batch ``failed`` with one error per
  line at fault (``errors``); then ``in_progress``;
- ``in_progress``: lines are read from the file one at a time and answered ``batches.concurrency`` at once, in
  the route's own dialect, exactly as ``POST <endpoint>`` answers them (``routes.respond``), each leaving its usage
  row (request type ``batch``, the batch's id). Of lines that ask about one input, the first is answered before the
  others start, so that a local engine computes the input once (its prefix cache). A line refused by a rate limit
  (or by a full engine queue: 503 with a retry-after) waits as the refusal says and is asked again: a batch takes
  what the limits leave to interactive traffic. Any other refusal (a budget's 402, a guardrail's block, a bad body)
  is the line's answer, in the error file, and the batch goes on;
- ``finalizing``: the output and error files are written in line order from the stored answers, then the batch is
  ``completed`` (or ``cancelled``, or ``expired`` — its unanswered lines then in the error file as
  ``batch_expired``) in the transaction that records them.

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
import dataclasses
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from ..canonical import DecisionResult, ScoreResult
from ..errors import RETRY_HEADERS, DecisionError, one_line
from ..gateway.batch_settings import BatchesConfig
from ..gateway.service import Gateway
from ..gateway.types import Caller, Context
from ..limits import BATCH_FLUSH_LINES, BATCH_FLUSH_S, BATCH_MAX_AHEAD, BATCH_MAX_ERRORS, BATCH_POLL_S
from ..store.batches import BatchStore, Result
from ..store.processes import runner_name
from ..store.tables import BatchJob, StoredFile
from . import files_fs
from .batch_takeover import Stopping, replay_dead_holder
from .middleware import INTERNAL_ERROR
from .routes import ROUTES, DecisionRoute, respond

log = logging.getLogger("decisiond.batches")

# The endpoints a batch may name: the decision routes.
ENDPOINTS: dict[str, DecisionRoute] = {route.path: route for route in ROUTES}
# How long a line refused by a rate limit waits when the refusal does not say, and at most.
RETRY_DEFAULT_S = 1.0
RETRY_MAX_S = 60.0
# How often a running batch reads its key again (a revoked key's lines are refused from then on).
CALLER_CHECK_S = 5.0
# Inputs a running batch remembers as computed (``_answer``).
WARM_INPUTS = 4096
# How often files past their expires_at, and temporary files of interrupted work (``files_fs.sweep``), are deleted.
FILE_EXPIRY_SCAN_S = 60.0
# How long a stopping runner lets the lines in flight finish before it cancels them.
STOP_GRACE_S = 5.0


def request_id(batch_id: str, line: int) -> str:
    """A line's request id, the same each time it is answered (``batch_req_`` and 24 hex digits)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


def record_id(batch_id: str, line: int) -> str:
    """A line's usage record id (``Context.record_id``): a second record of the line is not written."""
    return hashlib.sha256(f"usage:{batch_id}:{line}".encode()).hexdigest()[:30] + "00"


def output_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file, the same however often it is written."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class Stopped(Exception):
    """The batch is no longer this process's (its lease was lost) or the process is stopping."""


class BatchRunner:
    def __init__(self, gateway: Gateway, store: BatchStore, config: BatchesConfig,
                 clock: Callable[[], float] = time.time):
        self.gateway = gateway
        self.store = store
        self.config = config
        self.clock = clock
        self.name = runner_name()
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
                job = await self._set(job, status="finalizing", finalizing_at=int(self.clock()))
            if job.status == "validating":
                job = await self._validate(job)
            if job.status == "in_progress":
                job = await self._answer(job)
            if job.status in ("finalizing", "cancelling"):
                await self._finalize(job)
        except (Stopped, Stopping, asyncio.CancelledError):
            pass
        except Exception:  # a fault: the lease runs out and a process takes the batch up again
            log.exception("batch %s stopped by an error; it is taken up again later", job.id)
        finally:
            if self._stopping:
                with contextlib.suppress(Exception):
                    await self.store.release(job.id, self.name)

    async def _set(self, job: BatchJob, **values: Any) -> BatchJob:
        """The batch moved on from the status it has here; when it has meanwhile been cancelled, the batch as it
        now is (``cancelling``); ``Stopped`` when another process holds it."""
        if await self.store.set_state(job.id, self.name, job.status, values):
            for name, value in values.items():
                setattr(job, name, value)
            return job
        return await self._current(job)

    async def _current(self, job: BatchJob) -> BatchJob:
        """The batch as the database has it now; ``Stopped`` when another process holds it."""
        now = await self.store.batch(job.id)
        if now is None or now.runner != self.name:
            raise Stopped()
        return now

    async def _validate(self, job: BatchJob) -> BatchJob:
        """Every line's ``url`` is the batch's endpoint (the file's own shape was checked at upload)."""
        source = await self.store.file(job.input_file_id)
        if source is None:
            return await self._missing(job)

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
            return await self._set(job, status="failed", failed_at=int(self.clock()), errors=errors)
        return await self._set(job, status="in_progress", in_progress_at=int(self.clock()))

    async def _missing(self, job: BatchJob) -> BatchJob:
        return await self._set(job, status="failed", failed_at=int(self.clock()), errors=[{
            "code": "file_not_found", "line": None, "param": "input_file_id",
            "message": f"the input file {job.input_file_id} was deleted before the batch was done"}])

    async def _caller(self, job: BatchJob) -> Caller | DecisionError:
        """What the batch's lines run as now: the key that made it (a revoked key's lines are refused, 401)."""
        try:
            caller = await self.gateway.auth.caller_of(job.key_id, job.master)
        except DecisionError as error:
            return error
        return dataclasses.replace(caller, user_path=job.user_path)

    async def _answer(self, job: BatchJob) -> BatchJob:
        """Answer the lines not answered yet, storing them a group at a time; then ``finalizing`` — or the batch as
        it is when it was cancelled meanwhile (``cancelling``)."""
        source = await self.store.file(job.input_file_id)
        if source is None:
            return await self._missing(job)
        route = ENDPOINTS[job.endpoint]
        done = _Ahead(self.store.done_lines(job.id, job.next_line))
        slots = asyncio.Semaphore(self.config.concurrency)
        pending: set[int] = set()  # lines in flight
        abandoned: set[int] = set()  # lines stopped unanswered (stopping, cancelled, expired): not done
        tasks: set[asyncio.Task[None]] = set()
        answered: list[Result] = []
        progress = asyncio.Event()
        cursor = job.next_line
        status = job.status
        flushed = checked = time.monotonic()
        caller = await self._caller(job)
        read_all = False

        def going() -> bool:
            return not (self._stopping or status == "cancelling" or job.id in self._cancelling
                        or self.clock() >= job.expires_at)

        async def flush() -> None:
            nonlocal status, flushed
            group = list(answered)
            answered.clear()
            flushed = time.monotonic()
            saved = await self.store.save(job.id, self.name, group, min(pending | abandoned, default=cursor))
            if saved is None:
                raise Stopped()
            status = saved

        # Lines that ask about one input: the first is answered alone, and the others once it is, so that the engine
        # computes the input once and takes it from its prefix cache for them (packed together, each would compute
        # it again). Keyed by a digest of the body without its questions; the last WARM_INPUTS inputs answered are
        # remembered (their lines wait for nothing).
        first: dict[bytes, asyncio.Future[None]] = {}
        warm: OrderedDict[bytes, None] = OrderedDict()

        async def answer(n: int, raw: bytes, caller: Caller | DecisionError) -> None:
            item: dict[str, Any] = {}
            key: bytes | None = None
            mine: asyncio.Future[None] | None = None
            result: Result | None = None
            try:
                item = orjson.loads(raw)  # checked at upload: an object with a custom_id and an object body
                key = _input_key(item["body"])
                if key is not None and key not in warm:
                    ahead = first.get(key)
                    if ahead is None:
                        first[key] = mine = asyncio.get_running_loop().create_future()
                    else:
                        await asyncio.shield(ahead)
                result = await self._line(job, route, n, item, caller, going)
            except Stopped:  # stopped while the line waited out a limit: left for later
                pass
            except Exception:  # a fault outside the pipeline (which answers its own): the line's answer is a 500
                log.exception("batch %s line %d", job.id, n + 1)
                status_code, body = route.early_error(INTERNAL_ERROR, None)
                result = _result(n, request_id(job.id, n), item.get("custom_id"), status_code, body, None)
            finally:
                if mine is not None and key is not None:
                    mine.set_result(None)
                    first.pop(key, None)
                    warm[key] = None
                    if len(warm) > WARM_INPUTS:
                        warm.popitem(last=False)
                if result is not None:
                    answered.append(result)
                else:  # cancelled or stopped: not done, so the stored progress stays before it
                    abandoned.add(n)
                pending.discard(n)
                slots.release()
                progress.set()

        try:
            with self.store.path(source).open("rb") as file:
                for n, raw in enumerate(file):
                    if n < job.next_line or await done.has(n) or not raw.strip():
                        cursor = n + 1
                        continue
                    # A slow line holds the stored progress back; the lines answered past it are bounded, so that
                    # what a restart reads back (``done_lines``) stays small.
                    while pending and n - min(pending) >= BATCH_MAX_AHEAD and going():
                        progress.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(progress.wait(), BATCH_FLUSH_S)
                    # A slot, looking every BATCH_FLUSH_S meanwhile at what was answered (stored) and whether to
                    # go on (a stop, a cancel, the window's end do not wait for a slot).
                    slot = False
                    while going():
                        try:
                            slot = bool(await asyncio.wait_for(slots.acquire(), BATCH_FLUSH_S))
                        except asyncio.TimeoutError:
                            pass
                        if answered and (len(answered) >= BATCH_FLUSH_LINES
                                         or time.monotonic() - flushed >= BATCH_FLUSH_S):
                            await flush()
                        if slot:
                            break
                    if not slot or not going():
                        if slot:
                            slots.release()
                        break
                    if time.monotonic() - checked >= CALLER_CHECK_S:  # a key revoked meanwhile is seen
                        checked, caller = time.monotonic(), await self._caller(job)
                    pending.add(n)
                    cursor = n + 1
                    task = asyncio.create_task(answer(n, raw, caller))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                else:
                    read_all = True
            while tasks:
                _, late = await asyncio.wait(set(tasks), timeout=BATCH_FLUSH_S)
                if answered:
                    await flush()  # also tells of a cancel, which stops the lines that wait on a limit
                if late and self._stopping:
                    _, late = await asyncio.wait(late, timeout=STOP_GRACE_S)
                    for task in late:
                        task.cancel()
                    if late:
                        await asyncio.wait(late)
            await flush()
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        if self._stopping:
            raise Stopped()
        if status == "cancelling" or job.id in self._cancelling:
            return await self._current(job)
        if (read_all and not abandoned) or self.clock() >= job.expires_at:
            return await self._set(job, status="finalizing", finalizing_at=int(self.clock()))
        return job

    async def _line(self, job: BatchJob, route: DecisionRoute, n: int, item: dict[str, Any],
                    caller: Caller | DecisionError, going: Callable[[], bool]) -> Result:
        """One line answered as ``POST <endpoint>`` answers it, its usage recorded once it is final (with the
        line's answer: ``usage_writer`` stores it with the row, so that the answer kept is the one charged).
        ``Stopped`` when ``going()`` turns false while the line waits out a limit."""
        custom_id, document = item["custom_id"], item["body"]
        ident = request_id(job.id, n)
        if isinstance(caller, DecisionError):
            status, body = route.early_error(caller, None)
            return _result(n, ident, custom_id, status, body, None)
        dialect = route.choose(document)
        while True:
            context = Context(ident, dialect.operation, dialect.name, caller, strict_model=dialect.strict_model,
                              batch_id=job.id, record_id=record_id(job.id, n))
            answer = await respond(self.gateway, dialect, context, document, None, {})
            wait = _retry_after(answer.status, answer.headers)
            if wait is not None:
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    if not going():
                        raise Stopped()
                    await asyncio.sleep(min(1.0, deadline - time.monotonic()))
                continue
            result = _result(n, ident, custom_id, answer.status, answer.body, answer.result)
            context.batch_line = (n, result.ok, result.body)
            self.gateway.record("batch", context, answer.status, answer.error_code, answer.result, document,
                                answer.body)
            return result

    async def _finalize(self, job: BatchJob) -> None:
        """Write the output and error files in line order, then the batch's final state with them, at once."""
        job = await self._current(job)
        source = await self.store.file(job.input_file_id)
        now = int(self.clock())
        completed, failed = await self.store.counts(job.id)  # the answers kept: those whose usage rows were written
        short = completed + failed < job.total
        if short and job.status == "finalizing" and now < job.expires_at:  # never: a line was left behind
            log.error("batch %s has %d of %d lines answered at its end: answering the others",
                      job.id, completed + failed, job.total)
            await self._set(job, status="in_progress", next_line=0)
            return
        state = "cancelled" if job.status == "cancelling" else "expired" if short else "completed"
        folder = self.store.folder
        attempt = os.urandom(4).hex()  # a file of this attempt's own: another process's never overwrites it
        files = {kind: _Output(output_id(job.id, kind), folder / f".{output_id(job.id, kind)}.{attempt}.tmp",
                               f"{output_id(job.id, kind)}.{attempt}.jsonl") for kind in ("output", "error")}
        try:
            expired = await self._write_files(job, source if state == "expired" else None, files)
        except BaseException:
            for output in files.values():
                output.close()
                output.temporary.unlink(missing_ok=True)
            raise
        rows = []
        for kind, output in files.items():
            await asyncio.to_thread(output.close)
            if not output.lines:
                output.temporary.unlink(missing_ok=True)
                continue
            output.temporary.replace(folder / output.name)
            rows.append(StoredFile(id=output.id, key_id=job.key_id, filename=f"batch_{job.id}_{kind}.jsonl",
                                   purpose="batch_output", bytes=output.bytes, lines=output.lines,
                                   path=output.name, created_at=now,
                                   expires_at=now + job.output_expires_s if job.output_expires_s else None))
        values: dict[str, Any] = {"status": state, f"{state}_at": now, "completed": completed,
                                  "failed": failed + expired,
                                  "output_file_id": files["output"].id if files["output"].lines else None,
                                  "error_file_id": files["error"].id if files["error"].lines else None}
        finished = False
        try:
            finished = await self.store.finish(job.id, self.name, rows, values)
        finally:
            if not finished and not await self._recorded(job.id, rows):  # this attempt's files are nobody's
                for output in files.values():
                    (folder / output.name).unlink(missing_ok=True)
        if not finished:
            raise Stopped()
        log.info("batch %s %s", job.id, state, extra={"batch_id": job.id, "completed": completed,
                                                   "failed": failed + expired})

    async def _recorded(self, batch_id: str, rows: list[StoredFile]) -> bool:
        """Whether the files ``rows`` are the batch's now (its final state was committed although the call that
        committed it was interrupted before it returned)."""
        with contextlib.suppress(Exception):
            for row in rows:
                there = await self.store.file(row.id)
                if there is not None and there.path == row.path:
                    return True
        return False

    async def _write_files(self, job: BatchJob, expired_from: StoredFile | None, files: dict[str, _Output]) -> int:
        """The stored lines into the output and error files, in line order; with ``expired_from`` (the input of a
        batch past its window) also a ``batch_expired`` error for each line never answered. How many of those."""
        results = self.store.results(job.id)
        upcoming = await anext(results, None)
        expired = 0
        for n, raw in files_fs.request_lines(self.store.path(expired_from)) if expired_from is not None else ():
            while upcoming is not None and upcoming.line < n:
                files[_kind(upcoming.ok)].write(upcoming.body)
                upcoming = await anext(results, None)
            if upcoming is not None and upcoming.line == n:
                continue
            expired += 1
            files["error"].write({"id": request_id(job.id, n), "custom_id": orjson.loads(raw).get("custom_id"),
                                  "response": None, "error": {"code": "batch_expired", "message": "This request "
                                  "could not be executed before the completion window expired."}})
        while upcoming is not None:
            files[_kind(upcoming.ok)].write(upcoming.body)
            upcoming = await anext(results, None)
        return expired


class _Ahead:
    """An ascending iterator of line numbers, asked in ascending order whether it holds a given one."""

    def __init__(self, lines: Any):
        self.lines = lines
        self.head: int | None = -1

    async def has(self, n: int) -> bool:
        while self.head is not None and self.head < n:
            self.head = await anext(self.lines, None)
        return self.head == n


class _Output:
    """An output or error file being written under a temporary name: its id, its final name, lines and bytes so
    far."""

    def __init__(self, ident: str, temporary: Path, name: str):
        self.id = ident
        self.temporary = temporary
        self.name = name  # its name in the files folder once written
        self.handle: IO[bytes] | None = files_fs.create(temporary)
        self.lines = self.bytes = 0

    def write(self, body: Any) -> None:
        data = orjson.dumps(body) + b"\n"
        assert self.handle is not None
        self.handle.write(data)
        self.lines += 1
        self.bytes += len(data)

    def close(self) -> None:
        """Flushed to the disk and closed (the batch's final state is recorded only after)."""
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.handle = None


def _input_key(body: dict[str, Any]) -> bytes | None:
    """What a decision line asks about: a digest of its body without its questions (None for a body without
    questions)."""
    if "questions" not in body:
        return None
    try:
        rest = orjson.dumps({k: v for k, v in body.items() if k != "questions"}, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return hashlib.blake2b(rest, digest_size=16).digest()


def _kind(ok: bool) -> str:
    return "output" if ok else "error"


def _retry_after(status: int, headers: dict[str, str]) -> float | None:
    """How long a line waits before it is asked again: a rate limit's refusal (429), or a 503 that says when to
    come back (the local engine's queue is full); None for an answer that stands."""
    if status != 429 and not (status == 503 and any(name in headers for name in RETRY_HEADERS)):
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return min(RETRY_MAX_S, max(0.01, float(value) * scale))
            except ValueError:
                pass
    return RETRY_DEFAULT_S


def _result(n: int, ident: str, custom_id: Any, status: int, body: Any, result: Any) -> Result:
    usage = result.usage if isinstance(result, DecisionResult) else None
    return Result(n, 200 <= status < 300, {"id": ident, "custom_id": custom_id, "response": {
        "status_code": status, "request_id": ident, "body": body}, "error": None},
        input_tokens=usage.input_tokens if usage else result.prompt_tokens if isinstance(result, ScoreResult) else 0,
        cached_tokens=usage.cached_tokens if usage else 0, output_tokens=usage.output_tokens if usage else 0)
