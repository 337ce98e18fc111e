"""The gateway never makes up an answer, never waits past its client, never echoes a secret, and never answers bad
input with a 500: decisiond in front of loopback upstreams that misbehave in the ways real ones do."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
import upstreams
from servers import run_decisiond, start_decisiond
from typesafe_sdk import Noul, RetryPolicy, TypeSafeClient

UPSTREAM_KEY = "sk-upstream-reliability-7f6e5d"

CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
providers:
  - {name: good, type: openai, base_url: "${GOOD}/v1", api_key: "${UP_KEY}"}
  - {name: s1good, type: systemone, base_url: "${S1GOOD}"}
  - {name: bare, type: systemone, base_url: "${BARE}"}
  - {name: wild, type: systemone, base_url: "${WILD}"}
  - {name: empty, type: systemone, base_url: "${EMPTY}"}
  - {name: oai_missing, type: openai, base_url: "${OAI_MISSING}/v1"}
  - {name: stray, type: openai, base_url: "${STRAY}/v1"}
  - {name: echo, type: openai, base_url: "${ECHO}/v1", api_key: "${UP_KEY}"}
  - {name: hang, type: openai, base_url: "${HANG}/v1"}
  - {name: vision, type: systemone, base_url: "${S1GOOD}", images: true}
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
  - {name: r429, type: openai, base_url: "${R429}/v1"}
  - {name: r529, type: systemone, base_url: "${R529}"}
  - {name: drop, type: openai, base_url: "${DROP}/v1"}
virtual_models:
  - {name: r429-then-good, targets: [r429/x, good/gpt-6-luna]}
  - {name: r529-then-good, targets: [r529/jev, good/gpt-6-luna]}
  - {name: drop-then-good, targets: [drop/x, good/gpt-6-luna]}
  - {name: wild-then-good, targets: [wild/jev, good/gpt-6-luna]}
  - {name: stray-then-good, targets: [stray/x, good/gpt-6-luna]}
  - {name: bare-then-good, targets: [bare/jev, good/gpt-6-luna]}
  - {name: hang-then-good, targets: [hang/x, good/gpt-6-luna]}
  - {name: vision-then-good, targets: [vision/jev, good/gpt-6-luna]}
"""

PNG_LINK = "https://example.com/p.png"


