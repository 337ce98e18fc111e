"""The gateway as the server sees it: the router, the caller's authentication, the rate limiter, the database,
and the pipeline of stages in their one fixed order."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..canonical import DecisionRequest, DecisionResult, Message, ScoreRequest, ScoreResult, Text, Usage
from ..store import Database, KeyStore
from . import pricing
from .allowlist import Allowlist
from .auth import Authenticator
from .budgets import BudgetStage, BudgetStore
from .cache import CacheStage, ResponseCache
from .config import GatewayConfig
from .guardrails import GuardrailConfig, GuardrailSet, GuardrailStage, judge_question
from .limits import RequestLimits
from .pipeline import Context, Pipeline, Stage
from .ratelimit import RateLimiter, RateLimitStage, estimated_tokens
from .resolve import ResolveModel
from .router import Router, Target
from .usage import UsageWriter

__all__ = ["Gateway"]

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
            providers={p.name: p.rate_limits for p in config.providers if p.rate_limits is not None})
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
            GuardrailStage(self.guardrails),
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

    async def _judge(self, guardrail: GuardrailConfig, text: str) -> float:
        """P(yes) of a guardrail's policy question about ``text``, from the decision model it names."""
        request = DecisionRequest(input=(Message("user", (Text(text),)),), questions=(judge_question(guardrail),),
                                  model=guardrail.model)
        name = self.router.resolve_name(guardrail.model, strict=True)
        result = await self.router.decide(request, name)
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

        if context.operation == "score":
            assert isinstance(request, ScoreRequest)
            score: ScoreResult = await self.router.score(request, context.resolved_model, gate)
            self._priced(context, tried, Usage(input_tokens=score.prompt_tokens), "local")
            return score
        assert isinstance(request, DecisionRequest) and context.resolved_model is not None
        result: DecisionResult = await self.router.decide(request, context.resolved_model, gate)
        self._priced(context, tried, result.usage, result.provider_format)
        return result

    @staticmethod
    def _priced(context: Context, tried: list[Target], usage: Usage, provider_format: str) -> None:
        """Attribute the answer to the target that gave it, and price it by that target's price."""
        if not tried:
            return
        target = tried[-1]
        context.answered_by = (target.provider.name, target.name)
        context.cost = pricing.cost(target.price, usage, provider_format)
