"""Budgets: USD spending limits per key, per user-path subtree and per model, per UTC calendar hour/day/week/month
or per ``period_seconds`` (windows aligned on the Unix epoch), held in the database so replicas share them.

The ``BudgetStage`` runs after the rate limits and before the router. For every budget that applies to the
request (a budget on a model applies to every request that model may answer, under any name) it *reserves* the
most the request can cost: for the dearest target the model may route to (for a cascade, the dearest of each step,
summed), its input tokens (counted by the
model's tokenizer when it runs here, else bounded by the request's bytes: ``sizes.max_input_tokens``) plus the
output the request can still produce (its ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``,
else the model's ``max_output_tokens``), priced by the same rules as the bill (``pricing.cost``). One conditional
UPDATE per budget, in one transaction::

    UPDATE budget_windows SET reserved = reserved + :cost
     WHERE budget_id = :id AND window_start = :w AND spent + reserved + :cost <= :limit AND spent + reserved < :limit

then a row in ``budget_reservations``. 0 rows updated means the budget has no room: the transaction is rolled back
and the request refused with 402 ``budget_exceeded`` before any provider is called. PostgreSQL re-checks the WHERE
clause on the row a concurrent transaction just committed; SQLite serialises writers — so of N concurrent requests
only those that fit pass, on one replica or many. When the request ends, its charges (``types.Charge``: each reservation
to release, the real cost to add: its answer's price, what a stream relayed, an answer billed although it failed its
check; 0 for a failure) ride on its usage record: the usage writer applies them (``apply_charges``) in the
transaction that inserts the row, so each request is settled exactly once, from the journal after a crash too.
Amounts are integers in nano-USD, so they add up exactly.

The guarantee: spend never passes a limit by more than the sum, over the requests in flight together, of what each
was billed above its reservation — nothing while upstreams bill within what their requests allowed.

A reservation that is never settled (its replica was killed before the request's record was journaled) would hold
its room for ever; each is a row with its time, and one older than ``budget_reservation_ttl_s`` is released
(deleted with ``RETURNING``, so by exactly one replica) by the next request that reserves on that budget. A
settlement that finds its reservation already released adds only the cost.

The stage decides or refuses: a reservation not made within ``BUDGET_DB_TIMEOUT_S`` or any other failure to decide
is 503 ``budget_unavailable`` (a reservation that commits after its request gave up is released at once). Only for
a database that is really down (``store.db.transient`` and no answer to ``SELECT 1``) does
``budgets_when_database_down`` apply: ``admit`` (default) lets the request through unchecked — logged, its outcome
``unchecked: database unavailable`` — and charges it when the database is back; ``refuse`` answers 503.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Literal

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from ...canonical import DecisionRequest, Usage
from ...errors import BudgetExceeded, DecisionError, Unavailable, one_line
from ...limits import BUDGET_CACHE_S, BUDGET_DB_TIMEOUT_S, BUDGET_RESERVATION_TTL_S
from ...store.db import Database, transient
from ...store.tables import Budget, BudgetReservation, BudgetWindow
from .. import pricing
from ..router import Router
from ..settings import BudgetConfig, in_subtree
from ..sizes import max_input_tokens, max_output_tokens
from ..types import Caller, Charge, Context, Next

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


@dataclass
class Reservation:
    """What one request holds on its budgets: one hold per budget window (``hold_id`` None for a request admitted
    unchecked while the database was down: it holds nothing, and is charged all the same)."""

    holds: list[Hold] = field(default_factory=list)

    def charges(self, actual: int) -> list[Charge]:
        """What the request owes once it cost ``actual`` nano-USD: each hold released, ``actual`` spent in each."""
        return [Charge(h.budget_id, h.window_start, h.id, h.amount, actual) for h in self.holds]


@dataclass(frozen=True)
class Hold:
    id: str | None
    budget_id: str
    window_start: int
    amount: int


class BudgetStore:
    """Budgets and their windows in the database; the list is cached for ``BUDGET_CACHE_S``."""

    def __init__(self, db: Database, reservation_ttl_s: float = BUDGET_RESERVATION_TTL_S):
        self.db = db
        self.reservation_ttl_ms = int(reservation_ttl_s * 1000)
        self._cache: tuple[float, list[BudgetView]] | None = None
        self._late: set[asyncio.Task[None]] = set()

    async def budgets(self) -> list[BudgetView]:
        now = time.monotonic()
        if self._cache is not None and self._cache[0] > now:
            return self._cache[1]
        try:
            async with self.db.session() as session:
                rows = (await asyncio.wait_for(session.execute(select(Budget).order_by(Budget.id)),
                                               BUDGET_DB_TIMEOUT_S)).scalars()
                views = [_view(b) for b in rows]
        except Exception:
            if self._cache is None:
                raise
            views = self._cache[1]  # the database is down: keep the last list known
        self._cache = (now + BUDGET_CACHE_S, views)
        return views

    async def put(self, config: BudgetConfig, source: Literal["config", "admin"]) -> BudgetView:
        ident = budget_id(config)
        values = {"key_id": config.key, "user_path": config.user_path, "model": config.model,
                  "limit_nanousd": to_nano(config.limit_usd), "period": config.period,
                  "period_seconds": config.period_seconds, "source": source}
        async with self.db.session() as session, session.begin():
            existing = await session.get(Budget, ident)
            if existing is None:
                session.add(Budget(id=ident, created_at=datetime.now(timezone.utc), **values))
            else:
                for k, v in values.items():
                    setattr(existing, k, v)
        self._cache = None
        return BudgetView(ident, config.key, config.user_path, config.model, to_nano(config.limit_usd),
                          config.period, config.period_seconds, source)

    async def delete(self, ident: str) -> bool:
        async with self.db.session() as session, session.begin():
            result = await session.execute(delete(Budget).where(Budget.id == ident))
            await session.execute(delete(BudgetWindow).where(BudgetWindow.budget_id == ident))
            await session.execute(delete(BudgetReservation).where(BudgetReservation.budget_id == ident))
        self._cache = None
        return bool(getattr(result, "rowcount", 0))

    async def spend(self, budgets: list[BudgetView], now: float | None = None) -> list[dict[str, Any]]:
        """Each budget's public view with its current window's spend, and its reservations in flight (how many, and
        the age of the oldest)."""
        out = []
        r, w = BudgetReservation, BudgetWindow
        now = time.time() if now is None else now
        async with self.db.session() as session:
            for b in budgets:
                start, _ = b.window(now)
                # One statement, so one snapshot: the window's sums and its holds as one commit left them.
                holds = select(func.count(), func.min(r.created_ms)).where(r.budget_id == b.id,
                                                                          r.window_start == start).subquery()
                spent = select(w.spent).where(w.budget_id == b.id, w.window_start == start).scalar_subquery()
                reserved = select(w.reserved).where(w.budget_id == b.id, w.window_start == start).scalar_subquery()
                row = (await session.execute(select(spent, reserved, *holds.c))).one()
                view = b.public(row[0] or 0, row[1] or 0, now)
                view["reservations"] = int(row[2])
                view["oldest_reservation_age_s"] = round(max(0.0, now - row[3] / 1000), 3) if row[3] else None
                out.append(view)
        return out

    def _insert(self) -> Any:
        return pg_insert if self.db.dialect == "postgresql" else sqlite_insert

    async def reserve(self, budgets: list[BudgetView], amount: int) -> Reservation:
        """Reserve ``amount`` nano-USD in every budget, all or none; 402 naming the first without room. Expired
        reservations of these budgets are released first."""
        reservation = Reservation()
        now = time.time()
        insert = self._insert()
        w = BudgetWindow
        async with self.db.session() as session, session.begin():
            for b in sorted(budgets, key=lambda b: b.id):  # one lock order: no deadlock between requests
                start, end = b.window(now)
                await session.execute(insert(BudgetWindow).values(budget_id=b.id, window_start=start, spent=0,
                                                                  reserved=0).on_conflict_do_nothing())
                await self._release_expired(session, b.id, int(now * 1000))
                result = await session.execute(
                    update(w).where(w.budget_id == b.id, w.window_start == start,
                                    w.spent + w.reserved + amount <= b.limit_nano, w.spent + w.reserved < b.limit_nano)
                    .values(reserved=w.reserved + amount))
                if getattr(result, "rowcount", 0) != 1:
                    row = (await session.execute(select(w.spent, w.reserved).where(
                        w.budget_id == b.id, w.window_start == start))).one()
                    raise budget_exceeded(b, row.spent, row.reserved, amount, int(end - now))
                ident = uuid.uuid4().hex
                session.add(BudgetReservation(id=ident, budget_id=b.id, window_start=start, amount=amount,
                                              created_ms=int(now * 1000)))
                reservation.holds.append(Hold(ident, b.id, start, amount))
        return reservation

    async def reserve_within(self, budgets: list[BudgetView], amount: int, timeout: float) -> Reservation:
        """``reserve``, given up after ``timeout`` seconds (``TimeoutError``) or when the caller is cancelled. The
        transaction is not cancelled with it — it may already be committing — so a reservation that commits after
        its caller has gone is released by this store as soon as it exists."""
        task = asyncio.ensure_future(self.reserve(budgets, amount))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_late)
            raise
        if task not in done:
            task.add_done_callback(self._release_late)
            raise TimeoutError(f"no budget reservation within {timeout:g} s")
        return task.result()

    def _release_late(self, task: asyncio.Future[Reservation]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        release = asyncio.ensure_future(self.release(task.result()))
        self._late.add(release)
        release.add_done_callback(self._late.discard)

    async def release(self, reservation: Reservation) -> None:
        """Give back a reservation whose request never ran (its holds deleted, their room freed)."""
        try:
            async with self.db.session() as session, session.begin():
                await apply_charges(session, reservation.charges(0))
            log.warning("a budget reservation committed after its request had given up on it: released",
                        extra={"holds": len(reservation.holds)})
        except Exception as error:
            log.error("a late budget reservation could not be released; it is released after its time to live",
                      extra={"error": one_line(error)})

    async def _release_expired(self, session: Any, budget: str, now_ms: int) -> None:
        """Release this budget's reservations older than their time to live (each by exactly one transaction: the
        DELETE returns only the rows it removed)."""
        r = BudgetReservation
        gone = (await session.execute(delete(r).where(r.budget_id == budget,
                                                      r.created_ms < now_ms - self.reservation_ttl_ms)
                                      .returning(r.window_start, r.amount))).all()
        if not gone:
            return
        log.warning("budget reservations released after their time to live: their requests never settled",
                    extra={"budget": budget, "count": len(gone), "nanousd": sum(a for _, a in gone)})
        by_window: dict[int, int] = {}
        for start, amount in gone:
            by_window[start] = by_window.get(start, 0) + amount
        w = BudgetWindow
        for start, amount in by_window.items():
            await session.execute(update(w).where(w.budget_id == budget, w.window_start == start)
                                  .values(reserved=w.reserved - amount))


async def apply_charges(session: Any, charges: Iterable[Charge]) -> None:
    """Settle ``charges`` in ``session``'s transaction (the usage writer's, as it inserts their usage rows): each
    hold still held is released (a hold already released for its age frees nothing twice), and the actual costs are
    added to their windows' spend — one UPDATE per window, whatever the number of charges."""
    w, r = BudgetWindow, BudgetReservation
    released: dict[tuple[str, int], int] = {}
    spent: dict[tuple[str, int], int] = {}
    for c in charges:
        window = (c.budget_id, c.window_start)
        spent[window] = spent.get(window, 0) + c.actual
        if c.hold_id is not None:
            removed = await session.execute(delete(r).where(r.id == c.hold_id))
            if getattr(removed, "rowcount", 0) == 1:
                released[window] = released.get(window, 0) + c.held
    insert = pg_insert if session.bind.dialect.name == "postgresql" else sqlite_insert
    for (budget, start), amount in sorted(spent.items()):  # one lock order across writers
        free = released.get((budget, start), 0)
        if not amount and not free:
            continue
        await session.execute(insert(BudgetWindow).values(budget_id=budget, window_start=start, spent=0,
                                                          reserved=0).on_conflict_do_nothing())
        await session.execute(update(w).where(w.budget_id == budget, w.window_start == start).values(
            reserved=w.reserved - free, spent=w.spent + amount))


