"""Budget leases on a real database (SQLite, and PostgreSQL shared by two replicas): two lease books admitting at
once never hold more than the limit; near the limit they admit exactly what fits; far from it a budget costs a few
transactions, not one a request; settled requests reach the ledger exactly (spent = the sum of their costs, nothing
left held once the leases are given back); a lease grows ahead of need in the background."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError

from decisiond.errors import BudgetExceeded
from decisiond.gateway.access_settings import BudgetConfig
from decisiond.gateway.stages.budget_leases import LeaseBook
from decisiond.gateway.stages.budget_sql import SqlLedger, apply_charges
from decisiond.gateway.stages.budget_store import BudgetStore
from decisiond.limits import BUDGET_DB_TIMEOUT_S, DATABASE_IDLE_TRANSACTION_S
from decisiond.store.db import Database
from decisiond.store.tables import BudgetReservation, BudgetWindow

NANO = 1_000_000_000


class Replica:
    """A process's lease book on the shared database, and its usage writer's part: charges applied in batches."""

    def __init__(self, db: Database):
        self.store = BudgetStore(db)
        self.ledger = SqlLedger(db, 3600)
        self.book = LeaseBook(self.ledger, self.store)
        self.grows = 0
        grow = self.ledger.grow

        async def counted(*args, **kwargs):
            self.grows += 1
            return await grow(*args, **kwargs)

        self.ledger.grow = counted  # type: ignore[method-assign]
        self.charges: list = []

    async def write(self) -> None:
        charges, self.charges = self.charges, []
        async with self.book.settling:
            await self.store.db.write(lambda connection: apply_charges(connection, charges))
            self.book.written(charges)


async def run(url: str, limit_usd: float, worst_usd: float, requests: int, cost_usd: float, tag: str) -> dict:
    db = await Database.open(url)
    replicas = [Replica(db), Replica(db)]
    view = await replicas[0].store.put(BudgetConfig(key=f"key-{tag}", limit_usd=limit_usd, period="daily"), "admin")
    budgets = [view]
    worst, cost = int(worst_usd * NANO), int(cost_usd * NANO)
    held = {"now": 0, "most": 0}
    admitted = refused = 0
    rng = random.Random(7)

    async def one(i: int) -> None:
        nonlocal admitted, refused
        replica = replicas[i % 2]
        try:
            reservation = replica.book.admit_now(budgets, worst) or await replica.book.admit(budgets, worst)
        except BudgetExceeded:
            refused += 1
            return
        admitted += 1
        held["now"] += worst
        held["most"] = max(held["most"], held["now"])
        await asyncio.sleep(rng.random() * 0.01)  # the call
        held["now"] -= worst
        replica.charges += replica.book.settle(reservation, cost)
        if rng.random() < 0.2:
            await replica.write()

    await asyncio.gather(*(one(i) for i in range(requests)))
    for replica in replicas:
        await replica.write()
        for lease in list(replica.book.leases.values()):
            lease.used_at = -1e9  # idle for as long as the test says
        await replica.book.maintain()  # the first look finds it used since the last: it is idle only at the next
        await replica.book.maintain()
    (after,) = await replicas[0].store.spend_report(budgets)
    await db.aclose()
    return {"admitted": admitted, "refused": refused, "most_held": held["most"], "after": after,
            "grows": sum(r.grows for r in replicas)}


def test_two_replicas_never_hold_more_than_the_limit_and_settle_exactly(database):
    # $1 limit, a worst case of $0.011, a real cost of $0.007: 90 fit at once, more as they settle.
    out = asyncio.run(run(database, 1.0, 0.011, 300, 0.007, "concurrent"))
    assert out["most_held"] <= 1 * NANO
    after = out["after"]
    assert after["spent_usd"] == pytest.approx(out["admitted"] * 0.007) and after["spent_usd"] <= 1.0
    assert after["reserved_usd"] == 0 and after["reservations"] == 0
    assert out["admitted"] >= 90 and out["admitted"] + out["refused"] == 300


def test_near_the_limit_two_replicas_admit_exactly_what_fits(database):
    out = asyncio.run(run(database, 0.03, 0.01, 20, 0.01, "exact"))
    assert (out["admitted"], out["refused"]) == (3, 17)
    assert out["after"]["spent_usd"] == pytest.approx(0.03) and out["after"]["reserved_usd"] == 0


def test_far_from_the_limit_a_budget_costs_a_few_transactions(database):
    out = asyncio.run(run(database, 1_000_000, 0.0001, 2000, 0.0001, "far"))
    assert out["admitted"] == 2000 and out["grows"] <= 12  # chunks of 256 worst cases and more, per replica
    assert out["after"]["spent_usd"] == pytest.approx(0.2) and out["after"]["reserved_usd"] == 0


def test_a_lease_grows_ahead_of_need(tmp_path):
    async def main() -> None:
        db = await Database.open(f"sqlite:///{tmp_path}/ahead.sqlite3")
        replica = Replica(db)
        view = await replica.store.put(BudgetConfig(key="k", limit_usd=1000, period="daily"), "admin")
        worst = int(0.001 * NANO)
        await replica.book.admit([view], worst)  # the first growth: 256 worst cases
        (lease,) = replica.book.leases.values()
        assert lease.room == 255 * worst and replica.grows == 1
        for _ in range(64):  # down to three quarters: the next growth starts, beside the requests
            assert replica.book.admit_now([view], worst) is not None
        assert lease.growing is not None
        await lease.growing
        assert replica.grows == 2 and lease.room == 191 * worst + 512 * worst
        await db.aclose()

    asyncio.run(main())


def test_past_windows_and_the_windows_of_deleted_budgets_are_purged(database):
    """Windows whose period has passed (their holds expired) and the windows of budgets that are gone are deleted;
    the current window stays, and so does a past window whose hold a live process still renews."""
    async def main() -> None:
        db = await Database.open(database)
        store, ledger = BudgetStore(db), SqlLedger(db, 15)
        live = await store.put(BudgetConfig(key=f"purge-{random.random()}", limit_usd=10, period_seconds=60), "admin")
        gone = await store.put(BudgetConfig(key=f"purged-{random.random()}", limit_usd=10, period_seconds=60), "admin")
        now = live.window()[0]
        for view, start in ((live, now - 120), (live, now - 60), (live, now), (gone, now)):
            await ledger.grow(view, start, None, f"h{random.getrandbits(40):x}", NANO, NANO, NANO, "elsewhere:1:x")
        async with db.session() as session, session.begin():  # the oldest window's hold stopped being renewed
            await session.execute(update(BudgetReservation).where(BudgetReservation.window_start == now - 120)
                                  .values(created_ms=BudgetReservation.created_ms - 16_000))
        await store.delete(gone.id)
        await apply_late_charge(db, gone.id, now)  # a request of the deleted budget settles after it went
        await ledger.purge({live.id: now})
        async with db.session() as session:
            windows = set((await session.execute(select(BudgetWindow.budget_id, BudgetWindow.window_start)
                                                 .where(BudgetWindow.budget_id.in_([live.id, gone.id])))).all())
            holds = (await session.execute(select(BudgetReservation.window_start)
                                           .where(BudgetReservation.budget_id == live.id))).scalars().all()
        assert windows == {(live.id, now - 60), (live.id, now)} and sorted(holds) == [now - 60, now]
        await db.aclose()

    asyncio.run(main())


async def apply_late_charge(db: Database, budget: str, start: int) -> None:
    from decisiond.gateway.types import Charge

    await db.write(lambda connection: apply_charges(connection, [Charge(budget, start, None, 0, NANO)]))


@pytest.fixture(scope="module")
def postgres():
    from services import start_postgres

    server = start_postgres()
    yield server
    server.remove()


def test_a_renewal_takes_the_window_before_its_holds(postgres):
    """The documented lock order, windows before holds: a transaction that holds a window and one of its holds (as a
    growth releasing expired holds does) can still take the others while a renewal of those holds waits — with holds
    taken first, the two would wait for each other until PostgreSQL broke the deadlock."""
    async def main() -> None:
        import asyncpg

        db = await Database.open(postgres.url)
        store, ledger = BudgetStore(db), SqlLedger(db, 15)
        view = await store.put(BudgetConfig(key=f"order-{random.random()}", limit_usd=10, period="daily"), "admin")
        start = view.window()[0]
        first = await ledger.grow(view, start, None, "hold-a", NANO, NANO, NANO, "x:1:a")
        second = await ledger.grow(view, start, None, "hold-b", NANO, NANO, NANO, "x:2:b")
        other = await asyncpg.connect(postgres.url)
        try:
            transaction = other.transaction()
            await transaction.start()
            await other.execute("SET lock_timeout = '3s'")
            await other.execute("SELECT 1 FROM budget_windows WHERE budget_id = $1 AND window_start = $2 FOR UPDATE",
                                view.id, start)
            await other.execute("SELECT 1 FROM budget_reservations WHERE id = $1 FOR UPDATE", second.hold)
            renewing = asyncio.ensure_future(ledger.renew([(first.hold, view.id, start), (second.hold, view.id, start)]))
            await asyncio.sleep(0.3)
            assert not renewing.done()  # waiting: for the window, holding no hold
            await other.execute("SELECT 1 FROM budget_reservations WHERE id = $1 FOR UPDATE", first.hold)
            await transaction.commit()
            assert await renewing == {first.hold, second.hold}
        finally:
            await other.close()
            await db.aclose()

    asyncio.run(main())


def test_a_transaction_its_process_stalls_in_is_ended_and_its_locks_freed(postgres):
    """A process stopped mid-transaction (SIGSTOP, swapped out) holds its row locks only for
    DATABASE_IDLE_TRANSACTION_S: PostgreSQL ends its transaction, and another replica's growth of the same window goes
    on well within the budget check's time (BUDGET_DB_TIMEOUT_S) instead of waiting on it."""
    async def main() -> None:
        stalled, db = await Database.open(postgres.url), await Database.open(postgres.url)
        store, ledger = BudgetStore(db), SqlLedger(db, 15)
        view = await store.put(BudgetConfig(key=f"stall-{random.random()}", limit_usd=10, period="daily"), "admin")
        start = view.window()[0]
        await ledger.grow(view, start, None, "hold-first", NANO, NANO, NANO, "x:1:a")
        try:
            async with stalled.engine.connect() as connection:
                await connection.begin()
                await connection.execute(select(BudgetWindow).where(BudgetWindow.budget_id == view.id)
                                         .with_for_update())
                # The stalled process sends nothing more; its transaction stays open on its side.
                began = asyncio.get_running_loop().time()
                grant = await asyncio.wait_for(ledger.grow(view, start, None, "hold-second", NANO, NANO, NANO,
                                                           "x:2:b"), BUDGET_DB_TIMEOUT_S)
                waited = asyncio.get_running_loop().time() - began
                assert grant.hold == "hold-second" and DATABASE_IDLE_TRANSACTION_S * 0.9 <= waited
                with pytest.raises(DBAPIError):  # its transaction is gone: the next statement finds the session ended
                    await connection.execute(select(1))
        finally:
            await stalled.aclose()
            await db.aclose()

    asyncio.run(main())


