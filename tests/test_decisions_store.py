"""Stored decisions (``store: true``) and their labels, through a real server on loopback: fake upstreams (a weak one
answering every question the same way, a strong one answering from known labels behind a cascade), SQLite.

Guarantees, each with the test that would catch its breach:
- a key labels and deletes only its own decisions (404 for another's): ``test_labels_are_checked_and_scoped``;
- a label names a question of the decision and a value it allows, else 400 naming it: the same test;
- a decision past its retention is gone: ``test_a_decision_past_its_retention_is_purged``;
- ``/metrics`` reports the accuracy and ECE of what was served against the labels:
  ``test_metrics_report_accuracy_and_ece_over_the_labels``.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import upstreams
from servers import start_decisiond

MASTER = "store-master-key-0123456789"
ALICE = "store-alice-key-0123456789"
BOB = "store-bob-key-0123456789abc"
BILLING = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
TEAM = {"type": "choice", "name": "team", "instructions": "Which team should take it?",
        "choices": [{"value": "payments"}, {"value": "mobile"}, {"value": "sales"}]}
URGENCY = {"type": "score", "name": "urgency", "instructions": "How urgent is it?",
           "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}]}
# What the strong target knows: the team of each ticket.
TEAMS = {"The app crashes on start.": "mobile", "I was charged twice.": "payments"}

CONFIG = """
auth:
  master_key: "{master}"
  keys:
    - {{name: alice, key: "{alice}", user_path: /team/a}}
    - {{name: bob, key: "{bob}", user_path: /team/b}}
database_url: "sqlite:///{database}"
providers:
  - {{name: weak, type: openai, base_url: "{weak}/v1", api_key: sk-weak}}
  - {{name: strong, type: openai, base_url: "{strong}/v1", api_key: sk-strong}}
models:
  - {{name: luna, provider: weak, upstream: gpt-6-luna, store: true, store_retention_days: 7}}
  - {{name: plain, provider: weak, upstream: gpt-6-luna}}
  - {{name: oracle, provider: strong, upstream: oracle-1}}
virtual_models:
  - {{name: triage, strategy: cascade, targets: [plain, oracle], escalate_below: 0.65, store: true}}
"""


def strong_server() -> upstreams.Upstream:
    """An OpenAI-shaped upstream that knows each ticket's team: 0.9 on it."""
    def handle(seen):
        body = seen.json()
        answers = []
        for question in body["questions"]:
            if question["type"] != "choice":
                answers.append(upstreams.openai_answer(question, 0))
                continue
            known = TEAMS[body["input"]]
            values = [c["value"] for c in question["choices"]]
            rest = 0.1 / (len(values) - 1)
            answers.append({"type": "choice", "name": question.get("name"), "choice": known, "confidence": 0.9,
                            "probabilities": [{"value": v, "probability": 0.9 if v == known else rest}
                                              for v in values]})
        return 200, {}, {"answers": answers, "model": "oracle-1",
                         "usage": {"input_tokens": 10, "output_tokens": 0, "total_tokens": 10}}
    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    weak, strong = upstreams.openai_server(), strong_server()
    config = folder / "gateway.yaml"
    config.write_text(CONFIG.format(master=MASTER, alice=ALICE, bob=BOB, database=folder / "gw.sqlite3",
                                    weak=weak.url, strong=strong.url))
    server = start_decisiond("--config", str(config))
    server.database = folder / "gw.sqlite3"
    yield server
    server.stop()
    weak.stop()
    strong.stop()


def ask(server, key: str, model: str, text: str, questions: list) -> str:
    response = httpx.post(server.url + "/v1/decisions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": model, "input": text, "questions": questions})
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def label(server, key: str, request_id: str, labels) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/decisions/{request_id}/labels", headers={"Authorization": f"Bearer {key}"},
                      json={"labels": labels} if not isinstance(labels, httpx.Response) else labels, timeout=30)


def stored(database, request_id: str) -> dict | None:
    with sqlite3.connect(database) as connection:
        connection.row_factory = sqlite3.Row
        row = connection.execute("SELECT * FROM decisions WHERE request_id = ?", (request_id,)).fetchone()
    return None if row is None else {k: (json.loads(row[k]) if isinstance(row[k], str) and row[k][:1] in "[{"
                                         else row[k]) for k in row.keys()}