def budget_exceeded(b: BudgetView, spent: int, reserved: int, amount: int, resets_in: int) -> DecisionError:
    in_flight = f" (${reserved / NANO:.6f} more reserved by requests in flight)" if reserved else ""
    return BudgetExceeded(
        f"The budget of {b.scope} is spent: ${spent / NANO:.6f} of its ${b.limit_nano / NANO:.6f} limit per "
        f"{b.per} used{in_flight}; this request would cost about ${amount / NANO:.6f}. It resets in {resets_in} s.",
        headers={"retry-after": str(max(1, resets_in))})


class BudgetStage:
    """Reserve before the call, settle after (see the module docstring)."""

    name = "budget"

    def __init__(self, store_of: Any, router: Router, when_down: Literal["admit", "refuse"] = "admit"):
        # ``store_of()`` → the BudgetStore, or None before the database is open (no budgets then).
        self.store_of = store_of
        self.router = router
        self.when_down = when_down

    async def worst_case(self, context: Context, request: Any) -> int:
        """The most ``request`` can cost on any target its model may route to (see the module docstring); for a
        cascade, every step's worst case summed (every question may escalate to the last step)."""
        return await self._worst(context.resolved_model, request) if context.resolved_model else 0

    async def _worst(self, name: str, request: Any) -> int:
        steps = self.router.cascade_steps(name)
        if steps is not None:  # a step asks a subset of the questions: the whole request bounds its cost
            return sum([await self._worst(self.router.canonical(step) or step, request) for step in steps])
        worst = 0
        for t in self.router.chain(name):
            if t.price is None:
                continue
            counted = await t.provider.input_tokens(request) if isinstance(request, DecisionRequest) else None
            usage = Usage(input_tokens=counted if counted is not None else max_input_tokens(request),
                          output_tokens=max_output_tokens(request, t.max_output_tokens))
            worst = max(worst, to_nano(pricing.cost(t.price, usage, pricing.billed_as(request, t.provider.format))))
        return worst

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        store: BudgetStore | None = self.store_of()
        if store is None:
            return await call_next(context, request)
        try:
            budgets = [b for b in await store.budgets()
                       if b.applies(context.caller, self.router.policy_names(context.resolved_model or ""))]
            if not budgets:
                return await call_next(context, request)
            amount = await self.worst_case(context, request)
        except DecisionError:
            raise
        except Exception as error:  # no budget list, or no worst case (a tokenizer's error): nothing to decide on
            raise self._undecided(context, error, "budgets cannot be checked") from None
        try:
            reservation = await store.reserve_within(budgets, amount, BUDGET_DB_TIMEOUT_S)
        except DecisionError:
            raise
        except Exception as error:
            if self.when_down == "refuse" or not await _down(store, error):
                raise self._undecided(context, error, "budgets not reserved") from None
            log.warning("budgets not checked: the database is unavailable; the request is charged when it returns",
                        extra={"request_id": context.request_id, "error": one_line(error)[:300]})
            context.outcomes[self.name] = "unchecked: database unavailable (charged when it returns)"
            reservation = Reservation([Hold(None, b.id, b.window()[0], 0) for b in budgets])
        try:
            return await call_next(context, request)
        finally:
            # What it cost (its answer's price, what a stream relayed before its client left, an answer that
            # failed its check; 0 for a failure), settled with its usage row by the usage writer.
            context.charges = reservation.charges(to_nano(context.cost or 0.0))

    def _undecided(self, context: Context, error: Exception, what: str) -> DecisionError:
        """503 for a budget stage that could not decide: never admitted unchecked, never admitted for free."""
        log.warning(f"{what}: the request is refused", extra={
            "request_id": context.request_id, "error": one_line(error)[:300], "when_down": self.when_down})
        return Unavailable("Budgets cannot be checked right now. Retry shortly.", code="budget_unavailable",
                           headers={"retry-after": "5"})


async def _down(store: BudgetStore, error: Exception) -> bool:
    """Whether ``error`` is the database being down (a connection that fails, a ``SELECT 1`` unanswered), as
    opposed to a database that answers but was too slow or refused this transaction."""
    return transient(error) and not await store.db.reachable(BUDGET_DB_TIMEOUT_S)
