"""Learning stays in its tenant (issue 55): a label counts for the user path it was posted under and below, a
profile serves the scope it was learned for, the response cache never hands one tenant an answer computed with
another's profile, and migration 0010 gives what was there before the operator's scope.

The black-box test runs a real server (``servers.start_decisiond``) over an OpenAI-shaped upstream that answers
every ticket deterministically (0.7 on its true team), so that "unchanged" can mean byte-equal."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import sqlalchemy as sa
import upstreams
from servers import start_decisiond

from decisiond.gateway.access_settings import in_subtree
from decisiond.gateway.profiles import ProfileBook, enclosing

MASTER = "scope-master-key-0123456789"
KEY_A = "scope-tenant-a-key-0123456789"
KEY_B = "scope-tenant-b-key-0123456789"
TEAMS = ["payments", "mobile", "sales"]
TEAM = {"type": "choice", "name": "team", "instructions": "Which team should take it?",
        "choices": [{"value": t} for t in TEAMS]}
WORDS = {"payments": ["invoice", "refund", "charged twice", "billing address", "credit card"],
         "mobile": ["app crashes", "login screen", "push notifications", "android update", "iphone battery"],
         "sales": ["pricing plans", "a demo", "enterprise quote", "discount", "a reseller"]}
OPENERS = ["Hello, I have a question about", "Please help with", "Urgent:", "We need to talk about",
           "Problem with"]
TICKETS = {f"{o} {w}.": team for team, ws in WORDS.items() for w in ws for o in OPENERS}
ORDERED = sorted(TICKETS)
TRAIN, HELD = ORDERED[::5] + ORDERED[1::5] + ORDERED[2::5] + ORDERED[3::5], ORDERED[4::5]  # 60 and 15
WRONG = {"payments": "mobile", "mobile": "sales", "sales": "payments"}  # tenant A's labels: every one wrong

CONFIG = """
auth:
  master_key: "{master}"
  keys:
    - {{name: tenant-a, key: "{a}", user_path: /tenants/a}}
    - {{name: tenant-b, key: "{b}", user_path: /tenants/b}}
database_url: "sqlite:///{database}"
learning: {{refresh_s: 0.5}}
providers:
  - {{name: knows, type: openai, base_url: "{upstream}/v1", api_key: sk-knows}}
models:
  - {{name: helpdesk, provider: knows, upstream: knows-1, store: true}}
"""


def knowing_upstream() -> upstreams.Upstream:
    """Every ticket's true team at 0.7, the others 0.15: the same bytes each time it is asked."""
    def handle(seen):
        body = seen.json()
        known = TICKETS[body["input"]]
        answers = [{"type": "choice", "name": q.get("name"), "choice": known, "confidence": 0.55,
                    "probabilities": [{"value": c["value"], "probability": 0.7 if c["value"] == known else 0.15}
                                      for c in q["choices"]]} for q in body["questions"]]
        return 200, {}, {"answers": answers, "model": "knows-1",
                         "usage": {"input_tokens": 10, "output_tokens": 0, "total_tokens": 10}}
    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scopes")
    upstream = knowing_upstream()
    config = folder / "gateway.yaml"
    config.write_text(CONFIG.format(master=MASTER, a=KEY_A, b=KEY_B, database=folder / "gw.sqlite3",
                                    upstream=upstream.url))
    server = start_decisiond("--config", str(config))
    yield server
    server.stop()
    upstream.stop()


def ask(server, key: str, text: str, cache: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"Cache-Control": cache} if cache else {})}
    response = httpx.post(server.url + "/v1/decisions", timeout=60, headers=headers,
                          json={"model": "helpdesk", "input": text, "questions": [TEAM]})
    assert response.status_code == 200, response.text
    return response


def label(server, key: str, request_id: str, team: str) -> None:
    posted = httpx.post(f"{server.url}/v1/decisions/{request_id}/labels", timeout=30,
                        headers={"Authorization": f"Bearer {key}"}, json={"labels": {"team": team}})
    assert posted.status_code == 200, posted.text


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {MASTER}"}, timeout=120,
                         **kwargs)


