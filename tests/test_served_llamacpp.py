"""A real served model: llama.cpp's OpenAI-compatible server (llama-cpp-python, in the test extras) serving the
embedded SmolLM2 GGUF, as a decision model through decisiond's ``type: logprobs`` provider, beside decisiond's
in-process engine on the same weights (the same GGUF, de-quantized to float32). Its answers equal the in-process
engine's within 0.06 (llama.cpp's 8-bit activations; see below) with the same top option, and an eight-option choice gets all eight probabilities. Under
``CI=true`` a server that cannot start fails these tests (``services.unavailable``)."""

from __future__ import annotations

import math

import openai
import pytest
from gguf_f32 import write_f32
from served_tickets import INPUTS, QUESTIONS
from servers import start_decisiond
from services import start_llamacpp

pytestmark = pytest.mark.model  # decisiond's in-process side runs the real SmolLM2 model

# The interface of the check, as a user writes it; with the time a loaded CI machine needs (llama.cpp's
# server on the same two cores as the test run: an 8-option choice there has taken more than the default 9 s).
CONFIG = """
deadline: 120
providers:
  - {name: local, type: local, model: default}
  - {name: llamacpp, type: logprobs, api: completions, base_url: "${LLAMACPP_URL}", tokenizer: default, timeout: 60}
  - {name: llamacpp_f32, type: logprobs, api: completions, base_url: "${LLAMACPP_F32_URL}", tokenizer: default,
     timeout: 60}
models:
  - {name: there, provider: llamacpp, upstream: "${LLAMACPP_MODEL}"}
  - {name: there_f32, provider: llamacpp_f32, upstream: "${LLAMACPP_F32_MODEL}"}
"""

@pytest.fixture(scope="module")
def llamacpp():
    from decisiond.engine.model import default_gguf

    server = start_llamacpp(default_gguf())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llamacpp_f32(tmp_path_factory):
    """The same weights in float32 (``gguf_f32``): llama.cpp without its quantized dot products."""
    from decisiond.engine.model import default_gguf

    server = start_llamacpp(write_f32(default_gguf(), tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(llamacpp, llamacpp_f32, smollm_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("llamacpp-gw") / "gateway.yaml"
    path.write_text(CONFIG)
    running = start_decisiond("--config", str(path), env={"LLAMACPP_URL": llamacpp.url,
                                                          "LLAMACPP_MODEL": llamacpp.model,
                                                          "LLAMACPP_F32_URL": llamacpp_f32.url,
                                                          "LLAMACPP_F32_MODEL": llamacpp_f32.model})
    yield running
    running.stop()


def answers(decision) -> list[list[float]]:
    out = []
    for a in decision.answers:
        out.append([a.probability, 1 - a.probability] if a.type == "predicate" else
                   [p.probability for p in a.probabilities])
    return out


def side_by_side(gateway, model: str):
    """Each input's questions answered by the in-process engine and by ``model``: (input, question, engine's
    probabilities, the server's)."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    for text in INPUTS:
        local = client.decisions.create(model="SmolLM2-135M-Instruct", input=text, questions=QUESTIONS)
        served = client.decisions.create(model=model, input=text, questions=QUESTIONS)
        for question, mine, theirs in zip(QUESTIONS, answers(local), answers(served)):
            yield text, question, mine, theirs


def test_served_answers_equal_the_in_process_engine_on_the_same_weights(gateway):
    worst = 0.0
    for text, question, mine, theirs in side_by_side(gateway, "there"):
        assert len(theirs) == len(mine) and math.fsum(theirs) == pytest.approx(1.0)
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, theirs)))
        assert max(range(len(mine)), key=mine.__getitem__) == max(range(len(theirs)), key=theirs.__getitem__), \
            (text, question["name"], mine, theirs)
    # llama.cpp multiplies Q4_1 weights by activations quantized to 8 bits; the in-process engine runs the same weights
    # de-quantized, in float32. On these prompts the two differ by at most 0.055 (the same when the prompt is sent to
    # llama.cpp directly, without decisiond): the 0.05 holds for all but the support question's 'team'.
    assert worst <= 0.06, worst


def test_a_float32_gguf_of_the_same_weights_answers_within_0_005(gateway):
    worst = max(max(abs(a - b) for a, b in zip(mine, theirs))
                for _, _, mine, theirs in side_by_side(gateway, "there_f32"))
    # without Q4_1's 8-bit activations only the order of float32 sums differs
    assert worst <= 0.005, worst


def test_an_eight_option_choice_gets_all_eight_probabilities_and_the_label_mass(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    raw = client.decisions.with_raw_response.create(model="there", input=INPUTS[0], questions=QUESTIONS[3:])
    assert raw.headers["x-decisiond-provider-format"] == "logprobs"
    answer = raw.parse().answers[0]
    assert [p.value for p in answer.probabilities] == [c["value"] for c in QUESTIONS[3]["choices"]]
    assert all(p.probability > 0 for p in answer.probabilities)
    mass = raw.http_response.json()["answers"][0]["label_mass"]
    assert 0 < mass <= 1
    assert raw.http_response.json()["usage"]["input_tokens"] > 0
