"""One line of a batch answered as ``POST <endpoint>`` answers it (``routes.respond``), in the route's own dialect,
waiting out the limits that refuse it for now; its ids, the same each time it is answered; and its row as stored
(``store.batches.Result``)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..canonical import DecisionResult, ScoreResult
from ..errors import RETRY_HEADERS, DecisionError
from ..gateway.service import Gateway
from ..gateway.types import Caller, Context
from ..store.batches import Result
from ..store.tables import BatchJob
from .batch_holder import Stopped
from .routes import ROUTES, DecisionRoute, respond

# The endpoints a batch may name: the decision routes.
ENDPOINTS: dict[str, DecisionRoute] = {route.path: route for route in ROUTES}
# How long a line refused by a rate limit waits when the refusal does not say, and at most.
RETRY_DEFAULT_S = 1.0
RETRY_MAX_S = 60.0


def request_id(batch_id: str, line: int) -> str:
    """A line's request id, the same each time it is answered (``batch_req_`` and 24 hex digits)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


def record_id(batch_id: str, line: int) -> str:
    """A line's usage record id (``Context.record_id``): a second record of the line is not written."""
    return hashlib.sha256(f"usage:{batch_id}:{line}".encode()).hexdigest()[:30] + "00"


async def caller_of(gateway: Gateway, job: BatchJob) -> Caller | DecisionError:
    """What the batch's lines run as now: the key that made it (a revoked key's lines are refused, 401)."""
    try:
        caller = await gateway.auth.caller_of(job.key_id, job.master)
    except DecisionError as error:
        return error
    return dataclasses.replace(caller, user_path=job.user_path)


async def answer_line(gateway: Gateway, job: BatchJob, route: DecisionRoute, n: int, item: dict[str, Any],
                      caller: Caller | DecisionError, going: Callable[[], bool]) -> Result:
    """Line ``n`` (``item``, its JSON) answered as ``POST <endpoint>`` answers it, its usage recorded once it is final
    (with the line's answer: ``usage_writer`` stores it with the row, so that the answer kept is the one charged).
    ``Stopped`` when ``going()`` turns false while the line waits out a limit."""
    custom_id, document = item["custom_id"], item["body"]
    ident = request_id(job.id, n)
    if isinstance(caller, DecisionError):
        status, body = route.early_error(caller, None)
        return line_result(n, ident, custom_id, status, body, None)
    dialect = route.choose(document)
    while True:
        context = Context(ident, dialect.operation, dialect.name, caller, strict_model=dialect.strict_model,
                          batch_id=job.id, record_id=record_id(job.id, n))
        answer = await respond(gateway, dialect, context, document, None, {})
        wait = _retry_after(answer.status, answer.headers)
        if wait is not None:
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not going():
                    raise Stopped()
                await asyncio.sleep(min(1.0, deadline - time.monotonic()))
            continue
        result = line_result(n, ident, custom_id, answer.status, answer.body, answer.result)
        context.batch_line = (n, result.ok, result.body)
        gateway.record("batch", context, answer.status, answer.error_code, answer.result, document, answer.body)
        return result


def input_key(body: dict[str, Any]) -> bytes | None:
    """What a decision line asks about: a digest of its body without its questions (None for a body without
    questions)."""
    if "questions" not in body:
        return None
    try:
        rest = orjson.dumps({k: v for k, v in body.items() if k != "questions"}, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return hashlib.blake2b(rest, digest_size=16).digest()


def _retry_after(status: int, headers: dict[str, str]) -> float | None:
    """How long a line waits before it is asked again: a rate limit's refusal (429), or a 503 that says when to
    come back (the local engine's queue is full); None for an answer that stands."""
    if status != 429 and not (status == 503 and any(name in headers for name in RETRY_HEADERS)):
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return min(RETRY_MAX_S, max(0.01, float(value) * scale))
            except ValueError:
                pass
    return RETRY_DEFAULT_S


def line_result(n: int, ident: str, custom_id: Any, status: int, body: Any, result: Any) -> Result:
    """Line ``n``'s row as stored: its output line (status, request id, body) and the tokens it used."""
    usage = result.usage if isinstance(result, DecisionResult) else None
    return Result(n, 200 <= status < 300, {"id": ident, "custom_id": custom_id, "response": {
        "status_code": status, "request_id": ident, "body": body}, "error": None},
        input_tokens=usage.input_tokens if usage else result.prompt_tokens if isinstance(result, ScoreResult) else 0,
        cached_tokens=usage.cached_tokens if usage else 0, output_tokens=usage.output_tokens if usage else 0)
