"""Long shared prefixes: computed once (chunked prefill into a KV cache, then the question tails against it),
reused across requests from the prefix cache, with the probabilities of one plain pass per prompt."""

from __future__ import annotations

import pytest
from conftest import tiny_loaded

from decisiond.canonical import DecisionRequest, Message, Option, Question, ScoreRequest, Text
from decisiond.engine.kv import ROOM_FROM, ROOM_TOKENS
from decisiond.engine.local import LocalEngine
from decisiond.engine.packing import common_prefix, pack
from decisiond.probability import label_probabilities

BUDGET = 512


@pytest.fixture()
def long_engine(tokenizer):
    """A fresh engine (empty prefix cache) on the tiny model with room for 4K-token prompts."""
    return LocalEngine(tiny_loaded(tokenizer, context_length=4096), max_batch_tokens=BUDGET)


def document(words: int, seed: int = 0) -> str:
    return " ".join(f"Line {i + seed}: the customer wrote about order {(i * 7919 + seed) % 1000}." for i in range(words))


def questions(n: int, offset: int = 0):
    return tuple(Question("choice", f"q{i}", (Text(f"Which team should take part {i + offset}?"),),
                          options=(Option("billing"), Option("technical"), Option("sales"))) for i in range(n))


def request(text: str, qs) -> DecisionRequest:
    return DecisionRequest((Message("user", (Text(text),)),), qs)


def reference(engine: LocalEngine, req: DecisionRequest) -> list[list[float]]:
    return [label_probabilities(engine.backend.reference(q.prompt.ids, q.prompt.label_ids))
            for q in engine.prepare(req).questions]


def assert_close(result, expected, tol=1e-4):
    for answer, probs in zip(result.answers, expected):
        assert answer.probabilities == pytest.approx(probs, abs=tol)


def test_a_long_shared_prefix_is_computed_once(long_engine):
    req = request(document(190), questions(10))
    prompts = [q.prompt.ids for q in long_engine.prepare(req).questions]
    assert 2900 < min(len(p) for p in prompts) < 3300
    shared = common_prefix(prompts)
    tails = len(pack(prompts, skip=shared))
    stats = long_engine.backend.stats
    result = long_engine.decide(req)
    # The model ran the shared prefix once, in chunks within the budget, and each question's own tokens once.
    assert stats.computed_tokens == shared + tails
    assert stats.prefill_tokens == shared and stats.largest_pass <= BUDGET
    assert tails <= 10 * 40 and shared > 2900
    assert result.usage.input_tokens - result.usage.cached_tokens == shared + tails
    assert_close(result, reference(long_engine, req))


def test_a_repeated_document_reuses_its_prefix_with_the_same_probabilities(long_engine):
    text = document(120)
    first = long_engine.decide(request(text, questions(3)))
    stats = long_engine.backend.stats
    before = stats.computed_tokens
    again = long_engine.decide(request(text, questions(3)))  # a retried request: the same to float rounding
    assert_close(again, [a.probabilities for a in first.answers], tol=1e-7)
    prompts = [q.prompt.ids for q in long_engine.prepare(request(text, questions(3))).questions]
    shared = common_prefix(prompts)
    assert stats.computed_tokens - before == len(pack(prompts, skip=shared))  # the tails only
    assert again.usage.input_tokens - again.usage.cached_tokens == stats.computed_tokens - before
    # Another question about the same document: the longest cached prefix (the document) is reused.
    before, reused = stats.computed_tokens, stats.reused_tokens
    other = request(text, (Question("yes_no", "urgent", (Text("The customer needs an answer today."),)),))
    result = long_engine.decide(other)
    [prompt] = [q.prompt.ids for q in long_engine.prepare(other).questions]
    assert stats.reused_tokens - reused > 1800 and stats.computed_tokens - before < 40
    assert stats.computed_tokens - before + stats.reused_tokens - reused == len(prompt)
    assert_close(result, reference(long_engine, other))


