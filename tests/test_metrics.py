"""``GET /metrics`` on a real server: requests, latency, tokens, the engine's counters and upstream failovers
move as requests are made, read back with ``prometheus_client.parser``."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
import upstreams
from prometheus_client.parser import text_string_to_metric_families
from servers import start_decisiond

MASTER = "metrics-master-key-0123456789"
CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
auth: {master_key: "${TEST_MASTER}"}
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
  - {name: e529, type: openai, base_url: "${UP_529}/v1"}
virtual_models:
  - {name: sturdy, targets: [e529/x, local/tiny-local]}
  # never asked: its cascade series exist at 0 all the same (the dashboard plots them)
  - {name: careful, strategy: cascade, escalate_below: 0.5, targets: [local/tiny-local, sturdy]}
"""
QUESTIONS = [{"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
             {"type": "choice", "name": "team", "instructions": "Which team?",
              "choices": [{"value": "billing"}, {"value": "shipping"}]}]


@pytest.fixture(scope="module")
def gateway(tiny_dir, tmp_path_factory):
    overloaded = upstreams.status_server(529, {"error": {"message": "Overloaded", "type": "overloaded_error"}})
    path = tmp_path_factory.mktemp("metrics") / "gateway.yaml"
    path.write_text(CONFIG)
    running = start_decisiond("--config", str(path), env={"TEST_MASTER": MASTER, "TINY_DIR": tiny_dir,
                                                          "UP_529": overloaded.url,
                                                          "DECISIOND_DATABASE_URL": f"sqlite:///{path.parent}/keys.db"})
    yield running
    running.stop()
    overloaded.stop()


def scrape(server) -> dict[tuple[str, tuple], float]:
    response = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {MASTER}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_as_requests_are_made(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=MASTER, max_retries=0)
    before = scrape(gateway)
    ok = dict(route="/v1/decisions", dialect="openai", model="tiny-local", status="200")
    for _ in range(3):
        client.decisions.create(model="tiny-local", input="I was charged twice.", questions=QUESTIONS)
    with pytest.raises(openai.BadRequestError):
        client.decisions.create(model="tiny-local", input="x", questions=[{**QUESTIONS[1], "choices": []}])
    client.decisions.create(model="sturdy", input="Where is my parcel?", questions=QUESTIONS)
    after = scrape(gateway)

    assert value(after, "decisiond_requests_total", **ok) - value(before, "decisiond_requests_total", **ok) == 3
    bad = dict(route="/v1/decisions", dialect="openai", model="", status="400")
    assert value(after, "decisiond_requests_total", **bad) - value(before, "decisiond_requests_total", **bad) == 1
    refusals = [dict(k[1]) for k, v in after.items() if k[0] == "decisiond_refusals_total" and v > before.get(k, 0)]
    assert [r["status"] for r in refusals] == ["400"]
    hist = dict(route="/v1/decisions", dialect="openai", model="tiny-local")
    assert value(after, "decisiond_request_duration_seconds_count", **hist) - value(
        before, "decisiond_request_duration_seconds_count", **hist) == 3
    assert value(after, "decisiond_request_duration_seconds_sum", **hist) > value(
        before, "decisiond_request_duration_seconds_sum", **hist)
    assert value(after, "decisiond_questions_total", route="/v1/decisions", model="tiny-local") - value(
        before, "decisiond_questions_total", route="/v1/decisions", model="tiny-local") == 6
    assert value(after, "decisiond_input_tokens_total", model="tiny-local") > value(
        before, "decisiond_input_tokens_total", model="tiny-local")

    # The virtual model tried the overloaded upstream, failed over, and the local engine answered.
    assert value(after, "decisiond_requests_total", route="/v1/decisions", dialect="openai", model="sturdy",
                 status="200") == 1
    assert value(after, "decisiond_upstream_attempts_total", provider="e529", model="e529/x") == 1
    assert value(after, "decisiond_upstream_failovers_total", provider="e529") == 1
    assert sum(v for k, v in after.items() if k[0] == "decisiond_upstream_errors_total"
               and dict(k[1])["provider"] == "e529") == 1
    assert value(after, "decisiond_upstream_attempts_total", provider="local", model="tiny-local") - value(
        before, "decisiond_upstream_attempts_total", provider="local", model="tiny-local") >= 1

    # The engine's own counters: batches ran; prefix sharing computes fewer tokens than were requested.
    requested = value(after, "decisiond_engine_tokens_requested_total", model="tiny-local")
    computed = value(after, "decisiond_engine_tokens_computed_total", model="tiny-local")
    assert value(after, "decisiond_engine_batches_total", model="tiny-local") > value(
        before, "decisiond_engine_batches_total", model="tiny-local")
    assert 0 < computed < requested
    assert ("decisiond_engine_queue_depth", (("model", "tiny-local"),)) in after

    # Every series the Grafana dashboard plots exists.
    dashboard = (Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text()
    plotted = set(re.findall(r"decisiond_[a-z_]+", dashboard))
    text = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    declared = {family.name for family in text_string_to_metric_families(text)}  # gauges of labels have no samples
    assert plotted and plotted <= {name for name, _ in after} | declared  # without stored decisions


def test_metrics_need_the_master_key(gateway):
    assert httpx.get(gateway.url + "/metrics").status_code == 401


def test_a_scrape_of_several_workers_skips_a_file_a_worker_has_not_sized_yet(tmp_path):
    """A worker creates its metrics file before it sizes it: a scrape that finds it at 0 bytes (or finds it so for
    good, the worker having died in that moment) still reports what every other worker counted."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from decisiond.server.metrics import WorkerFiles

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(mmap_key("decisiond_seen", "decisiond_seen_total", [], [], "Seen"), 3.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # a worker's file, not yet sized
    registry = CollectorRegistry()
    WorkerFiles(registry, path=str(tmp_path))
    assert "decisiond_seen_total 3.0" in generate_latest(registry).decode()
