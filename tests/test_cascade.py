"""Cascades (``strategy: cascade``): the tiny local model answers first, and the questions it is unsure of go on to
real upstream-shaped HTTP servers on loopback (OpenAI's and System One's wire formats) — one call per step holding
only those questions, counted at the upstream. Through every route (OpenAI, SGLang, System One), the library and
``decisiond batch``; usage rows, cost, the response cache and budget reservations."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import pytest
import upstreams
from servers import run_decisiond

import decisiond
from decisiond.dialects import openai as openai_dialect
from decisiond.gateway import cascade
from decisiond.gateway.config import ConfigError, parse
from decisiond.gateway.router import Router
from decisiond.gateway.service import Gateway
from decisiond.gateway.stages.budget import BudgetStage
from decisiond.gateway.types import Context
from decisiond.library.decider import LoopThread
from decisiond.server.app import create_app

MASTER = "cascade-master-key-0123456789"
LOCAL_RATE, STRONG_RATE, JEV_RATE = 1.0, 20.0, 5.0  # USD per million input tokens
STRONG_P = 0.96
TEXT = "I was charged twice for my subscription and nobody answers. Please refund me today!"
QUESTIONS = [
    {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
    {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
     "choices": [{"value": "billing"}, {"value": "technical"}, {"value": "sales"}]},
    {"type": "predicate", "name": "urgent", "instructions": "The customer needs an answer today."},
    {"type": "score", "name": "anger", "instructions": "How angry is the customer?",
     "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}]},
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
    {"type": "choice", "name": "channel", "instructions": "Where did this come from?",
     "choices": [{"value": "email"}, {"value": "chat"}, {"value": "phone"}, {"value": "social"}]},
]


def strong_answer(question: dict[str, Any]) -> dict[str, Any]:
    """The first candidate at ``STRONG_P`` (a predicate: yes at ``STRONG_P``)."""
    name = question.get("name")
    if question["type"] == "predicate":
        return {"type": "predicate", "name": name, "probability": STRONG_P}
    items = question["choices"] if question["type"] == "choice" else question["levels"]
    probs = [STRONG_P] + [(1 - STRONG_P) / (len(items) - 1)] * (len(items) - 1)
    if question["type"] == "choice":
        return {"type": "choice", "name": name, "choice": items[0]["value"], "confidence": 0.9,
                "probabilities": [{"value": c["value"], "probability": p} for c, p in zip(items, probs)]}
    return {"type": "score", "name": name, "score": sum(i * p for i, p in enumerate(probs)), "confidence": 0.9,
            "probabilities": [{"label": lv["label"], "value": j, "probability": p}
                              for j, (lv, p) in enumerate(zip(items, probs))]}


def strong_server() -> upstreams.Upstream:
    """OpenAI's /v1/decisions, sure of every answer; it bills 5 input tokens plus 7 per question."""
    def handle(seen: upstreams.Seen):
        body = seen.json()
        return 200, {}, {"model": "gpt-6-strong", "answers": [strong_answer(q) for q in body["questions"]],
                         "usage": {"input_tokens": 5 + 7 * len(body["questions"]), "output_tokens": 0,
                                   "total_tokens": 5 + 7 * len(body["questions"])}}
    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def ups():
    made = {"strong": strong_server(), "jev": upstreams.systemone_server("jev-cascade"),
            "down": upstreams.status_server(503, {"error": {"message": "unavailable", "type": "server_error"}})}
    yield made
    for server in made.values():
        server.stop()


