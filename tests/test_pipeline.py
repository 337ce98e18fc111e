"""The pipeline in process: stage order, outcomes attributed to the stage that refused, and errors — the 500
fallback included — rendered in the caller's dialect."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from decisiond.errors import DecisionError
from decisiond.gateway.pipeline import Context, Pipeline
from decisiond.gateway.router import Router
from decisiond.gateway.service import Gateway
from decisiond.server import create_app


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
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
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
