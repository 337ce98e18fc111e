"""Rate limits per key, per user-path subtree, per model and per provider, on the ``limits`` library's moving
window (in-process memory, or Redis so that replicas share one set of counters), plus concurrent-request caps.

Requests per second/minute/hour/day and input tokens per minute. Tokens are estimated before the call (4
characters a token, as ``gateway.sizes`` estimates them) and reserved with the request; after the call, what the
provider really counted above the estimate is added, so concurrent requests cannot overshoot a window.

Key and user-path limits are checked by the pipeline stage (before guardrails, so an over-limit request costs
nothing downstream). Model and provider limits are checked by the router for each target it tries: a target at its
limit is unavailable, and a failover chain routes around it as on a 429 from upstream.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from limits import (
    RateLimitItem,
    RateLimitItemPerDay,
    RateLimitItemPerHour,
    RateLimitItemPerMinute,
    RateLimitItemPerSecond,
)
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter

from ...errors import DecisionError, LimitExceeded, ProviderError, RateLimited, provider_error, retry_headers
from ...limits import CONCURRENCY_SLOT_TTL_S
from ..access_settings import RateLimitConfig, UserPathLimit, in_subtree
from ..sizes import estimated_tokens
from ..types import Caller, Context, Next

log = logging.getLogger("decisiond.ratelimit")

_WINDOWS: dict[str, type[RateLimitItem]] = {
    "requests_per_second": RateLimitItemPerSecond,
    "requests_per_minute": RateLimitItemPerMinute,
    "requests_per_hour": RateLimitItemPerHour,
    "requests_per_day": RateLimitItemPerDay,
}


@dataclass(frozen=True)
class Scope:
    """What a set of limits applies to: ``key``/id, ``user_path``/path, ``model``/name, ``provider``/name."""

    kind: str
    id: str
    config: RateLimitConfig

    def describe(self) -> str:
        return {"key": "API key", "user_path": "user path", "model": "model", "provider": "provider"}[self.kind] + \
            f" {self.id!r}"


@dataclass(frozen=True)
class _Check:
    scope: Scope
    setting: str  # e.g. requests_per_minute
    item: RateLimitItem

    @property
    def tokens(self) -> bool:
        return self.setting == "input_tokens_per_minute"

    @property
    def identifiers(self) -> tuple[str, ...]:
        return ("decisiond", self.scope.kind, self.scope.id, "tokens" if self.tokens else "requests")


def part(amount: int, share: tuple[int, int]) -> int:
    """This process's part of a limit shared by ``share = (index, count)`` processes that cannot count together:
    the parts of all of them add up to the limit exactly."""
    index, count = share
    return amount // count + (1 if index < amount % count else 0)


def _checks(scopes: list[Scope], share: tuple[int, int] = (0, 1)) -> list[_Check]:
    out = []
    for scope in scopes:
        for setting, window in _WINDOWS.items():
            amount = getattr(scope.config, setting)
            if amount is not None:
                out.append(_Check(scope, setting, window(part(amount, share))))
        if scope.config.requests_per_window is not None:
            out.append(_Check(scope, "requests_per_window", RateLimitItemPerSecond(
                part(scope.config.requests_per_window, share), scope.config.window_seconds)))
        if scope.config.input_tokens_per_minute is not None:
            out.append(_Check(scope, "input_tokens_per_minute",
                              RateLimitItemPerMinute(part(scope.config.input_tokens_per_minute, share))))
    return out


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


@dataclass
class Admission:
    """What one request holds: its token reservations and concurrency slots, released when it ends."""

    limiter: "RateLimiter"
    checks: list[_Check] = field(default_factory=list)
    estimate: int = 0
    slots: list[tuple[Scope, str]] = field(default_factory=list)

    async def settle(self, actual_tokens: int) -> None:
        """Count the tokens the provider reported above the estimate (never more than the window still holds)."""
        extra = actual_tokens - self.estimate
        if extra <= 0:
            return
        try:
            for check in self.checks:
                if check.tokens:
                    await self.limiter.top_up(check, extra)
        except Exception as error:
            log.warning("token usage not counted: rate-limit storage unavailable", extra={"error": repr(error)})

    async def release(self) -> None:
        slots, self.slots = self.slots, []
        for scope, slot in slots:
            try:
                await self.limiter.concurrency.release(scope, slot)
            except Exception as error:  # the slot expires on its own (_Concurrency)
                log.warning("concurrency slot not released: storage unavailable", extra={"error": repr(error)})


# Take a slot: drop the scope's expired slots, refuse at the limit, else add this one with its expiry (Redis' own
# clock, so replicas agree). KEYS[1]: the scope's sorted set; ARGV: limit, slot id, slot TTL in ms.
_ACQUIRE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class _Concurrency:
    """Requests in flight per scope: a counter in memory, or in Redis a sorted set of slots shared by replicas. Each
    Redis slot carries its own expiry, so a slot left by a replica that died holding it is dropped after
    ``slot_ttl_s`` whatever the other replicas do (a counter's TTL would be renewed by every acquire)."""

    def __init__(self, redis: Any = None, slot_ttl_s: float = CONCURRENCY_SLOT_TTL_S):
        self.redis = redis
        self.slot_ttl_ms = max(1, int(slot_ttl_s * 1000))
        self.local: dict[str, int] = {}

    @staticmethod
    def _key(scope: Scope) -> str:
        return f"decisiond:slots:{scope.kind}:{scope.id}"

    async def acquire(self, scope: Scope, limit: int) -> str | None:
        """A slot's id, or None when the scope is at its limit."""
        key = self._key(scope)
        if self.redis is None:
            if self.local.get(key, 0) >= limit:
                return None
            self.local[key] = self.local.get(key, 0) + 1
            return key
        slot = uuid.uuid4().hex
        taken = await self.redis.eval(_ACQUIRE, 1, key, limit, slot, self.slot_ttl_ms)
        return slot if taken == 1 else None

    async def release(self, scope: Scope, slot: str) -> None:
        key = self._key(scope)
        if self.redis is None:
            self.local[key] = max(0, self.local.get(key, 0) - 1)
        else:
            await self.redis.zrem(key, slot)

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


class LocalStorage(MemoryStorage):
    """``limits``' in-process storage, its expiry swept at most every ``EXPIRY_SWEEP_S`` on the event loop. The
    library's own sweeps after every hit, and moves each key's search to a worker thread: a thread hop per key per
    request, whose GIL hand-overs were a rate-limited request's largest cost. Counting is the library's, unchanged:
    a sweep only drops entries and counters already past their window."""

    EXPIRY_SWEEP_S = 1.0

    def __init__(self) -> None:
        super().__init__()
        self._swept = 0.0

    async def _MemoryStorage__schedule_expiry(self) -> None:  # replaces the library's (name-mangled) hook
        now = time.monotonic()
        if now - self._swept >= self.EXPIRY_SWEEP_S:
            self._swept = now
            self._sweep()

    def _sweep(self) -> None:
        now = time.time()
        for key, events in list(self.events.items()):
            # Newest first: keep the entries whose window has not passed.
            live = bisect.bisect_left(events, -now, key=lambda entry: -entry.expiry)
            if live:
                self.events[key] = events[:live]
            else:
                self.events.pop(key, None)
                self.locks.pop(key, None)
        for key, expiry in list(self.expirations.items()):
            if expiry <= now:
                self.storage.pop(key, None)
                self.expirations.pop(key, None)
                self.locks.pop(key, None)


class RateLimiter:
    def __init__(self, redis_url: str | None = None, user_paths: list[UserPathLimit] | None = None,
                 models: dict[str, RateLimitConfig] | None = None,
                 providers: dict[str, RateLimitConfig] | None = None,
                 slot_ttl_s: float = CONCURRENCY_SLOT_TTL_S, share: tuple[int, int] = (0, 1)):
        """``share``: (this process's index, the number of processes) of a server whose processes count in memory
        (no ``redis_url``): each enforces its ``part`` of every limit, so that together they enforce the limit.
        With Redis they share one count, and each enforces the whole."""
        self.share = share if not redis_url else (0, 1)
        self.remote = bool(redis_url)
        self.user_paths = [u for u in user_paths or [] if not u.empty()]
        self.models = {k: v for k, v in (models or {}).items() if not v.empty()}
        self.providers = {k: v for k, v in (providers or {}).items() if not v.empty()}
        self.storage: Storage
        if redis_url:
            import redis.asyncio

            uri = "async+" + redis_url if not redis_url.startswith("async+") else redis_url
            self.storage = RedisStorage(uri, implementation="redispy")
            self.concurrency = _Concurrency(redis.asyncio.Redis.from_url(redis_url.removeprefix("async+")), slot_ttl_s)
        else:
            self.storage = LocalStorage()
            self.concurrency = _Concurrency()
        self.window = MovingWindowRateLimiter(self.storage)

    # ------------------------------------------------------------------------------------------ scopes

    def caller_scopes(self, caller: Caller) -> list[Scope]:
        scopes = []
        if caller.key_id is not None and caller.rate_limits is not None and not caller.rate_limits.empty():
            scopes.append(Scope("key", caller.key_id, caller.rate_limits))
        scopes += [Scope("user_path", u.user_path, u) for u in self.user_paths if in_subtree(caller.user_path,
                                                                                            u.user_path)]
        return scopes

    def target_scopes(self, model: str, provider: str) -> list[Scope]:
        scopes = []
        if model in self.models:
            scopes.append(Scope("model", model, self.models[model]))
        if provider in self.providers:
            scopes.append(Scope("provider", provider, self.providers[provider]))
        return scopes

    # ------------------------------------------------------------------------------------------ admission

    async def admit(self, scopes: list[Scope], tokens: int) -> Admission:
        """Reserve one request and ``tokens`` input tokens in every scope, or raise 429 naming the limit.

        When the counters cannot be reached (Redis down), the request is admitted and a warning logged: an outage
        of the limiter's storage degrades to no limits, never to refusing every request."""
        admission = Admission(self, _checks(scopes, self.share), tokens)
        if not scopes:
            return admission
        try:
            return await self._admit(admission, scopes, tokens)
        except DecisionError:
            raise
        except Exception as error:  # the storage: redis.ConnectionError, TimeoutError, …
            log.warning("rate limits not enforced: their storage is unavailable",
                        extra={"error": f"{type(error).__name__}: {error}"})
            return Admission(self)

    async def _admit(self, admission: Admission, scopes: list[Scope], tokens: int) -> Admission:
        for check in admission.checks:
            cost = tokens if check.tokens else 1
            if check.tokens and cost > check.item.amount:
                raise LimitExceeded(f"this request's estimated {cost} input tokens exceed the "
                                    f"{check.item.amount} tokens per minute of {check.scope.describe()}")
            # A hit counts only when it fits: with one limit, the hit below is the test (one call, one round trip
            # to Redis); with several, each is tested first, so that a refusal by one spends nothing of the others.
            if len(admission.checks) > 1 and not await self.window.test(check.item, *check.identifiers, cost=cost):
                raise await self._refusal(check, admission)
        for scope in scopes:
            if scope.config.concurrent is not None:
                slot = await self.concurrency.acquire(scope, part(scope.config.concurrent, self.share))
                if slot is None:
                    await admission.release()
                    raise RateLimited(f"{scope.describe()} already has {scope.config.concurrent} requests in "
                                      "flight (its concurrent limit)", 1.0)
                admission.slots.append((scope, slot))
        for check in admission.checks:
            if not await self.window.hit(check.item, *check.identifiers, cost=tokens if check.tokens else 1):
                await admission.release()
                raise await self._refusal(check, admission)
        return admission

    async def _refusal(self, check: _Check, admission: Admission) -> RateLimited:
        stats = await self.window.get_window_stats(check.item, *check.identifiers)
        wait = max(0.0, stats.reset_time - time.time())
        unit = "input tokens" if check.tokens else "requests"
        return RateLimited(f"{check.scope.describe()} is over its limit of {check.item.amount} {unit} per "
                           f"{_per(check.item)}; retry in {_duration(wait)}", wait,
                           headers=await self._headers(admission))

    async def top_up(self, check: _Check, extra: int) -> None:
        stats = await self.window.get_window_stats(check.item, *check.identifiers)
        cost = min(extra, stats.remaining)
        if cost > 0:
            await self.window.hit(check.item, *check.identifiers, cost=cost)

    async def headers(self, admission: Admission) -> dict[str, str]:
        """``_headers``, or none when the counters cannot be read (their storage is down)."""
        try:
            return await self._headers(admission)
        except Exception as error:
            log.warning("rate-limit headers not computed: storage unavailable", extra={"error": repr(error)})
            return {}

    async def _headers(self, admission: Admission) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` of the tightest request and token limits."""
        headers: dict[str, str] = {}
        for tokens, unit in ((False, "requests"), (True, "tokens")):
            tightest = None
            for check in admission.checks:
                if check.tokens != tokens:
                    continue
                stats = await self.window.get_window_stats(check.item, *check.identifiers)
                if tightest is None or stats.remaining < tightest[1].remaining:
                    tightest = (check, stats)
            if tightest is not None:
                check, stats = tightest
                headers[f"x-ratelimit-limit-{unit}"] = str(check.item.amount)
                headers[f"x-ratelimit-remaining-{unit}"] = str(max(0, stats.remaining))
                headers[f"x-ratelimit-reset-{unit}"] = _duration(max(0.0, stats.reset_time - time.time()))
        return headers

    async def counters(self, caller: Caller) -> list[dict[str, Any]]:
        """The caller's live counters (for ``GET /v1/usage``): each limit with what remains and when it resets."""
        out: list[dict[str, Any]] = []
        for check in _checks(self.caller_scopes(caller), self.share):
            stats = await self.window.get_window_stats(check.item, *check.identifiers)
            out.append({"scope": check.scope.describe(), "unit": "input_tokens" if check.tokens else "requests",
                        "per": _per(check.item), "limit": check.item.amount, "remaining": max(0, stats.remaining),
                        "resets_in_seconds": round(max(0.0, stats.reset_time - time.time()), 3)})
        return out

    async def aclose(self) -> None:
        await self.concurrency.aclose()

    # ------------------------------------------------------------------------------------------ targets

    def gate(self, model: str, provider: str, tokens: int) -> "TargetGate":
        return TargetGate(self, self.target_scopes(model, provider), tokens, model, provider)


def _per(item: RateLimitItem) -> str:
    return {1: "second", 60: "minute", 3600: "hour", 86400: "day"}.get(item.get_expiry(), f"{item.get_expiry()} s")


class TargetGate:
    """``async with limiter.gate(model, provider, tokens) as admission``: a target over its limits raises a
    failover-able 429 (the router then tries the next target); the slots are released when the attempt ends."""

    def __init__(self, limiter: RateLimiter, scopes: list[Scope], tokens: int, model: str, provider: str):
        self.limiter, self.scopes, self.tokens = limiter, scopes, tokens
        self.model, self.provider = model, provider
        self.admission: Admission | None = None

    async def __aenter__(self) -> Admission:
        try:
            self.admission = await self.limiter.admit(self.scopes, self.tokens)
        except RateLimited as error:
            raise _unavailable(error, self.provider) from None
        return self.admission

    async def __aexit__(self, *exc: Any) -> None:
        if self.admission is not None:
            await self.admission.release()


def _unavailable(error: RateLimited, provider: str) -> ProviderError:
    kept = retry_headers(error.headers)
    return provider_error(provider, 429, error.message, kept, code="rate_limit_exceeded")


class RateLimitStage:
    """The caller's limits: its key's and those of every user-path subtree it is in."""

    name = "rate_limit"

    def __init__(self, limiter: RateLimiter):
        self.limiter = limiter

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        scopes = self.limiter.caller_scopes(context.caller)
        if not scopes:
            return await call_next(context, request)
        admission = await self.limiter.admit(scopes, estimated_tokens(request))
        # The x-ratelimit-* counters: read beside the call when they are in Redis (a round trip the answer need not
        # wait for), at once when they are in memory.
        counters = asyncio.ensure_future(self.limiter.headers(admission)) if self.limiter.remote else None
        if counters is None:
            context.response_headers.update(await self.limiter.headers(admission))
        try:
            result = await call_next(context, request)
            usage = getattr(result, "usage", None)
            await admission.settle(usage.input_tokens if usage is not None else getattr(result, "prompt_tokens", 0))
            return result
        finally:
            if counters is not None:
                context.response_headers.update(await counters)
            await admission.release()
