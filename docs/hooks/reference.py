"""MkDocs hook: the reference pages that are generated from the code, so that they cannot drift from it.

- ``reference/config.md``: every key of the gateway's YAML, walked from ``decisiond.gateway.settings.GatewayConfig``
  (types, defaults and constraints from the pydantic fields, text from their attribute docstrings);
- ``reference/cli.md``: every command's ``--help``, from ``decisiond.cli.build_parser()``.

Neither page exists in git; both are added to the site at build time (``on_files``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import types
import typing
from typing import Any

from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


# ------------------------------------------------------------------------------------------------ config


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``…)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"map of {_type_name(key)} to {_type_name(value)}"
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


def _constraints(field: FieldInfo) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤",
             "pattern": "matches"}
    found = []
    for meta in field.metadata:
        for name, sign in words.items():
            value = getattr(meta, name, None)
            if value is not None:
                found.append(f"{sign} `{value}`")
    return ", ".join(found)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(its defaults)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return ""
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_page() -> str:
    from decisiond.gateway import config as config_module
    from decisiond.gateway.settings import GatewayConfig

    order: list[type[BaseModel]] = []
    where: dict[type[BaseModel], str] = {GatewayConfig: "the top level"}

    def walk(model: type[BaseModel], path: str) -> None:
        if model in order:
            return
        order.append(model)
        for name, field in model.model_fields.items():
            for inner in _models_in(field.annotation):
                many = typing.get_origin(field.annotation) is list or any(
                    typing.get_origin(a) is list for a in typing.get_args(field.annotation))
                key = f"{path}{name}{'[]' if many else ''}"
                where.setdefault(inner, f"`{key}`")
                walk(inner, key + ".")

    walk(GatewayConfig, "")
    out = ["# Configuration file", "",
           "The gateway's YAML file, given as `decisiond serve --config gw.yaml`. Every key below, with its type, "
           "default and meaning, is generated from the pydantic models that validate the file "
           "(`decisiond.gateway.settings`), so it cannot drift from what the server accepts. Unknown keys are "
           "refused, with a message that names the entry at fault.", "",
           "## Loading", "", inspect.cleandoc(config_module.__doc__ or ""), ""]
    for model in order:
        out += [f"## {model.__name__}", "", f"At {where[model]}.", ""]
        if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
            out += [inspect.cleandoc(model.__doc__), ""]
        out += ["| key | type | default | constraints | meaning |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {_constraints(field)} | "
                       f"{_cell(field.description or '')} |")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------- cli


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subcommands(sub, f"{prefix} {name}")
    return found


def cli_page() -> str:
    from decisiond.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help at the terminal's width: one width for the page
    out = ["# Command line", "",
           "Every `decisiond` command and its options, as `--help` prints them (generated from the parser at build "
           "time). A command refuses bad input with one line on stderr naming the file, the line and the field, "
           "and exits with status 2.", ""]
    for name, parser in _subcommands(build_parser(), "decisiond"):
        out += [f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------- hook


def on_files(files: Files, config: Any) -> Files:
    for path, content in ((CONFIG_PAGE, config_page()), (CLI_PAGE, cli_page())):
        files.append(File.generated(config, path, content=content))
    return files
