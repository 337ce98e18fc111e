"""Budgets that hold, attacked the way they break: 40 chats at once on one replica (SQLite) and on two replicas
sharing a real PostgreSQL, against an upstream that bills ~800 output tokens an answer; decisions whose upstream
counts more tokens than a 4-characters-a-token estimate; a replica killed while it holds a reservation; a judge
whose calls cost money. The guarantee: spend never passes a limit by more than one request's cost above its
reservation — which an honest upstream never exceeds, so spend stays within the limit."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import upstreams
from servers import start_decisiond
from services import start_postgres

MASTER = "budget-master-key-0123456789"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
# 9 input tokens and 800 output tokens an answer, at $1,000 per million either way: $0.809 a chat. The model may bill
# at most 1,000 output tokens, so a chat reserves (9 + 2 × 32 template tokens) × $0.001 + $1.00 = $1.073.
PER_CHAT = (9 + 800) * 1000 / 1e6
PRICED = """
  - {name: pricey, provider: chat, upstream: ok, capabilities: [chat], max_output_tokens: 1000,
     pricing: {input_per_mtok: 1000, output_per_mtok: 1000}}
  - {name: hanging, provider: chat, upstream: hang, capabilities: [chat], max_output_tokens: 1000,
     pricing: {input_per_mtok: 1000, output_per_mtok: 1000}}
  - {name: counted, provider: counting, upstream: gpt-6-luna, pricing: {input_per_mtok: 1000}}
  - {name: judge-priced, provider: counting, upstream: judge, pricing: {per_request: 0.01}}
  - {name: judged, provider: counting, upstream: gpt-6-luna, guardrails: [judge]}
  - {name: wrong, provider: lying, upstream: gpt-6-luna, pricing: {input_per_mtok: 1000}}
"""
VIRTUAL = """
virtual_models:
  - {name: wrong-then-counted, targets: [wrong, counted]}
"""


def config(database: str) -> str:
    return f"""
auth:
  master_key: "${{TEST_MASTER}}"
database_url: "{database}"
budget_reservation_ttl_s: 3600
cache: {{enabled: false}}
guardrails:
  - {{name: judge, type: decision_judge, model: judge-priced, instructions: "Is this rude?", user_path: /guardrails/j,
     threshold: 0.99}}
providers:
  - {{name: chat, type: openai, base_url: "${{CHAT}}/v1"}}
  - {{name: counting, type: openai, base_url: "${{COUNTING}}/v1"}}
  - {{name: lying, type: openai, base_url: "${{LYING}}/v1"}}
models:{PRICED}{VIRTUAL}"""


def counting_server() -> upstreams.Upstream:
    """OpenAI's Decisions API, billing as many input tokens as the request's input has bytes, once per question:
    more than a 4-characters-a-token estimate, never more than a byte-level tokenizer could count."""
    def handle(seen):
        body = seen.json()
        text = body["input"] if isinstance(body["input"], str) else json.dumps(body["input"])
        tokens = len(text.encode()) * len(body["questions"])
        return 200, {}, {"answers": [upstreams.openai_answer(q, i) for i, q in enumerate(body["questions"])],
                         "model": body["model"], "usage": {"input_tokens": tokens, "output_tokens": 0,
                                                           "total_tokens": tokens}}
    return upstreams.Upstream(handle).start()


def lying_server() -> upstreams.Upstream:
    """OpenAI's Decisions API answering with a probability outside [0, 1] — and billing 100 input tokens for it."""
    def handle(seen):
        body = seen.json()
        answers = [{**upstreams.openai_answer(q, i), "probability": 7.5} for i, q in enumerate(body["questions"])]
        return 200, {}, {"answers": answers, "model": body["model"],
                         "usage": {"input_tokens": 100, "output_tokens": 0, "total_tokens": 100}}
    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def ups():
    servers = {"CHAT": upstreams.ChatUpstream(output_tokens=800), "COUNTING": counting_server(),
               "LYING": lying_server()}
    yield servers
    for server in servers.values():
        server.stop()


