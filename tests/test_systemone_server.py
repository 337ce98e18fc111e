"""``POST /v1/systemone`` on the real server with the real model, driven by the official typesafe-sdk (zstd extra
installed, so bodies of 1 KiB or more arrive compressed; an attached image makes the body multipart)."""

from __future__ import annotations

import json
import math
import struct
import zlib

import httpx
import pytest
from typesafe_sdk import (
    Choice,
    Image,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeBadRequestError,
    TypeSafeClient,
    TypeSafeUnprocessableEntityError,
)

MODEL = "SmolLM2-135M-Instruct"
TICKET = "I've been trying to connect my Stripe account for 3 days and the integration keeps failing."


@pytest.fixture()
def client(server):
    with TypeSafeClient(base_url=server.url, api_key="unused", retry=RetryPolicy(max_retries=0), timeout=120) as c:
        yield c


def png_bytes(width: int = 4, height: int = 4) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def access_log(server, path="/v1/systemone"):
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("logger") == "decisiond.access" and e.get("path") == path]


def test_seed_example_three_types(client):
    result = client.system_one(
        TICKET,
        {
            "team": Choice(instructions="Which team should handle this ticket?",
                           criteria={"billing": None, "technical": "Bugs or integration problems", "sales": None}),
            "urgent": Noul(instructions="The customer needs an answer today."),
            "frustration": Score(instructions="How frustrated is the customer?",
                                 criteria=["Calm", "Frustrated but civil", "Very angry"]),
        },
    )
    assert result.model == MODEL
    assert set(result.answers) == {"team", "urgent", "frustration"}
    team = result.choices["team"]
    assert team.choice == max(team.probabilities, key=team.probabilities.get)
    assert math.fsum(team.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    assert team.confidence == pytest.approx(max(0.0, (3 * max(team.probabilities.values()) - 1) / 2))
    assert 0.0 <= result.nouls["urgent"].noul <= 1.0
    score = result.scores["frustration"]
    assert score.legend == {0: "Calm", 1: "Frustrated but civil", 2: "Very angry"}
    assert score.score == pytest.approx(sum(k * v for k, v in score.probabilities.items()))
    assert result.usage.output_tokens == 0 and result.usage.input_tokens > 100
    assert result.request_id.startswith("req_")
    raw = result.raw_http_response.json()
    assert all(0 < a["x_label_mass"] <= 1 for a in raw["answers"].values())


def test_same_numbers_as_openai_route_for_the_same_question(client, openai_client):
    s1 = client.system_one("The package arrived broken.", {"q": Noul(instructions="The customer wants a refund.")})
    oa = openai_client.decisions.create(model=MODEL, input="The package arrived broken.",
                                        questions=[{"type": "predicate", "instructions": "The customer wants a refund."}])
    # The second request continues the first one's cached prefix: equal up to float rounding.
    assert s1.nouls["q"].noul == pytest.approx(oa.answers[0].probability, abs=1e-5)
    # The state is counted once per question, as on the OpenAI route.
    assert s1.usage.input_tokens == oa.usage.input_tokens


def test_json_state_noul_from_criteria_and_question_without_instructions(client):
    result = client.system_one(
        {"subject": "Duplicate charge", "message": "Please help."},
        {
            "billing": Noul(criteria={"true": "Payments, charges, refunds", "false": None}),
            "tone": Choice(criteria={"angry": "An upset message", "calm": None}),
            "": Score(criteria=["low", {"level": "high"}]),
        },
    )
    assert set(result.answers) == {"billing", "tone", ""}
    assert result.scores[""].legend == {0: "low", 1: {"level": "high"}}


def test_forty_option_choice_with_a_large_compressed_body(client, server):
    options = {f"category {i:02d}": f"Tickets about topic number {i} and things close to it" for i in range(40)}
    result = client.system_one(TICKET * 3, {"category": Choice(instructions="Which category fits best?",
                                                                criteria=options)})
    answer = result.choices["category"]
    assert list(answer.probabilities) == list(options)
    assert math.fsum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    assert answer.choice in options
    last = access_log(server)[-1]
    assert last["content_encoding"] == "zstd" and last["status"] == 200  # the SDK compressed the ≥1 KiB body


def test_image_arrives_multipart_and_is_refused_by_a_text_only_model(client, server):
    photo = Image(png_bytes())
    with pytest.raises(TypeSafeBadRequestError) as e:
        client.system_one(photo, {"damaged": Noul(instructions="Is the product damaged?")})
    assert e.value.status == 400
    assert "reads text only" in str(e.value)
    assert e.value.body["error"]["loc"][:2] == ["body", "assets"]
    last = access_log(server)[-1]
    assert last["multipart"] is True and last["status"] == 400


def test_models_list_in_typesafe_shape(client, server):
    models = client.models.list()
    assert [m.name for m in models.models] == [MODEL]
    assert len(models.models[0].release_date) == 10 and models.models[0].description
    # Other callers keep OpenAI's list shape.
    assert httpx.get(server.url + "/v1/models").json()["object"] == "list"


def test_request_id_header_on_errors_too(client):
    with pytest.raises(TypeSafeUnprocessableEntityError) as e:
        client.system_one("x", {"q": {"type": "whatever", "foo": 1}})
    assert e.value.headers["x-typesafe-request-id"].startswith("req_")
    assert "request_id=req_" in str(e.value)


INVALID_422 = [
    # (questions, extra_body, expected loc)
    ({"q": {"type": "whatever", "foo": 1}}, None, ["body", "questions", "q"]),  # FastAPI: the tag error sits on the question
    ({"q": {"type": "score", "instructions": "?", "criteria": ["a"], "weight": 2}}, None,
     ["body", "questions", "q", "score", "weight"]),
    ({"q": {"type": "noul", "instructions": "  "}}, None, ["body", "questions", "q", "noul"]),
    ({"q": {"type": "noul", "criteria": {"true": "", "false": None}}}, None, ["body", "questions", "q", "noul"]),
    ({"q": {"type": "noul", "instructions": "?", "criteria": {"maybe": "x"}}}, None,
     ["body", "questions", "q", "noul", "criteria", "maybe"]),
    ({"q": {"type": "score", "instructions": "?", "criteria": [str(i) for i in range(11)]}}, None,
     ["body", "questions", "q", "score", "criteria"]),
    ({"q": {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(256)}}}, None,
     ["body", "questions", "q", "choice", "criteria"]),
    ({"q": {"type": "score", "instructions": "?", "criteria": ["low", "  "]}}, None,
     ["body", "questions", "q", "score", "criteria", 1]),
    ({"q": {"type": "choice", "instructions": "?", "criteria": {"Billing": None, " billing": "dup"}}}, None,
     ["body", "questions", "q", "choice", "criteria", " billing"]),
    ({"q": {"type": "choice", "instructions": "?", "criteria": {"a\nb": None, "c": None}}}, None,
     ["body", "questions", "q", "choice", "criteria", "a\nb"]),
    ({"q": {"type": "noul", "instructions": "?"}}, {"temperature": 0.5}, ["body", "temperature"]),
    ({"q": {"type": "noul", "instructions": "?"}}, {"prompt_format_version": 1}, ["body", "prompt_format_version"]),
    ({"q": {"type": "noul", "instructions": "?"}}, {"return_prompt_token_ids": True}, ["body", "return_prompt_token_ids"]),
    ({"q": {"type": "noul", "instructions": "?"}}, {"state": None}, ["body", "state"]),
    ({"q": {"type": "noul", "instructions": "?"}}, {"assets": {"X": {"type": "image", "part": "asset-9"}}},
     ["body", "assets", "X", "part"]),
]


