"""Real servers on loopback for the tests: decisiond itself, started as its own process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_decisiond(*args: str, env: dict | None = None, ready_timeout: float = 300.0) -> RunningServer:
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="decisiond-", suffix=".log", delete=False)
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "decisiond.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    server = RunningServer(f"http://127.0.0.1:{port}", process, Path(log_file.name))
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"decisiond exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"decisiond did not become ready:\n{server.log()}")
