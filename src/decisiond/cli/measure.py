"""The commands that measure a model: ``decisiond eval`` (the quality of the probabilities on labeled data, per
mode), ``decisiond calibrate`` (fit a calibration profile on labeled data) and ``decisiond bench`` (the side-by-side
speed benchmark)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InputError
from .common import build_router, check_writable, read_inputs, refuse

if TYPE_CHECKING:
    from ..engine.local import LocalEngine
    from ..evaluation import LabeledItem


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


def register_eval(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = sub.add_parser("eval", help="measure the quality of the probabilities on labeled data, per mode")
    _add_labeled_args(evaluate)
    evaluate.add_argument("--threshold", type=float, default=0.5,
                          help="answer only when the top probability reaches this (default 0.5)")
    evaluate.add_argument("--coverage", type=float, default=0.5,
                          help="also report the accuracy of this share of the most confident answers (default 0.5)")
    evaluate.add_argument("--out-dir", default="eval-report",
                          help="where report.json and reliability.png (with --cascade: cascade.json and cascade.png) "
                               "go")
    evaluate.add_argument("--cascade", default=None, metavar="NAME",
                          help="instead of the modes: the share escalated, accuracy, log loss and cost per 1,000 "
                               "requests of the cascade NAME of --config, for thresholds 0.5-0.99")
    evaluate.add_argument("--config", default=None, help="the gateway YAML that defines --cascade and its targets")
    evaluate.add_argument("--device", default="auto", help="where --config's local models run (default: auto)")
    # --config's local providers take their quality modes from their own entries.
    evaluate.set_defaults(func=cmd_eval, order=None, calibrate=None, calibration=None)


def register_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def register_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="measure the naive loop, decisiond in-process and over HTTP, side by side")
    bench.add_argument("--model", default="default")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--device", default="auto",
                       help="cpu, cuda, cuda:1… for the in-process engine, the naive loop and the server "
                            "(default: cuda when available)")
    bench.add_argument("--prefix-cache-mb", type=float, default=None,
                       help="the prefix cache's budget, in-process and in the server (default: the engine's, sized "
                            "for the model)")
    bench.add_argument("--tickets", type=int, default=200, help="support tickets per workload (default 200)")
    bench.add_argument("--questions", default="3,10", help="question-set sizes to run (default 3,10)")
    bench.add_argument("--clients", default=None,
                       help="concurrent HTTP clients per phase (default 1,4,16; with --gateway 1,10,64)")
    bench.add_argument("--naive-tickets", type=int, default=None, help="run the naive loop on the first N tickets only")
    bench.add_argument("--long-documents", type=int, default=0,
                       help="also run N documents of ~2,000 tokens (5 questions each, then asked again; default 0)")
    bench.add_argument("--fairness", type=int, default=0, metavar="BLOCKS",
                       help="also time tiny requests alone and with a 50-question long-document request in flight, "
                            "in BLOCKS alternating blocks of 20 (default 0: skip)")
    bench.add_argument("--served", action="store_true",
                       help="also serve the model (a GGUF: default or a .gguf file) with llama.cpp's server "
                            "(llama-cpp-python, as many threads as the in-process engine) and, where installed "
                            "(tests/install_vllm.sh), vLLM in float32 on the same weights, and time decisions read "
                            "through the logprobs provider, taking turns with the in-process engine on the same "
                            "tickets")
    bench.add_argument("--gateway", action="store_true",
                       help="instead: what the gateway adds in front of a mock upstream (keyless, keyed on SQLite, "
                            "keyed on PostgreSQL + Redis where installed) and whether a budget holds under load")
    bench.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                       help="--gateway: serve --workers for every configuration (default: the CPUs)")
    bench.add_argument("--seconds", type=float, default=8, help="--gateway: seconds of each load run (default 8)")
    bench.add_argument("--rounds", type=int, default=2, help="--gateway: interleaved rounds (default 2)")
    bench.add_argument("--no-postgres", action="store_true", help="--gateway: skip PostgreSQL + Redis")
    bench.add_argument("--out", default=None, help="write the markdown report here")
    bench.add_argument("--json", default=None, help="write the raw numbers here")
    bench.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    bench.add_argument("--log-level", default="warning")
    bench.set_defaults(func=cmd_bench)


def _load_engine_for(args: argparse.Namespace) -> LocalEngine:
    # Lazy: decisiond.engine imports torch (start-up time).
    from ..engine import model as model_mod
    from ..engine.local import LocalEngine

    return LocalEngine(model_mod.load(args.model, dtype=args.dtype, served_name=args.served_model_name))


def cmd_eval(args: argparse.Namespace) -> int:
    """Accuracy, log loss, Brier, ECE per mode side by side with bootstrap intervals; JSON report and reliability
    diagram."""
    # Lazy: the evaluation brings numpy and pydantic, its diagram matplotlib (start-up time).
    from .. import evaluation, evaluation_report

    items = evaluation.load(args.file)  # before any model loads
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise InputError("cannot write the report there: it is a file, not a folder", args.out_dir)
    if args.cascade is not None:
        return _eval_cascade(args, items)
    report = evaluation.evaluate(_load_engine_for(args), items, threshold=args.threshold, with_bias=args.bias,
                                 coverage=args.coverage, resamples=args.resamples, seed=args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    evaluation_report.plot(report, out / "reliability.png")
    print(evaluation_report.table(report))
    print(f"\nbest mode: {report['best_mode']}; wrote {out / 'report.json'} and {out / 'reliability.png'}",
          file=sys.stderr)
    return 0


def _eval_cascade(args: argparse.Namespace, items: list[LabeledItem]) -> int:
    """``eval --cascade``: the cascade's thresholds side by side (``decisiond.cascade_eval``); cascade.json and
    cascade.png."""
    # Lazy: the gateway (and torch for local models), matplotlib (start-up time).
    import asyncio

    from .. import cascade_eval

    if args.config is None:
        return refuse("--cascade needs --config: the gateway YAML that defines the cascade and its targets")
    router = build_router(args, read_inputs(args))

    async def run() -> dict[str, Any]:
        try:
            return await cascade_eval.sweep(router, args.cascade, items)
        finally:
            await router.aclose()

    try:
        report = asyncio.run(run())
    except ValueError as error:
        return refuse(error)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cascade.json").write_text(json.dumps(report, indent=2) + "\n")
    cascade_eval.plot(report, out / "cascade.png")
    print(cascade_eval.table(report))
    print(f"\nwrote {out / 'cascade.json'} and {out / 'cascade.png'}", file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a regularised temperature (and optionally a per-position bias) per question type on top of a mode, or
    on top of the best mode (``--auto``); write a profile."""
    # Lazy: the evaluation brings numpy and pydantic (start-up time).
    from .. import evaluation
    from ..engine.calibration import FOLDS

    items = evaluation.load(args.file)  # before the model loads
    check_writable(args.out)
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
                  f"cross-validated log loss ({row['cv_log_loss_base']:.3f}) by more than the spread of its gain "
                  f"across folds")
        else:
            print(f"{kind}: {row['questions']} questions, {mode}+fit with L2 strength {row['strength']:g} "
                  f"(chosen by {FOLDS}-fold CV), temperature {row['temperature']:.3f}"
                  + (f", bias {[round(b, 3) for b in row['bias']]}" if row["bias"] else "")
                  + f", cross-validated log loss {row['cv_log_loss_base']:.3f} -> {row['cv_log_loss']:.3f} "
                  f"(gain standard error {row['cv_gain_se']:.3f})")
    print(f"wrote {args.out}; serve with: decisiond serve --model {args.model} --calibration {args.out} "
          f"(it applies order {profile.order}, calibrate {profile.calibrate} and the fits)", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The side-by-side benchmark; writes markdown (and JSON) reports."""
    check_writable(args.out)  # before the benchmark runs, not after
    check_writable(args.json)
    if args.gateway:
        return _bench_gateway(args)
    # Lazy: the benchmark imports torch (start-up time).
    from ..bench import runner
    from ..bench.services import Unavailable
    from ..engine.model import ModelNotFound

    try:
        report = runner.run(model=args.model, tickets=args.tickets,
                            question_sets=tuple(int(x) for x in args.questions.split(",") if x),
                            clients=tuple(int(x) for x in (args.clients or "1,4,16").split(",")),
                            naive_tickets=args.naive_tickets, dtype=args.dtype, long_documents=args.long_documents,
                            fairness_blocks=args.fairness, device=args.device, prefix_cache_mb=args.prefix_cache_mb,
                            served=args.served, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (ModelNotFound, Unavailable) as error:
        return refuse(error)
    return _write_report(args, lambda command: runner.markdown(report, command), lambda: runner.to_json(report),
                         "decisiond bench")


def _bench_gateway(args: argparse.Namespace) -> int:
    from ..bench import gateway

    if args.workers < 1 or args.rounds < 1 or args.seconds < 1:
        return refuse("--workers and --rounds must be 1 or more, --seconds at least 1")
    try:
        clients = [int(x) for x in (args.clients or "1,10,64").split(",")]
    except ValueError:
        return refuse(f"--clients: {args.clients!r} is not a comma-separated list of numbers")
    report = gateway.run(workers=args.workers, seconds=args.seconds, rounds=args.rounds, clients=clients,
                         postgres=not args.no_postgres, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return _write_report(args, lambda command: gateway.markdown(report, command),
                         lambda: json.dumps(report, indent=2), "decisiond bench --gateway")


def _write_report(args: argparse.Namespace, markdown: Callable[[str], str], as_json: Callable[[], str],
                  bare: str) -> int:
    """Print a benchmark's markdown (naming the command that reproduces it; ``bare`` when run without arguments),
    and write it to ``--out`` and its JSON to ``--json`` where asked."""
    command = "decisiond bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else bare
    text = markdown(args.command_line or command)
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    if args.json:
        open(args.json, "w").write(as_json())
    return 0