def test_labels_are_checked_and_scoped(gateway):
    request_id = ask(gateway, ALICE, "luna", "I was charged twice.", [BILLING, TEAM, URGENCY])
    answer = label(gateway, ALICE, request_id, {"billing": True})  # at once: it waits for the decision's write
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"request_id": request_id, "object": "decision.labels", "labels": {"billing": True}}
    row = stored(gateway.database, request_id)
    assert row["model"] == "luna" and row["key_id"] == "static:alice"
    assert row["request"]["input"] == "I was charged twice."
    assert [q["name"] for q in row["questions"]] == ["billing", "team", "urgency"]
    assert row["answers"][0] == [0.7] or row["answers"][0][0] == pytest.approx(0.7)

    for labels, param in [({"refund": True}, "labels.refund"), ({"billing": "yes"}, "labels.billing"),
                          ({"team": "billing"}, "labels.team"), ({"urgency": 3}, "labels.urgency"),
                          ({"urgency": True}, "labels.urgency"), ({}, "labels")]:
        refused = label(gateway, ALICE, request_id, labels)
        assert refused.status_code == 400, (labels, refused.text)
        assert refused.json()["error"]["param"] == param
    assert label(gateway, BOB, request_id, {"billing": False}).status_code == 404  # not bob's
    again = label(gateway, ALICE, request_id, {"team": "payments", "urgency": 2, "billing": False})
    assert again.json()["labels"] == {"billing": False, "team": "payments", "urgency": 2}  # replaced, merged
    assert label(gateway, MASTER, request_id, {"urgency": 0}).json()["labels"]["urgency"] == 0

    unstored = ask(gateway, ALICE, "plain", "I was charged twice.", [BILLING])
    assert label(gateway, ALICE, unstored, {"billing": True}).status_code == 404
    headers = {"Authorization": f"Bearer {ALICE}"}
    assert httpx.delete(f"{gateway.url}/v1/decisions/{request_id}", headers={
        "Authorization": f"Bearer {BOB}"}).status_code == 404
    deleted = httpx.delete(f"{gateway.url}/v1/decisions/{request_id}", headers=headers)
    assert deleted.json() == {"id": request_id, "object": "decision", "deleted": True}
    assert stored(gateway.database, request_id) is None
    assert label(gateway, ALICE, request_id, {"billing": True}).status_code == 404
    assert httpx.post(f"{gateway.url}/v1/decisions/{request_id}/labels", json={"labels": {}}).status_code == 401


def test_a_cascade_keeps_every_step_and_teacher_labels(gateway):
    """The weak step is unsure of the team (0.6 < 0.65) and sure of billing (0.7): the team goes on to the strong
    step, and its answer is kept as the weak step's soft label for that question."""
    request_id = ask(gateway, ALICE, "triage", "The app crashes on start.", [BILLING, TEAM])
    label(gateway, ALICE, request_id, {"team": "mobile"})
    row = stored(gateway.database, request_id)
    assert row["model"] == "triage"
    assert [s["step"] for s in row["steps"]] == ["plain", "oracle"]
    assert set(row["steps"][0]["answers"]) == {"0", "1"} and set(row["steps"][1]["answers"]) == {"1"}
    assert row["steps"][1]["answers"]["1"] == pytest.approx([0.05, 0.9, 0.05])
    assert row["teacher"] == {"team": pytest.approx([0.05, 0.9, 0.05])}
    assert row["answers"][1] == pytest.approx([0.05, 0.9, 0.05])


def test_a_decision_past_its_retention_is_purged(gateway):
    from decisiond.gateway.decisions import DecisionStore
    from decisiond.store.db import Database

    request_id = ask(gateway, ALICE, "luna", "I was charged twice.", [BILLING])
    assert label(gateway, ALICE, request_id, {"billing": True}).status_code == 200
    row = stored(gateway.database, request_id)
    expires = datetime.fromisoformat(row["expires_at"])
    assert timedelta(days=6.9) < expires.replace(tzinfo=timezone.utc) - datetime.now(timezone.utc) <= timedelta(days=7)

    async def purge(at: datetime) -> int:
        db = await Database.open(f"sqlite:///{gateway.database}")
        try:
            return await DecisionStore(db).purge(at)
        finally:
            await db.aclose()

    assert asyncio.run(purge(datetime.now(timezone.utc) + timedelta(days=6))) == 0  # the clock the test sets
    assert asyncio.run(purge(datetime.now(timezone.utc) + timedelta(days=8))) >= 1
    assert stored(gateway.database, request_id) is None
    assert label(gateway, ALICE, request_id, {"billing": True}).status_code == 404


