"""Command line: ``decisiond serve`` (server and gateway), ``decide`` (one request, no server), ``eval`` and
``calibrate`` (labeled data), ``bench`` (the side-by-side benchmark).

The commands live in families (``serve``: serve, mcp; ``decide``: decide, batch; ``measure``: eval, calibrate,
bench; ``admin``: keys, usage), each registering its own subcommands; what they share is in ``common``. Building
the parser imports nothing heavy: each command imports torch, the gateway or uvicorn when it runs."""

from __future__ import annotations

import argparse

from .. import logs
from ..version import __version__
from . import admin, decide, measure, serve

# In the order ``decisiond --help`` lists them.
_COMMANDS = (serve.register_serve, decide.register_decide, decide.register_batch, serve.register_mcp,
             measure.register_eval, measure.register_calibrate, admin.register_keys, admin.register_usage,
             measure.register_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decisiond", description="Decision models from any chat LLM.")
    parser.add_argument("--version", action="version", version=f"decisiond {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    code: int = args.func(args)
    return code
