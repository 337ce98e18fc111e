"""What one process believes of its budget holds (``budget_leases.LeaseBook`` keeps them): each lease's room and how
long it may be used (``Lease``), and the charges its requests settled that the usage writer has not written to the
ledger yet (``Unwritten``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from ..types import Charge
from .budget_ledger import BudgetView


@dataclass
class Lease:
    """This process's room in one budget window: ``room`` nano-USD of the hold ``id`` not carved out by a request,
    usable while ``valid_until`` (monotonic) is ahead and the lease is not ``doubtful``."""

    budget: BudgetView
    start: int
    id: str | None = None
    room: int = 0
    last_growth: int = 0
    used_at: float = 0.0
    chunk_requests: int = 0
    # Used since ``maintain`` last looked: a lease is idle only when a turn of ``maintain`` finds it unused.
    used: bool = False
    valid_until: float = 0.0
    doubtful: bool = False
    unknown: set[str] = field(default_factory=set)  # holds a call with an unknown outcome may have made
    recalls: int = 0  # counts the times its room was taken back (a growth under way then is taken back too)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    growing: asyncio.Future[None] | None = None

    def usable(self, clock: float) -> bool:
        return not self.doubtful and clock < self.valid_until

    def drop(self) -> None:
        """Its hold is gone: no room, no hold."""
        self.id, self.room, self.valid_until, self.chunk_requests = None, 0, 0.0, 0


class Unwritten:
    """The charges not written yet: counted by charge, summed by window (the spend and holds the ledger does not show
    yet) and by hold (what each hold still holds for them)."""

    def __init__(self) -> None:
        self._charges: Counter[Charge] = Counter()
        self._windows: dict[tuple[str, int], tuple[int, int]] = {}
        self._holds: Counter[str] = Counter()

    def add(self, charges: list[Charge]) -> None:
        for c in charges:
            self._charges[c] += 1
            self._windows[(c.budget_id, c.window_start)] = _plus(self._windows.get((c.budget_id, c.window_start)), c)
            if c.hold_id is not None:
                self._holds[c.hold_id] += c.held

    def forget(self, charges: list[Charge]) -> list[Charge]:
        """``charges`` written (or found written): no longer counted. Those that were counted here are returned
        (others are other processes' charges, from their journals)."""
        ours = []
        for c in charges:
            if self._charges[c] <= 0:
                continue
            ours.append(c)
            self._charges[c] -= 1
            if not self._charges[c]:
                del self._charges[c]
            key = (c.budget_id, c.window_start)
            left = _plus(self._windows.get(key), c, -1)
            if left == (0, 0):
                self._windows.pop(key, None)
            else:
                self._windows[key] = left
            if c.hold_id is not None:
                self._holds[c.hold_id] -= c.held
                if self._holds[c.hold_id] <= 0:
                    del self._holds[c.hold_id]
        return ours

    def window(self, budget: str, start: int) -> tuple[int, int]:
        """(spent, held) of the charges on the window not written yet."""
        return self._windows.get((budget, start), (0, 0))

    def held(self, hold: str) -> int:
        """What the hold still holds for charges not written yet."""
        return self._holds.get(hold, 0)


def _plus(sums: tuple[int, int] | None, charge: Charge, sign: int = 1) -> tuple[int, int]:
    spent, held = sums or (0, 0)
    return spent + sign * charge.actual, held + sign * charge.held
