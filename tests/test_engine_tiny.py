"""The local engine on a tiny random-weight model: answers equal a hand computation from the model's logits."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_loaded

from decisiond.canonical import DecisionRequest, Image, Level, Message, Option, Question, Text
from decisiond.engine.local import LocalEngine
from decisiond.errors import DecisionError


def request(*questions, temperature=None, text="The integration keeps failing.", **kw):
    return DecisionRequest(input=(Message("user", (Text(text),)),), questions=tuple(questions),
                           temperature=temperature, **kw)


QUESTIONS = [
    Question("yes_no", "urgent", (Text("The customer needs an answer today."),), source=("questions", 0)),
    Question("choice", "team", (Text("Which team?"),),
             options=(Option("billing", "Payments"), Option("technical"), Option(True), Option("sales")),
             source=("questions", 1)),
    Question("score", "anger", (Text("How angry?"),),
             levels=(Level("Calm"), Level("Annoyed"), Level("Very angry")), source=("questions", 2)),
]


def hand_answer(engine: LocalEngine, prompt_ids, label_ids, temperature):
    """Softmax over the labels' raw logits / T, and the labels' share of the full-vocabulary softmax."""
    with torch.no_grad():
        logits = engine.loaded.model(torch.tensor([prompt_ids])).logits[0, -1].double()
    z = [float(logits[i]) for i in label_ids]
    weights = [math.exp(v / temperature) for v in z]
    probs = [w / sum(weights) for w in weights]
    normaliser = float(torch.logsumexp(logits, 0))
    mass = sum(math.exp(v - normaliser) for v in z)
    return probs, mass


@pytest.mark.parametrize("temperature", [None, 0.5, 2.0])
def test_probabilities_equal_hand_computation(tiny_engine, temperature):
    result = tiny_engine.decide(request(*QUESTIONS, temperature=temperature, return_prompt_token_ids=True))
    assert [a.name for a in result.answers] == ["urgent", "team", "anger"]
    for answer in result.answers:
        probs, mass = hand_answer(tiny_engine, answer.prompt_token_ids, answer.label_token_ids, temperature or 1.0)
        assert answer.probabilities == pytest.approx(probs, rel=1e-5, abs=1e-6)  # fp32 logits
        assert answer.label_mass == pytest.approx(mass, rel=1e-5)
        assert math.fsum(answer.probabilities) == pytest.approx(1.0, abs=1e-9)
    # The random model is not uniform over the labels (the comparison above is not vacuous).
    assert max(result.answers[1].probabilities) - min(result.answers[1].probabilities) > 0.01
    assert result.usage.input_tokens == sum(len(a.prompt_token_ids) for a in result.answers)


def test_label_mass_does_not_depend_on_temperature(tiny_engine):
    cold = tiny_engine.decide(request(QUESTIONS[1], temperature=0.25)).answers[0]
    hot = tiny_engine.decide(request(QUESTIONS[1], temperature=4.0)).answers[0]
    assert cold.label_mass == pytest.approx(hot.label_mass, rel=1e-12)
    assert max(cold.probabilities) > max(hot.probabilities)


def test_label_token_ids_are_the_labels(tiny_engine, tokenizer):
    answer = tiny_engine.decide(request(QUESTIONS[1], return_prompt_token_ids=True)).answers[0]
    assert answer.label_token_ids == [tokenizer.convert_tokens_to_ids(x) for x in "ABCD"]


def test_images_are_refused_by_a_text_only_model(tiny_engine):
    req = DecisionRequest(
        input=(Message("user", (Text("look"), Image(url="data:image/png;base64,AAAA", source=("input", 0, "content", 1)))),),
        questions=(QUESTIONS[0],),
    )
    with pytest.raises(DecisionError, match="reads text only") as e:
        tiny_engine.decide(req)
    assert e.value.path == ("input", 0, "content", 1) and e.value.status == 400


def test_prompt_format_version_pin(tiny_engine):
    assert tiny_engine.decide(request(QUESTIONS[0], prompt_format_version=1)).prompt_format_version == 1
    with pytest.raises(DecisionError, match="prompt_format_version 2 is not served"):
        tiny_engine.decide(request(QUESTIONS[0], prompt_format_version=2))


def test_too_many_levels_names_the_first_level_over(tiny_engine):
    q = Question("score", "s", (Text("?"),), levels=tuple(Level(f"l{i}", source=("questions", 0, "levels", i))
                                                          for i in range(11)), source=("questions", 0))
    with pytest.raises(DecisionError, match="at most 10 levels") as e:
        tiny_engine.decide(request(q))
    assert e.value.code == "limit_exceeded" and e.value.path == ("questions", 0, "levels", 10)


def test_context_length_refusal(tokenizer):
    engine = LocalEngine(tiny_loaded(tokenizer, context_length=128))
    with pytest.raises(DecisionError, match="does not fit the context length of 128") as e:
        engine.decide(request(QUESTIONS[0], text="word " * 200))
    assert e.value.path == ("questions", 0)
