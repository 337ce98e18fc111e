"""Command line: ``decisiond serve`` (server and gateway), ``decide`` (one request, no server), ``eval`` and
``calibrate`` (labeled data), ``bench`` (the side-by-side benchmark)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

from . import logs
from .limits import BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from .version import __version__

if TYPE_CHECKING:
    from . import library
    from .engine.calibration import Profile
    from .engine.local import LocalEngine
    from .gateway.router import Router
    from .gateway.settings import GatewayConfig


log = logging.getLogger("decisiond")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M-Instruct), a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--served-model-name", default=None, help="name the model answers to (default: from --model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1… (default: cuda when available)")
    p.add_argument("--log-level", default="info")


def _add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--order", default=None, choices=["given", "cyclic"],
                   help="choice option order: as given, or averaged over every cyclic shift (requests may override; "
                        "default: the profile's, else given)")
    p.add_argument("--calibrate", default=None, choices=["none", "contextual"],
                   help="divide out the label prior measured on content-free inputs (requests may override; "
                        "default: the profile's, else none)")
    p.add_argument("--calibration", default=None, metavar="PROFILE",
                   help="a profile written by 'decisiond calibrate': the mode it was fitted under and fitted "
                        "temperatures (and biases) per question type; refused for another model or prompt format")


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    from .limits import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS

    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help=f"padded tokens per batched forward pass across concurrent requests "
                        f"(default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long the scheduler waits for more requests to join a batch (default 2 ms)")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="memory for KV caches of prompt prefixes kept across requests, so a document asked again "
                        "is not recomputed (default: 1/16 of the machine's memory, at most 2048; 0 turns it off)")
    p.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                   help="tokens one request may make the model compute after prefix sharing; more is refused with "
                        f"400 (default {DEFAULT_MAX_REQUEST_TOKENS})")
    p.add_argument("--max-queued-tokens", type=int, default=DEFAULT_MAX_QUEUED_TOKENS,
                   help="tokens of admitted work not yet computed, across requests; a request that would go over "
                        f"gets 503 with retry-after-ms (default {DEFAULT_MAX_QUEUED_TOKENS})")
    p.add_argument("--allow-request-templates", action="store_true",
                   help="let a request's chat_template_kwargs.chat_template replace the model's chat template "
                        "(rendered in a child process under a time, memory and output limit); refused otherwise")


def _engine(args: argparse.Namespace) -> LocalEngine:
    from .engine import model as model_mod
    from .engine.local import LocalEngine

    loaded = model_mod.load(args.model, dtype=args.dtype, device=args.device, served_name=args.served_model_name)
    log.info("model loaded", extra={"model": loaded.name, "path": loaded.path, "dtype": loaded.dtype,
                                    "device": loaded.device, "context_length": loaded.context_length})
    options: dict[str, Any] = {}
    if hasattr(args, "max_batch_tokens"):
        options = _scheduling(args)
    if hasattr(args, "order"):
        options.update(order=args.order, calibrate=args.calibrate, profile=_profile(args.calibration))
    return LocalEngine(loaded, **options)


def _scheduling(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_queued_tokens < args.max_request_tokens:
        raise SystemExit(f"decisiond: --max-queued-tokens ({args.max_queued_tokens}) must be at least "
                         f"--max-request-tokens ({args.max_request_tokens})")
    return {"max_batch_tokens": args.max_batch_tokens, "max_wait_s": args.max_wait_ms / 1000,
            "prefix_cache_mb": args.prefix_cache_mb, "max_request_tokens": args.max_request_tokens,
            "max_queued_tokens": args.max_queued_tokens, "allow_templates": args.allow_request_templates}


def _profile(path: str | None) -> Profile | None:
    """The calibration profile at ``path`` (None without one); the engine checks it fits its model and mode."""
    from .engine.calibration import Profile

    return Profile.load(path) if path else None


def _load_config(args: argparse.Namespace) -> GatewayConfig | None:
    from .gateway import config as gateway_config

    return gateway_config.load(args.config) if getattr(args, "config", None) else None


def _router(args: argparse.Namespace, config: GatewayConfig | None = None) -> Router:
    """With a config: the gateway it describes (local providers load their models); without: the local engine
    alone."""
    from .gateway.router import Router

    if config is None:
        return Router.local_only(_engine(args))
    from .engine import model as model_mod
    from .engine.local import LocalEngine

    engines = {}
    for provider in config.providers:
        if provider.type == "local":
            loaded = model_mod.load(provider.model or "default", dtype=provider.dtype, device=args.device,
                                    served_name=provider.served_model_name)
            engines[provider.name] = LocalEngine(
                loaded, **_scheduling(args),
                order=provider.order or args.order, calibrate=provider.calibrate or args.calibrate,
                profile=_profile(provider.calibration or args.calibration))
    log.info("gateway configured", extra={"providers": [p.name for p in config.providers],
                                          "models": [m.name for m in config.models],
                                          "virtual_models": [v.name for v in config.virtual_models]})
    return Router.from_config(config, engines)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from .gateway.config import ConfigError
    from .gateway.service import Gateway
    from .gateway.settings import GatewayConfig

    try:
        config = _load_config(args)
    except ConfigError as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    unauthenticated = not Gateway.keys_configured(config or GatewayConfig())
    if unauthenticated and not _loopback(args.host) and not args.allow_unauthenticated:
        print(f"decisiond: refusing to serve {args.host} without an API key: set auth.master_key in the config or "
              "DECISIOND_MASTER_KEY, or pass --allow-unauthenticated", file=sys.stderr)
        return 2
    # Imported only once the configuration is known to be servable: a refusal above answers at once.
    import uvicorn

    from .engine.calibration import ProfileError
    from .engine.model import ModelNotFound
    from .server.app import Settings, create_app

    try:
        router = _router(args, config)
    except (ConfigError, ModelNotFound, ProfileError) as error:
        log.error(str(error))
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    settings = Settings(max_body_bytes=args.max_body_bytes, body_read_timeout=args.body_read_timeout)
    app = create_app(router, settings, Gateway(router, config))
    log.info("serving", extra={"host": args.host, "port": args.port})
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                timeout_keep_alive=60)
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    """One decision from a JSON request (OpenAI's shape) read from a file or stdin; the response on stdout."""
    from . import canonical
    from .dialects import openai as dialect
    from .dialects.common import parse_json
    from .engine.calibration import ProfileError
    from .errors import DecisionError
    from .gateway.router import Router
    from .gateway.service import Gateway
    from .gateway.types import Context

    raw = sys.stdin.buffer.read() if args.file in (None, "-") else open(args.file, "rb").read()
    try:
        engine = _engine(args)
    except ProfileError as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    try:
        request = dialect.parse_request(parse_json(raw))
        router = Router.local_only(engine)
        context = Context("cli", "decide", "openai", strict_model=False)
        result = asyncio.run(Gateway(router).pipeline.run(context, request))
        if not isinstance(result, canonical.DecisionResult):
            raise TypeError(f"the pipeline answered a decision with a {type(result).__name__}")
        out, code = dialect.render_response(result, request), 0
    except DecisionError as error:
        out, code = dialect.error_body(error), 1
    json.dump(out, sys.stdout, indent=2 if args.pretty else None, ensure_ascii=False)
    sys.stdout.write("\n")
    return code


def _decider(args: argparse.Namespace) -> library.Engine | library.Client:
    """``--url``: a remote decisiond (``--model`` names the model there); otherwise the model loaded here."""
    import os

    from . import library

    if getattr(args, "url", None):
        key = args.api_key or os.environ.get("DECISIOND_API_KEY")
        return library.Client(args.url, key, model=args.model)
    return library.load(args.model, dtype=args.dtype, device=args.device, served_name=args.served_model_name,
                        order=args.order, calibrate=args.calibrate, calibration=args.calibration)


def cmd_batch(args: argparse.Namespace) -> int:
    """Answer a JSON Lines file; resumable (see ``decisiond.batch``)."""
    from pathlib import Path

    from . import batch

    questions = None
    if args.questions:
        questions = json.loads(Path(args.questions).read_text())
        if isinstance(questions, dict):
            questions = questions.get("questions")
        if not isinstance(questions, list):
            print("decisiond: --questions must hold a JSON list of questions (or {\"questions\": [...]})",
                  file=sys.stderr)
            return 2
    decider = _decider(args)
    try:
        summary = batch.run(decider, Path(args.file), Path(args.out), questions, concurrency=args.concurrency,
                            progress=not args.no_progress)
    finally:
        decider.close()
    print(f"decisiond batch: {summary}; wrote {args.out}", file=sys.stderr)
    return 0 if summary.errors == 0 else 1


def cmd_mcp(args: argparse.Namespace) -> int:
    """The MCP server over stdio (tools decide and list_models), on the model or the gateway config given."""
    from .engine.model import ModelNotFound
    from .gateway.config import ConfigError
    from .gateway.service import Gateway
    from .server import mcp as mcp_server

    try:
        config = _load_config(args)
        router = _router(args, config)
    except (ConfigError, ModelNotFound) as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    mcp_server.build(Gateway(router, config)).run("stdio")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The side-by-side benchmark; writes markdown (and JSON) reports."""
    from .bench import runner

    report = runner.run(model=args.model, tickets=args.tickets,
                        question_sets=tuple(int(x) for x in args.questions.split(",") if x),
                        clients=tuple(int(x) for x in args.clients.split(",")),
                        naive_tickets=args.naive_tickets, dtype=args.dtype, long_documents=args.long_documents,
                        fairness_blocks=args.fairness,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    command = "decisiond bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "decisiond bench"
    text = runner.markdown(report, args.command_line or command)
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    if args.json:
        open(args.json, "w").write(runner.to_json(report))
    return 0


def _load_engine_for(args: argparse.Namespace) -> LocalEngine:
    from .engine import model as model_mod
    from .engine.local import LocalEngine

    return LocalEngine(model_mod.load(args.model, dtype=args.dtype, served_name=args.served_model_name))


def cmd_eval(args: argparse.Namespace) -> int:
    """Accuracy, log loss, Brier, ECE per mode side by side with bootstrap intervals; JSON report and reliability
    diagram."""
    from pathlib import Path

    from . import evaluation

    items = evaluation.load(args.file)
    report = evaluation.evaluate(_load_engine_for(args), items, threshold=args.threshold, with_bias=args.bias,
                                 coverage=args.coverage, resamples=args.resamples, seed=args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    evaluation.plot(report, out / "reliability.png")
    print(evaluation.table(report))
    print(f"\nbest mode: {report['best_mode']}; wrote {out / 'report.json'} and {out / 'reliability.png'}",
          file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a regularised temperature (and optionally a per-position bias) per question type on top of a mode, or
    on top of the best mode (``--auto``); write a profile."""
    from . import evaluation
    from .engine.calibration import FOLDS

    items = evaluation.load(args.file)
    profile, summary = evaluation.calibrate(_load_engine_for(args), items, order=args.order,
                                            calibrate_mode=args.calibrate, with_bias=args.bias, auto=args.auto,
                                            source=args.file, resamples=args.resamples, seed=args.seed)
    profile.save(args.out)
    mode = evaluation.mode_name(profile.order, profile.calibrate)
    if args.auto:
        losses = ", ".join(f"{m} {v:.3f}" for m, v in summary["log_loss_by_mode"].items())
        print(f"best mode by cross-validated log loss: {summary['best_mode']} ({losses})")
    for kind, row in summary["kinds"].items():
        if row["kept_base"]:
            print(f"{kind}: {row['questions']} questions, kept the base mode {mode}: no fit beat it in "
                  f"cross-validated log loss ({row['cv_log_loss_base']:.3f})")
        else:
            print(f"{kind}: {row['questions']} questions, {mode}+fit with L2 strength {row['strength']:g} "
                  f"(chosen by {FOLDS}-fold CV), temperature {row['temperature']:.3f}"
                  + (f", bias {[round(b, 3) for b in row['bias']]}" if row["bias"] else "")
                  + f", cross-validated log loss {row['cv_log_loss_base']:.3f} -> {row['cv_log_loss']:.3f}")
    print(f"wrote {args.out}; serve with: decisiond serve --model {args.model} --calibration {args.out} "
          f"(it applies order {profile.order}, calibrate {profile.calibrate} and the fits)", file=sys.stderr)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """Managed keys in the database the server uses (``--config``'s database_url, or DECISIOND_DATABASE_URL, or
    the default SQLite file): the same code as the admin API."""
    from datetime import datetime, timedelta, timezone

    from .gateway.config import ConfigError
    from .gateway.service import DATABASE_URL_ENV
    from .gateway.settings import RateLimitConfig, check_user_path, unknown_guardrail
    from .store.db import Database
    from .store.keys import KeyStore

    try:
        config = _load_config(args)
    except ConfigError as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    guardrails = list(dict.fromkeys(g.strip() for g in (getattr(args, "guardrails", None) or "").split(",")
                                    if g.strip()))
    defined = [g.name for g in config.guardrails] if config else []
    missing = unknown_guardrail(guardrails, defined)
    if missing is not None:  # checked against the server's config, as the admin API checks them
        print(f"decisiond: unknown guardrail {missing!r}; configured guardrails: "
              f"{', '.join(repr(n) for n in defined) or 'none (give the server config with --config)'}",
              file=sys.stderr)
        return 2
    import os

    url = args.database_url or (config.database_url if config else None) or os.environ.get(DATABASE_URL_ENV)

    async def run() -> int:
        db = await Database.open(url)
        store = KeyStore(db)
        try:
            if args.action == "create":
                limits = RateLimitConfig(requests_per_minute=args.rpm, requests_per_day=args.rpd,
                                         input_tokens_per_minute=args.tpm, concurrent=args.concurrent)
                expires = (datetime.now(timezone.utc) + timedelta(seconds=args.expires_in)
                           if args.expires_in else None)
                record, key = await store.create(
                    args.name, check_user_path(args.user_path),
                    [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None,
                    limits.model_dump(exclude_defaults=True) or None, expires, guardrails)
                print(json.dumps({**record.public(), "key": key}, indent=2))
                print("The key is shown once; store it now.", file=sys.stderr)
            elif args.action == "list":
                rows = [r.public() for r in await store.list()]
                print(f"{'id':<18} {'name':<20} {'user_path':<20} {'status':<8} models")
                for r in rows:
                    print(f"{r['id']:<18} {r['name'][:20]:<20} {r['user_path'][:20]:<20} {r['status']:<8} "
                          f"{','.join(r['models']) if r['models'] is not None else '*'}")
            else:
                revoked = await store.revoke(args.id)
                if revoked is None:
                    print(f"decisiond: no API key with id {args.id!r}", file=sys.stderr)
                    return 1
                print(json.dumps(revoked.public(), indent=2))
            return 0
        finally:
            await db.aclose()

    try:
        return asyncio.run(run())
    except ValueError as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2


def cmd_usage(args: argparse.Namespace) -> int:
    """Usage totals from the database the server writes to (the same query as ``GET /admin/usage/summary``),
    printed as a table."""
    import os
    from datetime import date, datetime, timedelta, timezone

    from .gateway import usage
    from .gateway.config import ConfigError
    from .gateway.service import DATABASE_URL_ENV
    from .store.db import Database

    try:
        config = _load_config(args)
        groups = [g.strip() for g in args.group_by.split(",") if g.strip()]
        unknown = [g for g in groups if g not in usage.GROUPS]
        if unknown:
            raise ConfigError(f"--group-by: unknown group {unknown[0]!r}; use {', '.join(usage.GROUPS)}")
        start = datetime.combine(date.fromisoformat(args.start), datetime.min.time(), timezone.utc) \
            if args.start else None
        end = datetime.combine(date.fromisoformat(args.end), datetime.min.time(), timezone.utc) + timedelta(days=1) \
            if args.end else None
    except (ConfigError, ValueError) as error:
        print(f"decisiond: {error}", file=sys.stderr)
        return 2
    url = args.database_url or (config.database_url if config else None) or os.environ.get(DATABASE_URL_ENV)

    async def run() -> list[dict]:  # type: ignore[type-arg]
        db = await Database.open(url)
        try:
            return await usage.summary(db, groups, usage.UsageFilter(start=start, end=end,
                                                                     request_type=args.request_type))
        finally:
            await db.aclose()

    rows = asyncio.run(run())
    headers = [*groups, "requests", "input_tokens", "output_tokens", "cost_usd"]
    cells = [[str(r[g]) if r[g] is not None else "-" for g in groups]
             + [str(r["requests"]), str(r["input_tokens"]), str(r["output_tokens"]), f"{r['cost_usd']:.6f}"]
             for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) if i < len(groups) else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    return 0


def _add_labeled_args(p: argparse.ArgumentParser) -> None:
    """Arguments eval and calibrate share."""
    p.add_argument("file", help="labeled JSON Lines (input, questions, gold)")
    p.add_argument("--model", default="default")
    p.add_argument("--served-model-name", default=None,
                   help="the name the model will be served under (a profile is tied to it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--bias", action="store_true", help="fit a per-position bias too (a learned prior correction)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples for the intervals (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--log-level", default="warning")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decisiond", description="Decision models from any chat LLM.")
    parser.add_argument("--version", action="version", version=f"decisiond {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    serve.add_argument("--config", default=None,
                       help="gateway YAML (providers, models, virtual models); without it, the local model alone")
    serve.add_argument("--body-read-timeout", type=float, default=BODY_READ_TIMEOUT_S, metavar="SECONDS",
                       help="408 for a client whose whole body has not arrived by then "
                            f"(default {BODY_READ_TIMEOUT_S:g})")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve a non-loopback host although no API key is configured")
    _add_scheduling_args(serve)
    _add_quality_args(serve)
    serve.set_defaults(func=cmd_serve)

    decide = sub.add_parser("decide", help="answer one decision request (JSON file or stdin) and print the answer")
    _add_model_args(decide)
    decide.add_argument("file", nargs="?", default="-", help="request JSON file, or - for stdin")
    decide.add_argument("--pretty", action="store_true", help="indent the JSON output")
    _add_quality_args(decide)
    decide.set_defaults(func=cmd_decide)

    batch = sub.add_parser("batch", help="answer a JSON Lines file of requests or inputs; resumable")
    _add_model_args(batch)
    _add_quality_args(batch)
    batch.add_argument("file", help="JSON Lines: one request (with questions) or one input per line")
    batch.add_argument("--out", required=True, help="answers, JSON Lines; lines already answered there are skipped")
    batch.add_argument("--questions", default=None, help="JSON list of questions for lines that are inputs")
    batch.add_argument("--url", default=None, help="a running decisiond to ask instead of loading --model here")
    batch.add_argument("--api-key", default=None, help="key for --url (default: $DECISIOND_API_KEY)")
    batch.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(func=cmd_batch)

    mcp = sub.add_parser("mcp", help="serve the MCP tools decide and list_models over stdio")
    _add_model_args(mcp)
    mcp.add_argument("--config", default=None, help="gateway YAML, as for serve")
    _add_scheduling_args(mcp)
    _add_quality_args(mcp)
    mcp.set_defaults(func=cmd_mcp)

    evaluate = sub.add_parser("eval", help="measure the quality of the probabilities on labeled data, per mode")
    _add_labeled_args(evaluate)
    evaluate.add_argument("--threshold", type=float, default=0.5,
                          help="answer only when the top probability reaches this (default 0.5)")
    evaluate.add_argument("--coverage", type=float, default=0.5,
                          help="also report the accuracy of this share of the most confident answers (default 0.5)")
    evaluate.add_argument("--out-dir", default="eval-report", help="where report.json and reliability.png go")
    evaluate.set_defaults(func=cmd_eval)

    calibrate = sub.add_parser("calibrate", help="fit regularised temperatures (and biases) on labeled data on top of "
                                                 "a mode and write a calibration profile")
    _add_labeled_args(calibrate)
    calibrate.add_argument("--order", default="given", choices=["given", "cyclic"], help="the base mode's order")
    calibrate.add_argument("--calibrate", default="none", choices=["none", "contextual"],
                           help="the base mode's calibration")
    calibrate.add_argument("--auto", action="store_true",
                           help="fit on top of the mode with the best cross-validated log loss (as eval finds it; "
                                "overrides --order and --calibrate)")
    calibrate.add_argument("--out", default="calibration.json")
    calibrate.set_defaults(func=cmd_calibrate)

    keys = sub.add_parser("keys", help="create, list and revoke managed API keys")
    keys.add_argument("--config", default=None, help="the gateway YAML whose database_url to use")
    keys.add_argument("--database-url", default=None, help="sqlite:///path or postgresql://user@host/db")
    keys.add_argument("--log-level", default="warning")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True)
    create.add_argument("--user-path", default="/")
    create.add_argument("--models", default=None, help="comma-separated model names or provider/* (default: all)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute")
    create.add_argument("--rpd", type=int, default=None, help="requests per day")
    create.add_argument("--tpm", type=int, default=None, help="input tokens per minute")
    create.add_argument("--concurrent", type=int, default=None, help="requests in flight")
    create.add_argument("--expires-in", type=int, default=None, metavar="SECONDS")
    create.add_argument("--guardrails", default=None,
                        help="comma-separated names of guardrails in --config's YAML, run on the key's requests")
    keys_sub.add_parser("list", help="list keys (never their secrets)")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("id")
    keys.set_defaults(func=cmd_keys)

    usage_cmd = sub.add_parser("usage", help="print usage and cost totals from the database as a table")
    usage_cmd.add_argument("--config", default=None, help="the gateway YAML whose database_url to use")
    usage_cmd.add_argument("--database-url", default=None, help="sqlite:///path or postgresql://user@host/db")
    usage_cmd.add_argument("--group-by", default="model",
                           help="comma-separated: key, user_path, model, provider, request_type (default: model)")
    usage_cmd.add_argument("--start", default=None, metavar="YYYY-MM-DD", help="first UTC day")
    usage_cmd.add_argument("--end", default=None, metavar="YYYY-MM-DD", help="last UTC day (included)")
    usage_cmd.add_argument("--request-type", default=None,  # usage.REQUEST_TYPES (a test keeps them equal)
                           choices=["decisions", "system_one", "score", "guardrail", "chat", "responses"])
    usage_cmd.add_argument("--log-level", default="warning")
    usage_cmd.set_defaults(func=cmd_usage)

    bench = sub.add_parser("bench", help="measure the naive loop, decisiond in-process and over HTTP, side by side")
    bench.add_argument("--model", default="default")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--tickets", type=int, default=200, help="support tickets per workload (default 200)")
    bench.add_argument("--questions", default="3,10", help="question-set sizes to run (default 3,10)")
    bench.add_argument("--clients", default="1,4,16", help="concurrent HTTP clients per phase (default 1,4,16)")
    bench.add_argument("--naive-tickets", type=int, default=None, help="run the naive loop on the first N tickets only")
    bench.add_argument("--long-documents", type=int, default=0,
                       help="also run N documents of ~2,000 tokens (5 questions each, then asked again; default 0)")
    bench.add_argument("--fairness", type=int, default=0, metavar="BLOCKS",
                       help="also time tiny requests alone and with a 50-question long-document request in flight, "
                            "in BLOCKS alternating blocks of 20 (default 0: skip)")
    bench.add_argument("--out", default=None, help="write the markdown report here")
    bench.add_argument("--json", default=None, help="write the raw numbers here")
    bench.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    bench.add_argument("--log-level", default="warning")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
