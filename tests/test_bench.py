"""``decisiond bench`` end to end on the tiny model: every mode runs, the naive loop and decisiond agree, and the
report holds the ratios. No timing is asserted."""

from __future__ import annotations

import json
import os

import pytest
from servers import run_decisiond

from decisiond.bench import measure, workload
from decisiond.bench.report import markdown


def test_workload_is_reproducible_and_sized():
    a, b = workload.requests(5, 10), workload.requests(5, 10)
    assert [r.input[0].parts[0].text for r in a] == [r.input[0].parts[0].text for r in b]
    assert len(a[0].questions) == 10 and len(workload.requests(1, 3)[0].questions) == 3
    kinds = [q.kind for q in a[0].questions[:3]]
    assert kinds == ["choice", "score", "yes_no"] and len(a[0].questions[0].options) == 4
    assert len(a[0].questions[1].levels) == 3


@pytest.mark.slow
def test_bench_command_end_to_end(tiny_dir, tmp_path):
    out, raw = tmp_path / "RESULTS.md", tmp_path / "RESULTS.json"
    done = run_decisiond("bench", "--model", tiny_dir, "--tickets", "2", "--questions", "3,10", "--clients", "1,2",
                         "--out", str(out), "--json", str(raw), env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(raw.read_text())
    modes = [(r["workload"], r["mode"]) for r in report["rows"]]
    assert len(modes) == 12 and ("10q", "decisiond HTTP, 2 clients") in modes
    # The repeated-request workload: every ticket a miss then a hit (the runner checks X-Cache), in the same run.
    assert ("3q", measure.CACHE_MISS) in modes and ("3q", measure.CACHE_HIT) in modes
    assert all(r["questions"] == r["requests"] * int(r["workload"][:-1]) for r in report["rows"])
    # The naive loop and decisiond computed the same probabilities.
    assert max(report["agreement"].values()) < 1e-4
    assert set(report["speedups"]) == {"3q: in-process / naive", "3q: HTTP 2 clients / HTTP 1 client",
                                       "10q: in-process / naive", "10q: HTTP 2 clients / HTTP 1 client",
                                       "3q: cache miss p50 / cache hit p50", "10q: cache miss p50 / cache hit p50"}
    assert report["server_peak_rss_mb"] > 0 and report["bounds"]["3q"]["unique_tokens"] > 0
    text = out.read_text()
    assert "| 10q | decisiond in-process |" in text and "time / FLOP bound" in text
    command = text.split("Reproduce: `")[1].split("`")[0]
    assert command.startswith("decisiond bench --model ")
    # The markdown report is a rendering of the JSON numbers, nothing else.
    assert text == markdown(runner_report(report), command)


def runner_report(data: dict) -> dict:
    rows = [measure.Row(r["workload"], r["mode"], r["requests"], r["questions"], r["seconds"], r["latencies"])
            for r in data["rows"]]
    return {**data, "rows": rows}


def test_bench_on_a_missing_gpu_fails_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = run_decisiond("bench", "--device", "cuda", "--dtype", "bfloat16", "--tickets", "1",
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 2 and not done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("decisiond: --device cuda: no CUDA device is available here")


@pytest.mark.slow
def test_bench_gateway_end_to_end(tmp_path):
    """``decisiond bench --gateway``, briefly: the mock upstream alone and decisiond keyless, keyed on SQLite and on
    PostgreSQL + Redis, each at every client count, no errors, and the budget checks. No timing is asserted."""
    out, raw = tmp_path / "GATEWAY.md", tmp_path / "GATEWAY.json"
    done = run_decisiond("bench", "--gateway", "--workers", "1", "--seconds", "1", "--rounds", "1", "--clients",
                         "1,4", "--out", str(out), "--json", str(raw), timeout=900, fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(raw.read_text())
    ran = set(report["table"])
    assert {"upstream", "keyless", "keyless-traced", "keyed-sqlite"} <= ran
    assert report["traces_received"]["exports"] > 0 and report["traces_received"]["bytes"] > 0  # traces were sent
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI installs PostgreSQL and Redis
        assert "keyed-postgres-redis" in ran, report["skipped"]
    for name, by_clients in report["table"].items():
        for clients, row in by_clients.items():
            assert row["rate"] > 0 and row["errors"] == 0 and row["non_2xx"] == 0, (name, clients, row)
    (budget,) = report["budgets"]
    assert budget["exact"] and budget["refused"] > 0 and budget["spent_usd"] <= budget["limit_usd"] + 1e-12
    assert set(report["shared"]) == {"keyed", "keyless"}
    assert all(set(by) == {"1", "2"} and min(by.values()) > 0 for by in report["shared"].values())
    text = out.read_text()
    assert "| keyless |" in text and "One budget shared by the workers" in text
    assert "Traces on (keyless-traced against keyless)" in text


def test_the_mock_upstream_answers_every_question_asked_and_nothing_else():
    from decisiond.bench import upstream

    status, body = upstream.respond("/v1/decisions", json.dumps({"questions": [
        {"type": "predicate", "name": "a"}, {"type": "choice", "name": "b", "choices": [{"value": "x"}, {"value": "y"}]},
        {"type": "score", "name": "c", "levels": [{"label": "low"}, {"label": "high"}]}]}).encode())
    answers = json.loads(body)["answers"]
    assert status == 200 and [a["name"] for a in answers] == ["a", "b", "c"]
    assert answers[0]["probability"] == 0.7 and [p["probability"] for p in answers[1]["probabilities"]] == [0.6, 0.4]
    assert upstream.respond("/v1/chat/completions", b"{}")[0] == 404
    assert upstream.respond("/v1/decisions", b"not json")[0] == 400


def test_the_mock_upstream_is_also_an_otlp_receiver_that_counts_what_it_gets():
    from decisiond.bench import upstream

    before = json.loads(upstream.respond("/v1/traces/received", b"")[1])
    assert upstream.respond("/v1/traces", b"\x0a\x00") == (200, b"")
    after = json.loads(upstream.respond("/v1/traces/received", b"")[1])
    assert after == {"exports": before["exports"] + 1, "bytes": before["bytes"] + 2}
