"""The Python library: typed questions and answers in-process (tiny model, and the real SmolLM2 against a real
server), pydantic models as question sets, many items at once, and the remote ``Client``."""

from __future__ import annotations

import asyncio
import enum
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

import decisiond
from decisiond import (
    AuthenticationFailed,
    BudgetExceeded,
    Choice,
    ChoiceAnswer,
    ConnectionFailed,
    GuardrailBlocked,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Predicate,
    PredicateAnswer,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    Score,
    ScoreAnswer,
    ServerError,
    Timeout,
    Unavailable,
)
from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text

PYTHON_API = Path(__file__).resolve().parents[1] / "docs" / "reference" / "python.md"
TICKET = "I was charged twice for my subscription. Please refund me today."
QUESTIONS = [
    Predicate("billing", "Is this ticket about billing?"),
    Choice("team", "Which team should handle it?", {"billing": "Charges, invoices", "shipping": None, True: None}),
    Score("urgency", "How urgent is it?", ["Can wait", "This week", "Today"]),
]


def test_exported_names_are_exactly_the_documented_ones():
    section = PYTHON_API.read_text().split("<!-- library-names -->")[1]
    documented = set(re.findall(r"`([A-Za-z_]+)`", section))
    assert set(decisiond.__all__) == documented
    for name in decisiond.__all__:
        assert hasattr(decisiond, name)
        if name[0].isupper() and name not in ("Answer", "QuestionLike"):
            assert getattr(decisiond, name).__doc__, name
    assert (Path(decisiond.__file__).parent / "py.typed").exists()


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with decisiond.Engine(tiny_engine) as built:
        yield built


def canonical_request() -> DecisionRequest:
    return DecisionRequest(input=(Message("user", (Text(TICKET),)),), questions=(
        Question("yes_no", "billing", (Text("Is this ticket about billing?"),)),
        Question("choice", "team", (Text("Which team should handle it?"),),
                 options=(Option("billing", "Charges, invoices"), Option("shipping"), Option(True))),
        Question("score", "urgency", (Text("How urgent is it?"),),
                 levels=(Level("Can wait"), Level("This week"), Level("Today"))),
    ))


def test_typed_answers_equal_the_engine(engine, tiny_engine):
    decision = engine.decide(TICKET, QUESTIONS)
    expected = tiny_engine.decide(canonical_request()).answers
    billing, team, urgency = decision.answers
    assert isinstance(billing, PredicateAnswer) and isinstance(team, ChoiceAnswer) and isinstance(urgency, ScoreAnswer)
    assert decision["billing"] is billing and decision[2] is urgency
    # The same numbers up to float rounding (the engine fixture answers in passes of another shape).
    assert billing.probability == pytest.approx(expected[0].probabilities[0], abs=1e-6)
    assert billing.probabilities == {True: billing.probability, False: pytest.approx(1 - billing.probability)}
    assert list(team.probabilities) == ["billing", "shipping", True]
    assert list(team.probabilities.values()) == pytest.approx(expected[1].probabilities, abs=1e-6)
    assert team.choice == max(team.probabilities, key=team.probabilities.get)
    assert list(urgency.probabilities.values()) == pytest.approx(expected[2].probabilities, abs=1e-6)
    assert urgency.score == pytest.approx(sum(i * p for i, p in enumerate(expected[2].probabilities)), abs=1e-6)
    assert urgency.label == ["Can wait", "This week", "Today"][urgency.level]
    for answer, raw in zip(decision.answers, expected):
        assert answer.label_mass == pytest.approx(raw.label_mass, abs=1e-6)
        assert 0.0 <= answer.confidence <= 1.0
    assert team.confidence == pytest.approx(expected[1].confidence or 0, abs=1e-6) or expected[1].confidence is None
    assert decision.model == "tiny-random" and decision.usage.input_tokens > 0 and decision.latency_s > 0
    # The random model is not uniform: the comparisons above are not vacuous.
    assert max(team.probabilities.values()) - min(team.probabilities.values()) > 0.01


