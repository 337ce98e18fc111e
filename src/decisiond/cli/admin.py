"""The administration commands: on the database the server writes to, ``decisiond keys`` (create, list and revoke
managed API keys) and ``decisiond usage`` (usage and cost totals as a table), which run the same code as the admin
API; ``decisiond learn`` (profiles from a stored model's labels, as ``POST /admin/learn``); and, against a running
server, ``decisiond labels import`` (labels for stored decisions in bulk) and ``decisiond quality``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from .common import load_config, refuse

if TYPE_CHECKING:
    from ..gateway.settings import GatewayConfig
    from ..store.db import Database
    from ..store.keys import KeyStore


def _add_database_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="the gateway YAML whose database_url to use")
    p.add_argument("--database-url", default=None, help="sqlite:///path or postgresql://user@host/db")


def register_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke managed API keys")
    _add_database_args(keys)
    keys.add_argument("--log-level", default="warning")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True)
    create.add_argument("--user-path", default=None,
                        help="the path its usage and budgets count under (default: one of its own, /keys/<id>)")
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


def register_usage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage_cmd = sub.add_parser("usage", help="print usage and cost totals from the database as a table")
    _add_database_args(usage_cmd)
    usage_cmd.add_argument("--group-by", default="model",
                           help="comma-separated: key, user_path, model, provider, request_type (default: model)")
    usage_cmd.add_argument("--start", default=None, metavar="YYYY-MM-DD", help="first UTC day")
    usage_cmd.add_argument("--end", default=None, metavar="YYYY-MM-DD", help="last UTC day (included)")
    usage_cmd.add_argument("--request-type", default=None,  # usage.REQUEST_TYPES (a test keeps them equal)
                           choices=["decisions", "system_one", "score", "guardrail", "chat", "responses", "mcp",
                                    "batch"])
    usage_cmd.add_argument("--log-level", default="warning")
    usage_cmd.set_defaults(func=cmd_usage)


def cmd_keys(args: argparse.Namespace) -> int:
    """Managed keys in the database the server uses (``--config``'s database_url, or DECISIOND_DATABASE_URL, or
    the default SQLite file): the same code as the admin API."""
    # Lazy: the gateway's configuration models (start-up time).
    from ..gateway.guardrail_settings import unknown_guardrail

    config = load_config(args)
    guardrails = list(dict.fromkeys(g.strip() for g in (getattr(args, "guardrails", None) or "").split(",")
                                    if g.strip()))
    defined = [g.name for g in config.guardrails] if config else []
    missing = unknown_guardrail(guardrails, defined)
    if missing is not None:  # checked against the server's config, as the admin API checks them
        return refuse(f"unknown guardrail {missing!r}; configured guardrails: "
                      f"{', '.join(repr(n) for n in defined) or 'none (give the server config with --config)'}")
    try:
        return asyncio.run(_keys(args, config, guardrails))
    except ValueError as error:
        return refuse(error)


async def _open_database(args: argparse.Namespace, config: GatewayConfig | None) -> Database:
    """The database the server uses: ``--database-url``, else the config's database_url, else
    DECISIOND_DATABASE_URL, else the default SQLite file. One that cannot be opened is refused naming the setting
    (and the file) it came from."""
    # Lazy: the gateway and SQLAlchemy (start-up time). The server's own opening: its refusals, word for word.
    from ..gateway.service import DATABASE_URL_ENV
    from ..gateway.service import _open_database as open_database

    if args.database_url:
        return await open_database(args.database_url, "--database-url")
    if config is not None and config.database_url:
        return await open_database(config.database_url, f"{args.config}: database_url")
    if os.environ.get(DATABASE_URL_ENV):
        return await open_database(os.environ[DATABASE_URL_ENV], DATABASE_URL_ENV)
    return await open_database(None, "database_url")


async def _keys(args: argparse.Namespace, config: GatewayConfig | None, guardrails: list[str]) -> int:
    """``keys create``, ``list`` or ``revoke`` on the server's database; the exit code."""
    # Lazy: SQLAlchemy (start-up time).
    from ..store.keys import KeyStore

    db = await _open_database(args, config)
    store = KeyStore(db)
    try:
        if args.action == "create":
            await _create_key(args, store, guardrails)
        elif args.action == "list":
            rows = [r.public() for r in await store.list()]
            print(f"{'id':<18} {'name':<20} {'user_path':<20} {'status':<8} models")
            for r in rows:
                print(f"{r['id']:<18} {r['name'][:20]:<20} {r['user_path'][:20]:<20} {r['status']:<8} "
                      f"{','.join(r['models']) if r['models'] is not None else '*'}")
        else:
            revoked = await store.revoke(args.id)
            if revoked is None:
                return refuse(f"no API key with id {args.id!r}", 1)
            print(json.dumps(revoked.public(), indent=2))
        return 0
    finally:
        await db.aclose()


