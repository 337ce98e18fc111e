"""The gateway end to end: a decisiond started with a YAML config in front of real loopback servers that follow
each provider's wire format — and of another decisiond as a System One upstream — called with the official
openai and typesafe SDKs."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import struct
import zlib

import httpx
import openai
import pytest
import upstreams
from servers import start_decisiond
from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeBadRequestError, TypeSafeClient


def png_data_url() -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + b"\x00\xff\x00" * 2 for _ in range(2))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


CONFIG = """
allow_raw_upstreams: true  # these tests name upstream models as <provider>/<upstream>
providers:
  - {name: openai, type: openai, base_url: "${UP_OPENAI}/v1", api_key: "${OPENAI_KEY}", timeout: 10}
  - {name: azure, type: azure, base_url: "${UP_AZURE}", api_key: azkey, api_version: "2026-06-01"}
  - {name: jev, type: systemone, base_url: "${UP_JEV}", api_key: tskey, images: true}
  - {name: kev, type: systemone, base_url: "${UP_KEV}", api_key: "${KEV_KEY:-unused}"}
  - {name: partial, type: systemone, base_url: "${UP_PARTIAL}"}
  - {name: e529, type: openai, base_url: "${UP_529}/v1"}
  - {name: e429, type: openai, base_url: "${UP_429}/v1"}
  - {name: e400, type: openai, base_url: "${UP_400}/v1"}
  - {name: hang, type: openai, base_url: "${UP_HANG}/v1", timeout: 1}
  - {name: drop, type: openai, base_url: "${UP_DROP}/v1"}
  - {name: garbage, type: openai, base_url: "${UP_GARBAGE}/v1"}
  - {name: local, type: local, model: "${TINY_DIR}", served_model_name: tiny-local}
models:
  - {name: gpt-chat, provider: openai, upstream: gpt-6, capabilities: [chat]}
  - {name: luna, provider: openai, upstream: gpt-6-luna}
virtual_models:
  - {name: resilient, strategy: failover, targets: [e529/x, e429/x, hang/x, drop/x, openai/gpt-6-luna]}
  - {name: strict-chain, targets: [e400/x, openai/gpt-6-luna]}
  - {name: vision, targets: [kev/kev-latest, openai/gpt-6-luna]}
  - {name: chatty, targets: [gpt-chat, luna]}
  - {name: nested, targets: [vision]}
  - {name: kev-alias, strategy: alias, targets: [kev/kev-latest]}
  - {name: sturdy, targets: [garbage/x, luna]}
