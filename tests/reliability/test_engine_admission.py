"""No request can starve the others: the local engine's admission control, interleaving, joining and cancellation,
and the chat templates a request may (not) bring. Ordering is checked with events, never with timings."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from concurrent.futures import CancelledError

import httpx
import openai
import pytest
import uvicorn
from conftest import blocked
from servers import free_port
from typesafe_sdk import Noul, RetryPolicy, TypeSafeClient

from decisiond.canonical import DecisionRequest, Message, Option, Question, Text
from decisiond.engine import scheduler as scheduler_module
from decisiond.engine.backends.transformers import TransformersBackend
from decisiond.engine.local import LocalEngine
from decisiond.engine.scheduler import Scheduler, work_tokens
from decisiond.errors import DecisionError
from decisiond.gateway.router import Router
from decisiond.server.app import create_app

LABELS = [[5, 6]]
DOCUMENT = list(range(100, 500))  # a 400-token "document"


def document_prompts(n: int, doc: list[int] = DOCUMENT) -> list[list[int]]:
    return [doc + [1000 + i, 2000 + i, 7] for i in range(n)]


class Stepper:
    """A stepped backend wrapper that counts passes, and can hold the worker after a given pass until released."""

    def __init__(self, inner: TransformersBackend, hold_at: int | None = None, hold_again: int | None = None):
        self.inner, self.name, self.vocab_size = inner, inner.name, inner.vocab_size
        self.passes = 0
        self.hold_at, self.hold_again = hold_at, hold_again
        self.held, self.release = threading.Event(), threading.Event()
        self.held_again, self.release_again = threading.Event(), threading.Event()
        self.sizes: list[int] = []  # tokens of each pass

    @property
    def step_budget(self) -> int:
        return self.inner.step_budget

    @step_budget.setter
    def step_budget(self, value: int) -> None:
        self.inner.step_budget = value

    def score(self, groups):
        return self.inner.score(groups)

    def steps(self, groups):
        steps = self.inner.steps(groups)
        while True:
            try:
                tokens = next(steps)
            except StopIteration as done:
                return done.value
            self.passes += 1
            self.sizes.append(tokens)
            if self.passes == self.hold_at:
                self.held.set()
                assert self.release.wait(60)
            if self.passes == self.hold_again:
                self.held_again.set()
                assert self.release_again.wait(60)
            yield tokens

    def describe(self):
        return "stepper"


def backend(tiny, max_batch_tokens: int = 64) -> TransformersBackend:
    return TransformersBackend(tiny.model, "tiny", max_batch_tokens, prefix_cache_bytes=0)


# ------------------------------------------------------------------------------------------ admission


def test_a_request_over_its_compute_budget_is_refused_naming_the_limit(tiny):
    scheduler = Scheduler(backend(tiny), max_request_tokens=500, max_queued_tokens=1000)
    prompts = document_prompts(40)  # 400 shared + 40 × 3 = 520 tokens after prefix sharing
    with pytest.raises(DecisionError) as e:
        scheduler.submit(prompts, LABELS * 40)
    assert e.value.status == 400 and e.value.code == "request_too_large"
    assert "--max-request-tokens" in e.value.message and "520" in e.value.message
    # Prefix sharing is what is counted: 30 prompts (490 tokens) pass, though their prompts hold 12,090 tokens.
    assert len(scheduler.submit(document_prompts(30), LABELS * 30).future.result(60).logprobs) == 30


def test_a_full_queue_is_a_503_with_retry_after_and_frees_up_as_work_finishes(tiny):
    scheduler = Scheduler(backend(tiny), max_request_tokens=450, max_queued_tokens=600)
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(10), LABELS * 10)  # 430 tokens queued
    large = (document_prompts(10, list(range(600, 1000))), LABELS * 10)
    with pytest.raises(DecisionError) as e:
        scheduler.submit(*large)
    assert e.value.status == 503 and e.value.code == "server_overloaded"
    assert "--max-queued-tokens" in e.value.message
    assert int(e.value.headers["retry-after-ms"]) >= 100 and int(e.value.headers["Retry-After"]) >= 1
    # The refused request holds a reservation: a small one that would fit the room left is refused meanwhile,
    # so a stream of small requests cannot starve the large one.
    with pytest.raises(DecisionError, match="busy"):
        scheduler.submit([[1, 2, 3]], LABELS)
    release.set()
    first.future.result(60)
    assert wait_for(lambda: scheduler.queued_tokens == 0)
    retried = scheduler.submit(*large)  # the retry (identical prompts) claims its reservation
    small = scheduler.submit([[1, 2, 3]], LABELS)
    retried.future.result(60), small.future.result(60)
    assert scheduler.queued_tokens == 0 and scheduler.stats.refused == 2


def test_a_reservation_nobody_claims_expires(tiny, monkeypatch):
    monkeypatch.setattr(scheduler_module, "RESERVATION_GRACE_S", 0.0)
    scheduler = Scheduler(backend(tiny), max_request_tokens=450, max_queued_tokens=600)
    scheduler.rate = 1e9  # retry-after at its floor, 100 ms
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(10), LABELS * 10)
    with pytest.raises(DecisionError) as e:
        scheduler.submit(document_prompts(10, list(range(600, 1000))), LABELS * 10)
    assert e.value.headers["retry-after-ms"] == "100"
    time.sleep(0.2)  # the refused client never came back
    small = scheduler.submit([[1, 2, 3]], LABELS)
    release.set()
    first.future.result(60), small.future.result(60)


def test_the_limits_must_be_consistent(tiny):
    with pytest.raises(ValueError, match="max_queued_tokens"):
        Scheduler(backend(tiny), max_request_tokens=1000, max_queued_tokens=999)


# ------------------------------------------------------------------------------------------ fairness


def test_a_small_request_is_answered_between_the_passes_of_a_large_one(tiny, monkeypatch):
    monkeypatch.setattr(scheduler_module, "CONTENDED_GRACE_S", 0.0)  # the moment after a small answer: below
    inner = backend(tiny)
    stepper = Stepper(inner, hold_at=2)
    scheduler = Scheduler(stepper, max_batch_tokens=64, max_wait_s=0)
    prompts = document_prompts(12)
    large = scheduler.submit(prompts, LABELS * 12)
    assert stepper.held.wait(60)  # the large request has run two of its passes
    large_done_when_small_answered: list[bool] = []
    small = scheduler.submit([[1, 2, 3]], LABELS)
    small.future.add_done_callback(lambda f: large_done_when_small_answered.append(large.future.done()))
    stepper.release.set()
    small.future.result(60)
    result = large.future.result(60)
    assert large_done_when_small_answered == [False]
    # The document took four passes before its last (tails) one; the small request went in between.
    assert stepper.passes == 4 and sum(stepper.sizes) == len(DOCUMENT), stepper.sizes
    # Interleaving changes nothing in the answers: each prompt as one plain forward pass.
    for prompt, got in zip(prompts, result.logprobs):
        assert got == pytest.approx(inner.reference(prompt, LABELS[0]), abs=1e-4)


def test_large_requests_go_in_short_passes_and_small_ones_in_full_passes(tiny, monkeypatch):
    monkeypatch.setattr(scheduler_module, "MIN_STEP_TOKENS", 8)
    inner = backend(tiny)
    stepper = Stepper(inner)
    scheduler = Scheduler(stepper, max_batch_tokens=64, max_wait_s=0)
    scheduler.submit([list(range(100, 160))], LABELS).future.result(60)  # 60 tokens: one small run
    assert stepper.sizes == []  # one pass, its last: answered at once, with no pass before it
    stepper.sizes.clear()
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(4, list(range(600, 1000))), LABELS * 4)
    second = scheduler.submit(document_prompts(4, list(range(1000, 1400))), LABELS * 4)
    release.set()
    a, b = first.future.result(60), second.future.result(60)
    # Long documents, one open at a time: the first goes in passes of an eighth of the budget while the second
    # waits (what a request arriving meanwhile waits for is one short pass), the second alone in passes of half.
    # Each document's last pass (its tails) returns the answers and is not a step.
    assert stepper.sizes[:50] == [8] * 50, str(stepper.sizes)
    assert sum(stepper.sizes[50:]) == 400 and max(stepper.sizes[50:]) <= 32, str(stepper.sizes)
    for prompts, result in ((first.job.group.prompts, a), (second.job.group.prompts, b)):
        for prompt, got in zip(prompts, result.logprobs):
            assert got == pytest.approx(inner.reference(prompt, LABELS[0]), abs=1e-4)


def test_small_requests_behind_a_waiting_large_one_go_as_one_run(tiny):
    """While one large run is open and another large request heads the queue, the small requests queued behind it
    are batched as usual: eight 30-token requests are one run (one pass over the weights), not eight."""
    runs: list[int] = []

    class Runs(Stepper):
        def steps(self, groups):
            runs.append(len(groups))
            return (yield from super().steps(groups))

    scheduler = Scheduler(Runs(backend(tiny, 256)), max_batch_tokens=256, max_wait_s=0)
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(2, list(range(600, 1000))), LABELS * 2)
    second = scheduler.submit(document_prompts(2, list(range(1000, 1400))), LABELS * 2)
    small = [scheduler.submit([list(range(3000 + 40 * i, 3030 + 40 * i))], LABELS) for i in range(8)]
    assert [ticket.job.size for ticket in small] == [30] * 8
    release.set()
    for ticket in [first, second, *small]:
        ticket.future.result(60)
    assert sorted(runs) == [1, 1, 8], runs


def test_a_large_request_right_after_a_small_one_goes_in_short_passes(tiny, monkeypatch):
    """A client that sends its next small request when the last is answered finds the document in a short pass:
    for a moment after a small run is answered, a large run's passes stay short, though it runs alone. Otherwise (a
    large run answered before it included) a large run alone goes in passes of half the budget."""
    monkeypatch.setattr(scheduler_module, "MIN_STEP_TOKENS", 8)
    monkeypatch.setattr(scheduler_module, "CONTENDED_GRACE_S", 3600.0)  # "a moment", long enough for the test
    stepper = Stepper(backend(tiny))
    scheduler = Scheduler(stepper, max_batch_tokens=64, max_wait_s=0)
    scheduler.submit(document_prompts(2, list(range(600, 700))), LABELS * 2).future.result(60)
    assert max(stepper.sizes) == 32, stepper.sizes  # no small request answered yet: half the budget
    stepper.sizes.clear()
    scheduler.submit(document_prompts(2, list(range(650, 750))), LABELS * 2).future.result(60)
    assert max(stepper.sizes) == 32, stepper.sizes  # a large request answered just before: still half
    scheduler.submit([[1, 2, 3]], LABELS).future.result(60)  # a small request, answered
    stepper.sizes.clear()
    scheduler.submit(document_prompts(2, list(range(700, 800))), LABELS * 2).future.result(60)
    assert len(stepper.sizes) > 4 and max(stepper.sizes) == 8, stepper.sizes  # an eighth
    monkeypatch.setattr(scheduler_module, "CONTENDED_GRACE_S", 0.0)  # the moment has passed
    stepper.sizes.clear()
    scheduler.submit(document_prompts(2, list(range(800, 900))), LABELS * 2).future.result(60)
    assert max(stepper.sizes) == 32, stepper.sizes


# ------------------------------------------------------------------------------------------ joining


def test_identical_requests_in_flight_join_one_computation(tiny):
    scheduler = Scheduler(backend(tiny))
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(3), LABELS * 3)
    retry = scheduler.submit(document_prompts(3), LABELS * 3)  # an SDK's retry of the same request
    other = scheduler.submit(document_prompts(3)[:2], LABELS * 2)
    assert first.job is retry.job and other.job is not first.job
    assert scheduler.queued_tokens == first.job.size + other.job.size  # joined work is not counted twice
    release.set()
    assert first.future.result(60).logprobs == retry.future.result(60).logprobs
    other.future.result(60)
    assert scheduler.stats.joined == 1 and scheduler.stats.jobs == 2


def test_a_joined_request_reports_its_tokens_as_cached(tiny):
    engine = LocalEngine(tiny)
    release = blocked(engine.scheduler)
    results: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.decide(long_request(4))))
               for i in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: engine.scheduler.stats.joined == 1)
    release.set()
    for t in threads:
        t.join(60)
    usages = sorted((r.usage.cached_tokens, r.usage.input_tokens) for r in results)
    assert usages[0][0] < usages[0][1]  # the first computed its prompts' tails
    assert usages[1][0] == usages[1][1]  # the second computed nothing
    assert results[0].answers == results[1].answers


def test_one_caller_of_a_joined_job_leaving_does_not_stop_it(tiny):
    scheduler = Scheduler(backend(tiny))
    release = blocked(scheduler)
    first = scheduler.submit(document_prompts(3), LABELS * 3)
    retry = scheduler.submit(document_prompts(3), LABELS * 3)
    assert first.future.cancel()
    release.set()
    assert len(retry.future.result(60).logprobs) == 3
    assert scheduler.stats.cancelled == 0


# ------------------------------------------------------------------------------------------ cancellation


def test_a_run_whose_callers_left_stops_between_passes(tiny):
    stepper = Stepper(backend(tiny), hold_at=2)
    scheduler = Scheduler(stepper, max_batch_tokens=64, max_wait_s=0, abandon_grace_s=0)
    large = scheduler.submit(document_prompts(12), LABELS * 12)
    assert stepper.held.wait(60)
    assert large.future.cancel()
    stepper.release.set()
    with pytest.raises(CancelledError):
        large.future.result(60)
    deadline = time.monotonic() + 60
    while scheduler.stats.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats.cancelled == 1 and scheduler.queued_tokens == 0
    assert stepper.passes == 2  # stopped right after the pass it was in
    assert len(scheduler.submit([[1, 2, 3]], LABELS).future.result(60).logprobs) == 1  # the worker lives on


def test_a_retry_after_its_client_gave_up_joins_the_work_already_done(tiny):
    stepper = Stepper(backend(tiny), hold_at=2, hold_again=4)
    scheduler = Scheduler(stepper, max_batch_tokens=64, max_wait_s=0, abandon_grace_s=60)
    first = scheduler.submit(document_prompts(12), LABELS * 12)
    assert stepper.held.wait(60)
    assert first.future.cancel()  # the SDK's read timed out: its connection is gone
    stepper.release.set()
    # Nobody waits, yet the work goes on through the grace period (with no grace it would stop here) …
    assert stepper.held_again.wait(30)
    retry = scheduler.submit(document_prompts(12), LABELS * 12)  # … and the same bytes, sent again, join it
    assert retry.job is first.job
    stepper.release_again.set()
    assert len(retry.future.result(60).logprobs) == 12
    assert scheduler.stats.joined == 1 and scheduler.stats.cancelled == 0 and scheduler.stats.jobs == 1
    alone = Stepper(backend(tiny))
    Scheduler(alone, max_batch_tokens=64).submit(document_prompts(12), LABELS * 12).future.result(60)
    assert stepper.passes == alone.passes  # nothing was computed twice


TEAM = Question("choice", "team", (Text("Which team?"),), options=(Option("billing"), Option("technical")))


def long_request(questions: int = 12) -> DecisionRequest:
    text = " ".join(f"Line {i}: the invoice was charged twice and the export fails." for i in range(25))
    qs = tuple(Question("predicate", f"q{i}", (Text(f"Is point {i} about billing?"),)) for i in range(questions))
    return DecisionRequest((Message("user", (Text(text),)),), qs)


class InProcessServer:
    """decisiond's app on a real loopback port, in this process, so a test can hold its model's worker."""

    def __init__(self, engine: LocalEngine):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(Router.local_only(engine)), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


SGLANG_BODY = {
    "input": " ".join(f"Line {i}: the invoice was charged twice and the export fails." for i in range(25)),
    "questions": [{"id": f"q{i}", "type": "yes_no", "question": f"Is point {i} about billing?"} for i in range(12)],
}


def held_engine(tiny) -> tuple[LocalEngine, Stepper]:
    engine = LocalEngine(tiny, max_batch_tokens=64, max_wait_s=0, prefix_cache_mb=0)
    stepper = Stepper(engine.backend, hold_at=2)  # type: ignore[arg-type]
    engine.backend = engine.scheduler.backend = stepper  # type: ignore[assignment]
    engine.scheduler.abandon_grace_s = 0  # stop as soon as the caller has gone (the grace is tested on its own)
    return engine, stepper


def wait_for(predicate, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_client_that_disconnects_stops_its_work(tiny):
    engine, stepper = held_engine(tiny)
    with InProcessServer(engine) as server:
        body = json.dumps(SGLANG_BODY).encode()
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(b"POST /v1/decisions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert stepper.held.wait(60)  # the model is in the middle of the request …
        client.close()  # … when its client leaves
        assert wait_for(lambda: engine.scheduler._running and all(j.left_at is not None for r in engine.scheduler._running
                                                                  for j in r.jobs))
        stepper.release.set()
        assert wait_for(lambda: engine.scheduler.stats.cancelled == 1)
        assert stepper.passes == 2 and engine.scheduler.queued_tokens == 0
        # The server goes on answering.
        r = httpx.post(server.url + "/v1/decisions", json={"input": "hi", "questions": [
            {"id": "u", "type": "yes_no", "question": "Urgent?"}]}, timeout=60)
        assert r.status_code == 200


def test_a_client_deadline_is_a_504_in_the_callers_dialect_and_stops_the_work(tiny):
    engine, stepper = held_engine(tiny)
    with InProcessServer(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        errors: list[openai.APIStatusError] = []

        def ask() -> None:
            try:
                client.decisions.create(
                    model="tiny-random", input=SGLANG_BODY["input"],
                    questions=[{"type": "predicate", "name": f"q{i}", "instructions": f"Point {i} billing?"}
                               for i in range(12)],
                    extra_headers={"x-decisiond-timeout-ms": "3000"})
            except openai.APIStatusError as error:
                errors.append(error)

        caller = threading.Thread(target=ask)
        caller.start()
        assert stepper.held.wait(60)  # computing when its deadline passes
        caller.join(60)
        assert errors and errors[0].status_code == 504 and errors[0].body["code"] == "deadline_exceeded"
        assert wait_for(lambda: engine.scheduler._running and all(j.left_at is not None for r in engine.scheduler._running
                                                                  for j in r.jobs))
        stepper.release.set()
        assert wait_for(lambda: engine.scheduler.stats.cancelled == 1)
        assert stepper.passes == 2
        bad = httpx.post(server.url + "/v1/decisions", json=SGLANG_BODY, timeout=30,
                         headers={"x-decisiond-timeout-ms": "soon"})
        assert bad.status_code == 400 and "x-decisiond-timeout-ms" in bad.json()["message"]


def test_a_request_abandoned_while_being_prepared_is_never_computed(tiny):
    engine = LocalEngine(tiny, max_wait_s=0)
    engine.scheduler.abandon_grace_s = 0

    async def main():
        task = asyncio.create_task(engine.decide_async(long_request()))
        await asyncio.sleep(0)  # preparing in a thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    release = blocked(engine.scheduler)
    asyncio.run(main())
    assert wait_for(lambda: engine.scheduler.waiting == 0 and engine.scheduler.stats.cancelled == 1)
    release.set()
    assert engine.scheduler.stats.jobs == 0


# ------------------------------------------------------------------------------------------ templates

HOSTILE_LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                "{{ messages[0]['content'] }}")
HOSTILE_MEMORY = "{% set s = 'a' * 2000000000 %}{{ s|length }}{{ messages[0]['content'] }}"
HOSTILE_OUTPUT = "{{ 'a' * 5000000 }}{{ messages[0]['content'] }}"
OWN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\nPlease be brief.\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(template: str | None = None, **extra) -> DecisionRequest:
    kwargs = {"chat_template": template, **extra} if template is not None else extra
    return DecisionRequest((Message("user", (Text("The export fails."),)),), (TEAM,), chat_template_kwargs=kwargs)


def test_a_request_template_is_refused_unless_the_server_allows_it(tiny_engine):
    with pytest.raises(DecisionError) as e:
        tiny_engine.decide(with_template(OWN_TEMPLATE))
    assert e.value.status == 400 and e.value.path == ("chat_template_kwargs", "chat_template")
    assert "--allow-request-templates" in e.value.message
    for name in ("tokenize", "messages", "add_generation_prompt"):
        with pytest.raises(DecisionError) as e:
            tiny_engine.decide(with_template(**{name: True}))
        assert e.value.path == ("chat_template_kwargs", name)


@pytest.mark.parametrize("template, why", [
    (HOSTILE_LOOP, "longer than"),
    (HOSTILE_MEMORY, "MiB"),
    (HOSTILE_OUTPUT, "more than"),
    ("{{ raise_exception('nope') }}", "nope"),
    ("x" * 40_000, "at most"),
])
def test_an_allowed_request_template_renders_under_limits(tiny, template, why):
    engine = LocalEngine(tiny, allow_templates=True)
    start = time.monotonic()
    with pytest.raises(DecisionError, match=why) as e:
        engine.decide(with_template(template))
    assert e.value.status == 400
    assert time.monotonic() - start < 30  # the loop alone would run for hours: it was stopped
    result = engine.decide(with_template(OWN_TEMPLATE))  # the engine is unharmed, and a fair template works
    assert math.fsum(result.answers[0].probabilities) == pytest.approx(1.0)


def test_an_allowed_request_template_is_the_one_rendered(tiny):
    engine = LocalEngine(tiny, allow_templates=True)
    own = engine.decide(with_template(OWN_TEMPLATE))
    default = engine.decide(with_template())
    assert own.answers[0].prompt_tokens != default.answers[0].prompt_tokens
    prepared = engine.prepare(with_template(OWN_TEMPLATE))
    assert "Please be brief." in prepared.questions[0].prompt.text


# ------------------------------------------------------------------------------------------ back-pressure


def job_size(engine: LocalEngine, document: dict) -> int:
    from decisiond.dialects import sglang

    return work_tokens([q.prompt.ids for q in engine.prepare(sglang.DIALECT.parse(document, {})).questions])


@pytest.mark.parametrize("sdk", ["typesafe", "openai"])
def test_both_sdks_honour_back_pressure_and_get_their_answer(tiny, sdk):
    probe = LocalEngine(tiny)
    size = job_size(probe, SGLANG_BODY)
    engine = LocalEngine(tiny, max_batch_tokens=64, max_wait_s=0, prefix_cache_mb=0,
                         max_request_tokens=size + 20, max_queued_tokens=size + 20)
    stepper = Stepper(engine.backend, hold_at=2)  # type: ignore[arg-type]
    engine.backend = engine.scheduler.backend = stepper  # type: ignore[assignment]
    with InProcessServer(engine) as server:
        big: list[httpx.Response] = []
        first = threading.Thread(target=lambda: big.append(
            httpx.post(server.url + "/v1/decisions", json=SGLANG_BODY, timeout=60)))
        first.start()
        assert stepper.held.wait(60)  # the queue is full while the model holds the first request
        answers: list[float] = []

        def ask() -> None:
            if sdk == "typesafe":
                with TypeSafeClient(base_url=server.url, api_key="unused", retry=RetryPolicy(max_retries=5)) as ts:
                    answers.append(ts.system_one("The export fails.", {"urgent": Noul(instructions="Urgent?")})
                                   .nouls["urgent"].noul)
            else:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=5)
                answers.append(client.decisions.create(model="tiny-random", input="The export fails.", questions=[
                    {"type": "predicate", "name": "urgent", "instructions": "Urgent?"}]).answers[0].probability)

        second = threading.Thread(target=ask)
        second.start()
        assert wait_for(lambda: engine.scheduler.stats.refused >= 1)  # a 503 with retry-after-ms went back
        stepper.release.set()
        first.join(60), second.join(60)
        assert big[0].status_code == 200
        assert len(answers) == 1 and 0 <= answers[0] <= 1
