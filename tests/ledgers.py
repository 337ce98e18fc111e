"""Ledgers for the lease book's tests (``budget_ledger.Ledger``), and the ways they fail.

- ``MemoryLedger``: the ledger's contract in memory, with a clock the test moves.
- ``Faults``: what the next calls do, by operation: ``lose`` (applied, then the acknowledgement is lost: a
  ``ConnectionResetError``), ``fail`` (not applied, the same error), ``stall`` (applied only once the test lets it go,
  whatever became of its caller: a commit that runs on after its caller was cancelled).
- ``FaultyDatabase``: the same faults on a real ``Database.write`` (SQLite: the transaction runs in a thread that a
  cancelled caller does not stop; a stall holds the transaction open until let go).
- ``Writer``: the usage writer's part: each request's charges as a record with an id, written once; a retry that
  finds its records there reports them dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from decisiond.gateway.stages.budget_ledger import BudgetGone, BudgetView, Grant, NoRoom
from decisiond.gateway.types import Charge


class Lost(ConnectionResetError):
    """The acknowledgement of a commit, lost (or a transaction cut before it)."""


@dataclass
class Faults:
    plan: list[tuple[str, str]] = field(default_factory=list)  # (operation, mode), taken in order
    go: threading.Event = field(default_factory=threading.Event)  # lets stalled calls finish
    stalled: list[Any] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)

    def take(self, operation: str) -> str | None:
        self.seen[operation] += 1
        for i, (op, mode) in enumerate(self.plan):
            if op in (operation, "any"):
                del self.plan[i]
                return mode
        return None

    async def run(self, operation: str, apply: Callable[[], Any]) -> Any:
        mode = self.take(operation)
        if mode == "fail":
            raise Lost(f"{operation}: connection lost before the commit")
        if mode == "stall":  # applied once let go, whatever became of the caller
            task = asyncio.ensure_future(asyncio.to_thread(lambda: (self.go.wait(30), apply())[1]))
            self.stalled.append(task)
            return await asyncio.shield(task)
        out = apply()
        if mode == "slow":  # applied now, answered once let go
            await self.hold_reply()
        if mode == "lose":
            raise Lost(f"{operation}: the reply to COMMIT was lost")
        return out

    async def hold_reply(self) -> None:
        waiting = asyncio.ensure_future(asyncio.to_thread(self.go.wait, 30))
        self.stalled.append(waiting)
        await waiting


@dataclass
class MemHold:
    budget: str
    start: int
    amount: int
    renewed: float
    holder: str


class MemoryLedger:
    """``budget_ledger.Ledger`` in memory; ``now()`` is its clock (seconds)."""

    def __init__(self, ttl_s: float = 15.0, now: Callable[[], float] = lambda: 0.0):
        self.ttl_s = ttl_s
        self.now = now
        self.faults = Faults()
        self.limits: dict[str, int] = {}
        self.windows: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])  # [spent, reserved]
        self.holds: dict[str, MemHold] = {}
        self.records: set[str] = set()
        self.lock = threading.Lock()

    # the contract

    async def grow(self, budget: BudgetView, start: int, hold: str | None, new_hold: str, need: int, chunk: int,
                   amount: int, holder: str) -> Grant:
        def apply() -> Grant:
            with self.lock:
                limit = self.limits.get(budget.id)
                if limit is None:
                    raise BudgetGone(budget.id)
                w = self.windows[(budget.id, start)]
                self._release_expired(budget.id, start)
                free = limit - w[0] - w[1]
                if free < need:
                    raise NoRoom(w[0], w[1], limit)
                granted = need + max(0, min(chunk - need, (free - need) // 4)) // amount * amount
                w[1] += granted
                if hold is not None and hold in self.holds:
                    h = self.holds[hold]
                    h.amount += granted
                    h.renewed = self.now()
                    return Grant(hold, h.amount, granted, False)
                self.holds[new_hold] = MemHold(budget.id, start, granted, self.now(), holder)
                return Grant(new_hold, granted, granted, True)

        return await self.faults.run("grow", apply)

    async def give_back(self, hold: str, budget: str, start: int, amount: int) -> int | None:
        def apply() -> int | None:
            with self.lock:
                h = self.holds.get(hold)
                if h is None:
                    return None
                taken = min(amount, h.amount)
                h.amount -= taken
                self.windows[(budget, start)][1] -= taken
                if h.amount <= 0:
                    del self.holds[hold]
                return h.amount

        return await self.faults.run("give_back", apply)

    async def renew(self, holds: Sequence[tuple[str, str, int]]) -> set[str]:
        def apply() -> set[str]:
            with self.lock:
                there = {ident for ident, _, _ in holds if ident in self.holds}
                for ident in there:
                    self.holds[ident].renewed = self.now()
                return there

        return await self.faults.run("renew", apply)

    async def read(self, budget: str, start: int, holds: Sequence[str]) -> dict[str, int]:
        # Under the window's lock: a call still under way (stalled) finishes first.
        await asyncio.gather(*self.faults.stalled, return_exceptions=True)
        with self.lock:
            return {ident: self.holds[ident].amount for ident in holds if ident in self.holds}

    async def holders(self, machine: str) -> list[str]:
        with self.lock:
            return sorted({h.holder for h in self.holds.values() if h.holder.startswith(machine + ":")})

    async def release(self, holders: Sequence[str]) -> int:
        def apply() -> int:
            with self.lock:
                dead = [ident for ident, h in self.holds.items() if h.holder in holders]
                return sum(self._release(ident) for ident in dead)

        return await self.faults.run("release", apply)

    async def purge(self, current: dict[str, int]) -> None:
        return None

    # the usage writer's part

    async def write(self, records: list[tuple[str, list[Charge]]]) -> tuple[list[Charge], list[Charge]]:
        """Insert the records not there yet and apply their charges; (applied, dropped)."""
        def apply() -> tuple[list[Charge], list[Charge]]:
            with self.lock:
                applied: list[Charge] = []
                dropped: list[Charge] = []
                for ident, charges in records:
                    (dropped if ident in self.records else applied).extend(charges)
                    self.records.add(ident)
                for c in applied:
                    self.windows[(c.budget_id, c.window_start)][0] += c.actual
                    h = self.holds.get(c.hold_id) if c.hold_id is not None else None
                    if h is not None:
                        taken = min(c.held, h.amount)
                        h.amount -= taken
                        self.windows[(c.budget_id, c.window_start)][1] -= taken
                        if h.amount <= 0:
                            del self.holds[c.hold_id]  # type: ignore[arg-type]
                return applied, dropped

        return await self.faults.run("write", apply)

    # what the tests look at

    def _release_expired(self, budget: str, start: int) -> None:
        for ident, h in list(self.holds.items()):
            if h.budget == budget and h.start == start and h.renewed < self.now() - self.ttl_s:
                self._release(ident)

    def _release(self, ident: str) -> int:
        h = self.holds.pop(ident)
        self.windows[(h.budget, h.start)][1] -= h.amount
        return h.amount

    def consistent(self) -> None:
        """The ledger's invariant: each window's ``reserved`` is the sum of its holds, none negative."""
        sums: dict[tuple[str, int], int] = defaultdict(int)
        for h in self.holds.values():
            assert h.amount > 0, h
            sums[(h.budget, h.start)] += h.amount
        for key, (spent, reserved) in self.windows.items():
            assert reserved == sums.get(key, 0), (key, reserved, sums.get(key, 0))


class Writer:
    """One process's usage writer on a ledger with ``write(records)`` (``MemoryLedger``): what its requests settled,
    written in batches, each batch retried whole until it goes through."""

    def __init__(self, ledger: Any, book: Any):
        self.ledger, self.book = ledger, book
        self.pending: list[tuple[str, list[Charge]]] = []
        self.count = 0

    def add(self, charges: list[Charge], ident: str | None = None) -> None:
        self.count += 1
        self.pending.append((ident or f"{id(self)}-{self.count}", charges))

    async def flush(self, tries: int = 20) -> None:
        batch, self.pending = self.pending, []
        for _ in range(tries):
            try:
                async with self.book.settling:
                    applied, dropped = await self.ledger.write(batch)
                    self.book.written(applied)
                    self.book.dropped(dropped)
                return
            except Lost:
                await asyncio.sleep(0)
        raise AssertionError("the writer never got through")
