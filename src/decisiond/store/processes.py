"""Which process holds something (a batch's lease, a budget's hold), and whether it has died.

A holder is named ``machine:pid:random``: the machine is what tells this process table from another's (the host
name, the kernel's boot id and the PID namespace: two containers may share a host name, never both of the others),
the random part what tells a process from an earlier one that had the same PID.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def machine() -> str:
    """This process table's name: ``host/boot id/PID namespace`` (with ``?`` where they cannot be read)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        boot = namespace = "?"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def holder_name() -> str:
    """A new name for this process as a holder: ``machine:pid:random``."""
    return f"{machine()}:{os.getpid()}:{os.urandom(4).hex()}"


def holder_gone(holder: str | None) -> bool:
    """Whether a holder is a process of this process table that has died (what it holds need not run out). A
    holder of another machine, or one whose machine cannot be told, is never known to be gone."""
    if not holder:
        return True
    parts = holder.rsplit(":", 2)
    if len(parts) != 3:
        return False
    where, pid, _ = parts
    if where != machine() or "?" in where or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
