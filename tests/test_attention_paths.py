"""The eager-attention and bfloat16 paths of the transformers backend against an independent reference: one plain
forward pass per prompt (``model(input_ids).logits[0, -1]``, log-softmax in float64), no packing and no cache.

The default tiny model runs sdpa in float32 (covered by ``test_engine_tiny``/``test_engine_prefix``). Eager attention
takes the other mask branch (an additive float mask instead of a boolean one); bfloat16 changes every rounding."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import tiny_loaded

from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text
from decisiond.engine.backends.base import Group
from decisiond.engine.backends.transformers import TransformersBackend
from decisiond.engine.local import LocalEngine
from decisiond.probability import label_probabilities

TICKET = ("The export button freezes the whole dashboard; we tried three browsers and two laptops, and our accountant "
          "needs the quarterly invoices by Friday. Account 44812, Business plan. This is getting really frustrating.")
QUESTIONS = (
    Question("choice", "team", (Text("Which team should handle this ticket?"),),
             options=(Option("billing", "Payments, refunds and invoices"), Option("technical", "Bugs"),
                      Option("sales"), Option("account", "Access and passwords"))),
    Question("score", "anger", (Text("How frustrated is the customer?"),),
             levels=(Level("Calm"), Level("Annoyed", "but polite"), Level("Very angry"))),
    Question("yes_no", "urgent", (Text("The customer needs an answer today."),)),
    Question("choice", "topic", (Text("Topic?"),), options=tuple(Option(f"topic {i}") for i in range(12))),
)

# bfloat16 keeps 8 significant bits. The packed pass adds up attention in another order than the plain pass (tree mask,
# padding, keys and values from a prefill or the prefix cache), so the bf16 logits may round differently; on this model
# that moves a label log-prob by at most 0.031 (measured: half a bf16 step at the logits' magnitude of 4-8), while
# bf16 itself is 0.2 away from float32. 0.1 is three times the measured difference and still catches a broken
# mask or position (those move log-probs by 0.3 and more here).
BF16_LOGPROB_TOLERANCE = 0.1


def reference_logprobs(model, prompt: list[int], labels: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[0, -1]
    log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return [float(log_probs[i]) for i in labels]


def groups(seed: int = 0) -> list[Group]:
    """Two requests in one call: different shared prefixes (so batched rows carry pasts of different lengths) and
    ragged tails."""
    rng = random.Random(seed)
    out = []
    for shared_len in (120, 37):
        shared = [rng.randrange(3, 40000) for _ in range(shared_len)]
        prompts = [shared + [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
        out.append(Group(prompts, [[rng.randrange(3, 40000) for _ in range(4)] for _ in prompts]))
    return out


def worst(got: list[list[float]], expected: list[list[float]]) -> float:
    return max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e))


@pytest.fixture(scope="module")
def eager(tokenizer):
    return tiny_loaded(tokenizer, attn_implementation="eager")


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def bf16(tokenizer, request):
    return tiny_loaded(tokenizer, attn_implementation=request.param, dtype="bfloat16")


@pytest.mark.parametrize("max_batch_tokens", [4096, 48])  # 48: chunked prefill and a pass per row or two
def test_eager_attention_packed_equals_one_pass_per_prompt(eager, max_batch_tokens):
    assert eager.model.config._attn_implementation == "eager"
    backend = TransformersBackend(eager.model, "eager", max_batch_tokens=max_batch_tokens)
    assert backend.packing and not backend.bool_mask  # the eager branch: packed rows under an additive float mask
    batch = groups()
    expected = [[reference_logprobs(eager.model, p, lab) for p, lab in zip(g.prompts, g.labels)] for g in batch]
    for attempt in range(2):  # the second time both shared prefixes come from the prefix cache
        scored = backend.score(batch)
        for got, want in zip(scored, expected):
            assert worst(got.logprobs, want) <= 1e-4, attempt
        assert (attempt == 0) == all(s.reused_tokens == 0 for s in scored)


def test_eager_attention_through_the_engine(eager):
    engine = LocalEngine(eager, max_batch_tokens=64)
    request = DecisionRequest((Message("user", (Text(TICKET),)),), QUESTIONS, return_prompt_token_ids=True)
    for attempt in range(2):
        result = engine.decide(request)
        for answer in result.answers:
            want = reference_logprobs(eager.model, answer.prompt_token_ids, answer.label_token_ids)
            assert answer.label_logprobs == pytest.approx(want, abs=1e-4), (attempt, answer.name)
        assert result.usage.cached_tokens > 0


def test_bfloat16_packed_is_close_to_one_pass_per_prompt_and_finite(bf16):
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    backend = TransformersBackend(bf16.model, "bf16", max_batch_tokens=64)
    assert backend.packing
    batch = groups()
    expected = [[reference_logprobs(bf16.model, p, lab) for p, lab in zip(g.prompts, g.labels)] for g in batch]
    for attempt in range(2):
        scored = backend.score(batch)
        for got, want in zip(scored, expected):
            assert all(math.isfinite(v) for row in got.logprobs for v in row)
            assert worst(got.logprobs, want) <= BF16_LOGPROB_TOLERANCE, attempt
            for g_row, w_row in zip(got.logprobs, want):  # and the label probabilities a caller sees
                assert label_probabilities(g_row) == pytest.approx(label_probabilities(w_row), abs=5e-3)


def test_bfloat16_through_the_engine_answers_finite(bf16):
    engine = LocalEngine(bf16)
    request = DecisionRequest((Message("user", (Text(TICKET),)),), QUESTIONS, return_prompt_token_ids=True,
                              temperature=0.5)
    result = engine.decide(request)
    for answer in result.answers:
        assert all(math.isfinite(p) and 0 <= p <= 1 for p in answer.probabilities)
        assert math.fsum(answer.probabilities) == pytest.approx(1.0, abs=1e-9)
        assert answer.label_mass is not None and 0 < answer.label_mass <= 1
        want = reference_logprobs(bf16.model, answer.prompt_token_ids, answer.label_token_ids)
        assert max(abs(a - b) for a, b in zip(answer.label_logprobs, want)) <= BF16_LOGPROB_TOLERANCE, answer.name