async def _create_key(args: argparse.Namespace, store: KeyStore, guardrails: list[str]) -> None:
    """Create the key ``keys create`` describes and print it, with its secret, once."""
    # Lazy: the gateway's configuration models (start-up time).
    from ..gateway.access_settings import RateLimitConfig, check_user_path

    limits = RateLimitConfig(requests_per_minute=args.rpm, requests_per_day=args.rpd,
                             input_tokens_per_minute=args.tpm, concurrent=args.concurrent)
    expires = (datetime.now(timezone.utc) + timedelta(seconds=args.expires_in)
               if args.expires_in else None)
    record, key = await store.create(
        args.name, check_user_path(args.user_path) if args.user_path is not None else None,
        [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None,
        limits.model_dump(exclude_defaults=True) or None, expires, guardrails)
    print(json.dumps({**record.public(), "key": key}, indent=2))
    print("The key is shown once; store it now.", file=sys.stderr)


def cmd_usage(args: argparse.Namespace) -> int:
    """Usage totals from the database the server writes to (the same query as ``GET /admin/usage/summary``),
    printed as a table."""
    # Lazy: the gateway and SQLAlchemy (start-up time).
    from ..gateway import usage

    config = load_config(args)
    groups = [g.strip() for g in args.group_by.split(",") if g.strip()]
    unknown = [g for g in groups if g not in usage.GROUPS]
    if unknown:
        return refuse(f"--group-by: unknown group {unknown[0]!r}; use {', '.join(usage.GROUPS)}")
    try:
        start = datetime.combine(date.fromisoformat(args.start), datetime.min.time(), timezone.utc) \
            if args.start else None
        end = datetime.combine(date.fromisoformat(args.end), datetime.min.time(), timezone.utc) + timedelta(days=1) \
            if args.end else None
    except ValueError as error:
        return refuse(error)

    async def run() -> list[dict[str, Any]]:
        db = await _open_database(args, config)
        try:
            return await usage.summary(db, groups, usage.UsageFilter(start=start, end=end,
                                                                     request_type=args.request_type))
        finally:
            await db.aclose()

    _print_table(groups, asyncio.run(run()))
    return 0


def _print_table(groups: list[str], rows: list[dict[str, Any]]) -> None:
    """The usage rows as columns: the groups left-aligned, the totals right-aligned."""
    headers = [*groups, "requests", "input_tokens", "output_tokens", "cost_usd"]
    cells = [[str(r[g]) if r[g] is not None else "-" for g in groups]
             + [str(r["requests"]), str(r["input_tokens"]), str(r["output_tokens"]), f"{r['cost_usd']:.6f}"]
             for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) if i < len(groups) else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))