def test_a_retried_short_request_agrees_to_float_rounding_and_computes_only_its_tails(long_engine):
    """The retry computes its tails against the cached ticket, in passes of another shape than the first ask's (its
    attention in other blocks of queries): the same answers up to float rounding, not bit for bit."""
    req = request("I was charged twice for my subscription this month.", questions(3))
    first = long_engine.decide(req)
    assert len(long_engine.backend.prefixes) == 1
    before = long_engine.backend.stats.computed_tokens
    again = long_engine.decide(req)
    prompts = [q.prompt.ids for q in long_engine.prepare(req).questions]
    assert long_engine.backend.stats.computed_tokens - before == len(pack(prompts, skip=common_prefix(prompts)))
    assert_close(again, [a.probabilities for a in first.answers], tol=1e-7)
    assert_close(again, reference(long_engine, req))


def test_score_prompt_longer_than_the_budget(long_engine, tokenizer):
    ids = tokenizer.encode(document(120))
    assert len(ids) > 2 * BUDGET
    result = long_engine.score(ScoreRequest(prompts=[ids, ids[:700]], label_token_ids=[[5, 6, 7]] * 2))
    for prompt, logprobs in zip([ids, ids[:700]], result.token_logprobs):
        assert logprobs == pytest.approx(long_engine.backend.reference(prompt, [5, 6, 7]), abs=1e-4)
    assert long_engine.backend.stats.largest_pass <= BUDGET


def test_concurrent_requests_with_different_cached_prefixes_share_a_pass(tokenizer):
    import threading

    long_engine = LocalEngine(tiny_loaded(tokenizer, context_length=4096), max_batch_tokens=2048)
    docs = [document(30, seed) for seed in (1, 2, 3)]
    for text in docs[:2]:
        long_engine.decide(request(text, questions(1)))  # cached prefixes of different lengths
    reqs = [request(text, questions(2, offset=5)) for text in docs]
    expected = [reference(long_engine, r) for r in reqs]
    long_engine.scheduler.max_wait_s = 0.3
    passes = long_engine.backend.stats.passes
    results: list = [None] * len(reqs)
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, long_engine.decide(reqs[i])))
                   for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        long_engine.scheduler.max_wait_s = 0.002
    # The two documents asked before are cached past this request's shared prefix; the third fits one row with its
    # tails: all three, after pasts of different lengths, in one pass.
    assert long_engine.backend.stats.passes - passes == 1
    for result, probs in zip(results, expected):
        assert_close(result, probs)


def test_answers_after_cached_prefixes_of_every_kind_equal_one_pass_per_prompt(long_engine):
    """Short tickets (one pass after the cached header), long documents (prefilled in chunks), a document asked again
    with other questions (its cached KV extended): all equal a plain pass per prompt to float rounding."""
    for text in ["I was charged twice this month.", document(60, 1), "The export is broken.", document(60, 1),
                 document(60, 2)]:
        for qs in (questions(1), questions(3, 4), questions(2, 9)):
            req = request(text, qs)
            assert_close(long_engine.decide(req), reference(long_engine, req), 1e-5)


def test_a_document_asked_again_shares_its_cached_kv(long_engine):
    backend = long_engine.backend
    text = document(120)
    long_engine.decide(request(text, questions(1)))
    per_token = backend.geometry.bytes_per_token
    [prompt] = [q.prompt.ids for q in long_engine.prepare(request(text, questions(1))).questions]
    assert len(prompt) - 1 >= ROOM_FROM  # a document's block has room for a pass read in place
    assert backend.prefixes.bytes == per_token * (len(prompt) - 1 + ROOM_TOKENS)
    for offset in (3, 7, 11):  # other questions: each a small block after the document's
        req = request(text, questions(1, offset))
        assert_close(long_engine.decide(req), reference(long_engine, req), 1e-5)  # its tails in the room
    assert len(backend.prefixes) >= 3
    assert backend.prefixes.bytes < per_token * (len(prompt) + ROOM_TOKENS + 3 * 40)  # one copy of the document
    # A new document copies the few header tokens it shares with a cached one instead of holding that one's block.
    new = request(document(120, 5), questions(1))
    long_engine.decide(new)
    [prompt] = [q.prompt.ids for q in long_engine.prepare(new).questions]
    length, chain = backend.prefixes.longest(prompt)
    assert length == len(prompt) - 1 and len(chain.pieces) == 1  # its own block, the header copied into it
