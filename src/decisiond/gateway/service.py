"""The gateway as the server sees it: the router, the caller's authentication, the rate limiter, the database,
the pipeline of stages in their one fixed order, and the process's traces (``decisiond.tracing``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .. import tracing
from ..canonical import DecisionRequest, DecisionResult, Message, ScoreRequest, ScoreResult, Text, Usage
from ..dialects import openai as openai_dialect
from ..errors import DecisionError, ProviderError, ServerError, one_line
from ..limits import USAGE_PURGE_INTERVAL_S
from ..store.db import Database
from ..store.keys import KeyStore
from . import decisions, pricing
from .cascade import ESCALATED_HEADER, Step, escalated
from .catalog import Target
from .chat import ChatRequest, ChatResult
from .config import ConfigError
from .decisions import DecisionStore
from .guardrail_settings import GuardrailConfig
from .journal import Journal, default_directory
from .pipeline import Pipeline
from .profile_store import ProfileStore
from .profiles import ProfileBook
from .router import Router
from .settings import GatewayConfig, check_redis_url
from .sizes import estimated_tokens
from .stages.allowlist import Allowlist
from .stages.auth import Authenticator
from .stages.budget import BudgetStage
from .stages.budget_leases import LeaseBook
from .stages.budget_sql import SqlLedger
from .stages.budget_store import BudgetStore
from .stages.cache import CacheStage, ResponseCache
from .stages.guardrails import GuardrailSet, GuardrailStage, judge_question
from .stages.ratelimit import RateLimiter, RateLimitStage
from .stages.request_limits import RequestLimits
from .stages.resolve import ResolveModel
from .types import Call, Caller, Context, Stage
from .usage import UsageRecord, redact
from .usage_writer import UsageWriter

log = logging.getLogger("decisiond.gateway")

MASTER_KEY_ENV = "DECISIOND_MASTER_KEY"
DATABASE_URL_ENV = "DECISIOND_DATABASE_URL"
REDIS_URL_ENV = "DECISIOND_REDIS_URL"
USAGE_JOURNAL_ENV = "DECISIOND_USAGE_JOURNAL"


def _setting(value: str | None, name: str, env: str) -> tuple[str | None, str]:
    """A setting from the config, else from its environment variable: its value, and the name a refusal gives it."""
    if value:
        return value, name
    if os.environ.get(env):
        return os.environ[env], env
    return None, name


class Gateway:
    def __init__(self, router: Router, config: GatewayConfig | None = None, worker: tuple[int, int] = (0, 1)):
        """``worker``: (this process's index, the number of processes) of a server run as several processes
        (``serve --workers``): what they count in memory, rate limits without Redis, each counts its part of."""
        config = config or GatewayConfig()
        self.router = router
        self.master_key = config.auth.master_key or os.environ.get(MASTER_KEY_ENV) or None
        self.database_url, self._database_setting = _setting(config.database_url, "database_url", DATABASE_URL_ENV)
        redis_url, redis_setting = _setting(config.redis_url, "redis_url", REDIS_URL_ENV)
        try:
            check_redis_url(redis_url)
        except ValueError as error:
            raise ConfigError(f"{redis_setting}: {error}") from None
        if config.console.oidc is not None and not (config.console.session_secret or self.master_key):
            raise ConfigError("console.oidc: single sign-on needs console.session_secret (or a master key) to sign "
                              "the console's sessions")
        self.auth = Authenticator(self.master_key, config.auth.keys)
        self.limiter = RateLimiter(
            redis_url, config.rate_limits,
            models={m.name: m.rate_limits for m in config.models if m.rate_limits is not None},
            providers={p.name: p.rate_limits for p in config.providers if p.rate_limits is not None},
            slot_ttl_s=config.concurrency_slot_ttl_s, share=worker)
        self.config = config
        self.db: Database | None = None
        self.keys: KeyStore | None = None
        self.guardrails = GuardrailSet(
            {g.name: g for g in config.guardrails}, judge=self._judge,
            by_model={**{m.name: m.guardrails for m in config.models if m.guardrails},
                      **{v.name: v.guardrails for v in config.virtual_models if v.guardrails}})
        self.budgets: BudgetStore | None = None
        self.leases: LeaseBook | None = None
        self.usage: UsageWriter | None = None
        self._started = self._closed = False
        self.cache = ResponseCache(config.cache)
        # Names whose decisions are kept (``store: true``) → their retention in days.
        self.stored_models = {**{m.name: m.store_retention_days for m in config.models if m.store},
                              **{v.name: v.store_retention_days for v in config.virtual_models if v.store}}
        self.decisions: DecisionStore | None = None
        self._purger: asyncio.Task[None] | None = None
        # Learned profiles: those this process serves (the router applies them) and where they are kept.
        self.profile_book = ProfileBook()
        router.profiles = self.profile_book
        self.profiles: ProfileStore | None = None
        self._profile_reader: asyncio.Task[None] | None = None
        otel = config.otel
        self.tracing = tracing.start(otel.endpoint, otel.service_name, otel.sample_ratio, otel.headers,
                                     otel.schedule_delay_ms)
        self.tracer = self.tracing.tracer if self.tracing is not None else None
        router.tracer = self.tracer
        self.pipeline, self.judge_pipeline = self._pipelines(router, config)

    def _pipelines(self, router: Router, config: GatewayConfig) -> tuple[Pipeline, Pipeline]:
        """The request pipeline, and the one of a ``decision_judge`` guardrail's calls."""
        # The cache after the allowlist (a key never reads answers of a model it may not use) and before the rate
        # limits and budgets: a hit runs nothing downstream, so it consumes no rate-limit tokens nor budget.
        catalog, when_down = router.catalog, config.budgets_when_database_down
        stages: list[Stage] = [
            RequestLimits(), ResolveModel(router), Allowlist(catalog), CacheStage(self.cache, router, self.guardrails,
                                                                           self.profile_book),
            RateLimitStage(self.limiter), BudgetStage(lambda: self.leases, catalog, when_down),
            GuardrailStage(self.guardrails, catalog),
        ]
        # A decision_judge guardrail's calls: its own user path's rate limits and budgets, then the router.
        judge = Pipeline([RateLimitStage(self.limiter), BudgetStage(lambda: self.leases, catalog, when_down)],
                         self._route, self.tracer)
        return Pipeline(stages, self._route, self.tracer), judge

    @staticmethod
    def keys_configured(config: GatewayConfig) -> bool:
        """Whether clients will need a key: a master key (config or environment) or static keys."""
        return bool(config.auth.master_key or os.environ.get(MASTER_KEY_ENV) or config.auth.keys)

    async def start(self) -> None:
        """Open the database (migrated) and the usage journal: ``database_url`` (or ``DECISIOND_DATABASE_URL``),
        else the default SQLite file in the data directory (``store.db.default_database_path``), so that every server
        — the embedded default with no config too — keeps usage, files and batches, budgets, learned profiles and the
        decisions of models with ``store: true``. A server without keys stays without keys: its key store is never
        asked. A setting that cannot work raises ``ConfigError`` naming it and the cause in one line (``decisiond
        serve`` starts the gateway before it serves, and exits 2 on it); a second call does nothing (the app's
        lifespan starts it too)."""
        if self._started:
            return
        self._started = True
        self.db = await _open_database(self.database_url, self._database_setting)
        journal = _open_journal(self.config.usage_journal, self.database_url)
        self.keys = KeyStore(self.db)
        self.decisions = DecisionStore(self.db)
        if _managed_keys(self.master_key, self.database_url):
            self.auth.store = self.keys
        self.budgets = BudgetStore(self.db)
        for budget in self.config.budgets:
            await self.budgets.put(budget, "config")
        self.leases = LeaseBook(SqlLedger(self.db, self.config.budget_reservation_ttl_s), self.budgets)
        await self.budgets.budgets()  # known from the start: a database that goes down later keeps this list
        self.usage = UsageWriter(self.db, self.config.audit.retention_days, journal, settling=self.leases.settling,
                                 on_written=self.leases.written, on_dropped=self.leases.dropped)
        self.leases.replay = self.usage.replay_orphans
        self.usage.start()
        self.leases.start()
        if self.stored_models:
            self._purger = asyncio.create_task(self._purge_decisions(), name="decisions-purge")
        self.profiles = ProfileStore(self.db)
        await self.read_profiles()
        self._profile_reader = asyncio.create_task(self._read_profiles(), name="profiles-reader")
        log.info("database ready", extra={"database": self.db.dialect})
        if not self.auth.enabled:
            log.warning("no API key is configured: every client that can reach this server may use every model "
                        f"and upstream key; set auth.master_key or {MASTER_KEY_ENV}")

    async def _purge_decisions(self) -> None:
        """Stored decisions past their retention are deleted, now and then every ``USAGE_PURGE_INTERVAL_S``."""
        while self.decisions is not None:
            try:
                await self.decisions.purge()
            except Exception as error:  # the database: tried again later
                log.warning("stored decisions not purged", extra={"error": one_line(error)})
            await asyncio.sleep(USAGE_PURGE_INTERVAL_S)

    async def read_profiles(self) -> int:
        """Read the active profiles into the book (``gateway.profiles``) where their set changed; how many. A
        database error leaves the book as it was."""
        if self.profiles is None:
            return 0
        try:
            ids = await self.profiles.active_ids()
            if ids == self.profile_book.ids:  # the same set: nothing to read again
                return len(ids)
            rows = await self.profiles.active()
        except Exception as error:
            log.warning("active profiles not read", extra={"error": one_line(error)})
            return 0
        self.profile_book.replace(rows)
        return len(rows)

    async def _read_profiles(self) -> None:
        while True:
            await asyncio.sleep(self.config.learning.refresh_s)
            await self.read_profiles()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._purger, self._profile_reader):
            if task is not None:
                task.cancel()
        if self.leases is not None:
            await self.leases.aclose()  # the room of budget leases given back
        if self.usage is not None:
            await self.usage.aclose()  # flush usage records (and their budget charges) before the database closes
        await self.router.aclose()
        await self.limiter.aclose()
        await self.cache.aclose()
        if self.db is not None:
            await self.db.aclose()
        if self.tracing is not None:  # the spans still queued are exported before the process ends
            await asyncio.to_thread(self.tracing.shutdown)

    async def _judge(self, guardrail: GuardrailConfig, text: str, request_id: str) -> float:
        """P(yes) of a guardrail's policy question about ``text``, from the decision model it names. The call runs
        as the guardrail's own caller (its ``user_path``): under that path's rate limits and budgets, and on a usage
        row of its own (request type ``guardrail``), never charged to the caller being judged."""
        request = DecisionRequest(input=(Message("user", (Text(text),)),), questions=(judge_question(guardrail),),
                                  model=guardrail.model)
        caller = Caller(name=f"guardrail:{guardrail.name}", user_path=guardrail.user_path)
        context = Context(request_id, "decide", "guardrail", caller, strict_model=True)
        context.resolved_model = self.router.catalog.resolve_name(guardrail.model, strict=True, internal=True)
        status: int = 500
        code: str | None = "judge_failed"
        result: Any = None
        with tracing.span(self.tracer, f"judge {guardrail.name}", {
                tracing.KIND: "GUARDRAIL", tracing.GUARDRAIL: guardrail.name}) as span:
            try:
                result = await self.judge_pipeline.run(context, request)
                status, code = 200, None
            except DecisionError as error:  # recorded, then raised on to the guardrail's fail_mode
                status, code = error.status, error.code
                raise
            except asyncio.CancelledError:  # the guardrail's timeout_ms ran out
                status, code = 504, "guardrail_timeout"
                raise
            finally:
                self.record("guardrail", context, status, code, result, None, None, guardrail=guardrail.name)
            if not isinstance(result, DecisionResult) or result.answers[0].refusal:
                raise ProviderError(f"the judge model {guardrail.model!r} did not answer", code="judge_refused")
            if span is not None:
                span.set_attribute(tracing.GUARDRAIL_SCORE, result.answers[0].probabilities[0])
        return result.answers[0].probabilities[0]

    async def _route(self, context: Context, request: Any) -> Any:
        tokens = estimated_tokens(request)

        tried: list[Target] = []

        def gate(target: Target) -> Any:
            tried.append(target)  # every attempt passes its gate: the last one tried is the one that answered
            context.targets_tried.append(target.name)
            return self.limiter.gate(target.name, target.provider.name, tokens)

        if context.resolved_model is None:
            raise ServerError("the pipeline reached the router without a resolved model")
        if isinstance(request, ChatRequest):  # failover until the first byte; each target's limits at its gate
            try:
                chat: ChatResult = await self.router.chat(request, context.resolved_model, gate, context.deadline)
            except asyncio.CancelledError:  # the client left mid-stream: what was relayed is still charged
                if request.partial is not None:
                    self._priced(context, tried, request.partial.usage, "chat")
                raise
            self._priced(context, tried, chat.usage, "chat")
            return chat
        if isinstance(request, ScoreRequest):
            score: ScoreResult = await self.router.score(request, context.resolved_model, gate)
            self._priced(context, tried, Usage(input_tokens=score.prompt_tokens), "local")
            return score
        steps: list[Step] = []  # a cascade's calls, each priced by its own target
        failed: list[Call] = []  # answers that failed their check: billed by their providers all the same

        def billed(target: Target, answer: DecisionResult, error: ProviderError) -> None:
            failed.append(Call([target.name], (target.provider.name, target.name), answer.usage, answer.model,
                               pricing.cost(target.price, answer.usage, answer.provider_format), error.status,
                               error.code))

        try:
            result: DecisionResult = await self.router.decide(request, context.resolved_model, gate, steps.append,
                                                              billed=billed, user_path=context.caller.user_path)
        except BaseException:
            _cascaded(context, steps, len(request.questions), failed)
            raise
        if not steps:
            self._priced(context, tried, result.usage, result.provider_format)
            if failed:  # the answer's own row, beside those of the billed failures
                failed.append(Call(list(context.targets_tried), context.answered_by, result.usage, result.model,
                                   context.cost or 0.0))
        _cascaded(context, steps, len(request.questions), failed)
        retention = self.stored_models.get(context.resolved_model)
        if retention is not None and self.usage is not None:
            try:
                context.stored = decisions.record(request, result, context.resolved_model, context.request_id,
                                                  context.caller, retention, steps,
                                                  target=context.answered_by[1] if context.answered_by else None)
            except Exception:  # keeping a decision never fails its request
                log.exception("decision not kept", extra={"request_id": context.request_id})
        return result

    async def answer_openai(self, body: Any, caller: Caller | None = None, request_id: str | None = None,
                            request_type: str = "decisions") -> dict[str, Any]:
        """Answer an OpenAI-shaped decision body through the whole pipeline as ``caller``, as ``POST /v1/decisions``
        would, and leave its usage row (``request_type``: ``mcp`` for MCP tool calls): the response body, or a raised
        ``DecisionError``. What the library and the MCP tools share."""
        context = Context(request_id or "lib_" + uuid.uuid4().hex, "decide", openai_dialect.DIALECT_NAME,
                          caller or Caller(), strict_model=True)
        status: int = 500
        code: str | None = ServerError.code
        result: Any = None
        rendered: dict[str, Any] | None = None
        try:
            request = openai_dialect.parse_request(body)
            result = await self.pipeline.run(context, request)
            if not isinstance(result, DecisionResult):
                raise ServerError(f"the pipeline answered a decision with a {type(result).__name__}")
            rendered = openai_dialect.render_response(result, request)
            status, code = 200, None
            return rendered
        except DecisionError as error:
            status, code = error.status, error.code
            raise
        finally:
            self.record(request_type, context, status, code, result, body, rendered)

    @staticmethod
    def _priced(context: Context, tried: list[Target], usage: Usage, provider_format: str) -> None:
        if tried:
            context.answered_by, context.cost = _answered(tried, usage, provider_format)

    def record(self, request_type: str, context: Context, status: int, error_code: str | None, result: Any,
               document: Any, body: Any, guardrail: str | None = None) -> None:
        """Journal one request's usage record for the background writer, before its response leaves (never waits,
        never fails the request; a no-op without a database). ``request_type``: one of ``usage.REQUEST_TYPES``;
        ``document`` and ``body``: the request and response bodies, kept (redacted) only with
        ``audit.log_bodies``; ``guardrail``: the guardrail a judge call was made for."""
        if self.usage is None:
            return
        if context.calls:  # one row per call, under the request's id (bodies and budget charges on the first)
            for n, call in enumerate(context.calls):
                part = dataclasses.replace(context, calls=[], targets_tried=call.targets_tried,
                                           answered_by=call.answered_by, cost=call.cost,
                                           charges=context.charges if n == 0 else [],
                                           record_id=_part_id(context.record_id, n),
                                           stored=context.stored if n == 0 else None,
                                           batch_line=context.batch_line if n == 0 else None)
                answer = DecisionResult(call.model or "", [], call.usage) if call.usage is not None else None
                self.record(request_type, part, call.status or status, call.error_code or error_code, answer,
                            document if n == 0 else None, body if n == 0 else None, guardrail)
            return
        answered = isinstance(result, (DecisionResult, ChatResult))
        usage = result.usage if answered else None
        audit = self.config.audit
        provider, model = context.answered_by or (None, None)
        outcomes = dict(context.outcomes)
        estimated = isinstance(result, ChatResult) and result.estimated
        if estimated:
            outcomes["usage"] = "estimated: not reported by the upstream"
        try:
            self.usage.submit(UsageRecord(
                time=datetime.now(timezone.utc), request_id=context.request_id, key_id=context.caller.key_id,
                user_path=context.caller.user_path, request_type=request_type, dialect=context.dialect,
                requested_model=context.requested_model, resolved_model=context.resolved_model, provider=provider,
                model=model, upstream_model=result.model if answered else None,
                attempts=len(context.targets_tried), targets=list(context.targets_tried),
                input_tokens=usage.input_tokens if usage is not None else getattr(result, "prompt_tokens", 0) or 0,
                cached_tokens=usage.cached_tokens if usage is not None else 0,
                output_tokens=usage.output_tokens if usage is not None else 0,
                cost=context.cost or 0.0, status=status, error_code=error_code,
                latency_ms=round((time.perf_counter() - context.started) * 1000, 2), cache_hit=context.cache_hit,
                estimated=estimated, guardrail=guardrail or _guardrail_summary(outcomes), outcomes=outcomes or None,
                request_body=redact(document, audit.redact_fields) if audit.log_bodies else None,
                response_body=redact(body, audit.redact_fields) if audit.log_bodies else None,
                charges=[c.row() for c in context.charges] or None, batch_id=context.batch_id,
                record_id=context.record_id, decision=context.stored,
                batch_line=list(context.batch_line) if context.batch_line is not None else None))
        except Exception:  # a record must never fail the request
            log.exception("usage record not built", extra={"request_id": context.request_id})


