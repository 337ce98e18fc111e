"""Gateway config (validation, ``${ENV}``), outbound System One translation and limits: pure, no servers."""

from __future__ import annotations

import pytest

from decisiond.dialects import openai as oa_wire
from decisiond.dialects import systemone as s1
from decisiond.errors import DecisionError
from decisiond.gateway import config, settings
from decisiond.gateway import sizes as limits


def test_env_interpolation(monkeypatch):
    monkeypatch.setenv("KEY_A", "secret")
    parsed = config.parse({"providers": [
        {"name": "openai", "type": "openai", "base_url": "${BASE:-https://api.openai.com/v1}", "api_key": "${KEY_A}"}]})
    assert parsed.providers[0].api_key == "secret" and parsed.providers[0].base_url == "https://api.openai.com/v1"
    with pytest.raises(config.ConfigError, match="providers\\[0\\].api_key: environment variable NOPE_X is not set"):
        config.parse({"providers": [{"name": "o", "type": "openai", "base_url": "http://x", "api_key": "${NOPE_X}"}]})


def provider(name, type_="openai", **kw):
    return {"name": name, "type": type_, "base_url": "http://x", **kw}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"providers": [provider("a"), provider("a")]}, "provider names must be unique"),
        ({"providers": [provider("a", "azure")]}, "needs an api_version"),
        ({"providers": [{"name": "a", "type": "openai"}]}, "needs a base_url"),
        ({"providers": [provider("a", "vertex")]}, "providers.0.type"),
        ({"providers": [provider("a")], "models": [{"name": "m", "provider": "b"}]}, "unknown provider 'b'"),
        ({"providers": [provider("a")], "virtual_models": [{"name": "v", "targets": ["zz/m"]}]},
         "names unknown model 'zz/m'"),
        ({"providers": [provider("a")], "virtual_models": [{"name": "v", "targets": ["w"]},
                                                          {"name": "w", "targets": ["v"]}]}, "cycle: v -> w -> v"),
        ({"providers": [provider("a")], "virtual_models": [{"name": "v", "strategy": "alias",
                                                           "targets": ["a/x", "a/y"]}]}, "exactly one target"),
        ({"providers": [provider("a")], "oops": 1}, "oops"),
    ],
)
def test_config_errors_name_the_entry(data, message):
    with pytest.raises(config.ConfigError, match=message):
        config.parse(data)


def test_chains_nest_at_most_eight_deep():
    chain = [{"name": "v0", "targets": ["a/x"]}] + [{"name": f"v{i}", "targets": [f"v{i - 1}"]} for i in range(1, 9)]
    with pytest.raises(config.ConfigError, match="v8' nests more than 8 levels"):
        config.parse({"providers": [provider("a")], "virtual_models": chain})
    config.parse({"providers": [provider("a")], "virtual_models": chain[:8]})


def test_image_reading_defaults():
    from decisiond.gateway.providers import build

    def reads(**fields):
        return build(settings.ProviderConfig(**fields)).reads_images

    assert reads(name="jev", type="systemone", base_url="https://api.typesafe.ai/")
    assert not reads(name="kev", type="systemone", base_url="http://kev:8008")
    assert reads(name="o", type="openai", base_url="http://x")
    assert not reads(name="o", type="openai", base_url="http://x", images=False)


REQUEST = {"model": "m", "input": "Shoes arrived late.", "questions": [
    {"type": "predicate", "name": "late", "instructions": "Was the delivery late?"},
    {"type": "choice", "instructions": [{"type": "input_text", "text": "Which team?"},
                                        {"type": "input_json", "data": {"hint": "x"}}],
     "choices": [{"value": "returns", "description": "Exchanges"}, {"value": False}]},
    {"type": "score", "name": "anger", "instructions": "How angry?",
     "levels": [{"label": "calm"}, {"label": "angry", "description": "shouting"}]},
]}


def test_outbound_system_one_body():
    out = s1.render_request(oa_wire.parse_request(REQUEST), "kev-latest")
    assert out.keys == ["late", "question_1", "anger"] and out.files == []
    assert out.body == {"state": "Shoes arrived late.", "model": "kev-latest", "questions": {
        "late": {"type": "noul", "instructions": "Was the delivery late?"},
        "question_1": {"type": "choice", "instructions": 'Which team?\n{"hint":"x"}',
                       "criteria": {"returns": "Exchanges", "false": None}},
        "anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "angry - shouting"]}}}


def test_outbound_state_shapes():
    one_json = dict(REQUEST, input=[{"role": "user", "content": [{"type": "input_json", "data": {"a": 1}}]}])
    assert s1.render_request(oa_wire.parse_request(one_json), "m").body["state"] == {"a": 1}
    transcript = dict(REQUEST, input=[{"role": "system", "content": "Be strict."}, {"role": "user", "content": "Hi"}])
    assert s1.render_request(oa_wire.parse_request(transcript), "m").body["state"] == "system: Be strict.\n\nuser: Hi"
    clash = dict(REQUEST, questions=[{"type": "predicate", "name": "question_1", "instructions": "?"},
                                     {"type": "predicate", "instructions": "?"}])
    with pytest.raises(DecisionError, match="'question_1' would be used twice"):
        s1.render_request(oa_wire.parse_request(clash), "m")


def test_answers_map_back_by_name_and_index():
    request = oa_wire.parse_request(REQUEST)
    result = s1.parse_response({"model": "kev-1", "usage": {"input_tokens": 9, "output_tokens": 3}, "answers": {
        "late": {"type": "noul", "noul": 0.25, "x_label_mass": 0.5},
        "question_1": {"type": "choice", "choice": "false", "confidence": 0.2,
                       "probabilities": {"returns": 0.4, "false": 0.6}},
    }}, request, ["late", "question_1", "anger"])
    assert result.answers[0].probabilities == [0.25, 0.75] and result.answers[0].label_mass == 0.5
    assert result.answers[1].probabilities == [0.4, 0.6] and result.answers[1].confidence == 0.2
    assert result.answers[2].refusal and result.usage.output_tokens == 3 and result.model == "kev-1"
    body = oa_wire.render_response(result, request)
    assert body["answers"][1]["choice"] is False and body["answers"][2] == {"type": "refusal", "name": "anger"}


def test_limit_checks():
    request = oa_wire.parse_request(REQUEST)
    limits.check_openai(request)
    limits.check_provider(request, limits.SYSTEM_ONE, "kev")
    with pytest.raises(DecisionError, match="kev takes at most 1 levels per question, got 2") as e:
        limits.check_provider(request, settings.Limits(max_levels=1), "kev")
    assert e.value.path == ("questions", 2, "levels", 1) and e.value.code == "limit_exceeded"
    assert limits.question_tokens(request)[0] == pytest.approx((19 + 22) / 4, abs=1)
