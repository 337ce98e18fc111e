"""The lean Llama forward pass (``engine/backends/decoder.py``) against transformers' own forward pass on the same
weights, and the models it declines (they keep transformers' forward pass)."""

from __future__ import annotations

from typing import Any

import torch
from conftest import tiny_loaded
from transformers import DynamicCache

from decisiond.engine.backends.decoder import LlamaDecoder
from decisiond.engine.backends.transformers import TransformersBackend


def decoder_of(tokenizer, seed: int) -> tuple[Any, LlamaDecoder]:
    """A tiny random Llama and its decoder."""
    model = tiny_loaded(tokenizer, seed=seed).model
    decoder = LlamaDecoder.of(model)
    assert decoder is not None
    return model, decoder


@torch.no_grad()
def test_the_decoder_computes_transformers_logits(tokenizer):
    model, decoder = decoder_of(tokenizer, seed=3)
    ids = torch.arange(5, 45)[None]
    reference = model(input_ids=ids, use_cache=False).logits[0]
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    every = decoder(ids, torch.arange(40)[None], causal, DynamicCache(), torch.arange(40))[0]
    torch.testing.assert_close(every, reference, rtol=1e-5, atol=1e-5)  # float rounding at logits of ±15
    # Only some positions wanted: the last layer computes its queries and MLP there alone, to the same logits.
    some = torch.tensor([3, 17, 39])
    picked = decoder(ids, torch.arange(40)[None], causal, DynamicCache(), some)[0]
    torch.testing.assert_close(picked, reference[some], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_decoder_continues_a_cache_as_transformers_does(tokenizer):
    model, decoder = decoder_of(tokenizer, seed=4)
    ids = torch.arange(100, 160)[None]
    reference = model(input_ids=ids, use_cache=False).logits[0, -1]
    cache = DynamicCache()
    decoder(ids[:, :50], torch.arange(50)[None], torch.ones(50, 50, dtype=torch.bool).tril()[None, None], cache,
            torch.tensor([49]))
    mask = torch.ones(10, 60, dtype=torch.bool)
    mask[:, 50:] = torch.ones(10, 10, dtype=torch.bool).tril()
    last = decoder(ids[:, 50:], torch.arange(50, 60)[None], mask[None, None], cache, torch.tensor([9]))[0, 0]
    torch.testing.assert_close(last, reference, rtol=1e-5, atol=1e-5)


def test_models_it_does_not_compute_exactly_keep_transformers_forward(tokenizer):
    assert LlamaDecoder.of(tiny_loaded(tokenizer, dtype="bfloat16").model) is None
    assert LlamaDecoder.of(tiny_loaded(tokenizer, attn_implementation="eager").model) is None
    assert TransformersBackend(tiny_loaded(tokenizer, dtype="bfloat16").model).decoder is None
    assert TransformersBackend(tiny_loaded(tokenizer).model).decoder is not None
