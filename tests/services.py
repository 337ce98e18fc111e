"""Real backing services for the tests, started on free loopback ports by ``decisiond.bench.services``:
``redis-server``, a PostgreSQL server (``initdb``/``pg_ctl`` in a temp dir, as the ``postgres`` user when
running as root, since PostgreSQL refuses to run as root) and llama.cpp's OpenAI-compatible server (llama-cpp-python's,
on a GGUF). Where one cannot be started, the test is skipped on a developer's machine and fails under ``CI=true``: CI
installs them (``.ci/run``: ``apt-get``, and ``install.sh`` the test extras)."""

from __future__ import annotations

import os

import pytest

from decisiond.bench import services
from decisiond.bench.services import Postgres, Redis


def unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message} (CI=true: a needed service must start)")
    pytest.skip(message)


def start_redis() -> Redis:
    try:
        return services.start_redis()
    except services.Unavailable as error:
        unavailable(str(error))
        raise


def start_postgres() -> Postgres:
    try:
        return services.start_postgres()
    except services.Unavailable as error:
        unavailable(str(error))
        raise


def start_llamacpp(gguf, threads: int = 2):
    try:
        return services.start_llamacpp(gguf, threads)
    except services.Unavailable as error:
        unavailable(str(error))
        raise


def start_chromium(*args: str):
    """A headless Chromium driven by selenium (Debian ``chromium`` + ``chromium-driver``), with ``args``; skipped
    where it is not installed or does not start (failed under ``CI=true``). The caller quits it."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        unavailable("chromium and chromedriver are not installed (Debian packages chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--no-first-run", *args):
        options.add_argument(arg)
    try:
        return webdriver.Chrome(service=Service(driver_path), options=options)
    except WebDriverException as error:
        unavailable(f"headless Chromium did not start: {error.msg}")
        raise


def start_vllm(folder, name: str, *args: str):
    """vLLM serving ``folder`` (``decisiond.bench.services.start_vllm``), its environment made first where it is
    missing (``tests/install_vllm.sh``, under a lock: one worker installs, the others wait)."""
    install_vllm()
    try:
        return services.start_vllm(folder, name, args=args)
    except services.Unavailable as error:
        unavailable(str(error))
        raise


def install_vllm() -> None:
    import fcntl
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    with open(root / ".venv-vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(["bash", str(root / "tests" / "install_vllm.sh")], capture_output=True, text=True,
                              timeout=1200)
    if done.returncode != 0:
        unavailable(f"vLLM could not be installed: {(done.stderr or done.stdout)[-800:]}")
    os.environ.setdefault("DECISIOND_VLLM_PYTHON", str(root / ".venv-vllm" / "bin" / "python"))
