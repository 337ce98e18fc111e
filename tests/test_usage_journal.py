"""An answered request always leaves its usage row: through a SIGKILL right after the answers (SQLite and a real
PostgreSQL server), through a replay that meets rows already written, and past a record the database refuses (a
string longer than its column, a number out of its column's range: on PostgreSQL, isolated while the rest of its
batch lands)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import upstreams
from servers import start_decisiond
from services import start_postgres
from sqlalchemy import func, select

from decisiond.gateway.journal import Journal, default_directory, encode_row
from decisiond.gateway.usage import UsageRecord
from decisiond.gateway.usage_writer import UsageWriter, fit
from decisiond.limits import USAGE_CUT_MARKER
from decisiond.store.db import Database
from decisiond.store.tables import UsageRow

MASTER = "journal-master-key-0123456789"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
ANSWERED = 50

CONFIG = """
auth: {master_key: "${TEST_MASTER}"}
database_url: "${TEST_DB}"
providers:
  - {name: openai, type: openai, base_url: "${UP_OPENAI}/v1", api_key: sk-test, pricing: {input_per_mtok: 2.0}}
models:
  - {name: luna, provider: openai, upstream: gpt-6-luna}
"""


def absurd_usage_server() -> upstreams.Upstream:
    """An OpenAI-like upstream that reports 2**40 input tokens for an input saying "absurd" (a value the usage
    table's integer column cannot hold, so that the database refuses that one row), and a model name of 300
    characters for one saying "long name" (longer than its column)."""
    inner = upstreams.openai_server()

    def handle(seen):
        status, headers, body = inner.handler(seen)
        text = json.dumps(seen.json().get("input"))
        if "absurd" in text:
            body["usage"]["input_tokens"] = 2**40
        if "long name" in text:
            body["model"] = "m" * 300
        return status, headers, body

    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def upstream():
    up = absurd_usage_server()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def postgres_url():
    postgres = start_postgres()
    try:
        yield postgres.url
    finally:
        postgres.remove()


def serve(upstream, database: str, folder: Path):
    config = folder / "gateway.yaml"
    config.write_text(CONFIG)
    return start_decisiond("--config", str(config), env={
        "TEST_MASTER": MASTER, "TEST_DB": database, "UP_OPENAI": upstream.url,
        "DECISIOND_DATA_DIR": str(folder / "data")})


def ask(client: httpx.Client, server, text: str = "I was charged twice.", model: str = "luna") -> httpx.Response:
    return client.post(server.url + "/v1/decisions", headers=ADMIN,
                       json={"model": model, "input": text, "questions": [QUESTION]})


def audit_rows(server, wanted: int, timeout: float = 30) -> list[dict]:
    """The audit rows once there are ``wanted`` of them (or what there is when ``timeout`` has passed)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = httpx.get(server.url + "/admin/audit", headers=ADMIN, params={"limit": 1000}, timeout=30).json()["data"]
        if len(rows) >= wanted or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ through a SIGKILL


def test_a_sigkill_right_after_the_answers_loses_no_usage_row(upstream, database, tmp_path):
    """50 answered requests, then SIGKILL at once (the writer has had no time to write them all), then a restart:
    exactly the 50 rows, each once, whatever the database."""
    server = serve(upstream, database, tmp_path)
    answered: list[str] = []
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(ANSWERED):
                response = ask(client, server, f"Charge number {i} came twice.")
                assert response.status_code == 200, response.text
                answered.append(response.headers["x-request-id"])
    finally:
        server.process.kill()
        server.process.wait(30)
    restarted = serve(upstream, database, tmp_path)
    try:
        rows = audit_rows(restarted, ANSWERED)
        time.sleep(0.5)  # nothing more may come: a replay inserts nothing twice
        rows = audit_rows(restarted, ANSWERED)
        assert sorted(r["request_id"] for r in rows) == sorted(answered)
        assert len({r["record_id"] for r in rows}) == ANSWERED and all(r["status"] == 200 for r in rows)
        assert "usage journal of a stopped process replayed" in restarted.log()
    finally:
        restarted.stop()
    journal = default_directory(database) if database.startswith("sqlite") else tmp_path / "data" / "usage-journal"
    left = [p.name for p in journal.rglob("*") if p.is_file()]
    assert left == [], left  # a clean stop with the database up leaves no journal behind


# ------------------------------------------------------------------------------------------- bad records


def test_a_record_the_database_refuses_is_set_aside_and_the_others_land(upstream, postgres_url, tmp_path):
    """On PostgreSQL, through the server: a model name longer than its column is cut (with the marker) and lands;
    a row the database refuses whatever is done to it (2**40 tokens reported by the upstream) goes to the
    dead-letter file and the metric, and every other row still lands."""
    server = serve(upstream, postgres_url, tmp_path)
    try:
        with httpx.Client(timeout=30) as client:
            ids = [ask(client, server).headers["x-request-id"] for _ in range(5)]
            long_name = ask(client, server, "This one has a long name.")
            assert long_name.status_code == 200
            absurd = ask(client, server, "This one is absurd.")
            assert absurd.status_code == 200
            ids += [ask(client, server).headers["x-request-id"] for _ in range(5)]
        rows = audit_rows(server, 11)
        assert {r["request_id"] for r in rows} == {*ids, long_name.headers["x-request-id"]}
        cut = next(r for r in rows if r["request_id"] == long_name.headers["x-request-id"])
        assert len(cut["upstream_model"]) == 256 and cut["upstream_model"].endswith(USAGE_CUT_MARKER)
        metrics = httpx.get(server.url + "/metrics", headers=ADMIN).text
        assert "decisiond_usage_dead_letters_total 1.0" in metrics
    finally:
        server.stop()
    (journal,) = (tmp_path / "data" / "usage-journal").iterdir()
    (letter,) = (journal / "dead-letter.jsonl").read_text().splitlines()
    kept = json.loads(letter)
    assert kept["record"]["request_id"] == absurd.headers["x-request-id"] and "out of int32 range" in kept["error"]


def record(request_id: str, **fields) -> UsageRecord:
    values = dict(time=datetime.now(timezone.utc), request_id=request_id, key_id=None, user_path="/",
                  request_type="decisions", dialect="openai", requested_model="luna", resolved_model="luna",
                  provider="openai", model="luna", upstream_model="gpt-6-luna", attempts=1, targets=["luna"],
                  input_tokens=50, cached_tokens=0, output_tokens=0, cost=0.0001, status=200, error_code=None,
                  latency_ms=3.0)
    values.update(fields)
    return UsageRecord(**values)


async def rows_of(db: Database) -> list[UsageRow]:
    async with db.session() as session:
        return list((await session.execute(select(UsageRow).order_by(UsageRow.id))).scalars())


def test_one_bad_record_in_a_batch_is_isolated_on_postgresql(postgres_url, tmp_path):
    """Forty records written as one batch, one of them beyond any fitting (a token count out of the column's
    range) and one with strings longer than their columns: the batch is split until the bad one is alone; it is
    dead-lettered, the 39 others land, the long strings cut with the marker."""

    async def main() -> None:
        db = await Database.open(postgres_url)
        writer = UsageWriter(db, journal=Journal.open(tmp_path / "journal"))
        for i in range(40):
            fields = {"input_tokens": 2**40} if i == 17 else {"guardrail": "g" * 500, "model": "x" * 400} \
                if i == 3 else {}
            writer.submit(record(f"batch_{i}", **fields))
        writer.start()  # one batch: every record is journaled before the writer runs
        await writer.aclose()
        rows = [r for r in await rows_of(db) if r.request_id.startswith("batch_")]  # (the database is shared)
        await db.aclose()
        assert sorted(r.request_id for r in rows) == sorted(f"batch_{i}" for i in range(40) if i != 17)
        long = next(r for r in rows if r.request_id == "batch_3")
        assert len(long.guardrail) == 200 and long.guardrail.endswith(USAGE_CUT_MARKER)
        assert len(long.model) == 256 and long.model.endswith(USAGE_CUT_MARKER)
        assert writer.dead_letters == 1 and writer.written == 39
        (letter,) = (tmp_path / "journal" / "dead-letter.jsonl").read_text().splitlines()
        assert json.loads(letter)["record"]["request_id"] == "batch_17"

    asyncio.run(main())


def test_fit_cuts_strings_to_their_columns_and_fills_defaults():
    row = {**record("r", model="é" * 300, guardrail="a\x00b", upstream_model="\ud800x").row(), "attempts": None,
           "not_a_column": 1}
    fitted = fit(row)
    assert fitted["model"] == "é" * (256 - len(USAGE_CUT_MARKER)) + USAGE_CUT_MARKER
    assert fitted["guardrail"] == "a\ufffdb" and fitted["upstream_model"] == "?x"
    assert fitted["attempts"] == 0 and "not_a_column" not in fitted and "id" not in fitted


# ------------------------------------------------------------------------------------------------ replays


def test_a_replay_inserts_each_record_once_and_keeps_rows_sharing_a_request_id(tmp_path):
    """A dead process's journal whose records are partly in the database already (it was killed after the insert,
    before deleting the segment), with two rows of one request (a judge call and the request), and the torn last
    line of a write cut short: each record is in the database once, the torn line is skipped, the files go."""
    url = f"sqlite:///{tmp_path}/usage.sqlite3"
    directory = tmp_path / "journal"

    async def main() -> None:
        db = await Database.open(url)
        first = UsageWriter(db, journal=Journal.open(directory))
        for i in range(3):
            first.submit(record(f"req_{i}"))
        first.start()
        await first.aclose()
        written = await rows_of(db)
        assert len(written) == 3
        # The journal of a process killed after its insert and before its segment was deleted.
        dead = directory / "4242-deadbeef.0.jsonl"
        lines = [encode_row({c: getattr(r, c) for c in UsageRow.__table__.columns.keys() if c != "id"})
                 for r in written]
        judge = {**record("req_9", request_type="guardrail").row(), "record_id": "a" * 32}
        own = {**record("req_9").row(), "record_id": "b" * 32}
        dead.write_bytes(b"".join(lines) + encode_row(judge) + encode_row(own) + encode_row(own)[:40])
        (directory / "4242-deadbeef.lock").touch()
        second = UsageWriter(db, journal=Journal.open(directory))
        second.start()
        await second.aclose()
        rows = await rows_of(db)
        async with db.session() as session:
            distinct = (await session.execute(select(func.count(func.distinct(UsageRow.record_id))))).scalar()
        await db.aclose()
        assert sorted(r.request_id for r in rows) == ["req_0", "req_1", "req_2", "req_9", "req_9"]
        assert distinct == 5
        assert sorted(p.name for p in directory.iterdir()) == []

    asyncio.run(main())


def test_a_live_process_journal_is_not_taken_and_one_per_process(tmp_path):
    """Two journals on one directory (two replicas on one host): each its own files; neither takes the other's
    while it lives; once one is gone (its lock released, its segments left), the other takes them."""
    a, b = Journal.open(tmp_path), Journal.open(tmp_path)
    assert a.stem != b.stem and str(os.getpid()) in a.stem
    a.append({"record_id": "x" * 32, "time": datetime.now(timezone.utc)})
    assert list(b.orphans()) == []
    a.close()  # a record left: its segment stays for the next process, its lock is let go
    (orphan,) = list(b.orphans())
    assert [p.name for p in orphan.segments] == [f"{a.stem}.0.jsonl"]
    for segment in orphan.segments:
        segment.unlink()
    orphan.release()
    b.close()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ a busy database


def test_a_locked_sqlite_database_holds_rows_back_and_sends_none_to_the_dead_letters(tmp_path):
    """Another connection holds SQLite's write lock past the busy timeout while a batch is written: the batch is
    put off, not split and dead-lettered; once the lock goes, every row lands, each once."""
    import sqlite3

    path = tmp_path / "usage.sqlite3"

    async def main() -> None:
        db = await Database.open(f"sqlite:///{path}")
        writer = UsageWriter(db, journal=Journal.open(tmp_path / "journal"))
        lock = sqlite3.connect(path, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the write lock, held by another connection
        for i in range(30):
            writer.submit(record(f"locked_{i}"))
        writer.start()
        while writer.deferred == 0:  # the writer met the lock, gave up after the busy timeout, and put it off
            await asyncio.sleep(0.05)
        assert writer.written == 0 and writer.dead_letters == 0
        lock.execute("ROLLBACK")
        lock.close()
        while writer.written < 30:
            await asyncio.sleep(0.05)
        await writer.aclose()
        rows = await rows_of(db)
        await db.aclose()
        assert sorted(r.request_id for r in rows) == sorted(f"locked_{i}" for i in range(30))
        assert writer.dead_letters == 0 and not (tmp_path / "journal" / "dead-letter.jsonl").exists()

    asyncio.run(main())


def test_a_connection_dropped_mid_batch_on_postgresql_is_retried_not_dead_lettered(postgres_url, tmp_path):
    """A batch waits on a table lock held by another session, and its connection is then terminated (as a restart,
    a failover or a network cut does): the error is the database's state, not the records'; the batch is retried
    whole and lands once the lock goes, with no dead letter."""
    import asyncpg
    from sqlalchemy.engine import make_url

    async def main() -> None:
        db = await Database.open(postgres_url)
        url = make_url(postgres_url)
        other = await asyncpg.connect(host=url.host, port=url.port, user=url.username, database=url.database,
                                      password=url.password)
        writer = UsageWriter(db, journal=Journal.open(tmp_path / "journal"))
        await other.execute("BEGIN")
        await other.execute("LOCK TABLE usage IN ACCESS EXCLUSIVE MODE")
        for i in range(30):
            writer.submit(record(f"dropped_{i}"))
        writer.start()
        waiting: list = []
        while not waiting:  # the writer's INSERT, blocked on the lock
            waiting = await other.fetch("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            await asyncio.sleep(0.05)
        await other.execute("SELECT pg_terminate_backend($1)", waiting[0]["pid"])
        while writer.deferred == 0:
            await asyncio.sleep(0.05)
        await other.execute("COMMIT")
        await other.close()
        while writer.written < 30:
            await asyncio.sleep(0.05)
        await writer.aclose()
        rows = [r for r in await rows_of(db) if r.request_id.startswith("dropped_")]
        await db.aclose()
        assert sorted(r.request_id for r in rows) == sorted(f"dropped_{i}" for i in range(30))
        assert writer.dead_letters == 0 and not (tmp_path / "journal" / "dead-letter.jsonl").exists()

    asyncio.run(main())


def test_an_idle_writer_without_a_journal_waits_instead_of_spinning(tmp_path, monkeypatch):
    """With nothing to write and no journal to scan, the writer sleeps until a record comes (it once polled with a
    timeout of 0: thousands of turns a second)."""

    async def main() -> None:
        db = await Database.open(f"sqlite:///{tmp_path}/usage.sqlite3")
        writer = UsageWriter(db)
        turns = 0
        pending = writer._pending

        def counted() -> bool:
            nonlocal turns
            turns += 1
            return pending()

        monkeypatch.setattr(writer, "_pending", counted)
        writer.start()
        for _ in range(20):
            await asyncio.sleep(0.01)
        idle = turns
        writer.submit(record("after_idle"))
        await writer.aclose()
        rows = await rows_of(db)
        await db.aclose()
        assert idle <= 2 and [r.request_id for r in rows] == ["after_idle"]

    asyncio.run(main())
