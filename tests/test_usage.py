"""Usage, pricing and budgets through real servers on loopback: fake upstreams that report usage (one reports
``usage.cost``), the official SDKs as clients, SQLite and a real PostgreSQL server."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
import upstreams
from servers import run_decisiond, start_decisiond
from services import start_postgres
from typesafe_sdk import Noul, RetryPolicy, TypeSafeClient

from decisiond.canonical import Usage
from decisiond.gateway import pricing
from decisiond.gateway.config import ConfigError, parse

MASTER = "usage-master-key-0123456789"
ALICE = "usage-alice-key-0123456789"
BOB = "usage-bob-key-0123456789abc"
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
ADMIN = {"Authorization": f"Bearer {MASTER}"}

CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
auth:
  master_key: "${TEST_MASTER}"
  keys:
    # Raw upstream names only for keys whose allowlist names them (provider/*; "*" covers configured models only).
    - {name: alice, key: "${TEST_ALICE}", user_path: /team/a, models: ["*", "openai/*", "openrouter/*", "jev/*"]}
    - {name: bob, key: "${TEST_BOB}", user_path: /team/b, models: ["*", "jev/*"]}
database_url: "${TEST_DB}"
providers:
  - {name: down, type: openai, base_url: "${UP_DOWN}/v1", api_key: sk-down}
  - {name: openai, type: openai, base_url: "${UP_OPENAI}/v1", api_key: sk-test, pricing: {input_per_mtok: 2.0}}
  - {name: jev, type: systemone, base_url: "${UP_JEV}", api_key: tskey,
     pricing: {input_per_mtok: 0.042, output_per_mtok: 1.0}}
  - {name: openrouter, type: openai, base_url: "${UP_COST}/v1", api_key: sk-or, pricing: {input_per_mtok: 99}}
  - {name: counted, type: openai, base_url: "${UP_COUNTED}/v1", api_key: sk-counted}
models:
  - {name: luna, provider: openai, upstream: gpt-6-luna,
     pricing: {input_per_mtok: 1.25, cached_input_per_mtok: 0.125, output_per_mtok: 10,
               long_context: {above_tokens: 100, input_per_mtok: 2.5}}}
  - {name: luna-long, provider: openai, upstream: gpt-6-luna,
     pricing: {input_per_mtok: 1.25, long_context: {above_tokens: 40, input_per_mtok: 2.5}}}
  - {name: flat, provider: openai, upstream: gpt-6-luna, pricing: {per_request: 0.002}}
  - {name: limited, provider: counted, upstream: gpt-6-luna, pricing: {per_request: 0.01}}
virtual_models:
  - {name: classifier, strategy: failover, targets: [down/gpt-6-luna, luna]}
budgets:
  - {model: limited, limit_usd: 0.01, period: daily}
"""


def cost_server() -> upstreams.Upstream:
    """An OpenRouter-like upstream: it reports its own charge as usage.cost."""
    inner = upstreams.openai_server("router-model")

    def handle(seen):
        status, headers, body = inner.handler(seen)
        body["usage"]["cost"] = 0.00123
        return status, headers, body

    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def ups():
    made = {"down": upstreams.status_server(503, {"error": {"message": "unavailable", "type": "server_error"}}),
            "openai": upstreams.openai_server(), "jev": upstreams.systemone_server(), "cost": cost_server(),
            "counted": upstreams.openai_server()}
    yield made
    for u in made.values():
        u.stop()


def _env(ups, db: str) -> dict[str, str]:
    return {"TEST_MASTER": MASTER, "TEST_ALICE": ALICE, "TEST_BOB": BOB, "TEST_DB": db,
            **{f"UP_{k.upper()}": u.url for k, u in ups.items()}}


@pytest.fixture(scope="module")
def gateway(ups, database, tmp_path_factory):
    config = tmp_path_factory.mktemp("usage-config") / "gateway.yaml"
    config.write_text(CONFIG)
    server = start_decisiond("--config", str(config), env=_env(ups, database))
    yield server
    server.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ask(server, key: str, model: str):
    return client(server, key).decisions.with_raw_response.create(model=model, input="I was charged twice.",
                                                                  questions=[QUESTION])


def audit(server, **params) -> list[dict]:
    """Every audit row matching ``params``, newest first, page after page (``next_before_id``) up to ``limit``
    rows in all (the admin API returns at most 1,000 a page)."""
    wanted = int(params.pop("limit", 100))
    rows: list[dict] = []
    before = None
    while len(rows) < wanted:
        page = httpx.get(server.url + "/admin/audit", headers=ADMIN, timeout=30,
                         params={**params, "limit": min(1000, wanted - len(rows)),
                                 **({"before_id": before} if before else {})}).json()
        rows += page["data"]
        before = page["next_before_id"]
        if not before:
            break
    return rows


