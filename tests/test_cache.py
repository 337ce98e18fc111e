"""The exact response cache on a real server: HIT/MISS per answer-changing field, dialects sharing one entry,
Cache-Control, single flight counted at a fake upstream, failover answers not stored, and the admin endpoints."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import struct
import threading
import time
import zlib

import httpx
import pytest
import upstreams
from servers import start_decisiond

MASTER = "cache-master-key-0123456789"

CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
auth:
  master_key: "${TEST_MASTER}"
cache: {ttl: 60}
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
  - {name: local2, type: local, model: "${TINY_DIR}", served_model_name: tiny-second}
  - {name: up, type: openai, base_url: "${UP}/v1", api_key: upkey, cache: true}
  - {name: slow, type: openai, base_url: "${SLOW}/v1", api_key: upkey, cache: true}
  - {name: plain, type: openai, base_url: "${UP}/v1", api_key: upkey}
  - {name: e529, type: openai, base_url: "${E529}/v1", api_key: upkey, cache: true}
models:
  # A model entry covers every name of its model (local2/tiny-second, tiny-second): all of them uncached.
  - {name: uncached, provider: local2, cache: false}
virtual_models:
  - {name: fallback, targets: [e529/x, up/gpt-6-luna]}
  - {name: valias, strategy: alias, targets: [local/tiny-local], cache: false}
"""

QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
CHOICE = {"type": "choice", "name": "team", "instructions": "Which team?",
          "choices": [{"value": "billing"}, {"value": "sales"}]}


def slow_server(seconds: float) -> upstreams.Upstream:
    inner = upstreams.openai_server()

    def handle(seen):
        time.sleep(seconds)
        return inner.handler(seen)

    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def ups():
    servers = {"up": upstreams.openai_server(), "slow": slow_server(0.5),
               "e529": upstreams.status_server(529, {"error": {"message": "Overloaded", "type": "overloaded"}})}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def gw(ups, tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache")
    (folder / "gateway.yaml").write_text(CONFIG)
    env = {"TEST_MASTER": MASTER, "TINY_DIR": tiny_dir, "UP": ups["up"].url, "SLOW": ups["slow"].url,
           "E529": ups["e529"].url, "DECISIOND_DATA_DIR": str(folder / "data")}
    running = start_decisiond("--config", str(folder / "gateway.yaml"), env=env)
    yield running
    running.stop()


_counter = iter(range(10**9))


def unique(text: str = "I was charged twice.") -> str:
    """A fresh input, so each test starts with a miss whatever ran before it."""
    return f"{text} (ticket {next(_counter)}-{time.monotonic_ns()})"


def post(gw, body: dict, path: str = "/v1/decisions", **headers: str) -> httpx.Response:
    response = httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {MASTER}", **headers},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response


def body(**fields) -> dict:
    return {"model": "tiny-local", "input": unique(), "questions": [QUESTION, CHOICE], **fields}


def test_a_repeated_request_is_a_hit_with_a_byte_identical_answer(gw):
    request = body()
    first, second = post(gw, request), post(gw, request)
    assert first.headers["x-cache"] == "MISS" and second.headers["x-cache"] == "HIT"
    assert first.content == second.content
    assert float(second.headers["x-decisiond-cost"]) == 0  # a hit calls no provider: it costs nothing
    # Key order and whitespace of the body do not matter.
    reordered = json.dumps(dict(reversed(list(request.items()))), indent=3).encode()
    third = httpx.post(gw.url + "/v1/decisions", content=reordered, timeout=60,
                       headers={"Authorization": f"Bearer {MASTER}", "content-type": "application/json"})
    assert third.headers["x-cache"] == "HIT" and third.content == first.content
    assert '"cache": "hit"' in gw.log() or '"cache":"hit"' in gw.log()


# One test per answer-changing field on the local engine: a base request, then the same with one field changed.
LOCAL_FIELDS = {
    "input": {"input": "A different ticket."},
    "question": {"questions": [{**QUESTION, "instructions": "Is this about refunds?"}, CHOICE]},
    "option order of a choice": {"questions": [QUESTION, {**CHOICE, "choices": CHOICE["choices"][::-1]}]},
    "temperature": {"temperature": 0.5},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "order": {"order": "cyclic"},
    "calibrate": {"calibrate": "contextual"},
    "prompt_format_version": {"prompt_format_version": 1},
    "return_prompt_token_ids": {"return_prompt_token_ids": True},
}


@pytest.mark.parametrize("field", list(LOCAL_FIELDS))
def test_a_request_differing_in_one_local_field_is_a_miss(gw, field):
    base = body()
    changed = {**base, **LOCAL_FIELDS[field]}
    if field == "input":
        changed["input"] = base["input"] + " Another sentence."
    assert post(gw, base).headers["x-cache"] == "MISS"
    assert post(gw, base).headers["x-cache"] == "HIT"
    assert post(gw, changed).headers["x-cache"] == "MISS"
    assert post(gw, changed).headers["x-cache"] == "HIT"


def png_data_url(green: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes([0, green, 0]) * 2 for _ in range(2))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def with_image(green: int) -> list:
    return [{"role": "user", "content": [{"type": "input_text", "text": "Look."},
                                         {"type": "input_image", "image_url": png_data_url(green)}]}]


# Fields that only an upstream reads (the local engine refuses them), on an upstream model with cache: true.
UPSTREAM_FIELDS = {
    "image bytes": ({"input": with_image(255)}, {"input": with_image(254)}),
    "extra": ({"metadata_x": 1}, {"metadata_x": 2}),
    "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit"}},
                             {"prompt_cache_options": {"mode": "explicit"}}),
    "prompt_cache_key": ({"prompt_cache_key": "a"}, {"prompt_cache_key": "b"}),
    "safety_identifier": ({"safety_identifier": "u1"}, {"safety_identifier": "u2"}),
}


