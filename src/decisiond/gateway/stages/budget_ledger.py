"""The budgets' ledger, as the lease book sees it: a small protocol (``Ledger``) in front of the database, and the
pure values both sides speak (``BudgetView``, ``Grant``, ``Pending``, the windows of a budget, ``NoRoom``).

The ledger is what every replica shares: each budget window's ``spent`` (settled costs) and ``reserved`` (room held),
and the holds on that room, one per lease of a process. Its contract, which every implementation keeps in each
transaction: in each window, ``reserved`` is the sum of its holds, and a hold is granted only out of what the limit
leaves (``spent + reserved + need <= limit``, the limit as the ledger has it *now*). Hold ages are the ledger's own
clock, never a replica's. The SQL ledger is ``budget_sql.SqlLedger``; the tests drive the lease book against an
in-memory one that loses acknowledgements, stalls and dies.

A call whose outcome is unknown (an error other than ``NoRoom`` or ``BudgetGone``: the acknowledgement of a commit
lost, a cancellation while the commit runs) may or may not have been applied: the caller reads the hold back
(``read``) before it uses that room again.

Amounts are integers in nano-USD, so they add up exactly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from ...errors import BudgetExceeded, DecisionError
from ..access_settings import BudgetConfig, in_subtree
from ..types import Caller

NANO = 1_000_000_000


def to_nano(usd: float) -> int:
    return int(round(usd * NANO))


def budget_id(config: BudgetConfig) -> str:
    """The same scope and period always name the same budget (a PUT replaces its limit)."""
    scope = f"key={config.key}" if config.key is not None else f"user_path={config.user_path}" \
        if config.user_path is not None else f"model={config.model}"
    period = config.period or f"{config.period_seconds}s"
    return "bud_" + hashlib.sha256(f"{scope}|{period}".encode()).hexdigest()[:20]


def window(period: str | None, period_seconds: int | None, now: float | None = None) -> tuple[int, int]:
    """The current window of a budget as (start, end) Unix seconds: UTC calendar periods, or epoch-aligned."""
    now = time.time() if now is None else now
    if period_seconds is not None:
        start = int(now // period_seconds * period_seconds)
        return start, start + period_seconds
    t = datetime.fromtimestamp(now, timezone.utc)
    if period == "hourly":
        s = t.replace(minute=0, second=0, microsecond=0)
        e = s + timedelta(hours=1)
    elif period == "daily":
        s = t.replace(hour=0, minute=0, second=0, microsecond=0)
        e = s + timedelta(days=1)
    elif period == "weekly":  # ISO weeks: Monday 00:00 UTC
        s = t.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=t.weekday())
        e = s + timedelta(days=7)
    else:  # monthly
        s = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        e = s.replace(year=s.year + 1, month=1) if s.month == 12 else s.replace(month=s.month + 1)
    return int(s.timestamp()), int(e.timestamp())


@dataclass(frozen=True)
class BudgetView:
    """A budget as read from the ledger. ``created_at`` tells a budget deleted and made again from the one before."""

    id: str
    key_id: str | None
    user_path: str | None
    model: str | None
    limit_nano: int
    period: str | None
    period_seconds: int | None
    source: str
    created_at: datetime | None = None

    @property
    def scope(self) -> str:
        return f"key {self.key_id}" if self.key_id is not None else f"user path {self.user_path}" \
            if self.user_path is not None else f"model {self.model}"

    @property
    def per(self) -> str:
        return self.period or f"{self.period_seconds} s"

    def applies(self, caller: Caller, models: tuple[str, ...]) -> bool:
        if self.key_id is not None:
            return caller.key_id == self.key_id
        if self.user_path is not None:
            return in_subtree(caller.user_path, self.user_path)
        return self.model in models

    def window(self, now: float | None = None) -> tuple[int, int]:
        return window(self.period, self.period_seconds, now)

    def narrowed(self, since: "BudgetView") -> bool:
        """Whether room leased under ``since`` may no longer be used under this view: the limit was lowered, or the
        budget was deleted and made again (its windows and holds went with it)."""
        return self.limit_nano < since.limit_nano or self.created_at != since.created_at

    def public(self, spent: int = 0, reserved: int = 0, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        start, end = self.window(now)
        return {"id": self.id, "key": self.key_id, "user_path": self.user_path, "model": self.model,
                "limit_usd": self.limit_nano / NANO, "period": self.period, "period_seconds": self.period_seconds,
                "source": self.source, "spent_usd": spent / NANO, "reserved_usd": reserved / NANO,
                "remaining_usd": max(0, self.limit_nano - spent - reserved) / NANO,
                "window_start": datetime.fromtimestamp(start, timezone.utc).isoformat(),
                "resets_in_seconds": max(0, int(end - now))}


def budget_exceeded(b: BudgetView, spent: int, reserved: int, amount: int, resets_in: int) -> DecisionError:
    in_flight = f" (${reserved / NANO:.6f} more held for requests in flight)" if reserved else ""
    return BudgetExceeded(
        f"The budget of {b.scope} is spent: ${spent / NANO:.6f} of its ${b.limit_nano / NANO:.6f} limit per "
        f"{b.per} used{in_flight}; this request would cost about ${amount / NANO:.6f}. It resets in {resets_in} s.",
        headers={"retry-after": str(max(1, resets_in))})


@dataclass
class Pending:
    """What one process knows of a budget window that the ledger does not have yet: ``spent``, the cost its
    requests settled that the usage writer has not written; ``free``, the room those requests held plus the room its
    leases hold that no request uses; ``explained``, by lease id, how much of the lease's hold that accounts for
    (a hold it all accounts for holds nothing for a request in flight)."""

    spent: int = 0
    free: int = 0
    explained: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Hold:
    """What one request holds of one budget window: ``amount`` nano-USD of the lease's hold ``lease`` (None:
    admitted unchecked while the database was down, holding nothing)."""

    lease: str | None
    budget_id: str
    window_start: int
    amount: int


@dataclass
class Reservation:
    """What one request holds on its budgets, one hold per budget window."""

    holds: list[Hold] = field(default_factory=list)


class NoRoom(Exception):
    """A window without the room asked for, as the ledger has it: its ``spent``, ``reserved`` and ``limit``. Nothing
    was changed."""

    def __init__(self, spent: int, reserved: int, limit: int | None = None):
        super().__init__(f"spent {spent}, reserved {reserved}")
        self.spent, self.reserved, self.limit = spent, reserved, limit


class BudgetGone(Exception):
    """The budget is no longer in the ledger (deleted since this process read the list). Nothing was changed."""


@dataclass(frozen=True)
class Grant:
    """What a growth left: the hold ``hold`` now holds ``amount``, ``granted`` of it just now; ``fresh`` when the
    hold is new (the one asked to grow was gone: released for its age, its budget changed, or never made)."""

    hold: str
    amount: int
    granted: int
    fresh: bool


class Ledger(Protocol):
    """The transactions a lease book makes on the ledger. Each is atomic; each may fail with its outcome unknown
    (then the caller reads the hold back before using its room)."""

    @property
    def ttl_s(self) -> float:
        """Seconds after its last renewal (the ledger's clock) that a hold may be released by any replica."""
        ...

    async def grow(self, budget: BudgetView, start: int, hold: str | None, new_hold: str, need: int, chunk: int,
                   amount: int, holder: str) -> Grant:
        """Add at least ``need`` and up to ``chunk`` (whole ``amount``s, a quarter of what is free at most) to
        ``hold`` in ``budget``'s window ``start``, or, where that hold is gone (or None), make ``new_hold`` for
        ``holder``; renews the hold. Expired holds of the window are released first. ``NoRoom`` when not even
        ``need`` is free under the limit the ledger has; ``BudgetGone`` when the budget is gone."""
        ...

    async def give_back(self, hold: str, budget: str, start: int, amount: int) -> int | None:
        """Take up to ``amount`` off ``hold`` and its window's ``reserved``: what the hold has left (deleted at 0),
        or None when it is gone."""
        ...

    async def renew(self, holds: Sequence[tuple[str, str, int]]) -> set[str]:
        """Mark the holds ``(id, budget, window start)`` renewed now; the ids of those still there."""
        ...

    async def read(self, budget: str, start: int, holds: Sequence[str]) -> dict[str, int]:
        """The amount of each of ``holds`` (of ``budget``'s window ``start``) still there, read under the window's
        lock: a transaction on that window still under way (a commit whose reply was lost) has finished first."""
        ...

    async def holders(self, machine: str) -> list[str]:
        """The holders of ``machine`` (``store.processes``) that hold something."""
        ...

    async def release(self, holders: Sequence[str]) -> int:
        """Release every hold of ``holders`` (processes known to have died); how much room came back."""
        ...

    async def purge(self, current: dict[str, int]) -> None:
        """Delete what no admission reads again: the windows of budgets that are gone, and of each budget in
        ``current`` (id → its current window's start) the earlier windows, once their holds are expired."""
        ...
