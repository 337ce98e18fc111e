"""``/v1/score`` replays and the engine's label log-probs checked against an independent reference: one plain forward
pass per prompt of the transformers model itself (``model(input_ids).logits[0, -1]``, log-softmax in float64) — no
packing, no shared-prefix KV cache, no prefix LRU, none of the engine's scoring code."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text
from decisiond.gateway.router import Router
from decisiond.probability import label_probabilities
from decisiond.server.app import create_app

TICKET = ("I have been trying to connect my Stripe account for three days and the integration keeps failing with a "
          "timeout. We are losing sales every hour and nobody has answered my two previous emails. Account 5531.")

QUESTIONS = [
    {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
     "options": [{"name": "billing", "description": "Payments and invoices"}, {"name": "technical"},
                 {"name": "sales", "description": "Plans, pricing and the longer questions a sales team answers"}]},
    {"id": "anger", "type": "score", "question": "How frustrated is the customer?",
     "levels": ["Calm", "Frustrated but civil", "Very angry"]},
    {"id": "urgent", "type": "yes_no", "question": "The customer needs an answer today."},
]


def reference_logprobs(model, prompt_ids: list[int], label_ids: list[int]) -> list[float]:
    """The model's own next-token log-probs after ``prompt_ids``: one unpacked pass, nothing else."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long)).logits[0, -1]
    log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return [float(log_probs[i]) for i in label_ids]


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=60) as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def app(tiny_engine):
    return create_app(Router.local_only(tiny_engine))


def test_engine_label_logprobs_equal_one_plain_pass_per_prompt(tiny_engine, tiny):
    questions = (
        Question("choice", "team", (Text("Which team should handle this ticket?"),),
                 options=(Option("billing", "Payments"), Option("technical"), Option("sales"), Option("account"))),
        Question("score", "anger", (Text("How frustrated is the customer?"),),
                 levels=(Level("Calm"), Level("Annoyed"), Level("Very angry"))),
        Question("yes_no", "urgent", (Text("The customer needs an answer today."),)),
    )
    request = DecisionRequest((Message("user", (Text(TICKET),)),), questions, return_prompt_token_ids=True)
    for attempt in range(2):  # the second time the shared prefix comes from the cross-request prefix cache
        result = tiny_engine.decide(request)
        for answer in result.answers:
            expected = reference_logprobs(tiny.model, answer.prompt_token_ids, answer.label_token_ids)
            assert answer.label_logprobs == pytest.approx(expected, abs=1e-4), (attempt, answer.name)
            assert answer.probabilities == pytest.approx(label_probabilities(expected), abs=1e-4)
        assert result.usage.cached_tokens > 0  # the prompts did share a prefix: packing was really exercised


def test_score_replay_of_a_decision_equals_one_plain_pass_per_prompt(app, tiny):
    decision = post(app, "/v1/decisions", {"input": TICKET, "questions": QUESTIONS, "temperature": 0.7,
                                           "return_prompt_token_ids": True})
    assert decision.status_code == 200, decision.text
    answers = decision.json()["answers"]
    prompts = [answers[q["id"]]["prompt_token_ids"] for q in QUESTIONS]
    labels = [answers[q["id"]]["label_token_ids"] for q in QUESTIONS]
    expected = [reference_logprobs(tiny.model, p, lab) for p, lab in zip(prompts, labels)]
    # The decision's own probabilities against the reference.
    for q, lps in zip(QUESTIONS, expected):
        assert list(answers[q["id"]]["probabilities"].values()) == pytest.approx(
            label_probabilities(lps, 0.7), abs=1e-4), q["id"]

    # Replay all three prompts in one /v1/score request: the shared beginning as the query, the tails as items, so
    # the scorer packs them together.
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    assert shared > 20
    raw = post(app, "/v1/score", {"query": prompts[0][:shared], "items": [p[shared:] for p in prompts],
                                  "label_token_ids": labels, "return_token_logprobs": True})
    assert raw.status_code == 200, raw.text
    for got, lps in zip(raw.json()["token_logprobs"], expected):
        assert got == pytest.approx(lps, abs=1e-4)
    assert raw.json()["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)

    softmaxed = post(app, "/v1/score", {"items": prompts, "label_token_ids": labels, "apply_softmax": True,
                                        "temperature": 0.7})
    assert softmaxed.status_code == 200, softmaxed.text
    for scores, lps in zip(softmaxed.json()["scores"], expected):
        assert scores == pytest.approx(label_probabilities(lps, 0.7), abs=1e-4)
        assert math.isclose(sum(scores), 1.0, abs_tol=1e-9)


def test_the_reference_tells_prompts_apart(tiny):
    # Guard against a vacuous comparison: the tiny model's label log-probs do depend on the prompt, by far more than
    # the tolerance, so a replay that scored the wrong prompt (or a truncated one) could not pass the tests above.
    a = reference_logprobs(tiny.model, [1, 520, 3390, 28, 9690], [330, 331, 332])
    b = reference_logprobs(tiny.model, [1, 520, 3390, 29, 9690], [330, 331, 332])
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-2
