"""Backing services started on free loopback ports, for ``decisiond bench --gateway`` (and the test suite, which
wraps them): ``redis-server``, and a PostgreSQL server made with ``initdb`` and run with ``pg_ctl`` in a temp dir
(as the ``postgres`` user when running as root: PostgreSQL refuses to run as root). ``Unavailable`` says why one
cannot start."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Unavailable(Exception):
    """A service that cannot start here (not installed, or it failed): the message says which and why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port



def stop_process(process: Any, timeout: float) -> None:
    """SIGTERM, then SIGKILL if ``process`` (a ``subprocess.Popen`` or alike) has not exited within ``timeout``."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

@dataclass
class Redis:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.process, 10)


def start_redis() -> Redis:
    binary = shutil.which("redis-server")
    if binary is None:
        raise Unavailable("redis-server is not installed (Debian package redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--protected-mode", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return Redis(port, process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise Unavailable("redis-server did not start")


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@dataclass
class Postgres:
    bin: Path
    data: Path
    port: int
    as_user: list[str]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), *args],
                              capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._ctl("-o", options, "-l", str(self.data / "server.log"), "-w", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop", check=False)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data.parent, ignore_errors=True)


def start_postgres() -> Postgres:
    pg_bin = _pg_bin()
    if pg_bin is None:
        raise Unavailable("PostgreSQL is not installed (Debian package postgresql)")
    root = Path(tempfile.mkdtemp(prefix="decisiond-pg-"))
    data = root / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise Unavailable("running as root and runuser is missing: cannot start PostgreSQL as 'postgres'")
        as_user = [runuser, "-u", "postgres", "--"]
        os.chmod(root, 0o755)
        shutil.chown(root, "postgres", "postgres")
    init = subprocess.run([*as_user, str(pg_bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                           "-E", "UTF8", "--no-sync"], capture_output=True, text=True, timeout=120)
    if init.returncode != 0:
        raise Unavailable(f"initdb failed: {init.stderr[-500:]}")
    server = Postgres(pg_bin, data, free_port(), as_user)
    try:
        server.start()
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"PostgreSQL did not start: {e.stderr[-500:]}") from None
    return server


@dataclass
class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``) on a loopback port."""

    port: int
    model: str  # the name it answers to: the GGUF's path
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        stop_process(self.process, 10)
        self.log.unlink(missing_ok=True)


def start_llamacpp(gguf: str | os.PathLike[str], threads: int = 2, context: int = 4096,
                   timeout: float = 120) -> LlamaCppServer:
    """llama-cpp-python's server on ``gguf``, with the log-probabilities of every position kept (``--logits_all``:
    its completions route reads them) and ``threads`` compute threads, once it has answered a first completion (which
    takes seconds: later ones do not); ``Unavailable`` where it is not installed (``llama-cpp-python[server]``, in
    decisiond's test extras) or does not start."""
    import importlib.util
    import sys

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
        raise Unavailable("llama-cpp-python's server is not installed (pip install 'llama-cpp-python[server]')")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="llamacpp-", suffix=".log")[1])
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port",
             str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(context),
             "--logits_all", "true", "--verbose", "false"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Unavailable(f"llama.cpp's server exited with {process.returncode}: "
                              f"{log.read_text(errors='replace')[-500:]}")
        try:
            body = json.dumps({"prompt": "Hello", "max_tokens": 1, "logprobs": 1}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())):
                return LlamaCppServer(port, str(gguf), process, log)
        except OSError:
            time.sleep(0.2)
    stop_process(process, 10)
    raise Unavailable(f"llama.cpp's server did not start within {timeout:g} s")


@dataclass
class VllmServer:
    """vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``) on a loopback port, in a process group
    of its own (its engine core and worker are child processes)."""

    port: int
    model: str  # the name it answers to (--served-model-name)
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        import signal

        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.unlink(missing_ok=True)


def vllm_python() -> Path | None:
    """The interpreter of vLLM's own environment: ``$DECISIOND_VLLM_PYTHON``, else ``.venv-vllm`` of the working
    directory (``tests/install_vllm.sh`` makes it), where it exists."""
    named = os.environ.get("DECISIOND_VLLM_PYTHON")
    path = Path(named) if named else Path(".venv-vllm/bin/python").absolute()
    return path if path.exists() else None


def start_vllm(folder: str | os.PathLike[str], name: str, python: str | os.PathLike[str] | None = None,
               args: tuple[str, ...] = (), dtype: str = "float32", context: int = 2048,
               timeout: float = 420) -> VllmServer:
    """vLLM serving the model ``folder`` as ``name`` in ``dtype``, eager (no compilation: it starts in about a minute
    on two cores), with 1 GiB of KV cache and a context of ``context`` tokens, once its ``/v1/models`` answers;
    ``args``: more of its options. ``Unavailable`` where vLLM is not installed or does not start."""
    python = python or vllm_python()
    if python is None or not Path(python).exists():
        raise Unavailable("vLLM is not installed (tests/install_vllm.sh makes .venv-vllm)")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
             name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
             "--max-model-len", str(context), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    server = VllmServer(port, name, process, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            server.stop()
            raise Unavailable(f"vLLM exited with {process.returncode}: {tail}")
        try:
            with urllib.request.urlopen(f"{server.url}/models", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise Unavailable(f"vLLM did not start within {timeout:g} s")