def test_a_spend_view_reads_once_while_the_writer_writes_without_pause(tmp_path):
    """The admin view of a budget is read beside this process's unwritten charges as one snapshot, under the usage
    writer's lock: one read a view, however busy the writer (a retry loop until no write landed during the read would
    spin for as long as writes come)."""
    async def main() -> None:
        db = await Database.open(f"sqlite:///{tmp_path}/spend.sqlite3")
        replica = Replica(db)
        view = await replica.store.put(BudgetConfig(key="busy", limit_usd=1000, period="daily"), "admin")
        reads = 0
        spend = replica.store.spend_report

        async def counted(*args, **kwargs):
            nonlocal reads
            reads += 1
            await asyncio.sleep(0.002)  # a read that takes a moment: writes land meanwhile
            return await spend(*args, **kwargs)

        replica.store.spend_report = counted  # type: ignore[method-assign]
        stop = asyncio.Event()
        admitted = 0

        async def writer() -> None:
            nonlocal admitted
            while not stop.is_set():
                r = replica.book.admit_now([view], NANO // 1000) or await replica.book.admit([view], NANO // 1000)
                admitted += 1
                replica.charges += replica.book.settle(r, NANO // 2000)
                await replica.write()

        writing = asyncio.ensure_future(writer())
        views = [await replica.book.spend_report([view]) for _ in range(20)]
        stop.set()
        await writing
        assert reads == 20 and admitted >= 15  # writes went on between the reads
        spent = [v[0]["spent_usd"] for v in views]
        assert spent == sorted(spent)  # each a consistent snapshot: spend never seen to go back
        await db.aclose()

    asyncio.run(main())
