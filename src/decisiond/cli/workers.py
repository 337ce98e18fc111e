"""``decisiond serve --workers N``: N server processes sharing one listening socket, so that a gateway uses every
core. The parent binds the socket, forks the workers (before it has an event loop or a thread), and supervises
them: SIGTERM or SIGINT is passed on to each and waited for; a worker that dies on its own is started again after a
pause (a worker that cannot start — exit 2 or 3 — stops them all, with its exit code).

Each worker is a whole server, as a replica is: its own event loop, connection pools, usage journal (one per
process) and budget leases; keys, budgets and usage live in the database they share, rate limits in Redis when it
is configured (else each worker enforces its part of every limit: ``stages.ratelimit.part``), the response cache in
Redis when configured (else each worker its own).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("decisiond.server")

# A worker that exits with one of these could not start (a setting refused, the socket or lifespan failed):
# starting it again would fail again.
START_FAILURES = (2, 3)
RESTART_PAUSE_S = 1.0


def serve_workers(count: int, sock: socket.socket, run: Callable[[socket.socket, int], int]) -> int:
    """Run ``run(sock, index)`` in ``count`` forked processes until SIGTERM/SIGINT; the exit code."""
    children: dict[int, int] = {}
    stopping = False
    code = 0

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker: it serves until told to stop, then leaves without the parent's cleanup
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            status = 1
            try:
                status = run(sock, index)
            except BaseException:  # noqa: BLE001 - logged, then the worker's exit code says it failed
                log.exception("worker failed", extra={"worker": index})
            finally:
                logging.shutdown()
                os._exit(status)
        children[pid] = index

    def stop(signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for index in range(count):
        spawn(index)
    log.info("serving with workers", extra={"workers": count, "pids": sorted(children)})
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        index = children.pop(pid, -1)
        if index < 0:
            continue
        exit_code = os.waitstatus_to_exitcode(status)
        if stopping:
            continue
        if exit_code in START_FAILURES:
            log.error("a worker could not start: stopping the others", extra={"worker": index, "exit": exit_code})
            code = exit_code
            stop()
            continue
        log.error("a worker stopped: starting it again", extra={"worker": index, "exit": exit_code})
        time.sleep(RESTART_PAUSE_S)
        if not stopping:
            spawn(index)
    sock.close()
    return code
