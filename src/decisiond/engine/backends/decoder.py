"""A Llama decoder's forward pass over packed rows, top to bottom, for the transformers backend.

Contract: ``LlamaDecoder.of(model)`` returns a decoder only for a model it computes exactly — float32
``LlamaForCausalLM`` with SDPA attention, silu MLPs and no tensor-parallel split — and its logits equal transformers'
forward pass over the same ids, positions, mask and cache up to float rounding (``tests/test_decoder.py``,
``tests/test_architectures.py``); for any other model it returns ``None`` and transformers' forward pass serves it.

How it does the same work in fewer tensor operations than transformers' forward pass (the measurements behind each
choice: ``benchmarks/ENGINE_NOTES.md``):

- **The model's own weights, as they are**, never copied or fused (fused copies would stay resident beside the
  mapped safetensors pages).
- **The mask is made additive once a pass**, not converted again by every layer's attention.
- **The last layer only where answers are read**: its keys and values are computed for every token (the cache
  needs them), its queries, attention output and MLP only at the positions whose logits are wanted.
- **Attention by blocks of queries**: SDPA computes masked query–key products like any other, so the queries of a
  long pass go ``QUERY_BLOCK`` at a time, each block against the keys up to its own last token (the keys after it
  are masked for the whole block: a token never sees a later one). About a third less attention work for a
  500-token pass, for the same result up to float rounding (the keys left out weigh zero). Where the tree mask hides
  a fifth or more of those keys from a whole block (the tails of earlier questions, laid out before it), the block
  reads only the runs of keys it sees, gathered: the shared prompt and its own tails.
- **Grouped KV heads folded** in a pass of a few tokens (a question asked about a cached document): each KV head's
  query heads go as one row of queries, so one SDPA call reads the document's keys once per KV head.
- Element-wise work in place where the result is not needed twice (SwiGLU, residuals, rotary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Queries per attention call in a pass over new tokens (``LlamaDecoder._attend``; chosen by measurement,
# benchmarks/ENGINE_NOTES.md).
QUERY_BLOCK = 64


def sdpa_reads_grouped_heads(device: torch.device) -> bool:
    """Whether attention passes grouped KV heads to SDPA as they are (``enable_gqa``): on a CPU, where it gives the
    same results as KV heads repeated for every query head, without the copies (not every GPU kernel takes
    ``enable_gqa`` with a mask)."""
    return device.type == "cpu"


def _fold(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``[rows, 1, queries, keys]`` → ``[rows, 1, group × queries, keys]``: the mask of each query, once for each query
    head of a KV head's group (``LlamaDecoder._attend_folded``)."""
    return mask[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)


# A block of queries reads the keys it sees gathered (``_blocks``) where that leaves out at least this share of the keys
# up to its last token: gathering copies the keys, so a block that sees most of them reads them in place.
GATHER_FROM = 0.2


@dataclass(frozen=True)
class _Block:
    """Queries ``start:end`` of a pass, against the keys in ``ranges`` (key positions, the past's included), with
    ``mask``, the pass's mask for those queries and keys."""

    start: int
    end: int
    ranges: tuple[tuple[int, int], ...]
    mask: torch.Tensor


