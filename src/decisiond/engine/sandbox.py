"""Running code a request chose (a chat template it sends) under a time, memory and output limit.

A Jinja template can loop and build strings without bound, and a thread cannot be stopped from outside; so the
rendering runs in a forked child process whose address space is capped (``RLIMIT_AS``), which is killed when it
runs past its time, and whose output is cut off past its size. The child only renders and writes its result to a
pipe; the server's threads (the event loop, the model's worker) are not in it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import select
import signal
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from ..errors import InvalidRequest, LimitExceeded, Unavailable, refused
from ..limits import (
    REQUEST_TEMPLATE_BUDGET_S,
    REQUEST_TEMPLATE_MAX_OUTPUT,
    REQUEST_TEMPLATE_MEMORY_BYTES,
    REQUEST_TEMPLATE_TIMEOUT_S,
)

# The time left to the current request's template renders (all of them together), when one is set.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("template_deadline", default=None)


@contextlib.contextmanager
def request_deadline(seconds: float = REQUEST_TEMPLATE_BUDGET_S) -> Iterator[None]:
    """Every ``run_isolated`` inside shares one time budget: a request renders its template once per question,
    and the limit is on the request, not on each render."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def isolated_available() -> bool:
    return hasattr(os, "fork")


def run_isolated(fn: Callable[[], str], what: str, timeout_s: float = REQUEST_TEMPLATE_TIMEOUT_S,
                 memory_bytes: int = REQUEST_TEMPLATE_MEMORY_BYTES,
                 max_output: int = REQUEST_TEMPLATE_MAX_OUTPUT) -> str:
    """``fn()`` (a string) computed in a child process; a ``DecisionError`` naming ``what`` when it fails, runs past
    ``timeout_s``, needs more than ``memory_bytes`` beyond what the server has mapped, or returns more than
    ``max_output`` bytes."""
    if not isolated_available():
        raise refused(f"{what} cannot be rendered safely on this platform")
    deadline = time.monotonic() + timeout_s
    shared = _DEADLINE.get()
    if shared is not None and shared < deadline:
        deadline = shared
    if deadline <= time.monotonic():
        raise LimitExceeded(f"{what} took longer than the {REQUEST_TEMPLATE_BUDGET_S:g} s a request may spend "
                            "rendering it", code="template_limit")
    pid, read_fd = _fork(what, lambda write_fd: _child(fn, write_fd, memory_bytes, max_output))
    payload = _read_child(pid, read_fd, deadline, what, timeout_s, max_output)
    if payload[:1] == b"k" and len(payload) - 1 <= max_output:
        return payload[1:].decode("utf-8", "surrogatepass")
    if payload[:1] == b"k":
        raise LimitExceeded(f"{what} rendered more than {max_output:,} bytes", code="template_limit")
    if payload[:1] == b"e":
        reason = payload[1:].decode("utf-8", "replace")
        if reason.startswith("MemoryError"):
            reason = f"it needed more than {memory_bytes // 2**20} MiB"
        raise InvalidRequest(f"{what} failed: {reason}", code="chat_template_error")
    raise InvalidRequest(f"{what} failed: its renderer stopped without an answer", code="chat_template_error")


def _fork(what: str, child: Callable[[int], NoReturn]) -> tuple[int, int]:
    """A child process that runs ``child`` on the write end of a pipe; the parent gets its pid and the read end."""
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError as error:  # no memory or no process slot for the child
        os.close(read_fd)
        os.close(write_fd)
        raise Unavailable(f"{what} cannot be rendered now: {error.strerror}", code="server_overloaded",
                          type="api_error") from None
    if pid == 0:
        child(write_fd)
    os.close(write_fd)
    return pid, read_fd


def _child(fn: Callable[[], str], write_fd: int, memory_bytes: int, max_output: int) -> NoReturn:
    """The child: render, report (``k`` and the text, or ``e`` and the error), exit without running the parent's
    clean-up."""
    status = 0
    try:
        # Only the pipe to the parent stays open: not other requests' pipes or the server's sockets.
        os.closerange(3, write_fd)
        os.closerange(write_fd + 1, _max_fd())
        _cap_memory(memory_bytes)
        try:
            payload = b"k" + fn().encode("utf-8", "surrogatepass")[: max_output + 1]
        except BaseException as error:  # MemoryError, RecursionError, the template's own errors
            payload = b"e" + f"{type(error).__name__}: {error}"[:500].encode("utf-8", "replace")
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _read_child(pid: int, read_fd: int, deadline: float, what: str, timeout_s: float, max_output: int) -> bytes:
    """What the child wrote, read until it closes the pipe; past the deadline or the output limit, a
    ``LimitExceeded``. The child is killed and reaped either way."""
    chunks: list[bytes] = []
    size = 0
    poller = select.poll()  # not select(): descriptors above 1024 are common on a busy server
    poller.register(read_fd, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LimitExceeded(f"{what} took longer than {timeout_s:g} s to render", code="template_limit")
            if not poller.poll(left * 1000):
                continue
            data = os.read(read_fd, 1 << 16)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > max_output + 1:
                raise LimitExceeded(f"{what} rendered more than {max_output:,} bytes", code="template_limit")
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return b"".join(chunks)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


def _cap_memory(extra: int) -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, mapped + extra))
    except (OSError, ValueError, ImportError):  # no /proc: the time limit still holds
        pass