def _part_id(record_id: str | None, n: int) -> str | None:
    """The usage record id of row ``n`` of a request whose records have fixed ids (``Context.record_id``, the
    first row's; the others end in their number)."""
    return None if record_id is None else f"{record_id[:30]}{n % 100:02d}"


def _managed_keys(master_key: str | None, database_url: str | None) -> bool:
    """Whether managed keys are honoured: where a master key can make them, or on a database named by
    ``database_url`` (``decisiond keys create`` makes them there too). On the default SQLite file of a server without a
    master key, never: a server without keys stays without keys, and one with static keys only takes those."""
    return master_key is not None or database_url is not None


async def prepare(config: GatewayConfig) -> None:
    """What the processes of one server would otherwise race to do as they start (``serve --workers``): migrate the
    database and write the config's budgets, once, before they start. ``ConfigError`` as ``Gateway.start``."""
    url, setting = _setting(config.database_url, "database_url", DATABASE_URL_ENV)
    db = await _open_database(url, setting)
    try:
        store = BudgetStore(db)
        for budget in config.budgets:
            await store.put(budget, "config")
    finally:
        await db.aclose()


async def _open_database(url: str | None, setting: str) -> Database:
    try:
        return await Database.open(url)
    except (ValueError, ArgumentError) as error:  # a URL decisiond cannot use
        raise ConfigError(f"{setting}: {error}") from None
    except Exception as error:  # unreachable, refused, no such database, not migratable
        shown = make_url(url).render_as_string(hide_password=True) if url else "the default SQLite file"
        raise ConfigError(f"{setting}: cannot open {shown}: {one_line(error)}") from None


