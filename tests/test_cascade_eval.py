"""``decisiond eval --cascade``: the example set answered down a cascade whose first step is the tiny local model and
whose strong step is a real OpenAI-shaped HTTP server on loopback that knows the gold labels; every number of the
table checked against the first step's own answers."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import upstreams
from servers import run_decisiond

from decisiond import cascade_eval, evaluation
from decisiond.gateway import cascade
from decisiond.gateway.config import parse
from decisiond.gateway.router import Router

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tickets.jsonl"
SURE = 0.97
PER_REQUEST = 0.002  # USD per call of the strong model


def gold_server() -> upstreams.Upstream:
    """OpenAI's /v1/decisions, answering each example ticket's gold label at ``SURE``."""
    golds = {}
    for line in EXAMPLES.read_text().splitlines():
        data = json.loads(line)
        golds[data["input"]] = data["gold"]

    def answer(question: dict[str, Any], gold: Any) -> dict[str, Any]:
        name = question["name"]
        if question["type"] == "predicate":
            return {"type": "predicate", "name": name, "probability": SURE if gold else 1 - SURE}
        items = question["choices"] if question["type"] == "choice" else question["levels"]
        right = next(i for i, c in enumerate(items) if c.get("value", c.get("label")) == gold or (
            question["type"] == "score" and (gold == i or gold == c["label"])))
        probs = [SURE if i == right else (1 - SURE) / (len(items) - 1) for i in range(len(items))]
        if question["type"] == "choice":
            return {"type": "choice", "name": name, "choice": items[right]["value"], "confidence": 0.9,
                    "probabilities": [{"value": c["value"], "probability": p} for c, p in zip(items, probs)]}
        return {"type": "score", "name": name, "score": float(right), "confidence": 0.9,
                "probabilities": [{"label": c["label"], "value": i, "probability": p}
                                  for i, (c, p) in enumerate(zip(items, probs))]}

    def handle(seen: upstreams.Seen):
        body = seen.json()
        gold = golds[body["input"]]
        return 200, {}, {"model": "gold-model", "answers": [answer(q, gold[q["name"]]) for q in body["questions"]],
                         "usage": {"input_tokens": 40, "output_tokens": 0, "total_tokens": 40}}

    return upstreams.Upstream(handle).start()


@pytest.fixture(scope="module")
def strong():
    server = gold_server()
    yield server
    server.stop()


def config_data(strong_url: str, local: dict[str, Any]) -> dict[str, Any]:
    return {"providers": [{"name": "local", "type": "local", **local},
                          {"name": "strong", "type": "openai", "base_url": strong_url + "/v1", "api_key": "k"}],
            "models": [{"name": "luna", "provider": "strong", "upstream": "gold-model",
                        "pricing": {"per_request": PER_REQUEST}}],
            "virtual_models": [{"name": "triage", "strategy": "cascade", "escalate_below": 0.8,
                                "targets": [f"local/{local.get('served_model_name', 'tiny-random')}", "luna"]}]}


def test_the_table_on_the_example_set_matches_the_first_steps_own_answers(strong, tiny_engine):
    items = evaluation.load(EXAMPLES)
    router = Router.from_config(parse(config_data(strong.url, {})), {"local": tiny_engine})
    before = len(strong.seen)

    async def run() -> tuple[dict[str, Any], list[Any]]:
        report = await cascade_eval.sweep(router, "triage", items, progress=False)
        own = [await router.decide(item.request, "tiny-random") for item in items]
        await router.aclose()
        return report, own

    report, own = asyncio.run(run())
    rows = report["rows"]
    assert [r["threshold"] for r in rows] == list(cascade_eval.THRESHOLDS)
    for key in ("escalated", "cost_per_1000", "calls_per_request"):
        assert all(a[key] <= b[key] for a, b in zip(rows, rows[1:])), key
    questions = sum(len(i.gold) for i in items)
    first = report["first_step_only"]
    own_pairs = [(a.probabilities, g) for result, item in zip(own, items) for a, g in zip(result.answers, item.gold)]
    assert first["escalated"] == 0 and first["cost_per_1000"] == 0 and first["calls_per_request"] == 1
    assert first["accuracy"] == pytest.approx(evaluation.metrics(own_pairs, 0.5)["accuracy"])
    every = report["every_question_escalated"]
    assert every["escalated"] == 1 and every["accuracy"] == 1
    assert every["log_loss"] == pytest.approx(-math.log(SURE))
    assert every["cost_per_1000"] == pytest.approx(PER_REQUEST * 1000)
    # Each row by hand from the first step's own answers: the unsure questions take the strong model's answer.
    subsets = set()
    for row in rows:
        t = row["threshold"]
        unsure = [cascade.unsure(result.answers, t) for result in own]
        subsets |= {(n, tuple(u)) for n, u in enumerate(unsure) if u}
        assert row["escalated"] == pytest.approx(sum(map(len, unsure)) / questions)
        assert row["cost_per_1000"] == pytest.approx(1000 * PER_REQUEST * sum(bool(u) for u in unsure) / len(items))
        right = sum((k in u) or (evaluation.predicted(a.probabilities) == g)
                    for result, item, u in zip(own, items, unsure)
                    for k, (a, g) in enumerate(zip(result.answers, item.gold)))
        assert row["accuracy"] == pytest.approx(right / questions)
    # Each distinct set of unsure questions of an item went to the strong model in one call, once.
    subsets |= {(n, tuple(range(len(item.gold)))) for n, item in enumerate(items)}
    assert len(strong.seen) - before == len(subsets)
    assert 0 < rows[0]["escalated"] < rows[-1]["escalated"] < 1  # the tiny model is unsure of some questions only
    assert "| 0.8 |" in cascade_eval.table(report)


def test_eval_cascade_on_the_command_line(strong, tiny_dir, tmp_path):
    (tmp_path / "gateway.yaml").write_text(json.dumps(config_data(
        strong.url, {"model": tiny_dir, "served_model_name": "tiny-eval"})))
    out = tmp_path / "report"
    done = run_decisiond("eval", str(EXAMPLES), "--cascade", "triage", "--config", str(tmp_path / "gateway.yaml"),
                         "--out-dir", str(out), timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| escalate below | escalated | accuracy | log loss |" in done.stdout and "| 0.99 |" in done.stdout
    report = json.loads((out / "cascade.json").read_text())
    assert report["steps"] == ["local/tiny-eval", "luna"] and report["items"] == 60
    assert (out / "cascade.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = run_decisiond("eval", str(EXAMPLES), "--cascade", "triage")
    assert refused.returncode == 2 and "--cascade needs --config" in refused.stderr
    wrong = run_decisiond("eval", str(EXAMPLES), "--cascade", "luna", "--config", str(tmp_path / "gateway.yaml"),
                          "--out-dir", str(out))
    assert wrong.returncode == 2 and "'luna' is not a cascade" in wrong.stderr