def start(folder, database: str, ups) -> object:
    path = folder / "gateway.yaml"
    path.write_text(config(database))
    return start_decisiond("--config", str(path), env={"TEST_MASTER": MASTER, "CHAT": ups["CHAT"].url,
                                                       "COUNTING": ups["COUNTING"].url, "LYING": ups["LYING"].url})


@pytest.fixture(scope="module")
def single(ups, tmp_path_factory):
    folder = tmp_path_factory.mktemp("budgets-sqlite")
    server = start(folder, f"sqlite:///{folder}/budgets.sqlite3", ups)
    yield server
    server.stop()


def new_key(server, **fields) -> dict:
    created = httpx.post(server.url + "/admin/keys", headers=ADMIN, json={"name": "spender", **fields})
    assert created.status_code == 201, created.text
    return created.json()


def put_budget(server, **fields) -> str:
    put = httpx.put(server.url + "/admin/budgets", headers=ADMIN, json={"period": "daily", **fields})
    assert put.status_code == 200, put.text
    return put.json()["id"]


def budget(server, ident: str) -> dict:
    listed = httpx.get(server.url + "/admin/budgets", headers=ADMIN).json()["data"]
    return next(b for b in listed if b["id"] == ident)


def settled(server, ident: str) -> dict:
    """The budget once no reservation is in flight (a request settles a moment after its client has the answer)."""
    deadline = time.monotonic() + 20
    while (view := budget(server, ident))["reservations"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return view


def chat(server, key: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:
        if stream:
            chunks = list(client.chat.completions.create(model="pricey", stream=True,
                                                         messages=[{"role": "user", "content": "Say hello"}]))
            assert all(c.usage is None for c in chunks)  # usage was not asked: none is shown
        else:
            client.chat.completions.create(model="pricey", messages=[{"role": "user", "content": "Say hello"}])
        return 200
    except openai.APIStatusError as error:
        assert error.status_code == 402 and error.code == "budget_exceeded", error.message
        return 402


def forty_chats(servers: list, key: str) -> list[int]:
    with ThreadPoolExecutor(40) as pool:
        return list(pool.map(lambda i: chat(servers[i % len(servers)], key, stream=i % 2 == 1), range(40)))


def test_forty_concurrent_chats_on_one_replica_stay_within_the_budget(single, ups):
    key = new_key(single)
    ident = put_budget(single, key=key["id"], limit_usd=20)
    calls = len(ups["CHAT"].seen)
    statuses = forty_chats([single], key["key"])
    answered = statuses.count(200)
    after = settled(single, ident)
    assert after["spent_usd"] <= 20 + 1e-9  # never past the limit
    assert after["spent_usd"] == pytest.approx(answered * PER_CHAT)  # every answered chat is charged, streamed too
    assert after["reserved_usd"] == 0 and after["reservations"] == 0
    assert answered >= 18  # the room is used: 20 / 1.073 reservations fit at once, more as they settle
    assert len(ups["CHAT"].seen) - calls == answered  # a refused chat never reached the upstream


def test_forty_concurrent_chats_on_two_replicas_sharing_postgresql(ups, tmp_path_factory):
    postgres = start_postgres()
    replicas = []
    try:
        for i in range(2):
            replicas.append(start(tmp_path_factory.mktemp(f"replica-{i}"), postgres.url, ups))
        key = new_key(replicas[0])
        ident = put_budget(replicas[0], key=key["id"], limit_usd=5)
        time.sleep(2.2)  # the other replica re-reads the budget list within BUDGET_CACHE_S
        statuses = forty_chats(replicas, key["key"])
        after = settled(replicas[1], ident)
        assert after["spent_usd"] <= 5 + 1e-9
        assert after["spent_usd"] == pytest.approx(statuses.count(200) * PER_CHAT)
        assert statuses.count(200) >= 4 and after["reserved_usd"] == 0
    finally:
        for server in replicas:
            server.stop()
        postgres.remove()


def test_decisions_counted_above_the_estimate_stay_within_the_budget(single):
    key = new_key(single)
    ident = put_budget(single, key=key["id"], limit_usd=1)
    text = "The invoice was charged twice and the export fails. " * 4  # 208 bytes: $0.208 a question
    client = openai.OpenAI(base_url=single.url + "/v1", api_key=key["key"], max_retries=0, timeout=60)

    def ask(_):
        try:
            client.decisions.create(model="counted", input=text, questions=[
                {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}])
            return 200
        except openai.APIStatusError as error:
            assert error.status_code == 402, error.message
            return 402

    with ThreadPoolExecutor(40) as pool:
        statuses = list(pool.map(ask, range(40)))
    after = settled(single, ident)
    assert after["spent_usd"] <= 1 + 1e-9 and statuses.count(200) >= 3
    assert after["spent_usd"] == pytest.approx(statuses.count(200) * len(text.encode()) * 1000 / 1e6)


def test_a_reservation_left_by_a_replica_killed_on_another_host_is_released_after_its_time_to_live(ups, tmp_path):
    """A replica on another host dies holding a reservation: nothing here can tell that its process is gone, so its
    hold goes only once it has not been renewed for ``budget_reservation_ttl_s`` (by the database's clock)."""
    database = tmp_path / "killed.sqlite3"
    server = start(tmp_path, f"sqlite:///{database}", ups)
    key = new_key(server)
    ident = put_budget(server, key=key["id"], limit_usd=2)
    def hold() -> None:  # the request the kill cuts off
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key['key']}"},
                       timeout=60, json={"model": "hanging", "messages": [{"role": "user", "content": "Say hello"}]})

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    deadline = time.monotonic() + 20
    while budget(server, ident)["reservations"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    held = budget(server, ident)
    assert held["reservations"] == 1 and held["reserved_usd"] > 1
    server.process.kill()  # SIGKILL: the reservation is never settled
    server.process.wait()
    with contextlib.closing(sqlite3.connect(database)) as db, db:  # as if it had been a process of another host
        db.execute("UPDATE budget_reservations SET holder = 'elsewhere/0/0:4242:beef'")
    server = start(tmp_path, f"sqlite:///{database}", ups)
    try:
        orphan = budget(server, ident)
        assert orphan["reservations"] == 1 and orphan["reserved_usd"] == held["reserved_usd"]
        assert orphan["oldest_reservation_age_s"] >= 0
        # Two reservations ($1.073 each) do not fit in $2 until the orphan goes: a chat now is refused (its time to
        # live is an hour); once the test moves the orphan's clock past that hour, a chat passes.
        assert chat(server, key["key"], stream=False) == 402
        with contextlib.closing(sqlite3.connect(database)) as db, db:
            db.execute("UPDATE budget_reservations SET created_ms = created_ms - 3601000")
        assert chat(server, key["key"], stream=False) == 200
        after = settled(server, ident)
        assert after["reservations"] == 0 and after["reserved_usd"] == 0
        assert after["spent_usd"] == pytest.approx(PER_CHAT)
        assert "released after their time to live" in server.log()
    finally:
        server.stop()


def test_sigkill_then_restart_on_the_same_host_strands_no_room(ups, tmp_path):
    """Six clients spend a $100 budget; the server is SIGKILLed mid-spend, holding leased room and requests in flight,
    then started again on the same host: the dead process's holds come back at once (its PID is gone), so the spend
    reaches the limit within 10 s of the restart, never past it."""
    database = f"sqlite:///{tmp_path}/sigkill.sqlite3"
    server = start(tmp_path, database, ups)
    key = new_key(server)
    ident = put_budget(server, key=key["id"], limit_usd=100)
    stop = threading.Event()
    answered: list[int] = []

    def spend() -> None:
        while not stop.is_set():
            try:
                status = chat(server, key["key"], stream=False)
            except (openai.APIConnectionError, openai.APITimeoutError, httpx.HTTPError):
                time.sleep(0.05)  # the server is down: ask again
                continue
            answered.append(status)
            if status == 402:
                time.sleep(0.05)

    clients = [threading.Thread(target=spend, daemon=True) for _ in range(6)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 60
    while answered.count(200) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.process.kill()  # SIGKILL: leased room and six requests in flight, never settled
    server.process.wait()
    server = start(tmp_path, database, ups)
    restarted = time.monotonic()
    try:
        while time.monotonic() < restarted + 10:
            time.sleep(0.1)
        stop.set()
        for client in clients:
            client.join(60)
        after = settled(server, ident)
        # Every answered chat is charged; the room is all used: what is left does not fit one more ($1.073).
        assert 100 - 1.073 < after["spent_usd"] <= 100 + 1e-9, after
        assert after["reserved_usd"] == 0 and after["reservations"] == 0
        assert "released" in server.log()
    finally:
        stop.set()
        server.stop()


def test_a_judge_is_charged_to_its_own_path_and_stops_at_its_budget(single):
    ident = put_budget(single, user_path="/guardrails/j", limit_usd=0.015)  # room for one judged call
    key = new_key(single)
    client = openai.OpenAI(base_url=single.url + "/v1", api_key=key["key"], max_retries=0, timeout=60)
    question = [{"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}]
    first = client.decisions.with_raw_response.create(model="judged", input="hello there", questions=question)
    assert float(first.headers["x-decisiond-cost"]) == 0  # the caller's model is free; the judge's call is not
    assert settled(single, ident)["spent_usd"] == pytest.approx(0.01)
    with pytest.raises(openai.BadRequestError) as e:  # the judge's budget is spent: it fails closed
        client.decisions.create(model="judged", input="hello again", questions=question)
    assert e.value.code == "guardrail_blocked" and "budget" in e.value.message
    deadline = time.monotonic() + 20  # rows reach the database in batches, a moment after their requests
    while True:
        rows = httpx.get(single.url + "/admin/audit", headers=ADMIN,
                         params={"request_type": "guardrail", "user_path": "/guardrails/j"}).json()["data"]
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted((r["status"], round(r["cost"], 6)) for r in rows) == [(200, 0.01), (402, 0.0)]


def test_an_answer_that_fails_its_check_is_still_charged_and_recorded(single, ups):
    """The first target answers with a probability of 7.5 and bills 100 tokens ($0.10): the answer is refused and
    the request fails over, but the bill is real — it has its own usage row (502, with its cost) and its budget
    pays it, beside the answer's own row."""
    key = new_key(single)
    ident = put_budget(single, key=key["id"], limit_usd=10)
    client = openai.OpenAI(base_url=single.url + "/v1", api_key=key["key"], max_retries=0, timeout=60)
    text = "The invoice was charged twice."  # 30 bytes: $0.03 from the counting upstream
    raw = client.decisions.with_raw_response.create(model="wrong-then-counted", input=text, questions=[
        {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}])
    assert raw.status_code == 200 and float(raw.headers["x-decisiond-cost"]) == pytest.approx(0.10 + 0.03)
    assert settled(single, ident)["spent_usd"] == pytest.approx(0.13)
    deadline = time.monotonic() + 20
    while True:
        rows = httpx.get(single.url + "/admin/audit", headers=ADMIN, params={"key": key["id"]}).json()["data"]
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted((r["status"], r["error_code"], r["model"], round(r["cost"], 6)) for r in rows) == [
        (200, None, "counted", 0.03), (502, "upstream_invalid_response", "wrong", 0.1)]
    assert {r["request_id"] for r in rows} == {raw.headers["x-request-id"]}


def test_a_reservation_that_cannot_be_made_in_time_is_refused_not_admitted_free(ups, tmp_path):
    """Another connection holds the SQLite write lock (a slow database's stand-in): the reservation cannot commit
    within its time, so the request is refused with 503 — the upstream is never called, nothing is admitted
    unchecked. Once the lock goes, nothing is left held: room granted after its request gave up on it stays with the
    replica that asked, which gives it back."""
    database = tmp_path / "locked.sqlite3"
    server = start(tmp_path, f"sqlite:///{database}", ups)
    try:
        key = new_key(server)
        # $4: room for three $1.073 worst cases, never for a lease of two (a lease takes at most a quarter of what
        # is free beyond the request's own): every chat takes its room from the database.
        ident = put_budget(server, key=key["id"], limit_usd=4)
        assert chat(server, key["key"], stream=False) == 200
        calls = len(ups["CHAT"].seen)
        lock = sqlite3.connect(database, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            refused = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                 headers={"Authorization": f"Bearer {key['key']}"},
                                 json={"model": "pricey", "messages": [{"role": "user", "content": "Say hello"}]})
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "budget_unavailable"
        assert len(ups["CHAT"].seen) == calls  # never sent upstream
        after = settled(server, ident)
        assert after["reservations"] == 0 and after["reserved_usd"] == 0
        assert after["spent_usd"] == pytest.approx(PER_CHAT)  # the first chat alone
    finally:
        server.stop()


def test_requests_admitted_while_the_database_is_down_are_charged_when_it_returns(ups, tmp_path):
    """PostgreSQL stops: with ``budgets_when_database_down: admit`` (the default) requests under a budget are let
    through unchecked — and charged, once the database is back, from the usage journal: admitted means charged later,
    never free. (Each request's worst case is $0.084, 84 tokens at most; a $0.25 budget has room for it, one at a time,
    but never for a lease of two: each request while the database is down needs the database.)"""
    postgres = start_postgres()
    path = tmp_path / "gateway.yaml"
    path.write_text(config(postgres.url).replace(
        'auth:\n  master_key: "${TEST_MASTER}"',
        'auth:\n  master_key: "${TEST_MASTER}"\n  keys: [{name: alice, key: alice-static-key-0123456789}]') + """
budgets:
  - {key: "static:alice", limit_usd: 0.25, period: daily}
""")
    server = start_decisiond("--config", str(path), env={"TEST_MASTER": MASTER, "CHAT": ups["CHAT"].url,
                                                         "COUNTING": ups["COUNTING"].url, "LYING": ups["LYING"].url})
    text = "The invoice was charged twice."  # 30 bytes: $0.03 a request

    def ask() -> int:
        return httpx.post(server.url + "/v1/decisions", timeout=60,
                          headers={"Authorization": "Bearer alice-static-key-0123456789"},
                          json={"model": "counted", "input": text, "questions": [
                              {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}]}
                          ).status_code

    try:
        assert [ask() for _ in range(3)] == [200] * 3
        (ident,) = [b["id"] for b in httpx.get(server.url + "/admin/budgets", headers=ADMIN).json()["data"]]
        assert settled(server, ident)["spent_usd"] == pytest.approx(3 * 0.03)
        postgres.stop()
        assert [ask() for _ in range(3)] == [200] * 3  # admitted unchecked
        assert "budgets not checked: the database is unavailable" in server.log()
        postgres.start()
        deadline = time.monotonic() + 60
        while (view := budget(server, ident))["spent_usd"] < 0.18 - 1e-9 and time.monotonic() < deadline:
            time.sleep(0.2)
        # A lease whose give-back failed while the database was down is read back, then given back, a moment later.
        view = settled(server, ident)
        assert view["spent_usd"] == pytest.approx(6 * 0.03) and view["reservations"] == 0
    finally:
        server.stop()
        postgres.remove()
