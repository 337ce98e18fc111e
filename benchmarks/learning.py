"""Decisions that learn from their outcomes, measured: the embedded SmolLM2-135M behind a real gateway, on the
project's labelled tickets (``examples/tickets.jsonl`` and ``examples/tickets_more.jsonl``, 180 tickets with three
questions each), split by ticket: 100 to learn from, 80 held out.

- **Labels.** The held-out tickets are asked once; the 100 others are asked and labelled (``POST
  /v1/decisions/{id}/labels``); ``POST /admin/learn``; the held-out tickets are asked again. Accuracy, log loss and
  ECE (15 bins) per question, before and after.
- **Teacher labels.** On a fresh database, a cascade (SmolLM2, then a strong target that answers every ticket's gold
  label at 0.94) answers the held-out tickets, through a twin cascade that keeps nothing (they never teach); then
  the 100 others, whose escalated questions give teacher labels only (no label is posted); ``POST /admin/learn``;
  the held-out tickets again. Escalation share and agreement with the strong target per question, before and after,
  at the cascade's threshold; and the share a cascade must escalate to reach a given agreement, before and after.

    python benchmarks/learning.py [--threshold 0.8] [--train 100] [--seed 0]

writes ``benchmarks/LEARNING.md`` and ``benchmarks/LEARNING.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from decisiond.scores import metrics

ROOT = Path(__file__).resolve().parent.parent
MASTER = "bench-learning-master-0123456789"
KEY = "bench-learning-user-0123456789"
BINS = 15

CONFIG = """
auth:
  master_key: "{master}"
  keys:
    - {{name: user, key: "{key}", user_path: /bench}}
database_url: "sqlite:///{database}"
providers:
  - {{name: local, type: local, model: default, served_model_name: smol}}
  - {{name: strong, type: openai, base_url: "{strong}/v1", api_key: sk-strong}}
models:
  - {{name: smol, provider: local, store: true}}
  - {{name: oracle, provider: strong, upstream: oracle-1}}
virtual_models:
  - {{name: triage, strategy: cascade, targets: [smol, oracle], escalate_below: {threshold}, store: true}}
  # The same cascade, keeping nothing: the held-out tickets are asked through it, so they never teach.
  - {{name: triage-eval, strategy: cascade, targets: [smol, oracle], escalate_below: {threshold}}}
