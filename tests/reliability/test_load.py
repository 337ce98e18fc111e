"""A bounded load test of the local engine: 16 clients for 30 s over every route, the official SDKs among them,
one client sending a 50-question request on a long document over and over. Every answer must arrive and equal the
answer the same request got alone; small requests must keep being answered while the large one is in flight."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from servers import start_decisiond
from typesafe_sdk import Noul, RetryPolicy, TypeSafeClient

DURATION_S = float(os.environ.get("DECISIOND_LOAD_SECONDS", "30"))
CLIENTS = 16
TOLERANCE = 1e-4  # batch composition changes float rounding, never the answer

TICKETS = [
    "I was charged twice for my subscription this month.",
    "The export to CSV fails with an error since yesterday.",
    "Can I get a refund for the unused part of my plan?",
    "Our whole team is locked out after the password reset.",
    "Please update the billing address on our invoices.",
]
DOCUMENT = " ".join(f"Entry {i}: the customer reports a double charge and a failing export." for i in range(18))


CONFIG = """
providers:
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-load}
cache: {enabled: false}
"""


@pytest.fixture(scope="module")
def loaded_server(tiny_dir, tmp_path_factory):
    # No response cache and no prefix cache: every request is computed, so the load is real. The default queue
    # bound; back-pressure itself is tested in test_engine_admission.py.
    config = tmp_path_factory.mktemp("load") / "gateway.yaml"
    config.write_text(CONFIG)
    running = start_decisiond("--config", str(config), "--prefix-cache-mb", "0", env={"TINY_DIR": tiny_dir})
    yield running
    running.stop()


def openai_call(client: openai.OpenAI, text: str) -> list[float]:
    r = client.decisions.create(model="tiny-load", input=text, questions=[
        {"type": "predicate", "name": "urgent", "instructions": "Is it urgent?"},
        {"type": "choice", "name": "team", "instructions": "Which team?",
         "choices": [{"value": "billing"}, {"value": "technical"}]}])
    urgent, team = r.answers
    return [urgent.probability, *(p.probability for p in team.probabilities)]


def systemone_call(client: TypeSafeClient, text: str) -> list[float]:
    r = client.system_one(text, {"urgent": Noul(instructions="Is it urgent?")}, model="tiny-load")
    return [r.nouls["urgent"].noul]


def retrying_post(http: httpx.Client, path: str, body: dict) -> dict:
    """A raw client that honours back-pressure as the SDKs do."""
    for _ in range(20):
        r = http.post(path, json=body)
        if r.status_code == 503:
            assert "retry-after-ms" in r.headers
            time.sleep(int(r.headers["retry-after-ms"]) / 1000)
            continue
        assert r.status_code == 200, r.text
        return r.json()
    raise AssertionError(f"{path} stayed overloaded")


def sglang_call(http: httpx.Client, text: str) -> list[float]:
    body = retrying_post(http, "/v1/decisions", {"model": "tiny-load", "input": text, "questions": [
        {"id": "urgent", "type": "yes_no", "question": "Is it urgent?"}]})
    return [body["answers"]["urgent"]["probabilities"]["yes"]]


def score_call(http: httpx.Client, text: str) -> list[float]:
    body = retrying_post(http, "/v1/score", {"model": "tiny-load", "query": text, "items": [" yes", " no"],
                                             "label_token_ids": [5, 6], "apply_softmax": True})
    return [s for item in body["scores"] for s in item]


LARGE_QUESTIONS = [{"id": f"q{i}", "type": "yes_no", "question": f"Does entry {i} mention a double charge?"}
                   for i in range(50)]


def large_call(http: httpx.Client, text: str) -> list[float]:
    body = retrying_post(http, "/v1/decisions", {"model": "tiny-load", "input": text,
                                                 "questions": LARGE_QUESTIONS})
    return [body["answers"][q["id"]]["probabilities"]["yes"] for q in LARGE_QUESTIONS]


@dataclass
class Log:
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # kind, start, end
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def test_sixteen_clients_lose_no_answer_and_small_ones_keep_answering(loaded_server):
    url = loaded_server.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=6)
    ts = TypeSafeClient(base_url=url, api_key="unused", retry=RetryPolicy(max_retries=6))
    http = httpx.Client(base_url=url, timeout=120)
    kinds = {
        "openai": lambda t: openai_call(oai, t),
        "systemone": lambda t: systemone_call(ts, t),
        "sglang": lambda t: sglang_call(http, t),
        "score": lambda t: score_call(http, t),
        "large": lambda t: large_call(http, t),
    }
    # What each request answers alone, before the load.
    expected = {(kind, t): call(t) for kind, call in kinds.items() if kind != "large" for t in TICKETS}
    expected[("large", DOCUMENT)] = large_call(http, DOCUMENT)

    roles = ["large"] + ["openai"] * 5 + ["systemone"] * 4 + ["sglang"] * 3 + ["score"] * 3
    assert len(roles) == CLIENTS
    log = Log()
    stop = time.monotonic() + DURATION_S

    def client(kind: str, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            text = DOCUMENT if kind == "large" else rng.choice(TICKETS)
            start = time.monotonic()
            try:
                got = kinds[kind](text)
            except Exception as error:  # a lost answer
                with log.lock:
                    log.errors.append(f"{kind}: {type(error).__name__}: {error}")
                continue
            end = time.monotonic()
            want = expected[(kind, text)]
            with log.lock:
                log.calls.append((kind, start, end))
                if len(got) != len(want) or any(abs(a - b) > TOLERANCE for a, b in zip(got, want)):
                    log.wrong.append(f"{kind}: {got} != {want}")

    threads = [threading.Thread(target=client, args=(kind, i)) for i, kind in enumerate(roles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION_S + 300)
    oai.close(), ts.close()
    metrics = http.get("/metrics").text
    http.close()

    assert not log.errors, log.errors[:5]
    assert not log.wrong, log.wrong[:5]
    large = [(s, e) for kind, s, e in log.calls if kind == "large"]
    small = [(s, e) for kind, s, e in log.calls if kind != "large"]
    assert large and len(small) > 10 * len(large)
    # Small requests were answered while a large one was in flight (started after it and finished before it).
    inside = sum(1 for s, e in small for ls, le in large if ls < s and e < le)
    assert inside >= len(large), f"{inside} small answers inside {len(large)} large requests"
    assert "decisiond_engine_queued_tokens" in metrics
    joined = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("decisiond_engine_joined_jobs_total"))
    print(f"load: {len(large)} large, {len(small)} small answered; {inside} small inside large ones; "
          f"{joined:.0f} joined an identical request in flight")
