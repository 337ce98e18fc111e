"""The usage journal: every usage record is appended to a local file before its response leaves, so that an
answered request keeps its row even when the process is killed the next instant; the usage writer (``usage``) moves
journaled records to the database and removes the files it has written.

An append is one ``write`` of one JSON line to a file opened with ``O_APPEND``. Once ``write`` returns, the line is
in the kernel's page cache: a killed process (SIGKILL, OOM killer, a crash) cannot lose it, so no ``fsync`` is
made. A machine that loses power can lose what the kernel had not yet written back (Linux writes dirty pages
within ``vm.dirty_expire_centisecs``, 30 s by default): the records of the last seconds of answers.

One directory per database (``default_directory``), shared by every process on the host that writes to it; each
process owns files under a stem of its own, ``<pid>-<random>``:

- ``<stem>.lock``: locked (``flock``) for as long as the process lives. The lock is taken before the name exists
  (the file is created under a temporary name and renamed), so a lock file that can be locked belongs to a process
  that has died: its segments are orphans, and whichever process locks it first replays them.
- ``<stem>.<n>.jsonl``: segments. Records are appended to the open one; the writer seals it (a new one opens)
  before it writes what is sealed, and deletes a sealed segment once every record in it is in the database.
- ``dead-letter.jsonl``: records the database refused, one per line with the error (see ``usage``).

Replaying is idempotent: each record carries a unique ``record_id`` and is inserted only if no row has it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.engine import make_url

from ..store.db import data_directory, sqlite_file
from ..store.db import database_url as store_url

log = logging.getLogger("decisiond.usage")

DEAD_LETTER = "dead-letter.jsonl"


def default_directory(database_url: str | None) -> Path:
    """The journal of the database ``database_url`` names: beside a SQLite file (``<file>.usage-journal``), else in
    the data directory, under a name of the database (``usage-journal/<hash of its URL, password left out>``), so
    that two servers on one host writing to two databases never replay each other's records."""
    path = sqlite_file(database_url)
    if path is not None:
        return path.with_name(path.name + ".usage-journal")
    name = make_url(store_url(database_url)).render_as_string(hide_password=True)  # postgres:// = postgresql://
    return data_directory() / "usage-journal" / hashlib.sha256(name.encode()).hexdigest()[:16]


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def encode_row(row: dict[str, Any]) -> bytes:
    """One record as one line (``time`` as ISO 8601; anything JSON cannot hold as its text). A lone surrogate (from
    an upstream's JSON) is kept as such (``surrogatepass``)."""
    try:
        return orjson.dumps(row, default=_encode, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # a lone surrogate, which orjson refuses
        return (json.dumps(row, default=_encode, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
            "utf-8", "surrogatepass")


def decode_row(line: bytes) -> dict[str, Any] | None:
    """A journaled record, or None for a line that is not one (the torn last line of a killed process)."""
    try:
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:  # a lone surrogate written with surrogatepass, or a torn line
            row = json.loads(line.decode("utf-8", "surrogatepass"))
        if not isinstance(row, dict) or not isinstance(row.get("record_id"), str):
            return None
        row["time"] = datetime.fromisoformat(row["time"])
        return row
    except (ValueError, TypeError, KeyError):
        return None


def read_segment(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one segment, in order; lines that are not records are skipped (and logged)."""
    skipped = 0
    with path.open("rb") as f:
        for line in f:
            row = decode_row(line)
            if row is None:
                skipped += 1 if line.strip() else 0
                continue
            yield row
    if skipped:
        log.warning("usage journal lines skipped: not complete records (a write cut short by a kill)",
                    extra={"segment": str(path), "skipped": skipped})


def _lock(path: Path) -> int | None:
    """An exclusive lock on ``path`` if no live process holds it (its descriptor), else None."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _segments(directory: Path, stem: str) -> list[Path]:
    """``stem``'s segments, oldest first."""
    found = []
    for path in directory.glob(f"{stem}.*.jsonl"):
        number = path.name[len(stem) + 1:-len(".jsonl")]
        if number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


@dataclass
class Orphan:
    """The journal of a process that died: its segments, held under its lock until ``release``."""

    lock: Path
    fd: int
    segments: list[Path]

    def release(self) -> None:
        """Once every segment is written and deleted: remove the lock file and let go of it."""
        if not any(path.exists() for path in self.segments):
            self.lock.unlink(missing_ok=True)
        os.close(self.fd)


@dataclass
class Journal:
    """This process's journal in ``directory``. ``Journal.open`` raises ``OSError`` when it cannot be written."""

    directory: Path
    stem: str
    _lock_fd: int
    _number: int = 0
    _fd: int = -1
    _count: int = 0  # records in the open segment
    _sealed: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, directory: Path) -> "Journal":
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        stem = f"{os.getpid()}-{secrets.token_hex(4)}"
        fresh = directory / f".{stem}.lock-new"
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before the name an orphan scan looks for exists
        os.rename(fresh, directory / f"{stem}.lock")
        journal = cls(directory, stem, fd)
        journal._fd = journal._open_segment()
        return journal

    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.stem}.lock"

    @property
    def dead_letter_path(self) -> Path:
        return self.directory / DEAD_LETTER

    def _segment(self, number: int) -> Path:
        return self.directory / f"{self.stem}.{number}.jsonl"

    def _open_segment(self) -> int:
        return os.open(self._segment(self._number), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, row: dict[str, Any]) -> None:
        """Append one record; it survives the process from the moment this returns. ``OSError`` when the disk
        refuses (full, gone), or once the journal is closed."""
        if self._fd < 0:
            raise OSError("the usage journal is closed")
        data = memoryview(encode_row(row))
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        self._count += 1

    def seal(self) -> None:
        """Close the open segment (when it holds records) for the writer, and open the next."""
        if self._count == 0:
            return
        os.close(self._fd)
        self._sealed.append(self._segment(self._number))
        self._number += 1
        self._count = 0
        self._fd = self._open_segment()

    def sealed(self) -> list[Path]:
        """Sealed segments not yet deleted, oldest first."""
        return list(self._sealed)

    def done(self, segment: Path) -> None:
        """Every record of ``segment`` is in the database: delete it."""
        segment.unlink(missing_ok=True)
        self._sealed.remove(segment)

    @property
    def pending(self) -> int:
        """Records in the open segment (sealed ones are counted by the writer as it reads them)."""
        return self._count

    def orphans(self) -> Iterator[Orphan]:
        """The journals of dead processes on this directory, each locked for the caller until released."""
        for stale in self.directory.glob(".*.lock-new"):  # a process died between creating and naming its lock
            fd = _lock(stale)
            if fd is not None:
                stale.unlink(missing_ok=True)
                os.close(fd)
        for lock in sorted(self.directory.glob("*.lock")):
            if lock == self.lock_path:
                continue
            fd = _lock(lock)
            if fd is None:
                continue  # its process is alive
            if not lock.exists():  # replayed and removed by another process meanwhile
                os.close(fd)
                continue
            yield Orphan(lock, fd, _segments(self.directory, lock.name[:-len(".lock")]))

    def held(self, pid: int) -> bool:
        """Whether a journal of process ``pid`` is still on the directory (its lock file: records not all written,
        or a replay of them under way)."""
        return any(lock.name.startswith(f"{pid}-") for lock in self.directory.glob("*.lock"))

    def dead_letter(self, row: dict[str, Any], error: str) -> None:
        """Keep a record the database refused, with why, in ``dead-letter.jsonl`` (one line, appended)."""
        line = encode_row({"error": error, "record": row})
        fd = os.open(self.dead_letter_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Stop appending. Without records left, the files go; with some (the database was down), they stay, to be
        replayed by the next process that opens this directory."""
        os.close(self._fd)
        self._fd = -1
        if self._count == 0:
            self._segment(self._number).unlink(missing_ok=True)
        else:
            self._sealed.append(self._segment(self._number))
        if not self._sealed:
            self.lock_path.unlink(missing_ok=True)
        else:
            log.warning("usage records left in the journal: they are written at the next start",
                        extra={"journal": str(self.directory), "segments": len(self._sealed)})
        os.close(self._lock_fd)