def config(ups, escalate_below: Any, database: str | None = None, **extra: Any):
    """``escalate_below``: the two-step cascades' threshold (a list: the three-step one's, whose first is theirs;
    a number t: theirs, and [t, 0.7] for the three-step one)."""
    first = escalate_below[0] if isinstance(escalate_below, list) else escalate_below
    steps = escalate_below if isinstance(escalate_below, list) else [escalate_below, 0.7]
    return parse({
        "allow_raw_upstreams": True,
        **({"database_url": database, "auth": {"master_key": MASTER}} if database else {}),
        "providers": [
            {"name": "local", "type": "local", "pricing": {"input_per_mtok": LOCAL_RATE}},
            {"name": "strong", "type": "openai", "base_url": ups["strong"].url + "/v1", "api_key": "sk-strong"},
            {"name": "jev", "type": "systemone", "base_url": ups["jev"].url, "api_key": "ts"},
            {"name": "down", "type": "openai", "base_url": ups["down"].url + "/v1", "api_key": "sk-down"}],
        "models": [{"name": "luna", "provider": "strong", "upstream": "gpt-6-strong",
                    "pricing": {"input_per_mtok": STRONG_RATE}},
                   {"name": "jev-1", "provider": "jev", "pricing": {"input_per_mtok": JEV_RATE}}],
        "virtual_models": [
            {"name": "triage", "strategy": "cascade", "escalate_below": first,
             "targets": ["local/tiny-random", "luna"]},
            {"name": "sturdy", "targets": ["down/x", "luna"]},
            {"name": "careful", "strategy": "cascade", "escalate_below": first,
             "targets": ["local/tiny-random", "sturdy"]},
            {"name": "three", "strategy": "cascade", "escalate_below": steps,
             "targets": ["local/tiny-random", "jev-1", "luna"]}],
        **extra})


def gateway_for(ups, tiny_engine, escalate_below: Any, **kw: Any) -> Gateway:
    built = config(ups, escalate_below, **kw)
    return Gateway(Router.from_config(built, {"local": tiny_engine}), built)


# Each gateway ``post`` used, with its own event loop: kept, so that its upstream sessions are closed on that loop
# when the module is done (``_close_posted``).
LOOPS: dict[int, tuple[Gateway, LoopThread]] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_posted():
    yield
    for gateway, loop in LOOPS.values():
        loop.run(gateway.router.aclose())
        loop.close()
    LOOPS.clear()


def post(gateway: Gateway, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """``body`` posted to the app in front of ``gateway``, on that gateway's own event loop (its upstream clients'
    connections belong to the loop they were opened on)."""
    app = create_app(gateway.router, gateway=gateway)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, json=body, headers=headers or {})

    return LOOPS.setdefault(id(gateway), (gateway, LoopThread()))[1].run(go())


def openai_body(model: str, questions: list[dict[str, Any]] = QUESTIONS) -> dict[str, Any]:
    return {"model": model, "input": TEXT, "questions": questions}


@pytest.fixture(scope="module")
def local_answers(ups, tiny_engine) -> list[dict[str, Any]]:
    """The first target's own answers to QUESTIONS, asked of it directly."""
    response = post(gateway_for(ups, tiny_engine, 0.5), "/v1/decisions", openai_body("local/tiny-random"))
    assert response.status_code == 200, response.text
    return response.json()["answers"]


def confidence(answer: dict[str, Any]) -> float:
    if answer["type"] == "predicate":
        return max(answer["probability"], 1 - answer["probability"])
    return max(p["probability"] for p in answer["probabilities"])


def between(local_answers: list[dict[str, Any]]) -> float:
    """A threshold halfway into the first target's confidences: some questions under it, some over."""
    ordered = sorted(confidence(a) for a in local_answers)
    middle = len(ordered) // 2
    assert ordered[middle - 1] < ordered[middle], "the tiny model gave equal confidences; pick other questions"
    return (ordered[middle - 1] + ordered[middle]) / 2


def close(got: Any, expected: Any, tolerance: float = 1e-5) -> bool:
    """Equal, floats within ``tolerance``: the local model's answers after a cached prefix differ from a fresh pass
    at float rounding only."""
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(close(got[k], expected[k], tolerance) for k in got)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(close(a, b, tolerance) for a, b in zip(got, expected))
    if isinstance(got, float) or isinstance(expected, float):
        return isinstance(got, (int, float)) and isinstance(expected, (int, float)) and abs(got - expected) <= tolerance
    return bool(got == expected)


