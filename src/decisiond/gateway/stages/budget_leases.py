"""Budget admission in memory, off the hot row: each process leases room of a budget window from the ledger
(``budget_ledger``: one transaction a lease grows, never one a request) and admits requests from it locally.

- A request is admitted when every budget that applies has its worst case in this process's lease of the budget's
  current window, all or none. A lease short of it grows first (``BudgetStore.grow``: the shortfall, and up to
  ``LEASE_CHUNK_REQUESTS`` worst cases more — twice as many at each growth of a lease in use — where a quarter of the
  budget's free room allows), one growth at a time per lease; a lease that grew by a chunk and is down to three
  quarters of it grows in the background, so that the next requests need not wait.
- A request's worst case is carved out of its lease while it runs. When it ends, what it did not use goes back to
  the lease at once, and its charge (``types.Charge``) carries its real cost to the usage writer, which moves that
  much from the lease's hold to the spend in the database (an upstream that billed more than the worst case: the
  worst case leaves the hold, the whole bill is spent).
- A lease unused for ``LEASE_IDLE_S`` gives its room back; live leases are renewed every ``LEASE_RENEW_S`` so that no
  replica releases them for their age (``budget_reservation_ttl_s``). At shutdown every lease gives its room back.

Since each process admits only out of room the ledger granted it, and the ledger grants only what the limit leaves,
the guarantee of a single transaction per request holds: spend passes a limit only by what requests are billed
above their worst cases. Near a limit, room leased by one replica is not seen by another until it is given back
(at most ``LEASE_IDLE_S`` after its last use): a replica may refuse a request that another replica's idle room would
have fitted, never admit one that does not fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...errors import one_line
from ...limits import LEASE_CHUNK_REQUESTS, LEASE_IDLE_S, LEASE_RENEW_S
from ..types import Charge
from .budget_ledger import BudgetStore, BudgetView, Local, NoRoom, budget_exceeded

log = logging.getLogger("decisiond.budgets")

MAX_CHUNK_REQUESTS = 1 << 16


@dataclass(frozen=True)
class Hold:
    """What one request holds of one budget window: ``amount`` nano-USD of the lease ``lease`` (None: admitted
    unchecked while the database was down, holding nothing)."""

    lease: str | None
    budget_id: str
    window_start: int
    amount: int


@dataclass
class Reservation:
    """What one request holds on its budgets, one hold per budget window."""

    holds: list[Hold] = field(default_factory=list)


@dataclass
class Lease:
    """This process's room in one budget window: ``room`` nano-USD not yet carved out by a request."""

    budget: BudgetView
    start: int
    id: str | None = None
    room: int = 0
    last_growth: int = 0
    used_at: float = field(default_factory=time.monotonic)
    chunk_requests: int = 0
    # Used since ``tend`` last looked: a lease is idle only when a turn of ``tend`` finds it unused, so that a
    # process that stalled (a pause of the machine) does not take its own stall for idleness.
    used: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    growing: asyncio.Future[None] | None = None


