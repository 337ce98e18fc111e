"""Chat traffic through the gateway as ordinary traffic: failover across a virtual model's targets until the client's
first byte, timeouts of its own (connect, first byte, between chunks; no overall cap but the client's), the client's
``x-decisiond-timeout-ms`` over the whole exchange, and the Responses API the same — with the official ``openai``
client against real HTTP upstreams that fail (500, 400), hang, answer slowly, or break off mid-stream."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import upstreams
from servers import start_decisiond

MASTER = "chat-failover-master-0123456789"

CONFIG = """
auth:
  master_key: "${TEST_MASTER}"
database_url: "sqlite:///${DB_DIR}/chat.sqlite3"
providers:
  - {name: up, type: openai, base_url: "${CHAT}/v1", chat: {first_byte_timeout_s: 2, idle_timeout_s: 2}}
  - {name: patient, type: openai, base_url: "${CHAT}/v1"}
  - {name: dec, type: openai, base_url: "${CHAT}/v1"}
models:
  - {name: chat-ok, provider: up, upstream: ok, capabilities: [chat]}
  - {name: chat-500, provider: up, upstream: e500, capabilities: [chat]}
  - {name: chat-400, provider: up, upstream: e400, capabilities: [chat]}
  - {name: chat-hang, provider: up, upstream: hang, capabilities: [chat]}
  - {name: chat-cut, provider: up, upstream: cut, capabilities: [chat]}
  - {name: chat-pause, provider: up, upstream: pause, capabilities: [chat]}
  - {name: chat-slow, provider: patient, upstream: slow, capabilities: [chat]}
  - {name: chat-hang-long, provider: patient, upstream: hang, capabilities: [chat]}
  - {name: decider, provider: dec, upstream: ok}
virtual_models:
  - {name: after-500, targets: [chat-500, chat-ok]}
  - {name: after-400, targets: [chat-400, chat-ok]}
  - {name: after-hang, targets: [chat-hang, chat-ok]}
  - {name: after-cut, targets: [chat-cut, chat-ok]}
  - {name: skip-decider, targets: [decider, chat-ok]}
"""


@pytest.fixture(scope="module")
def chat():
    upstream = upstreams.ChatUpstream(slow_s=7.0, pause_s=4.0)
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def gateway(chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-failover")
    config = folder / "gateway.yaml"
    config.write_text(CONFIG)
    server = start_decisiond("--config", str(config), env={"TEST_MASTER": MASTER, "CHAT": chat.url,
                                                             "DB_DIR": str(folder)})
    yield server
    server.stop()


def client(gateway, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=MASTER, max_retries=0, timeout=timeout)


MESSAGES = [{"role": "user", "content": "Say hello"}]


def row(gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rows = httpx.get(gateway.url + "/admin/audit", headers={"Authorization": f"Bearer {MASTER}"},
                         params={"limit": 1000}).json()["data"]
        found = [r for r in rows if r["request_id"] == request_id]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no usage row for {request_id}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_500_fails_over_to_the_next_target_plain_and_streamed(gateway, stream):
    with client(gateway).chat.completions.with_streaming_response.create(model="after-500", messages=MESSAGES,
                                                                          stream=stream) as raw:
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        else:
            text = raw.parse().choices[0].message.content
    assert text == "Hello"
    record = row(gateway, raw.headers["x-request-id"])
    assert record["status"] == 200 and record["attempts"] == 2 and record["targets"] == ["chat-500", "chat-ok"]
    assert (record["provider"], record["model"]) == ("up", "chat-ok") and record["output_tokens"] == 3


def test_a_4xx_other_than_429_does_not_fail_over(gateway, chat):
    before = len(chat.seen)
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway).chat.completions.create(model="after-400", messages=MESSAGES)
    assert "upstream says e400" in e.value.message
    assert [s["body"]["model"] for s in chat.seen[before:]] == ["e400"]


def test_a_hanging_target_is_left_after_its_first_byte_timeout(gateway):
    started = time.monotonic()
    answer = client(gateway).chat.completions.create(model="after-hang", messages=MESSAGES)
    assert answer.choices[0].message.content == "Hello" and 1.5 < time.monotonic() - started < 10


def test_a_slow_completion_is_not_cut_off(gateway):
    """Seven seconds for a non-streamed answer: well past the 4 s decisions allow, inside chat's own timeouts."""
    started = time.monotonic()
    answer = client(gateway).chat.completions.create(model="chat-slow", messages=MESSAGES)
    assert answer.choices[0].message.content == "Hello" and time.monotonic() - started >= 6.5


