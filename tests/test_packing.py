"""Shared-prefix packing and cross-request batching: same probabilities as one forward pass per question."""

from __future__ import annotations

import threading

import pytest

from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text
from decisiond.engine.packing import common_prefix, pack, split_rows
from decisiond.engine.scheduler import Scheduler
from decisiond.probability import label_probabilities


def visible(row, target):
    """The tokens a target position attends to, in order — what the model sees as that prompt."""
    mask = row.mask()
    return [row.tokens[j] for j in range(len(row)) if mask[target, j]]


def test_pack_stores_shared_tokens_once_and_each_prompt_sees_itself():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 7, 8], [1, 2], [6, 6], [1, 2, 3, 9]]
    row = pack(prompts)
    assert len(row) == len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})  # radix tree size
    for prompt, target in zip(prompts, row.targets):
        assert visible(row, target) == prompt
        assert row.positions[target] == len(prompt) - 1
    assert row.targets[1] == row.targets[5]  # identical prompts share everything, target included


def test_pack_with_skipped_prefix_and_split_rows():
    prompts = [[1, 2, 3, 4, 10 + i, 20 + i] for i in range(6)]
    row = pack(prompts, skip=2)
    assert row.tokens[:2] == [3, 4] and row.positions[:2] == [2, 3]
    for prompt, target in zip(prompts, row.targets):
        assert visible(row, target) == prompt[2:]
    assert common_prefix(prompts) == 4
    rows = split_rows(prompts, max_row_tokens=6, skip=2)
    assert [members for members, _ in rows] == [[0, 1], [2, 3], [4, 5]]
    assert all(len(r) <= 6 for _, r in rows)


def test_mask_blocks_other_branches():
    row = pack([[1, 2, 3], [1, 4, 5]])
    mask = row.mask()
    first_branch = row.tokens.index(3)
    second_branch = row.tokens.index(5)
    assert not mask[second_branch, first_branch] and not mask[first_branch, second_branch]
    assert bool(mask[second_branch, 0])


@pytest.fixture(scope="session")
def smol_engine(smollm_dir):
    from decisiond.engine.local import LocalEngine
    from decisiond.engine.model import load

    return LocalEngine(load(smollm_dir, served_name="smol"))


TICKETS = [
    "I was charged twice for my subscription this month. Please refund one of the charges.",
    "The export button freezes the whole dashboard; we tried three browsers and two laptops, and our accountant "
    "needs the quarterly invoices by Friday. Account 44812, Business plan. This is getting really frustrating.",
    "Can I upgrade to the team plan?",
]


def questions():
    return (
        Question("choice", "team", (Text("Which team should handle this ticket?"),), options=(
            Option("billing", "Payments, refunds and invoices"), Option("technical", "Bugs"), Option("sales"),
            Option("account", "Access, passwords and the things a longer description needs to mention"))),
        Question("score", "anger", (Text("How frustrated is the customer?"),),
                 levels=(Level("Calm"), Level("Annoyed", "but polite"), Level("Very angry"))),
        Question("yes_no", "urgent", (Text("The customer needs an answer today."),)),
        Question("yes_no", "refund", (), yes="The customer asks for money back", no="Anything else"),
        Question("choice", "topic", (Text("Topic?"),), options=tuple(Option(f"topic {i}") for i in range(30))),
    )


def reference_probabilities(engine, request):
    prepared = engine.prepare(request)
    return [label_probabilities(engine.scorer.reference(p.prompt.ids, p.prompt.label_ids), request.temperature or 1.0)
            for p in prepared.questions]


@pytest.mark.parametrize("temperature, tickets", [(None, TICKETS), (0.5, TICKETS[1:2])])
def test_packed_equals_one_pass_per_question_on_the_real_model(smol_engine, temperature, tickets):
    for ticket in tickets:
        request = DecisionRequest((Message("user", (Text(ticket),)),), questions(), temperature=temperature)
        result = smol_engine.decide(request)
        expected = reference_probabilities(smol_engine, request)
        for answer, probs in zip(result.answers, expected):
            assert answer.probabilities == pytest.approx(probs, abs=1e-4)
        # Ragged suffixes: the five prompts differ in length by dozens of tokens.
        lengths = [a.prompt_tokens for a in result.answers]
        assert max(lengths) - min(lengths) > 40
        assert 0 < result.usage.cached_tokens < result.usage.input_tokens


def test_concurrent_requests_are_batched_and_still_exact(smol_engine):
    scheduler: Scheduler = smol_engine.scheduler
    requests = [DecisionRequest((Message("user", (Text(t),)),), questions()[:3]) for t in TICKETS * 3]
    by_ticket = [reference_probabilities(smol_engine, r) for r in requests[:len(TICKETS)]]
    expected = by_ticket * 3
    before = (scheduler.stats.runs, scheduler.stats.jobs, scheduler.stats.joined)
    scheduler.max_wait_s = 0.2  # give the threads time to queue up together
    results: list = [None] * len(requests)
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, smol_engine.decide(requests[i])))
                   for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        scheduler.max_wait_s = 0.002
    runs, jobs = scheduler.stats.runs - before[0], scheduler.stats.jobs - before[1]
    joined = scheduler.stats.joined - before[2]
    # Each ticket three times: identical requests in flight together join one computation.
    assert jobs + joined == len(requests) and jobs >= len(TICKETS)
    assert runs < jobs  # several requests shared a run (its forward passes)
    for result, probs in zip(results, expected):
        for answer, p in zip(result.answers, probs):
            assert answer.probabilities == pytest.approx(p, abs=1e-4)


def test_header_prefix_cache_is_the_template_header(smol_engine, tokenizer):
    header = smol_engine.prompter.header_ids(smol_engine.prompter.template_kwargs({}))
    text = tokenizer.decode(list(header))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user")
    # Independent of the other tests: empty the cross-request prefix cache, decide once, and the cache must now hold a
    # prefix that starts with the whole template header (the request's shared prefix: header plus ticket).
    prefixes = smol_engine.backend.prefixes
    prefixes.clear()
    assert prefixes.longest(header) == (0, None)
    smol_engine.decide(DecisionRequest((Message("user", (Text(TICKETS[0]),)),), questions()[:2]))
    shared, entry = prefixes.longest(header)
    assert shared == len(header) and entry is not None


def test_scorer_errors_reach_the_caller_and_the_worker_survives(smol_engine):
    scheduler = smol_engine.scheduler
    worker = scheduler.call(threading.current_thread)  # the one thread that does the model math
    job = scheduler.submit([[1, 2, 3]], [[10 ** 7]])  # a label id outside the vocabulary
    with pytest.raises((IndexError, RuntimeError)):
        job.future.result(timeout=60)
    ok = scheduler.submit([[1, 2, 3]], [[5]])
    assert len(ok.future.result(timeout=60).logprobs[0]) == 1
    # The same worker thread served the failing job and the next one: the error did not kill it (a dead worker would
    # be replaced by a fresh thread on the next submit, which this tells apart).
    assert scheduler.call(threading.current_thread) is worker and worker.is_alive()
    assert worker is not threading.current_thread()