def wait_for_rows(server, count: int, **params) -> list[dict]:
    deadline = time.monotonic() + 20
    while True:
        rows = audit(server, limit=100_000, **params)
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- pricing rules

def test_cost_follows_each_pricing_rule():
    openai_usage = Usage(input_tokens=50, cached_tokens=10, cache_write_tokens=5, output_tokens=7)
    luna = pricing.Pricing(input_per_mtok=1.25, cached_input_per_mtok=0.125, output_per_mtok=10)
    # OpenAI's Decisions API: every input token at the input rate; output and cache are free.
    assert pricing.cost(luna, openai_usage, "openai") == pytest.approx(50 * 1.25 / 1e6)
    # Any other format: uncached input, cached input at its rate, output at the output rate.
    assert pricing.cost(luna, openai_usage, "system_one") == pytest.approx((40 * 1.25 + 10 * 0.125 + 7 * 10) / 1e6)
    tiered = pricing.Pricing(input_per_mtok=1.0, long_context=pricing.LongContext(above_tokens=40, input_per_mtok=3))
    assert pricing.cost(tiered, Usage(input_tokens=40), "openai") == pytest.approx(40e-6)
    assert pricing.cost(tiered, Usage(input_tokens=41), "openai") == pytest.approx(41 * 3 / 1e6)
    assert pricing.cost(pricing.Pricing(per_request=0.002), openai_usage, "openai") == 0.002
    assert pricing.cost(luna, Usage(input_tokens=50, cost=0.5), "openai") == 0.5  # the provider's own figure
    assert pricing.cost(None, openai_usage, "local") == 0.0


def test_pricing_rules_are_checked_at_start_up():
    base = {"providers": [{"name": "o", "type": "openai", "base_url": "http://x"}]}
    with pytest.raises(ConfigError, match="per_request price applies only to a model that serves nothing but "
                                          "decisions"):
        parse({**base, "models": [{"name": "m", "provider": "o", "capabilities": ["decisions", "chat"],
                                   "pricing": {"per_request": 0.1}}]})
    with pytest.raises(ConfigError, match="per request or per token, not both"):
        parse({**base, "models": [{"name": "m", "provider": "o",
                                   "pricing": {"per_request": 0.1, "input_per_mtok": 1}}]})
    with pytest.raises(ConfigError, match="exactly one of key, user_path or model"):
        parse({**base, "budgets": [{"limit_usd": 1, "period": "daily"}]})
    from decisiond.gateway.pricing import check_pricing
    with pytest.raises(ValueError, match="reports no token counts"):
        check_pricing("provider 'studio'", pricing.Pricing(input_per_mtok=1), reports_tokens=False)
    check_pricing("provider 'studio'", pricing.Pricing(per_request=0.002), reports_tokens=False)


# --------------------------------------------------------------------------------------------- the server

def test_costs_headers_and_usage_rows(gateway):
    expected = {
        "luna": 50 * 1.25 / 1e6,        # input only, at the input rate (cached tokens are not discounted)
        "luna-long": 50 * 2.5 / 1e6,    # 50 tokens > 40: the long-context rate
        "flat": 0.002,                  # per request
        "openai/gpt-6-other": 50 * 2.0 / 1e6,  # a raw upstream (no entry covers it): the provider's default price
        "openrouter/x": 0.00123,        # the upstream's usage.cost
    }
    ids = {}
    for model, cost in expected.items():
        raw = ask(gateway, ALICE, model)
        assert float(raw.headers["x-decisiond-cost"]) == pytest.approx(cost, abs=1e-10)
        ids[raw.headers["x-request-id"]] = (model, cost)
    with TypeSafeClient(base_url=gateway.url, api_key=ALICE, retry=RetryPolicy(max_retries=0), timeout=30) as ts:
        result = ts.system_one("x", {"q": Noul(instructions="?")}, model="jev/jev-latest")
        # System One: 120 input tokens at 0.042 and 20 output tokens at 1.0 per million.
        assert float(result.raw_http_response.headers["x-decisiond-cost"]) == pytest.approx((120 * 0.042 + 20) / 1e6)
        ids[result.raw_http_response.headers["x-request-id"]] = ("jev/jev-latest", (120 * 0.042 + 20) / 1e6)
    rows = {r["request_id"]: r for r in wait_for_rows(gateway, len(ids), key="static:alice")}
    for request_id, (model, cost) in ids.items():
        row = rows[request_id]
        assert row["cost"] == pytest.approx(cost, abs=1e-12) and row["status"] == 200
        assert row["requested_model"] == model and row["user_path"] == "/team/a"
        assert row["request_type"] == ("system_one" if model.startswith("jev") else "decisions")


