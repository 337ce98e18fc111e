"""Stage: the exact response cache. A decision is a pure function of the model and the full request, so an
identical request is answered from the cache without running the engine or calling upstream.

- **Key**: SHA-256 of the resolved model name, the target that will answer (provider, its wire format, the upstream
  model; for a local engine the weights, its default order and calibration, the calibration profile in force and
  the prompt format), the operation, the canonical request (every field that takes part in its equality, nothing
  of how it was spelled on the wire) and the learned profiles that may serve the caller's user path (none: nothing
  added), so that no caller is served an answer computed with profiles that do not serve it. One decision asked
  through ``/v1/decisions`` and ``/v1/systemone`` is one entry, rendered per dialect; the key order of the body
  never matters, that of JSON the model reads does.
- **Storage**: an in-process LRU bounded in bytes, then Redis (``cache.redis_url``) shared by replicas; both with
  ``cache.ttl``. Redis unreachable → the in-process cache alone, with a warning, never an error.
- **Single flight**: identical concurrent misses in one process run once; the others wait and share the answer.
- **Control**: ``Cache-Control: no-cache`` recomputes and refreshes the entry, ``no-store`` neither reads nor
  writes. Responses carry ``X-Cache: HIT`` or ``MISS`` (none where the model is not cached). Never stored: errors,
  answers with a refusal, answers from any but the first target of a failover chain, and a cascade's answers that
  escalated any question (its key holds its steps and thresholds: an answer stored is its first call's).

The stage runs after the allowlist (a key never reads answers of a model it may not use) and before the rate
limits, so that a hit costs no rate-limit tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from ...canonical import Answer, DecisionRequest, DecisionResult, ScoreRequest, ScoreResult, Usage
from ..cascade import ESCALATED_HEADER
from ..catalog import Target
from ..fingerprint import request_tree
from ..profiles import ProfileBook
from ..router import Router
from ..settings import CacheConfig
from ..types import Context, Next
from .guardrails import GuardrailSet

log = logging.getLogger("decisiond.cache")

KEY_VERSION = 2
REDIS_PREFIX = "decisiond:cache:"
# After a Redis error, the cache does without Redis for this long before trying it again.
REDIS_RETRY_S = 2.0


# ------------------------------------------------------------------------------------------------ key


def _answerer(target: Target) -> dict[str, Any]:
    """What answers on a target: the provider, its wire format, the upstream model and, where the provider declares
    one (a local engine: weights, default modes, profile, prompt format), everything else that shapes its answers."""
    provider = target.provider
    described: dict[str, Any] = {"target": target.name, "provider": provider.name, "format": provider.format,
                                 "upstream": target.upstream}
    identity = provider.cache_identity()
    if identity is not None:
        described["engine"] = identity
    return described


def cache_key(operation: str, model: str, target: Target, request: DecisionRequest | ScoreRequest,
              guardrails: Any = None, cascade: Any = None, profiles: str = "") -> str:
    """``guardrails``: the configs of the guardrails in force — deterministic functions of the request, so the
    entry answers exactly the request they let through (and edited). ``cascade``: a cascade's config (its steps and
    thresholds decide that no question escalated). ``profiles``: the generation of the learned profiles that may serve
    the caller's user path (``ProfileBook.generation``): an answer computed with one tenant's profiles is never
    served to a caller they do not serve, and one stored under others is not served after a profile is accepted or
    rolled back."""
    # The requested name is left out: the resolved model stands for it (lenient dialects map any name to it).
    canonical = dataclasses.replace(request, model=None)
    material = {"v": KEY_VERSION, "operation": operation, "model": model, "answerer": _answerer(target),
                "request": request_tree(canonical), "guardrails": guardrails}
    if cascade is not None:
        material["cascade"] = cascade
    if profiles:
        material["profiles"] = profiles
    text = json.dumps(material, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- values


def encode(result: DecisionResult | ScoreResult) -> bytes:
    kind = "score" if isinstance(result, ScoreResult) else "decide"
    data = dataclasses.asdict(result)
    for answer in data.get("answers", ()):  # what a learned head read: nothing a hit needs, and the bulk of it
        answer["features"] = None
    return json.dumps({"kind": kind, "result": data}, separators=(",", ":")).encode()


def decode(blob: bytes) -> DecisionResult | ScoreResult:
    """A fresh result from an entry (each hit renders its own copy)."""
    data = json.loads(blob)
    result = data["result"]
    if data["kind"] == "score":
        return ScoreResult(**result)
    return DecisionResult(model=result["model"], answers=[Answer(**a) for a in result["answers"]],
                          usage=Usage(**result["usage"]), prompt_format_version=result["prompt_format_version"],
                          provider_format=result["provider_format"])


def cache_control(headers: Any) -> set[str]:
    """The request's Cache-Control directives, lower-cased (``no-cache``, ``no-store``)."""
    value = headers.get("cache-control") if headers else None
    return {d.strip().split("=", 1)[0].lower() for d in value.split(",")} if value else set()


