"""The pipeline in process: stage order, outcomes attributed to the stage that refused, and errors — the 500
fallback included — rendered in the caller's dialect."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from decisiond.errors import DecisionError
from decisiond.gateway.pipeline import Pipeline
from decisiond.gateway.router import Router
from decisiond.gateway.service import Gateway
from decisiond.gateway.types import Context
from decisiond.server.app import create_app


class Record:
    def __init__(self, name: str, seen: list, fail: Exception | None = None):
        self.name, self.seen, self.fail = name, seen, fail

    async def __call__(self, context, request, call_next):
        self.seen.append(self.name)
        if self.fail is not None:
            raise self.fail
        return await call_next(context, request)


def test_stages_run_in_order_and_the_refusing_stage_is_named():
    seen: list[str] = []

    async def terminal(context, request):
        seen.append("route")
        return "answer"

    ok = Pipeline([Record("a", seen), Record("b", seen)], terminal)
    context = Context("req_1", "decide", "openai")

    class Request:
        model = "m"

    assert asyncio.run(ok.run(context, Request())) == "answer"
    assert seen == ["a", "b", "route"] and context.outcomes == {"a": "ok", "b": "ok", "route": "ok"}
    assert set(context.timings) == {"a", "b", "route"} and context.requested_model == "m"

    seen.clear()
    refusing = Pipeline([Record("a", seen), Record("b", seen, DecisionError("no", code="nope", status=403))],
                        terminal)
    context = Context("req_2", "decide", "openai")
    with pytest.raises(DecisionError):
        asyncio.run(refusing.run(context, Request()))
    assert seen == ["a", "b"] and context.outcomes == {"a": "ok", "b": "refused: nope"}


@pytest.fixture()
def broken_app(tiny_engine):
    """The real app on the tiny engine, with a stage that fails as a bug would."""
    router = Router.local_only(tiny_engine)
    gateway = Gateway(router)
    gateway.pipeline = Pipeline([*gateway.pipeline.stages, Record("bug", [], RuntimeError("boom at secret"))],
                                gateway.pipeline.terminal)
    return create_app(router, gateway=gateway)


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def test_a_bug_is_a_500_in_the_callers_dialect(broken_app):
    openai_shape = post(broken_app, "/v1/decisions", {"model": "tiny-random", "input": "x", "questions": [
        {"type": "predicate", "name": "q", "instructions": "?"}]})
    assert openai_shape.status_code == 500
    assert openai_shape.json() == {"error": {"message": "Internal server error.", "type": "server_error",
                                             "param": None, "code": "internal_error"}}
    sglang = post(broken_app, "/v1/decisions", {"input": "x", "questions": [
        {"id": "q", "type": "yes_no", "question": "?"}]})
    assert sglang.status_code == 500 and sglang.json()["object"] == "error" and sglang.json()["code"] == 500
    systemone = post(broken_app, "/v1/systemone", {"state": "x", "model": "m", "questions": {
        "q": {"type": "noul", "instructions": "?"}}})
    assert systemone.status_code == 500 and systemone.json()["error"]["type"] == "server_error"
    for response in (openai_shape, sglang, systemone):
        assert "boom" not in response.text and response.headers["x-request-id"].startswith("req_")


@pytest.fixture()
def app(tiny_engine):
    from decisiond.gateway.config import parse

    config = parse({"allow_raw_upstreams": True, "providers": [{"name": "up", "type": "openai", "base_url": "http://127.0.0.1:9/v1"},
                                  {"name": "local", "type": "local"}]})
    router = Router.from_config(config, {"local": tiny_engine})
    return create_app(router, gateway=Gateway(router, config))


def send(app, path: str, content: bytes, headers: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(go())


SGLANG_BODY = b'{"input": "I was charged twice.", "questions": [{"id": "q", "type": "yes_no", "question": "Billing?"}]}'


def test_gzip_deflate_and_zstd_bodies(app):
    import zlib

    gz = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    for encoding, data in (("gzip", gz.compress(SGLANG_BODY) + gz.flush()), ("deflate", zlib.compress(SGLANG_BODY)),
                           ("identity", SGLANG_BODY)):
        response = send(app, "/v1/decisions", data, {"content-encoding": encoding,
                                                       "content-type": "application/json"})
        assert response.status_code == 200, (encoding, response.text)
        assert set(response.json()["answers"]["q"]["probabilities"]) == {"yes", "no"}
    broken = send(app, "/v1/decisions", zlib.compress(SGLANG_BODY)[:-6], {"content-encoding": "deflate"})
    assert broken.status_code == 400 and "deflate" in broken.json()["message"]
    import zstandard

    cut = send(app, "/v1/decisions", zstandard.ZstdCompressor().compress(SGLANG_BODY)[:-4],
               {"content-encoding": "zstd"})
    assert cut.status_code == 400 and "zstd" in cut.json()["message"] and "ends early" in cut.json()["message"]
    unknown = send(app, "/v1/decisions", SGLANG_BODY, {"content-encoding": "br"})
    assert unknown.status_code == 415 and "br" in unknown.json()["message"]


def test_score_needs_a_local_model(app):
    body = b'{"model": "up/gpt-6", "query": "Is this billing? ", "items": ["yes"], "label_token_ids": [1, 2]}'
    refused = send(app, "/v1/score", body, {"content-type": "application/json"})
    assert refused.status_code == 400 and refused.json()["object"] == "error"
    assert "not a local model" in refused.json()["message"] and refused.json()["param"] == "model"
    served = send(app, "/v1/score", body.replace(b"up/gpt-6", b"local/tiny-random"),
                  {"content-type": "application/json"})
    assert served.status_code == 200 and len(served.json()["scores"][0]) == 2