"""


def tickets() -> list[dict[str, Any]]:
    rows = []
    for name in ("tickets.jsonl", "tickets_more.jsonl"):
        rows += [json.loads(line) for line in (ROOT / "examples" / name).read_text().splitlines() if line.strip()]
    return rows


def gold_index(question: dict[str, Any], value: Any) -> int:
    if question["type"] == "predicate":
        return 0 if value else 1
    if question["type"] == "choice":
        return [c["value"] for c in question["choices"]].index(value)
    return int(value)


# ----------------------------------------------------------------------------------------------- the strong target


def strong_target(gold: dict[str, dict[str, Any]]) -> tuple[ThreadingHTTPServer, str]:
    """An OpenAI-shaped Decisions upstream that knows every ticket's labels: 0.94 on the gold option."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            known = gold[body["input"]]
            answers = []
            for q in body["questions"]:
                g = known[q["name"]]
                if q["type"] == "predicate":
                    answers.append({"type": "predicate", "name": q["name"], "probability": 0.94 if g else 0.06})
                    continue
                options = q["choices"] if q["type"] == "choice" else q["levels"]
                at = gold_index(q, g)
                rest = 0.06 / (len(options) - 1)
                probs = [0.94 if i == at else rest for i in range(len(options))]
                if q["type"] == "choice":
                    answers.append({"type": "choice", "name": q["name"], "choice": g, "confidence": 0.92,
                                    "probabilities": [{"value": c["value"], "probability": p}
                                                      for c, p in zip(options, probs)]})
                else:
                    answers.append({"type": "score", "name": q["name"], "score": float(at), "confidence": 0.92,
                                    "probabilities": [{"label": lv["label"], "value": i, "probability": p}
                                                      for i, (lv, p) in enumerate(zip(options, probs))]})
            data = json.dumps({"answers": answers, "model": "oracle-1",
                               "usage": {"input_tokens": 10, "output_tokens": 0, "total_tokens": 10}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# --------------------------------------------------------------------------------------------------- the gateway


class Gateway:
    def __init__(self, folder: Path, strong: str, threshold: float):
        config = folder / "gateway.yaml"
        config.write_text(CONFIG.format(master=MASTER, key=KEY, database=folder / "gw.sqlite3", strong=strong,
                                        threshold=threshold))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(folder / "server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "decisiond.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port)], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.client = httpx.Client(timeout=300)
        deadline = time.monotonic() + 600
        while True:
            try:
                if self.client.get(self.url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"decisiond did not start: see {folder / 'server.log'}")
            time.sleep(0.2)

    def ask(self, model: str, ticket: dict[str, Any]) -> httpx.Response:
        response = self.client.post(self.url + "/v1/decisions", headers={"Authorization": f"Bearer {KEY}"},
                                    json={"model": model, "input": ticket["input"], "questions": ticket["questions"]})
        response.raise_for_status()
        return response

    def label(self, request_id: str, gold: dict[str, Any]) -> None:
        self.client.post(f"{self.url}/v1/decisions/{request_id}/labels", headers={"Authorization": f"Bearer {KEY}"},
                         json={"labels": gold}).raise_for_status()

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, self.url + path, headers={"Authorization": f"Bearer {MASTER}"},
                                       **kwargs)
        response.raise_for_status()
        return response.json()

    def wait_stored(self, model: str, count: int) -> None:
        deadline = time.monotonic() + 120
        while self.admin("GET", "/admin/quality", params={"model": model})["decisions"] < count:
            if time.monotonic() > deadline:
                raise RuntimeError("the stored decisions were not written")
            time.sleep(0.3)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.client.close()
        self.log.close()


# -------------------------------------------------------------------------------------------------- measuring


def probabilities(answer: dict[str, Any]) -> list[float]:
    if answer["type"] == "predicate":
        return [answer["probability"], 1 - answer["probability"]]
    return [p["probability"] for p in answer["probabilities"]]