def register_labels(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    labels = sub.add_parser("labels", help="post labels for stored decisions in bulk to a running decisiond")
    labels_sub = labels.add_subparsers(dest="labels_command", required=True)
    bulk = labels_sub.add_parser("import", help='post each line of a JSON Lines file, {"request_id", "labels"}')
    bulk.add_argument("file", help='JSON Lines: {"request_id": "req_...", "labels": {"<question name>": value}}')
    bulk.add_argument("--url", default="http://127.0.0.1:8000", help="the decisiond that stored the decisions")
    bulk.add_argument("--api-key", default=None, help="the key that made them, or the master key "
                                                      "(default: $DECISIOND_API_KEY)")
    bulk.add_argument("--log-level", default="warning")
    bulk.set_defaults(func=cmd_labels_import)


def _label_lines(path: str) -> list[tuple[int, str, Any]]:
    """(line number, request id, labels) of each line; the file refused (``InputError``) at its first bad line,
    before anything is posted."""
    from ..errors import InputError

    out = []
    for n, item in InputError.json_lines(path):
        if not isinstance(item, dict):
            raise InputError('each line is an object {"request_id": ..., "labels": {...}}', path, n)
        for field, kind, shown in (("request_id", str, "a string"), ("labels", dict, "an object")):
            if field not in item:
                raise InputError('missing: each line holds request_id and labels', path, n, field)
            if not isinstance(item[field], kind):
                raise InputError(f"must be {shown}", path, n, field)
        out.append((n, item["request_id"], item["labels"]))
    if not out:
        raise InputError("no lines to post", path)
    return out


def cmd_labels_import(args: argparse.Namespace) -> int:
    """Each line's labels posted to ``POST /v1/decisions/{request_id}/labels``; a line the server refuses is one
    line on stderr (``FILE:LINE: FIELD: message``) and the rest go on. Prints the counts; exit 1 when any line was
    refused."""
    import httpx

    from ..errors import InputError

    lines = _label_lines(args.file)
    key = args.api_key or os.environ.get("DECISIOND_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    stored = refused = 0
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=60) as client:
        for n, request_id, labels in lines:
            try:
                response = client.post(f"/v1/decisions/{request_id}/labels", json={"labels": labels})
            except httpx.HTTPError as error:
                raise InputError(f"cannot reach {args.url}: {type(error).__name__}: {error}", field="--url") from None
            if response.status_code == 200:
                stored += 1
                continue
            refused += 1
            try:
                body = response.json()["error"]
                where, message = body.get("param"), body.get("message")
            except (ValueError, KeyError, TypeError, AttributeError):
                where, message = None, response.text[:200]
            print(f"decisiond: {args.file}:{n}: " + (f"{where}: " if where else "") + f"{message} "
                  f"({response.status_code})", file=sys.stderr)
    print(json.dumps({"labelled": stored, "refused": refused}))
    return 1 if refused else 0


def register_quality(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    quality = sub.add_parser("quality", help="print how good a stored model's answers were against their labels")
    quality.add_argument("--model", required=True, help="a model or virtual model with store: true")
    quality.add_argument("--since", default=None, metavar="DATE", help="only decisions from then (ISO date or time)")
    quality.add_argument("--user-path", default=None, metavar="PATH",
                         help="show the learned profile serving this user path (default: /, the operator's)")
    quality.add_argument("--url", default="http://127.0.0.1:8000", help="the decisiond that stored them")
    quality.add_argument("--api-key", default=None, help="the master key (default: $DECISIOND_API_KEY)")
    quality.add_argument("--png", default=None, help="also draw the reliability diagram into this PNG file")
    quality.add_argument("--log-level", default="warning")
    quality.set_defaults(func=cmd_quality)


def cmd_quality(args: argparse.Namespace) -> int:
    """``GET /admin/quality`` as a table on stdout (and its reliability diagram as a PNG); a refusal is its error
    object on stdout and exit 1."""
    import httpx

    from ..errors import InputError
    from .common import check_writable

    check_writable(args.png)
    key = args.api_key or os.environ.get("DECISIOND_API_KEY")
    params = {"model": args.model, **({"since": args.since} if args.since else {}),
              **({"user_path": args.user_path} if args.user_path else {})}
    try:
        response = httpx.get(args.url.rstrip("/") + "/admin/quality", params=params, timeout=120,
                             headers={"Authorization": f"Bearer {key}"} if key else {})
    except httpx.HTTPError as error:
        raise InputError(f"cannot reach {args.url}: {type(error).__name__}: {error}", field="--url") from None
    if response.status_code != 200:
        print(response.text)
        return 1
    report = response.json()
    rows = [f"{report['model']}: {report['decisions']} stored decisions"
            + (f" since {report['since']}" if report.get("since") else ""), "",
            "| question | stored | labels | accuracy | log loss | Brier | ECE | escalated | profile | "
            "profile accuracy (CV) | profile log loss (CV) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for q in report["questions"]:
        served = q["served"] or {}
        cells = [f"{served[k]:.3f}" if k in served else "–" for k in ("accuracy", "log_loss", "brier", "ece")]
        share = q["escalated_share"]
        profile = q.get("profile") or {}
        cv = profile.get("cv") or {}
        others = len(q.get("profiles") or ()) - bool(profile)
        shown = (f"{profile['kind']} v{profile['version']} ({profile['id']}) at {profile['scope']}" if profile
                 else "none")
        learned = [shown + (f", +{others} of other scopes" if others > 0 else ""),
                   *(f"{cv[k]:.3f}" if k in cv else "–" for k in ("accuracy", "log_loss"))]
        rows.append(f"| {q['question']} | {q['stored']} | {q['labels']} | " + " | ".join(cells)
                    + f" | {'–' if share is None else f'{share:.1%}'} | " + " | ".join(learned) + " |")
    print("\n".join(rows))
    if args.png:
        _reliability_png(report, args.png)
    return 0


def register_learn(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    learn = sub.add_parser("learn", help="learn profiles from a stored model's labels (as POST /admin/learn)")
    learn.add_argument("--model", required=True, help="a model or virtual model with store: true")
    _add_database_args(learn)
    learn.add_argument("--json", action="store_true", help="print the whole report as JSON instead of a table")
    learn.add_argument("--log-level", default="warning")
    learn.set_defaults(func=cmd_learn)


def cmd_learn(args: argparse.Namespace) -> int:
    """Learn on the server's database (``--database-url``, else ``--config``'s, else DECISIOND_DATABASE_URL, else the
    default SQLite file), as ``POST /admin/learn`` does: every replica serves an accepted profile within its
    ``learning.refresh_s``. With ``--config``, a model it does not store is refused. Prints, per target, question
    and scope, the cross-validated metrics of what is served now and of each candidate, and what was accepted."""
    config = load_config(args)
    if config is not None:
        stored = [m.name for m in config.models if m.store] + [v.name for v in config.virtual_models if v.store]
        if args.model not in stored:
            return refuse(f"learn: --model {args.model!r} keeps no decisions in {args.config} (models with store: "
                          f"true: {', '.join(stored) or 'none'})")
    report = asyncio.run(_learn(args, config))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [f"{report['model']}: {report['decisions']} decisions with labels or teacher labels", "",
            "| question | target | scope | labels | teacher | candidate | accuracy | log loss | gain ± SE | verdict |",
            "|---|---|---|---:|---:|---|---:|---:|---:|---|"]
    for q in report["questions"]:
        head = f"| {q['question']} | {q['target']} | {q['scope']} | {q['labels']} | {q['teacher_labels']} |"
        served = q["served"]
        if served:
            rows.append(f"{head} served now | {served['accuracy']:.3f} | {served['log_loss']:.3f} | | |")
        for c in q["candidates"]:
            verdict = f"accepted: {q['profile']}" if q["accepted"] == c["kind"] else (c["reason"] or "not the best")
            rows.append(f"| | | | | | {c['kind']} | {c['cv']['accuracy']:.3f} | {c['cv']['log_loss']:.3f} | "
                        f"{c['log_loss_gain']:.3f} ± {c['gain_error']:.3f} | {verdict} |")
        if not q["candidates"]:
            rows.append(f"{head} | | | | {q['reason']} |")
    rows += [""] + [f"scope {scope}: {c['questions']} question(s), {c['labels']} labels, {c['teacher_labels']} "
                    f"teacher labels, {c['accepted']} accepted" for scope, c in report["scopes"].items()]
    print("\n".join(rows))
    return 0


async def _learn(args: argparse.Namespace, config: GatewayConfig | None) -> dict[str, Any]:
    from ..gateway.profile_learning import learn_model
    from ..gateway.profile_store import ProfileStore

    db = await _open_database(args, config)
    try:
        return await learn_model(ProfileStore(db), args.model)
    finally:
        await db.aclose()


def _reliability_png(report: dict[str, Any], path: str) -> None:
    """The reliability diagram of each labelled question: accuracy against mean confidence per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6), dpi=100)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    for q in report["questions"]:
        if q["reliability"]:
            bins = q["reliability"]
            ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o",
                    label=f"{q['question']} (ECE {q['served']['ece']:.3f}, {q['labels']} labels)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (bin mean)")
    ax.set_ylabel("accuracy against the labels")
    ax.set_title(f"Reliability: {report['model']}, {report['bins']} bins", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
