"""``decisiond batch``: a real run killed half-way resumes without answering a line twice; bad lines become error
records and the run goes on; the same against a remote server (``--url``)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest
from servers import Child, decisiond

QUESTIONS = [{"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
             {"type": "choice", "name": "team", "instructions": "Which team?",
              "choices": [{"value": "billing"}, {"value": "shipping"}]}]


def batch(*args: str) -> Child:
    return decisiond("batch", *args, "--log-level", "warning", env={**os.environ, "HF_HUB_OFFLINE": "1"})


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_source(tmp_path, count: int):
    lines = []
    for i in range(1, count + 1):
        if i == 3:
            lines.append("{not json")
        elif i == 5:
            lines.append(json.dumps({"id": "t5", "input": "x", "questions": [{**QUESTIONS[1], "choices": []}]}))
        elif i % 7 == 0:
            lines.append(json.dumps({"id": f"t{i}", "input": f"Ticket {i}: my parcel is late.",
                                     "questions": QUESTIONS[:1]}))
        else:
            lines.append(json.dumps(f"Ticket {i}: I was charged twice."))
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n")
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps(QUESTIONS))
    return source, questions


def check_complete(out, count: int) -> None:
    final = records(out)
    assert Counter(r["line"] for r in final) == Counter(range(1, count + 1))  # every line once: none twice
    by_line = {r["line"]: r for r in final}
    assert by_line[3]["error"]["code"] == "invalid_json"
    assert by_line[5]["error"]["status"] == 400 and by_line[5]["error"]["param"] == "questions[0].choices"
    assert by_line[5]["id"] == "t5"
    assert by_line[7]["id"] == "t7" and [a["name"] for a in by_line[7]["answers"]] == ["billing"]
    one = by_line[1]
    assert [a["name"] for a in one["answers"]] == ["billing", "team"] and one["model"] == "tiny-random"
    assert abs(sum(p["probability"] for p in one["answers"][1]["probabilities"]) - 1) < 1e-9


@pytest.mark.slow
def test_killed_run_resumes_without_answering_twice(tiny_dir, tmp_path):
    count = 120
    source, questions = write_source(tmp_path, count)
    out = tmp_path / "answers.jsonl"
    args = (str(source), "--out", str(out), "--questions", str(questions), "--model", tiny_dir,
            "--served-model-name", "tiny-random", "--concurrency", "2")
    first = batch(*args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 10):
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    partial = len(out.read_text().splitlines())
    assert first.returncode == -signal.SIGKILL and 10 <= partial < count
    with out.open("a") as f:
        f.write('{"line": 120, "model": "tiny-ran')  # a record torn by the kill

    second = batch(*args)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode in (0, 1), stderr  # 1 when the bad lines 3 and 5 fell to this run
    assert f"{count} lines:" in stderr and "q/s" in stderr
    skipped = int(stderr.split(" skipped")[0].rsplit(", ", 1)[-1].split()[0])
    assert skipped >= partial - 1  # everything the killed run wrote, but the torn line
    check_complete(out, count)

    third = batch(*args)
    _, stderr = third.communicate(timeout=120)
    assert f"0 answered, 0 errors, {count} skipped" in stderr


def test_batch_against_a_server(tiny_server, tmp_path):
    source, questions = write_source(tmp_path, 8)
    out = tmp_path / "answers.jsonl"
    run = batch(str(source), "--out", str(out), "--questions", str(questions), "--url", tiny_server.url,
                "--model", "tiny-modes", "--no-progress")
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1 and "6 answered, 2 errors, 0 skipped" in stderr, stderr
    assert {r["line"] for r in records(out)} == set(range(1, 9))
    assert all(r["model"] == "tiny-modes" for r in records(out) if "error" not in r)
