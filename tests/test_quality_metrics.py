"""The decision quality metrics of ``GET /metrics`` (``server.decision_metrics``) on real servers: a gateway over
simulated upstreams whose answers the test chooses, and a plain server of the tiny model. Each check reads what the
responses said (probabilities, label mass, the escalated header) and finds exactly that in the scraped histograms and
counters (``prometheus_client.parser``)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import upstreams
from prometheus_client.parser import text_string_to_metric_families
from servers import run_decisiond, start_decisiond

CONFIG = """
metrics: {question_labels: 3}
providers:
  - {name: cheap, type: openai, base_url: "${CHEAP}/v1"}
  - {name: strong, type: openai, base_url: "${STRONG}/v1"}
  - {name: strict, type: openai, base_url: "${STRICT}/v1"}
models:
  - {name: small, provider: cheap, upstream: small, cache: true}
  - {name: probe, provider: cheap, upstream: small}
  - {name: shy, provider: cheap, upstream: shy}
  - {name: many, provider: cheap, upstream: many}
  - {name: big, provider: strong, upstream: big}
  - {name: picky, provider: strict, upstream: picky}
virtual_models:
  - {name: triage, strategy: cascade, escalate_below: 0.8, targets: [small, big]}
"""


def chosen_answer(question: dict) -> dict:
    """The cheap upstream's answer, read from the question's name: ``p70`` a predicate with probability 0.70, ``c50``
    a choice whose first option has 0.50, ``s60`` a score whose first level has 0.60; ``refuse…`` a refusal. The
    label mass is half the top probability plus 0.4, except for scores (none reported)."""
    name = question.get("name") or ""
    if name.startswith("refuse"):
        return {"type": "refusal", "name": name}
    top = int(name[1:]) / 100
    if question["type"] == "predicate":
        return {"type": "predicate", "name": name, "probability": top, "label_mass": max(top, 1 - top) / 2 + 0.4}
    if question["type"] == "choice":
        rest = (1 - top) / (len(question["choices"]) - 1)
        return {"type": "choice", "name": name, "choice": question["choices"][0]["value"], "confidence": 0.0,
                "label_mass": top / 2 + 0.4,
                "probabilities": [{"value": c["value"], "probability": top if i == 0 else rest}
                                  for i, c in enumerate(question["choices"])]}
    rest = (1 - top) / (len(question["levels"]) - 1)
    return {"type": "score", "name": name, "score": 0.0, "confidence": 0.0,
            "probabilities": [{"label": lv["label"], "value": i, "probability": top if i == 0 else rest}
                              for i, lv in enumerate(question["levels"])]}


def cheap_server() -> upstreams.Upstream:
    def handle(seen: upstreams.Seen):
        body = seen.json()
        return 200, {}, {"answers": [chosen_answer(q) for q in body["questions"]], "model": body["model"],
                         "usage": {"input_tokens": 10, "output_tokens": 0}}
    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    cheap, strong = cheap_server(), upstreams.openai_server("big")
    strict = upstreams.status_server(400, {"error": {"message": "questions[0] is not allowed here",
                                                     "type": "invalid_request_error", "param": "questions[0]",
                                                     "code": "question_not_allowed"}})
    path = tmp_path_factory.mktemp("quality") / "gateway.yaml"
    path.write_text(CONFIG)
    running = start_decisiond("--config", str(path), env={"CHEAP": cheap.url, "STRONG": strong.url,
                                                          "STRICT": strict.url})
    yield running
    running.stop()
    for upstream in (cheap, strong, strict):
        upstream.stop()


def predicate(name: str) -> dict:
    return {"type": "predicate", "name": name, "instructions": "Is this about billing?"}


def choice(name: str) -> dict:
    return {"type": "choice", "name": name, "instructions": "Which team?",
            "choices": [{"value": "billing"}, {"value": "shipping"}, {"value": "returns"}]}


def score(name: str) -> dict:
    return {"type": "score", "name": name, "instructions": "How urgent?",
            "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}]}


def scrape(server) -> dict[tuple[str, tuple], float]:
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def grown(before, after, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def decide(server, model: str, questions: list[dict], text: str = "I was charged twice.") -> httpx.Response:
    response = httpx.post(server.url + "/v1/decisions", json={"model": model, "input": text, "questions": questions})
    return response


def top(answer: dict) -> float:
    """The confidence the metrics mean, from a response's answer: its top probability (a predicate's max(p, 1 − p))."""
    if answer["type"] == "predicate":
        return max(answer["probability"], 1 - answer["probability"])
    return max(p["probability"] for p in answer["probabilities"])


def test_histograms_hold_what_the_answers_said(gateway):
    before = scrape(gateway)
    questions = [predicate("p30"), choice("c50"), score("s60")]
    bodies = []
    for text in ("I was charged twice.", "Where is my parcel?", "I was charged twice."):  # the third: a cache hit
        response = decide(gateway, "small", questions, text)
        assert response.status_code == 200, response.text
        bodies.append(response.json())
    assert response.headers.get("x-cache") == "HIT"  # answered by the cache, and counted all the same
    after = scrape(gateway)

    for i, question in enumerate(questions):
        answers = [body["answers"][i] for body in bodies]
        labels = dict(model="small", question=question["name"])
        assert grown(before, after, "decisiond_decision_confidence_count", **labels) == 3
        assert grown(before, after, "decisiond_decision_confidence_sum", **labels) == pytest.approx(
            math.fsum(top(a) for a in answers))
        masses = [a["label_mass"] for a in answers if "label_mass" in a]
        assert len(masses) == (0 if question["type"] == "score" else 3)  # the upstream reports none for scores
        assert grown(before, after, "decisiond_decision_label_mass_count", **labels) == len(masses)
        assert grown(before, after, "decisiond_decision_label_mass_sum", **labels) == pytest.approx(math.fsum(masses))
        # Each bucket counts the answers at or below its bound.
        for bound in ("0.5", "0.6", "0.7"):
            assert grown(before, after, "decisiond_decision_confidence_bucket", le=bound, **labels) == sum(
                top(a) <= float(bound) + 1e-12 for a in answers)


def test_refusals_are_counted_by_model(gateway):
    before = scrape(gateway)
    # The model refuses one of two questions: the refusal is counted, not observed in the histograms.
    response = decide(gateway, "shy", [predicate("p90"), predicate("refuse")])
    assert [a["type"] for a in response.json()["answers"]] == ["predicate", "refusal"]
    # A request refused with a 400 that names a question, once its model is known.
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.decisions.create(model="picky", input="x", questions=[predicate("p90")])
    code = refused.value.code
    after = scrape(gateway)

    assert grown(before, after, "decisiond_decision_refusals_total", model="shy", question="refuse") == 1
    assert grown(before, after, "decisiond_decision_confidence_count", model="shy", question="refuse") == 0
    assert grown(before, after, "decisiond_decision_refusals_total", model="shy", question="p90") == 0
    assert grown(before, after, "decisiond_decision_confidence_count", model="shy", question="p90") == 1
    assert code
    refusals = {dict(k[1])["code"]: v - before.get(k, 0) for k, v in after.items()
                if k[0] == "decisiond_refusals_total" and dict(k[1])["model"] == "picky" and v > before.get(k, 0)}
    assert refusals == {code: 1}
    # ... so that a refusal rate by model can be computed against the requests.
    assert grown(before, after, "decisiond_requests_total", route="/v1/decisions", dialect="openai", model="picky",
                 status="400") == 1


def test_a_cascade_counts_the_questions_it_escalates(gateway):
    questions = [predicate("p95"), predicate("p30"), predicate("p85"), choice("c50"), predicate("refuse")]
    # What the first step's upstream answers to each question, asked directly: those below 0.8 escalate.
    first = decide(gateway, "probe", questions, "Is it billing?").json()["answers"]
    expected = sum(a["type"] == "refusal" or top(a) < 0.8 for a in first)
    assert expected == 3
    before = scrape(gateway)
    response = decide(gateway, "triage", questions, "Is it billing?")
    assert response.status_code == 200, response.text
    after = scrape(gateway)

    assert response.headers["x-decisiond-escalated"] == f"{expected} of {len(questions)}"
    step1, step2 = dict(cascade="triage", step="1", model="small"), dict(cascade="triage", step="2", model="big")
    assert grown(before, after, "decisiond_cascade_questions_total", **step1) == len(questions)
    assert grown(before, after, "decisiond_cascade_escalated_total", **step1) == expected
    assert grown(before, after, "decisiond_cascade_questions_total", **step2) == expected
    assert grown(before, after, "decisiond_cascade_escalated_total", **step2) == 0  # the last step sends none on
    # The cascade's own answers are recorded once, under its name (every question answered: the refusal escalated).
    answered = sum(v - before.get(k, 0) for k, v in after.items()
                   if k[0] == "decisiond_decision_confidence_count" and dict(k[1])["model"] == "triage")
    assert answered == len(questions)


def test_question_names_are_bounded_per_model(gateway):
    # metrics.question_labels is 3: the first three names of a model get a label value, the others are "_other".
    names = ["p91", "p92", "p93", "p94", "p95"]
    assert decide(gateway, "many", [predicate(n) for n in names]).status_code == 200
    assert decide(gateway, "many", [predicate("p91"), predicate("p96")]).status_code == 200
    after = scrape(gateway)
    counts = {dict(k[1])["question"]: v for k, v in after.items()
              if k[0] == "decisiond_decision_confidence_count" and dict(k[1])["model"] == "many"}
    assert counts == {"p91": 2, "p92": 1, "p93": 1, "_other": 3}


def test_a_plain_server_takes_the_bound_from_its_command_line(tiny_dir):
    assert run_decisiond("serve", "--model", tiny_dir, "--metrics-question-labels", "-1").returncode == 2
    server = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny-bound", "--metrics-question-labels", "1")
    try:
        response = decide(server, "tiny-bound", [predicate("first"), choice("second"), score("third")])
        assert response.status_code == 200, response.text
        after = scrape(server)
    finally:
        server.stop()
    answers = response.json()["answers"]
    confidence = {dict(k[1])["question"]: v for k, v in after.items()
                  if k[0] == "decisiond_decision_confidence_sum" and dict(k[1])["model"] == "tiny-bound"}
    assert confidence.keys() == {"first", "_other"}
    assert confidence["first"] == pytest.approx(top(answers[0]))
    assert confidence["_other"] == pytest.approx(top(answers[1]) + top(answers[2]))
    masses = {dict(k[1])["question"]: v for k, v in after.items()
              if k[0] == "decisiond_decision_label_mass_sum" and dict(k[1])["model"] == "tiny-bound"}
    assert masses["_other"] == pytest.approx(answers[1]["label_mass"] + answers[2]["label_mass"])
