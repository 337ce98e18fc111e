"""The commands that answer requests without a server: ``decisiond decide`` (one request, JSON in and out) and
``decisiond batch`` (a JSON Lines file, resumable; on a model loaded here or a running decisiond)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import decisiond

from .. import canonical
from ..batch import run as run_batch
from ..errors import DecisionError, InputError, openai_param
from .common import (
    add_model_args,
    add_quality_args,
    build_router,
    check_readable,
    check_writable,
    local_engine,
    read_input,
    read_inputs,
)

if TYPE_CHECKING:
    from ..gateway.settings import GatewayConfig


def register_decide(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    decide = sub.add_parser("decide", help="answer one decision request (JSON file or stdin) and print the answer")
    add_model_args(decide)
    decide.add_argument("file", nargs="?", default="-", help="request JSON file, or - for stdin")
    decide.add_argument("--pretty", action="store_true", help="indent the JSON output")
    add_quality_args(decide)
    decide.set_defaults(func=cmd_decide)


def register_batch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batch = sub.add_parser("batch", help="answer a JSON Lines file of requests or inputs; resumable")
    add_model_args(batch)
    add_quality_args(batch)
    batch.add_argument("file", help="JSON Lines: one request (with questions) or one input per line")
    batch.add_argument("--out", required=True, help="answers, JSON Lines; lines already answered there are skipped")
    batch.add_argument("--questions", default=None, help="JSON list of questions for lines that are inputs")
    batch.add_argument("--url", default=None, help="a running decisiond to ask instead of loading --model here")
    batch.add_argument("--config", default=None,
                       help="a gateway YAML to answer through here (--model then names one of its models, e.g. a "
                            "cascade)")
    batch.add_argument("--api-key", default=None, help="key for --url (default: $DECISIOND_API_KEY)")
    batch.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(func=cmd_batch)


def cmd_decide(args: argparse.Namespace) -> int:
    """One decision from a JSON request (OpenAI's shape) read from a file or stdin; the response on stdout.

    The pipeline is run here rather than through ``Gateway.answer_openai``: that one requires the request's model to
    be known (``strict_model=True``, as the HTTP route does), while ``decide`` answers with the one model it loaded
    whatever the request names."""
    # Lazy: the gateway, the dialects' pydantic models and numpy (start-up time).
    from ..dialects import openai as dialect
    from ..dialects.common import parse_json
    from ..gateway.router import Router
    from ..gateway.service import Gateway
    from ..gateway.types import Context

    raw = read_input(args.file or "-")
    read_inputs(args)  # the profile, before the model loads
    try:  # a request the server would refuse is refused as it would be (its error object, exit 1), before the load
        request = dialect.parse_request(parse_json(raw))
    except DecisionError as error:
        return _print(args, dialect.error_body(error), 1)
    engine = local_engine(args)
    try:
        router = Router.local_only(engine)
        context = Context("cli", "decide", "openai", strict_model=False)
        result = asyncio.run(Gateway(router).pipeline.run(context, request))
        if not isinstance(result, canonical.DecisionResult):
            raise TypeError(f"the pipeline answered a decision with a {type(result).__name__}")
        out, code = dialect.render_response(result, request), 0
    except DecisionError as error:
        out, code = dialect.error_body(error), 1
    return _print(args, out, code)


def _print(args: argparse.Namespace, out: Any, code: int) -> int:
    json.dump(out, sys.stdout, indent=2 if args.pretty else None, ensure_ascii=False)
    sys.stdout.write("\n")
    return code


def _decider(args: argparse.Namespace, config: GatewayConfig | None) -> decisiond.Engine | decisiond.Client:
    """``--url``: a remote decisiond (``--model`` names the model there); ``--config``: the gateway it describes,
    built here; otherwise the model loaded here."""
    if getattr(args, "url", None):
        key = args.api_key or os.environ.get("DECISIOND_API_KEY")
        return decisiond.Client(args.url, key, model=args.model)
    if config is not None:
        return decisiond.Engine(build_router(args, config), model=args.model)
    return decisiond.load(args.model, dtype=args.dtype, device=args.device, served_name=args.served_model_name,
                          order=args.order, calibrate=args.calibrate, calibration=args.calibration)


def cmd_batch(args: argparse.Namespace) -> int:
    """Answer a JSON Lines file; resumable (see ``decisiond.batch``)."""
    # Every file read before a model loads or a server is asked: lines that are not JSON or not requests are
    # the batch's to answer (an error record each), a file that cannot be read is refused here.
    check_readable(args.file)
    if Path(args.out).exists():
        check_readable(args.out)  # the answers of an earlier run
    check_writable(args.out)
    questions = _questions(args.questions) if args.questions else None
    decider = _decider(args, read_inputs(args))
    try:
        summary = run_batch(decider, Path(args.file), Path(args.out), questions, concurrency=args.concurrency,
                            progress=not args.no_progress)
    finally:
        decider.close()
    print(f"decisiond batch: {summary}; wrote {args.out}", file=sys.stderr)
    return 0 if summary.errors == 0 else 1


def _questions(path: str) -> list[Any]:
    """The questions of ``--questions``: a JSON list of questions in ``/v1/decisions``' shape, or an object with
    one under ``questions``; checked as the server checks a request's."""
    # Lazy: the dialects' pydantic models (start-up time).
    from ..dialects import openai as dialect

    try:
        data = json.loads(read_input(path))
    except json.JSONDecodeError as error:
        raise InputError(InputError.not_json(error), path, error.lineno) from None
    except UnicodeDecodeError as error:
        raise InputError.unreadable(path, error) from None
    questions = data.get("questions") if isinstance(data, dict) else data
    if not isinstance(questions, list):
        raise InputError('must be a JSON list of questions, or an object {"questions": [...]}', path,
                         field="questions")
    try:
        dialect.parse_request({"model": "default", "input": "-", "questions": questions})
    except DecisionError as error:
        raise InputError(error.message, path, field=openai_param(error.path) or "questions") from None
    return questions
