"""Real decisiond processes for the tests: servers on loopback and CLI runs.

Each one is its own process running ``decisiond.cli.main``, forked from a *preloaded* interpreter (a multiprocessing
forkserver that has imported decisiond, torch and transformers once). Importing those costs 7–10 s of CPU on this
machine, which used to be paid again by every server and every CLI run of the suite; a fork is instant. The child is
otherwise a normal process: its own environment, stdin, stdout and stderr (files), exit code and signals. The few
tests about the command line itself (``python -m decisiond.cli``) pass ``fresh=True`` and start a new interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from decisiond.bench.services import stop_process

# What every decisiond process imports before it can do anything; the forkserver imports it once.
PRELOAD = ["decisiond.cli", "decisiond.server", "decisiond.engine.local", "decisiond.batch",
           "transformers.models.llama.modeling_llama"]
_context: multiprocessing.context.ForkServerContext | None = None


def _preloaded() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _main(argv: list[str], env: dict[str, str], stdin: str, stdout: str, stderr: str,
          umask: int | None = None) -> None:
    """The child: its own environment, standard streams and (given one) umask, then ``decisiond.cli.main`` and its
    exit code."""
    if umask is not None:
        os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    for fd, path, mode in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_APPEND),
                          (2, stderr, os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    import logging

    from decisiond import cli

    sys.argv = [cli.__file__, *argv]  # as ``python -m decisiond.cli ARGV`` sets it
    try:
        code = cli.main(argv)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


class Child:
    """A decisiond process with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, stdin: bytes | None,
                 merged: bool = False, umask: int | None = None) -> None:
        folder = Path(tempfile.mkdtemp(prefix="decisiond-"))
        self.stdin_path, self.stdout_path = folder / "stdin", folder / "stdout"
        self.stderr_path = self.stdout_path if merged else folder / "stderr"
        self.stdin_path.write_bytes(stdin or b"")
        self.stdout_path.touch()
        self.stderr_path.touch()
        self.args = argv
        self.process = _preloaded().Process(
            target=_main, daemon=True,
            args=(argv, dict(os.environ) if env is None else env, str(self.stdin_path), str(self.stdout_path),
                  str(self.stderr_path), umask))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self, text: bool = True) -> tuple[str | bytes, str | bytes]:
        out, err = self.stdout_path.read_bytes(), self.stderr_path.read_bytes()
        return (out.decode(errors="replace"), err.decode(errors="replace")) if text else (out, err)

    def communicate(self, timeout: float | None = None, text: bool = True) -> tuple[str | bytes, str | bytes]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return self.output(text)


def decisiond(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> Child:
    """Start ``decisiond ARGS`` as its own process. ``env`` replaces the environment, as in ``subprocess``."""
    return Child(list(args), env, stdin)


def run_decisiond(*args: str, input: bytes | str | None = None, env: dict[str, str] | None = None,
                  timeout: float = 600, text: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``decisiond ARGS`` to its end, like ``subprocess.run(..., capture_output=True)``. ``fresh``: in a new
    interpreter (``python -m decisiond.cli``), for the tests about the command line itself."""
    data = input.encode() if isinstance(input, str) else input
    if fresh:
        done = subprocess.run([sys.executable, "-m", "decisiond.cli", *args], input=data, capture_output=True,
                              env=env, timeout=timeout)
        if text:
            return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                               done.stderr.decode(errors="replace"))
        return done
    child = decisiond(*args, env=env, stdin=data)
    out, err = child.communicate(timeout, text=text)
    return subprocess.CompletedProcess(list(args), child.wait(), out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    process: Child
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.process, 20)


def start_decisiond(*args: str, env: dict | None = None, ready_timeout: float = 300.0,
                    umask: int | None = None) -> RunningServer:
    """``decisiond serve ARGS`` on a free loopback port, once ``/health`` answers; stdout and stderr in one log.
    ``env`` is added to the test process's environment; ``umask``, given, is the server process's."""
    port = free_port()
    process = Child(["serve", "--host", "127.0.0.1", "--port", str(port), *args],
                    {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, None, merged=True, umask=umask)
    server = RunningServer(f"http://127.0.0.1:{port}", process, process.stdout_path)
    deadline = time.monotonic() + ready_timeout
    with httpx.Client(timeout=2) as client:  # one client: each new one loads the CA bundle (~80 ms of CPU)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"decisiond exited with {process.returncode}:\n{server.log()}")
            try:
                if client.get(server.url + "/health").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"decisiond did not become ready:\n{server.log()}")


def warm() -> None:
    """Start the preloading forkserver now, so that its imports overlap test collection."""
    from multiprocessing import forkserver

    _preloaded()
    forkserver.ensure_running()