def seen_since(upstream: upstreams.Upstream, before: int) -> list[list[str]]:
    """The question names of each request the upstream got since ``before``."""
    out = []
    for seen in upstream.seen[before:]:
        body = seen.json()
        questions = body["questions"]
        out.append([q["name"] for q in questions] if isinstance(questions, list) else list(questions))
    return out


def test_only_the_unsure_questions_go_to_the_strong_model_in_one_call(ups, tiny_engine, local_answers):
    threshold = between(local_answers)
    unsure = [a["name"] for a in local_answers if confidence(a) < threshold]
    assert 0 < len(unsure) < len(QUESTIONS)
    before = len(ups["strong"].seen)
    response = post(gateway_for(ups, tiny_engine, threshold), "/v1/decisions", openai_body("triage"))
    assert response.status_code == 200, response.text
    assert seen_since(ups["strong"], before) == [unsure]  # one call, exactly those questions, in order
    assert response.headers["x-decisiond-escalated"] == f"{len(unsure)} of {len(QUESTIONS)}"
    answers = response.json()["answers"]
    assert [a["name"] for a in answers] == [q["name"] for q in QUESTIONS]
    for mine, local in zip(answers, local_answers):
        if mine["name"] in unsure:
            assert confidence(mine) == pytest.approx(STRONG_P)
        else:
            assert close(mine, local)  # kept: the first target's own answer
    # Usage and cost summed over both calls: the local call's tokens at its price, the strong call's at its own.
    direct = post(gateway_for(ups, tiny_engine, 0.5), "/v1/decisions", openai_body("local/tiny-random"))
    local_tokens = direct.json()["usage"]["input_tokens"]
    strong_tokens = 5 + 7 * len(unsure)
    assert response.json()["usage"]["input_tokens"] == local_tokens + strong_tokens
    cost = float(response.headers["x-decisiond-cost"])
    assert cost == pytest.approx((local_tokens * LOCAL_RATE + strong_tokens * STRONG_RATE) / 1e6, rel=1e-6)
    assert float(direct.headers["x-decisiond-cost"]) == pytest.approx(local_tokens * LOCAL_RATE / 1e6, rel=1e-6)


def test_threshold_zero_never_escalates_and_above_one_always_does(ups, tiny_engine, local_answers):
    before = len(ups["strong"].seen)
    never = post(gateway_for(ups, tiny_engine, 0), "/v1/decisions", openai_body("triage"))
    assert never.status_code == 200 and never.headers["x-decisiond-escalated"] == "0 of 6"
    assert close(never.json()["answers"], local_answers) and len(ups["strong"].seen) == before
    always = post(gateway_for(ups, tiny_engine, 1.01), "/v1/decisions", openai_body("triage"))
    assert always.status_code == 200 and always.headers["x-decisiond-escalated"] == "6 of 6"
    assert seen_since(ups["strong"], before) == [[q["name"] for q in QUESTIONS]]
    assert all(confidence(a) == pytest.approx(STRONG_P) for a in always.json()["answers"])
    assert always.json()["model"] == "gpt-6-strong"