@pytest.fixture(scope="module")
def ups():
    servers = {
        "GOOD": upstreams.openai_server(),
        "S1GOOD": upstreams.systemone_server(),
        "BARE": upstreams.status_server(200, {"answers": {"team": {"type": "choice"}, "urgent": {"type": "noul"}}}),
        "WILD": upstreams.status_server(200, {"answers": {"urgent": {"type": "noul", "noul": 7.5}}}),
        "EMPTY": upstreams.status_server(200, {"answers": {}}),
        "OAI_MISSING": upstreams.status_server(200, {"answers": [{"type": "predicate", "name": "urgent"}]}),
        "STRAY": upstreams.status_server(200, {"answers": [{"type": "choice", "name": "team", "choice": "legal",
                                                            "probabilities": [{"value": "legal", "probability": 1.0}]}]}),
        "ECHO": upstreams.status_server(401, {"error": {"message": f"Invalid API key provided: Bearer {UPSTREAM_KEY}"}}),
        "HANG": upstreams.hanging_server(20),
        "R429": upstreams.status_server(429, {"error": {"message": "slow down", "type": "rate_limit_error"}},
                                        {"retry-after": "1"}),
        "R529": upstreams.status_server(529, {"detail": "overloaded"}),
        "DROP": upstreams.dropping_server(),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def gateway(ups, tiny_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("reliability") / "gateway.yaml"
    config.write_text(CONFIG)
    env = {name: up.url for name, up in ups.items()}
    running = start_decisiond("--config", str(config), "--body-read-timeout", "1",
                              env={**env, "UP_KEY": UPSTREAM_KEY, "TINY_DIR": tiny_dir})
    yield running
    running.stop()


def oai(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


URGENT = {"type": "predicate", "name": "urgent", "instructions": "Is it urgent?"}
TEAM = {"type": "choice", "name": "team", "instructions": "Which team?", "choices": [{"value": "billing"},
                                                                                   {"value": "sales"}]}


@pytest.mark.parametrize("model, questions, what", [
    ("bare/jev", [TEAM, URGENT], "has no probabilities object"),
    ("wild/jev", [URGENT], "outside [0, 1]"),
    ("oai_missing/x", [URGENT], "probability is None"),
    ("stray/x", [TEAM], "not one of its choices"),
])
def test_a_malformed_answer_is_a_502_never_a_made_up_answer(gateway, model, questions, what):
    with pytest.raises(openai.InternalServerError) as e:
        oai(gateway).decisions.create(model=model, input="I was charged twice.", questions=questions)
    assert e.value.status_code == 502 and e.value.code == "upstream_invalid_response"
    assert what in e.value.message


def test_a_malformed_answer_fails_over_to_the_next_target(gateway, ups):
    before = len(ups["GOOD"].seen)
    decision = oai(gateway).decisions.create(model="bare-then-good", input="x", questions=[TEAM, URGENT])
    assert decision.answers[1].probability == pytest.approx(0.7) and len(ups["GOOD"].seen) == before + 1


def test_unanswered_questions_reach_sglang_clients_as_an_error_not_a_500(gateway):
    r = httpx.post(gateway.url + "/v1/decisions", json={"model": "empty/jev", "input": "x", "questions": [
        {"id": "urgent", "type": "yes_no", "question": "Is it urgent?"}]}, timeout=30)
    assert r.status_code == 502 and r.json()["object"] == "error" and "urgent" in r.json()["message"]


def test_a_hanging_first_target_leaves_time_for_the_next_within_the_sdk_timeout(gateway, ups):
    with TypeSafeClient(base_url=gateway.url, api_key="unused", retry=RetryPolicy(max_retries=0)) as ts:
        start = time.monotonic()
        result = ts.system_one("I was charged twice.", {"urgent": Noul(instructions="Is it urgent?")},
                               model="hang-then-good")
        took = time.monotonic() - start
    assert result.nouls["urgent"].noul == pytest.approx(0.7) and took < 10


def test_upstream_error_text_is_scrubbed_of_credentials(gateway):
    with pytest.raises(openai.AuthenticationError) as e:
        oai(gateway).decisions.create(model="echo/x", input="x", questions=[URGENT])
    assert UPSTREAM_KEY not in json.dumps(e.value.body) and "[redacted]" in e.value.message
    assert UPSTREAM_KEY not in gateway.log()


def test_an_image_link_skips_a_system_one_target_without_spending_an_attempt(gateway, ups):
    before = len(ups["S1GOOD"].seen), len(ups["GOOD"].seen)
    decision = oai(gateway).decisions.create(model="vision-then-good", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": PNG_LINK}]}],
        questions=[URGENT])
    assert decision.model == "gpt-6-luna"
    assert (len(ups["S1GOOD"].seen), len(ups["GOOD"].seen)) == (before[0], before[1] + 1)


DEEP = b'{"input": "x", "questions": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
SURROGATE = b'{"model": "tiny-local", "input": "x", "questions": [{"type": "predicate", "name": "bi\\udfffing", ' \
            b'"instructions": "?"}]}'


@pytest.mark.parametrize("path", ["/v1/decisions", "/v1/systemone", "/v1/score"])
@pytest.mark.parametrize("body, what", [(DEEP, "nests deeper"), (SURROGATE, "surrogate")], ids=["deep", "surrogate"])
def test_hostile_json_is_a_4xx_on_every_route(gateway, path, body, what):
    r = httpx.post(gateway.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500 and what in r.text


def test_a_stalled_body_is_cut_off(gateway):
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/decisions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"input\": ")
        start = time.monotonic()
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and time.monotonic() - start < 5


def test_no_decision_model_configured_is_a_404(tmp_path):
    from decisiond.gateway.config import parse
    from decisiond.gateway.router import Router

    router = Router.from_config(parse({"providers": [{"name": "o", "type": "openai", "base_url": "http://x"}],
                                       "models": [{"name": "chat", "provider": "o", "capabilities": ["chat"]}]}), {})
    from decisiond.errors import DecisionError

    for name in ("chat", "anything"):
        with pytest.raises(DecisionError) as e:
            router.catalog.resolve_name(name, strict=True)
        assert e.value.status == 404 and e.value.code == "model_not_found"


def test_a_virtual_model_naming_a_missing_local_model_is_refused_at_start(tiny_dir, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(f"""
providers:
  - {{name: local, type: local, model: "{tiny_dir}", served_model_name: tiny-local}}
virtual_models:
  - {{name: typo, targets: [local/tiny-lokal]}}
""")
    done = run_decisiond("serve", "--config", str(config), "--port", "1", timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert done.returncode == 2 and "local/tiny-lokal" in done.stderr


# Models whose answers, when they come, can only be the good upstream's; and those that can never answer.
RECOVERING = ["bare-then-good", "r429-then-good", "r529-then-good", "drop-then-good", "wild-then-good",
              "stray-then-good", "hang-then-good", "good/gpt-6-luna"]
NEVER = ["bare/jev", "wild/jev", "stray/x", "oai_missing/x", "empty/jev", "r429/x", "r529/jev", "drop/x"]
# First targets that are System One upstreams answering no question (EMPTY), or only "urgent" (WILD, with a value
# outside [0, 1]: a 502, so a chain fails over). A question they leave unanswered is a refusal on OpenAI's wire (the
# translation the product documents): a reply, not a failure, so wild-then-good answers "team" alone with one.
UNANSWERED = {"empty/jev", "wild/jev", "wild-then-good"}


def test_under_load_over_misbehaving_upstreams_no_answer_is_made_up(gateway):
    """8 clients for 20 s over upstreams that hang, reset, 429, 529 and send malformed 200s: a chain with a good
    target always answers, with exactly the good upstream's answer; a model that cannot answer gets an error in
    OpenAI's shape with a failover status, never a 200."""
    import random
    import threading

    questions = [TEAM, URGENT]
    expected = [{"type": "choice", "choice": "billing", "p": [0.6, 0.4]}, {"type": "predicate", "p": 0.7}]
    stop = time.monotonic() + 20
    made_up: list[str] = []
    counts = {"ok": 0, "refused": 0}
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            while time.monotonic() < stop:
                model = rng.choice(RECOVERING + NEVER)
                asked = rng.sample(questions, rng.randint(1, 2))
                if model == "hang-then-good" and rng.random() < 0.7:
                    continue  # each costs 4 s of waiting: a few are enough
                r = http.post("/v1/decisions", json={"model": model, "input": "I was charged twice.",
                                                     "questions": asked})
                with lock:
                    if r.status_code == 200:
                        counts["ok"] += 1
                        answers = r.json()["answers"]
                        want = [expected[questions.index(q)] for q in asked]
                        try:
                            got = [{"type": a["type"], "choice": a["choice"],
                                    "p": [p["probability"] for p in a["probabilities"]]} if a["type"] == "choice"
                                   else {"type": a["type"], "p": a["probability"]} for a in answers]
                        except (KeyError, TypeError):  # a 200 that is not a well-formed answer
                            got = None
                        # A System One upstream that leaves a question unanswered: OpenAI's wire says so with a
                        # refusal for it (the documented translation), which makes nothing up.
                        refused = [{"type": "refusal", "name": q["name"]} for q in asked]
                        if model in UNANSWERED and answers == refused:
                            continue
                        if model in NEVER or got != want:
                            made_up.append(f"{model}: {answers}")
                    else:
                        counts["refused"] += 1
                        error = r.json().get("error", {})
                        if model in RECOVERING or r.status_code not in (429, 502, 503, 504, 529) or \
                                not error.get("message"):  # a lost answer, or an error that is not one
                            made_up.append(f"{model}: {r.status_code} {r.text[:200]}")

    def guarded(seed: int) -> None:
        try:
            client(seed)
        except Exception as error:  # noqa: BLE001 - a client that dies must fail the test, not end quietly
            with lock:
                made_up.append(f"client {seed} died: {error!r}")

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not made_up, made_up[:5]
    assert counts["ok"] > 20 and counts["refused"] > 20  # both kinds exercised