def test_dict_questions_and_options_are_the_wire_fields(engine):
    as_dicts = engine.decide(TICKET, [q.to_dict() for q in QUESTIONS])
    assert as_dicts.to_dict()["answers"] == engine.decide(TICKET, QUESTIONS).to_dict()["answers"]
    cold = engine.decide(TICKET, QUESTIONS[1:2], temperature=0.25)["team"]
    hot = engine.decide(TICKET, QUESTIONS[1:2], temperature=4.0)["team"]
    assert max(cold.probabilities.values()) > max(hot.probabilities.values())
    cyclic = engine.decide(TICKET, QUESTIONS[1:2], order="cyclic")["team"]
    assert cyclic.probabilities != as_dicts["team"].probabilities


def test_refusals_name_the_field(engine):
    with pytest.raises(decisiond.DecisionError) as error:
        engine.decide(TICKET, [Choice("team", "Which team?", ["billing", "billing"])])
    assert error.value.path == ("questions", 0, "choices", 1, "value") and error.value.status == 400
    with pytest.raises(decisiond.DecisionError, match="temperature"):
        engine.decide(TICKET, QUESTIONS, temperature=-1.0)
    with pytest.raises(decisiond.DecisionError, match="does not exist"):
        engine.decide(TICKET, QUESTIONS, model="gpt-nope")
    with pytest.raises(TypeError, match="Predicate, Choice, Score"):
        engine.decide(TICKET, ["Is it billing?"])


def test_async_and_sync_inside_a_running_loop(engine):
    async def main():
        awaited = await engine.adecide(TICKET, QUESTIONS[:1])
        blocking = await asyncio.to_thread(engine.decide, TICKET, QUESTIONS[:1])
        return awaited, blocking

    awaited, blocking = asyncio.run(main())
    assert awaited["billing"].probability == blocking["billing"].probability


class Team(str, enum.Enum):
    billing = "billing"
    shipping = "shipping"


class Ticket(BaseModel):
    billing: bool | None = Field(None, description="Is this ticket about billing?")
    team: Team | None = Field(None, description="Which team should handle it?")
    tone: Literal["calm", "angry", "sarcastic"] | None = None
    urgency: Literal[1, 2, 3] | None = Field(None, description="How urgent, from 1 to 3?")


def test_questions_from_a_pydantic_model():
    billing, team, tone, urgency = decisiond.questions_from(Ticket)
    assert billing == Predicate("billing", "Is this ticket about billing?")
    assert team == Choice("team", "Which team should handle it?", ["billing", "shipping"])
    assert tone == Choice("tone", "Tone?", ["calm", "angry", "sarcastic"])
    assert urgency == Score("urgency", "How urgent, from 1 to 3?", ["1", "2", "3"])

    class Bad(BaseModel):
        amount: float

    with pytest.raises(TypeError, match="'amount'"):
        decisiond.questions_from(Bad)


def test_decide_as_fills_the_model_and_leaves_unsure_fields_none(engine):
    decision = engine.decide(TICKET, decisiond.questions_from(Ticket))
    full = engine.decide_as(Ticket, TICKET)
    assert isinstance(full, Ticket)
    assert full.billing == (decision["billing"].probability >= 0.5)
    assert full.team is Team(decision["team"].choice)
    assert full.tone == decision["tone"].choice
    assert full.urgency == [1, 2, 3][decision["urgency"].level]
    confidences = sorted(a.confidence for a in decision.answers)
    threshold = (confidences[1] + confidences[2]) / 2
    assert confidences[1] < threshold < confidences[2]
    partial = engine.decide_as(Ticket, TICKET, min_confidence=threshold)
    kept = {name for name in Ticket.model_fields if decision[name].confidence >= threshold}
    assert len(kept) == 2
    for name in Ticket.model_fields:
        assert (getattr(partial, name) is None) == (name not in kept)
        if name in kept:
            assert getattr(partial, name) == getattr(full, name)


def test_decide_many_keeps_order_and_reports_bad_items(engine):
    items = ["My parcel never arrived.", {"input": TICKET, "questions": [QUESTIONS[0].to_dict()]}, 42,
             "Please refund me."]
    results = engine.decide_many(items, QUESTIONS[:2], concurrency=3)
    assert [type(r).__name__ for r in results] == ["Decision", "Decision", "InvalidRequest", "Decision"]
    assert isinstance(results[2], decisiond.DecisionError)
    assert [a.name for a in results[1].answers] == ["billing"]
    assert "input" in str(results[2])
    single = engine.decide("Please refund me.", QUESTIONS[:2])
    assert results[3].to_dict()["answers"] == single.to_dict()["answers"]