@pytest.mark.parametrize("field", list(UPSTREAM_FIELDS))
def test_a_request_differing_in_one_upstream_field_is_a_miss(gw, ups, field):
    first, second = UPSTREAM_FIELDS[field]
    base = {**body(model="up/gpt-6-luna"), **first}
    changed = {**base, **second}
    before = len(ups["up"].seen)
    assert post(gw, base).headers["x-cache"] == "MISS"
    assert post(gw, base).headers["x-cache"] == "HIT"
    assert post(gw, changed).headers["x-cache"] == "MISS"
    assert post(gw, changed).headers["x-cache"] == "HIT"
    assert len(ups["up"].seen) == before + 2  # the hits never reached the upstream


def test_key_order_inside_a_mapping_option_does_not_matter(gw, ups):
    base = body(model="up/gpt-6-luna", metadata_x={"a": 1, "b": 2})
    assert post(gw, base).headers["x-cache"] == "MISS"
    assert post(gw, {**base, "metadata_x": {"b": 2, "a": 1}}).headers["x-cache"] == "HIT"


def test_the_same_decision_through_two_dialects_is_one_entry(gw):
    text = unique()
    openai_shape = {"model": "tiny-local", "input": text, "questions": [QUESTION, CHOICE]}
    systemone_shape = {"model": "tiny-local", "state": text, "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "sales": None}}}}
    first = post(gw, openai_shape)
    second = post(gw, systemone_shape, path="/v1/systemone")
    assert first.headers["x-cache"] == "MISS" and second.headers["x-cache"] == "HIT"
    oa, s1 = first.json(), second.json()
    assert s1["answers"]["billing"]["noul"] == pytest.approx(oa["answers"][0]["probability"])
    assert s1["answers"]["team"]["choice"] == oa["answers"][1]["choice"]


def test_no_cache_recomputes_and_refreshes_no_store_neither_reads_nor_writes(gw, ups):
    request = body(model="up/gpt-6-luna")
    seen = ups["up"].seen
    before = len(seen)
    assert post(gw, request, **{"Cache-Control": "no-store"}).headers["x-cache"] == "MISS"
    assert post(gw, request).headers["x-cache"] == "MISS"  # no-store wrote nothing
    assert post(gw, request, **{"Cache-Control": "no-store"}).headers["x-cache"] == "MISS"  # nor read it
    assert post(gw, request, **{"Cache-Control": "no-cache"}).headers["x-cache"] == "MISS"
    assert post(gw, request).headers["x-cache"] == "HIT"
    assert len(seen) == before + 4


def test_sixteen_identical_concurrent_requests_call_the_upstream_once(gw, ups):
    request = body(model="slow/gpt-6-luna")
    before = len(ups["slow"].seen)
    barrier = threading.Barrier(16)

    def ask(_):
        barrier.wait()
        return post(gw, request)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(ask, range(16)))
    assert len(ups["slow"].seen) == before + 1
    assert sorted(r.headers["x-cache"] for r in responses) == ["HIT"] * 15 + ["MISS"]
    assert len({r.content for r in responses}) == 1


