"""OpenAI wire format ↔ canonical form: pure translation, no model."""

from __future__ import annotations

import pytest

from decisiond.canonical import Answer, DecisionResult, Image, Json, Message, ToolCall, ToolOutput, Usage
from decisiond.dialects import openai as d
from decisiond.errors import DecisionError

SPEC_REQUEST = {
    "model": "gpt-6-luna", "prompt_cache_key": "tenant-42",
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}, "safety_identifier": "user-hash-1",
    "input": [
        {"type": "message", "role": "system", "content": "You moderate a marketplace."},
        {"role": "developer", "content": [{"type": "input_text", "text": "Policy v3",
                                           "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Listing:"},
                                     {"type": "input_image", "image_url": "https://example.com/p.jpg", "detail": "low"},
                                     {"type": "input_json", "data": {"price": 3, "currency": "USD", "tags": ["watch"]}}]},
        {"role": "assistant", "phase": "commentary", "content": [{"type": "output_text", "text": "Checking seller."}]},
        {"type": "function_call", "call_id": "call_1", "name": "seller_lookup", "arguments": "{\"id\":7}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "seller age: 2 days"},
    ],
    "questions": [{"type": "choice", "name": "verdict",
                   "instructions": [{"type": "input_text", "text": "Pick the verdict."},
                                    {"type": "input_json", "data": [{"rule": "R1"}]}],
                   "choices": [{"value": "allow"}, {"value": "review"}, {"value": "block"}]}],
}


def test_spec_example_parses_to_canonical():
    r = d.parse_request(SPEC_REQUEST)
    assert [type(i) for i in r.input] == [Message, Message, Message, Message, ToolCall, ToolOutput]
    user = r.input[2]
    assert isinstance(user.parts[1], Image) and user.parts[1].source == ("input", 2, "content", 1)
    assert isinstance(user.parts[2], Json) and user.parts[2].data["price"] == 3
    assert r.input[1].parts[0].cache_breakpoint
    q = r.questions[0]
    assert q.kind == "choice" and [o.value for o in q.options] == ["allow", "review", "block"]
    assert isinstance(q.instructions[1], Json)
    assert r.prompt_cache_key == "tenant-42" and r.safety_identifier == "user-hash-1"


def test_spec_example_round_trips_to_the_same_wire_body():
    assert d.render_request(d.parse_request(SPEC_REQUEST)) == SPEC_REQUEST
    simple = {"model": "m", "input": "hello", "questions": [
        {"type": "predicate", "name": "p", "instructions": "Is it?"},
        {"type": "score", "instructions": "How?", "levels": [{"label": "lo"}, {"label": "hi", "description": "very"}]},
        {"type": "choice", "instructions": "Which?", "choices": [{"value": True}, {"value": "true"}]}]}
    assert d.render_request(d.parse_request(simple)) == simple


def test_typed_choice_values_render_back_with_their_type():
    r = d.parse_request({"model": "m", "input": "x", "questions": [
        {"type": "choice", "instructions": "?", "choices": [{"value": True}, {"value": "true"}, {"value": False}]}]})
    result = DecisionResult("m", [Answer("choice", None, probabilities=[0.2, 0.5, 0.3], label_mass=0.9)])
    body = d.render_response(result, r)
    answer = body["answers"][0]
    assert answer["choice"] == "true" and isinstance(answer["choice"], str)
    assert [e["value"] for e in answer["probabilities"]] == [True, "true", False]
    assert answer["name"] is None and "name" in answer
    assert answer["confidence"] == pytest.approx((3 * 0.5 - 1) / 2)