def test_load_a_folder_and_the_client_agree(tiny_dir, tiny_server):
    local = decisiond.load(tiny_dir, served_name="tiny-modes")
    remote = decisiond.Client(tiny_server.url + "/v1", model="tiny-modes")
    try:
        here, there = local.decide(TICKET, QUESTIONS), remote.decide(TICKET, QUESTIONS)
        assert [type(a) for a in here.answers] == [type(a) for a in there.answers]
        for a, b in zip(here.answers, there.answers):
            assert list(a.probabilities.values()) == pytest.approx(list(b.probabilities.values()), abs=1e-5)
            assert a.confidence == pytest.approx(b.confidence, abs=1e-5)
        assert there.model == "tiny-modes" and there.usage.input_tokens == here.usage.input_tokens
        assert remote.models() == ["tiny-modes"]
        with pytest.raises(decisiond.DecisionError) as error:
            remote.decide(TICKET, [Choice("team", "Which team?", ["a", "a"])])
        assert error.value.status == 400 and error.value.path == ("questions[0].choices[1].value",)
        assert asyncio.run(remote.adecide(TICKET, QUESTIONS[:1]))["billing"].probability == pytest.approx(
            there["billing"].probability)
    finally:
        local.close()
        remote.close()


@pytest.mark.model
def test_real_model_in_process_equals_the_server(server):
    engine = decisiond.load("default")
    client = decisiond.Client(server.url)
    try:
        here = engine.decide(TICKET, QUESTIONS)
        there = client.decide(TICKET, QUESTIONS)
        assert here.model == there.model == "SmolLM2-135M-Instruct"
        for a, b in zip(here.answers, there.answers):
            assert list(a.probabilities.values()) == pytest.approx(list(b.probabilities.values()), abs=1e-5)
            assert math.isclose(sum(a.probabilities.values()), 1.0, abs_tol=1e-9)
            assert a.label_mass is not None and 0 < a.label_mass <= 1
    finally:
        engine.close()
        client.close()


# ------------------------------------------------------------------------- the client's exception boundary


