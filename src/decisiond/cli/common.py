"""What the command families share: the model, quality and scheduling argument groups, reading the files a command
was given (before any model loads), loading a local engine or building a router from a gateway config, the loopback
check, and the one shape of a refusal on stderr.

A file that cannot be used raises ``InputError`` where it is read (``decisiond.errors``: the file, line and field
at fault); ``cli.main`` prints it as the one line ``decisiond: FILE:LINE: FIELD: what is wrong`` and exits 2.

The ``decisiond`` imports below that pull in torch (``decisiond.engine``) or the gateway's pydantic and SQLAlchemy
models are made inside the functions that need them: ``decisiond --help`` and building the parser stay fast."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..limits import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS

if TYPE_CHECKING:
    from ..engine.calibration import Profile
    from ..engine.local import LocalEngine
    from ..gateway.router import Router
    from ..gateway.settings import GatewayConfig


log = logging.getLogger("decisiond")


def refuse(message: object, code: int = 2) -> int:
    """Print ``decisiond: <message>`` on stderr and give the exit code back (2: the command was refused)."""
    print(f"decisiond: {message}", file=sys.stderr)
    return code


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M-Instruct), a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--served-model-name", default=None, help="name the model answers to (default: from --model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1… (default: cuda when available)")
    p.add_argument("--log-level", default="info")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--order", default=None, choices=["given", "cyclic"],
                   help="choice option order: as given, or averaged over every cyclic shift (requests may override; "
                        "default: the profile's, else given)")
    p.add_argument("--calibrate", default=None, choices=["none", "contextual"],
                   help="divide out the label prior measured on content-free inputs (requests may override; "
                        "default: the profile's, else none)")
    p.add_argument("--calibration", default=None, metavar="PROFILE",
                   help="a profile written by 'decisiond calibrate': the mode it was fitted under and fitted "
                        "temperatures (and biases) per question type; refused for another model or prompt format")


def add_scheduling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help=f"padded tokens per batched forward pass across concurrent requests "
                        f"(default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long the scheduler waits for more requests to join a batch (default 2 ms)")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="memory for KV caches of prompt prefixes kept across requests (least recently used out "
                        "first), so a document asked again is not recomputed (default: sized for the model, the KV "
                        "of one full context window, at most half the weights: 257 for the embedded model; 0 turns "
                        "it off)")
    p.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                   help="tokens one request may make the model compute after prefix sharing; more is refused with "
                        f"400 (default {DEFAULT_MAX_REQUEST_TOKENS})")
    p.add_argument("--max-queued-tokens", type=int, default=DEFAULT_MAX_QUEUED_TOKENS,
                   help="tokens of admitted work not yet computed, across requests; a request that would go over "
                        f"gets 503 with retry-after-ms (default {DEFAULT_MAX_QUEUED_TOKENS})")
    p.add_argument("--allow-request-templates", action="store_true",
                   help="let a request's chat_template_kwargs.chat_template replace the model's chat template "
                        "(rendered in a child process under a time, memory and output limit); refused otherwise")


def local_engine(args: argparse.Namespace) -> LocalEngine:
    """The model ``--model`` names, loaded here, under the scheduling and quality options the command has."""
    # Lazy: decisiond.engine imports torch (start-up time); a gateway-only install is refused by name first.
    from ..engine import model as model_mod

    model_mod.require_engine()
    from ..engine.local import LocalEngine

    options: dict[str, Any] = {}
    if hasattr(args, "max_batch_tokens"):
        options = scheduling(args)
    if hasattr(args, "order"):  # the profile read before the model loads: a file that is not one is refused at once
        options.update(order=args.order, calibrate=args.calibrate, profile=load_profile(args.calibration))
    loaded = model_mod.load(args.model, dtype=args.dtype, device=args.device, served_name=args.served_model_name)
    log.info("model loaded", extra={"model": loaded.name, "path": loaded.path, "dtype": loaded.dtype,
                                    "device": loaded.device, "context_length": loaded.context_length})
    return LocalEngine(loaded, **options)


def scheduling(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler's options from ``add_scheduling_args``' arguments, as ``LocalEngine`` takes them."""
    if args.max_queued_tokens < args.max_request_tokens:
        raise SystemExit(f"decisiond: --max-queued-tokens ({args.max_queued_tokens}) must be at least "
                         f"--max-request-tokens ({args.max_request_tokens})")
    return {"max_batch_tokens": args.max_batch_tokens, "max_wait_s": args.max_wait_ms / 1000,
            "prefix_cache_mb": args.prefix_cache_mb, "max_request_tokens": args.max_request_tokens,
            "max_queued_tokens": args.max_queued_tokens, "allow_templates": args.allow_request_templates}