def test_sglang_and_system_one_routes_cascade_too(ups, tiny_engine, local_answers):
    gateway = gateway_for(ups, tiny_engine, between(local_answers))
    before = len(ups["strong"].seen)
    sglang = post(gateway, "/v1/decisions", {"model": "triage", "input": TEXT, "questions": [
        {"id": "billing", "type": "yes_no", "question": "Is this about billing?"},
        {"id": "urgent", "type": "yes_no", "question": "The customer needs an answer today."}]})
    assert sglang.status_code == 200, sglang.text
    assert set(sglang.json()["answers"]) == {"billing", "urgent"}
    system_one = post(gateway, "/v1/systemone", {"state": TEXT, "model": "triage", "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "urgent": {"type": "noul", "instructions": "The customer needs an answer today."}}})
    assert system_one.status_code == 200, system_one.text
    assert set(system_one.json()["answers"]) == {"billing", "urgent"}
    for response in (sglang, system_one):
        assert response.headers["x-decisiond-escalated"].endswith(" of 2")
    calls = seen_since(ups["strong"], before)
    escalated = [int(r.headers["x-decisiond-escalated"].split()[0]) for r in (sglang, system_one)]
    assert [len(c) for c in calls] == [n for n in escalated if n]  # one call per request that escalated
    assert all(set(c) <= {"billing", "urgent"} for c in calls)


def test_per_step_thresholds_three_steps_one_call_each(ups, tiny_engine, local_answers):
    """local → System One (jev: its choices and scores at 0.6, predicates at 0.8) → luna, thresholds [t, 0.7]:
    jev gets the local model's unsure questions, luna only jev's choices and scores among them."""
    threshold = between(local_answers)
    unsure = [a["name"] for a in local_answers if confidence(a) < threshold]
    kinds = {q["name"]: q["type"] for q in QUESTIONS}
    jev_before, strong_before = len(ups["jev"].seen), len(ups["strong"].seen)
    response = post(gateway_for(ups, tiny_engine, [threshold, 0.7]), "/v1/decisions", openai_body("three"))
    assert response.status_code == 200, response.text
    assert seen_since(ups["jev"], jev_before) == [unsure]
    to_luna = [n for n in unsure if kinds[n] != "predicate"]
    assert seen_since(ups["strong"], strong_before) == ([to_luna] if to_luna else [])
    answers = {a["name"]: a for a in response.json()["answers"]}
    for name in unsure:
        expected = STRONG_P if name in to_luna else 0.8  # jev's noul probability
        assert confidence(answers[name]) == pytest.approx(expected)
    assert response.headers["x-decisiond-escalated"] == f"{len(unsure)} of 6"
    assert response.headers["x-decisiond-provider-format"] == "+".join(
        ["local", "system_one"] + (["openai"] if to_luna else []))


def test_failover_within_a_step_and_one_usage_row_per_call(ups, tiny_engine, local_answers, tmp_path):
    threshold = between(local_answers)
    unsure = [a["name"] for a in local_answers if confidence(a) < threshold]
    gateway = gateway_for(ups, tiny_engine, threshold, database=f"sqlite:///{tmp_path}/usage.sqlite3")
    app = create_app(gateway.router, gateway=gateway)
    headers = {"authorization": f"Bearer {MASTER}"}
    down_before, strong_before = len(ups["down"].seen), len(ups["strong"].seen)

    async def go() -> tuple[httpx.Response, list[dict[str, Any]]]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            answered = await client.post("/v1/decisions", json=openai_body("careful"), headers=headers)
            rid = answered.headers["x-request-id"]
            deadline = time.monotonic() + 20
            while True:
                rows = (await client.get("/admin/audit", headers=headers)).json()["data"]
                mine = [r for r in rows if r["request_id"] == rid]
                if len(mine) >= 2 or time.monotonic() > deadline:
                    return answered, mine
                await asyncio.sleep(0.05)

    response, rows = asyncio.run(go())
    assert response.status_code == 200, response.text
    assert seen_since(ups["down"], down_before) == [unsure]  # the step's first target failed over…
    assert seen_since(ups["strong"], strong_before) == [unsure]  # …to its second, in the same one call
    rows.sort(key=lambda r: r["id"])
    assert [r["targets"] for r in rows] == [["tiny-random"], ["down/x", "luna"]]
    assert [r["model"] for r in rows] == ["tiny-random", "luna"] and rows[1]["attempts"] == 2
    assert rows[1]["input_tokens"] == 5 + 7 * len(unsure)
    assert rows[0]["input_tokens"] + rows[1]["input_tokens"] == response.json()["usage"]["input_tokens"]
    assert rows[1]["cost"] == pytest.approx(rows[1]["input_tokens"] * STRONG_RATE / 1e6, rel=1e-6)
    assert sum(r["cost"] for r in rows) == pytest.approx(float(response.headers["x-decisiond-cost"]), rel=1e-6)
    assert {r["status"] for r in rows} == {200} and {r["resolved_model"] for r in rows} == {"careful"}


def test_a_step_that_fails_fails_the_request_and_keeps_the_first_calls_cost(ups, tiny_engine):
    built = parse({**config(ups, 2).model_dump(mode="json"), "virtual_models": [
        {"name": "broken", "strategy": "cascade", "escalate_below": 2, "targets": ["local/tiny-random", "down/x"]}]})
    gateway = Gateway(Router.from_config(built, {"local": tiny_engine}), built)
    context = Context("req_x", "decide", "openai", resolved_model="broken")
    request = openai_dialect.parse_request(openai_body("broken"))

    async def run() -> Any:
        try:
            return await gateway.pipeline.run(context, request)
        finally:
            await gateway.router.aclose()  # its upstream sessions, on the loop they were opened on

    with pytest.raises(decisiond.ProviderError):
        asyncio.run(run())
    assert len(context.calls) == 2 and context.calls[0].usage is not None and context.calls[1].usage is None
    assert context.cost == pytest.approx(context.calls[0].cost) and context.cost > 0
    assert context.response_headers["x-decisiond-escalated"] == "6 of 6"


def test_cache_keeps_only_answers_that_escalated_nothing(ups, tiny_engine):
    never = gateway_for(ups, tiny_engine, 0)
    first, second = (post(never, "/v1/decisions", openai_body("triage")) for _ in range(2))
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
    assert second.headers["x-decisiond-escalated"] == "0 of 6" and second.json()["answers"] == first.json()["answers"]
    always = gateway_for(ups, tiny_engine, 1.5)
    before = len(ups["strong"].seen)
    first, second = (post(always, "/v1/decisions", openai_body("triage")) for _ in range(2))
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "MISS")
    assert len(ups["strong"].seen) == before + 2
    # Another threshold is another entry: an answer stored under one never answers under the other.
    from decisiond.gateway.stages.cache import CacheStage

    request = openai_dialect.parse_request(openai_body("triage"))
    keys = {CacheStage(never.cache, g.router).plan(Context("r", "decide", "openai", resolved_model="triage"),
                                                   request)[0] for g in (never, always)}
    assert len(keys) == 2


def test_budgets_reserve_every_steps_worst_case(ups, tiny_engine):
    gateway = gateway_for(ups, tiny_engine, 0.8)
    stage = BudgetStage(lambda: None, gateway.router.catalog)
    request = openai_dialect.parse_request(openai_body("triage"))

    def worst(name: str) -> int:
        return asyncio.run(stage.worst_case(Context("r", "decide", "openai", resolved_model=name), request))

    assert worst("luna") > 0 and worst("tiny-random") > 0
    assert worst("triage") == worst("tiny-random") + worst("luna")
    assert worst("three") == worst("tiny-random") + worst("jev-1") + worst("luna")
    assert worst("careful") == worst("tiny-random") + worst("sturdy")


def test_the_library_asks_a_cascade_by_name(ups, tiny_engine, local_answers):
    threshold = between(local_answers)
    unsure = {a["name"] for a in local_answers if confidence(a) < threshold}
    built = config(ups, threshold)
    questions = [decisiond.Predicate("billing", "Is this about billing?"),
                 decisiond.Choice("team", "Which team should handle it?", ["billing", "technical", "sales"]),
                 decisiond.Predicate("urgent", "The customer needs an answer today.")]
    router = Router.from_config(built, {"local": tiny_engine})
    with decisiond.Engine(router) as engine:
        try:
            local = engine.decide(TEXT, questions, model="local/tiny-random")
            before = len(ups["strong"].seen)
            decision = engine.decide(TEXT, questions, model="triage")
        finally:
            engine._run(router.aclose())  # its upstream sessions, on the engine's own loop
    asked = {q.name for q in questions}
    expected = [n for n in ("billing", "team", "urgent") if n in unsure & asked]
    assert seen_since(ups["strong"], before) == ([expected] if expected else [])
    for name in ("billing", "team", "urgent"):
        if name in expected:
            assert decision[name].probabilities != local[name].probabilities
        else:
            assert decision[name].probabilities == local[name].probabilities


def test_batch_with_a_config_answers_through_the_cascade(ups, tiny_dir, tmp_path):
    (tmp_path / "gateway.yaml").write_text(json.dumps({
        "providers": [{"name": "local", "type": "local", "model": tiny_dir, "served_model_name": "tiny-batch"},
                      {"name": "strong", "type": "openai", "base_url": ups["strong"].url + "/v1", "api_key": "k"}],
        "models": [{"name": "luna", "provider": "strong", "upstream": "gpt-6-strong"}],
        "virtual_models": [{"name": "triage", "strategy": "cascade", "escalate_below": 1.5,
                            "targets": ["local/tiny-batch", "luna"]}]}))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "input": f"ticket {i}"}) + "\n" for i in range(3)))
    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS[:2]))
    before = len(ups["strong"].seen)
    result = run_decisiond("batch", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
                           "--questions", str(tmp_path / "q.json"), "--config", str(tmp_path / "gateway.yaml"),
                           "--model", "triage", "--no-progress", timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [0, 1, 2]
    assert all(math.isclose(r["answers"][0]["probability"], STRONG_P) for r in records)
    assert seen_since(ups["strong"], before) == [["billing", "team"]] * 3


def test_cascade_config_is_checked(ups):
    base = config(ups, 0.8).model_dump(mode="json")

    def with_virtual(*virtual: dict[str, Any]) -> None:
        parse({**base, "virtual_models": list(virtual)})

    with pytest.raises(ConfigError, match="needs at least two targets"):
        with_virtual({"name": "c", "strategy": "cascade", "escalate_below": 0.5, "targets": ["luna"]})
    with pytest.raises(ConfigError, match="escalate_below goes with strategy cascade"):
        with_virtual({"name": "c", "strategy": "cascade", "targets": ["luna", "jev-1"]})
    with pytest.raises(ConfigError, match="escalate_below goes with strategy cascade"):
        with_virtual({"name": "c", "escalate_below": 0.5, "targets": ["luna", "jev-1"]})
    with pytest.raises(ConfigError, match="one threshold per step but the last"):
        with_virtual({"name": "c", "strategy": "cascade", "escalate_below": [0.5, 0.6], "targets": ["luna", "jev-1"]})
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        with_virtual({"name": "c", "strategy": "cascade", "escalate_below": -0.1, "targets": ["luna", "jev-1"]})
    with pytest.raises(ConfigError, match="a cascade is asked by name only"):
        with_virtual({"name": "c", "strategy": "cascade", "escalate_below": 0.5, "targets": ["luna", "jev-1"]},
                     {"name": "f", "targets": ["c", "luna"]})


def test_confidence_is_the_top_probability_and_a_refusal_has_none():
    from decisiond.canonical import Answer

    assert cascade.confidence(Answer("yes_no", "a", [0.3, 0.7])) == 0.7
    assert cascade.confidence(Answer("choice", "b", [0.2, 0.5, 0.3])) == 0.5
    assert cascade.confidence(Answer("yes_no", "c", [], refusal=True)) == 0.0
    answers = [Answer("yes_no", "a", [0.3, 0.7]), Answer("yes_no", "b", [0.9, 0.1]), Answer("yes_no", "c", [1.0, 0.0])]
    assert cascade.unsure(answers, 0) == [] and cascade.unsure(answers, 1.01) == [0, 1, 2]
    assert cascade.unsure(answers, 0.8) == [0] and cascade.unsure(answers, 1.0) == [0, 1]