class LeaseBook:
    """This process's leases, by (budget id, window start). A lease stays in the book, room or not, until its window
    has passed."""

    def __init__(self, store: BudgetStore, chunk_requests: int = LEASE_CHUNK_REQUESTS):
        self.store = store
        self.chunk_requests = chunk_requests
        # Renewed well within the time to live after which other replicas release a hold.
        self.renew_s = min(LEASE_RENEW_S, store.reservation_ttl_ms / 1000 / 3)
        self.leases: dict[tuple[str, int], Lease] = {}
        # Charges of this process's requests not yet written by the usage writer, and their sums by window.
        self._unwritten: Counter[Charge] = Counter()
        self._pending: dict[tuple[str, int], tuple[int, int]] = {}
        self._pending_held: dict[str, int] = {}
        self._writes = 0
        self._task: asyncio.Task[None] | None = None
        self._growths: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._tend(), name="budget-leases")

    def admit_now(self, budgets: list[BudgetView], amount: int, now: float | None = None) -> Reservation | None:
        """``admit`` without waiting: the reservation when every lease has the room already, else None (then
        ``admit``). The common case, and no await: no task, no turn of the event loop."""
        now = time.time() if now is None else now
        leases = [self._lease(b, b.window(now)[0]) for b in budgets]
        if any(lease.room < amount for lease in leases):
            return None
        return Reservation([self._carve(lease, amount) for lease in leases])

    async def admit(self, budgets: list[BudgetView], amount: int, now: float | None = None) -> Reservation:
        """Carve ``amount`` nano-USD out of this process's lease of every budget's current window, all or none,
        growing leases that are short (402 ``budget_exceeded`` naming the first budget without room)."""
        now = time.time() if now is None else now
        holds: list[Hold] = []
        taken: list[Lease] = []
        try:
            for b in sorted(budgets, key=lambda b: b.id):
                lease = self._lease(b, b.window(now)[0])
                if lease.room < amount:
                    await self._grow(lease, amount)
                holds.append(self._carve(lease, amount))
                taken.append(lease)
        except BaseException:
            for lease in taken:  # all or none
                lease.room += amount
            raise
        return Reservation(holds)

    def _carve(self, lease: Lease, amount: int) -> Hold:
        lease.room -= amount
        lease.used_at = time.monotonic()
        lease.used = True
        if amount < lease.last_growth and 4 * lease.room < 3 * lease.last_growth and (
                lease.growing is None or lease.growing.done()):
            # A lease that grows by chunks (the budget is far from its limit) grows again in the background,
            # before its room runs out; near the limit, room is taken a request at a time.
            lease.growing = self._growth(lease, amount, ahead=True)
        return Hold(lease.id, lease.budget.id, lease.start, amount)

    def settle(self, reservation: Reservation, actual: int) -> list[Charge]:
        """A request of this process ended, having cost ``actual`` nano-USD: what it did not use of its worst case
        goes back to its lease at once, and its charges (what the usage writer will move from the lease's hold to
        the spend) are returned. Until they are written (``written``), views of its budgets count them as spent."""
        charges = []
        for h in reservation.holds:
            held = min(actual, h.amount)
            lease = self.leases.get((h.budget_id, h.window_start))
            if h.lease is None:  # admitted unchecked: held nothing
                held = 0
            elif lease is not None and lease.id == h.lease:
                lease.room += h.amount - held
            else:  # its lease is gone from this process (its window passed): the whole hold goes back to the window
                held = h.amount
            charges.append(Charge(h.budget_id, h.window_start, h.lease, held, actual))
        self._settled(charges)
        return charges

    def _settled(self, charges: list[Charge]) -> None:
        for c in charges:
            self._unwritten[c] += 1
            self._pending[(c.budget_id, c.window_start)] = _plus(self._pending.get((c.budget_id, c.window_start)), c)
            if c.hold_id is not None:
                self._pending_held[c.hold_id] = self._pending_held.get(c.hold_id, 0) + c.held

    def dropped(self, charges: list[Charge]) -> None:
        """The usage writer has not applied ``charges``: their records were written before (a request answered
        again, its first answer already charged). What they held goes back to their lease, whose hold in the
        ledger still has it."""
        for c in self._forget(charges):
            lease = self.leases.get((c.budget_id, c.window_start))
            if lease is not None and c.hold_id is not None and lease.id == c.hold_id:
                lease.room += c.held

    def written(self, charges: list[Charge]) -> None:
        """The usage writer has applied ``charges`` to the ledger (those of other processes' journals are not ours,
        and change nothing here)."""
        self._forget(charges)

    def _forget(self, charges: list[Charge]) -> list[Charge]:
        """``charges`` no longer pending (those of this process: returned)."""
        ours = []
        for c in charges:
            if self._unwritten[c] <= 0:
                continue
            ours.append(c)
            self._writes += 1
            self._unwritten[c] -= 1
            if not self._unwritten[c]:
                del self._unwritten[c]
            key = (c.budget_id, c.window_start)
            left = _plus(self._pending.get(key), c, -1)
            if left == (0, 0):
                self._pending.pop(key, None)
            else:
                self._pending[key] = left
            if c.hold_id is not None:
                held = self._pending_held.get(c.hold_id, 0) - c.held
                if held > 0:
                    self._pending_held[c.hold_id] = held
                else:
                    self._pending_held.pop(c.hold_id, None)
        return ours

    def local(self, budget: str, start: int) -> Local:
        """What this process knows of a window that the ledger does not have yet (``budget_ledger.Local``)."""
        lease = self.leases.get((budget, start))
        spent, held = self._pending.get((budget, start), (0, 0))
        room = lease.room if lease is not None else 0
        explained = {}
        if lease is not None and lease.id is not None:
            explained[lease.id] = room + self._pending_held.get(lease.id, 0)
        return Local(spent, held + room, explained)

    async def spend(self, budgets: list[BudgetView]) -> list[dict[str, Any]]:
        """``BudgetStore.spend`` as this process knows it (``local``); read again if the writer wrote meanwhile."""
        while True:
            before = self._writes
            views = await self.store.spend(budgets, local=self.local)
            if self._writes == before:
                return views

    def _lease(self, budget: BudgetView, start: int) -> Lease:
        lease = self.leases.get((budget.id, start))
        if lease is None:
            lease = self.leases[(budget.id, start)] = Lease(budget, start)
        else:
            lease.budget = budget  # its limit may have changed
        return lease

    async def _grow(self, lease: Lease, amount: int) -> None:
        """Wait until ``lease`` holds ``amount``: for a growth under way (another request's), else for one of this
        request's own. A growth runs on when the request gives up waiting: its room stays in the lease."""
        while lease.room < amount:
            growing = lease.growing
            if growing is not None and not growing.done():
                with contextlib.suppress(Exception):  # another's growth: then look again
                    await asyncio.shield(growing)
                continue
            lease.growing = growing = self._growth(lease, amount)
            await asyncio.shield(growing)

    def _growth(self, lease: Lease, amount: int, ahead: bool = False) -> asyncio.Future[None]:
        task = asyncio.ensure_future(self._take(lease, amount, ahead))
        self._growths.add(task)
        task.add_done_callback(self._growth_done)
        return task

    def _growth_done(self, task: asyncio.Future[None]) -> None:
        self._growths.discard(task)
        if not task.cancelled():
            task.exception()  # no room, or the database: whoever waits on it finds out; nobody else needs to

    async def _take(self, lease: Lease, amount: int, ahead: bool = False) -> None:
        """Grow ``lease`` so that it holds ``amount`` (or, ``ahead`` of need, three quarters of its last growth)."""
        async with lease.lock:
            if lease.room >= amount and not (ahead and 4 * lease.room < 3 * lease.last_growth):
                return
            need = amount - lease.room if lease.room < amount else amount  # ahead: at least one request more
            # Each growth of a lease in use takes twice the last (up to the quarter of the free room the ledger
            # allows at most), so that a busy lease grows rarely; one given back for being idle starts again small.
            lease.chunk_requests = min(2 * lease.chunk_requests, MAX_CHUNK_REQUESTS) if lease.chunk_requests \
                else self.chunk_requests
            chunk = max(need, amount * lease.chunk_requests)
            try:
                ident, granted = await self.store.grow(lease.budget, lease.start, lease.id, need, chunk, amount)
            except NoRoom as full:
                b, now = lease.budget, time.time()
                known = self.local(b.id, lease.start)
                raise budget_exceeded(b, full.spent + known.spent, max(0, full.reserved - known.free), amount,
                                      int(b.window(now)[1] - now)) from None
            lease.id, lease.room, lease.last_growth = ident, lease.room + granted, granted

    async def _tend(self) -> None:
        """``tend`` for as long as the process serves."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(min(LEASE_IDLE_S / 2, self.renew_s))
            try:
                renew = time.monotonic() - renewed >= self.renew_s
                await self.tend(renew=renew)
                if renew:
                    renewed = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database: tried again at the next turn
                log.warning("budget leases not tended", extra={"error": one_line(error)})

    async def tend(self, now: float | None = None, clock: float | None = None, renew: bool = False) -> None:
        """Give back the room of leases idle for ``LEASE_IDLE_S`` (``clock``: ``time.monotonic()``) or of past
        windows (``now``: ``time.time()``), forget leases of past windows once empty, and renew live ones."""
        now = time.time() if now is None else now
        clock = time.monotonic() if clock is None else clock
        for key, lease in list(self.leases.items()):
            ended = lease.budget.window(now)[0] != lease.start
            idle = not lease.used and clock - lease.used_at >= LEASE_IDLE_S
            lease.used = False
            if lease.room > 0 and (ended or idle):
                await self._give_back(lease)
            if ended and lease.room == 0:
                del self.leases[key]
        if renew:
            await self.store.renew(lease.id for lease in self.leases.values() if lease.id is not None)

    async def _give_back(self, lease: Lease) -> None:
        async with lease.lock:
            room, lease.room = lease.room, 0
            lease.chunk_requests = 0
            if room > 0 and lease.id is not None:
                try:
                    await self.store.give_back(lease.id, lease.budget.id, lease.start, room)
                except BaseException:
                    lease.room += room  # still held in the database: still this lease's
                    raise

    async def aclose(self) -> None:
        """Give every lease's room back (what requests in flight hold is settled by their usage rows)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for growth in list(self._growths):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await growth
        for lease in list(self.leases.values()):
            try:
                await self._give_back(lease)
            except Exception as error:
                log.warning("budget lease not given back at shutdown: released after its time to live",
                            extra={"error": one_line(error)})


def _plus(sums: tuple[int, int] | None, charge: Charge, sign: int = 1) -> tuple[int, int]:
    spent, held = sums or (0, 0)
    return spent + sign * charge.actual, held + sign * charge.held