def test_usage_is_integers_and_complete():
    r = d.parse_request({"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]})
    body = d.render_response(DecisionResult("m", [Answer("yes_no", None, probabilities=[0.7, 0.3])], Usage(42)), r)
    assert body["usage"] == {"input_tokens": 42, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42}
    assert body["answers"] == [{"type": "predicate", "name": None, "probability": 0.7}]


def test_messages_without_type_are_told_apart_by_role():
    r = d.parse_request({"model": "m", "input": [{"role": "user", "content": "task"},
                                                 {"role": "user", "content": [{"type": "input_text", "text": "obs"}]}],
                         "questions": [{"type": "predicate", "instructions": "?"}]})
    assert [p.text for m in r.input for p in m.parts] == ["task", "obs"]


def test_null_optional_fields_are_accepted():
    r = d.parse_request({"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "?", "name": None}],
                         "prompt_cache_key": None, "prompt_cache_options": None, "safety_identifier": None})
    assert r.questions[0].name is None


def bad(body_update=None, question=None, **top):
    body = {"model": "m", "input": "x", "questions": [question or {"type": "predicate", "instructions": "?"}]}
    body.update(top)
    if body_update:
        body_update(body)
    with pytest.raises(DecisionError) as e:
        d.parse_request(body)
    return e.value


def over_limits(**top):
    """Parsed fine, then refused by OpenAI's limits, which the gateway checks for every dialect."""
    from decisiond.gateway.sizes import check_openai

    request = d.parse_request({"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}],
                               **top})
    with pytest.raises(DecisionError) as e:
        check_openai(request)
    return e.value


@pytest.mark.parametrize(
    "error_of, param, code",
    [
        (lambda: bad(questions=[]), "questions", "array_below_min_length"),
        (lambda: bad(questions=[{"type": "predicate", "instructions": "?"}] * 401), "questions", "array_above_max_length"),
        (lambda: bad(question={"type": "box", "instructions": "?"}), "questions[0].type", "invalid_value"),
        (lambda: bad(question={"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}),
         "questions[0].choices", "array_below_min_length"),
        (lambda: bad(question={"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": 3}]}),
         "questions[0].choices[1].value", "invalid_type"),
        (lambda: bad(question={"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}),
         "questions[0].choices[1].value", "invalid_value"),
        (lambda: bad(question={"type": "choice", "instructions": "?",
                               "choices": [{"value": "a", "weight": 2}, {"value": "b"}]}),
         "questions[0].choices[0].weight", "unknown_parameter"),
        (lambda: bad(question={"type": "score", "levels": [{"label": "a"}]}), "questions[0].instructions",
         "missing_required_parameter"),
        (lambda: bad(question={"type": "predicate", "instructions": "  "}), "questions[0].instructions", "empty_string"),
        (lambda: bad(questions=[{"type": "predicate", "instructions": "?", "name": "a"},
                                {"type": "predicate", "instructions": "?", "name": "a"}]), "questions[1].name",
         "duplicate_value"),
        (lambda: bad(input=""), "input", "empty_string"),
        (lambda: bad(input=[{"role": "tool", "content": "x"}]), "input[0]", "invalid_value"),
        (lambda: bad(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text",
         "missing_required_parameter"),
        (lambda: bad(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]), "input[0].call_id",
         "invalid_value"),
        (lambda: bad(prompt_cache_options={"ttl": "1h"}), "prompt_cache_options.ttl", "invalid_value"),
        (lambda: bad(safety_identifier="x" * 129), "safety_identifier", "string_above_max_length"),
        (lambda: bad(temperature=0), "temperature", "invalid_value"),
        (lambda: bad(lambda b: b.pop("model")), "model", "missing_required_parameter"),
    ],
)
def test_invalid_requests_name_the_field(error_of, param, code):
    error = error_of()
    assert error.status == 400
    assert d.error_body(error)["error"]["param"] == param
    assert error.code == code
    # The message the client reads names the field too, not only the param.
    message = d.error_body(error)["error"]["message"]
    assert param in message or param.split(".")[-1].split("[")[0] in message, message


def test_input_json_limits():
    deep: object = 1
    for _ in range(33):
        deep = [deep]
    e = over_limits(input=[{"role": "user", "content": [{"type": "input_json", "data": {"d": deep}}]}])
    assert d.error_body(e)["error"]["param"] == "input[0].content[0]" and e.code == "limit_exceeded"
    e = over_limits(input=[{"role": "user", "content": [{"type": "input_json", "data": {"k": list(range(10_001))}}]}])
    assert "10000 values" in e.message
    e = over_limits(input=[{"role": "user", "content": [{"type": "input_json", "data": {"k": "x" * (256 * 1024)}}]}])
    assert "byte limit" in e.message


def test_error_body_shape():
    e = bad(question={"type": "box", "instructions": "?"})
    body = d.error_body(e)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "questions[0].type" in body["error"]["message"]


def test_a_request_forwarded_upstream_keeps_its_wire_shape():
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                         {"type": "input_json", "data": {"order": 7}}]},
            {"role": "assistant", "phase": "final_answer",
             "content": [{"type": "output_text", "text": "One moment"}, {"type": "refusal", "refusal": "No."}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "found"},
            {"role": "user", "content": "Thanks"},
        ],
        "questions": [{"type": "predicate", "name": "p", "instructions": "?"}],
    }
    request = d.parse_request(body)
    assert d.render_request(request) == body
    assert d.render_request(d.parse_request({**body, "input": "plain"}))["input"] == "plain"


def test_requests_from_other_dialects_render_their_natural_openai_shape():
    from decisiond.dialects import sglang, systemone

    text = sglang.parse_request({"input": "A ticket.", "questions": [{"id": "q", "type": "yes_no", "question": "?"}]})
    assert d.render_request(text, "gpt")["input"] == "A ticket."
    data = systemone.parse_request({"state": {"id": 3}, "model": "m", "questions": {
        "q": {"type": "noul", "instructions": "?"}}})
    assert d.render_request(data, "gpt")["input"] == [
        {"role": "user", "content": [{"type": "input_json", "data": {"id": 3}}]}]
