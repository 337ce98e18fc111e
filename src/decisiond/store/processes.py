"""Which process is which, and whether it has died: the one rule that tells a dead process's work from a live one's —
a batch's lease (``batches.claim``), an upload's temporary files (``server.files_fs.sweep``), a budget's hold
(``gateway.stages.budget_sql``).

A process is named by its machine (``machine``: the host name, the kernel's boot id and the PID namespace, so that
two containers sharing a host name are two machines) and its pid. Only a process of this process table can be known
dead (no process has its pid); one of another machine, or whose machine cannot be told, is never taken for dead.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path


def machine() -> str:
    """What tells this process's process table from another's: the host name, the kernel's boot id and the PID
    namespace (two containers may share a host name, never both of the others)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        boot = namespace = "?"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _gone(where: str, pid: str) -> bool:
    """Whether ``pid`` on ``where`` is a process of this process table that has died (not this one)."""
    if where != machine() or "?" in where or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def runner_name() -> str:
    """This process's name as a lease holder: ``machine:pid:random``."""
    return f"{machine()}:{os.getpid()}:{os.urandom(4).hex()}"


def dead_pid(runner: str | None) -> int | None:
    """The pid of a lease holder (``runner_name``) that is a process of this process table that has died; None for
    a live one, another machine's, or no holder."""
    parts = (runner or "").rsplit(":", 2)
    if len(parts) != 3 or not _gone(parts[0], parts[1]):
        return None
    return int(parts[1])


def holder_gone(runner: str | None) -> bool:
    """Whether a lease holder is no process (no holder) or one of this process table that has died (its lease need
    not run out)."""
    return not runner or dead_pid(runner) is not None


def pid_gone(pid: int) -> bool:
    """Whether no process of this process table has the id ``pid`` (it has died, and its id is not reused)."""
    return _gone(machine(), str(pid))


def _digest(machine: str) -> str:
    return hashlib.sha256(machine.encode()).hexdigest()[:12]


def process_mark() -> str:
    """This process as a mark fit for a file name (letters, digits and one ``-``): its machine's digest and its
    pid."""
    return f"{_digest(machine())}-{os.getpid()}"


def mark_gone(mark: str) -> bool:
    """Whether ``mark`` (``process_mark``) names a process of this process table that has died."""
    digest, _, pid = mark.partition("-")
    here = machine()
    return digest == _digest(here) and _gone(here, pid)