# --------------------------------------------------------------------------------------------- storage


class MemoryStore:
    """Least recently used entries first out, bounded by the bytes of their values; each entry expires."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= time.monotonic():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def set(self, key: str, value: bytes, ttl: float) -> None:
        if key in self._entries:
            self._drop(key)
        if len(value) > self.max_bytes:
            return
        self._entries[key] = (value, time.monotonic() + ttl)
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> int:
        count = len(self._entries)
        self._entries.clear()
        self.bytes = 0
        return count

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self.bytes -= len(value)


class RedisStore:
    """Entries shared by replicas. Every error is logged and swallowed (the caller sees a miss, or no write), and
    Redis is left alone for ``REDIS_RETRY_S`` after one."""

    def __init__(self, url: str):
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5,
                                                   retry_on_timeout=False)
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, action: str, error: Exception) -> None:
        if self.available:
            log.warning("response cache: redis unavailable, using the in-process cache only",
                        extra={"action": action, "error": f"{type(error).__name__}: {error}"})
        self._down_until = time.monotonic() + REDIS_RETRY_S

    async def get(self, key: str) -> bytes | None:
        if not self.available:
            return None
        try:
            value = await self.client.get(REDIS_PREFIX + key)
        except Exception as error:  # redis.ConnectionError, TimeoutError, …: no caching, never an error
            self._failed("get", error)
            return None
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        if not self.available:
            return
        try:
            await self.client.set(REDIS_PREFIX + key, value, px=max(1, int(ttl * 1000)))
        except Exception as error:
            self._failed("set", error)

    async def _keys(self) -> list[bytes]:
        return [k async for k in self.client.scan_iter(match=REDIS_PREFIX + "*", count=1000)]

    async def count(self) -> int | None:
        try:
            return len(await self._keys())
        except Exception as error:
            self._failed("count", error)
            return None

    async def clear(self) -> int | None:
        try:
            keys = await self._keys()
            for i in range(0, len(keys), 1000):
                await self.client.unlink(*keys[i:i + 1000])
            return len(keys)
        except Exception as error:
            self._failed("clear", error)
            return None

    async def aclose(self) -> None:
        await self.client.aclose()


class ResponseCache:
    """The two stores, the hit and miss counters, and the flights in progress."""

    def __init__(self, config: CacheConfig):
        self.enabled = config.enabled
        self.ttl = config.ttl
        self.memory = MemoryStore(config.max_bytes)
        self.redis = RedisStore(config.redis_url) if config.enabled and config.redis_url else None
        self.hits = 0
        self.misses = 0
        self.flights: dict[str, asyncio.Future[bytes | None]] = {}

    async def get(self, key: str) -> bytes | None:
        value = self.memory.get(key)
        if value is None and self.redis is not None:
            value = await self.redis.get(key)
            if value is not None:
                self.memory.set(key, value, self.ttl)
        return value

    async def put(self, key: str, value: bytes) -> None:
        self.memory.set(key, value, self.ttl)
        if self.redis is not None:
            await self.redis.set(key, value, self.ttl)

    async def stats(self) -> dict[str, Any]:
        shared = None
        if self.redis is not None:
            shared = {"entries": await self.redis.count(), "available": self.redis.available}
        return {"object": "cache", "enabled": self.enabled, "ttl": self.ttl, "entries": len(self.memory),
                "bytes": self.memory.bytes, "max_bytes": self.memory.max_bytes, "hits": self.hits,
                "misses": self.misses, "redis": shared}

    async def clear(self) -> dict[str, Any]:
        deleted = {"object": "cache.deleted", "entries": self.memory.clear(), "redis": None}
        if self.redis is not None:
            deleted["redis"] = await self.redis.clear()
        return deleted

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


# ----------------------------------------------------------------------------------------------- stage


class CacheStage:
    name = "cache"

    def __init__(self, cache: ResponseCache, router: Router, guardrails: GuardrailSet | None = None,
                 profiles: ProfileBook | None = None):
        self.cache = cache
        self.router = router
        self.catalog = router.catalog
        self.guardrails = guardrails
        self.profiles = profiles

    def enabled_for(self, name: str, target: Target) -> bool:
        """``cache`` on every virtual model the request passes through (``Catalog.policy_names``), the model, the
        provider: any false wins, then any true; else the provider's default."""
        virtual = [self.catalog.virtual[n].cache for n in self.catalog.policy_names(name) if n in self.catalog.virtual]
        settings = (*virtual, target.cache, target.provider.config.cache)
        if False in settings:
            return False
        return True in settings or target.provider.cached_by_default

    def plan(self, context: Context, request: Any) -> tuple[str, Target] | None:
        """The entry's key and the target that should answer, or None when this request is not cached."""
        name = context.resolved_model
        if not self.cache.enabled or name is None or context.operation == "chat":  # chat answers are not cached
            return None
        if context.operation == "score":
            target: Target | None = self.router.score_target(name)
        else:
            target = self.catalog.first_target(request, name)
        if target is None or not self.enabled_for(name, target):
            return None
        models = self.catalog.policy_names(name)
        in_force = self.guardrails.for_request(models, context.caller.guardrails) if self.guardrails else []
        fingerprint = [g.model_dump(mode="json") for g in in_force] or None
        cascade = self.catalog.virtual[name].model_dump(mode="json") if self.catalog.cascade_steps(name) else None
        context.profiles_generation = self._generation(context)
        return cache_key(context.operation, name, target, request, fingerprint, cascade,
                         context.profiles_generation), target

    def _generation(self, context: Context) -> str:
        """The learned profiles that may serve this caller (its user path's), as the key names them."""
        return self.profiles.generation(context.caller.user_path) if self.profiles is not None else ""

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        plan = self.plan(context, request)
        if plan is None:
            return await call_next(context, request)
        key, target = plan
        directives = cache_control(context.request_headers)
        if "no-store" in directives:
            context.response_headers["x-cache"] = "MISS"
            self.cache.misses += 1
            return await call_next(context, request)
        if "no-cache" not in directives:
            blob = await self.cache.get(key)
            if blob is None and key in self.cache.flights:  # the same request is being answered: share it
                blob = await asyncio.shield(self.cache.flights[key])
            if blob is not None:
                self.cache.hits += 1
                context.cache_hit = True
                context.cost = 0.0  # a hit calls no provider: x-decisiond-cost: 0, and nothing is charged
                context.response_headers["x-cache"] = "HIT"
                if self.catalog.cascade_steps(context.resolved_model or "") and isinstance(request, DecisionRequest):
                    # a cascade's answer is stored only when no question escalated
                    context.response_headers[ESCALATED_HEADER] = f"0 of {len(request.questions)}"
                return decode(blob)
        return await self._compute(context, request, call_next, key, target)

    async def _compute(self, context: Context, request: Any, call_next: Next, key: str, target: Target) -> Any:
        self.cache.misses += 1
        context.response_headers["x-cache"] = "MISS"
        flight: asyncio.Future[bytes | None] | None = None
        if key not in self.cache.flights:
            flight = asyncio.get_running_loop().create_future()
            self.cache.flights[key] = flight
        try:
            result = await call_next(context, request)
            blob = encode(result)
            # An answer computed while the active profiles changed may be under either set: not stored (the key
            # names the set read when the request was planned).
            changed = self._generation(context) != context.profiles_generation
            storable = _storable(result, context, target) and not changed
            if flight is not None and (storable or not context.calls):
                # Waiters share even an answer that is not stored, but not a cascade's that escalated (its
                # x-decisiond-escalated is this request's): they compute their own.
                flight.set_result(blob)
            if storable:
                await self.cache.put(key, blob)
            return result
        finally:
            if flight is not None:
                if not flight.done():  # failed or cancelled: each waiter computes its own answer
                    flight.set_result(None)
                if self.cache.flights.get(key) is flight:
                    del self.cache.flights[key]


def _storable(result: Any, context: Context, target: Target) -> bool:
    """An answer of the first target on its first attempt, with no refusal (for a cascade: its first call, which no
    question escalated from)."""
    if context.targets_tried != [target.name]:
        return False
    return not (isinstance(result, DecisionResult) and any(a.refusal for a in result.answers))