def scored(responses: list[httpx.Response], held: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per question: accuracy, log loss, ECE of the answers against the gold labels; escalated share when the
    responses came from a cascade."""
    pairs: dict[str, list[tuple[list[float], int]]] = {}
    escalated: dict[str, int] = {}
    cascade = False
    for response, ticket in zip(responses, held):
        body = response.json()
        cascade = cascade or "x-decisiond-escalated" in response.headers
        for q, answer in zip(ticket["questions"], body["answers"]):
            p = probabilities(answer)
            pairs.setdefault(q["name"], []).append((p, gold_index(q, ticket["gold"][q["name"]])))
            # The strong target answers exactly 0.94 on its option: an answer with that top probability is its own.
            escalated[q["name"]] = escalated.get(q["name"], 0) + math.isclose(max(p), 0.94)
    out = {}
    for name, p in pairs.items():
        m = metrics(p, bins=BINS)
        out[name] = {"n": len(p), "accuracy": m["accuracy"], "log_loss": m["log_loss"], "ece": m["ece"]}
        if cascade:
            out[name]["escalated_share"] = escalated[name] / len(p)
    return out


AGREEMENTS = (0.95, 0.99)


def escalation_needed(responses: list[httpx.Response], held: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per question, for each agreement in ``AGREEMENTS``: the smallest share of the held-out questions a cascade
    must escalate (the least confident first, as a threshold does) so that its final answers agree that often with
    the strong target, given the small model's own answers (``responses``, asked of it directly)."""
    out: dict[str, dict[str, float]] = {}
    for k, question in enumerate(held[0]["questions"]):
        rows = []
        for response, ticket in zip(responses, held):
            p = probabilities(response.json()["answers"][k])
            top = max(range(len(p)), key=lambda i: (p[i], -i))
            rows.append((max(p), top == gold_index(question, ticket["gold"][question["name"]])))
        rows.sort(key=lambda r: r[0])  # least confident first: escalated first
        n = len(rows)
        need = {}
        for target in AGREEMENTS:
            for escalated in range(n + 1):  # escalated answers agree (the strong target gives them)
                if (escalated + sum(right for _, right in rows[escalated:])) / n >= target:
                    need[str(target)] = escalated / n
                    break
        out[question["name"]] = need
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", type=float, default=0.8, help="the cascade's escalate_below")
    parser.add_argument("--train", type=int, default=100, help="tickets to learn from (the rest are held out)")
    parser.add_argument("--seed", type=int, default=0, help="the split's shuffle")
    parser.add_argument("--out", default=str(Path(__file__).parent / "LEARNING"))
    args = parser.parse_args()
    rows = tickets()
    random.Random(args.seed).shuffle(rows)
    train, held = rows[:args.train], rows[args.train:]
    strong, strong_url = strong_target({t["input"]: t["gold"] for t in rows})
    report: dict[str, Any] = {"command": "python benchmarks/learning.py " + " ".join(sys.argv[1:]),
                              "train": len(train), "held_out": len(held), "threshold": args.threshold}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as labels_dir:
            gateway = Gateway(Path(labels_dir), strong_url, args.threshold)
            try:
                before = scored([gateway.ask("smol", t) for t in held], held)
                ids = [gateway.ask("smol", t).headers["x-request-id"] for t in train]
                gateway.wait_stored("smol", len(held) + len(train))
                for request_id, ticket in zip(ids, train):
                    gateway.label(request_id, ticket["gold"])
                learned = gateway.admin("POST", "/admin/learn", json={"model": "smol"})
                after = scored([gateway.ask("smol", t) for t in held], held)
            finally:
                gateway.stop()
        report["labels"] = {"before": before, "after": after, "learned": _learned(learned)}
        with tempfile.TemporaryDirectory() as cascade_dir:
            gateway = Gateway(Path(cascade_dir), strong_url, args.threshold)
            try:
                before = scored([gateway.ask("triage-eval", t) for t in held], held)
                needed_before = escalation_needed([gateway.ask("smol", t) for t in held], held)
                for t in train:
                    gateway.ask("triage", t)
                gateway.wait_stored("triage", len(train))
                learned = gateway.admin("POST", "/admin/learn", json={"model": "triage"})
                after = scored([gateway.ask("triage-eval", t) for t in held], held)
                needed_after = escalation_needed([gateway.ask("smol", t) for t in held], held)
            finally:
                gateway.stop()
        report["teacher"] = {"before": before, "after": after, "learned": _learned(learned),
                             "escalation_needed": {"before": needed_before, "after": needed_after}}
    finally:
        strong.shutdown()
    report["seconds"] = round(time.monotonic() - started, 1)
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(report))
    print(markdown(report))


