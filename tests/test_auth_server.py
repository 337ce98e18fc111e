"""Keys, user paths, allowlists and rate limits end to end: a decisiond with a master key in front of the tiny
local model and two loopback OpenAI-shaped upstreams, called with the official openai and typesafe SDKs."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import upstreams
from servers import run_decisiond, start_decisiond
from typesafe_sdk import (
    Noul,
    RetryPolicy,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeRateLimitError,
)

MASTER = "master-7f3e9c1d5b2a4e6f8091"
STATIC = "static-key-0a1b2c3d4e5f6789"
UPSTREAM_KEY = "sk-upstream-secret-5d6e7f80"

CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
auth:
  master_key: "${TEST_MASTER}"
  keys:
    - {name: ci, key: "${TEST_STATIC}", user_path: /ci, models: [tiny-local]}
database_url: "sqlite:///${DB_DIR}/keys.sqlite3"
rate_limits:
  - {user_path: /team/slow, requests_per_minute: 2}
# These tests repeat one request to count it against limits; a cache hit would cost nothing (test_cache).
cache: {enabled: false}
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
  - {name: up1, type: openai, base_url: "${UP1}/v1", api_key: "${UP_KEY}", rate_limits: {requests_per_minute: 1}}
  - {name: up2, type: openai, base_url: "${UP2}/v1", api_key: "${UP_KEY}"}
virtual_models:
  - {name: pair, targets: [up1/gpt-6-luna, up2/gpt-6-luna]}
"""

QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}