def probabilities(response: httpx.Response) -> list:
    return [answer["probabilities"] for answer in response.json()["answers"]]


def test_a_tenants_labels_move_only_its_own_answers(gateway):
    """Tenant A labels 60 tickets, every one with the wrong team; the operator learns. Tenant B's answers to 15
    other tickets are byte-for-byte what they were, with no profile, computed afresh and from the cache (after A
    asked the same tickets through its profile); A's answers go through A's profile. Then the operator's own labels
    (the master key's) teach a profile that serves everyone: B gets it, A keeps its own, the more specific; a
    rollback of A's hands A the operator's."""
    before = {text: probabilities(ask(gateway, KEY_B, text, "no-store")) for text in HELD}
    for text in TRAIN:
        label(gateway, KEY_A, ask(gateway, KEY_A, text, "no-store").headers["x-request-id"], WRONG[TICKETS[text]])

    learned = admin(gateway, "POST", "/admin/learn", json={"model": "helpdesk"}).json()
    (entry,) = learned["questions"]
    assert (entry["scope"], entry["labels"], entry["inherited_labels"], entry["teacher_labels"]) == (
        "/tenants/a", 60, 0, 0), entry
    assert entry["accepted"] == "calibration" and entry["profile"].startswith("prof_"), entry
    assert set(learned["scopes"]) == {"/tenants/a"} and learned["scopes"]["/tenants/a"]["accepted"] == 1
    tenant_a = entry["profile"]

    for text in HELD:  # A first, through the cache: its answers are stored under A's profiles
        mine = ask(gateway, KEY_A, text)
        assert mine.headers["x-decisiond-profile"] == tenant_a and probabilities(mine) != before[text]
    for cache in (None, "no-cache"):
        for text in HELD:
            theirs = ask(gateway, KEY_B, text, cache)
            assert "x-decisiond-profile" not in theirs.headers, (cache, theirs.headers)
            assert probabilities(theirs) == before[text], (cache, text)

    for text in TRAIN:  # the operator's labels, right ones, on decisions of its own
        label(gateway, MASTER, ask(gateway, MASTER, text, "no-store").headers["x-request-id"], TICKETS[text])
    learned = admin(gateway, "POST", "/admin/learn", json={"model": "helpdesk"}).json()
    by_scope = {q["scope"]: q for q in learned["questions"]}
    assert set(by_scope) == {"/", "/tenants/a"}, learned
    assert (by_scope["/"]["labels"], by_scope["/tenants/a"]["inherited_labels"]) == (60, 60)
    operator = by_scope["/"]["profile"]
    assert operator is not None and by_scope["/"]["accepted"] == "calibration", by_scope["/"]
    tenant_a = by_scope["/tenants/a"]["profile"] or tenant_a  # a new one of A's, or the one it had

    assert ask(gateway, KEY_B, HELD[0]).headers["x-decisiond-profile"] == operator
    assert ask(gateway, MASTER, HELD[0]).headers["x-decisiond-profile"] == operator
    assert ask(gateway, KEY_A, HELD[0]).headers["x-decisiond-profile"] == tenant_a
    listed = admin(gateway, "GET", "/admin/profiles", params={"model": "helpdesk", "scope": "/tenants/a"}).json()
    assert {p["scope"] for p in listed["data"]} == {"/tenants/a"} and any(p["id"] == tenant_a for p in listed["data"])
    quality = admin(gateway, "GET", "/admin/quality", params={"model": "helpdesk", "user_path": "/tenants/a"}).json()
    (row,) = quality["questions"]
    assert row["labels_by_scope"] == {"/": 60, "/tenants/a": 60} and row["profile"]["id"] == tenant_a
    assert {p["scope"] for p in row["profiles"]} == {"/", "/tenants/a"}

    rolled = admin(gateway, "PUT", f"/admin/profiles/{tenant_a}", json={"active": False}).json()
    assert rolled["scope"] == "/tenants/a"
    deadline = time.monotonic() + 10
    while ask(gateway, KEY_A, HELD[1]).headers.get("x-decisiond-profile") != operator:
        assert time.monotonic() < deadline, "A is not served the operator's profile after the rollback"
        time.sleep(0.2)


