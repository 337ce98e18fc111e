"""The lean Llama forward pass (``engine/backends/decoder.py``) against transformers' own forward pass on the same
weights, and the models it declines (they keep transformers' forward pass)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_loaded
from transformers import DynamicCache

from decisiond.engine.backends import decoder as decoder_module
from decisiond.engine.backends.decoder import QUERY_BLOCK, LlamaDecoder
from decisiond.engine.backends.transformers import TransformersBackend
from decisiond.engine.packing import pack


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


@pytest.mark.parametrize("past, new", [(50, 10), (30, 150)])
@torch.no_grad()
def test_the_decoder_continues_a_cache_as_transformers_does(tokenizer, past, new):
    """A few new tokens (one attention call, KV heads folded) and more than QUERY_BLOCK of them (calls by blocks of
    queries, each against the keys up to its own last token) after a cached past."""
    assert (new < QUERY_BLOCK) == (new == 10)
    model, decoder = decoder_of(tokenizer, seed=4)
    ids = torch.arange(100, 100 + past + new)[None]
    reference = model(input_ids=ids, use_cache=False).logits[0, past:]
    cache = DynamicCache()
    decoder(ids[:, :past], torch.arange(past)[None], torch.ones(past, past, dtype=torch.bool).tril()[None, None],
            cache, torch.tensor([past - 1]))
    mask = torch.ones(new, past + new, dtype=torch.bool)
    mask[:, past:] = torch.ones(new, new, dtype=torch.bool).tril()
    every = decoder(ids[:, past:], torch.arange(past, past + new)[None], mask[None, None], cache,
                    torch.arange(new))[0]
    torch.testing.assert_close(every, reference, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_attention_by_query_blocks_equals_one_call_over_padded_packed_rows(tokenizer, monkeypatch):
    """Two rows of different lengths, each a radix tree of prompts after a past of its own (padded): the tree mask is
    not plain causal, and the blocks must cut it, the padding and the past alike. The last block reads its keys
    gathered (the first prompt's tail is hidden from it)."""
    model, decoder = decoder_of(tokenizer, seed=5)
    rows = [pack([[*range(10, 90), *range(200, 240)], [*range(10, 90), *range(300, 330)]], skip=0),
            pack([[*range(400, 470), 7, 8], [*range(400, 470), 9]], skip=0)]
    width = max(len(r) for r in rows)
    assert width > QUERY_BLOCK and len(rows[1]) < width
    ids = torch.zeros(2, width, dtype=torch.long)
    positions = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, 1, width, 5 + width, dtype=torch.bool)
    for r, row in enumerate(rows):
        n = len(row)
        ids[r, :n], positions[r, :n] = torch.tensor(row.tokens), torch.tensor(row.positions) + 5
        mask[r, 0, :n, :5], mask[r, 0, :n, 5:5 + n] = True, row.mask()
        mask[r, 0, n:, 5 + n:] = torch.eye(width - n, dtype=torch.bool)
    wanted = torch.tensor(sorted({t for row in rows for t in row.targets}))

    def run() -> torch.Tensor:
        cache = DynamicCache()
        past = torch.arange(20, 25)[None].expand(2, 5)
        decoder(past, torch.arange(5)[None].expand(2, 5), torch.ones(5, 5, dtype=torch.bool).tril()[None, None], cache,
                torch.tensor([4]))
        return decoder(ids, positions, mask, cache, wanted)

    planned: list[list[Any]] = []

    def spy(*args: Any) -> list[Any]:
        planned.append(plan(*args))
        return planned[-1]

    plan = decoder_module._blocks
    monkeypatch.setattr(decoder_module, "_blocks", spy)
    blocks = run()
    gathered = [b.ranges for b in planned[-1] if len(b.ranges) > 1]
    assert gathered == [((0, 85), (125, 155))]  # the past and shared prefix, then the last tail (and padding)
    # The reference: one plain SDPA call a layer, KV heads repeated for the query heads as transformers does (not
    # folded, not in blocks).
    monkeypatch.setattr(decoder_module, "QUERY_BLOCK", 10_000)
    monkeypatch.setattr(decoder, "grouped", False)
    torch.testing.assert_close(blocks, run(), rtol=1e-5, atol=1e-5)  # float rounding at logits of ±15


def test_runs_of_keys_a_block_sees():
    runs = decoder_module._runs
    assert runs(torch.tensor([True, True, False, True])) == ((0, 2), (3, 4))
    assert runs(torch.tensor([False, True, True, True, False])) == ((1, 4),)
    assert runs(torch.tensor([True, False, True, False, True])) == ((0, 1), (2, 3), (4, 5))
    assert runs(torch.tensor([True])) == ((0, 1),)


def test_models_it_does_not_compute_exactly_keep_transformers_forward(tokenizer):
    assert LlamaDecoder.of(tiny_loaded(tokenizer, dtype="bfloat16").model) is None
    assert LlamaDecoder.of(tiny_loaded(tokenizer, attn_implementation="eager").model) is None
    assert TransformersBackend(tiny_loaded(tokenizer, dtype="bfloat16").model).decoder is None
    assert TransformersBackend(tiny_loaded(tokenizer).model).decoder is not None


def test_a_backend_changes_no_process_wide_setting(tokenizer):
    """The choice to let SDPA read grouped KV heads is the decoder's, in its own calls: building a backend leaves
    the environment (and so every other model in the process) as it was."""
    import os

    before = dict(os.environ)
    TransformersBackend(tiny_loaded(tokenizer).model)
    assert dict(os.environ) == before