"""


@pytest.fixture(scope="module")
def ups():
    servers = {
        "openai": upstreams.openai_server(),
        "azure": upstreams.azure_server("my-deployment", "azkey", "2026-06-01"),
        "jev": upstreams.systemone_server(),
        "partial": upstreams.systemone_server("kev-9", skip=("b",)),
        "529": upstreams.status_server(529, {"error": {"message": "Overloaded", "type": "overloaded_error"}}),
        "429": upstreams.status_server(429, {"error": {"message": "Rate limit reached", "type": "rate_limit"}},
                                       {"retry-after": "7"}),
        "400": upstreams.status_server(400, {"error": {"message": "Invalid value: " + "x" * 900, "param": "input"}}),
        "hang": upstreams.hanging_server(30),
        "drop": upstreams.dropping_server(),
        "garbage": upstreams.status_server(200, {"answers": "not a list", "usage": "none"}),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def gateway(ups, tiny_server, tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    path.write_text(CONFIG)
    env = {f"UP_{k.upper()}": s.url for k, s in ups.items()}
    env.update(UP_KEV=tiny_server.url, OPENAI_KEY="sk-upstream", TINY_DIR=tiny_dir)
    running = start_decisiond("--config", str(path), env=env)
    yield running
    running.stop()


@pytest.fixture()
def oa(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


QUESTIONS = [
    {"type": "predicate", "name": "urgent", "instructions": "The customer needs an answer today."},
    {"type": "choice", "name": "team", "instructions": "Which team?",
     "choices": [{"value": "billing", "description": "Payments"}, {"value": True}, {"value": "sales"}]},
    {"type": "score", "instructions": "How angry?",
     "levels": [{"label": "calm"}, {"label": "annoyed", "description": "but polite"}, {"label": "furious"}]},
]


def test_openai_upstream_gets_the_request_as_sent_with_model_replaced(oa, ups):
    before = len(ups["openai"].seen)
    raw = oa.decisions.with_raw_response.create(
        model="openai/gpt-6-luna", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        questions=QUESTIONS, prompt_cache_key="tenant-1", safety_identifier="u1", extra_body={"metadata_x": 1})
    decision = raw.parse()
    assert raw.headers["x-decisiond-provider-format"] == "openai"
    seen = ups["openai"].seen[before]
    sent = seen.json()
    assert sent["model"] == "gpt-6-luna" and sent["questions"] == QUESTIONS
    assert sent["prompt_cache_key"] == "tenant-1" and sent["safety_identifier"] == "u1" and sent["metadata_x"] == 1
    assert sent["input"] == [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]
    assert seen.headers["authorization"] == "Bearer sk-upstream"
    assert decision.model == "gpt-6-luna"
    assert decision.answers[1].choice == "billing" and decision.answers[1].probabilities[1].value is True
    assert decision.usage.input_tokens_details.cached_tokens == 10


def test_azure_deployment_route_and_api_key(oa, ups):
    decision = oa.decisions.create(model="azure/my-deployment", input="x", questions=QUESTIONS[:1])
    seen = ups["azure"].seen[-1]
    assert seen.path == "/openai/deployments/my-deployment/decisions" and seen.headers["api-key"] == "azkey"
    assert "authorization" not in seen.headers and seen.json()["model"] == "my-deployment"
    assert decision.answers[0].probability == pytest.approx(0.7)


def test_decisiond_as_system_one_upstream_translates_both_ways(oa, tiny_server):
    via = oa.decisions.with_raw_response.create(model="kev/kev-latest", input="The export keeps failing.",
                                                questions=QUESTIONS)
    assert via.headers["x-decisiond-provider-format"] == "system_one"
    via = via.parse()
    # The same question asked of the upstream directly, in OpenAI's shape (level descriptions joined as the
    # System One translation sends them).
    direct_questions = json.loads(json.dumps(QUESTIONS))
    direct_questions[2]["levels"][1] = {"label": "annoyed - but polite"}
    direct_questions[1]["choices"][1] = {"value": "true"}
    direct = httpx.post(tiny_server.url + "/v1/decisions", json={
        "model": "default", "input": "The export keeps failing.", "questions": direct_questions}).json()
    assert via.answers[0].probability == pytest.approx(direct["answers"][0]["probability"], abs=1e-6)
    got = [p.probability for p in via.answers[1].probabilities]
    want = [p["probability"] for p in direct["answers"][1]["probabilities"]]
    assert got == pytest.approx(want, abs=1e-6)
    assert [p.value for p in via.answers[1].probabilities] == ["billing", True, "sales"]  # typed values restored
    assert via.answers[2].name is None  # unnamed: sent as question_2, mapped back by position
    assert [p.probability for p in via.answers[2].probabilities] == pytest.approx(
        [p["probability"] for p in direct["answers"][2]["probabilities"]], abs=1e-6)
    assert via.usage.input_tokens == direct["usage"]["input_tokens"]


def test_missing_system_one_answer_becomes_a_refusal(oa):
    decision = oa.decisions.create(model="partial/kev", input="x", questions=[
        {"type": "predicate", "name": "a", "instructions": "?"},
        {"type": "predicate", "name": "b", "instructions": "?"}])
    assert decision.answers[0].type == "predicate" and decision.answers[1].type == "refusal"
    assert decision.answers[1].name == "b"


def test_boolean_and_string_choice_clash_is_refused_for_system_one(oa):
    with pytest.raises(openai.BadRequestError, match="same System One criteria name") as e:
        oa.decisions.create(model="kev/kev-latest", input="x", questions=[
            {"type": "choice", "instructions": "?", "choices": [{"value": True}, {"value": "true"}]}])
    assert e.value.param == "questions[0].choices[1]"


def test_images_go_to_hosted_jev_as_assets(oa, ups):
    image = png_data_url()
    oa.decisions.create(model="jev/jev-latest", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Is this product damaged?"},
        {"type": "input_image", "image_url": image}]}], questions=QUESTIONS[:1])
    seen = ups["jev"].seen[-1]
    assert seen.headers["typesafe-danger-zone-images"] == "true"
    assert seen.headers["authorization"] == "Bearer tskey"
    request, files = upstreams.multipart_request(seen)
    (key, asset), = request["assets"].items()
    assert asset == {"type": "image", "part": "asset-0"} and key in request["state"]
    assert request["state"].startswith("Is this product damaged?\n\n<image:")
    assert files["asset-0"][0] == base64.b64decode(image.split(",")[1]) and files["asset-0"][1] == "image/png"


def test_image_refusals(oa, ups):
    with pytest.raises(openai.BadRequestError, match="does not fetch links") as e:
        oa.decisions.create(model="jev/jev-latest", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/p.jpg"}]}], questions=QUESTIONS[:1])
    assert e.value.param == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError, match="reads text only") as e:
        oa.decisions.create(model="kev/kev-latest", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": png_data_url()}]}], questions=QUESTIONS[:1])
    assert e.value.code == "unsupported_input"


def test_failover_chain_skips_the_text_only_target_for_images(oa, ups, tiny_server):
    kev_before = ups["openai"].seen[:]
    decision = oa.decisions.create(model="nested", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "photo"}, {"type": "input_image", "image_url": png_data_url()}]}],
        questions=QUESTIONS[:1])
    assert decision.model == "gpt-6-luna" and len(ups["openai"].seen) == len(kev_before) + 1
    text_only = oa.decisions.create(model="vision", input="no image here", questions=QUESTIONS[:1])
    assert text_only.model == "tiny-modes"  # the first target, kev (the tiny decisiond), answered


def test_failover_over_529_429_hang_and_drop_loses_no_request(oa, ups):
    counts = {k: len(ups[k].seen) for k in ("529", "429", "hang", "drop", "openai")}

    def ask(i: int):
        return oa.decisions.create(model="resilient", input=f"ticket {i}", questions=QUESTIONS[:1])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(12)))
    assert all(r.model == "gpt-6-luna" and r.answers[0].probability == pytest.approx(0.7) for r in results)
    for k in ("529", "429", "hang", "drop", "openai"):
        assert len(ups[k].seen) - counts[k] == 12, k  # every target tried once per request, in order


def test_validation_error_ends_the_chain_with_the_providers_status_and_message(oa, ups):
    before = len(ups["openai"].seen)
    with pytest.raises(openai.BadRequestError) as e:
        oa.decisions.create(model="strict-chain", input="x", questions=QUESTIONS[:1])
    assert len(ups["openai"].seen) == before  # no failover on a 4xx validation error
    assert e.value.message.startswith("Error code: 400 - Invalid value: xxx")
    assert len(e.value.body["message"]) == 512


def test_direct_429_keeps_status_and_retry_after(oa, gateway):
    with pytest.raises(openai.RateLimitError) as e:
        oa.decisions.create(model="e429/x", input="x", questions=QUESTIONS[:1])
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "7"
    assert "Rate limit reached" in e.value.message
    r = httpx.post(gateway.url + "/v1/decisions", json={"model": "e529/x", "input": "x", "questions": QUESTIONS[:1]})
    assert r.status_code == 529 and r.json()["error"]["message"] == "Overloaded"
    r = httpx.post(gateway.url + "/v1/decisions", json={"model": "hang/x", "input": "x", "questions": QUESTIONS[:1]},
                   timeout=30)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]


def test_a_malformed_upstream_answer_is_a_502_that_fails_over(oa, gateway):
    r = httpx.post(gateway.url + "/v1/decisions", json={"model": "garbage/x", "input": "x", "questions": QUESTIONS[:1]})
    assert r.status_code == 502 and "garbage" in r.json()["error"]["message"]
    assert oa.decisions.create(model="sturdy", input="x", questions=QUESTIONS[:1]).model == "gpt-6-luna"
    assert oa.decisions.with_raw_response.create(model="kev-alias", input="x", questions=QUESTIONS[:1]).headers[
        "x-decisiond-provider-format"] == "system_one"


def test_models_without_a_decisions_api_are_skipped_or_refused(oa, ups):
    assert oa.decisions.create(model="chatty", input="x", questions=QUESTIONS[:1]).model == "gpt-6-luna"
    with pytest.raises(openai.BadRequestError, match="has no Decisions API") as e:
        oa.decisions.create(model="gpt-chat", input="x", questions=QUESTIONS[:1])
    assert e.value.code == "model_not_supported"


def test_limits(oa):
    levels = [{"label": f"level {i}"} for i in range(12)]
    with pytest.raises(openai.BadRequestError, match="at most 10 levels") as e:
        oa.decisions.create(model="kev/kev-latest", input="x",
                            questions=[{"type": "score", "instructions": "?", "levels": levels}])
    assert e.value.code == "limit_exceeded" and "kev" in e.value.message
    # OpenAI has no level limit: the same request goes through to OpenAI.
    ok = oa.decisions.create(model="luna", input="x", questions=[{"type": "score", "instructions": "?", "levels": levels}])
    assert len(ok.answers[0].probabilities) == 12
    # 25K tokens of input: each question fits TypeSafe's 32K, but three of them (the input counted once per
    # question) exceed its 64K per request.
    with pytest.raises(openai.BadRequestError, match="at most 65536 tokens per request") as e:
        oa.decisions.create(model="jev/jev-latest", input="word " * 20000, questions=QUESTIONS)
    assert e.value.code == "limit_exceeded"
    with pytest.raises(openai.BadRequestError, match="at most 32768 tokens per question"):
        oa.decisions.create(model="jev/jev-latest", input="word " * 30000, questions=QUESTIONS[:1])


def test_typesafe_sdk_reaches_an_openai_provider(gateway, ups):
    with TypeSafeClient(base_url=gateway.url, api_key="unused", retry=RetryPolicy(max_retries=0), timeout=60) as ts:
        result = ts.system_one("I was charged twice.", {
            "billing": Noul(instructions="Is this about billing?"),
            "tone": Choice(instructions="Tone?", criteria={"angry": "Upset", "calm": None}),
            "urgency": Score(instructions="How urgent?", criteria=["low", "high"]),
        }, model="luna")
        assert result.raw_http_response.headers["x-decisiond-provider-format"] == "openai"
        sent = ups["openai"].seen[-1].json()
        assert sent["input"] == "I was charged twice."
        assert [q["name"] for q in sent["questions"]] == ["billing", "tone", "urgency"]
        assert sent["questions"][1]["choices"] == [{"value": "angry", "description": "Upset"}, {"value": "calm"}]
        assert result.nouls["billing"].noul == pytest.approx(0.7)
        assert result.choices["tone"].choice == "angry"
        assert result.scores["urgency"].probabilities[0] == pytest.approx(0.6)
        assert result.model == "gpt-6-luna"
        # Any other name answers from the default (local) model, as System One servers accept any name.
        local = ts.system_one("x", {"q": Noul(instructions="?")}, model="jev-latest")
        assert local.model == "tiny-local"
        assert local.raw_http_response.headers["x-decisiond-provider-format"] == "local"
        # A System One request to a System One upstream: the gateway's own limits, then the provider's answer.
        relayed = ts.system_one("x", {"q": Noul(instructions="?")}, model="jev/jev-latest")
        assert relayed.model == "jev-1.14.0" and relayed.nouls["q"].noul == pytest.approx(0.8)
        gif = base64.b64encode(b"GIF89a" + bytes(20)).decode()
        with pytest.raises(TypeSafeBadRequestError, match="only PNG and JPEG"):
            ts.system_one({"photo": "IMG"}, {"q": Noul(instructions="?")}, model="jev/jev-latest",
                          extra_body={"assets": {"IMG": {"type": "image", "format": "png", "data_base64": gif}}})


def test_models_list_with_capabilities(gateway):
    listed = httpx.get(gateway.url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in listed}
    assert by_id["gpt-chat"]["capabilities"] == ["chat"] and by_id["luna"]["capabilities"] == ["decisions"]
    # One entry per model: the local model under its served name (local/tiny-local is another spelling of it).
    assert "resilient" in by_id and "tiny-local" in by_id and "local/tiny-local" not in by_id
    decisions = {m["id"] for m in httpx.get(gateway.url + "/v1/models", params={"capability": "decisions"}).json()["data"]}
    assert "gpt-chat" not in decisions and {"luna", "resilient", "chatty"} <= decisions


def test_local_engine_extensions_are_refused_by_upstreams(oa):
    with pytest.raises(openai.BadRequestError, match="applied by decisiond's local engine") as e:
        oa.decisions.create(model="luna", input="x", questions=QUESTIONS[:1], extra_body={"temperature": 0.5})
    assert e.value.param == "temperature" and e.value.code == "unsupported_parameter"
    local = oa.decisions.create(model="tiny-local", input="x", questions=QUESTIONS[:1], extra_body={"temperature": 0.5})
    assert local.model == "tiny-local"


def test_unknown_model_on_the_openai_route(oa):
    with pytest.raises(openai.BadRequestError) as e:
        oa.decisions.create(model="nope/", input="x", questions=QUESTIONS[:1])
    assert e.value.code == "model_not_found" and e.value.param == "model"
