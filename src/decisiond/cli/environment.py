"""``decisiond serve``'s settings from the environment, for containers and process managers that set variables rather
than arguments (the image's ``CMD`` stays the same whatever the deployment):

- ``DECISIOND_CONFIG``: the gateway YAML, as ``--config`` (empty or unset: none, the local model alone);
- ``DECISIOND_WORKERS``: server processes, as ``--workers`` (unset: 1).

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
# A bound well past any machine's cores: a typo (10000) is refused rather than forking thousands of processes.
MAX_WORKERS = 256


def serve_from_environment(args: argparse.Namespace) -> None:
    """Fill ``args.config`` and ``args.workers`` from the environment where the command line left them unset
    (``None``); ``InputError`` for a value that cannot be used."""
    if args.config is None:
        args.config = os.environ.get(CONFIG_ENV) or None
    if args.workers is None:
        args.workers = workers(os.environ.get(WORKERS_ENV))


def workers(value: str | None) -> int:
    """``DECISIOND_WORKERS`` as a count of processes: 1 when unset or empty."""
    if value is None or not value.strip():
        return 1
    text = value.strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise InputError(f"{WORKERS_ENV} must be a whole number from 1 to {MAX_WORKERS}, not {value[:40]!r}")
    return int(text)
