"""The response cache shared by two replicas through a real redis-server, and a Redis outage mid-run that loses
no request (the cache degrades to each process's own memory)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from servers import start_decisiond
from services import start_redis

pytestmark = pytest.mark.services  # every test here runs replicas over Redis or PostgreSQL

QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}

CONFIG = """
cache: {redis_url: "${TEST_REDIS}", ttl: 60}
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
"""


def ask(server, text: str) -> httpx.Response:
    response = httpx.post(server.url + "/v1/decisions", timeout=60, json={
        "model": "tiny-local", "input": text, "questions": [QUESTION]})
    assert response.status_code == 200, response.text
    return response


@pytest.fixture()
def redis():
    running = start_redis()
    yield running
    running.stop()


def replica(tiny_dir, tmp_path, redis_url: str, name: str):
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG)
    return start_decisiond("--config", str(config), env={"TEST_REDIS": redis_url, "TINY_DIR": tiny_dir,
                                                         "DECISIOND_DATA_DIR": str(tmp_path / name)})


def test_two_replicas_share_hits_through_redis(tiny_dir, tmp_path, redis):
    import redis as redis_client

    a = replica(tiny_dir, tmp_path, redis.url, "a")
    b = replica(tiny_dir, tmp_path, redis.url, "b")
    try:
        first = ask(a, "I was charged twice for one month.")
        second = ask(b, "I was charged twice for one month.")
        assert first.headers["x-cache"] == "MISS" and second.headers["x-cache"] == "HIT"
        assert first.content == second.content
        keys = redis_client.Redis.from_url(redis.url).keys("decisiond:cache:*")
        assert len(keys) == 1
        ttl = redis_client.Redis.from_url(redis.url).ttl(keys[0])
        assert 0 < ttl <= 60
        # b answers the next new question first; a reads it from redis.
        assert ask(b, "Where is my invoice?").headers["x-cache"] == "MISS"
        assert ask(a, "Where is my invoice?").headers["x-cache"] == "HIT"
    finally:
        a.stop()
        b.stop()


def test_stopping_redis_mid_run_loses_no_request(tiny_dir, tmp_path, redis):
    server = replica(tiny_dir, tmp_path, redis.url, "solo")
    try:
        texts = [f"Ticket {i % 24}: the export fails." for i in range(48)]  # 8 new ones after the stop

        def go(i: int) -> httpx.Response:
            if i == 16:
                redis.stop()
            return ask(server, texts[i])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(go, range(len(texts))))
        assert all(r.status_code == 200 for r in responses)
        # Same text, same answer, whether it came from redis, memory or the engine.
        by_text: dict[str, set[bytes]] = {}
        for text, r in zip(texts, responses):
            by_text.setdefault(text, set()).add(r.content)
        assert all(len(bodies) == 1 for bodies in by_text.values())
        new = ask(server, "A question asked after the outage.")
        assert new.headers["x-cache"] == "MISS"
        assert ask(server, "A question asked after the outage.").headers["x-cache"] == "HIT"  # memory still works
        time.sleep(0.2)
        assert "redis unavailable" in server.log()
    finally:
        server.stop()
