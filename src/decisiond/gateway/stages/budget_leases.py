"""Budget admission in memory, off the hot row: each process leases room of a budget window from the ledger
(``budget_ledger.Ledger``: one transaction a lease grows, never one a request) and admits requests from it locally.

- A request is admitted when every budget that applies has its worst case in this process's lease of the budget's
  current window, all or none. A lease short of it grows first (``Ledger.grow``: the shortfall, and up to
  ``LEASE_CHUNK_REQUESTS`` worst cases more — twice as many at each growth of a lease in use — where a quarter of the
  budget's free room allows), one growth at a time per lease; a lease that grew by a chunk and is down to three
  quarters of it grows in the background, so that the next requests need not wait.
- A request's worst case is carved out of its lease while it runs. When it ends, what it did not use goes back to
  the lease at once, and its charge (``types.Charge``) carries its real cost to the usage writer, which moves that
  much from the lease's hold to the spend in the ledger.

**The room obeys the ledger.** What this process believes of a lease (``Lease.room``, and for each hold the worst
cases its requests carved and the charges not yet written) adds up to the hold's amount in the ledger. Where that may
no longer be so, the lease admits nothing until the ledger has been asked again:

- a call whose outcome is unknown (``grow``, ``give_back``, a usage write that found its records there already: a
  reply to COMMIT lost, a cancellation mid-commit) makes the lease *doubtful*: its hold is read back and the room set
  from it (``hold − carved − unwritten``), under the usage writer's ``settling`` lock (no write lands in between);
- a hold found gone (``renew``, ``grow``: released by another replica for its age, or with its budget) leaves the
  lease no room, and a growth into a new hold starts from what that growth granted alone;
- room is used only while the hold cannot have expired: until two thirds of the ledger's time to live after the
  last renewal or growth was *sent*, by this process's monotonic clock (a process stopped past its lease — SIGSTOP, a
  stall — renews first, and finds its hold gone); live leases are renewed every third of it;
- a budget whose limit was lowered, or that was deleted or made again, takes back its room at once, on every process
  as it reads the list (``BudgetStore.listen``; within ``BUDGET_CACHE_S``), and a growth that was under way then is
  given back too; a growth is always judged against the limit the ledger has.

Holds of processes that died on this host are released (after their usage journals are written: ``replay``) at
start, every renewal and before a request is refused for lack of room; elsewhere they expire after the time to live.
Leases unused for ``LEASE_IDLE_S`` give their room back, and every lease at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import DecisionError, one_line
from ...limits import LEASE_CHUNK_REQUESTS, LEASE_IDLE_S, LEASE_PURGE_S
from ...store.processes import dead_pid, machine, runner_name
from ..types import Charge
from .budget_accounts import Lease, Unwritten
from .budget_ledger import BudgetGone, BudgetView, Hold, Ledger, NoRoom, Pending, Reservation, budget_exceeded

log = logging.getLogger("decisiond.budgets")

MAX_CHUNK_REQUESTS = 1 << 16
READY_TRIES = 8  # read-backs or renewals of a lease one request waits for before it gives up (503)
# A lease may be used for this share of the ledger's time to live after its last renewal was sent.
VALID_SHARE = 2 / 3


class LeaseUnsettled(Exception):
    """A lease that kept changing under a request (read back, lost, recalled) more often than ``READY_TRIES``."""


class LeaseBook:
    """This process's leases, by (budget id, window start). A lease stays in the book until its window has passed.
    ``store`` (a ``BudgetStore``) gives the budget list and its changes; ``settling`` is held by the usage writer
    around each write of charges, and by whatever must see the ledger and this book as one."""

    def __init__(self, ledger: Ledger, store: Any = None, chunk_requests: int = LEASE_CHUNK_REQUESTS,
                 holder: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.ledger = ledger
        self.clock = clock  # monotonic seconds: idleness, and how long a hold may be used after its renewal
        self.store = store
        self.chunk_requests = chunk_requests
        self.holder = holder or runner_name()
        # Writes the usage journal of a process of this host that died (``UsageWriter.replay_orphans``).
        self.replay: Callable[[int], Awaitable[None]] | None = None
        self.renew_s = ledger.ttl_s / 3
        self.valid_s = ledger.ttl_s * VALID_SHARE
        self.leases: dict[tuple[str, int], Lease] = {}
        self.settling = asyncio.Lock()
        # Charges of this process's requests not yet written by the usage writer; the worst cases carved out of
        # each hold by requests in flight.
        self._unwritten = Unwritten()
        self._reserved: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self._looked_for_dead = float("-inf")
        if store is not None:
            store.listen(self._listed)

    def start(self) -> None:
        self._task = asyncio.create_task(self._maintain(), name="budget-leases")
        self._spawn(self._release_dead(force=True))

    # ----------------------------------------------------------------------------------------------- admission

    def admit_now(self, budgets: list[BudgetView], amount: int, now: float | None = None) -> Reservation | None:
        """``admit`` without waiting: the reservation when every lease is usable and has the room already, else None
        (then ``admit``). The common case, and no await: no task, no turn of the event loop."""
        now = time.time() if now is None else now
        clock = self.clock()
        leases = [self._lease(b, b.window(now)[0]) for b in budgets]
        if any(lease.room < amount or not lease.usable(clock) for lease in leases):
            return None
        return Reservation([self._reserve(lease, amount) for lease in leases])

    async def admit(self, budgets: list[BudgetView], amount: int, now: float | None = None) -> Reservation:
        """Carve ``amount`` nano-USD out of this process's lease of every budget's current window, all or none,
        making leases ready first (read back, renewed, grown: 402 ``budget_exceeded`` naming the first budget
        without room). A budget deleted meanwhile is passed over."""
        now = time.time() if now is None else now
        holds: list[Hold] = []
        try:
            for b in sorted(budgets, key=lambda b: b.id):
                lease = self._lease(b, b.window(now)[0])
                try:
                    await self._ready(lease, amount)
                except BudgetGone:  # deleted since the list was read: no longer a limit
                    if self.store is not None:
                        self.store.forget()
                    continue
                holds.append(self._reserve(lease, amount))
        except BaseException:
            for hold in holds:  # all or none
                self._uncarve(hold, hold.amount)
            raise
        return Reservation(holds)

    async def _ready(self, lease: Lease, amount: int) -> None:
        """Return once ``lease`` is usable with ``amount`` of room (no await in between and the caller's carve)."""
        refreshed = 0
        while True:  # each turn waits for the ledger (the stage bounds the wait: BUDGET_DB_TIMEOUT_S)
            if lease.doubtful or (lease.id is not None and self.clock() >= lease.valid_until):
                refreshed += 1
                if refreshed > READY_TRIES:
                    raise LeaseUnsettled(f"the lease of budget {lease.budget.id} kept changing")
                await self._refresh(lease)
            elif lease.room >= amount:
                return
            else:
                await self._grow(lease, amount)

    def _reserve(self, lease: Lease, amount: int) -> Hold:
        lease.room -= amount
        lease.used_at = self.clock()
        lease.used = True
        if lease.id is not None:
            self._reserved[lease.id] += amount
        if amount < lease.last_growth and 4 * lease.room < 3 * lease.last_growth and (
                lease.growing is None or lease.growing.done()):
            # A lease that grows by chunks (the budget is far from its limit) grows again in the background,
            # before its room runs out; near the limit, room is taken a request at a time.
            lease.growing = self._growth(lease, amount, ahead=True)
        return Hold(lease.id, lease.budget.id, lease.start, amount)

    def _uncarve(self, hold: Hold, unused: int) -> bool:
        """A request's hold ends, ``unused`` of it back to its lease where that lease still has the hold (True)."""
        if hold.lease is None:
            return False
        self._reserved[hold.lease] -= hold.amount
        if self._reserved[hold.lease] <= 0:
            del self._reserved[hold.lease]
        lease = self.leases.get((hold.budget_id, hold.window_start))
        if lease is None or lease.id != hold.lease:
            return False
        lease.room += unused
        return True

    def settle(self, reservation: Reservation, actual: int) -> list[Charge]:
        """A request of this process ended, having cost ``actual`` nano-USD: what it did not use of its worst case
        goes back to its lease at once, and its charges (what the usage writer will move from the hold to the spend)
        are returned. Until they are written (``written``), views of its budgets count them as spent."""
        charges = []
        for h in reservation.holds:
            held = 0 if h.lease is None else min(actual, h.amount)
            if h.lease is not None and not self._uncarve(h, h.amount - held):
                held = h.amount  # its lease let go of that hold: the whole worst case goes back to the window
            charges.append(Charge(h.budget_id, h.window_start, h.lease, held, actual))
        self._unwritten.add(charges)
        return charges

    # ------------------------------------------------------------------------------------ what the writer says

    def dropped(self, charges: list[Charge]) -> None:
        """The usage writer found the records of ``charges`` in the ledger already: written by an earlier try whose
        acknowledgement was lost (applied), or a request answered again (not applied). Only the ledger knows which:
        their leases read their holds back before they admit again."""
        for c in self._unwritten.forget(charges):
            lease = self.leases.get((c.budget_id, c.window_start))
            if lease is not None and c.hold_id is not None and lease.id == c.hold_id:
                self._doubt(lease)

    def written(self, charges: list[Charge]) -> None:
        """The usage writer has applied ``charges`` to the ledger (those of other processes' journals are not ours,
        and change nothing here)."""
        self._unwritten.forget(charges)

    def believed(self, hold: str) -> int:
        """What this process's accounts say ``hold`` has in the ledger: its lease's room, the worst cases requests
        in flight carved out of it, and its charges not written yet (while no call on it is under way)."""
        room = sum(lease.room for lease in self.leases.values() if lease.id == hold)
        return room + self._reserved.get(hold, 0) + self._unwritten.held(hold)

    def pending(self, budget: str, start: int) -> Pending:
        """What this process knows of a window that the ledger does not have yet (``budget_ledger.Pending``)."""
        lease = self.leases.get((budget, start))
        spent, held = self._unwritten.window(budget, start)
        room = lease.room if lease is not None and not lease.doubtful else 0
        explained = {}
        if lease is not None and lease.id is not None:
            explained[lease.id] = room + self._unwritten.held(lease.id)
        return Pending(spent, held + room, explained)

    async def spend_report(self, budgets: list[BudgetView]) -> list[dict[str, Any]]:
        """``BudgetStore.spend_report`` as this process knows it (``local``), read while no write of charges lands."""
        async with self.settling:
            views: list[dict[str, Any]] = await self.store.spend_report(budgets, pending=self.pending)
        return views

    # ---------------------------------------------------------------------------------- the ledger, obeyed

    def _lease(self, budget: BudgetView, start: int) -> Lease:
        lease = self.leases.get((budget.id, start))
        if lease is None:
            lease = self.leases[(budget.id, start)] = Lease(budget, start, used_at=self.clock())
        elif budget is not lease.budget:
            if budget.narrowed(lease.budget):
                self._recall(lease)
            lease.budget = budget
        return lease

    def _listed(self, views: list[BudgetView]) -> None:
        """The budget list as just read: leases of budgets lowered, deleted or made again take back their room."""
        by_id = {v.id: v for v in views}
        for lease in list(self.leases.values()):
            view = by_id.get(lease.budget.id)
            if view is None:
                self._recall(lease)  # deleted: its holds went with it
                lease.drop()
            else:
                self._lease(view, lease.start)

    def _recall(self, lease: Lease) -> None:
        """Take back the lease's room at once (and a growth under way, as it lands); give it back to the ledger."""
        room, lease.room = lease.room, 0
        lease.recalls += 1
        lease.chunk_requests = lease.last_growth = 0
        if room > 0 and lease.id is not None:
            self._spawn(self._give_back(lease, lease.id, room))

    def _doubt(self, lease: Lease) -> None:
        """The hold's amount is not known any more: no admission from it until it is read back (soon, here)."""
        if not lease.doubtful:
            lease.doubtful = True
            self._spawn(self._refresh(lease))

    async def _refresh(self, lease: Lease) -> None:
        """Read a doubtful lease's hold back, or renew one past its validity (under the lease's lock)."""
        async with lease.lock:
            if lease.doubtful:
                await self._read_back(lease)
            elif lease.id is not None and self.clock() >= lease.valid_until:
                ident, sent = lease.id, self.clock()
                there = await self.ledger.renew([(ident, lease.budget.id, lease.start)])
                self._renewed(lease, ident, ident in there, sent)

    def _renewed(self, lease: Lease, ident: str, there: bool, sent: float) -> None:
        if lease.id != ident:
            return  # a growth moved the lease to another hold meanwhile
        if there:
            lease.valid_until = max(lease.valid_until, sent + self.valid_s)
        else:
            log.warning("budget lease lost: another replica released its hold (this process was stalled past its "
                        "time to live, or its budget changed)", extra={"budget": lease.budget.id})
            lease.drop()

    async def _read_back(self, lease: Lease) -> None:
        """Set a doubtful lease's hold and room from the ledger (the lease's lock held)."""
        ids = sorted({i for i in (lease.id, *lease.unknown) if i is not None})
        async with self.settling:
            amounts = await self.ledger.read(lease.budget.id, lease.start, ids)
            hold = lease.id if lease.id in amounts else next((i for i in ids if i in amounts), None)
            if hold is None:
                lease.drop()
            else:
                room = amounts[hold] - self._reserved.get(hold, 0) - self._unwritten.held(hold)
                if room < 0:
                    log.warning("budget hold holds less than this process's requests in flight",
                                extra={"budget": lease.budget.id, "nanousd": -room})
                lease.id, lease.room = hold, max(0, room)
            lease.unknown.clear()
            lease.doubtful = False

    async def _give_back(self, lease: Lease, hold: str, room: int) -> None:
        """Return ``room``, already taken out of the lease, to the hold ``hold`` in the ledger."""
        async with lease.lock:
            if lease.id != hold:
                return  # the hold is gone, and its room with it
            try:
                await self.ledger.give_back(hold, lease.budget.id, lease.start, room)
            except BaseException:
                self._doubt(lease)  # given back or not: read back before the room is used
                raise

    # ------------------------------------------------------------------------------------------------- growth

    async def _grow(self, lease: Lease, amount: int) -> None:
        """Wait for a growth of ``lease``: one under way (another request's), else one of this request's own. A
        growth runs on when the request gives up waiting: its room stays in the lease."""
        growing = lease.growing
        if growing is None or growing.done():
            lease.growing = growing = self._growth(lease, amount)
            await asyncio.shield(growing)
        else:
            with contextlib.suppress(Exception):  # another's growth: then look again
                await asyncio.shield(growing)

    def _growth(self, lease: Lease, amount: int, ahead: bool = False) -> asyncio.Future[None]:
        return self._spawn(self._grow_lease(lease, amount, ahead))

    async def _grow_lease(self, lease: Lease, amount: int, ahead: bool = False) -> None:
        """Grow ``lease`` so that it holds ``amount`` (or, ``ahead`` of need, three quarters of its last growth)."""
        async with lease.lock:
            if lease.doubtful:
                await self._read_back(lease)
            if lease.room >= amount and not (ahead and 4 * lease.room < 3 * lease.last_growth):
                return
            need = amount - lease.room if lease.room < amount else amount  # ahead: at least one request more
            # Each growth of a lease in use takes twice the last (up to the quarter of the free room the ledger
            # allows at most), so that a busy lease grows rarely; one given back for being idle starts again small.
            lease.chunk_requests = min(2 * lease.chunk_requests, MAX_CHUNK_REQUESTS) if lease.chunk_requests \
                else self.chunk_requests
            chunk = max(need, amount * lease.chunk_requests)
            recalls, new, sent = lease.recalls, uuid.uuid4().hex, self.clock()
            try:
                grant = await self._grant(lease, need, chunk, amount, new)
            except (DecisionError, BudgetGone):  # no room, no budget: nothing was changed
                raise
            except BaseException:  # given or not (a lost acknowledgement, a cancellation mid-commit): read back
                self._unknown(lease, new)
                raise
            if grant.fresh or grant.hold != lease.id:
                lease.id, lease.room = grant.hold, grant.granted  # a new hold: nothing of the old one is left
            else:
                lease.room += grant.granted
            lease.last_growth = grant.granted
            lease.valid_until = sent + self.valid_s
            if lease.recalls != recalls:  # taken back while it grew: granted under a limit that was lowered
                self._recall(lease)

    def _unknown(self, lease: Lease, new: str) -> None:
        lease.unknown.add(new)
        self._doubt(lease)

    async def _grant(self, lease: Lease, need: int, chunk: int, amount: int, new: str) -> Any:
        """``Ledger.grow``; where there is no room, once more after releasing the holds of dead processes here."""
        released = False
        while True:
            try:
                return await self.ledger.grow(lease.budget, lease.start, lease.id, new, need, chunk, amount,
                                              self.holder)
            except NoRoom as full:
                if released or not await self._release_dead(quiet=True):
                    b, now = lease.budget, time.time()
                    known = self.pending(b.id, lease.start)
                    raise budget_exceeded(b, full.spent + known.spent, max(0, full.reserved - known.free), amount,
                                          int(b.window(now)[1] - now)) from None
                released = True

    async def _release_dead(self, force: bool = False, quiet: bool = False) -> int:
        """Release the holds of processes that died on this host (at most once a second unless ``force``), once
        their usage journals are written (``replay``): their charges settle on their holds first, so that no room
        they had spent goes back. ``quiet``: a failure (the database) is logged and nothing released."""
        if not force and self.clock() - self._looked_for_dead < 1.0:
            return 0
        self._looked_for_dead = self.clock()
        try:
            dead = {h: pid for h in await self.ledger.holders(machine()) if (pid := dead_pid(h)) is not None}
            if self.replay is not None:
                for pid in sorted(set(dead.values())):
                    await self.replay(pid)
            return await self.ledger.release(sorted(dead))
        except Exception as error:
            if not quiet:
                raise
            log.warning("holds of stopped processes not released", extra={"error": one_line(error)})
            return 0

    # -------------------------------------------------------------------------------------------- background

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            # No room, or the database: whoever waits on it finds out; the lease stays doubtful where it must.
            log.debug("budget lease work failed", extra={"error": one_line(error)})

    async def _maintain(self) -> None:
        """``maintain`` for as long as the process serves."""
        renewed = purged = self.clock()
        while True:
            await asyncio.sleep(min(LEASE_IDLE_S / 2, self.renew_s))
            try:
                renew = self.clock() - renewed >= self.renew_s
                await self.maintain(renew=renew)
                if renew:
                    renewed = self.clock()
                    await self._release_dead()
                if self.store is not None and self.clock() - purged >= LEASE_PURGE_S:
                    purged = self.clock()
                    await self.ledger.purge({b.id: b.window()[0] for b in await self.store.budgets()})
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database: tried again at the next turn
                log.warning("budget leases not tended", extra={"error": one_line(error)})

    async def maintain(self, now: float | None = None, clock: float | None = None, renew: bool = False) -> None:
        """Give back the room of leases idle for ``LEASE_IDLE_S`` (``clock``: ``self.clock()``) or of past
        windows (``now``: ``time.time()``), forget leases of past windows once empty, and renew live ones."""
        now = time.time() if now is None else now
        clock = self.clock() if clock is None else clock
        failed: Exception | None = None
        for key, lease in list(self.leases.items()):
            ended = lease.budget.window(now)[0] != lease.start
            idle = not lease.used and clock - lease.used_at >= LEASE_IDLE_S
            lease.used = False
            try:
                if lease.doubtful:  # an earlier read-back failed (the database was down): again
                    await self._refresh(lease)
                if lease.room > 0 and (ended or idle) and not lease.doubtful and lease.id is not None:
                    room, lease.room, lease.chunk_requests = lease.room, 0, 0
                    await self._give_back(lease, lease.id, room)
            except Exception as error:  # the others are tended all the same
                failed = error
            if ended and lease.room == 0 and not lease.doubtful:
                del self.leases[key]
        if renew:
            await self.renew()
        if failed is not None:
            raise failed

    async def renew(self) -> None:
        """Renew every lease's hold; a lease whose hold is gone is left without room."""
        live = [(lease, lease.id) for lease in self.leases.values() if lease.id is not None]
        sent = self.clock()
        there = await self.ledger.renew([(ident, lease.budget.id, lease.start) for lease, ident in live])
        for lease, ident in live:
            self._renewed(lease, ident, ident in there, sent)

    async def aclose(self) -> None:
        """Give every lease's room back (what requests in flight hold is settled by their usage rows)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for work in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await work
        for lease in list(self.leases.values()):
            try:
                if lease.doubtful:
                    async with lease.lock:
                        await self._read_back(lease)
                if lease.room > 0 and lease.id is not None:
                    room, lease.room = lease.room, 0
                    await self._give_back(lease, lease.id, room)
            except Exception as error:
                log.warning("budget lease not given back at shutdown: released after its time to live",
                            extra={"error": one_line(error)})
        self.leases.clear()  # a request that ends later gives its whole worst case back to the window

