"""The long-running commands: ``decisiond serve`` (the HTTP server and gateway) and ``decisiond mcp`` (the MCP
tools over stdio), on one local model or on the gateway a config describes."""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import tempfile
from typing import TYPE_CHECKING, Any

from ..limits import BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_QUESTION_LABELS, MAX_QUESTION_LABELS
from .common import (
    add_model_args,
    add_quality_args,
    add_scheduling_args,
    build_router,
    is_loopback,
    log,
    read_inputs,
    refuse,
)
from .environment import serve_from_environment

if TYPE_CHECKING:
    from ..gateway.service import Gateway
    from ..gateway.settings import GatewayConfig

# uvicorn's exit code for a server that could not start (its port taken, its lifespan failed).
STARTUP_FAILURE = 3


def register_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run the HTTP server")
    add_model_args(serve)
    serve.add_argument("--host", default=None, help="default: $DECISIOND_HOST where set, else 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: $DECISIOND_PORT where set, else 8000")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    serve.add_argument("--config", default=None,
                       help="gateway YAML (providers, models, virtual models); default: $DECISIOND_CONFIG where set, "
                            "else none: the local model alone")
    serve.add_argument("--body-read-timeout", type=float, default=BODY_READ_TIMEOUT_S, metavar="SECONDS",
                       help="408 for a client whose whole body has not arrived by then "
                            f"(default {BODY_READ_TIMEOUT_S:g})")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve a non-loopback host although no API key is configured")
    serve.add_argument("--workers", type=int, default=None, metavar="N",
                       help="server processes on the one port (default: $DECISIOND_WORKERS where set, else 1): a "
                            "gateway uses N cores; each worker loads its own copy of a local model")
    serve.add_argument("--metrics-question-labels", type=int, default=None, metavar="N",
                       help="question names that get a label of their own in the decision quality metrics of "
                            f"/metrics, per model: the first N seen, the others '_other' (default "
                            f"{DEFAULT_QUESTION_LABELS}, 0 to {MAX_QUESTION_LABELS}; 0: none); overrides the config's "
                            "metrics.question_labels")
    add_scheduling_args(serve)
    add_quality_args(serve)
    serve.set_defaults(func=cmd_serve)


def register_mcp(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    mcp = sub.add_parser("mcp", help="serve the MCP tools decide and list_models over stdio")
    add_model_args(mcp)
    mcp.add_argument("--config", default=None, help="gateway YAML, as for serve")
    add_scheduling_args(mcp)
    add_quality_args(mcp)
    mcp.set_defaults(func=cmd_mcp)


def cmd_serve(args: argparse.Namespace) -> int:
    serve_from_environment(args)  # DECISIOND_CONFIG, DECISIOND_WORKERS where no argument says
    config = read_inputs(args)  # first: a file that cannot be used is refused at once
    # Lazy: the gateway (start-up time).
    from ..gateway.service import Gateway
    from ..gateway.settings import GatewayConfig

    unauthenticated = not Gateway.keys_configured(config or GatewayConfig())
    if unauthenticated and not is_loopback(args.host) and not args.allow_unauthenticated:
        return refuse(f"refusing to serve {args.host} without an API key: set auth.master_key in the config or "
                      "DECISIOND_MASTER_KEY, or pass --allow-unauthenticated")
    if args.workers < 1:
        return refuse(f"--workers must be 1 or more, not {args.workers}")
    labels = args.metrics_question_labels
    if labels is not None and not 0 <= labels <= MAX_QUESTION_LABELS:
        return refuse(f"--metrics-question-labels must be from 0 to {MAX_QUESTION_LABELS}, not {labels}")
    if config is None or any(p.type == "local" or p.tokenizer for p in config.providers):
        from ..engine.model import ModelNotFound, require_engine

        try:  # a gateway-only install is refused here, once, before a database is opened or a worker forked
            require_engine("a model served here, or a provider's tokenizer,")
        except ModelNotFound as error:
            return refuse(error)
    if args.workers == 1:
        return _serve_one(args, config)
    # Imported only once the configuration is known to be servable: a refusal above answers at once.
    import uvicorn

    from ..gateway.service import prepare
    from .workers import serve_workers

    asyncio.run(prepare(config or GatewayConfig()))  # migrations and the config's budgets, once
    from ..server.metrics import share_between_processes

    sock = uvicorn.Config(None, host=args.host, port=args.port).bind_socket()  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="decisiond-metrics-") as metrics:
        share_between_processes(metrics)  # /metrics adds up every worker's counts, whichever answers the scrape
        return serve_workers(args.workers, sock, lambda shared, index: _serve_one(args, config, shared,
                                                                                  (index, args.workers)))


