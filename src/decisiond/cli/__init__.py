"""Command line: ``decisiond serve`` (server and gateway), ``decide`` (one request, no server), ``eval`` and
``calibrate`` (labeled data), ``bench`` (the side-by-side benchmark).

The commands live in families (``serve``: serve, mcp; ``decide``: decide, batch; ``measure``: eval, calibrate,
bench; ``admin``: keys, usage, labels, quality), each registering its own subcommands; what they share is in
``common``. Building the parser imports nothing heavy: each command imports torch, the gateway or uvicorn when it
runs.

A file or setting a command cannot use raises ``InputError`` where it is read; ``main`` prints it as one line,
``decisiond: FILE:LINE: FIELD: what is wrong``, and exits 2, never with a traceback. Every help names the docs
page that explains the command (``DOCS``)."""

from __future__ import annotations

import argparse

from .. import logs
from ..errors import InputError
from ..version import __version__
from . import admin, decide, measure, serve
from .common import refuse

# In the order ``decisiond --help`` lists them.
_COMMANDS = (serve.register_serve, decide.register_decide, decide.register_batch, serve.register_mcp,
             measure.register_eval, measure.register_calibrate, admin.register_keys, admin.register_usage,
             admin.register_labels, admin.register_quality, admin.register_learn, measure.register_bench)

# The docs pages that explain each command (None: ``decisiond`` itself), each with what it covers where a
# command has several; every ``--help`` ends with them.
DOCS: dict[str | None, tuple[tuple[str, str | None], ...]] = {
    None: (("docs/index.md", None), ("docs/quickstart.md", "a first request with each SDK")),
    "serve": (("docs/guides/serving.md", None), ("docs/guides/gateway.md", "--config: the gateway YAML")),
    "mcp": (("docs/guides/mcp.md", None),),
    "decide": (("docs/quickstart.md", None),),
    "batch": (("docs/guides/batch.md", None),),
    "eval": (("docs/guides/better-probabilities.md", None),),
    "calibrate": (("docs/guides/better-probabilities.md", None),),
    "keys": (("docs/guides/keys-limits-budgets.md", None),),
    "usage": (("docs/guides/keys-limits-budgets.md", None),),
    "labels": (("docs/guides/better-probabilities.md", "stored decisions and labels"),),
    "quality": (("docs/guides/better-probabilities.md", "stored decisions and labels"),),
    "learn": (("docs/guides/better-probabilities.md", "learning from the labels"),),
    "bench": (("docs/performance.md", None),),
}


def docs_epilog(command: str | None) -> str:
    """The ``docs: PAGE`` lines that end the help of ``command``."""
    return "\n".join(f"docs: {page}" + (f" ({about})" if about else "") for page, about in DOCS[command])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands ``parser`` has, by name."""
    return {name: p for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, p in action.choices.items()}


def _with_docs(parser: argparse.ArgumentParser, epilog: str) -> None:
    """End ``parser``'s help, and its subcommands' (``keys create``), with ``epilog``, its lines kept."""
    parser.epilog = epilog
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for child in _subcommands(parser).values():
        _with_docs(child, epilog)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decisiond", description="Decision models from any chat LLM.",
                                     epilog=docs_epilog(None), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"decisiond {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _COMMANDS:
        register(sub)
    for name, command in _subcommands(parser).items():
        _with_docs(command, docs_epilog(name))  # a command missing from DOCS fails here, at once
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        code: int = args.func(args)
    except InputError as error:  # a file or setting the command cannot use: one line, exit 2
        return refuse(error)
    return code
