"""Reading label log-probabilities from servers' replies (``dialects.completions``, ``engine.served``), on the
documented shapes of each server: what is found, how two reads are put on one scale, and what is refused."""

from __future__ import annotations

import math

import pytest

from decisiond.canonical import Candidate
from decisiond.dialects import completions as wire
from decisiond.engine import served
from decisiond.engine.served import LabelToken, Unscored


def test_openai_legacy_completions_shape_with_the_chosen_token():
    reply = wire.read_reply({"choices": [{"text": "A", "logprobs": {
        "tokens": ["A"], "token_logprobs": [-0.5], "text_offset": [0],
        "top_logprobs": [{"A": -0.5, " B": -1.5, "C": -2.5}]}}],
        "usage": {"prompt_tokens": 90, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 64}}})
    assert Candidate(-1.5, " B") in reply.candidates and Candidate(-0.5, "A") in reply.candidates
    assert (reply.usage.input_tokens, reply.usage.cached_tokens, reply.usage.output_tokens) == (90, 64, 1)


def test_chat_shape_and_llamacpp_ids_and_vllm_token_ids():
    chat = wire.read_reply({"choices": [{"logprobs": {"content": [{"token": "yes", "logprob": -0.1, "bytes": [121],
                                                                   "top_logprobs": [{"token": "no", "logprob": -2.4}]}]}}]})
    assert [c.text for c in chat.candidates] == ["yes", "no"]
    llamacpp = wire.read_reply({"choices": [{"logprobs": {"content": [{"id": 49, "token": "A", "logprob": -0.3,
                                                                       "top_logprobs": [{"id": 50, "token": "B",
                                                                                         "logprob": -1.0}]}]}}]})
    assert [c.id for c in llamacpp.candidates] == [49, 50]
    vllm = wire.read_reply({"choices": [{"logprobs": {"tokens": ["token_id:49"], "token_logprobs": [-0.3],
                                                      "top_logprobs": [{"token_id:49": -0.3, "token_id:7": -2.0}]}}]})
    assert {c.id for c in vllm.candidates} == {49, 7}


@pytest.mark.parametrize("body", [{"choices": [{"text": "A"}]}, {"choices": [{"logprobs": None}]},
                                  {"choices": [{"logprobs": {"content": []}}]},
                                  {"choices": [{"logprobs": {"tokens": [], "top_logprobs": []}}]}])
def test_a_reply_without_log_probabilities_is_refused(body):
    with pytest.raises(wire.NoLogprobs):
        wire.read_reply(body)


@pytest.mark.parametrize("body", [[], {"choices": []}, {"choices": [{"logprobs": {"content": [
    {"token": "A", "logprob": "high"}]}}]}, {"choices": [{"logprobs": {"content": [{"token": "A", "logprob": None}]}}]}])
def test_a_malformed_reply_is_refused(body):
    with pytest.raises(ValueError):
        wire.read_reply(body)


def test_labels_by_id_by_token_text_and_by_their_own_text():
    candidates = [Candidate(-1.0, "A", 49), Candidate(-2.0, " A", 330), Candidate(-1.0, "A", 49),
                  Candidate(-3.0, "Yes"), Candidate(-4.0, "yes"), Candidate(-5.0, "a")]
    assert served.find(candidates, LabelToken("A", 49, "A")) == -1.0  # listed twice, counted once
    assert served.find(candidates, LabelToken("A", None, " A")) == -2.0
    both = served.find(candidates, LabelToken("A"))  # no tokenizer: "A" and " A" add up; "a" is not A
    assert both == pytest.approx(math.log(math.exp(-1) + math.exp(-2)))
    assert served.find(candidates, LabelToken("yes")) == pytest.approx(math.log(math.exp(-3) + math.exp(-4)))
    assert served.find(candidates, LabelToken("B", 50, "B")) is None


def test_a_restricted_read_is_put_back_on_the_plain_reads_scale():
    plain = [-1.0, -2.0, None, None]
    restricted = [-0.3, -1.3, -2.3, -3.3]  # the same distribution, shifted by log of the labels' share
    values, exact = served.combine(plain, restricted)
    assert exact and values == pytest.approx([-1.0, -2.0, -3.0, -4.0])


