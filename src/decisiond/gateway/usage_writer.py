"""Writing usage rows: each record is journaled before its response leaves (``journal``), then moved to the database
in batches by a background task, off the request path. An answered request always leaves its usage row.

``UsageWriter.submit(record)`` never waits and never fails the request: the record gets a unique ``record_id`` and
is appended to this process's journal. The background task, woken by a record (at most once every ``USAGE_GATHER_S``,
so that under load the records of a moment share a transaction), seals the journal's open segment, inserts its records
in batches of ``limits.USAGE_BATCH`` rows (one transaction a batch, ``INSERT … ON CONFLICT (record_id) DO
NOTHING``), with the budget charges the inserted rows carry (``stages.budget_ledger.apply_charges``: a budget is settled
exactly once per request, in the transaction that records it), then deletes the segment. When the database cannot
be reached or is busy (locked, a lock or statement timeout, a serialization failure, a dropped connection:
``store.db.transient``), the segments wait on disk and the write is retried whole with a growing pause (up to
``USAGE_RETRY_MAX_S``); requests go on being answered meanwhile. A write that failed with its outcome unknown (its
reply to COMMIT lost) is read back at once: when all its records are there it is done, and its charges go to the lease
book as found there already, so no spend report counts them twice while a retry waits. At start, and
every ``USAGE_ORPHAN_SCAN_S``, the journals of processes that died are written the same way (a replay inserts a
record that is already in the database no second time).

A bad record never blocks the others: values are fitted to the schema before the insert (``fit``), and a batch that
still fails with an error of its data while the database answers is split until the record at fault is alone; only a
record that fails alone on a healthy database goes to the journal's
``dead-letter.jsonl`` and is counted (``dead_letters``, the metric ``decisiond_usage_dead_letters_total``), and the
rest go in. Only when the journal's disk refuses a record is it held in memory (at most ``USAGE_QUEUE_MAX``; beyond,
it is dropped, counted in ``lost`` and logged). ``aclose()`` writes what is journaled (for up to
``USAGE_FLUSH_TIMEOUT_S``); what the database did not take stays in the journal for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import String, delete, select
from sqlalchemy.engine import Connection

from ..errors import one_line
from ..limits import (
    USAGE_BATCH,
    USAGE_CUT_MARKER,
    USAGE_FLUSH_TIMEOUT_S,
    USAGE_GATHER_S,
    USAGE_ORPHAN_SCAN_S,
    USAGE_PING_TIMEOUT_S,
    USAGE_PURGE_INTERVAL_S,
    USAGE_QUEUE_MAX,
    USAGE_RETRY_MAX_S,
    USAGE_SLICE,
)
from ..store.batches import put_results
from ..store.db import Database, transient
from ..store.processes import pid_gone
from ..store.tables import BudgetWindow, UsageRow
from ..store.usage_rows import insert_new_postgres, insert_new_sqlite, values_of
from .decisions import insert_rows as insert_decisions
from .journal import Journal, read_segment
from .stages.budget_sql import apply_charges
from .types import Charge
from .usage import UsageRecord

log = logging.getLogger("decisiond.usage")


class DatabaseDown(Exception):
    """The database could not be reached: the records stay where they are (the journal) and are retried."""


def _fit_text(text: str, length: int | None) -> str:
    text = text.replace("\x00", "\ufffd")
    if not text.isascii():  # a lone surrogate (from an upstream's JSON) cannot be stored: "?" in its place
        text = text.encode("utf-8", "replace").decode("utf-8")
    if length is not None and len(text) > length:
        keep = max(0, length - len(USAGE_CUT_MARKER))
        text = text[:keep] + USAGE_CUT_MARKER[:length - keep]
    return text


def fit(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` made to fit the usage table before it is inserted: a string longer than its column is cut to the
    column's size, ending in ``USAGE_CUT_MARKER`` (a guardrail list, a model name: PostgreSQL refuses the whole
    insert otherwise); NUL characters and lone surrogates, which PostgreSQL refuses, are replaced; a missing value
    takes its column's default; keys that are no column are left out."""
    out: dict[str, Any] = {}
    for name, default, length, text in _COLUMNS:
        value = row.get(name)
        if value is None:
            value = default
        elif text:
            value = _fit_text(str(value), length)
        out[name] = value
    return out


# (name, the value for a missing one, the length of a string column, whether it is one), for ``fit``.
_COLUMNS = [(c.name, c.default.arg if not c.nullable and c.default is not None else None,
             c.type.length if isinstance(c.type, String) else None, isinstance(c.type, String))
            for c in UsageRow.__table__.columns if not c.primary_key]