@pytest.fixture(scope="module")
def ups():
    servers = {"up1": upstreams.openai_server(), "up2": upstreams.openai_server()}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def gateway(ups, tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    config = folder / "gateway.yaml"
    config.write_text(CONFIG)
    running = start_decisiond("--config", str(config), env={
        "TEST_MASTER": MASTER, "TEST_STATIC": STATIC, "DB_DIR": str(folder), "TINY_DIR": tiny_dir,
        "UP1": ups["up1"].url, "UP2": ups["up2"].url, "UP_KEY": UPSTREAM_KEY})
    yield running
    running.stop()


def admin(gateway, method: str, path: str, key: str = MASTER, **kwargs) -> httpx.Response:
    return httpx.request(method, gateway.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                         **kwargs)


def new_key(gateway, **fields) -> dict:
    response = admin(gateway, "POST", "/admin/keys", json={"name": "test", **fields})
    assert response.status_code == 201, response.text
    return response.json()


def oai(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def ask(client: openai.OpenAI, model: str = "tiny-local"):
    return client.decisions.create(model=model, input="I was charged twice.", questions=[QUESTION])


def typesafe(gateway, key: str, retries: int = 0) -> TypeSafeClient:
    return TypeSafeClient(base_url=gateway.url, api_key=key, retry=RetryPolicy(max_retries=retries), timeout=60)


def test_health_is_open_and_everything_else_needs_a_key(gateway):
    assert httpx.get(gateway.url + "/health").status_code == 200
    for key in ("wrong-key-123456789", "dk-0123456789abcdef-forged"):
        with pytest.raises(openai.AuthenticationError) as e:
            ask(oai(gateway, key))
        assert e.value.code == "invalid_api_key" and key not in str(e.value.body)
        with typesafe(gateway, key) as ts, pytest.raises(TypeSafeAuthenticationError):
            ts.system_one("I was charged twice.", {"billing": Noul(instructions="Is this about billing?")})
    # No Authorization header at all: each route answers 401 in its own shape, before reading the body.
    bare = httpx.post(gateway.url + "/v1/decisions", content=b"not even json")
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["type"] == "authentication_error" and bare.json()["object"] == "error"
    assert httpx.post(gateway.url + "/v1/systemone", json={}).json()["error"]["type"] == "authentication_error"
    score = httpx.post(gateway.url + "/v1/score", json={})
    assert score.status_code == 401 and score.json()["object"] == "error" and score.json()["code"] == 401
    assert httpx.get(gateway.url + "/v1/models").status_code == 401
    assert httpx.get(gateway.url + "/admin/keys").status_code == 401


def test_master_and_static_keys(gateway):
    assert ask(oai(gateway, MASTER)).answers[0].probability is not None
    assert ask(oai(gateway, STATIC)).model == "tiny-local"
    with pytest.raises(openai.PermissionDeniedError) as e:  # the static key is bound to tiny-local
        ask(oai(gateway, STATIC), "pair")
    assert e.value.code == "model_not_allowed"
    # Only the master key may use the admin API.
    assert admin(gateway, "GET", "/admin/keys", key=STATIC).status_code == 403


def test_managed_key_works_with_both_sdks_and_is_never_listed(gateway):
    created = new_key(gateway, name="both-sdks", user_path="/team/alpha")
    key = created["key"]
    assert key.startswith("dk-") and created["status"] == "active" and created["user_path"] == "/team/alpha"
    assert ask(oai(gateway, key)).answers[0].name == "billing"
    with typesafe(gateway, key) as ts:
        result = ts.system_one("I was charged twice.", {"billing": Noul(instructions="Is this about billing?")})
        assert 0.0 <= result.nouls["billing"].noul <= 1.0
    listing = admin(gateway, "GET", "/admin/keys")
    assert listing.status_code == 200
    secret = key.split("-", 2)[2]
    assert secret not in listing.text and any(k["id"] == created["id"] for k in listing.json()["data"])


def test_admin_refuses_bad_bodies_naming_the_field(gateway):
    for body, param in (({"name": "x", "user_path": "no-slash"}, "user_path"),
                        ({"name": "x", "rate_limits": {"requests_per_minute": 0}}, "rate_limits.requests_per_minute"),
                        ({"user_path": "/a"}, "name"),
                        ({"name": "x", "colour": "red"}, "colour")):
        response = admin(gateway, "POST", "/admin/keys", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    assert admin(gateway, "DELETE", "/admin/keys/unknown").status_code == 404


def test_a_key_limited_to_one_model(gateway):
    key = new_key(gateway, models=["tiny-local"])["key"]
    assert ask(oai(gateway, key)).model == "tiny-local"
    assert ask(oai(gateway, key), "default").model == "tiny-local"  # resolved before the allowlist
    with pytest.raises(openai.PermissionDeniedError) as e:
        ask(oai(gateway, key), "pair")
    assert e.value.code == "model_not_allowed" and e.value.param == "model"
    with pytest.raises(openai.PermissionDeniedError):
        ask(oai(gateway, key), "up2/gpt-6-luna")
    # The same local model under both its names, nothing else.
    assert sorted(m.id for m in oai(gateway, key).models.list()) == ["tiny-local"]  # one entry per model
    with typesafe(gateway, key) as ts:
        assert sorted(m.name for m in ts.models.list().models) == ["tiny-local"]
    # provider/* covers what that provider serves, not virtual models.
    wildcard = new_key(gateway, models=["up2/*"])["key"]
    assert ask(oai(gateway, wildcard), "up2/gpt-6-luna").model == "gpt-6-luna"
    with pytest.raises(openai.PermissionDeniedError):
        ask(oai(gateway, wildcard), "pair")
    # The master key sees everything.
    assert {"tiny-local", "pair"} <= {m.id for m in oai(gateway, MASTER).models.list()}


def test_three_requests_a_minute(gateway):
    key = new_key(gateway, rate_limits={"requests_per_minute": 3})["key"]
    client = oai(gateway, key)
    for i in range(3):
        raw = client.decisions.with_raw_response.create(model="tiny-local", input="hi", questions=[QUESTION])
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    with pytest.raises(openai.RateLimitError) as e:
        ask(client)
    assert e.value.code == "rate_limit_exceeded" and e.value.type == "rate_limit_error"
    headers = e.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60 and 0 < int(headers["retry-after-ms"]) <= 60_000
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    with typesafe(gateway, key) as ts, pytest.raises(TypeSafeRateLimitError) as te:
        ts.system_one("hi", {"billing": Noul(instructions="Is this about billing?")})
    assert 0 < te.value.retry_after_ms <= 60_000


def test_input_tokens_are_reserved_then_corrected_to_what_was_counted(gateway):
    key = new_key(gateway, rate_limits={"input_tokens_per_minute": 2000})["key"]
    client = oai(gateway, key)

    def call():
        return client.decisions.with_raw_response.create(model="tiny-local", input="I was charged twice.",
                                                         questions=[QUESTION])

    first, second = call(), call()
    counted = first.parse().usage.input_tokens
    estimate = 2000 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert first.headers["x-ratelimit-limit-tokens"] == "2000" and 0 < estimate < counted
    # The second request's headers see the first one's real count, not its estimate.
    assert int(first.headers["x-ratelimit-remaining-tokens"]) - int(second.headers["x-ratelimit-remaining-tokens"]) \
        == counted
    big = new_key(gateway, rate_limits={"input_tokens_per_minute": 10})["key"]
    with pytest.raises(openai.BadRequestError) as e:  # can never fit the window: not a 429 to retry
        oai(gateway, big).decisions.create(model="tiny-local", input="word " * 200, questions=[QUESTION])
    assert e.value.code == "limit_exceeded" and "tokens per minute" in e.value.message


def test_typesafe_retry_waits_retry_after_ms(gateway):
    # One request per 5 s: the second call comes within the window even on a loaded machine.
    key = new_key(gateway, rate_limits={"requests_per_window": 1, "window_seconds": 5})["key"]
    with typesafe(gateway, key, retries=2) as ts:
        questions = {"billing": Noul(instructions="Is this about billing?")}
        ts.system_one("first", questions)
        start = time.monotonic()
        ts.system_one("second", questions)  # refused with retry-after-ms, then answered on the SDK's retry
        waited = time.monotonic() - start
    lines = [json.loads(x) for x in gateway.log().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("logger") == "decisiond.access" and x.get("key_id") == key.split("-")[1]]
    # Exactly one refusal: the SDK's own backoff (at most 0.5 s) would have met a second 429 inside the window;
    # it waited what retry-after-ms said, and its retry was answered.
    assert [x["status"] for x in mine] == [200, 429, 200]
    assert waited >= 1.0


def test_user_path_subtree_shares_one_limit(gateway):
    a = new_key(gateway, user_path="/team/slow/a")["key"]
    b = new_key(gateway, user_path="/team/slow/b")["key"]
    ask(oai(gateway, a))
    ask(oai(gateway, b))
    with pytest.raises(openai.RateLimitError) as e:
        ask(oai(gateway, a))
    assert "/team/slow" in e.value.message
    # The master key may act for a user path, which counts against that subtree too.
    with pytest.raises(openai.RateLimitError):
        oai(gateway, MASTER).decisions.create(model="tiny-local", input="hi", questions=[QUESTION],
                                              extra_headers={"X-Decisiond-User-Path": "/team/slow/c"})
    # A key may narrow its path, not leave it.
    other = new_key(gateway, user_path="/team/fast")["key"]
    with pytest.raises(openai.PermissionDeniedError):
        oai(gateway, other).decisions.create(model="tiny-local", input="hi", questions=[QUESTION],
                                             extra_headers={"X-Decisiond-User-Path": "/team/slow"})
    with pytest.raises(openai.BadRequestError):
        oai(gateway, MASTER).decisions.create(model="tiny-local", input="hi", questions=[QUESTION],
                                              extra_headers={"X-Decisiond-User-Path": "../etc"})


def test_a_provider_at_its_limit_is_routed_around(gateway, ups):
    before = {name: len(up.seen) for name, up in ups.items()}
    client = oai(gateway, MASTER)
    ask(client, "pair")
    ask(client, "pair")  # up1 allows one request a minute: the chain fails over to up2
    assert len(ups["up1"].seen) - before["up1"] == 1
    assert len(ups["up2"].seen) - before["up2"] == 1
    with pytest.raises(openai.RateLimitError) as e:  # alone, up1 at its limit is a 429 with its retry time
        ask(client, "up1/gpt-6-luna")
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_revoked_and_expired_keys(gateway):
    created = new_key(gateway)
    client = oai(gateway, created["key"])
    ask(client)
    revoked = admin(gateway, "DELETE", f"/admin/keys/{created['id']}")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    with pytest.raises(openai.AuthenticationError) as e:
        ask(client)
    assert "revoked" in e.value.message
    short = new_key(gateway, expires_in_seconds=1)
    time.sleep(1.2)
    with pytest.raises(openai.AuthenticationError) as e:
        ask(oai(gateway, short["key"]))
    assert "expired" in e.value.message


def test_no_secret_reaches_a_log_line_or_an_error_body(gateway):
    created = new_key(gateway)
    secret = created["key"].split("-", 2)[2]
    ask(oai(gateway, created["key"]))
    ask(oai(gateway, MASTER), "up2/gpt-6-luna")
    with pytest.raises(openai.AuthenticationError) as e:
        ask(oai(gateway, created["key"] + "x"))
    assert secret not in str(e.value.body)
    log = gateway.log()
    for value in (MASTER, STATIC, secret, UPSTREAM_KEY):
        assert value not in log
    assert "Bearer" not in log


@pytest.mark.slow
def test_refuses_to_serve_a_public_host_without_keys(tmp_path):
    # A new interpreter, as a user starts it: ``python -m decisiond.cli``.
    done = run_decisiond("serve", "--host", "0.0.0.0", "--port", "1", fresh=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "--allow-unauthenticated" in done.stderr
