"""System One wire format ↔ canonical form (pure), and two-letter labels above 26 options."""

from __future__ import annotations

import base64

import pytest
from test_prompt import with_template

from decisiond.canonical import Answer, DecisionResult, Image, Json, Text, Usage
from decisiond.dialects import systemone as s1
from decisiond.errors import DecisionError
from decisiond.server.payload import UploadedFile


def parse(**body):
    return s1.parse_request({"state": "x", "model": "jev-latest", **body})


def error_of(**body):
    with pytest.raises(DecisionError) as e:
        parse(**body)
    return s1.render_error(e.value)


def test_questions_map_to_canonical_with_wire_paths():
    r = parse(questions={
        "billing": {"type": "noul", "instructions": "Billing?", "criteria": {"true": "Payments", "false": None}},
        "tone": {"type": "choice", "criteria": {"angry": "Upset", "calm": None}},
        "urgency": {"type": "score", "instructions": {"task": "rate"}, "criteria": ["Can wait", ["today", "now"]]},
    })
    billing, tone, urgency = r.questions
    assert (billing.kind, billing.name, billing.yes, billing.no) == ("yes_no", "billing", "Payments", None)
    assert tone.instructions == () and [o.name for o in tone.options] == ["angry", "calm"]
    assert tone.options[0].source == ("questions", "tone", "choice", "criteria", "angry")
    assert isinstance(urgency.instructions[0], Json) and urgency.levels[1].label == ["today", "now"]
    assert r.model == "jev-latest" and r.temperature is None


def test_state_shapes_and_image_placeholders():
    assert parse(questions={"q": {"type": "noul", "instructions": "?"}}).input[0].parts == (Text("x"),)
    json_state = s1.parse_request({"state": {"a": [1, None]}, "model": "m", "questions": {"q": {"type": "noul", "instructions": "?"}}})
    assert json_state.input[0].parts == (Json({"a": [1, None]}),)
    png = b"\x89PNG\r\n\x1a\nrest"
    r = s1.parse_request(
        {"state": "see <image:aa> and <image:bb>", "model": "m", "questions": {"q": {"type": "noul", "instructions": "?"}},
         "assets": {"<image:aa>": {"type": "image", "part": "asset-0"},
                    "<image:bb>": {"type": "image", "format": "png", "data_base64": base64.b64encode(png).decode()},
                    "UNUSED": {"type": "image", "part": "asset-1"}}},
        {"asset-0": UploadedFile(b"\xff\xd8\xffjpeg", "image/jpeg"), "asset-1": UploadedFile(b"gif", None)},
    )
    parts = r.input[0].parts
    assert [type(p).__name__ for p in parts] == ["Text", "Image", "Text", "Image", "Image"]
    assert parts[1].data.startswith(b"\xff\xd8") and parts[3].data == png and parts[1].source == ("assets", "<image:aa>")
    assert len(r.images()) == 3 and all(isinstance(i, Image) for i in r.images())


def test_response_shape():
    r = parse(questions={"n": {"type": "noul", "instructions": "?"},
                         "c": {"type": "choice", "criteria": {"a": None, "b": None}},
                         "s": {"type": "score", "criteria": ["lo", {"x": 1}]}})
    result = DecisionResult("SmolLM2", [
        Answer("yes_no", "n", probabilities=[0.9, 0.1], label_mass=0.5),
        Answer("choice", "c", probabilities=[0.25, 0.75], label_mass=0.6, confidence=0.5),
        Answer("score", "s", probabilities=[0.1, 0.9], label_mass=0.7, confidence=0.8),
    ], Usage(input_tokens=300))
    assert s1.render_response(result, r) == {
        "model": "SmolLM2",
        "answers": {
            "n": {"type": "noul", "noul": 0.9, "x_label_mass": 0.5},
            "c": {"type": "choice", "choice": "b", "confidence": 0.5, "probabilities": {"a": 0.25, "b": 0.75},
                  "x_label_mass": 0.6},
            "s": {"type": "score", "score": 0.9, "confidence": 0.8, "legend": {"0": "lo", "1": {"x": 1}},
                  "probabilities": {"0": 0.1, "1": 0.9}, "x_label_mass": 0.7},
        },
        "usage": {"input_tokens": 300, "output_tokens": 0},
    }


def test_validation_errors_are_fastapi_422():
    status, body = error_of(questions={"urgency": {"type": "score"}})
    assert status == 422
    assert body == {"detail": [{"loc": ["body", "questions", "urgency", "score", "criteria"], "msg": "Field required",
                                "type": "missing"}]}
    status, body = s1.render_error(pytest.raises(DecisionError, s1.parse_request, {"model": "m", "questions": {}}).value)
    assert status == 422 and {"loc": ["body", "state"], "msg": "Field required", "type": "missing"} in body["detail"]
    status, body = error_of(state=None, questions={"q": {"type": "noul", "instructions": "?"}})
    assert body["detail"][0]["loc"] == ["body", "state"]
    assert "valid string, or input should be a valid dictionary" in body["detail"][0]["msg"]


def test_empty_state_and_blank_ids_are_accepted():
    r = s1.parse_request({"state": "", "model": "m", "questions": {"": {"type": "noul", "instructions": "?"}, " ": {
        "type": "noul", "instructions": "?"}}})
    assert [q.name for q in r.questions] == ["", " "]


def test_refusals_are_400_with_loc():
    status, body = error_of(questions={"q": {"type": "box"}})
    assert status == 400 and body["error"]["loc"] == ["body", "questions", "q", "box"]
    status, body = error_of(model="base:adapter", questions={"q": {"type": "noul", "instructions": "?"}})
    assert status == 400 and body["error"]["loc"] == ["body", "model"]


def test_more_than_26_options_use_one_token_two_letter_labels(tiny_engine):
    r = parse(questions={"c": {"type": "choice", "instructions": "Pick",
                               "criteria": {f"option {i}": None for i in range(40)}}})
    prepared = tiny_engine.prepare(r).questions[0]
    # SmolLM2 splits "AJ" into two tokens, so it is skipped; every label is one distinct token.
    assert prepared.labels[:9] == ["AA", "AB", "AC", "AD", "AE", "AF", "AG", "AH", "AI"]
    assert prepared.labels[9] == "AK" and "AJ" not in prepared.labels and len(prepared.labels) == 40
    assert "\nAK: option 9\n" in prepared.prompt.text
    assert len(set(prepared.prompt.label_ids)) == 40


def test_too_few_one_token_labels_is_refused(tiny, tokenizer):
    from decisiond.engine.local import LocalEngine

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\nAnswer: {% endif %}")
    engine = LocalEngine(type(tiny)(**{**tiny.__dict__, "tokenizer": with_template(tokenizer, template)}))
    r = parse(questions={"c": {"type": "choice", "instructions": "Pick",
                               "criteria": {f"option {i}": None for i in range(30)}}})
    with pytest.raises(DecisionError, match="two-letter labels that are one token") as e:
        engine.decide(r)
    assert e.value.path == ("questions", "c", "choice", "criteria", "option 26")