def _runs(columns: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` runs of true values in a bool vector: where it turns on, then off (a false at each end)."""
    edge = torch.zeros(1, dtype=torch.int8, device=columns.device)
    turns = torch.cat([edge, columns.to(torch.int8), edge]).diff().nonzero().squeeze(1).tolist()
    return tuple(zip(turns[0::2], turns[1::2]))


def _blocks(seen: torch.Tensor, mask: torch.Tensor, past: int) -> list[_Block]:
    """The pass's queries in blocks of ``QUERY_BLOCK``, each with the keys it reads (``seen``: the bool mask, ``[rows,
    1, queries, keys]``; ``mask``: the same, additive). A block reads the keys up to its own last token (a token never
    sees a later one); where the tree mask hides a good share of those (other questions' tails, laid out before the
    block), only the runs of keys some query of the block sees: the prompt's shared part and the block's own tails."""
    width = seen.shape[2]
    out = []
    for start in range(0, width, QUERY_BLOCK):
        end = min(width, start + QUERY_BLOCK)
        upto = past + end
        columns = seen[:, 0, start:end, :upto].any(dim=1).any(dim=0)
        ranges: tuple[tuple[int, int], ...] = ((0, upto),)
        if int(columns.sum()) <= (1 - GATHER_FROM) * upto:
            ranges = _runs(columns)
        if len(ranges) == 1:  # one run: a view, as ``_attend`` reads its keys
            (a, z), = ranges
            block_mask = mask[:, :, start:end, a:z]
        else:
            block_mask = torch.cat([mask[:, :, start:end, a:z] for a, z in ranges], dim=3)
        out.append(_Block(start, end, ranges, block_mask))
    return out


@dataclass(frozen=True)
class _Layer:
    norm1: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LlamaDecoder:
    """``decoder(ids, positions, mask, cache, wanted)``: the logits at ``wanted`` of every row."""

    def __init__(self, model: Any):
        self.model = model
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
        self.scale = float(model.model.layers[0].self_attn.scaling)
        # Where SDPA reads grouped KV heads itself; elsewhere they are repeated for the query heads (as transformers).
        self.grouped = sdpa_reads_grouped_heads(next(model.parameters()).device)

    @classmethod
    def of(cls, model: Any) -> LlamaDecoder | None:
        """The decoder for ``model``, or ``None`` when it is not a model this module computes exactly."""
        config = model.config
        if type(model).__name__ != "LlamaForCausalLM" or getattr(config, "model_type", "") != "llama":
            return None
        if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
            return None
        if next(model.parameters()).dtype != torch.float32:
            return None  # in half precision, another order of operations rounds visibly differently
        if (getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False)
                or int(getattr(config, "pretraining_tp", 1) or 1) != 1):
            return None
        return cls(model)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm in float32, bit for bit, in one pass fewer over ``x`` than ``F.rms_norm`` makes
        # on a CPU.
        return torch.mul(x, x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(weight)

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` (``x``: [rows, heads, tokens, head size])."""
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                blocks: list[_Block] | None) -> torch.Tensor:
        """Attention of ``q`` (``[rows, heads, queries, head size]``), ``[rows, queries, heads × head size]``: one SDPA
        call, or one per block of queries (``_blocks``) against the keys that block sees."""
        rows, heads, width, d = q.shape
        grouped = keys.shape[1] != heads
        if blocks is None:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=grouped)
            return o.transpose(1, 2).reshape(rows, width, heads * d)
        out = q.new_empty(rows, width, heads, d)
        for b in blocks:
            if len(b.ranges) == 1:
                (a, z), = b.ranges
                k, v = keys[:, :, a:z], values[:, :, a:z]
            else:  # gathered: the runs of keys the block sees
                k = torch.cat([keys[:, :, a:z] for a, z in b.ranges], dim=2)
                v = torch.cat([values[:, :, a:z] for a, z in b.ranges], dim=2)
            o = F.scaled_dot_product_attention(q[:, :, b.start:b.end], k, v, attn_mask=b.mask, scale=self.scale,
                                               enable_gqa=grouped)
            out[:, b.start:b.end] = o.transpose(1, 2)
        return out.view(rows, width, heads * d)

    def _attend_folded(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       folded: torch.Tensor) -> torch.Tensor:
        """Attention with grouped KV heads, each head's query heads as one row of queries (``folded``: the mask
        repeated for each, ``_fold``): one SDPA call reads each KV head once, and its result equals ``enable_gqa``'s
        to float rounding."""
        rows, heads, width, d = q.shape
        o = F.scaled_dot_product_attention(q.reshape(rows, keys.shape[1], -1, d), keys, values, attn_mask=folded,
                                           scale=self.scale)
        return o.reshape(rows, heads, width, d).transpose(1, 2).reshape(rows, width, heads * d)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any,
                 wanted: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(ids)
        rows, width, _ = h.shape
        cos, sin = inner.rotary_emb(h, positions)
        cos, sin = cos[:, None], sin[:, None]
        seen = mask if mask.dtype == torch.bool else mask == 0
        if mask.dtype == torch.bool:  # additive, once for every layer
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        past = mask.shape[3] - width
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        last = len(self.layers) - 1
        # A pass of a few tokens (a question asked again about a cached document) reads each KV head once for all the
        # query heads it serves, as one row of queries each (``_attend_folded``).
        group = heads // kv if kv != heads and self.grouped else 1
        fold = group > 1 and width <= QUERY_BLOCK
        folded = _fold(mask, group) if fold else None
        blocks = None if fold else _blocks(seen, mask, past)
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.norm1)
            k = F.linear(x, layer.k, layer.k_bias).view(rows, width, kv, d).transpose(1, 2)
            v = F.linear(x, layer.v, layer.v_bias).view(rows, width, kv, d).transpose(1, 2)
            keys, values = cache.update(self._rotary(k, cos, sin), v, i)
            attn_mask = mask
            if i == last:  # the last layer: queries, and all after attention, only where logits are read
                x, h, attn_mask = x[:, wanted], h[:, wanted], mask[:, :, wanted]
                cos, sin = cos[:, :, wanted], sin[:, :, wanted]
                folded = _fold(attn_mask, group) if group > 1 else None
            q = F.linear(x, layer.q, layer.q_bias).view(rows, x.shape[1], heads, d).transpose(1, 2)
            q = self._rotary(q, cos, sin)
            if kv != heads and not self.grouped:
                keys = keys.repeat_interleave(heads // kv, dim=1)
                values = values.repeat_interleave(heads // kv, dim=1)
            if folded is not None:
                o = self._attend_folded(q, keys, values, folded)
            else:
                o = self._attend(q, keys, values, attn_mask, blocks if i != last else None)
            h = h + F.linear(o, layer.o, layer.o_bias)
            x = self._norm(h, layer.norm2)
            h += F.linear(F.silu(F.linear(x, layer.gate), inplace=True).mul_(F.linear(x, layer.up)), layer.down)
        logits: torch.Tensor = self.model.lm_head(self._norm(h, inner.norm.weight))
        return logits