def _learned(report: dict[str, Any]) -> dict[str, Any]:
    """Per question, what learning accepted and the cross-validated figures it was judged on."""
    return {q["question"]: {"accepted": q["accepted"], "profile": q["profile"], "labels": q["labels"],
                            "teacher_labels": q["teacher_labels"], "served": q["served"],
                            "candidates": {c["kind"]: {**c["cv"], "gain": c["log_loss_gain"],
                                                       "gain_error": c["gain_error"], "reason": c["reason"]}
                                           for c in q["candidates"]}, "reason": q["reason"]}
            for q in report["questions"]}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Learning from outcomes", "",
        f"`{report['command'].strip()}` — the embedded SmolLM2-135M-Instruct behind `decisiond serve --config`, on "
        f"the project's labelled tickets split by ticket: {report['train']} to learn from, {report['held_out']} held "
        f"out ({report['seconds']} s in all). Metrics on the held-out tickets against their gold labels; ECE in "
        f"{BINS} bins.", "",
        f"## Labels: {report['train']} labelled decisions, then `POST /admin/learn`", "",
        "| question | accepted | accuracy before → after | log loss before → after | ECE before → after |",
        "|---|---|---:|---:|---:|"]
    labels = report["labels"]
    for name, b in labels["before"].items():
        a, learned = labels["after"][name], labels["learned"].get(name, {})
        lines.append(f"| {name} | {learned.get('accepted') or 'nothing'} | {b['accuracy']:.3f} → {a['accuracy']:.3f} | "
                     f"{b['log_loss']:.3f} → {a['log_loss']:.3f} | {b['ece']:.3f} → {a['ece']:.3f} |")
    team_before, team_after = labels["before"]["team"], labels["after"]["team"]
    ratio = team_after["log_loss"] / team_before["log_loss"]
    lines += ["", f"Target, for the one recurring question `team` after {report['train']} labels: held-out log loss at "
              f"most half of before, accuracy ≥ 0.8. Measured: log loss × **{ratio:.2f}** "
              f"({team_before['log_loss']:.3f} → {team_after['log_loss']:.3f}), "
              f"accuracy **{team_after['accuracy']:.3f}** — "
              f"{'met' if ratio <= 0.5 and team_after['accuracy'] >= 0.8 else 'NOT met'}."]
    lines += ["", f"What the acceptance rule saw (cross-validated on the {report['train']} labels):", "",
              "| question | candidate | accuracy | log loss | gain ± SE | verdict |", "|---|---|---:|---:|---:|---|"]
    for name, learned in labels["learned"].items():
        lines.append(f"| {name} | served now | {learned['served']['accuracy']:.3f} | "
                     f"{learned['served']['log_loss']:.3f} | | |")
        for kind, c in learned["candidates"].items():
            verdict = "accepted" if learned["accepted"] == kind else (c["reason"] or "accepted, not the best")
            lines.append(f"| | {kind} | {c['accuracy']:.3f} | {c['log_loss']:.3f} | {c['gain']:.3f} ± "
                         f"{c['gain_error']:.3f} | {verdict} |")
    teacher = report["teacher"]
    lines += ["", f"## Teacher labels: a cascade (escalate_below {report['threshold']}) learning from its strong "
              "target", "",
              "No label is posted: each question the small model escalated is labelled by the strong target's answer. "
              "Agreement: the final answer's top option is the strong target's (which answers the gold label).", "",
              "| question | teacher labels | accepted | escalated before → after | agreement before → after |",
              "|---|---:|---|---:|---:|"]
    for name, b in teacher["before"].items():
        a, learned = teacher["after"][name], teacher["learned"].get(name, {})
        lines.append(f"| {name} | {learned.get('teacher_labels', 0)} | {learned.get('accepted') or 'nothing'} | "
                     f"{b['escalated_share']:.1%} → {a['escalated_share']:.1%} | "
                     f"{b['accuracy']:.3f} → {a['accuracy']:.3f} |")
    needed = teacher["escalation_needed"]
    lines += ["", "At equal agreement: the share of held-out questions a cascade must escalate (the least confident "
              "first, whatever the threshold) for its answers to agree that often with the strong target, from the "
              "small model's answers before and after learning.", "",
              "| question | " + " | ".join(f"escalated for agreement ≥ {a} before → after" for a in AGREEMENTS) + " |",
              "|---|" + "---:|" * len(AGREEMENTS)]
    for name, b in needed["before"].items():
        a = needed["after"][name]
        lines.append(f"| {name} | " + " | ".join(f"{b[str(x)]:.1%} → {a[str(x)]:.1%}" for x in AGREEMENTS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