def test_scope_parameters_are_checked(gateway):
    for path, param in (("/admin/profiles", "scope"), ("/admin/quality", "user_path")):
        bad = admin(gateway, "GET", path, params={"model": "helpdesk", param: "tenants/a"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


# ------------------------------------------------------------------------------------------------- serving, pure

def test_a_request_is_served_by_the_most_specific_enclosing_profile_and_the_cache_keys_on_them():
    paths = ["/", "/t", "/t/a", "/t/a/bob", "/t/ab", "/u", "/t/b"]
    for path in paths:
        for root in paths:
            assert (root in enclosing(path)) == in_subtree(path, root), (path, root)

    book = ProfileBook()
    params = {"temperature": 1.0, "bias": [0.0, 0.0]}
    book.replace([("p-global", "m", "sig", "/", "calibration", params),
                  ("p-a", "m", "sig", "/t/a", "calibration", params),
                  ("p-other", "m", "other", "/t/b", "calibration", params)])
    assert [book.serving("m", "sig", p).id for p in ("/t/a/bob", "/t/a", "/t/ab", "/t/b", "/")] == [
        "p-a", "p-a", "p-global", "p-global", "p-global"]
    assert book.serving("m", "other", "/t/a") is None and book.serving("m", "other", "/t/b/x").id == "p-other"
    generations = {p: book.generation(p) for p in ("/t/a", "/t/a/bob", "/t/b", "/t/c", "/")}
    assert generations["/t/a"] == generations["/t/a/bob"] != generations["/t/c"]
    assert generations["/t/b"] not in (generations["/t/a"], generations["/t/c"])
    assert generations["/t/c"] == generations["/"] != ""
    book.replace([])
    assert book.generation("/t/a") == ""


# ------------------------------------------------------------------------------------------------ the migration

@pytest.fixture(scope="module")
def postgres():
    from services import start_postgres

    server = start_postgres()
    yield server
    server.remove()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/scopes.sqlite3"
    import subprocess

    server = request.getfixturevalue("postgres")
    name = f"s{tmp_path.name.replace('-', '_').lower()}"[:60]
    subprocess.run([*server.as_user, str(server.bin / "createdb"), "-h", "127.0.0.1", "-p", str(server.port),
                    "-U", "postgres", name], check=True, capture_output=True)
    return f"postgresql://postgres@127.0.0.1:{server.port}/{name}"


DECISIONS = sa.table("decisions", *(sa.column(c, t) for c, t in (
    ("request_id", sa.String), ("key_id", sa.String), ("user_path", sa.String), ("model", sa.String),
    ("time", sa.DateTime(timezone=True)), ("expires_at", sa.DateTime(timezone=True)), ("request", sa.JSON),
    ("questions", sa.JSON), ("answers", sa.JSON), ("steps", sa.JSON), ("teacher", sa.JSON), ("labels", sa.JSON),
    ("labelled_at", sa.DateTime(timezone=True)))))
PROFILES = sa.table("profiles", *(sa.column(c, t) for c, t in (
    ("id", sa.String), ("model", sa.String), ("target", sa.String), ("question", sa.String),
    ("signature", sa.String), ("version", sa.Integer), ("kind", sa.String), ("params", sa.JSON),
    ("metrics", sa.JSON), ("accepted", sa.Boolean), ("active", sa.Boolean),
    ("created_at", sa.DateTime(timezone=True)))))


def _migrate(connection, revision: str, down: bool = False) -> None:
    from alembic import command
    from alembic.config import Config

    from decisiond.store.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    (command.downgrade if down else command.upgrade)(config, revision)


def _decision(request_id: str, labels: dict | None, teacher: dict | None = None) -> dict:
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    return {"request_id": request_id, "key_id": None, "user_path": "/t/a", "model": "m", "time": now,
            "expires_at": now + timedelta(days=1), "request": {"input": request_id}, "answers": [[0.5, 0.5]],
            "questions": [{"name": "q", "type": "yes_no", "values": [True, False], "signature": "sig"}],
            "steps": None, "teacher": teacher, "labels": labels, "labelled_at": now if labels else None}


def test_migration_0010_gives_old_labels_and_profiles_the_operator_scope(database_url):
    """A database at 0008 with a labelled decision, an unlabelled one and an active profile, upgraded: the label's
    scope is /, the profile's / and still active; one active profile per scope is allowed, two in one scope are
    not; learning lists only decisions with a label or a teacher label (a JSON null is none); a downgrade
    deactivates the tenant's profile and drops the scopes."""
    from datetime import datetime, timezone

    from sqlalchemy.exc import IntegrityError
    from sqlalchemy.ext.asyncio import create_async_engine

    from decisiond.gateway.profile_store import ProfileStore
    from decisiond.store.db import Database
    from decisiond.store.db import database_url as async_url

    now = datetime.now(timezone.utc)
    profile = {"model": "m", "target": "m", "question": "q", "signature": "sig", "version": 1,
               "kind": "calibration", "params": {"temperature": 1.0, "bias": [0.0, 0.0]}, "metrics": {},
               "accepted": True, "active": True, "created_at": now}

    def seed(connection):
        _migrate(connection, "0008")
        connection.execute(sa.insert(DECISIONS), [_decision("labelled", {"q": True}), _decision("bare", None),
                                                  _decision("taught", None, {"q": [0.2, 0.8]})])
        connection.execute(sa.insert(PROFILES).values(id="p-old", **profile))

    def tenant_profile(connection, profile_id: str, scope: str):
        scoped = sa.table("profiles", *(sa.column(c.name, c.type) for c in PROFILES.columns),
                          sa.column("scope", sa.String))
        connection.execute(sa.insert(scoped).values(id=profile_id, scope=scope, **profile))

    async def scenario():
        engine = create_async_engine(async_url(database_url))
        async with engine.begin() as conn:
            await conn.run_sync(seed)
        await engine.dispose()
        db = await Database.open(database_url)  # to the head
        try:
            scoped = sa.table("decisions", sa.column("request_id", sa.String), sa.column("label_scopes", sa.JSON))
            async with db.engine.connect() as conn:
                scopes = (await conn.execute(sa.select(scoped.c.request_id, scoped.c.label_scopes)
                                             .order_by(scoped.c.request_id))).all()
            assert [tuple(r) for r in scopes] == [("bare", None), ("labelled", {"q": "/"}), ("taught", None)]
            store = ProfileStore(db)
            assert [(i, scope) for i, _, _, scope, _, _ in await store.active()] == [("p-old", "/")]
            assert await store.labelled_ids("m") in (["labelled", "taught"], ["taught", "labelled"])
            async with db.engine.begin() as conn:
                await conn.run_sync(tenant_profile, "p-tenant", "/t/a")
            with pytest.raises(IntegrityError):
                async with db.engine.begin() as conn:
                    await conn.run_sync(tenant_profile, "p-twin", "/t/a")
            assert sorted(i for i, *_ in await store.active()) == ["p-old", "p-tenant"]
            async with db.engine.begin() as conn:
                await conn.run_sync(_migrate, "0008", True)
                active = (await conn.execute(sa.text("SELECT id FROM profiles WHERE active"))).scalars().all()
                columns = list((await conn.execute(sa.text("SELECT * FROM profiles"))).keys())
                decision_columns = list((await conn.execute(sa.text("SELECT * FROM decisions"))).keys())
            assert active == ["p-old"] and "scope" not in columns and "label_scopes" not in decision_columns
        finally:
            await db.aclose()

    asyncio.run(scenario())