def test_reads_that_disagree_or_miss_a_label_are_refused():
    with pytest.raises(Unscored) as e:
        served.combine([-1.0, -2.0, None], [-0.3, -0.5, -2.0])  # not one constant apart
    assert e.value.index in (0, 1)
    with pytest.raises(Unscored) as e:
        served.combine([-1.0, None, None], [-1.0, -2.0, None])
    assert e.value.index == 2


def test_without_a_shared_label_only_the_probabilities_are_known():
    values, exact = served.combine([None, None], [-0.2, -1.7])
    assert not exact and values == [-0.2, -1.7]


def test_the_restriction_bodies():
    assert wire.restriction("logit_bias", [5, 9]) == {"logit_bias": {"5": 100, "9": 100}}
    assert wire.restriction("allowed_token_ids", [5, 9]) == {"allowed_token_ids": [5, 9]}
    assert wire.restriction("none", [5]) == {} and wire.restriction("logit_bias", []) == {}
    body = wire.completion_body("m", [1, 2], 20, {})
    assert body == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "temperature": 0, "logprobs": 20,
                    "stream": False}
    chat = wire.chat_body("m", "Q?", [], 5, {}, {"enable_thinking": False})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 5
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_what_is_learned_of_a_server_is_learned_again_after_a_while():
    """A server is upgraded or restarted: a fact learned from its replies (that it ignores a restriction, its most
    log-probabilities) is forgotten after ``ttl`` seconds of a clock the test moves."""
    from decisiond.gateway.providers.served_facts import RESTRICTION_IGNORED, Facts

    now = [1000.0]
    facts = Facts(ttl=300, clock=lambda: now[0])
    facts.learn(RESTRICTION_IGNORED, True)
    now[0] += 299.9
    assert facts.get(RESTRICTION_IGNORED) is True
    now[0] += 0.2
    assert facts.get(RESTRICTION_IGNORED) is None


def test_each_server_is_told_apart_by_its_model_card_and_sent_only_what_it_takes():
    from decisiond.dialects import served_servers as servers

    def owner(name: str) -> str:
        return servers.detect({"object": "list", "data": [{"id": "m", "owned_by": name}]}).name

    assert [owner(n) for n in ("vllm", "sglang", "llamacpp", "me", "library", "system", "someone")] == \
        ["vllm", "sglang", "llamacpp", "llamacpp", "ollama", "openai", "generic"]
    assert servers.detect({"detail": "Not Found"}).name == "generic"
    vllm = servers.SERVERS["vllm"].fields(False, [5, 6], {})
    assert vllm["logprob_token_ids"] == [5, 6] and vllm["repetition_penalty"] == 1.0
    assert "logprob_token_ids" not in servers.SERVERS["vllm"].fields(False, list(range(129)), {})  # vLLM's bound
    chat = servers.SERVERS["vllm"].fields(True, [], {"enable_thinking": False, "tone": "dry"})
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False, "tone": "dry"}
    assert servers.SERVERS["ollama"].fields(True, [], {})["reasoning_effort"] == "none"
    assert set(servers.SERVERS["openai"].fields(True, [1], {})) == {"frequency_penalty", "presence_penalty",
                                                                   "max_completion_tokens"}
    assert servers.maximum("Requested sample logprobs of 1000, which is greater than max allowed: 20") == 20
    assert servers.maximum("top_logprobs must be between 0 and 20") is None  # no maximum read where none is named


def test_a_label_token_is_compared_with_the_text_it_adds_in_context(tokenizer):
    from decisiond.gateway.providers.label_reads import in_context

    prompt = tokenizer.encode("Answer with yes or no only.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    assert in_context(tokenizer, prompt, yes) == "yes"
    spaced = tokenizer.encode(" A", add_special_tokens=False)[0]
    assert in_context(tokenizer, prompt, spaced) == " A"