def _gauge(text: str, name: str, model: str, question: str) -> float:
    prefix = f'{name}{{model="{model}",question="{question}"}} '
    [value] = [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]
    return float(value)


def test_metrics_report_accuracy_and_ece_over_the_labels(gateway):
    """The weak upstream answers billing with 0.7 every time: 3 labels true and 1 false make an accuracy of 0.75
    and an ECE of |0.75 - 0.7| = 0.05 (one bin)."""
    headers = {"Authorization": f"Bearer {MASTER}"}
    ids = [ask(gateway, BOB, "luna", f"ticket {i} for the metrics", [{**BILLING, "name": "metric_billing"}])
           for i in range(4)]
    for request_id, truth in zip(ids, [True, True, True, False]):
        assert label(gateway, BOB, request_id, {"metric_billing": truth}).status_code == 200
    time.sleep(0.1)
    text = httpx.get(gateway.url + "/metrics", headers=headers).text
    assert _gauge(text, "decisiond_decision_labels", "luna", "metric_billing") == 4
    assert _gauge(text, "decisiond_decision_accuracy", "luna", "metric_billing") == pytest.approx(0.75)
    assert _gauge(text, "decisiond_decision_ece", "luna", "metric_billing") == pytest.approx(0.05)


def test_labels_import_posts_each_line_and_reports_the_refused(gateway, tmp_path):
    from servers import run_decisiond

    first = ask(gateway, ALICE, "luna", "I was charged twice.", [BILLING, TEAM])
    second = ask(gateway, ALICE, "luna", "The app crashes on start.", [BILLING, TEAM])
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps({"request_id": first, "labels": {"billing": True, "team": "payments"}}) + "\n\n"
                    + json.dumps({"request_id": second, "labels": {"team": "finance"}}) + "\n"
                    + json.dumps({"request_id": "req_nobody", "labels": {"billing": True}}) + "\n")
    done = run_decisiond("labels", "import", str(path), "--url", gateway.url, "--api-key", ALICE)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout) == {"labelled": 1, "refused": 2}
    refusals = done.stderr.splitlines()
    assert refusals[0].startswith(f"decisiond: {path}:3: labels.team: a label of 'team' is one of 'payments'")
    assert refusals[1].startswith(f"decisiond: {path}:4: request_id: no stored decision 'req_nobody'")
    assert stored(gateway.database, first)["labels"] == {"billing": True, "team": "payments"}
    assert stored(gateway.database, second)["labels"] is None


def test_the_quality_report_and_its_command(gateway, tmp_path):
    """``GET /admin/quality`` over the cascade's stored decisions: the team question's labels against what was
    served, and the share that went on to the strong step; ``decisiond quality`` prints it and draws it."""
    from servers import run_decisiond

    for text in TEAMS:
        request_id = ask(gateway, ALICE, "triage", text, [BILLING, TEAM])
        assert label(gateway, ALICE, request_id, {"team": TEAMS[text]}).status_code == 200
    headers = {"Authorization": f"Bearer {MASTER}"}
    report = httpx.get(gateway.url + "/admin/quality", params={"model": "triage"}, headers=headers).json()
    by = {q["question"]: q for q in report["questions"]}
    assert report["bins"] == 15 and by["team"]["labels"] >= 2
    assert by["team"]["served"]["accuracy"] == 1.0  # the strong step answered every team, with 0.9 on the label
    assert by["team"]["served"]["log_loss"] == pytest.approx(-math.log(0.9))
    assert by["team"]["escalated_share"] == 1.0 and by["billing"]["escalated_share"] == 0.0
    assert by["billing"]["labels"] == 0 and by["billing"]["served"] is None
    assert httpx.get(gateway.url + "/admin/quality", params={"model": "plain"}, headers=headers).json()[
        "error"]["param"] == "model"
    assert httpx.get(gateway.url + "/admin/quality", params={"model": "triage"},
                     headers={"Authorization": f"Bearer {ALICE}"}).status_code in (401, 403)

    png = tmp_path / "quality.png"
    done = run_decisiond("quality", "--model", "triage", "--url", gateway.url, "--api-key", MASTER, "--png", str(png))
    assert done.returncode == 0, done.stderr
    assert "| team |" in done.stdout and "100.0%" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
