"""The real server on loopback with the real SmolLM2 model, driven by the official openai SDK (strict validation)."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
TICKET = "I've been trying to connect my Stripe account for 3 days and the integration keeps failing. I'm losing sales."
THREE = [
    {"type": "predicate", "name": "urgent", "instructions": "The customer needs an answer today."},
    {"type": "choice", "name": "team", "instructions": "Which team should handle this ticket?",
     "choices": [{"value": "billing", "description": "Payment or subscription issues"},
                 {"value": "technical", "description": "Bugs or integration problems"},
                 {"value": "sales"}]},
    {"type": "score", "name": "frustration", "instructions": "How frustrated is the customer?",
     "levels": [{"label": "Calm"}, {"label": "Frustrated but civil"}, {"label": "Very angry"}]},
]


def check_answer_math(answer):
    if answer.type == "predicate":
        assert 0.0 <= answer.probability <= 1.0
        return
    probs = [p.probability for p in answer.probabilities]
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-9)
    n = len(probs)
    if answer.type == "choice":
        assert answer.choice == answer.probabilities[probs.index(max(probs))].value
        assert answer.confidence == pytest.approx(min(1, max(0, (n * max(probs) - 1) / (n - 1))))
    else:
        assert answer.score == pytest.approx(sum(i * p for i, p in enumerate(probs)))
        assert [p.value for p in answer.probabilities] == list(range(n))


def test_three_question_types(openai_client):
    decision = openai_client.decisions.create(model=MODEL, input=TICKET, questions=THREE)
    assert decision.model == MODEL
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in decision.answers] == ["urgent", "team", "frustration"]
    for answer in decision.answers:
        check_answer_math(answer)
        assert 0 < answer.label_mass <= 1  # decisiond extension, kept by the SDK as an extra field
    usage = decision.usage
    assert usage.input_tokens > 3 * 40 and usage.output_tokens == 0 and usage.total_tokens == usage.input_tokens
    # The shared header and input are computed once for the three questions: the repeats count as cached.
    assert 0 < usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert decision._request_id.startswith("req_")


def test_same_request_same_answer_and_default_alias(openai_client):
    a = openai_client.decisions.create(model=MODEL, input=TICKET, questions=THREE[1:2])
    b = openai_client.decisions.create(model="default", input=TICKET, questions=THREE[1:2])
    assert [p.probability for p in a.answers[0].probabilities] == pytest.approx(
        [p.probability for p in b.answers[0].probabilities], abs=1e-12)


def test_message_input_with_json_parts_and_tool_items(openai_client):
    decision = openai_client.decisions.create(
        model=MODEL,
        input=[
            {"type": "message", "role": "system", "content": "You moderate a marketplace."},
            {"role": "user", "content": [{"type": "input_text", "text": "Listing:"},
                                         {"type": "input_json", "data": {"price": 3, "currency": "USD"}}]},
            {"role": "assistant", "phase": "commentary", "content": [{"type": "output_text", "text": "Checking seller."}]},
            {"type": "function_call", "call_id": "call_1", "name": "seller_lookup", "arguments": "{\"id\":7}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "seller age: 2 days"},
        ],
        questions=[{"type": "choice", "name": "verdict",
                    "instructions": [{"type": "input_text", "text": "Pick the verdict."},
                                     {"type": "input_json", "data": [{"rule": "R1"}]}],
                    "choices": [{"value": "allow"}, {"value": "review"}, {"value": "block"}]}],
        prompt_cache_key="tenant-42",
        safety_identifier="user-1",
    )
    answer = decision.answers[0]
    assert answer.name == "verdict" and answer.choice in ("allow", "review", "block")
    check_answer_math(answer)


def test_user_messages_without_type_like_the_tool_runner(openai_client):
    decision = openai_client.decisions.create(
        model=MODEL,
        input=[{"role": "user", "content": "Book a flight to Paris."},
               {"role": "user", "content": [{"type": "input_text", "text": "Search results: 3 flights."}]}],
        questions=[{"type": "choice", "name": "next_action", "instructions": "What next?",
                    "choices": [{"value": "pick_flight", "description": "choose one"}, {"value": "search_again"}]}],
    )
    assert len(decision.answers) == 1 and decision.answers[0].name == "next_action"
    assert isinstance(decision.answers[0].choice, str)


def test_boolean_choices_keep_their_type(openai_client):
    decision = openai_client.decisions.create(
        model=MODEL, input="The sky is green.",
        questions=[{"type": "choice", "instructions": "Is the statement right?",
                    "choices": [{"value": True}, {"value": False}, {"value": "unsure", "description": "cannot tell"}]}],
    )
    answer = decision.answers[0]
    assert answer.name is None
    assert [p.value for p in answer.probabilities] == [True, False, "unsure"]
    assert answer.choice in (True, False, "unsure")
    # A boolean and a string with the same text are distinct values, but one prompt line: refused, not merged.
    with pytest.raises(openai.BadRequestError, match="render as the same option line") as e:
        openai_client.decisions.create(model=MODEL, input="x", questions=[
            {"type": "choice", "instructions": "?", "choices": [{"value": True}, {"value": "true"}]}])
    assert e.value.param == "questions[0].choices[1]"


def test_temperature_extension_sharpens(openai_client):
    kw = dict(model=MODEL, input=TICKET, questions=THREE[1:2])
    base = openai_client.decisions.create(**kw).answers[0]
    cold = openai_client.decisions.create(**kw, extra_body={"temperature": 0.25}).answers[0]
    assert max(p.probability for p in cold.probabilities) > max(p.probability for p in base.probabilities)
    # Temperature never changes the label mass; the two answers may come from different batches or a reused
    # prefix KV cache, which agree to fp32 rounding (as packed and one-pass scoring do, to 1e-4).
    assert cold.label_mass == pytest.approx(base.label_mass, rel=1e-4)


def test_predicate_probability_is_yes_share(openai_client):
    decision = openai_client.decisions.create(
        model=MODEL, input="Ticket text.", questions=[{"type": "predicate", "instructions": "It is about billing."}],
        extra_body={"return_prompt_token_ids": True},
    )
    assert 0 < decision.answers[0].probability < 1


INVALID = [
    # (create kwargs, status, param, code)
    (dict(questions=[]), 400, "questions", "array_below_min_length"),
    (dict(questions=[{"type": "box", "instructions": "?"}]), 400, "questions[0].type", "invalid_value"),
    (dict(questions=[THREE[0], {"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}]), 400,
     "questions[1].choices", "array_below_min_length"),
    (dict(questions=[{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": 3}]}]), 400,
     "questions[0].choices[1].value", "invalid_type"),
    (dict(questions=[{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}]), 400,
     "questions[0].choices[1].value", "invalid_value"),
    (dict(questions=[{"type": "choice", "instructions": "?", "choices": [{"value": "a", "weight": 1}, {"value": "b"}]}]),
     400, "questions[0].choices[0].weight", "unknown_parameter"),
    (dict(questions=[{"type": "predicate"}]), 400, "questions[0].instructions", "missing_required_parameter"),
    (dict(questions=[{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "b\nc"}]}]), 400,
     "questions[0].choices[1]", "invalid_value"),
    (dict(questions=[{"type": "score", "instructions": "?", "levels": [{"label": str(i)} for i in range(11)]}]), 400,
     "questions[0].levels[10]", "limit_exceeded"),
    (dict(questions=[{"type": "predicate", "name": "a", "instructions": "?"},
                     {"type": "predicate", "name": "a", "instructions": "?"}]), 400, "questions[1].name",
     "duplicate_value"),
    (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "look"},
                                              {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]),
     400, "input[0].content[1]", "unsupported_input"),
    (dict(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]), 400, "input[0].call_id",
     "invalid_value"),
    (dict(input=""), 400, "input", "empty_string"),
    (dict(model="gpt-6-luna"), 400, "model", "model_not_found"),
    (dict(prompt_cache_options={"mode": "explicit", "ttl": "1h"}), 400, "prompt_cache_options.ttl", "invalid_value"),
    (dict(extra_body={"temperature": 0}), 400, "temperature", "invalid_value"),
    (dict(extra_body={"prompt_format_version": 2}), 400, "prompt_format_version", "unsupported_value"),
    (dict(extra_body={"chat_template_kwargs": {"enable_thinking": True}}), 400, "chat_template_kwargs.enable_thinking",
     "unsupported_value"),
    (dict(input="word " * 9000), 400, "questions[0]", "context_length_exceeded"),
    (dict(extra_body={"top_p": 0.5}), 400, "top_p", "unknown_parameter"),
]


@pytest.mark.parametrize("kwargs, status, param, code", INVALID, ids=[p for _, _, p, _ in INVALID])
def test_invalid_requests(openai_client, kwargs, status, param, code):
    call = dict(model=MODEL, input="A ticket.", questions=[THREE[0]])
    call.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.decisions.create(**call)
    err = e.value
    assert err.status_code == status
    assert err.param == param, err.message
    assert err.code == code, err.message
    assert err.type == "invalid_request_error"
    assert err.request_id and err.request_id.startswith("req_")
    assert len(err.message) > 20


def test_not_json_and_too_large(server):
    r = httpx.post(server.url + "/v1/decisions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps({"model": MODEL, "input": "x" * (5 * 1024 * 1024), "questions": [THREE[0]]})
    r = httpx.post(server.url + "/v1/decisions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["x-request-id"].startswith("req_")


def test_models_and_health(openai_client, server):
    ids = [m.id for m in openai_client.models.list()]
    assert ids == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["models"] == [MODEL]


def test_structured_access_log(server, openai_client):
    openai_client.decisions.create(model=MODEL, input="x", questions=[THREE[0]])
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    access = [e for e in lines if e.get("logger") == "decisiond.access" and e.get("path") == "/v1/decisions"]
    assert access, server.log()[-2000:]
    last = access[-1]
    assert last["status"] == 200 and last["request_id"].startswith("req_") and last["questions"] == 1
    assert last["input_tokens"] > 0 and last["duration_ms"] > 0
