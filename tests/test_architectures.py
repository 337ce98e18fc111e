"""Any chat LLM: tiny random models of each architecture, saved as Hugging Face folders with SmolLM2's real
tokenizer and chat template, served end to end (``decisiond serve --model FOLDER``). Each answer — a document asked
the first time (prefilled in chunks), asked again (its KV from the prefix cache), one question and many, requests
packed into one pass — equals a plain transformers forward pass over the prompt ids the server reports, to 1e-5.

Llama models (default, each rope scaling, attention bias, untied embeddings, a head size of its own) run through
decisiond's Llama decoder; Qwen2, Gemma, Phi-3 and GPT-2 through transformers' forward pass, packed; Mistral with a
sliding window shorter than the prompt through one plain pass per prompt. The server's log names the path."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
import transformers as hf
from servers import start_decisiond

TOLERANCE = 1e-5

LLAMA_DECODER = "decisiond's Llama decoder"
PACKED = "transformers' forward pass, in packed passes"
ONE_BY_ONE = "one plain transformers forward pass per prompt"

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# name -> (config class, model class, config fields, the path that serves it)
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, {}, LLAMA_DECODER),
    "llama-rope-llama3": (hf.LlamaConfig, hf.LlamaForCausalLM, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}, LLAMA_DECODER),
    "llama-rope-linear": (hf.LlamaConfig, hf.LlamaForCausalLM,
                          {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, LLAMA_DECODER),
    "llama-rope-dynamic": (hf.LlamaConfig, hf.LlamaForCausalLM,
                           {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, LLAMA_DECODER),
    "llama-rope-yarn": (hf.LlamaConfig, hf.LlamaForCausalLM, {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}, LLAMA_DECODER),
    "llama-attention-bias": (hf.LlamaConfig, hf.LlamaForCausalLM, {"attention_bias": True}, LLAMA_DECODER),
    "llama-untied": (hf.LlamaConfig, hf.LlamaForCausalLM, {"tie_word_embeddings": False}, LLAMA_DECODER),
    "llama-head-size": (hf.LlamaConfig, hf.LlamaForCausalLM, {"head_dim": 32}, LLAMA_DECODER),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, {}, PACKED),
    "mistral-sliding-window": (hf.MistralConfig, hf.MistralForCausalLM, {"sliding_window": 16}, ONE_BY_ONE),
    "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM, {"head_dim": 16}, PACKED),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, {}, PACKED),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, {}, PACKED),
}

DOCUMENT = " ".join(
    f"Ticket {n}: the export button freezes the dashboard for account {44812 + n}; the customer tried three "
    f"browsers, needs the quarterly invoices by Friday and is getting frustrated." for n in range(14))

TEAM = {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
        "options": [{"name": "billing", "description": "Payments and invoices"}, {"name": "technical"},
                    {"name": "sales"}, {"name": "account", "description": "Access and passwords"}]}
ANGER = {"id": "anger", "type": "score", "question": "How frustrated is the customer?",
         "levels": ["Calm", "Annoyed", "Very angry"]}
URGENT = {"id": "urgent", "type": "yes_no", "question": "The customer needs an answer today."}
LANGUAGE = {"id": "language", "type": "choice", "question": "Which language is the ticket in?",
            "options": [{"name": "English"}, {"name": "German"}, {"name": "French"}]}


def build(name: str, tokenizer) -> Any:
    """The tiny random model ``name``, its final norm scaled so that label probabilities differ from uniform."""
    config_class, model_class, fields, _ = ARCHITECTURES[name]
    ids = dict(bos_token_id=tokenizer.bos_token_id or 1, eos_token_id=tokenizer.eos_token_id or 2)
    if config_class is hf.GPT2Config:
        config = config_class(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=1024, **ids)
    else:
        config = config_class(vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=ids["eos_token_id"],
                              **SMALL, **ids, **fields)
    torch.manual_seed(0)
    model = model_class(config).eval()
    norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
    with torch.no_grad():
        if config_class is hf.GemmaConfig:  # Gemma scales by 1 + weight, and the weight starts at zero
            norm.weight.fill_(39.0)
        else:
            norm.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    """``name -> (folder, model)``, built on first use."""
    made: dict[str, tuple[str, Any]] = {}

    def get(name: str) -> tuple[str, Any]:
        if name not in made:
            model = build(name, tokenizer)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            copy.deepcopy(tokenizer).save_pretrained(folder)
            made[name] = (str(folder), model)
        return made[name]

    return get


@torch.no_grad()
def reference(model: Any, prompt_ids: list[int], label_ids: list[int]) -> tuple[list[float], float]:
    """One plain forward pass over the prompt: the softmax over the labels' logits, and their full-vocabulary mass."""
    logits = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].to(torch.float64)
    chosen = logits[label_ids]
    return torch.softmax(chosen, 0).tolist(), float(torch.exp(torch.log_softmax(logits, 0)[label_ids]).sum())