def load_profile(path: str | None) -> Profile | None:
    """The calibration profile at ``path`` (None without one); the engine checks it fits its model and mode."""
    # Lazy: decisiond.engine imports torch (start-up time).
    from ..engine.calibration import Profile

    return Profile.load(path) if path else None


def load_config(args: argparse.Namespace) -> GatewayConfig | None:
    """The gateway YAML ``--config`` names (None without one)."""
    # Lazy: the gateway's configuration models (start-up time).
    from ..gateway import config as gateway_config

    return gateway_config.load(args.config) if getattr(args, "config", None) else None


def read_inputs(args: argparse.Namespace) -> GatewayConfig | None:
    """Read and check the files a command that loads models was given, before it loads one: the gateway config
    (returned) and every calibration profile named, by ``--calibration`` or by the config's local providers."""
    config = load_config(args)
    profiles = [getattr(args, "calibration", None)]
    if config is not None:
        profiles += [provider.calibration for provider in config.providers if provider.type == "local"]
    for path in dict.fromkeys(p for p in profiles if p):
        load_profile(path)
    return config


def read_input(path: str) -> bytes:
    """The bytes of the file ``path`` (``-``: stdin)."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InputError.unreadable(path, error) from None


def check_readable(path: str | os.PathLike[str]) -> None:
    """Refuse a file that cannot be opened for reading (missing, a folder, not permitted) now, not once the model
    is loaded."""
    try:
        open(path, "rb").close()
    except OSError as error:
        raise InputError.unreadable(path, error) from None


def check_writable(path: str | os.PathLike[str] | None) -> None:
    """Refuse an output file that could not be written (a folder, in a folder that does not exist) now, not once
    the work is done."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise InputError("cannot write it: it is a folder", path)
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"cannot write it: the folder {folder} does not exist", path)
    if not os.access(folder if not target.exists() else target, os.W_OK):
        raise InputError("cannot write it: permission denied", path)


def build_router(args: argparse.Namespace, config: GatewayConfig | None = None) -> Router:
    """With a config: the gateway it describes (local providers load their models); without: the local engine
    alone."""
    # Lazy: the gateway (start-up time); decisiond.engine (torch) only where a model runs here, so that a
    # gateway-only server neither imports nor holds it.
    from ..gateway.router import Router

    if config is None:
        return Router.local_only(local_engine(args))
    engines = {}
    for provider in config.providers:
        if provider.type == "local":
            from ..engine import model as model_mod

            model_mod.require_engine()
            from ..engine.local import LocalEngine

            profile = load_profile(provider.calibration or args.calibration)  # before the model loads
            loaded = model_mod.load(provider.model or "default", dtype=provider.dtype, device=args.device,
                                    served_name=provider.served_model_name)
            engines[provider.name] = LocalEngine(
                loaded, **(scheduling(args) if hasattr(args, "max_batch_tokens") else {}),
                order=provider.order or args.order, calibrate=provider.calibrate or args.calibrate, profile=profile)
    log.info("gateway configured", extra={"providers": [p.name for p in config.providers],
                                          "models": [m.name for m in config.models],
                                          "virtual_models": [v.name for v in config.virtual_models]})
    return Router.from_config(config, engines)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``serve`` refuses others without an API key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
