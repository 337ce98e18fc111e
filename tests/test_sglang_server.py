"""SGLang's /v1/decisions dialect and /v1/score on real servers, posted with ``requests`` as SGLang users do.

The two Python examples of the SGLang seed run verbatim apart from the URL."""

from __future__ import annotations

import math

import pytest
import requests

TICKET = "I've been trying to connect my Stripe account for 3 days and the integration keeps failing. I'm losing sales."


def test_seed_example_request(server, capsys):
    URL = server.url
    # ---- verbatim from the seed ("Example request"), apart from URL ----
    response = requests.post(
        f"{URL}/v1/decisions",
        json={
            "input": "I've been trying to connect my Stripe account for 3 days and the integration keeps failing. I'm losing sales.",
            "questions": [
                {
                    "id": "team",
                    "type": "choice",
                    "question": "Which team should handle this ticket?",
                    "options": [
                        {"name": "billing", "description": "Payment or subscription issues"},
                        {"name": "technical", "description": "Bugs or integration problems"},
                        {"name": "sales", "description": "Pricing or account questions"},
                    ],
                },
                {
                    "id": "frustration",
                    "type": "score",
                    "question": "How frustrated is the customer?",
                    "levels": ["Calm", "Frustrated but civil", "Very angry"],
                },
                {
                    "id": "urgent",
                    "type": "yes_no",
                    "question": "The customer needs an answer today.",
                },
            ],
        },
        timeout=60,
    )
    response.raise_for_status()
    for question_id, answer in response.json()["answers"].items():
        print(question_id, answer)
    # ---- end of the seed's example ----
    printed = capsys.readouterr().out
    assert printed.startswith("team {") and "frustration {" in printed and "urgent {" in printed

    body = response.json()
    assert body["object"] == "decisions" and body["model"] == "default" and body["prompt_format_version"] == 1
    team, frustration, urgent = body["answers"]["team"], body["answers"]["frustration"], body["answers"]["urgent"]
    assert list(body["answers"]) == ["team", "frustration", "urgent"]
    assert team["type"] == "choice" and list(team["probabilities"]) == ["billing", "technical", "sales"]
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert frustration["type"] == "score" and list(frustration["probabilities"]) == ["0", "1", "2"]
    assert frustration["score"] == pytest.approx(sum(int(k) * v for k, v in frustration["probabilities"].items()))
    assert urgent["type"] == "yes_no" and list(urgent["probabilities"]) == ["yes", "no"]
    for answer in body["answers"].values():
        assert math.fsum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-9)
        assert 0 < answer["label_mass"] <= 1
        assert "prompt_token_ids" not in answer
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"]