@contextmanager
def answering(status: int, body: Any, headers: dict[str, str] | None = None, *, delay_s: float = 0.0,
              drop: bool = False) -> Iterator[str]:
    """A real HTTP server on loopback answering every GET and POST with ``status`` and ``body`` (JSON, or bytes as
    they are) after ``delay_s``, or dropping the connection unanswered; yields its URL."""

    class Handle(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            time.sleep(delay_s)
            if drop:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json" if not isinstance(body, bytes) else "text/html")
            self.send_header("content-length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_POST = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def refusal(status: int, code: str | None, param: str | None = None, type: str = "invalid_request_error") -> dict:
    return {"error": {"message": f"refused with {status}", "type": type, "param": param, "code": code}}


RETRY = {"retry-after": "2", "retry-after-ms": "1500"}


@pytest.mark.parametrize(("status", "code", "headers", "expected", "expected_code"), [
    (400, "invalid_value", {}, InvalidRequest, "invalid_value"),
    (400, "limit_exceeded", {}, LimitExceeded, "limit_exceeded"),
    (413, "request_too_large", {}, LimitExceeded, "request_too_large"),
    (400, "context_length_exceeded", {}, LimitExceeded, "context_length_exceeded"),
    (422, "invalid_type", {}, InvalidRequest, "invalid_type"),
    (415, "unsupported_encoding", {}, InvalidRequest, "unsupported_encoding"),
    (401, "invalid_api_key", {}, AuthenticationFailed, "invalid_api_key"),
    (402, "budget_exceeded", RETRY, BudgetExceeded, "budget_exceeded"),
    (403, "model_not_allowed", {}, PermissionDenied, "model_not_allowed"),
    (404, "model_not_found", {}, NotFound, "model_not_found"),
    (400, "guardrail_blocked", {}, GuardrailBlocked, "guardrail_blocked"),
    (429, "rate_limit_exceeded", RETRY, RateLimited, "rate_limit_exceeded"),
    (500, "internal_error", {}, ServerError, "internal_error"),
    (500, "guardrail_not_configured", {}, ServerError, "guardrail_not_configured"),
    (503, "server_overloaded", RETRY, Unavailable, "server_overloaded"),
    (504, "deadline_exceeded", {}, Timeout, "deadline_exceeded"),
    (504, "upstream_timeout", {}, ProviderTimeout, "upstream_timeout"),
    (502, "upstream_unavailable", {}, ProviderError, "upstream_unavailable"),
    (401, "upstream_401", {}, ProviderError, "upstream_401"),  # the provider's key failed, not the caller's
    (529, None, {}, ProviderError, "provider_error"),
    (418, None, {}, InvalidRequest, "invalid_value"),
])
def test_client_raises_the_class_of_each_server_refusal(status, code, headers, expected, expected_code):
    with answering(status, refusal(status, code, "questions[0].name"), headers) as url, \
            decisiond.Client(url) as client:
        with pytest.raises(decisiond.DecisionError) as caught:
            client.decide(TICKET, QUESTIONS[:1])
    error = caught.value
    assert type(error) is expected and isinstance(error, decisiond.DecisionError)
    assert (error.status, error.code, error.message) == (status, expected_code, f"refused with {status}")
    assert error.path == ("questions[0].name",) and error.type == "invalid_request_error"
    for name, value in headers.items():
        assert error.headers[name] == value
    assert "content-length" not in error.headers


def test_client_models_map_errors_the_same_way():
    with answering(401, refusal(401, "invalid_api_key", type="authentication_error")) as url, \
            decisiond.Client(url, api_key="sk-wrong") as client:
        with pytest.raises(AuthenticationFailed) as caught:
            client.models()
    assert (caught.value.status, caught.value.code, caught.value.type) == (401, "invalid_api_key",
                                                                          "authentication_error")
    assert isinstance(caught.value, decisiond.DecisionError)
    with answering(200, {"object": "list", "data": [{"id": "tiny"}, {"id": "default"}]}) as url, \
            decisiond.Client(url) as client:
        assert client.models() == ["tiny", "default"]
    with answering(200, {"object": "list", "data": [{"name": "tiny"}]}) as url, decisiond.Client(url) as client:
        with pytest.raises(ProviderError) as caught:
            client.models()
    assert type(caught.value) is ProviderError and (caught.value.status, caught.value.code) == (502, "invalid_response")


@pytest.mark.parametrize(("status", "body", "expected_status"), [
    (502, b"<html><body>502 Bad Gateway</body></html>", 502),
    (500, b"Internal Server Error", 500),
    (200, b"this is not JSON", 502),
    (200, ["a", "list"], 502),
    (200, {"object": "list"}, 502),  # neither answers nor models
])
def test_client_names_the_status_of_a_body_that_is_not_an_answer(status, body, expected_status):
    with answering(status, body) as url, decisiond.Client(url) as client:
        for call in (lambda: client.decide(TICKET, QUESTIONS[:1]), client.models):
            with pytest.raises(decisiond.DecisionError) as caught:
                call()
            error = caught.value
            assert type(error) is ProviderError and isinstance(error, decisiond.DecisionError)
            assert (error.status, error.code) == (expected_status, "invalid_response")
            assert f"HTTP {status}" in error.message


def test_client_transport_failures_are_decision_errors():
    with socket.socket() as probe:  # a port nothing listens on: the connection is refused
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with decisiond.Client(closed) as client:
        for call in (lambda: client.decide(TICKET, QUESTIONS[:1]), client.models):
            with pytest.raises(ConnectionFailed) as caught:
                call()
            assert isinstance(caught.value, decisiond.DecisionError)
            assert (caught.value.status, caught.value.code) == (503, "connection_failed")
    with answering(200, {}, drop=True) as url, decisiond.Client(url) as client:
        with pytest.raises(ConnectionFailed) as caught:
            client.decide(TICKET, QUESTIONS[:1])
        assert (caught.value.status, caught.value.code) == (503, "connection_failed")
    with answering(200, {}, delay_s=2.0) as url, decisiond.Client(url, timeout=0.2) as client:
        started = time.perf_counter()
        with pytest.raises(Timeout) as caught:
            client.decide(TICKET, QUESTIONS[:1])
        assert time.perf_counter() - started < 1.5
        assert type(caught.value) is Timeout and isinstance(caught.value, decisiond.DecisionError)
        assert (caught.value.status, caught.value.code) == (504, "client_timeout")
        with pytest.raises(Timeout):
            asyncio.run(client.amodels())
