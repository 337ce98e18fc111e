"""The budgets' ledger in the database, which every replica shares: the budgets themselves (``budgets``), each
budget's windows (``budget_windows``: ``spent``, the settled costs, and ``reserved``, the room held) and the holds
on that room (``budget_reservations``: one row a lease, with its amount and the time it was last renewed).

The invariant every transaction here keeps: in each window, ``reserved`` is the sum of its holds, and
``spent + reserved`` never passes the limit by what a hold is granted — a hold is granted only in a conditional
``UPDATE … WHERE spent + reserved + :need <= limit`` (PostgreSQL re-checks the row a concurrent transaction
committed; SQLite serialises writers). What a replica admits comes out of its holds (``budget_leases``), so the
requests of all replicas together never hold more than the limit leaves.

- ``grow``: a lease takes more room, at least what a request needs, up to a chunk (a quarter of what is free at
  most, so that the last room of a budget goes a request at a time); expired holds of that budget are released
  first (``budget_reservation_ttl_s`` after their last renewal: their replica died).
- ``give_back``: a lease returns room it did not use.
- ``apply_charges``: requests settle, in the usage writer's transaction that inserts their rows (exactly once): each
  request's worst case leaves its lease's hold and the window's ``reserved``, its real cost is added to ``spent``. A
  hold that reaches 0 is deleted. A charge whose hold is gone (released for its age) adds its cost only.

Amounts are integers in nano-USD, so they add up exactly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from sqlalchemy import delete, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from ...errors import BudgetExceeded, DecisionError
from ...limits import BUDGET_CACHE_S, BUDGET_DB_TIMEOUT_S, BUDGET_RESERVATION_TTL_S
from ...store.db import Database
from ...store.tables import Budget, BudgetReservation, BudgetWindow
from ..settings import BudgetConfig, in_subtree
from ..types import Caller, Charge

log = logging.getLogger("decisiond.budgets")

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
    id: str
    key_id: str | None
    user_path: str | None
    model: str | None
    limit_nano: int
    period: str | None
    period_seconds: int | None
    source: str

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

    def public(self, spent: int = 0, reserved: int = 0, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        start, end = self.window(now)
        return {"id": self.id, "key": self.key_id, "user_path": self.user_path, "model": self.model,
                "limit_usd": self.limit_nano / NANO, "period": self.period, "period_seconds": self.period_seconds,
                "source": self.source, "spent_usd": spent / NANO, "reserved_usd": reserved / NANO,
                "remaining_usd": max(0, self.limit_nano - spent - reserved) / NANO,
                "window_start": datetime.fromtimestamp(start, timezone.utc).isoformat(),
                "resets_in_seconds": max(0, int(end - now))}


def _view(b: Budget) -> BudgetView:
    return BudgetView(b.id, b.key_id, b.user_path, b.model, b.limit_nanousd, b.period, b.period_seconds, b.source)


def budget_exceeded(b: BudgetView, spent: int, reserved: int, amount: int, resets_in: int) -> DecisionError:
    in_flight = f" (${reserved / NANO:.6f} more held for requests in flight)" if reserved else ""
    return BudgetExceeded(
        f"The budget of {b.scope} is spent: ${spent / NANO:.6f} of its ${b.limit_nano / NANO:.6f} limit per "
        f"{b.per} used{in_flight}; this request would cost about ${amount / NANO:.6f}. It resets in {resets_in} s.",
        headers={"retry-after": str(max(1, resets_in))})


@dataclass
class Local:
    """What one process knows of a budget window that the ledger does not have yet: ``spent``, the cost its
    requests settled that the usage writer has not written; ``free``, the room those requests held plus the room its
    leases hold that no request uses; ``explained``, by lease id, how much of the lease's hold that accounts for
    (a hold it all accounts for holds nothing for a request in flight)."""

    spent: int = 0
    free: int = 0
    explained: dict[str, int] = field(default_factory=dict)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # raised to whoever awaits it (none, for a read beside requests)


class NoRoom(Exception):
    """A window without the room asked for, as the ledger has it: its ``spent`` and ``reserved``."""

    def __init__(self, spent: int, reserved: int):
        super().__init__(f"spent {spent}, reserved {reserved}")
        self.spent, self.reserved = spent, reserved


class BudgetStore:
    """Budgets and their windows in the database; the list is cached for ``BUDGET_CACHE_S``."""

    def __init__(self, db: Database, reservation_ttl_s: float = BUDGET_RESERVATION_TTL_S):
        self.db = db
        self.reservation_ttl_ms = int(reservation_ttl_s * 1000)
        self._cache: tuple[float, list[BudgetView]] | None = None
        self._refresh: asyncio.Task[list[BudgetView]] | None = None

    async def budgets(self) -> list[BudgetView]:
        """Every budget, as read at most ``BUDGET_CACHE_S`` ago (a change on another replica is seen within it): the
        list in memory, read again beside the request once half that old, so that while requests come none waits
        for the database; one read at a time; the last list known while the database cannot be read."""
        now, cached, refresh = time.monotonic(), self._cache, self._refresh
        if refresh is None or refresh.done():
            if cached is not None and cached[0] - now >= BUDGET_CACHE_S / 2:
                return cached[1]
            refresh = self._refresh = asyncio.ensure_future(self._read())
            refresh.add_done_callback(_retrieved)
        if cached is not None and cached[0] > now:
            return cached[1]
        return await asyncio.shield(refresh)

    async def _read(self) -> list[BudgetView]:
        try:
            async with self.db.session() as session:
                rows = (await asyncio.wait_for(session.execute(select(Budget).order_by(Budget.id)),
                                               BUDGET_DB_TIMEOUT_S)).scalars()
                views = [_view(b) for b in rows]
        except Exception:
            if self._cache is None:
                raise
            views = self._cache[1]  # the database is down: keep the last list known
        self._cache = (time.monotonic() + BUDGET_CACHE_S, views)
        return views

    def forget(self) -> None:
        """Read the list again, and wait for it, at the next request (after a change here)."""
        self._cache = None
        self._refresh = None

    async def put(self, config: BudgetConfig, source: Literal["config", "admin"]) -> BudgetView:
        ident = budget_id(config)
        values = {"key_id": config.key, "user_path": config.user_path, "model": config.model,
                  "limit_nanousd": to_nano(config.limit_usd), "period": config.period,
                  "period_seconds": config.period_seconds, "source": source}
        # One upsert: replicas (and the workers of one server) starting together write the config's budgets at once.
        statement = self._insert()(Budget).values(id=ident, created_at=datetime.now(timezone.utc), **values)
        async with self.db.session() as session, session.begin():
            await session.execute(statement.on_conflict_do_update(index_elements=["id"], set_=values))
        self.forget()
        return BudgetView(ident, config.key, config.user_path, config.model, to_nano(config.limit_usd),
                          config.period, config.period_seconds, source)

    async def delete(self, ident: str) -> bool:
        async with self.db.session() as session, session.begin():
            result = await session.execute(delete(Budget).where(Budget.id == ident))
            await session.execute(delete(BudgetWindow).where(BudgetWindow.budget_id == ident))
            await session.execute(delete(BudgetReservation).where(BudgetReservation.budget_id == ident))
        self.forget()
        return bool(getattr(result, "rowcount", 0))

    async def spend(self, budgets: list[BudgetView], now: float | None = None,
                    local: Callable[[str, int], Local] | None = None) -> list[dict[str, Any]]:
        """Each budget's public view with its current window's spend and the room held (``reserved_usd``), the holds
        that hold it for requests in flight (``reservations``: leases) and the age of the oldest renewal.
        ``local(budget id, window start)``: what this process knows better than the ledger yet (``Local``)."""
        out = []
        r, w = BudgetReservation, BudgetWindow
        now = time.time() if now is None else now
        async with self.db.session() as session:
            for b in budgets:
                start, _ = b.window(now)
                # One statement, so one snapshot: the window's sums and its holds as one commit left them.
                rows = (await session.execute(
                    select(w.spent, w.reserved, r.id, r.amount, r.created_ms)
                    .outerjoin(r, (r.budget_id == w.budget_id) & (r.window_start == w.window_start))
                    .where(w.budget_id == b.id, w.window_start == start))).all()
                known = local(b.id, start) if local else Local()
                spent, reserved = (rows[0][0], rows[0][1]) if rows else (0, 0)
                # Holds that hold something for a request in flight: this process's idle leases left out.
                held = [row[4] for row in rows if row[2] is not None and row[3] > known.explained.get(row[2], 0)]
                view = b.public(spent + known.spent, max(0, reserved - known.free), now)
                view["reservations"] = len(held)
                view["oldest_reservation_age_s"] = round(max(0.0, now - min(held) / 1000), 3) if held else None
                out.append(view)
        return out

    def _insert(self) -> Any:
        return pg_insert if self.db.dialect == "postgresql" else sqlite_insert

    async def grow(self, b: BudgetView, start: int, lease: str | None, need: int, chunk: int,
                   amount: int) -> tuple[str, int]:
        """Take ``need`` nano-USD more room for the lease ``lease`` (a new lease when None or gone) in ``b``'s window
        ``start``, and up to ``chunk`` in all, in whole worst cases of ``amount`` (the request's), where a quarter of
        what is then free allows: (its id, the room granted). ``NoRoom`` when not even ``need`` is free. Expired
        holds of that window are released first."""
        ttl_ms = self.reservation_ttl_ms

        def run(connection: Connection) -> tuple[str, int]:
            w, r = BudgetWindow, BudgetReservation
            now_ms = int(time.time() * 1000)
            spent, reserved = _locked_window(connection, b.id, start)
            reserved -= _release_expired(connection, b.id, start, now_ms - ttl_ms)
            free = b.limit_nano - spent - reserved
            if free < need:
                raise NoRoom(spent, reserved)
            # Whole requests' worst cases only: no lease keeps a fragment another replica could have used.
            extra = max(0, min(chunk - need, (free - need) // 4)) // amount * amount
            granted = need + extra
            connection.execute(update(w).where(w.budget_id == b.id, w.window_start == start)
                               .values(reserved=reserved + granted))
            renewed = 0
            if lease is not None:
                renewed = connection.execute(update(r).where(r.id == lease).values(
                    amount=r.amount + granted, created_ms=now_ms)).rowcount
            ident = lease if lease is not None and renewed == 1 else uuid.uuid4().hex
            if ident != lease:
                connection.execute(insert(r).values(id=ident, budget_id=b.id, window_start=start, amount=granted,
                                                    created_ms=now_ms))
            return ident, granted

        return await self.db.write(run)

    async def give_back(self, lease: str, budget: str, start: int, amount: int) -> None:
        """Return ``amount`` of a lease's room to its window (the hold deleted once it holds nothing)."""
        def run(connection: Connection) -> None:
            r, w = BudgetReservation, BudgetWindow
            _locked_window(connection, budget, start)
            left = connection.execute(update(r).where(r.id == lease).values(amount=r.amount - amount)
                                      .returning(r.amount)).first()
            if left is None:
                return  # released for its age meanwhile: its room is back already
            connection.execute(update(w).where(w.budget_id == budget, w.window_start == start)
                               .values(reserved=w.reserved - amount))
            if left[0] <= 0:
                connection.execute(delete(r).where(r.id == lease, r.amount <= 0))

        await self.db.write(run)

    async def renew(self, leases: Iterable[str]) -> None:
        """Mark live leases as renewed now, so that no replica releases them for their age."""
        ids = sorted(leases)
        if not ids:
            return

        def run(connection: Connection) -> None:
            r = BudgetReservation
            for ident in ids:  # one row at a time, in the one order every transaction takes holds in
                connection.execute(update(r).where(r.id == ident).values(created_ms=int(time.time() * 1000)))

        await self.db.write(run)


def _release_expired(connection: Connection, budget: str, start: int, before_ms: int) -> int:
    """Release the window's holds not renewed since ``before_ms`` (each by exactly one transaction: the DELETE returns
    only the rows it removed): the room they held, for the caller to take off ``reserved``."""
    r = BudgetReservation
    gone = connection.execute(delete(r).where(r.budget_id == budget, r.window_start == start,
                                              r.created_ms < before_ms).returning(r.amount)).all()
    if not gone:
        return 0
    amount = sum(a for (a,) in gone)
    log.warning("budget reservations released after their time to live: their replica stopped renewing them",
                extra={"budget": budget, "count": len(gone), "nanousd": amount})
    return int(amount)


def _locked_window(connection: Connection, budget: str, start: int) -> tuple[int, int]:
    """The window's (spent, reserved), made if missing, and locked for the rest of the transaction. Every
    transaction here locks windows before holds (windows in (budget, start) order, holds in id order), so that two
    never wait for each other (PostgreSQL would find the deadlock only after ``deadlock_timeout``, a second)."""
    w = BudgetWindow
    upsert = pg_insert if connection.dialect.name == "postgresql" else sqlite_insert
    connection.execute(upsert(w).values(budget_id=budget, window_start=start, spent=0, reserved=0)
                       .on_conflict_do_nothing())
    row = connection.execute(select(w.spent, w.reserved).where(w.budget_id == budget, w.window_start == start)
                             .with_for_update()).one()
    return int(row[0]), int(row[1])


def apply_charges(connection: Connection, charges: Iterable[Charge]) -> None:
    """Settle ``charges`` in ``connection``'s transaction (the usage writer's, as it inserts their usage rows): each
    hold still there gives up what its requests held (a hold already released for its age frees nothing twice; one
    that reaches 0 is deleted), and the actual costs are added to their windows' spend — one UPDATE per hold and one
    per window, whatever the number of charges; windows locked first, as every transaction here does."""
    w, r = BudgetWindow, BudgetReservation
    held: dict[str, int] = {}
    spent: dict[tuple[str, int], int] = {}
    for c in charges:
        window_key = (c.budget_id, c.window_start)
        spent[window_key] = spent.get(window_key, 0) + c.actual
        if c.hold_id is not None:
            held[c.hold_id] = held.get(c.hold_id, 0) + c.held
    windows = sorted(spent)
    for budget, start in windows:
        _locked_window(connection, budget, start)
    released: dict[tuple[str, int], int] = {}
    for hold, amount in sorted(held.items()):
        row = connection.execute(update(r).where(r.id == hold).values(amount=r.amount - amount)
                                 .returning(r.amount, r.budget_id, r.window_start)).first()
        if row is None:
            continue
        released[(row[1], row[2])] = released.get((row[1], row[2]), 0) + amount
        if row[0] <= 0:
            connection.execute(delete(r).where(r.id == hold, r.amount <= 0))
    for budget, start in windows:
        cost, free = spent[(budget, start)], released.get((budget, start), 0)
        if cost or free:
            connection.execute(update(w).where(w.budget_id == budget, w.window_start == start).values(
                reserved=w.reserved - free, spent=w.spent + cost))
