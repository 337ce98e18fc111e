"""Several decisiond replicas sharing their state: rate-limit counters in a real redis-server, managed keys in a
real PostgreSQL server."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from servers import start_decisiond
from services import start_postgres, start_redis

pytestmark = pytest.mark.services  # every test here runs replicas over Redis or PostgreSQL

MASTER = "replica-master-key-0123456789"
STATIC = "replica-static-key-0123456789"
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}

CONFIG = """
auth:
  master_key: "${TEST_MASTER}"
  keys:
    - {name: shared, key: "${TEST_STATIC}", rate_limits: {requests_per_minute: 3}}
database_url: "${TEST_DB}"
redis_url: "${TEST_REDIS}"
# These tests repeat one request to count it against limits; a cache hit would cost nothing (test_cache).
cache: {enabled: false}
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
"""


@pytest.fixture(scope="module")
def replicas(tiny_dir, tmp_path_factory):
    redis, postgres = start_redis(), None
    running = []
    try:
        postgres = start_postgres()
        config = tmp_path_factory.mktemp("replicas") / "gateway.yaml"
        config.write_text(CONFIG)
        env = {"TEST_MASTER": MASTER, "TEST_STATIC": STATIC, "TEST_DB": postgres.url, "TEST_REDIS": redis.url,
               "TINY_DIR": tiny_dir}
        for _ in range(2):
            running.append(start_decisiond("--config", str(config), env=env))
        yield running
    finally:
        for server in running:
            server.stop()
        if postgres is not None:
            postgres.remove()
        redis.stop()


def ask(server, key: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return client.decisions.create(model="tiny-local", input="I was charged twice.", questions=[QUESTION])


def test_two_replicas_enforce_one_shared_limit(replicas):
    a, b = replicas
    outcomes = []
    for server in (a, b, a, b, a):
        try:
            ask(server, STATIC)
            outcomes.append("ok")
        except openai.RateLimitError:
            outcomes.append("429")
    assert outcomes == ["ok", "ok", "ok", "429", "429"]


def test_a_key_created_on_one_replica_works_on_the_other(replicas):
    a, b = replicas
    created = httpx.post(a.url + "/admin/keys", headers={"Authorization": f"Bearer {MASTER}"},
                         json={"name": "roaming", "rate_limits": {"requests_per_minute": 2}}, timeout=30)
    assert created.status_code == 201
    key = created.json()["key"]
    ask(b, key)
    ask(a, key)
    with pytest.raises(openai.RateLimitError):  # its own limit is shared through redis too
        ask(b, key)
    listed = httpx.get(b.url + "/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}).json()["data"]
    assert created.json()["id"] in [k["id"] for k in listed]
    revoked = httpx.delete(f"{a.url}/admin/keys/{created.json()['id']}", headers={"Authorization": f"Bearer {MASTER}"})
    assert revoked.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        ask(a, key)
    time.sleep(5.2)  # another replica remembers a verified key for at most 5 s
    with pytest.raises(openai.AuthenticationError):
        ask(b, key)


def test_rate_limits_degrade_to_none_when_redis_is_down(tiny_dir, tmp_path):
    redis = start_redis()
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG.replace('database_url: "${TEST_DB}"\n', ""))
    server = start_decisiond("--config", str(config), env={
        "TEST_MASTER": MASTER, "TEST_STATIC": STATIC, "TEST_REDIS": redis.url, "TINY_DIR": tiny_dir,
        "DECISIOND_DATA_DIR": str(tmp_path / "data")})
    try:
        ask(server, STATIC)
        redis.stop()
        for _ in range(4):  # over the key's 3 a minute, but the counters are gone: admitted, with a warning
            ask(server, STATIC)
        assert "rate limits not enforced" in server.log()
    finally:
        server.stop()
        redis.stop()
