"""The Python library: typed questions and answers in-process (tiny model, and the real SmolLM2 against a real
server), pydantic models as question sets, many items at once, and the remote ``Client``."""

from __future__ import annotations

import asyncio
import enum
import math
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import decisiond
from decisiond import Choice, ChoiceAnswer, Predicate, PredicateAnswer, Score, ScoreAnswer
from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text

README = Path(__file__).resolve().parents[1] / "README.md"
TICKET = "I was charged twice for my subscription. Please refund me today."
QUESTIONS = [
    Predicate("billing", "Is this ticket about billing?"),
    Choice("team", "Which team should handle it?", {"billing": "Charges, invoices", "shipping": None, True: None}),
    Score("urgency", "How urgent is it?", ["Can wait", "This week", "Today"]),
]


def test_exported_names_are_exactly_the_documented_ones():
    section = README.read_text().split("<!-- library-names -->")[1]
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
    assert billing.probability == pytest.approx(expected[0].probabilities[0], abs=1e-12)
    assert billing.probabilities == {True: billing.probability, False: pytest.approx(1 - billing.probability)}
    assert list(team.probabilities) == ["billing", "shipping", True]
    assert list(team.probabilities.values()) == pytest.approx(expected[1].probabilities, abs=1e-12)
    assert team.choice == max(team.probabilities, key=team.probabilities.get)
    assert list(urgency.probabilities.values()) == pytest.approx(expected[2].probabilities, abs=1e-12)
    assert urgency.score == pytest.approx(sum(i * p for i, p in enumerate(expected[2].probabilities)))
    assert urgency.label == ["Can wait", "This week", "Today"][urgency.level]
    for answer, raw in zip(decision.answers, expected):
        assert answer.label_mass == pytest.approx(raw.label_mass, abs=1e-12)
        assert 0.0 <= answer.confidence <= 1.0
    assert team.confidence == pytest.approx(expected[1].confidence or 0, abs=1e-12) or expected[1].confidence is None
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