def _open_journal(configured: str | None, database_url: str | None) -> Journal:
    directory, setting = _setting(configured, "usage_journal", USAGE_JOURNAL_ENV)
    path = Path(directory) if directory else default_directory(database_url)
    try:
        return Journal.open(path)
    except OSError as error:
        raise ConfigError(f"{setting}: cannot write the usage journal in {path}: "
                          f"{error.strerror or one_line(error)}") from None


def _answered(tried: list[Target], usage: Usage, provider_format: str) -> tuple[tuple[str, str], float]:
    """The target that gave an answer — the last one tried — as (provider, name), and the answer's cost by that
    target's price."""
    target = tried[-1]
    return (target.provider.name, target.name), pricing.cost(target.price, usage, provider_format)


def _cascaded(context: Context, steps: list[Step], questions: int, failed: list[Call]) -> None:
    """A request's calls on the context, one ``Call`` per usage row: a cascade's (``gateway.cascade``), with its
    ``x-decisiond-escalated``, and those answered but billed (``failed``). Its cost is their sum (also when a later
    call failed) and its answer is the last call's that answered."""
    if not steps and not failed:
        return
    context.calls = [Call([t.name for t in s.tried], _name(s.answered_by), s.result.usage if s.result else None,
                          s.result.model if s.result else None, s.cost) for s in steps] + failed
    context.cost = math.fsum(call.cost for call in context.calls)
    context.answered_by = next((c.answered_by for c in reversed(context.calls) if c.answered_by and c.status is None),
                               None)
    if steps:
        context.escalated = escalated(steps)
        context.response_headers[ESCALATED_HEADER] = f"{context.escalated} of {questions}"


def _name(target: Target | None) -> tuple[str, str] | None:
    return (target.provider.name, target.name) if target is not None else None


def _guardrail_summary(outcomes: dict[str, str]) -> str | None:
    """``pii=redact (redacted email); words=warn`` from the guardrail stage's per-guardrail outcomes."""
    parts = [f"{k.removeprefix('guardrail:')}={v}" for k, v in outcomes.items() if k.startswith("guardrail:")]
    return "; ".join(parts)[:500] if parts else outcomes.get("guardrails")
