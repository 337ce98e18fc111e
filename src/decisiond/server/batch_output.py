"""A batch's end (``finalizing``, ``cancelling``; ``batch_runner``): its output and error files written in line
order from the stored answers (with a ``batch_expired`` error for each line a batch past its window never
answered), then its final state — ``completed``, ``cancelled`` or ``expired`` — recorded with the files in one
transaction. Each attempt writes files of its own: an attempt whose state is not recorded leaves none behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import IO, Any

import orjson

from ..store.tables import BatchJob, StoredFile
from . import files_fs
from .batch_holder import BatchHolder, Stopped
from .batch_lines import request_id

log = logging.getLogger("decisiond.batches")


def output_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file, the same however often it is written."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class Output:
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
        if self.handle is None:
            raise ValueError("the output is closed")
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


async def finalize(holder: BatchHolder, job: BatchJob) -> None:
    """Write the output and error files in line order, then the batch's final state with them, at once.
    ``Stopped`` when another process holds the batch."""
    store = holder.store
    job = await holder.current(job)
    source = await store.file(job.input_file_id)
    now = int(holder.clock())
    completed, failed = await store.counts(job.id)  # the answers kept: those whose usage rows were written
    short = completed + failed < job.total
    if short and job.status == "finalizing" and now < job.expires_at:  # never: a line was left behind
        log.error("batch %s has %d of %d lines answered at its end: answering the others",
                  job.id, completed + failed, job.total)
        await holder.set(job, status="in_progress", next_line=0)
        return
    state = "cancelled" if job.status == "cancelling" else "expired" if short else "completed"
    attempt = os.urandom(4).hex()  # a file of this attempt's own: another process's never overwrites it
    files = {kind: Output(output_id(job.id, kind), store.folder / f".{output_id(job.id, kind)}.{attempt}.tmp",
                          f"{output_id(job.id, kind)}.{attempt}.jsonl") for kind in ("output", "error")}
    try:
        expired = await _write_files(holder, job, source if state == "expired" else None, files)
    except BaseException:
        for output in files.values():
            output.close()
            output.temporary.unlink(missing_ok=True)
        raise
    rows = await _placed(job, files, store.folder, now)
    values: dict[str, Any] = {"status": state, f"{state}_at": now, "completed": completed,
                              "failed": failed + expired,
                              "output_file_id": files["output"].id if files["output"].lines else None,
                              "error_file_id": files["error"].id if files["error"].lines else None}
    finished = False
    try:
        finished = await store.finish(job.id, holder.name, rows, values)
    finally:
        if not finished and not await _recorded(holder, rows):  # this attempt's files are nobody's
            for output in files.values():
                (store.folder / output.name).unlink(missing_ok=True)
    if not finished:
        raise Stopped()
    log.info("batch %s %s", job.id, state, extra={"batch_id": job.id, "completed": completed,
                                               "failed": failed + expired})


async def _placed(job: BatchJob, files: dict[str, Output], folder: Path, now: int) -> list[StoredFile]:
    """The written files closed and moved to their final names (an empty one deleted), and their rows."""
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
    return rows


async def _recorded(holder: BatchHolder, rows: list[StoredFile]) -> bool:
    """Whether the files ``rows`` are the batch's now (its final state was committed although the call that
    committed it was interrupted before it returned)."""
    with contextlib.suppress(Exception):
        for row in rows:
            there = await holder.store.file(row.id)
            if there is not None and there.path == row.path:
                return True
    return False


async def _write_files(holder: BatchHolder, job: BatchJob, expired_from: StoredFile | None,
                       files: dict[str, Output]) -> int:
    """The stored lines into the output and error files, in line order; with ``expired_from`` (the input of a
    batch past its window) also a ``batch_expired`` error for each line never answered. How many of those."""
    results = holder.store.results(job.id)
    upcoming = await anext(results, None)
    expired = 0
    for n, raw in files_fs.request_lines(holder.store.path(expired_from)) if expired_from is not None else ():
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


def _kind(ok: bool) -> str:
    return "output" if ok else "error"