def _serve_one(args: argparse.Namespace, config: GatewayConfig | None, sock: socket.socket | None = None,
               worker: tuple[int, int] = (0, 1)) -> int:
    """One server process: the router (local models loaded), the gateway and uvicorn, on ``sock`` when given (a
    worker of ``--workers``), else on ``--host``/``--port``."""
    import uvicorn

    from ..engine.calibration import ProfileError
    from ..engine.model import ModelNotFound
    from ..gateway.config import ConfigError
    from ..gateway.service import Gateway
    from ..server.app import create_app
    from ..server.settings import Settings

    try:
        router = build_router(args, config)
    except (ConfigError, ModelNotFound, ProfileError) as error:
        log.error(str(error))
        return refuse(error)
    settings = Settings(max_body_bytes=args.max_body_bytes, body_read_timeout=args.body_read_timeout, host=args.host)
    try:
        gateway = Gateway(router, _gateway_config(config, args.metrics_question_labels), worker)
    except ConfigError as error:
        return refuse(error)
    app = create_app(router, settings, gateway)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                                           timeout_keep_alive=60))
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        return runner.run(_serve(server, gateway, args, sock))


def _gateway_config(config: GatewayConfig | None, question_labels: int | None) -> GatewayConfig | None:
    """The gateway's config: the file's (None without one), with ``--metrics-question-labels`` over its
    ``metrics.question_labels``."""
    if question_labels is None:
        return config
    from ..gateway.settings import GatewayConfig
    from ..gateway.telemetry_settings import MetricsConfig

    return (config or GatewayConfig()).model_copy(update={"metrics": MetricsConfig(question_labels=question_labels)})


async def _serve(server: Any, gateway: Gateway, args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Start the gateway (database, usage journal) before serving, in the loop that serves: a setting that cannot
    work is refused with one line and exit 2, not a traceback from the app's start-up."""
    from ..gateway.config import ConfigError

    try:
        await gateway.start()
    except ConfigError as error:
        await gateway.aclose()
        return refuse(error)
    # What start-up made (modules, the config, a model's weights' wrappers) lives as long as the process: frozen out
    # of the collector, so that a full collection walks only what requests made (else it walks every module
    # object, and its pauses are a request's p99).
    gc.collect()
    gc.freeze()
    log.info("serving", extra={"host": args.host, "port": args.port})
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        await gateway.aclose()  # (the app's lifespan closed it already, unless the server never started)
    return 0 if server.started else STARTUP_FAILURE


def cmd_mcp(args: argparse.Namespace) -> int:
    """The MCP server over stdio (tools decide and list_models), on the model or the gateway config given."""
    config = read_inputs(args)  # first: a file that cannot be used is refused at once
    # Lazy: the gateway, the MCP server and decisiond.engine (torch) (start-up time).
    from ..engine.model import ModelNotFound
    from ..gateway.service import Gateway
    from ..server import mcp as mcp_server

    try:
        router = build_router(args, config)
    except ModelNotFound as error:
        return refuse(error)
    mcp_server.build(Gateway(router, config)).run("stdio")
    return 0
