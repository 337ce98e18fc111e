"""The Batch API's rows: files (``files``: the bytes in a folder of their own, the row what the Files API lists),
batches (``batches``) and the answered lines of unfinished batches (``batch_results``).

A batch is run by one process at a time: the one that holds its lease (``claim``), which it renews while it runs
(``renew``). A lease whose holder has gone silent for ``lease_s`` — or, on the same host, whose process has died — is
taken by the next process that looks (``claim``). Progress is written a group of answered lines at a time, each group
in one transaction with the batch's counts (``save``): a line is answered once in the output, whatever dies when.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.engine import Connection, make_url

from .db import Database, data_directory, sqlite_file
from .db import database_url as database_url_of
from .dialect import insert_ignoring_conflict, upsert
from .processes import holder_gone
from .tables import BatchJob, BatchResult, StoredFile

# A batch whose lines are not all answered yet; FINAL: done, one way or another.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
RESULT_PAGE = 1000


@dataclass(frozen=True)
class Result:
    """One answered line: its place in the input file, whether it goes to the output file (else the error file),
    its line of that file, and the tokens it used."""

    line: int
    ok: bool
    body: dict[str, Any]
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def default_folder(database_url: str | None) -> Path:
    """Where files live without ``batches.files_path``: beside a SQLite file (``<file>.files``), else in the data
    directory under a name of the database (as the usage journal: ``gateway.journal.default_directory``)."""
    path = sqlite_file(database_url)
    if path is not None:
        return path.with_name(path.name + ".files")
    name = make_url(database_url_of(database_url)).render_as_string(hide_password=True)
    return data_directory() / "files" / hashlib.sha256(name.encode()).hexdigest()[:16]


class BatchStore:
    """Files and batches on the gateway's database, file bytes under ``folder``."""

    def __init__(self, db: Database, folder: Path):
        self.db = db
        self.folder = folder

    # Files

    def path(self, row: StoredFile) -> Path:
        return self.folder / row.path

    async def add_file(self, row: StoredFile) -> None:
        async with self.db.session() as session, session.begin():
            session.add(row)

    async def file(self, file_id: str) -> StoredFile | None:
        async with self.db.session() as session:
            return await session.get(StoredFile, file_id)

    async def files(self, key_id: str | None, everyone: bool, purpose: str | None, after: str | None, limit: int,
                    descending: bool) -> list[StoredFile]:
        """A page of files (``limit`` + 1 rows, the extra one telling there are more), by creation time then id."""
        where = [StoredFile.purpose == purpose] if purpose is not None else []
        return await self._page(StoredFile, key_id, everyone, after, limit, descending, where)
    async def delete_file(self, file_id: str) -> bool:
        async with self.db.session() as session, session.begin():
            row = await session.get(StoredFile, file_id)
            if row is None:
                return False
            await session.delete(row)
        self.path(row).unlink(missing_ok=True)
        return True

    async def expired_files(self, now: int) -> list[str]:
        async with self.db.session() as session:
            return list((await session.scalars(select(StoredFile.id).where(
                StoredFile.expires_at.is_not(None), StoredFile.expires_at <= now).limit(1000))).all())

    # Batches

    async def add_batch(self, row: BatchJob) -> None:
        async with self.db.session() as session, session.begin():
            session.add(row)

    async def batch(self, batch_id: str) -> BatchJob | None:
        async with self.db.session() as session:
            return await session.get(BatchJob, batch_id)

    async def batches(self, key_id: str | None, everyone: bool, after: str | None, limit: int) -> list[BatchJob]:
        """A page of batches, newest first (``limit`` + 1 rows, the extra one telling there are more)."""
        return await self._page(BatchJob, key_id, everyone, after, limit, True, [])

    async def _page(self, table: Any, key_id: str | None, everyone: bool, after: str | None, limit: int,
                    descending: bool, where: list[Any]) -> list[Any]:
        """``limit`` + 1 rows of ``table`` after the row ``after`` (a cursor that is no row: from the start), by
        creation time then id; only ``key_id``'s unless ``everyone``."""
        query = select(table).where(*where)
        if not everyone:
            query = query.where(table.key_id == key_id)
        order = (table.created_at.desc(), table.id.desc()) if descending else (table.created_at, table.id)
        async with self.db.session() as session:
            if after is not None:
                cursor = await session.get(table, after)
                if cursor is not None:
                    query = query.where(_past(table, cursor.created_at, cursor.id, descending))
            return list((await session.scalars(query.order_by(*order).limit(limit + 1))).all())

    async def cancel(self, batch_id: str, now: int) -> BatchJob | None:
        """Mark an active batch ``cancelling`` (its runner stops it and writes what it has); any other is left as
        it is. The batch as it then is."""
        def run(connection: Connection) -> None:
            connection.execute(update(BatchJob).where(BatchJob.id == batch_id, BatchJob.status.in_(
                ("validating", "in_progress"))).values(status="cancelling", cancelling_at=now))

        await self.db.write(run)
        return await self.batch(batch_id)

    async def claim(self, runner: str, now: float, lease_s: float,
                    skip: set[str]) -> tuple[BatchJob, str | None] | None:
        """The oldest active batch no live process holds, now held by ``runner`` until ``now + lease_s``, with the
        holder it was taken from (None: no one's); None when there is none. Atomic: of two processes that claim one
        batch, one gets it."""
        async with self.db.session() as session:
            rows = (await session.execute(select(BatchJob.id, BatchJob.runner, BatchJob.lease_until).where(
                BatchJob.status.in_(ACTIVE)).order_by(BatchJob.created_at, BatchJob.id).limit(100))).all()
        for batch_id, holder, until in rows:
            if batch_id in skip or (holder is not None and (until or 0) > now and not holder_gone(holder)):
                continue

            def take(connection: Connection, batch_id: str = batch_id, holder: str | None = holder,
                     until: float | None = until) -> int:
                held = BatchJob.runner.is_(None) if holder is None else and_(BatchJob.runner == holder,
                                                                              BatchJob.lease_until == until)
                return connection.execute(update(BatchJob).where(BatchJob.id == batch_id, held).values(
                    runner=runner, lease_until=now + lease_s)).rowcount

            if await self.db.write(take) == 1:
                job = await self.batch(batch_id)
                return (job, holder) if job is not None else None
        return None

    async def renew(self, batch_ids: list[str], runner: str, until: float) -> tuple[dict[str, str], set[str]]:
        """Extend ``runner``'s leases: the batches it still holds, with their statuses, and those another process
        has taken (a batch that finished meanwhile, no one's now, is in neither)."""
        def run(connection: Connection) -> tuple[dict[str, str], set[str]]:
            rows = connection.execute(update(BatchJob).where(BatchJob.id.in_(batch_ids), BatchJob.runner == runner)
                                      .values(lease_until=until).returning(BatchJob.id, BatchJob.status)).all()
            taken = set(connection.execute(select(BatchJob.id).where(
                BatchJob.id.in_(batch_ids), BatchJob.runner.is_not(None), BatchJob.runner != runner)).scalars())
            return {str(r[0]): str(r[1]) for r in rows}, taken

        return await self.db.write(run) if batch_ids else ({}, set())

    async def release(self, batch_id: str, runner: str) -> None:
        def run(connection: Connection) -> None:
            connection.execute(update(BatchJob).where(BatchJob.id == batch_id, BatchJob.runner == runner)
                               .values(runner=None, lease_until=None))

        await self.db.write(run)

    async def set_state(self, batch_id: str, runner: str, was: str, values: dict[str, Any]) -> bool:
        """Change the batch's fields while ``runner`` holds it and its status is still ``was`` (a cancel meanwhile
        is not overwritten); whether it did."""
        def run(connection: Connection) -> int:
            held = and_(BatchJob.id == batch_id, BatchJob.runner == runner, BatchJob.status == was)
            return connection.execute(update(BatchJob).where(held).values(**values)).rowcount

        return await self.db.write(run) == 1

    async def save(self, batch_id: str, runner: str, results: list[Result], next_line: int) -> str | None:
        """Store answered lines and the batch's progress in one transaction, while ``runner`` holds the batch: its
        status then (``cancelling`` when it was cancelled meanwhile), or None when the lease is lost (nothing is
        stored: another process runs the batch). The lease is checked by the update that takes the row's lock, so
        no other process can claim the batch before this transaction ends. A line already stored (by the usage
        writer, with the usage row of the answer that was charged: ``put_results``) keeps that answer."""
        def run(connection: Connection) -> str | None:
            status = connection.execute(update(BatchJob).where(
                BatchJob.id == batch_id, BatchJob.runner == runner).values(
                next_line=next_line,
                completed=BatchJob.completed + sum(r.ok for r in results),
                failed=BatchJob.failed + sum(not r.ok for r in results),
                input_tokens=BatchJob.input_tokens + sum(r.input_tokens for r in results),
                cached_tokens=BatchJob.cached_tokens + sum(r.cached_tokens for r in results),
                output_tokens=BatchJob.output_tokens + sum(r.output_tokens for r in results))
                .returning(BatchJob.status)).scalar_one_or_none()
            if status is None:
                return None
            put_results(connection, batch_id, [(r.line, r.ok, r.body) for r in results], replace=False)
            return str(status)

        return await self.db.write(run)

    async def done_lines(self, batch_id: str, start: int) -> AsyncIterator[int]:
        """The answered lines at or past ``start``, in order, a page at a time."""
        last = start - 1
        while True:
            async with self.db.session() as session:
                page = (await session.scalars(select(BatchResult.line).where(
                    BatchResult.batch_id == batch_id, BatchResult.line > last).order_by(BatchResult.line)
                    .limit(RESULT_PAGE))).all()
            for line in page:
                yield line
            if len(page) < RESULT_PAGE:
                return
            last = page[-1]

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """(answered, failed) lines stored for the batch."""
        async with self.db.session() as session:
            rows = (await session.execute(select(BatchResult.ok, func.count()).where(
                BatchResult.batch_id == batch_id).group_by(BatchResult.ok))).all()
        by = {bool(ok): int(n) for ok, n in rows}
        return by.get(True, 0), by.get(False, 0)

    async def in_use(self, file_id: str) -> bool:
        """Whether an active batch reads the file."""
        async with self.db.session() as session:
            found = await session.scalar(select(func.count()).select_from(BatchJob).where(
                BatchJob.input_file_id == file_id, BatchJob.status.in_(ACTIVE)))
        return bool(found)

    async def sweep(self) -> int:
        """Delete answered lines left behind by finished batches (a usage record written after its batch was);
        how many."""
        def run(connection: Connection) -> int:
            finished = select(BatchJob.id).where(BatchJob.status.in_(FINAL))
            return int(connection.execute(delete(BatchResult).where(BatchResult.batch_id.in_(finished))).rowcount
                       or 0)

        return await self.db.write(run)

    async def results(self, batch_id: str) -> AsyncIterator[BatchResult]:
        """The batch's answered lines in line order, a page at a time."""
        last = -1
        while True:
            async with self.db.session() as session:
                page = (await session.scalars(select(BatchResult).where(
                    BatchResult.batch_id == batch_id, BatchResult.line > last).order_by(BatchResult.line)
                    .limit(RESULT_PAGE))).all()
            for row in page:
                yield row
            if len(page) < RESULT_PAGE:
                return
            last = page[-1].line

    async def finish(self, batch_id: str, runner: str, files: list[StoredFile], values: dict[str, Any]) -> bool:
        """The batch's files recorded and its final state set, its answered lines deleted, its lease released: one
        transaction, while ``runner`` holds it (checked by the update that takes the row's lock). Whether it did."""
        def run(connection: Connection) -> bool:
            held = connection.execute(update(BatchJob).where(BatchJob.id == batch_id, BatchJob.runner == runner)
                                      .values(**values, runner=None, lease_until=None)
                                      .returning(BatchJob.id)).scalar_one_or_none()
            if held is None:
                return False
            for row in files:
                connection.execute(insert(StoredFile), [file_columns(row)])
            connection.execute(delete(BatchResult).where(BatchResult.batch_id == batch_id))
            return True

        return await self.db.write(run)


def put_results(connection: Connection, batch_id: str, lines: list[tuple[int, bool, Any]], replace: bool) -> None:
    """Insert answered lines of a batch, in ``connection``'s transaction; a line already there is replaced
    (``replace``: the line of the usage record that was written, which is the answer charged) or kept."""
    if not lines:
        return
    values = [{"batch_id": batch_id, "line": line, "ok": ok, "body": body} for line, ok, body in lines]
    dialect, key = connection.dialect.name, ["batch_id", "line"]
    statement = (upsert(dialect, BatchResult, key, ["ok", "body"]) if replace
                 else insert_ignoring_conflict(dialect, BatchResult, index_elements=key))
    connection.execute(statement, values)


def file_columns(row: StoredFile) -> dict[str, Any]:
    """A file's row as the values of an insert."""
    return {c.name: getattr(row, c.key) for c in StoredFile.__table__.columns}


def _past(table: Any, created_at: int, ident: str, descending: bool) -> Any:
    """Rows after the cursor row (``created_at``, ``ident``) in the listing's order."""
    if descending:
        return or_(table.created_at < created_at, and_(table.created_at == created_at, table.id < ident))
    return or_(table.created_at > created_at, and_(table.created_at == created_at, table.id > ident))

