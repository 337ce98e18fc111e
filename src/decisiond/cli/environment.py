"""``decisiond serve``'s settings from the environment, for containers and process managers that set variables rather
than arguments (the image's ``CMD`` stays the same whatever the deployment):

- ``DECISIOND_CONFIG``: the gateway YAML, as ``--config`` (empty or unset: none, the local model alone);
- ``DECISIOND_WORKERS``: server processes, as ``--workers`` (unset: 1);
- ``DECISIOND_HOST`` and ``DECISIOND_PORT``: the address served, as ``--host`` and ``--port`` (unset: 127.0.0.1 and
  8000; the image sets 0.0.0.0, and its health check reads ``DECISIOND_PORT``).

An argument given on the command line wins. A value that cannot be used is refused naming the variable, before
anything loads (``InputError``: ``decisiond: DECISIOND_WORKERS must be …``, exit 2). The gateway's own variables
(``DECISIOND_MASTER_KEY``, ``DECISIOND_DATABASE_URL``, ``DECISIOND_REDIS_URL``, ``DECISIOND_USAGE_JOURNAL``) and the
``${VAR}`` references of the YAML are read where they are used.
"""

from __future__ import annotations

import argparse
import os

from ..errors import InputError

CONFIG_ENV = "DECISIOND_CONFIG"
WORKERS_ENV = "DECISIOND_WORKERS"
HOST_ENV = "DECISIOND_HOST"
PORT_ENV = "DECISIOND_PORT"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# A bound well past any machine's cores: a typo (10000) is refused rather than forking thousands of processes.
MAX_WORKERS = 256


def serve_from_environment(args: argparse.Namespace) -> None:
    """Fill ``args.config``, ``args.workers``, ``args.host`` and ``args.port`` from the environment where the command
    line left them unset (``None``); ``InputError`` for a value that cannot be used."""
    if args.config is None:
        args.config = os.environ.get(CONFIG_ENV) or None
    if args.workers is None:
        args.workers = _whole(WORKERS_ENV, os.environ.get(WORKERS_ENV), 1, 1, MAX_WORKERS)
    if args.host is None:
        args.host = (os.environ.get(HOST_ENV) or "").strip() or DEFAULT_HOST
    if args.port is None:
        args.port = _whole(PORT_ENV, os.environ.get(PORT_ENV), DEFAULT_PORT, 1, 65535)


def _whole(name: str, value: str | None, default: int, low: int, high: int) -> int:
    """The variable ``name``'s ``value`` as a whole number from ``low`` to ``high``; ``default`` when unset or
    empty."""
    if value is None or not value.strip():
        return default
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 6 or not low <= int(text) <= high:
        raise InputError(f"{name} must be a whole number from {low} to {high}, not {value[:40]!r}")
    return int(text)
