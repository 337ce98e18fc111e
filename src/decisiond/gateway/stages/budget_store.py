"""Budgets in the database, which every replica shares: the list (``budgets``: each one's scope, limit and period),
read by every request through a short-lived cache, and the spend views of the admin routes. The transactions on
budget windows and holds are the ledger's (``budget_sql.SqlLedger``, behind ``budget_ledger.Ledger``).

A change to the list reaches every process within ``BUDGET_CACHE_S``: the list is read again at most that long after
the last read (and at once on the process that made the change), and each read is told to the listeners
(``listen``): the lease book gives back the room it leased under a limit that was lowered, at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Literal

from sqlalchemy import delete, select

from ...limits import BUDGET_CACHE_S, BUDGET_DB_TIMEOUT_S
from ...store.db import Database, aware
from ...store.dialect import upsert
from ...store.tables import Budget, BudgetReservation, BudgetWindow
from ..access_settings import BudgetConfig
from .budget_ledger import BudgetView, Pending, budget_id, to_nano
from .budget_sql import now_ms


def _view(b: Budget) -> BudgetView:
    return BudgetView(b.id, b.key_id, b.user_path, b.model, b.limit_nanousd, b.period, b.period_seconds, b.source,
                      aware(b.created_at))


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # raised to whoever awaits it (none, for a read beside requests)


class BudgetStore:
    """Budgets and their windows in the database; the list is cached for ``BUDGET_CACHE_S``."""

    def __init__(self, db: Database):
        self.db = db
        self._cache: tuple[float, list[BudgetView]] | None = None
        self._refresh: asyncio.Task[list[BudgetView]] | None = None
        self._listeners: list[Callable[[list[BudgetView]], None]] = []

    def listen(self, listener: Callable[[list[BudgetView]], None]) -> None:
        """Call ``listener(views)`` with each list read from the database, before any request is given it."""
        self._listeners.append(listener)

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
        else:
            for listener in self._listeners:
                listener(views)
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
        statement = upsert(self.db.dialect, Budget, ["id"], list(values),
                           {"id": ident, "created_at": datetime.now(timezone.utc), **values})
        async with self.db.session() as session, session.begin():
            await session.execute(statement)
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

    async def spend_report(self, budgets: list[BudgetView], now: float | None = None,
                    pending: Callable[[str, int], Pending] | None = None) -> list[dict[str, Any]]:
        """Each budget's public view with its current window's spend and the room held (``reserved_usd``), the holds
        that hold it for requests in flight (``reservations``: leases) and the age of the oldest renewal.
        ``pending(budget id, window start)``: what this process knows better than the ledger yet (``Pending``)."""
        out = []
        r, w = BudgetReservation, BudgetWindow
        now = time.time() if now is None else now
        async with self.db.session() as session:
            for b in budgets:
                start, _ = b.window(now)
                # One statement, so one snapshot: the window's sums and its holds as one commit left them.
                rows = (await session.execute(
                    select(w.spent, w.reserved, r.id, r.amount, r.created_ms, now_ms(self.db.dialect))
                    .outerjoin(r, (r.budget_id == w.budget_id) & (r.window_start == w.window_start))
                    .where(w.budget_id == b.id, w.window_start == start))).all()
                known = pending(b.id, start) if pending else Pending()
                spent, reserved = (rows[0][0], rows[0][1]) if rows else (0, 0)
                # Holds that hold something for a request in flight: this process's idle leases left out.
                held = [row[4] for row in rows if row[2] is not None and row[3] > known.explained.get(row[2], 0)]
                view = b.public(spent + known.spent, max(0, reserved - known.free), now)
                view["reservations"] = len(held)
                clock = rows[0][5] / 1000 if rows else now  # hold ages are the database's clock
                view["oldest_reservation_age_s"] = round(max(0.0, clock - min(held) / 1000), 3) if held else None
                out.append(view)
        return out
