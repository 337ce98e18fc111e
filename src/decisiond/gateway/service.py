"""The gateway as the server sees it: the router, the caller's authentication, the rate limiter, the database,
and the pipeline of stages in their one fixed order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from ..canonical import DecisionRequest, DecisionResult, Message, ScoreRequest, ScoreResult, Text, Usage
from ..dialects import openai as openai_dialect
from ..errors import DecisionError, ServerError
from ..store.db import Database
from ..store.keys import KeyStore
from . import pricing
from .catalog import Target
from .chat import ChatRequest, ChatResult
from .forward import forward as forward_chat
from .pipeline import Pipeline
from .router import Gate, Router
from .settings import GatewayConfig, GuardrailConfig
from .sizes import estimated_tokens
from .stages.allowlist import Allowlist
from .stages.auth import Authenticator
from .stages.budget import BudgetStage, BudgetStore
from .stages.cache import CacheStage, ResponseCache
from .stages.guardrails import GuardrailSet, GuardrailStage, judge_question
from .stages.ratelimit import RateLimiter, RateLimitStage
from .stages.request_limits import RequestLimits
from .stages.resolve import ResolveModel
from .types import Caller, Context, Stage
from .usage import UsageRecord, UsageWriter, redact

log = logging.getLogger("decisiond.gateway")

MASTER_KEY_ENV = "DECISIOND_MASTER_KEY"
DATABASE_URL_ENV = "DECISIOND_DATABASE_URL"
REDIS_URL_ENV = "DECISIOND_REDIS_URL"


class Gateway:
    def __init__(self, router: Router, config: GatewayConfig | None = None):
        config = config or GatewayConfig()
        self.router = router
        self.master_key = config.auth.master_key or os.environ.get(MASTER_KEY_ENV) or None
        self.database_url = config.database_url or os.environ.get(DATABASE_URL_ENV) or None
        redis_url = config.redis_url or os.environ.get(REDIS_URL_ENV) or None
        self.auth = Authenticator(self.master_key, config.auth.keys)
        self.limiter = RateLimiter(
            redis_url, config.rate_limits,
            models={m.name: m.rate_limits for m in config.models if m.rate_limits is not None},
            providers={p.name: p.rate_limits for p in config.providers if p.rate_limits is not None},
            slot_ttl_s=config.concurrency_slot_ttl_s)
        self.config = config
        self.db: Database | None = None
        self.keys: KeyStore | None = None
        self.guardrails = GuardrailSet(
            {g.name: g for g in config.guardrails}, judge=self._judge,
            by_model={**{m.name: m.guardrails for m in config.models if m.guardrails},
                      **{v.name: v.guardrails for v in config.virtual_models if v.guardrails}})
        self.budgets: BudgetStore | None = None
        self.usage: UsageWriter | None = None
        self.cache = ResponseCache(config.cache)
        # The cache after the allowlist (a key never reads answers of a model it may not use) and before the rate
        # limits and budgets: a hit runs nothing downstream, so it consumes no rate-limit tokens nor budget.
        stages: list[Stage] = [
            RequestLimits(), ResolveModel(router), Allowlist(router), CacheStage(self.cache, router, self.guardrails),
            RateLimitStage(self.limiter), BudgetStage(lambda: self.budgets, router, config.budgets_when_database_down),
            GuardrailStage(self.guardrails, router),
        ]
        self.pipeline = Pipeline(stages, self._route)

    @staticmethod
    def keys_configured(config: GatewayConfig) -> bool:
        """Whether clients will need a key: a master key (config or environment) or static keys."""
        return bool(config.auth.master_key or os.environ.get(MASTER_KEY_ENV) or config.auth.keys)

    @property
    def needs_database(self) -> bool:
        """Managed keys exist only with a master key to create them; a database_url or budgets open it
        regardless. Usage is recorded wherever a database is open."""
        return self.master_key is not None or self.database_url is not None or bool(self.config.budgets)

    async def start(self) -> None:
        if self.needs_database:
            self.db = await Database.open(self.database_url)
            self.keys = KeyStore(self.db)
            self.auth.store = self.keys
            self.budgets = BudgetStore(self.db)
            for budget in self.config.budgets:
                await self.budgets.put(budget, "config")
            self.usage = UsageWriter(self.db, self.config.audit.retention_days)
            self.usage.start()
            log.info("database ready", extra={"database": self.db.dialect})
        if not self.auth.enabled:
            log.warning("no API key is configured: every client that can reach this server may use every model "
                        f"and upstream key; set auth.master_key or {MASTER_KEY_ENV}")

    async def aclose(self) -> None:
        if self.usage is not None:
            await self.usage.aclose()  # flush usage records before the database closes
        await self.router.aclose()
        await self.limiter.aclose()
        await self.cache.aclose()
        if self.db is not None:
            await self.db.aclose()

    async def _judge(self, guardrail: GuardrailConfig, text: str, request_id: str) -> float:
        """P(yes) of a guardrail's policy question about ``text``, from the decision model it names. The call's
        usage and cost go on a usage row of its own, under the guardrail's user path (not the caller's)."""
        request = DecisionRequest(input=(Message("user", (Text(text),)),), questions=(judge_question(guardrail),),
                                  model=guardrail.model)
        name = self.router.resolve_name(guardrail.model, strict=True, internal=True)
        tried: list[Target] = []
        started = time.perf_counter()
        result: DecisionResult | None = None
        failure: BaseException | None = None
        try:
            result = await self.router.decide(request, name, _tracking(tried))
        except BaseException as error:  # recorded, then raised on to the guardrail's fail_mode
            failure = error
            raise
        finally:
            self._record_judge(guardrail, request_id, name, tried, result, failure, started)
        answer = result.answers[0]
        if answer.refusal:
            raise RuntimeError(f"the judge model {guardrail.model!r} did not answer")
        return answer.probabilities[0]

    async def _route(self, context: Context, request: Any) -> Any:
        tokens = estimated_tokens(request)

        tried: list[Target] = []

        def gate(target: Target) -> Any:
            tried.append(target)  # every attempt passes its gate: the last one tried is the one that answered
            context.targets_tried.append(target.name)
            return self.limiter.gate(target.name, target.provider.name, tokens)

        if context.resolved_model is None:
            raise ServerError("the pipeline reached the router without a resolved model")
        if isinstance(request, ChatRequest):  # no failover: the chat target of the model, its own limits at its gate
            target = self.router.chat_target(context.resolved_model)
            chat: ChatResult = await forward_chat(request, target, gate(target))
            self._priced(context, tried, chat.usage, "chat")
            return chat
        if isinstance(request, ScoreRequest):
            score: ScoreResult = await self.router.score(request, context.resolved_model, gate)
            self._priced(context, tried, Usage(input_tokens=score.prompt_tokens), "local")
            return score
        result: DecisionResult = await self.router.decide(request, context.resolved_model, gate)
        self._priced(context, tried, result.usage, result.provider_format)
        return result

    async def answer_openai(self, body: Any, caller: Caller | None = None,
                            request_id: str | None = None) -> dict[str, Any]:
        """Answer an OpenAI-shaped decision body through the pipeline, as ``POST /v1/decisions`` would: the response
        body, or a raised ``DecisionError``. What the library, the MCP tools and ``decisiond decide`` share."""
        request = openai_dialect.parse_request(body)
        context = Context(request_id or "lib_" + uuid.uuid4().hex, "decide", openai_dialect.DIALECT_NAME,
                          caller or Caller(), strict_model=True)
        result = await self.pipeline.run(context, request)
        if not isinstance(result, DecisionResult):
            raise ServerError(f"the pipeline answered a decision with a {type(result).__name__}")
        return openai_dialect.render_response(result, request)

    @staticmethod
    def _priced(context: Context, tried: list[Target], usage: Usage, provider_format: str) -> None:
        if tried:
            context.answered_by, context.cost = _answered(tried, usage, provider_format)

    def record(self, request_type: str, context: Context, status: int, error_code: str | None, result: Any,
               document: Any, body: Any) -> None:
        """Hand one request's usage record to the background writer (never waits, never fails the request; a no-op
        without a database). ``request_type``: decisions, system_one, score, chat or responses; ``document`` and
        ``body``: the request and response bodies, kept (redacted) only with ``audit.log_bodies``."""
        if self.usage is None:
            return
        answered = isinstance(result, (DecisionResult, ChatResult))
        usage = result.usage if answered else None
        audit = self.config.audit
        provider, model = context.answered_by or (None, None)
        outcomes = dict(context.outcomes)
        if isinstance(result, ChatResult) and not result.reported:
            outcomes["usage"] = "not reported by the upstream"
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
                guardrail=_guardrail_summary(outcomes), outcomes=outcomes or None,
                request_body=redact(document, audit.redact_fields) if audit.log_bodies else None,
                response_body=redact(body, audit.redact_fields) if audit.log_bodies else None))
        except Exception:  # a record must never fail the request
            log.exception("usage record not built", extra={"request_id": context.request_id})

    def _record_judge(self, guardrail: GuardrailConfig, request_id: str, name: str, tried: list[Target],
                      result: DecisionResult | None, failure: BaseException | None, started: float) -> None:
        """Hand one judge call's usage row to the writer (no-op without a database; never fails the call)."""
        if self.usage is None:
            return
        usage = result.usage if result is not None else Usage()
        answered_by, cost = _answered(tried, usage, result.provider_format) if result is not None and tried \
            else ((None, None), 0.0)
        if failure is None:
            status, code = 200, None
        elif isinstance(failure, DecisionError):
            status, code = failure.status, failure.code
        elif isinstance(failure, asyncio.CancelledError):  # the guardrail's timeout_ms ran out
            status, code = 504, "guardrail_timeout"
        else:
            status, code = 502, "judge_failed"
        try:
            self.usage.submit(UsageRecord(
                time=datetime.now(timezone.utc), request_id=request_id, key_id=None, user_path=guardrail.user_path,
                request_type="guardrail", dialect=None, requested_model=guardrail.model, resolved_model=name,
                provider=answered_by[0], model=answered_by[1],
                upstream_model=result.model if result is not None else None, attempts=len(tried),
                targets=[t.name for t in tried], input_tokens=usage.input_tokens, cached_tokens=usage.cached_tokens,
                output_tokens=usage.output_tokens, cost=cost, status=status, error_code=code,
                latency_ms=round((time.perf_counter() - started) * 1000, 2), guardrail=guardrail.name))
        except Exception:  # a record must never fail the guardrail
            log.exception("judge usage record not built", extra={"request_id": request_id})


def _answered(tried: list[Target], usage: Usage, provider_format: str) -> tuple[tuple[str, str], float]:
    """The target that gave an answer — the last one tried — as (provider, name), and the answer's cost by that
    target's price."""
    target = tried[-1]
    return (target.provider.name, target.name), pricing.cost(target.price, usage, provider_format)


def _guardrail_summary(outcomes: dict[str, str]) -> str | None:
    """``pii=redact (redacted email); words=warn`` from the guardrail stage's per-guardrail outcomes."""
    parts = [f"{k.removeprefix('guardrail:')}={v}" for k, v in outcomes.items() if k.startswith("guardrail:")]
    return "; ".join(parts)[:500] if parts else outcomes.get("guardrails")


def _tracking(tried: list[Target]) -> Gate:
    """A gate that admits every attempt and notes its target in ``tried``."""

    @contextlib.asynccontextmanager
    async def gate(target: Target) -> AsyncIterator[None]:
        tried.append(target)
        yield None

    return gate