@pytest.mark.parametrize("route", ["chat/completions", "responses"])
def test_the_clients_deadline_bounds_the_exchange_and_cancels_the_upstream_call(gateway, chat, route):
    chat.cancelled.clear()
    body = {"model": "chat-hang-long", "messages": MESSAGES} if route == "chat/completions" else \
        {"model": "chat-hang-long", "input": "Say hello"}
    started = time.monotonic()
    answer = httpx.post(f"{gateway.url}/v1/{route}", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {MASTER}", "x-decisiond-timeout-ms": "1500"})
    took = time.monotonic() - started
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "deadline_exceeded", answer.text
    assert 1.4 < took < 3.5
    assert chat.cancelled.wait(5)  # the upstream saw its request abandoned


def test_a_stream_that_breaks_off_ends_with_an_error_event_and_its_row_counts_what_was_relayed(gateway):
    with client(gateway).chat.completions.with_streaming_response.create(model="after-cut", messages=MESSAGES,
                                                                          stream=True) as raw:
        stream = raw.parse()
        chunks = []
        with pytest.raises(openai.APIError) as e:
            for chunk in stream:
                chunks.append(chunk)
    # Started on the first target: no failover once the client has bytes; the error closes the stream.
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hel"
    assert "broke off" in str(e.value)
    record = row(gateway, raw.headers["x-request-id"])
    assert record["targets"] == ["chat-cut"] and record["error_code"] == "upstream_unavailable"
    assert record["estimated"] and record["output_tokens"] == 1  # "Hel": 3 characters, at 4 a token


def test_a_silence_mid_stream_past_the_idle_timeout_ends_the_stream(gateway):
    started = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for _ in client(gateway).chat.completions.create(model="chat-pause", messages=MESSAGES, stream=True):
            pass
    assert "sent nothing for 2 s" in str(e.value) and time.monotonic() - started < 4


def test_targets_without_chat_are_skipped_without_an_attempt(gateway):
    raw = client(gateway).chat.completions.with_raw_response.create(model="skip-decider", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "Hello"
    record = row(gateway, raw.headers["x-request-id"])
    assert record["attempts"] == 1 and record["targets"] == ["chat-ok"]


def test_responses_fail_over_plain_and_streamed(gateway):
    oa = client(gateway)
    raw = oa.responses.with_raw_response.create(model="after-500", input="Say hello")
    assert raw.parse().output_text == "Hello"
    assert row(gateway, raw.headers["x-request-id"])["targets"] == ["chat-500", "chat-ok"]
    with oa.responses.with_streaming_response.create(model="after-hang", input="Say hello", stream=True) as streamed:
        events = list(streamed.parse())
    assert [e.type for e in events][-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    record = row(gateway, streamed.headers["x-request-id"])
    assert record["targets"] == ["chat-hang", "chat-ok"] and record["output_tokens"] == 3
    assert record["request_type"] == "responses" and not record["estimated"]


def test_a_responses_stream_that_breaks_off_ends_with_an_error_event(gateway):
    with httpx.stream("POST", gateway.url + "/v1/responses", timeout=30,
                      headers={"Authorization": f"Bearer {MASTER}"},
                      json={"model": "chat-cut", "input": "Say hello", "stream": True}) as response:
        body = b"".join(response.iter_bytes())
    assert response.status_code == 200
    assert body.rstrip().split(b"\n\n")[-1].startswith(b"event: error\ndata: ")
    assert b'"code": "upstream_unavailable"' in body
