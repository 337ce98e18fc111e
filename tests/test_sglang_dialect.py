"""SGLang's dialect ↔ canonical (pure) and the rule that tells it from OpenAI's on /v1/decisions."""

from __future__ import annotations

import pytest

from decisiond.canonical import Answer, DecisionResult, Json, Text, Usage
from decisiond.dialects import sglang
from decisiond.dialects.detect import decisions_dialect
from decisiond.errors import DecisionError


@pytest.mark.parametrize(
    "body, dialect",
    [
        ({"input": "x", "questions": [{"id": "a", "type": "yes_no", "question": "?"}]}, "sglang"),
        ({"input": "x", "questions": [{"type": "choice", "question": "?", "options": []}]}, "sglang"),
        ({"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]}, "openai"),
        ({"model": "m", "input": "x", "questions": [{"type": "score", "instructions": "?", "levels": []}]}, "openai"),
        ({"input": "x", "questions": [{"type": "score", "levels": ["a", "b"]}]}, "openai"),  # no marker: OpenAI
        ({"input": "x"}, "openai"),
        ("not an object", "openai"),
    ],
)
def test_detection_rule(body, dialect):
    assert decisions_dialect(body) == dialect


def test_mixed_markers_are_refused_naming_both():
    with pytest.raises(DecisionError) as e:
        decisions_dialect({"prompt_cache_key": "k", "input": "x", "questions": [{"id": "a", "type": "yes_no"}]})
    assert "prompt_cache_key" in e.value.message and "questions[0].id" in e.value.message


def test_parse_and_render():
    r = sglang.parse_request({
        "input": {"ticket": "x"},
        "questions": [{"id": "t", "type": "choice", "question": {"ask": "which"},
                       "options": [{"name": "a", "description": "first"}, {"name": "b"}]},
                      {"id": "u", "type": "yes_no", "question": "urgent?", "no": "can wait"}],
        "temperature": 2, "return_prompt_token_ids": True})
    assert isinstance(r.input[0].parts[0], Json) and isinstance(r.questions[0].instructions[0], Json)
    assert r.temperature == 2.0 and r.model == "default" and r.questions[1].no == "can wait"
    assert isinstance(r.questions[1].instructions[0], Text)
    result = DecisionResult("served", [
        Answer("choice", "t", probabilities=[0.4, 0.6], label_mass=0.5, prompt_token_ids=[1, 2], label_token_ids=[3, 4]),
        Answer("yes_no", "u", probabilities=[0.3, 0.7], label_mass=0.1, prompt_token_ids=[1], label_token_ids=[5, 6]),
    ], Usage(input_tokens=9), prompt_format_version=1)
    assert sglang.render_response(result, r) == {
        "object": "decisions", "model": "default", "prompt_format_version": 1,
        "answers": {
            "t": {"type": "choice", "probabilities": {"a": 0.4, "b": 0.6}, "label_mass": 0.5, "choice": "b",
                  "prompt_token_ids": [1, 2], "label_token_ids": [3, 4]},
            "u": {"type": "yes_no", "probabilities": {"yes": 0.3, "no": 0.7}, "label_mass": 0.1,
                  "prompt_token_ids": [1], "label_token_ids": [5, 6]},
        },
        "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9},
    }


def test_error_names_question_id_or_position():
    body = {"input": "x", "questions": [{"id": "team", "type": "choice", "question": "?", "options": [{"name": "a"}]}]}
    with pytest.raises(DecisionError) as e:
        sglang.parse_request(body)
    rendered = sglang.error_body(e.value, body["questions"])
    assert rendered["message"].startswith("question 'team' (questions[0]).options: List should have at least 2 items")
    assert rendered["param"] == "questions[0].options" and rendered["code"] == 400
