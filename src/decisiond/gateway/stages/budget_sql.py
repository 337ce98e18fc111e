"""The budgets' ledger in the SQL database (``budget_ledger.Ledger``): ``budget_windows`` (each window's ``spent``
and ``reserved``) and ``budget_reservations`` (the holds: one a lease, with its amount, its holder and when it was
last renewed, by the database's clock).

Every transaction here keeps the ledger's invariant (``reserved`` is the sum of the window's holds) and takes its
locks in one order: windows first, in (budget, start) order, then holds, in id order, so that no two wait for each
other (PostgreSQL would find the deadlock only after ``deadlock_timeout``, a second). A hold is granted only under the
limit the ``budgets`` row has in the same transaction, so a lowered limit binds every growth at once. Hold ages are
the database's clock (``now_ms``): replicas' clocks may differ, the database's is one.

``apply_charges`` settles requests in the usage writer's transaction (the one that inserts their usage rows):
each request's worst case leaves its hold and the window's ``reserved``, its real cost is added to ``spent``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, insert, literal_column, select, update
from sqlalchemy.engine import Connection

from ...store.db import Database
from ...store.dialect import insert_ignoring_conflict
from ...store.tables import Budget, BudgetReservation, BudgetWindow
from ..types import Charge
from .budget_ledger import BudgetGone, BudgetView, Grant, NoRoom

log = logging.getLogger("decisiond.budgets")

# Windows one purge looks at, at most (the rest at the next).
PURGE_WINDOWS = 500


def now_ms(dialect: str) -> Any:
    """The database's clock, in Unix milliseconds, as an SQL expression."""
    if dialect == "postgresql":
        return literal_column("CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
    return literal_column("CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)")


class SqlLedger:
    """``budget_ledger.Ledger`` on the gateway's database."""

    def __init__(self, db: Database, ttl_s: float):
        self.db = db
        self.ttl_s = ttl_s
        self.ttl_ms = int(ttl_s * 1000)

    async def grow(self, budget: BudgetView, start: int, hold: str | None, new_hold: str, need: int, chunk: int,
                   amount: int, holder: str) -> Grant:
        ttl_ms = self.ttl_ms

        def run(connection: Connection) -> Grant | NoRoom:
            limit = connection.execute(select(Budget.limit_nanousd).where(Budget.id == budget.id)).scalar()
            if limit is None:
                raise BudgetGone(budget.id)
            spent, reserved = _locked_window(connection, budget.id, start)
            reserved -= _release_expired(connection, budget.id, start, ttl_ms)
            free = limit - spent - reserved
            if free < need:  # returned, not raised: the expired holds released above are committed
                return NoRoom(spent, reserved, limit)
            # Whole requests' worst cases only: no lease keeps a fragment another replica could have used.
            granted = need + max(0, min(chunk - need, (free - need) // 4)) // amount * amount
            w, r, now = BudgetWindow, BudgetReservation, now_ms(connection.dialect.name)
            connection.execute(update(w).where(w.budget_id == budget.id, w.window_start == start)
                               .values(reserved=reserved + granted))
            if hold is not None:
                row = connection.execute(update(r).where(r.id == hold).values(
                    amount=r.amount + granted, created_ms=now).returning(r.amount)).first()
                if row is not None:
                    return Grant(hold, int(row[0]), granted, False)
            connection.execute(insert(r).values(id=new_hold, budget_id=budget.id, window_start=start, amount=granted,
                                                holder=holder, created_ms=now))
            return Grant(new_hold, granted, granted, True)

        out = await self.db.write(run)
        if isinstance(out, NoRoom):
            raise out
        return out

    async def give_back(self, hold: str, budget: str, start: int, amount: int) -> int | None:
        def run(connection: Connection) -> int | None:
            r, w = BudgetReservation, BudgetWindow
            _locked_window(connection, budget, start)
            row = connection.execute(select(r.amount).where(r.id == hold).with_for_update()).first()
            if row is None:
                return None  # released meanwhile (its age, its budget changed): its room is back already
            taken = max(0, min(amount, int(row[0])))
            left = int(row[0]) - taken
            if left > 0:
                connection.execute(update(r).where(r.id == hold).values(amount=left))
            else:
                connection.execute(delete(r).where(r.id == hold))
            connection.execute(update(w).where(w.budget_id == budget, w.window_start == start)
                               .values(reserved=w.reserved - taken))
            return left

        return await self.db.write(run)

    async def renew(self, holds: Sequence[tuple[str, str, int]]) -> set[str]:
        if not holds:
            return set()

        def run(connection: Connection) -> set[str]:
            w, r, now = BudgetWindow, BudgetReservation, now_ms(connection.dialect.name)
            for budget, start in sorted({(b, s) for _, b, s in holds}):
                connection.execute(select(w.spent).where(w.budget_id == budget, w.window_start == start)
                                   .with_for_update())
            there = set()
            for ident in sorted(h for h, _, _ in holds):
                if connection.execute(update(r).where(r.id == ident).values(created_ms=now)).rowcount:
                    there.add(ident)
            return there

        return await self.db.write(run)

    async def read(self, budget: str, start: int, holds: Sequence[str]) -> dict[str, int]:
        def run(connection: Connection) -> dict[str, int]:
            r = BudgetReservation
            _locked_window(connection, budget, start)  # waits for a transaction of ours still on it
            rows = connection.execute(select(r.id, r.amount).where(r.id.in_(list(holds)))).all()
            return {str(ident): int(amount) for ident, amount in rows}

        return await self.db.write(run) if holds else {}

    async def holders(self, machine: str) -> list[str]:
        r = BudgetReservation
        async with self.db.session() as session:
            found = (await session.scalars(select(r.holder).distinct().where(
                r.holder.startswith(machine + ":", autoescape=True)))).all()
        return sorted(h for h in found if h is not None)

    async def release(self, holders: Sequence[str]) -> int:
        r, dead = BudgetReservation, sorted(holders)
        if not dead:
            return 0

        def run(connection: Connection) -> int:
            held = connection.execute(select(r.budget_id, r.window_start).distinct()
                                      .where(r.holder.in_(dead))).all()
            for budget, start in sorted((str(b), int(s)) for b, s in held):
                _locked_window(connection, budget, start)
            rows = connection.execute(delete(r).where(r.holder.in_(dead))
                                      .returning(r.budget_id, r.window_start, r.amount)).all()
            return _unreserve(connection, rows)

        room = await self.db.write(run)
        log.warning("budget reservations of stopped processes on this host released",
                    extra={"holders": len(dead), "nanousd": room})
        return room

    async def purge(self, current: dict[str, int]) -> None:
        ttl_ms = self.ttl_ms

        def run(connection: Connection) -> None:
            w, r = BudgetWindow, BudgetReservation
            known = set(connection.scalars(select(Budget.id)).all())
            windows = connection.execute(select(w.budget_id, w.window_start).order_by(w.budget_id, w.window_start)
                                         .limit(PURGE_WINDOWS * 4)).all()
            past = [(str(b), int(s)) for b, s in windows
                    if b not in known or (b in current and s < current[b])][:PURGE_WINDOWS]
            for budget, start in past:
                _locked_window(connection, budget, start)
                if budget in known:
                    _release_expired(connection, budget, start, ttl_ms)
                else:
                    connection.execute(delete(r).where(r.budget_id == budget, r.window_start == start))
                if connection.execute(select(r.id).where(r.budget_id == budget, r.window_start == start)
                                      .limit(1)).first() is None:
                    connection.execute(delete(w).where(w.budget_id == budget, w.window_start == start))

        await self.db.write(run)


def _unreserve(connection: Connection, rows: Iterable[Any]) -> int:
    """Take the amounts of deleted holds ``rows`` (budget, window start, amount) off their windows' ``reserved``."""
    w = BudgetWindow
    sums: dict[tuple[str, int], int] = {}
    for budget, start, amount in rows:
        sums[(str(budget), int(start))] = sums.get((str(budget), int(start)), 0) + int(amount)
    for (budget, start), amount in sorted(sums.items()):
        connection.execute(update(w).where(w.budget_id == budget, w.window_start == start)
                           .values(reserved=w.reserved - amount))
    return sum(sums.values())


def _release_expired(connection: Connection, budget: str, start: int, ttl_ms: int) -> int:
    """Release the window's holds not renewed for ``ttl_ms`` by the database's clock (each by exactly one
    transaction: the DELETE returns only the rows it removed); the room they held, for the caller to take off
    ``reserved``. The window is locked by the caller."""
    r = BudgetReservation
    gone = connection.execute(delete(r).where(
        r.budget_id == budget, r.window_start == start,
        r.created_ms < now_ms(connection.dialect.name) - ttl_ms).returning(r.amount)).all()
    if not gone:
        return 0
    amount = sum(int(a) for (a,) in gone)
    connection.execute(update(BudgetWindow).where(BudgetWindow.budget_id == budget,
                                                  BudgetWindow.window_start == start)
                       .values(reserved=BudgetWindow.reserved - amount))
    log.warning("budget reservations released after their time to live: their replica stopped renewing them",
                extra={"budget": budget, "count": len(gone), "nanousd": amount})
    return amount


def _locked_window(connection: Connection, budget: str, start: int) -> tuple[int, int]:
    """The window's (spent, reserved), made if missing, and locked for the rest of the transaction."""
    w = BudgetWindow
    connection.execute(insert_ignoring_conflict(connection.dialect.name, w, {
        "budget_id": budget, "window_start": start, "spent": 0, "reserved": 0}))
    row = connection.execute(select(w.spent, w.reserved).where(w.budget_id == budget, w.window_start == start)
                             .with_for_update()).one()
    return int(row[0]), int(row[1])


def apply_charges(connection: Connection, charges: Iterable[Charge]) -> None:
    """Settle ``charges`` in ``connection``'s transaction (the usage writer's, as it inserts their usage rows): each
    hold still there gives up what its requests held, never more than it has (a hold already released frees nothing
    twice; one that reaches 0 is deleted), and the actual costs are added to their windows' spend — one UPDATE per
    hold and one per window, whatever the number of charges; windows locked first."""
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
        left, key = int(row[0]), (str(row[1]), int(row[2]))
        released[key] = released.get(key, 0) + amount + min(0, left)  # never more than the hold had
        if left <= 0:
            connection.execute(delete(r).where(r.id == hold))
    for budget, start in windows:
        cost, free = spent[(budget, start)], released.get((budget, start), 0)
        if cost or free:
            connection.execute(update(w).where(w.budget_id == budget, w.window_start == start).values(
                reserved=w.reserved - free, spent=w.spent + cost))
