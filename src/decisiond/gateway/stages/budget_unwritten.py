"""The charges a process's requests settled that its usage writer has not written to the budget ledger yet
(``types.Charge``): counted by charge, summed by window (the spend and holds the ledger does not show yet) and by
hold (what each hold still holds for them). ``budget_leases.LeaseBook`` keeps one."""

from __future__ import annotations

from collections import Counter

from ..types import Charge


class Unwritten:
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