def test_seed_replay_example_reproduces_probabilities(server, capsys):
    URL = server.url
    # ---- verbatim from the seed ("Pin and replay the prompt"), apart from URL ----
    body = {
        "input": "The integration keeps failing.",
        "questions": [{"id": "urgent", "type": "yes_no", "question": "The customer needs an answer today."}],
        "prompt_format_version": 1,
        "return_prompt_token_ids": True,
    }
    answer = requests.post(f"{URL}/v1/decisions", json=body, timeout=60).json()["answers"]["urgent"]
    replay = requests.post(
        f"{URL}/v1/score",
        json={
            "query": [],
            "items": [answer["prompt_token_ids"]],
            "label_token_ids": [answer["label_token_ids"]],
            "apply_softmax": True,
            "return_token_logprobs": True,
        },
        timeout=60,
    ).json()
    print(answer["probabilities"], replay["scores"][0])
    # ---- end of the seed's example ----
    assert capsys.readouterr().out.startswith("{'yes': ")
    assert replay["scores"][0] == pytest.approx([answer["probabilities"]["yes"], answer["probabilities"]["no"]],
                                                abs=1e-5)
    assert math.fsum(math.exp(lp) for lp in replay["token_logprobs"][0]) == pytest.approx(answer["label_mass"],
                                                                                        rel=1e-5)
    assert replay["object"] == "scoring" and replay["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])


def test_replay_with_temperature_for_every_question_type(server):
    body = {
        "input": {"ticket": TICKET, "plan": "pro"},
        "questions": [
            {"id": "team", "type": "choice", "question": "Which team?",
             "options": [{"name": "billing"}, {"name": "technical", "description": {"area": "bugs"}}, {"name": "sales"}]},
            {"id": "anger", "type": "score", "question": "How angry?", "levels": ["calm", "annoyed", ["very", "angry"]]},
            {"id": "refund", "type": "yes_no", "question": "They want a refund.", "yes": "asks for money back"},
        ],
        "temperature": 0.7,
        "return_prompt_token_ids": True,
        "model": "my-deployment",
    }
    decision = requests.post(f"{server.url}/v1/decisions", json=body, timeout=60).json()
    assert decision["model"] == "my-deployment"
    for qid, answer in decision["answers"].items():
        replay = requests.post(f"{server.url}/v1/score", json={
            "query": answer["prompt_token_ids"][:5], "items": [answer["prompt_token_ids"][5:]],
            "label_token_ids": answer["label_token_ids"], "apply_softmax": True, "temperature": 0.7}, timeout=60).json()
        assert replay["scores"][0] == pytest.approx(list(answer["probabilities"].values()), abs=1e-5), qid
        assert replay["token_logprobs"] is None


def test_score_text_items_and_raw_probabilities(server):
    labels = [10407, 4607]  # "yes", "no" in SmolLM2's vocabulary
    r = requests.post(f"{server.url}/v1/score", json={
        "query": "Is the sky blue? Answer:", "items": [" yes or no?", " Answer now:"],
        "label_token_ids": labels, "return_token_logprobs": True}, timeout=60).json()
    assert len(r["scores"]) == 2 and r["model"] == "default"
    for scores, lps in zip(r["scores"], r["token_logprobs"]):
        assert scores == pytest.approx([math.exp(lp) for lp in lps], rel=1e-12)  # no softmax: full-vocabulary p
        assert sum(scores) < 1
    first = requests.post(f"{server.url}/v1/score", json={
        "query": " yes or no?", "items": "Is the sky blue? Answer:", "item_first": True,
        "label_token_ids": labels}, timeout=60).json()
    assert first["scores"][0] == pytest.approx(r["scores"][0], rel=1e-4)  # packed with another item before: fp32 rounding


SCORE_ERRORS = [
    ({"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "query"),
    ({"items": [[1, 2]], "label_token_ids": [10 ** 6]}, "label_token_ids"),
    ({"items": [[1, 10 ** 6]], "label_token_ids": [1]}, "items[0]"),
    ({"items": [[1, 2]], "label_token_ids": [1], "temperature": 2.0}, "temperature"),
    ({"items": [], "label_token_ids": [1]}, "items"),
    ({"items": [[1], [2]], "label_token_ids": [[1], [2], [3]]}, "label_token_ids"),
    ({"items": [[1]], "label_token_ids": [1], "unknown": 1}, "unknown"),
]


@pytest.mark.parametrize("body, param", SCORE_ERRORS, ids=[p for _, p in SCORE_ERRORS])
def test_score_errors(server, body, param):
    r = requests.post(f"{server.url}/v1/score", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["object"] == "error" and error["code"] == 400 and error["param"] == param and error["message"]


def q(**kw):
    base = {"id": "team", "type": "choice", "question": "Which team?", "options": [{"name": "billing"}, {"name": "sales"}]}
    base.update(kw)
    return base


ERRORS = [
    # (body changes, text the message must hold)
    ({"questions": [q(type="ranking")]}, "question 'team' (questions[0]).type"),
    ({"questions": [q()], "stream": True}, "stream: Unknown field"),
    ({"questions": [q(weight=2)]}, "question 'team' (questions[0]).weight: Unknown field"),
    ({"questions": [q(options=[{"name": "billing", "color": "red"}, {"name": "sales"}])]}, "options[0].color"),
    ({"questions": [q(options=[{"name": "only"}])]}, "at least 2 items"),
    ({"questions": [q(options=[{"name": f"o{i}"} for i in range(27)])]}, "at most 26 items"),
    ({"questions": [{"id": "s", "type": "score", "question": "?", "levels": ["one"]}]}, "question 's' (questions[0]).levels"),
    ({"questions": [{"id": "s", "type": "score", "question": "?", "levels": [str(i) for i in range(11)]}]}, "at most 10 items"),
    ({"input": "   ", "questions": [q()]}, "input: must not be blank"),
    ({"questions": [q(question="")]}, "question: must not be blank"),
    ({"questions": [q(id=" ")]}, "questions[0].id: must not be blank"),
    ({"questions": [{"id": "s", "type": "score", "question": "?", "levels": ["low", ""]}]}, "levels[1]: must not be blank"),
    ({"questions": [q(), q()]}, "question id 'team' repeats another question"),
    ({"questions": [q(options=[{"name": "Billing"}, {"name": " billing "}])]}, "options[1]: option name ' billing ' repeats"),
    ({"questions": [q(options=[{"name": "a"}, {"name": ""}])]}, "option names must not be blank"),
    ({"questions": [q(options=[{"name": "a"}, {"name": "b\tc"}])]}, "control or line break"),
    ({"questions": [q()], "prompt_format_version": 2}, "prompt_format_version 2 is not served"),
    ({"questions": [q()], "model": "base:my-lora"}, "LoRA adapter 'my-lora'"),
    ({"questions": [q()], "temperature": 0}, "temperature"),
    ({"questions": [q()], "chat_template_kwargs": {"enable_thinking": True}}, "decisions need it false or unset"),
    ({"input": "word " * 9000, "questions": [q()]}, "question 'team' (questions[0]): the prompt has"),
    ({"questions": [q(), {"type": "predicate", "instructions": "?"}]}, "mixes OpenAI's Decisions shape"),
]


@pytest.mark.parametrize("changes, text", ERRORS, ids=[t[:40] for _, t in ERRORS])
def test_sglang_errors(server, changes, text):
    body = {"input": "A ticket."}
    body.update(changes)
    r = requests.post(f"{server.url}/v1/decisions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["object"] == "error" and error["code"] == 400 and error["type"] == "BadRequestError"
    assert text in error["message"], error["message"]


def test_mixed_request_error_also_reads_as_openai(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="mixes OpenAI's Decisions shape") as e:
        client.decisions.create(model="default", input="x",
                                questions=[{"type": "predicate", "instructions": "?", "id": "x"}])
    assert e.value.code == "mixed_dialects"


TEMPLATE_ERRORS = [
    ({"mode": "space"}, "the answer label 'A' is not one distinct token"),
    ({"mode": "open"}, "leaves a reasoning block open"),
    ({"mode": "hidden"}, "starts every answer with a reasoning block"),
    ({"mode": "raise"}, "the chat template failed: the template refuses"),
    ({"enable_thinking": True}, "'enable_thinking' to True"),
]


@pytest.mark.parametrize("kwargs, text", TEMPLATE_ERRORS, ids=[t[:30] for _, t in TEMPLATE_ERRORS])
def test_template_refusals_on_a_thinking_template(tiny_server, kwargs, text):
    body = {"input": "A ticket.", "questions": [q()], "chat_template_kwargs": kwargs}
    r = requests.post(f"{tiny_server.url}/v1/decisions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert text in r.json()["message"]


def test_thinking_template_answers_with_thinking_off(tiny_server, tokenizer):
    body = {"input": "A ticket.", "questions": [q()], "return_prompt_token_ids": True}
    answer = requests.post(f"{tiny_server.url}/v1/decisions", json=body, timeout=60).json()["answers"]["team"]
    text = tokenizer.decode(answer["prompt_token_ids"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    assert math.fsum(answer["probabilities"].values()) == pytest.approx(1.0)
    r = requests.post(f"{tiny_server.url}/v1/decisions", json={"input": "word " * 600, "questions": [q()]}, timeout=60)
    assert r.status_code == 400 and "does not fit the context length of 512" in r.json()["message"]