def test_usage_is_attributed_to_the_target_that_answered_after_failover(gateway):
    raw = ask(gateway, BOB, "classifier")
    assert float(raw.headers["x-decisiond-cost"]) == pytest.approx(50 * 1.25 / 1e6)
    rows = wait_for_rows(gateway, 1, key="static:bob", model="classifier")
    row = next(r for r in rows if r["request_id"] == raw.headers["x-request-id"])
    assert row["resolved_model"] == "classifier"
    assert (row["provider"], row["model"], row["upstream_model"]) == ("openai", "luna", "gpt-6-luna")
    assert row["attempts"] == 2 and row["targets"] == ["down/gpt-6-luna", "luna"]
    assert row["input_tokens"] == 50 and row["cached_tokens"] == 10


def wait_for_ids(server, request_ids) -> list[dict]:
    deadline = time.monotonic() + 20
    while True:
        rows = audit(server, limit=1000)
        if set(request_ids) <= {r["request_id"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def bob_system_one(server) -> dict:
    summary = httpx.get(server.url + "/admin/usage/summary", headers=ADMIN,
                        params={"group_by": "request_type,key"}).json()["data"]
    return next((s for s in summary if s["key"] == "static:bob" and s["request_type"] == "system_one"),
                {"requests": 0, "cost_usd": 0.0})


def test_audit_filter_by_request_type_and_summary(gateway):
    # The test makes its own rows (two System One requests and three decisions by bob) and compares the summary with
    # what it was before, so it passes or fails the same alone or after the others.
    before = bob_system_one(gateway)
    mine: dict[str, str] = {}
    with TypeSafeClient(base_url=gateway.url, api_key=BOB, retry=RetryPolicy(max_retries=0), timeout=30) as ts:
        for _ in range(2):
            result = ts.system_one("x", {"q": Noul(instructions="?")}, model="jev/jev-latest")
            mine[result.raw_http_response.headers["x-request-id"]] = "system_one"
    for _ in range(3):
        mine[ask(gateway, BOB, "luna").headers["x-request-id"]] = "decisions"
    everything = wait_for_ids(gateway, mine)
    assert set(mine) <= {r["request_id"] for r in everything}
    for kind in ("system_one", "decisions"):
        rows = audit(gateway, request_type=kind, limit=1000)
        assert {r["request_type"] for r in rows} == {kind}
        assert {i for i, k in mine.items() if k == kind} <= {r["request_id"] for r in rows}
        assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in everything if r["request_type"] == kind)
    assert len(everything) >= 5
    page = httpx.get(gateway.url + "/admin/audit", headers=ADMIN, params={"limit": 2}).json()
    following = httpx.get(gateway.url + "/admin/audit", headers=ADMIN,
                          params={"limit": 2, "before_id": page["next_before_id"]}).json()
    assert [r["id"] for r in page["data"] + following["data"]] == [r["id"] for r in everything[:4]]
    bad = httpx.get(gateway.url + "/admin/audit", headers=ADMIN, params={"request_type": "completions"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_type"
    after = bob_system_one(gateway)
    # System One: 120 input tokens at 0.042 and 20 output tokens at 1.0 per million, per request.
    assert after["requests"] == before["requests"] + 2
    assert after["cost_usd"] == pytest.approx(before["cost_usd"] + 2 * (120 * 0.042 + 20) / 1e6, abs=1e-12)
    daily = httpx.get(gateway.url + "/admin/usage/daily", headers=ADMIN, params={"group_by": "model"}).json()["data"]
    assert sum(d["requests"] for d in daily) == len(everything)
    assert httpx.get(gateway.url + "/admin/audit", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 403


def test_v1_usage_reflects_a_keys_spend_and_budgets(gateway):
    put = httpx.put(gateway.url + "/admin/budgets", headers=ADMIN,
                    json={"key": "static:alice", "limit_usd": 1.0, "period": "monthly"})
    assert put.status_code == 200, put.text
    before = httpx.get(gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {ALICE}"}).json()
    ask(gateway, ALICE, "flat")
    wait_for_rows(gateway, 1, key="static:alice", model="flat")
    time.sleep(0.3)
    after = httpx.get(gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert after["spend"]["total"]["cost_usd"] == pytest.approx(before["spend"]["total"]["cost_usd"] + 0.002)
    assert after["spend"]["total"]["requests"] == before["spend"]["total"]["requests"] + 1
    budget = next(b for b in after["budgets"] if b["id"] == put.json()["id"])
    assert budget["spent_usd"] == pytest.approx(0.002) and budget["remaining_usd"] == pytest.approx(0.998)
    assert 0 < budget["resets_in_seconds"] <= 31 * 86400
    assert httpx.delete(f"{gateway.url}/admin/budgets/{budget['id']}", headers=ADMIN).status_code == 200


def _race(servers, model: str, n: int) -> list[str]:
    def one(i):
        try:
            ask(servers[i % len(servers)], ALICE, model)
            return "ok"
        except openai.APIStatusError as e:
            assert e.status_code == 402, e.response.text
            assert e.code == "budget_exceeded" and "limit" in e.message
            return "402"

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_budget_with_room_for_one_admits_one_of_20_concurrent_requests(gateway, ups):
    before = len(ups["counted"].seen)
    outcomes = _race([gateway], "limited", 20)
    assert outcomes.count("ok") == 1 and outcomes.count("402") == 19
    assert len(ups["counted"].seen) == before + 1  # the refused ones never reached the upstream
    # Once spent, it stays spent.
    with pytest.raises(openai.APIStatusError, match=r"\$0.010000 of its \$0.010000 limit"):
        ask(gateway, ALICE, "limited")
    budgets = httpx.get(gateway.url + "/admin/budgets", headers=ADMIN).json()["data"]
    limited = next(b for b in budgets if b["model"] == "limited")
    assert limited["spent_usd"] == pytest.approx(0.01) and limited["reserved_usd"] == 0
    # Start afresh for the other database.
    httpx.delete(f"{gateway.url}/admin/budgets/{limited['id']}", headers=ADMIN)


# ------------------------------------------------------------------------------- replicas sharing PostgreSQL

@pytest.fixture(scope="module")
def shared_postgres():
    postgres = start_postgres()
    try:
        yield postgres
    finally:
        postgres.remove()


def test_two_replicas_sharing_postgres_admit_only_what_the_budget_has_room_for(ups, shared_postgres,
                                                                              tmp_path_factory):
    config = tmp_path_factory.mktemp("usage-replicas") / "gateway.yaml"
    config.write_text(CONFIG.replace("limit_usd: 0.01,", "limit_usd: 0.03,"))
    replicas = []
    try:
        for _ in range(2):
            replicas.append(start_decisiond("--config", str(config), env=_env(ups, shared_postgres.url)))
        before = len(ups["counted"].seen)
        outcomes = _race(replicas, "limited", 20)
        assert outcomes.count("ok") == 3 and outcomes.count("402") == 17
        assert len(ups["counted"].seen) == before + 3
    finally:
        for server in replicas:
            server.stop()


def test_stopping_postgres_for_10_s_under_load_loses_no_request_and_no_usage_record(ups, shared_postgres,
                                                                                    tmp_path_factory):
    """8 clients send requests while PostgreSQL is down for 10 s: every request is answered, and every usage record
    is written once the database is back (the writer's queue holds them meanwhile)."""
    config = tmp_path_factory.mktemp("usage-outage") / "gateway.yaml"
    config.write_text(CONFIG)
    server = start_decisiond("--config", str(config), env=_env(ups, shared_postgres.url))
    try:
        start = len(audit(server, key="static:bob", limit=100_000))
        ids: list[str] = []
        failures: list[str] = []
        stop_at = time.monotonic() + 16

        def load():
            while time.monotonic() < stop_at:
                try:
                    ids.append(ask(server, BOB, "luna").headers["x-request-id"])
                except Exception as error:  # noqa: BLE001 - any failure is what the test looks for
                    failures.append(repr(error))
                time.sleep(0.05)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            running = [pool.submit(load) for _ in range(8)]
            time.sleep(2)
            shared_postgres.stop()
            time.sleep(10)
            shared_postgres.start()
            for f in running:
                f.result()
        assert not failures and len(ids) > 50
        rows = wait_for_rows(server, start + len(ids), key="static:bob")
        written = {r["request_id"] for r in rows}
        assert set(ids) <= written and len(rows) == start + len(ids)
        assert "database unavailable" in server.log()  # the outage was real, and logged
    finally:
        server.stop()


def test_cli_prints_the_summary_as_a_table(gateway, database):
    out = run_decisiond("usage", "--database-url", database, "--group-by", "request_type", timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["request_type", "requests", "input_tokens", "output_tokens", "cost_usd"]
    summary = httpx.get(gateway.url + "/admin/usage/summary", headers=ADMIN,
                        params={"group_by": "request_type"}).json()["data"]
    assert sorted(line.split()[:2] for line in lines[1:]) == sorted([s["request_type"], str(s["requests"])]
                                                                    for s in summary)


def test_logged_bodies_are_redacted():
    from decisiond.gateway.usage import redact

    body = {"input": "hi", "metadata": {"api_key": "sk-secret", "Authorization": "Bearer x", "email": "a@b.c"},
            "questions": [{"name": "q", "password": "p"}]}
    assert redact(body, ["email"]) == {"input": "hi", "metadata": {"api_key": "[redacted]",
                                                                   "Authorization": "[redacted]",
                                                                   "email": "[redacted]"},
                                       "questions": [{"name": "q", "password": "[redacted]"}]}
