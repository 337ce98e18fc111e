"""The key store on both databases it supports: a SQLite file and a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import datetime, timedelta, timezone

import pytest
from servers import run_decisiond
from services import start_postgres

from decisiond.store.db import Database
from decisiond.store.keys import KeyStore, split_key


@pytest.fixture(scope="module")
def postgres():
    server = start_postgres()
    yield server
    server.remove()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/nested/keys.sqlite3"
    server = request.getfixturevalue("postgres")
    name = f"k{tmp_path.name.replace('-', '_').lower()}"[:60]
    import subprocess

    subprocess.run([*server.as_user, str(server.bin / "createdb"), "-h", "127.0.0.1", "-p", str(server.port),
                    "-U", "postgres", name], check=True, capture_output=True)
    return f"postgresql://postgres@127.0.0.1:{server.port}/{name}"


def run(coro):
    return asyncio.run(coro)


def test_create_verify_list_revoke(database_url):
    async def scenario():
        db = await Database.open(database_url)
        store = KeyStore(db)
        try:
            record, key = await store.create("alpha", "/team/alpha", ["tiny", "openai/*"],
                                             {"requests_per_minute": 3})
            assert split_key(key) == (record.id, key.split("-", 2)[2])
            found = await store.verify(key)
            assert found is not None and found.id == record.id and found.user_path == "/team/alpha"
            assert found.models == ["tiny", "openai/*"] and found.rate_limits == {"requests_per_minute": 3}
            assert found.status() == "active"
            # A wrong secret for a real id, an unknown id, and something that is not a key at all.
            assert await store.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
            assert await store.verify("dk-0000000000000000-" + key.split("-", 2)[2]) is None
            assert await store.verify("sk-not-ours") is None
            listed = await store.list()
            assert [r.id for r in listed] == [record.id]
            assert key not in repr(listed) and key.split("-", 2)[2] not in str([r.public() for r in listed])
            revoked = await store.revoke(record.id)
            assert revoked is not None and revoked.status() == "revoked"
            assert (await store.verify(key)).status() == "revoked"
            assert await store.revoke("nope") is None
            past = datetime.now(timezone.utc) - timedelta(seconds=1)
            old, old_key = await store.create("old", expires_at=past)
            assert (await store.verify(old_key)).status() == "expired"
            assert old.guardrails == [] and old.public()["guardrails"] == []
            guarded, guarded_key = await store.create("guarded", guardrails=["pii", "injection"])
            assert (await store.verify(guarded_key)).guardrails == ["pii", "injection"]
            assert (await store.get(guarded.id)).public()["guardrails"] == ["pii", "injection"]
        finally:
            await db.aclose()

    run(scenario())


def test_migrations_are_idempotent_and_versioned(database_url):
    async def scenario():
        for _ in range(2):  # a second start finds the schema current
            db = await Database.open(database_url)
            async with db.engine.connect() as conn:
                from sqlalchemy import text

                version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
            await db.aclose()
            assert version == head  # the newest migration

    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from decisiond.store.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None and head >= "0002"

    run(scenario())


def test_keys_made_before_key_guardrails_migrate_without_any(database_url):
    """A database at 0002 (keys without a guardrails column) upgraded to the head: its keys still verify, with no
    guardrails; a downgrade drops the column again (SQLite copies the table)."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from decisiond.store.db import MIGRATIONS
    from decisiond.store.db import database_url as async_url
    from decisiond.store.keys import hash_secret

    def migrate(connection, revision, down=False):
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)

    async def scenario():
        engine = create_async_engine(async_url(database_url))
        async with engine.begin() as conn:
            await conn.run_sync(migrate, "0002")
            await conn.execute(text(
                "INSERT INTO api_keys (id, name, salt, secret_hash, user_path, created_at) "
                "VALUES ('0123456789abcdef', 'old', '00', :hash, '/old', CURRENT_TIMESTAMP)"),
                {"hash": hash_secret("00", "s3cret")})
        await engine.dispose()
        db = await Database.open(database_url)  # to the head
        try:
            record = await KeyStore(db).verify("dk-0123456789abcdef-s3cret")
            assert record is not None and record.user_path == "/old" and record.guardrails == []
            async with db.engine.begin() as conn:
                await conn.run_sync(migrate, "0002", True)
                columns = list((await conn.execute(text("SELECT * FROM api_keys"))).keys())
            assert "guardrails" not in columns and "user_path" in columns
        finally:
            await db.aclose()

    run(scenario())


def test_only_a_salted_hash_is_stored(tmp_path):
    path = tmp_path / "keys.sqlite3"

    async def scenario():
        db = await Database.open(f"sqlite:///{path}")
        first = await KeyStore(db).create("a")
        second = await KeyStore(db).create("b")
        await db.aclose()
        return first, second

    (r1, k1), (r2, k2) = run(scenario())
    raw = path.read_bytes()
    for key in (k1, k2):
        assert key.split("-", 2)[2].encode() not in raw
    rows = sqlite3.connect(path).execute("SELECT salt, secret_hash FROM api_keys").fetchall()
    assert len({salt for salt, _ in rows}) == 2 and all(len(h) == 64 for _, h in rows)


def test_keys_cli_creates_lists_and_revokes(tmp_path):
    import json

    url = f"sqlite:///{tmp_path}/cli.sqlite3"

    def cli(*args):
        return run_decisiond("keys", "--database-url", url, *args, timeout=120)

    created = cli("create", "--name", "ci", "--user-path", "/ci", "--models", "tiny,openai/*", "--rpm", "5")
    assert created.returncode == 0, created.stderr
    record = json.loads(created.stdout)
    assert record["key"].startswith("dk-") and record["models"] == ["tiny", "openai/*"]
    assert record["rate_limits"] == {"requests_per_minute": 5} and "shown once" in created.stderr
    listed = cli("list")
    assert record["id"] in listed.stdout and record["key"].split("-", 2)[2] not in listed.stdout
    assert cli("revoke", record["id"]).returncode == 0
    assert "revoked" in cli("list").stdout
    assert cli("revoke", "nope").returncode == 1
    assert cli("create", "--name", "x", "--user-path", "bad").returncode == 2
    # Guardrails are checked against the server's config: without one, no name is known.
    config = tmp_path / "gateway.yaml"
    config.write_text(f"database_url: {url}\nguardrails:\n  - {{name: pii, type: pii, action: redact}}\n")

    def configured(*args):
        return run_decisiond("keys", "--config", str(config), *args, timeout=120)

    unknown = configured("create", "--name", "g", "--guardrails", "pii,nope")
    assert unknown.returncode == 2 and "'nope'" in unknown.stderr and "'pii'" in unknown.stderr
    assert cli("create", "--name", "g", "--guardrails", "pii").returncode == 2
    guarded = configured("create", "--name", "g", "--guardrails", "pii")
    assert guarded.returncode == 0, guarded.stderr
    assert json.loads(guarded.stdout)["guardrails"] == ["pii"]

    async def verify():
        db = await Database.open(url)
        try:
            return await KeyStore(db).verify(record["key"])
        finally:
            await db.aclose()

    assert run(verify()).status() == "revoked"
