"""The files folder of the Files and Batch APIs on disk (``batches.files_path``): private to the OS user, and clear
of what interrupted work leaves behind.

- **Modes.** The folder, and each folder above it that decisiond makes, is 0700; every file decisiond writes in it
  (an upload, its ``.part`` and custom-id SQLite files, a batch's output and error files and their ``.tmp`` files)
  is 0600, whatever the process's umask: each is made with that mode and then set to it (a umask only takes bits
  away, ``fchmod`` does not heed it). An existing folder that others may enter is set to 0700: its files are
  prompts and answers.
- **Leftovers.** An upload's temporary files are named after the file and the process writing them
  (``.{file_id}.{mark}.part`` and ``.{file_id}.{mark}.custom-ids.sqlite3``, ``mark`` from
  ``store.processes.process_mark``). ``sweep`` (at a runner's start, then at each of its housekeeping rounds)
  deletes those of a process of this host that has died, and any temporary file older than ``TEMPORARY_TTL_S`` (of
  another host, whose process cannot be known dead, or of an older decisiond that named them otherwise: an upload is
  copied into the folder in seconds, a batch's output written in minutes). A live upload's files, of this process,
  another on this host or a replica on another host sharing the folder, are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..store.processes import mark_gone, process_mark

log = logging.getLogger("decisiond.batches")

FOLDER_MODE = 0o700
FILE_MODE = 0o600
# How old a temporary file must be before a sweep deletes it when its process cannot be known dead.
TEMPORARY_TTL_S = 3600.0
# Temporary files: an upload's, named after its process (file id, mark, kind), and any other (by age alone).
_MARKED = re.compile(r"^\.(file-[0-9a-f]+)\.([0-9a-f]+-[0-9]+)\.(part|custom-ids\.sqlite3)$")
_TEMPORARY = re.compile(r"^\..+\.(part|tmp)$|^\.custom-ids-.*\.sqlite3$")


def make_folder(folder: Path) -> None:
    """``folder`` made if missing (with the folders above it that are missing), each 0700; an existing ``folder``
    that group or others may use is set to 0700 (a warning when it cannot be: another user's)."""
    missing = []
    here = folder
    while not here.exists():
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by a replica sharing it
            os.mkdir(path, FOLDER_MODE)
            os.chmod(path, FOLDER_MODE)
    if stat.S_IMODE(folder.stat().st_mode) & 0o077:
        try:
            os.chmod(folder, FOLDER_MODE)
        except OSError as error:
            log.warning("the files folder %s is open to other users and cannot be made private: %s", folder,
                        error.strerror)


def create(path: Path) -> BinaryIO:
    """A file at ``path``, empty, mode 0600, open for writing (an existing one is truncated and set to 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def upload_names(folder: Path, file_id: str) -> tuple[Path, Path]:
    """The temporary files of this process's upload of ``file_id``: the ``.part`` file it is copied to, and the
    SQLite file its custom ids are checked in."""
    stem = f".{file_id}.{process_mark()}"
    return folder / f"{stem}.part", folder / f"{stem}.custom-ids.sqlite3"


def sweep(folder: Path, now: Callable[[], float] = time.time) -> int:
    """Delete the temporary files left in ``folder`` by interrupted work that is provably over: those of a dead
    process of this host, and any older than ``TEMPORARY_TTL_S``. How many were deleted."""
    deleted = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        marked = _MARKED.match(entry.name)
        if not marked and not _TEMPORARY.match(entry.name):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile (its upload ended, another replica swept it)
            if (marked and mark_gone(marked.group(2))) or now() - entry.stat().st_mtime > TEMPORARY_TTL_S:
                os.unlink(entry.path)
                deleted += 1
    if deleted:
        log.info("files folder: %d temporary files of interrupted work deleted", deleted)
    return deleted


def request_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(index, line) of each request line of a file of the folder (blank lines skipped; indices count every
    line)."""
    with path.open("rb") as file:
        for n, raw in enumerate(file):
            if raw.strip():
                yield n, raw
