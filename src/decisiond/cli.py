"""Command line: ``decisiond serve`` and ``decisiond decide``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from . import __version__, logs

log = logging.getLogger("decisiond")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M-Instruct), a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--served-model-name", default=None, help="name the model answers to (default: from --model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1… (default: cuda when available)")
    p.add_argument("--log-level", default="info")


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    from .engine.scheduler import DEFAULT_MAX_BATCH_TOKENS

    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help=f"padded tokens per batched forward pass across concurrent requests "
                        f"(default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long the scheduler waits for more requests to join a batch (default 2 ms)")


def _engine(args: argparse.Namespace):
    from .engine import model as model_mod
    from .engine.local import LocalEngine

    loaded = model_mod.load(args.model, dtype=args.dtype, device=args.device, served_name=args.served_model_name)
    log.info("model loaded", extra={"model": loaded.name, "path": loaded.path, "dtype": loaded.dtype,
                                    "device": loaded.device, "context_length": loaded.context_length})
    scheduling = {}
    if hasattr(args, "max_batch_tokens"):
        scheduling = {"max_batch_tokens": args.max_batch_tokens, "max_wait_s": args.max_wait_ms / 1000}
    return LocalEngine(loaded, **scheduling)


def _router(args: argparse.Namespace):
    """With ``--config``: the gateway it describes (local providers load their models); without: the local
    engine alone."""
    from .gateway.router import Router

    if not getattr(args, "config", None):
        return Router.local_only(_engine(args))
    from .engine import model as model_mod
    from .engine.local import LocalEngine
    from .gateway import config as gateway_config

    config = gateway_config.load(args.config)
    engines = {}
    for provider in config.providers:
        if provider.type == "local":
            loaded = model_mod.load(provider.model or "default", dtype=provider.dtype, device=args.device,
                                    served_name=provider.served_model_name)
            engines[provider.name] = LocalEngine(loaded, max_batch_tokens=args.max_batch_tokens,
                                                 max_wait_s=args.max_wait_ms / 1000)
    log.info("gateway configured", extra={"providers": [p.name for p in config.providers],
                                          "models": [m.name for m in config.models],
                                          "virtual_models": [v.name for v in config.virtual_models]})
    return Router.from_config(config, engines)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .server import Settings, create_app

    from .engine.model import ModelNotFound
    from .gateway.config import ConfigError

    try:
        router = _router(args)
    except (ConfigError, ModelNotFound) as error:
        log.error(str(error))
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    app = create_app(router, Settings(max_body_bytes=args.max_body_bytes))
    log.info("serving", extra={"host": args.host, "port": args.port})
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                timeout_keep_alive=60)
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    """One decision from a JSON request (OpenAI's shape) read from a file or stdin; the response on stdout."""
    from .dialects import openai as dialect
    from .dialects.common import parse_json
    from .errors import DecisionError
    from .gateway.router import Router

    raw = sys.stdin.buffer.read() if args.file in (None, "-") else open(args.file, "rb").read()
    try:
        request = dialect.parse_request(parse_json(raw))
        router = Router.local_only(_engine(args))
        result = asyncio.run(router.decide(request, strict=False))
        out, code = dialect.render_response(result, request), 0
    except DecisionError as error:
        out, code = dialect.error_body(error), 1
    json.dump(out, sys.stdout, indent=2 if args.pretty else None, ensure_ascii=False)
    sys.stdout.write("\n")
    return code


def cmd_bench(args: argparse.Namespace) -> int:
    """The side-by-side benchmark; writes markdown (and JSON) reports."""
    from .bench import runner

    report = runner.run(model=args.model, tickets=args.tickets,
                        question_sets=tuple(int(x) for x in args.questions.split(",")),
                        clients=tuple(int(x) for x in args.clients.split(",")),
                        naive_tickets=args.naive_tickets, dtype=args.dtype,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    command = "decisiond bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "decisiond bench"
    text = runner.markdown(report, args.command_line or command)
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    if args.json:
        open(args.json, "w").write(runner.to_json(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decisiond", description="Decision models from any chat LLM.")
    parser.add_argument("--version", action="version", version=f"decisiond {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)
    serve.add_argument("--config", default=None,
                       help="gateway YAML (providers, models, virtual models); without it, the local model alone")
    _add_scheduling_args(serve)
    serve.set_defaults(func=cmd_serve)

    decide = sub.add_parser("decide", help="answer one decision request (JSON file or stdin) and print the answer")
    _add_model_args(decide)
    decide.add_argument("file", nargs="?", default="-", help="request JSON file, or - for stdin")
    decide.add_argument("--pretty", action="store_true", help="indent the JSON output")
    decide.set_defaults(func=cmd_decide)

    bench = sub.add_parser("bench", help="measure the naive loop, decisiond in-process and over HTTP, side by side")
    bench.add_argument("--model", default="default")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--tickets", type=int, default=200, help="support tickets per workload (default 200)")
    bench.add_argument("--questions", default="3,10", help="question-set sizes to run (default 3,10)")
    bench.add_argument("--clients", default="1,4,16", help="concurrent HTTP clients per phase (default 1,4,16)")
    bench.add_argument("--naive-tickets", type=int, default=None, help="run the naive loop on the first N tickets only")
    bench.add_argument("--out", default=None, help="write the markdown report here")
    bench.add_argument("--json", default=None, help="write the raw numbers here")
    bench.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    bench.add_argument("--log-level", default="warning")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
