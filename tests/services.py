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
