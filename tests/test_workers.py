"""``decisiond serve --workers 2``: two processes on one port, sharing what replicas share. Forty requests at once are
all answered and all charged once to one budget; a rate limit holds across the workers without Redis (each counts
its part of it); ``/metrics`` adds up both workers whichever answers the scrape, and each scrape reports the label
quality gauges; a worker killed is started again; SIGTERM stops them all."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import upstreams
from servers import start_decisiond

MASTER = "workers-master-key-0123456789"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
PRICE = 0.001

SPENDER = "workers-spender-key-0123456789"
CONFIG = f"""
auth:
  master_key: "${{TEST_MASTER}}"
  keys: [{{name: spender, key: "{SPENDER}"}}]
budgets:  # in the config, so that both workers know it from their start
  - {{key: "static:spender", limit_usd: 1, period: daily}}
database_url: "${{TEST_DB}}"
providers:
  - {{name: up, type: openai, base_url: "${{UP}}/v1"}}
models:
  - {{name: luna, provider: up, upstream: gpt-6-luna, pricing: {{per_request: {PRICE}}}, store: true}}
"""


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in found]


@pytest.fixture(scope="module")
def upstream():
    up = upstreams.openai_server()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def workers(upstream, tmp_path_factory):
    folder = tmp_path_factory.mktemp("workers")
    (folder / "gateway.yaml").write_text(CONFIG)
    server = start_decisiond("--config", str(folder / "gateway.yaml"), "--workers", "2", env={
        "TEST_MASTER": MASTER, "TEST_DB": f"sqlite:///{folder}/gateway.sqlite3", "UP": upstream.url,
        "DECISIOND_DATA_DIR": str(folder / "data")})
    yield server
    server.stop()


def new_key(server, **fields) -> dict:
    created = httpx.post(server.url + "/admin/keys", headers=ADMIN, json={"name": "w", **fields}, timeout=30)
    assert created.status_code == 201, created.text
    return created.json()


def ask(server, key: str) -> int:
    return httpx.post(server.url + "/v1/decisions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "luna", "input": "I was charged twice.", "questions": [QUESTION]}).status_code


def test_two_workers_answer_forty_requests_at_once_and_charge_each_once(workers):
    assert len(children(workers.process.pid)) == 2
    with ThreadPoolExecutor(40) as pool:  # a new connection each: the kernel hands them to both workers
        statuses = list(pool.map(lambda _: ask(workers, SPENDER), range(40)))
    assert statuses == [200] * 40
    deadline = time.monotonic() + 30
    while True:
        (view,) = httpx.get(workers.url + "/admin/budgets", headers=ADMIN).json()["data"]
        rows = httpx.get(workers.url + "/admin/audit", headers=ADMIN, params={"key": "static:spender"}).json()["data"]
        if (len(rows) == 40 and view["spent_usd"] >= 40 * PRICE - 1e-12) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rows) == 40 and len({r["request_id"] for r in rows}) == 40
    assert view["spent_usd"] == pytest.approx(40 * PRICE)


def test_a_rate_limit_holds_across_workers_without_redis(workers):
    key = new_key(workers, rate_limits={"requests_per_minute": 3})
    with ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(lambda _: ask(workers, key["key"]), range(10)))
    # Each worker counts its part (2 and 1): never more than 3 together, whichever worker a request reaches.
    assert statuses.count(200) <= 3 and set(statuses) <= {200, 429}


def test_the_label_quality_gauges_are_in_every_scrape(workers):
    """Read from the database the workers share, so that any worker's scrape reports them (before any other scrape
    in this module: a worker reads them again at most every 15 s)."""
    ids = []
    for n in range(2):
        answered = httpx.post(workers.url + "/v1/decisions", headers=ADMIN, timeout=60, json={
            "model": "luna", "input": f"labelled {n}", "questions": [QUESTION]})
        assert answered.status_code == 200, answered.text
        ids.append(answered.headers["x-request-id"])
    for request_id in ids:
        labelled = httpx.post(f"{workers.url}/v1/decisions/{request_id}/labels", headers=ADMIN, timeout=30,
                              json={"labels": {"billing": True}})
        assert labelled.status_code == 200, labelled.text
    for _ in range(6):
        text = httpx.get(workers.url + "/metrics", headers=ADMIN, timeout=30).text
        assert re.search(r'^decisiond_decision_labels\{model="luna",question="billing"\} 2\.0$', text, re.M), \
            text + workers.log()[-4000:]


def test_metrics_add_up_every_worker(workers):
    key = new_key(workers)
    def total() -> float:
        text = httpx.get(workers.url + "/metrics", headers=ADMIN, timeout=30).text
        found = re.findall(r'^decisiond_requests_total\{[^}]*route="/v1/decisions"[^}]*status="200"\} (\S+)$', text,
                           re.M)
        return sum(float(x) for x in found)

    before = total()
    with ThreadPoolExecutor(20) as pool:
        assert list(pool.map(lambda _: ask(workers, key["key"]), range(20))) == [200] * 20
    assert [total() - before for _ in range(6)] == [20.0] * 6  # the same sum whichever worker answers


def test_a_killed_worker_is_started_again_and_sigterm_stops_them_all(upstream, tmp_path):
    (tmp_path / "gateway.yaml").write_text(CONFIG)
    server = start_decisiond("--config", str(tmp_path / "gateway.yaml"), "--workers", "2", env={
        "TEST_MASTER": MASTER, "TEST_DB": f"sqlite:///{tmp_path}/gateway.sqlite3", "UP": upstream.url,
        "DECISIOND_DATA_DIR": str(tmp_path / "data")})
    try:
        first = children(server.process.pid)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (now := children(server.process.pid)) == first or len(now) < 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        assert first[0] not in now and first[1] in now
        assert "a worker stopped: starting it again" in server.log()
        assert ask(server, MASTER) == 200
        server.process.terminate()
        assert server.process.wait(timeout=60) == 0
        for pid in now:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        server.stop()