def ask(client: httpx.Client, url: str, name: str, text: str, *questions: dict) -> dict:
    response = client.post(url + "/v1/decisions", json={
        "model": name, "input": text, "questions": list(questions), "return_prompt_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def engine_counts(client: httpx.Client, url: str) -> tuple[float, float]:
    """The engine's batches and the jobs they served so far, from ``/metrics``."""
    found = {}
    for line in client.get(url + "/metrics").text.splitlines():
        for metric in ("decisiond_engine_batches_total", "decisiond_engine_batched_jobs_total"):
            if line.startswith(metric + "{"):
                found[metric] = float(line.rsplit(" ", 1)[1])
    return found["decisiond_engine_batches_total"], found["decisiond_engine_batched_jobs_total"]


def check(model: Any, body: dict) -> int:
    """Every answer of ``body`` against the plain pass; the number of answers checked."""
    for qid, answer in body["answers"].items():
        want, mass = reference(model, answer["prompt_token_ids"], answer["label_token_ids"])
        got = list(answer["probabilities"].values())
        assert got == pytest.approx(want, abs=TOLERANCE), qid
        assert answer["label_mass"] == pytest.approx(mass, rel=TOLERANCE, abs=1e-12), qid
    return len(body["answers"])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_path_answers_as_a_plain_forward_pass(name, saved):
    folder, model = saved(name)
    path = ARCHITECTURES[name][3]
    # Passes of at most 256 tokens: the document (~550 tokens) is prefilled in chunks, then its questions read
    # against it; concurrent requests wait up to 200 ms for each other, and are packed into one pass.
    server = start_decisiond("--model", folder, "--served-model-name", name, "--max-batch-tokens", "256",
                             "--max-wait-ms", "200")
    try:
        with httpx.Client(timeout=120) as client:
            first = ask(client, server.url, name, DOCUMENT, URGENT, TEAM, ANGER)
            assert check(model, first) == 3
            assert len(first["answers"]["team"]["prompt_token_ids"]) > 600
            spread = first["answers"]["team"]["probabilities"].values()
            assert max(spread) - min(spread) > 0.01  # not uniform: the comparison is not vacuous
            again = ask(client, server.url, name, DOCUMENT, LANGUAGE)
            assert check(model, again) == 1
            cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            if path == ONE_BY_ONE:
                assert cached == 0
            else:
                assert cached > 500, again["usage"]  # the document's KV came from the prefix cache
            tickets = [f"Ticket {n}: my invoice for order {n * 7919} was charged twice." for n in range(4)]
            asks = [(text, (TEAM,) if n % 2 else (URGENT, LANGUAGE)) for n, text in enumerate(tickets)]
            before = engine_counts(client, server.url)
            with ThreadPoolExecutor(len(asks)) as pool:
                bodies = list(pool.map(lambda a: ask(client, server.url, name, a[0], *a[1]), asks))
            assert sum(check(model, body) for body in bodies) == 6
            batches, jobs = (after - was for after, was in zip(engine_counts(client, server.url), before))
            assert jobs == 4 and batches < 4, (batches, jobs)  # some of them shared a batch
        log = server.log()
    finally:
        server.stop()
    served = [line for line in log.splitlines() if "is served by" in line]
    assert len(served) == 1 and name in served[0] and path in served[0], served