def test_models_without_caching_and_failover_answers_are_not_stored(gw, ups):
    for model in ("uncached", "valias"):
        request = body(model=model)
        assert "x-cache" not in post(gw, request).headers and "x-cache" not in post(gw, request).headers
    off = body(model="plain/gpt-6-luna")  # an upstream provider: not cached unless it says cache: true
    assert "x-cache" not in post(gw, off).headers
    request = body(model="fallback")
    before = len(ups["up"].seen)
    assert post(gw, request).headers["x-cache"] == "MISS"
    assert post(gw, request).headers["x-cache"] == "MISS"  # the answer came from the second target
    assert len(ups["up"].seen) == before + 2


def test_admin_cache_statistics_and_delete_need_the_master_key(gw):
    request = body()
    post(gw, request)
    post(gw, request)
    master = {"Authorization": f"Bearer {MASTER}"}
    stats = httpx.get(gw.url + "/admin/cache", headers=master).json()
    assert stats["entries"] >= 1 and stats["bytes"] > 0 and stats["hits"] >= 1 and stats["misses"] >= 1
    assert httpx.get(gw.url + "/admin/cache").status_code == 401
    assert httpx.delete(gw.url + "/admin/cache", headers={"Authorization": "Bearer wrong-key-0123456789"}) \
        .status_code == 401
    deleted = httpx.delete(gw.url + "/admin/cache", headers=master)
    assert deleted.status_code == 200 and deleted.json()["entries"] >= 1
    assert httpx.get(gw.url + "/admin/cache", headers=master).json()["entries"] == 0
    assert post(gw, request).headers["x-cache"] == "MISS"


def test_the_calibration_profile_in_force_is_part_of_the_key(tiny):
    from decisiond.canonical import DecisionRequest, Message, Question, Text
    from decisiond.engine.calibration import Fit, Profile
    from decisiond.engine.local import LocalEngine
    from decisiond.gateway.router import Router
    from decisiond.gateway.settings import CacheConfig
    from decisiond.gateway.stages.cache import CacheStage, ResponseCache
    from decisiond.gateway.types import Context

    request = DecisionRequest((Message("user", (Text("hi"),)),), (Question("yes_no", "q", (Text("?"),)),))
    keys = []
    for profile in (None, Profile("tiny-random", 1, fits={"yes_no": Fit(temperature=1.5)}),
                    Profile("tiny-random", 1, fits={"yes_no": Fit(temperature=2.0)})):
        engine = LocalEngine(tiny, profile=profile)
        stage = CacheStage(ResponseCache(CacheConfig()), Router.local_only(engine))
        context = Context("req_1", "decide", "openai", resolved_model="tiny-random")
        plan = stage.plan(context, request)
        assert plan is not None
        keys.append(plan[0])
    assert len(set(keys)) == 3


def test_a_hit_consumes_no_rate_limit_tokens(gw):
    created = httpx.post(gw.url + "/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}, timeout=30,
                         json={"name": "two-a-minute", "rate_limits": {"requests_per_minute": 2}})
    key = created.json()["key"]

    def ask(request):
        return httpx.post(gw.url + "/v1/decisions", json=request, headers={"Authorization": f"Bearer {key}"},
                          timeout=60)

    request = body()
    statuses = [ask(request) for _ in range(4)]
    assert [(r.status_code, r.headers.get("x-cache")) for r in statuses] == [(200, "MISS")] + [(200, "HIT")] * 3
    assert ask(body()).status_code == 200  # the second token of the minute
    assert ask(body()).status_code == 429
    assert ask(request).status_code == 200  # still a hit
