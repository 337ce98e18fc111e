"""The gateway's shared types: who is asking (``Caller``), what the stages know of one request (``Context``), and
the ``Stage`` protocol every pipeline stage follows. Pure: no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Mapping, Protocol, Union

from ..canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult, Usage
from .access_settings import RateLimitConfig
from .chat import ChatRequest, ChatResult

Operation = Literal["decide", "score", "chat"]
Request = Union[DecisionRequest, ScoreRequest, ChatRequest]
Result = Union[DecisionResult, ScoreResult, ChatResult]


@dataclass(frozen=True)
class Caller:
    """Who is asking: the master key, a managed or static key, or anyone (no keys configured)."""

    key_id: str | None = None
    name: str = "anonymous"
    user_path: str = "/"
    # Model patterns the key may use (names, ``provider/*``, virtual models); None means every model.
    models: tuple[str, ...] | None = None
    # The key's own rate limits, if any.
    rate_limits: RateLimitConfig | None = None
    master: bool = False
    # Guardrails attached to the key (names from the config), run on top of the model's.
    guardrails: tuple[str, ...] = ()


@dataclass
class Call:
    """One upstream call of a request that makes several (a cascade's steps, an attempt billed although its answer
    failed its check), for its own usage row: the targets it tried, the one that answered (provider, name), its
    usage, the upstream model and its cost."""

    targets_tried: list[str]
    answered_by: tuple[str, str] | None = None
    usage: Usage | None = None
    model: str | None = None
    cost: float = 0.0
    # A call that failed although the provider billed it (an answer that failed its check): its own status and
    # error on its row, whatever became of the request.
    status: int | None = None
    error_code: str | None = None


@dataclass(frozen=True)
class Charge:
    """What one request owes one budget window, settled by the usage writer in the transaction that inserts the
    request's usage row (so exactly once, and also after a restart, from the journal): ``held`` nano-USD of the hold
    ``hold_id`` are released (None: the request was admitted without a hold, the database being down) and
    ``actual`` nano-USD are added to the window's spend."""

    budget_id: str
    window_start: int
    hold_id: str | None
    held: int
    actual: int

    def row(self) -> list[Any]:
        return [self.budget_id, self.window_start, self.hold_id, self.held, self.actual]

    @classmethod
    def of(cls, row: Any) -> "Charge":
        budget_id, window_start, hold_id, held, actual = row
        return cls(str(budget_id), int(window_start), None if hold_id is None else str(hold_id), int(held),
                   int(actual))


@dataclass
class Context:
    """What the stages know of one request besides the canonical request itself."""

    request_id: str
    operation: Operation
    dialect: str
    caller: Caller = field(default_factory=Caller)
    # Unknown model names: refused (OpenAI) or answered by the default model (System One, SGLang).
    strict_model: bool = True
    requested_model: str | None = None
    resolved_model: str | None = None
    started: float = field(default_factory=time.perf_counter)
    # Stage name → seconds spent in it and everything after it.
    timings: dict[str, float] = field(default_factory=dict)
    # Stage name → what it decided ("ok", "refused: rate_limit_exceeded", …), for the access log and audit.
    outcomes: dict[str, str] = field(default_factory=dict)
    # Headers every stage may add to the response (rate-limit counters, …), success or refusal.
    response_headers: dict[str, str] = field(default_factory=dict)
    # For the usage record: the targets the router tried (in order, failed attempts included), the one that
    # answered (provider, name), the request's cost in USD once known, and whether the cache answered.
    targets_tried: list[str] = field(default_factory=list)
    answered_by: tuple[str, str] | None = None
    cost: float | None = None
    cache_hit: bool = False
    # A cascade's calls, one usage row each (empty for a request answered in one call).
    calls: list[Call] = field(default_factory=list)
    # How many of a cascade's questions went on past its first call (None: not a cascade).
    escalated: int | None = None
    # When the client stops waiting (``time.monotonic()``; ``x-decisiond-timeout-ms``), for stages that enforce it.
    deadline: float | None = None
    # The HTTP request's headers (case-insensitive where the server passes Starlette's), e.g. Cache-Control.
    request_headers: Mapping[str, str] = field(default_factory=dict)
    # What the request owes its budgets, set by the budget stage as the request ends; carried by its usage record.
    charges: list[Charge] = field(default_factory=list)
    # A batch line's: its batch, and the id of its usage record (32 characters; a request of several rows gives
    # row n the same id ending in n, two digits), the same however many times the line is answered
    # (``usage.UsageRecord.record_id``).
    batch_id: str | None = None
    record_id: str | None = None
    # A batch line's (line number, answered, line of its output or error file), kept with its usage row.
    batch_line: tuple[int, bool, Any] | None = None
    # The decision to keep, for a model with ``store: true`` (``decisions.record``); on its usage record.
    stored: dict[str, Any] | None = None
    # The generation of the active learned profiles the response cache keyed this request under.
    profiles_generation: str = ""


Next = Callable[[Context, Any], Awaitable[Any]]


class Stage(Protocol):
    name: str

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any: ...
