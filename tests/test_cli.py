"""``decisiond decide``: one request from stdin or a file, the OpenAI-shaped answer on stdout."""

from __future__ import annotations

import json
import os

from servers import run_decisiond

REQUEST = {"model": "default", "input": "My card was charged twice.",
           "questions": [{"type": "predicate", "name": "billing", "instructions": "The message is about billing."},
                         {"type": "score", "name": "urgency", "instructions": "How urgent?",
                          "levels": [{"label": "low"}, {"label": "high"}]}]}


def decide(*args, stdin: bytes = b""):
    return run_decisiond("decide", *args, input=stdin, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=False)


def test_decide_from_stdin_and_file(smollm_dir, tmp_path):
    done = decide("-", stdin=json.dumps(REQUEST).encode())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    body = json.loads(done.stdout)
    assert [a["name"] for a in body["answers"]] == ["billing", "urgency"]
    assert body["model"] == "SmolLM2-135M-Instruct" and body["usage"]["input_tokens"] > 0
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST))
    again = json.loads(decide(str(path)).stdout)
    assert again["answers"] == body["answers"]


def test_decide_reports_errors_in_openai_shape(smollm_dir):
    done = decide(stdin=json.dumps({**REQUEST, "questions": []}).encode())
    assert done.returncode == 1
    assert json.loads(done.stdout)["error"]["param"] == "questions"