@pytest.mark.parametrize("questions, extra_body, loc", INVALID_422, ids=[".".join(map(str, c[2][1:])) for c in INVALID_422])
def test_invalid_requests_get_422_with_loc(client, questions, extra_body, loc):
    with pytest.raises(TypeSafeUnprocessableEntityError) as e:
        client.system_one("A ticket.", questions, extra_body=extra_body)
    assert e.value.status == 422
    detail = e.value.body["detail"]
    assert isinstance(detail, list) and detail[0]["msg"]
    assert loc in [d["loc"] for d in detail], detail


INVALID_400 = [
    ({"q": {"type": "box", "instructions": "The dog"}}, None, "box questions"),
    ({"q": {"type": "noul", "instructions": "?"}}, {"model": "base:adapter"}, "LoRA adapter"),
    ({"q": {"type": "noul", "instructions": "?"}}, {"chat_template_kwargs": {"enable_thinking": True}},
     "decisions need it false"),
    ({"q": {"type": "noul", "instructions": "word " * 9000}}, None, "does not fit the context length"),
]


@pytest.mark.parametrize("questions, extra_body, message", INVALID_400, ids=[c[2] for c in INVALID_400])
def test_other_refusals_get_400(client, questions, extra_body, message):
    with pytest.raises(TypeSafeBadRequestError) as e:
        client.system_one("A ticket.", questions, extra_body=extra_body)
    assert e.value.status == 400 and message in str(e.value)


def test_unknown_top_level_fields_are_ignored_and_chat_template_kwargs_accepted(client):
    result = client.system_one("x", {"q": Noul(instructions="?")},
                               extra_body={"metadata": {"a": 1}, "chat_template_kwargs": {"enable_thinking": False}})
    assert "q" in result.nouls


def test_raw_http_errors_never_500(server):
    url = server.url + "/v1/systemone"
    cases = [
        (b"{not json", {"content-type": "application/json"}, 422),
        (b"[1, 2]", {"content-type": "application/json"}, 422),
        # The SDK refuses a bare Noul() itself; a raw client gets 422 from the server.
        (b'{"state":"x","model":"m","questions":{"q":{"type":"noul"}}}', {"content-type": "application/json"}, 422),
        (b"\x28\xb5\x2f\xfd garbage", {"content-type": "application/json", "content-encoding": "zstd"}, 422),
        (b"{}", {"content-type": "application/json", "content-encoding": "br"}, 415),
        (b"--x\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\n1\r\n--x--\r\n",
         {"content-type": "multipart/form-data; boundary=x"}, 422),
    ]
    for body, headers, status in cases:
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == status, (body, r.text)
        assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_zstd_bomb_is_refused_by_size(server):
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b" " * (5 * 1024 * 1024))  # above the test server's 4 MiB limit
    r = httpx.post(server.url + "/v1/systemone", content=bomb,
                   headers={"content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 413