@dataclass
class UsageWriter:
    """Journals each record (``submit``) and moves journaled records to the database in the background."""

    db: Database
    retention_days: int | None = None
    journal: Journal | None = None
    # Told of the budget charges of each batch once they are in the ledger (the budgets' view of this process), and
    # of those not applied because their record was in the table already (a request answered again: a batch line
    # taken up after a restart).
    on_written: Callable[[list[Charge]], None] | None = None
    on_dropped: Callable[[list[Charge]], None] | None = None
    # Held from before each write of charges until those callbacks have run (``budget_leases.LeaseBook.settling``):
    # whoever reads the ledger beside this process's view of it sees both as one.
    settling: asyncio.Lock | None = None
    queue_max: int = USAGE_QUEUE_MAX
    # Records the journal could not take (its disk refused them), held in memory up to queue_max.
    buffer: list[dict[str, Any]] = field(default_factory=list)
    lost: int = 0
    written: int = 0
    dead_letters: int = 0
    # Times a write was put off because the database was down or busy (its records kept, retried later).
    deferred: int = 0
    # Set once the journals of dead processes found at start are written (``batch_runner`` waits for it).
    replayed: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Held while dead processes' journals are replayed: one replay at a time (the scan's, ``replay_orphans``).
    _replaying: asyncio.Lock = field(default_factory=asyncio.Lock)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _scan_at: float = 0.0
    _drained_at: float = 0.0
    _task: asyncio.Task[None] | None = None
    _purger: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.journal is None:
            self.replayed.set()
        self._task = asyncio.create_task(self._run(), name="usage-writer")
        if self.retention_days is not None:
            self._purger = asyncio.create_task(self._purge_loop(), name="usage-purge")

    def wake(self) -> None:
        """Write what is journaled now (a label waits for its decision)."""
        self._wake.set()

    def submit(self, record: UsageRecord) -> None:
        """Journal ``record`` (before its response leaves); the writer takes it from there. Never waits."""
        row = record.row()
        row["record_id"] = record.record_id or uuid.uuid4().hex
        if self.journal is not None:
            try:
                self.journal.append(row)
                self._wake.set()
                return
            except OSError as error:
                log.error("usage record not journaled: kept in memory until it is written",
                          extra={"request_id": record.request_id, "error": one_line(error)})
        if len(self.buffer) >= self.queue_max:
            self.lost += 1
            if self.lost == 1 or self.lost % 1000 == 0:
                log.error("usage record dropped: neither the journal nor the writer's queue could take it",
                          extra={"lost": self.lost, "queue_max": self.queue_max, "request_id": record.request_id})
            return
        self.buffer.append(row)
        self._wake.set()

    def _scan_due(self) -> bool:
        """Whether to look for dead processes' journals now: at start (even when already stopping), then every
        USAGE_ORPHAN_SCAN_S while running."""
        if self.journal is None or time.monotonic() < self._scan_at:
            return False
        return self._scan_at == 0.0 or not self._stop.is_set()

    def _pending(self) -> bool:
        journal = self.journal
        return bool(self.buffer) or (journal is not None and bool(journal.pending or journal.sealed()))

    async def _run(self) -> None:
        pause = 0.25
        while True:
            if not self._pending() and not self._scan_due():
                if self._stop.is_set():
                    return
                self._wake.clear()
                # Until a record is submitted, or the next scan for dead processes' journals (none without one).
                wait = None if self.journal is None else max(0.0, self._scan_at - time.monotonic())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            gather = self._drained_at + USAGE_GATHER_S - time.monotonic()
            if gather > 0 and not self._stop.is_set():
                # Written a moment ago: let the records of this moment join one batch.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), gather)
            try:
                await self._drain()
                self._drained_at = time.monotonic()
                pause = 0.25
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if self._stop.is_set():
                    raise
                self.deferred += 1
                log.warning("usage records not written yet: database unavailable; retrying",
                            extra={"retry_in_s": pause, "error": one_line(error)})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), pause)
                pause = min(pause * 2, USAGE_RETRY_MAX_S)

    async def _drain(self) -> None:
        """Write what is journaled (this process's sealed segments, then dead processes' journals when a scan is
        due) and what waits in memory; ``DatabaseDown`` leaves the rest for the next try."""
        journal = self.journal
        if journal is not None:
            journal.seal()
            for segment in journal.sealed():
                await self._write_rows(read_segment(segment))
                journal.done(segment)
            if self._scan_due():
                await self._replay_orphans(journal)
                self._scan_at = time.monotonic() + USAGE_ORPHAN_SCAN_S
                self.replayed.set()
        while self.buffer:
            batch = self.buffer[:USAGE_BATCH]
            await self._insert(batch)
            del self.buffer[:len(batch)]

    async def _replay_orphans(self, journal: Journal) -> None:
        async with self._replaying:
            for orphan in journal.orphans():
                before = self.written
                try:
                    for segment in orphan.segments:
                        await self._write_rows(read_segment(segment))
                        segment.unlink(missing_ok=True)
                finally:
                    orphan.release()
                log.info("usage journal of a stopped process replayed",
                         extra={"journal": str(orphan.lock), "records": self.written - before})

    async def replay_orphans(self, pid: int | None = None) -> None:
        """Write the journals of dead processes now, not at the next scan; with ``pid`` (a process of this host
        that has died: ``batch_takeover``), return only once that process's journal is in the database, also when
        another process on the host is replaying it. Safe beside the background scan (one replay at a time in this
        process: a journal it is writing is waited for; another process's, up to ``USAGE_ORPHAN_SCAN_S``). Raises
        the database's error (``DatabaseDown``) when the records could not be written: they stay in the journal, and
        a later call writes them."""
        journal = self.journal
        if journal is None:
            return
        await self._replay_orphans(journal)
        deadline = time.monotonic() + USAGE_ORPHAN_SCAN_S
        while pid is not None and journal.held(pid) and pid_gone(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # another process on the host is writing it
            await self._replay_orphans(journal)

    async def _write_rows(self, rows: Iterator[dict[str, Any]]) -> None:
        while batch := list(itertools.islice(rows, USAGE_BATCH)):
            await self._insert(batch)

    async def _insert(self, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` in one transaction, with the budget charges they carry
        (``stages.budget_ledger.apply_charges``: of the rows inserted now only, so a replayed record is charged
        once). A failure of the database's state (it is down, locked, busy, timed out: ``store.db.transient``)
        raises ``DatabaseDown`` and the batch is retried whole later. Any other failure splits the batch until the
        record at fault is alone: it goes to the
        dead-letter file, the others go in."""
        try:
            fitted: list[dict[str, Any]] = []
            for start in range(0, len(rows), USAGE_SLICE):  # the event loop serves requests between slices
                fitted += [fit(r) for r in rows[start:start + USAGE_SLICE]]
                await asyncio.sleep(0)
            async with self.settling or contextlib.nullcontext():
                try:
                    charges, dropped = await self._write(rows, fitted)
                except Exception:
                    if not await self._there_already(rows):
                        raise
                    # Committed, its reply lost: done, each charge as one found there already (applied now or by
                    # an earlier try: the lease book reads its hold back).
                    charges, dropped = [], [Charge.of(c) for r in rows for c in r.get("charges") or ()]
                if charges and self.on_written is not None:
                    self.on_written(charges)
                if dropped and self.on_dropped is not None:
                    self.on_dropped(dropped)
            self.written += len(rows)
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            failure = error
        if transient(failure) or not await self.db.reachable(USAGE_PING_TIMEOUT_S):
            raise DatabaseDown(one_line(failure)) from failure
        if len(rows) > 1:
            half = len(rows) // 2
            await self._insert(rows[:half])
            await self._insert(rows[half:])
            return
        self.dead_letters += 1
        log.error("usage record refused by the database: kept in the dead-letter file",
                  extra={"request_id": rows[0].get("request_id"), "record_id": rows[0].get("record_id"),
                         "error": one_line(failure)})
        if self.journal is not None:
            self.journal.dead_letter(rows[0], one_line(failure))

    async def _there_already(self, rows: list[dict[str, Any]]) -> bool:
        """Whether every record of ``rows`` is in the database, read at once (within ``USAGE_PING_TIMEOUT_S``; False
        when it cannot be read): a write that failed with its outcome unknown — its reply to COMMIT lost — and did
        commit. Read before ``settling`` is let go, so that no spend report counts its charges twice: in the ledger,
        and as this process's charges not yet written."""
        ids = {r["record_id"] for r in rows}
        windows = sorted({(c.budget_id, c.window_start) for r in rows for c in map(Charge.of, r.get("charges") or ())})

        async def read() -> set[str]:
            async with self.db.session() as session:  # never committed: a read, rolled back as the session closes
                w = BudgetWindow
                for budget, start in windows:  # waits for the write, were it still committing (PostgreSQL)
                    await session.execute(select(w.spent).where(w.budget_id == budget, w.window_start == start)
                                          .with_for_update())
                found = await session.execute(select(UsageRow.record_id).where(UsageRow.record_id.in_(ids)))
                return {str(ident) for ident, in found}

        try:
            return await asyncio.wait_for(read(), USAGE_PING_TIMEOUT_S) >= ids
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _write(self, rows: list[dict[str, Any]],
                     fitted: list[dict[str, Any]]) -> tuple[list[Charge], list[Charge]]:
        """One transaction: the new rows inserted, the charges they carry applied, the decisions they carry kept
        (``decisions``); those charges, and those of the rows already there (not applied: a record is charged
        once)."""
        dialect = self.db.engine.dialect

        def inserted(new: set[str]) -> list[bool]:
            """Whether each row was inserted now: the first of its id among those new (a batch may hold one record
            twice: a line answered again after a restart, beside the first answer replayed)."""
            seen: set[str] = set()
            out = []
            for r in rows:
                ident = r["record_id"]
                out.append(ident in new and ident not in seen)
                seen.add(ident)
            return out

        def charged(now: list[bool]) -> tuple[list[Charge], list[Charge]]:
            applied: list[Charge] = []
            dropped: list[Charge] = []
            for r, new in zip(rows, now):
                (applied if new else dropped).extend(Charge.of(c) for c in r.get("charges") or ())
            return applied, dropped

        def kept(connection: Connection, now: list[bool]) -> None:
            """What the rows inserted now carry: the decisions they keep, the batch lines they answered."""
            insert_decisions(connection, [r["decision"] for r, new in zip(rows, now) if new and r.get("decision")])
            lines: dict[str, list[tuple[int, bool, Any]]] = {}
            for r, new in zip(rows, now):
                if new and r.get("batch_line") and r.get("batch_id"):
                    line, ok, body = r["batch_line"]
                    lines.setdefault(r["batch_id"], []).append((int(line), bool(ok), body))
            for batch_id, answered in lines.items():
                put_results(connection, batch_id, answered, replace=True)

        if self.db.writer is not None:  # SQLite: the whole transaction in a thread, the file's lock held briefly
            def run(connection: Connection) -> tuple[list[Charge], list[Charge]]:
                now = inserted(insert_new_sqlite(connection, fitted, values_of(fitted, dialect)))
                charges = charged(now)
                apply_charges(connection, charges[0])
                kept(connection, now)
                return charges

            return await self.db.write(run)
        values: list[list[Any]] = []
        for start in range(0, len(fitted), USAGE_SLICE):  # the event loop serves requests between slices
            values += values_of(fitted[start:start + USAGE_SLICE], dialect)
            await asyncio.sleep(0)
        async with self.db.session() as session, session.begin():
            now = inserted(await insert_new_postgres(session, values))
            charges = charged(now)
            connection = await session.connection()
            if charges[0]:
                await connection.run_sync(apply_charges, charges[0])
            if any(now):
                await connection.run_sync(kept, now)
        return charges

    async def aclose(self) -> None:
        """Write what is journaled (retrying until USAGE_FLUSH_TIMEOUT_S), then stop. What the database did not
        take stays in the journal, for the next start."""
        if self._purger is not None:
            self._purger.cancel()
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + USAGE_FLUSH_TIMEOUT_S
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), USAGE_FLUSH_TIMEOUT_S)
            self._task.cancel()
        while self._pending() and time.monotonic() < deadline:
            try:
                await self._drain()
            except Exception:
                await asyncio.sleep(0.5)
        if self.journal is not None:
            self.journal.close()
        if self.buffer:
            self.lost += len(self.buffer)
            log.error("usage records lost at shutdown: neither the journal nor the database took them",
                      extra={"lost": len(self.buffer)})
            self.buffer.clear()

    async def _purge_loop(self) -> None:
        while True:
            try:
                await self.purge()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("usage retention purge failed", extra={"error": f"{type(error).__name__}: {error}"})
            await asyncio.sleep(USAGE_PURGE_INTERVAL_S)

    async def purge(self) -> int:
        """Delete rows older than ``retention_days``; returns how many."""
        if self.retention_days is None:
            return 0
        cutoff = datetime.now(timezone.utc) - timedelta(days=self.retention_days)
        async with self.db.session() as session, session.begin():
            result = await session.execute(delete(UsageRow).where(UsageRow.time < cutoff))
        return int(getattr(result, "rowcount", 0) or 0)
