"""Forward passes: the full-vocabulary log-probabilities of the answer labels at the answer position.

Two paths give the same numbers (to float rounding; tested to 1e-4 in fp32):
- ``reference``: one forward pass per prompt — the plain way, kept as the yardstick;
- ``packed``: rows of shared-prefix packed prompts (``packing``), padded into one batch, with an optional cached
  prefix (the chat template's header, computed once and shared by every row) given to the model as its KV cache.
Models whose attention is not plain causal over the whole context (sliding windows, mixed layer types) use the
reference path, which needs no custom mask.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .packing import PackedRow

PREFIX_CACHE_ENTRIES = 8


@dataclass
class RowJob:
    """One packed row and, for each of its prompts, the label ids to read."""

    row: PackedRow
    labels: list[list[int]]


class Scorer:
    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        self.packing = impl in ("sdpa", "eager") and layer_types == {"full_attention"} and not sliding
        self.bool_mask = impl == "sdpa"
        self._prefixes: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    # ----------------------------------------------------------------------------------- reference

    @torch.inference_mode()
    def reference(self, ids: Sequence[int], label_ids: Sequence[int]) -> list[float]:
        """One forward pass over one prompt."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x, logits_to_keep=1, use_cache=False).logits[0, -1]
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        return [float(lp[i]) for i in label_ids]

    # -------------------------------------------------------------------------------------- packed

    @torch.inference_mode()
    def _prefix_kv(self, prefix: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cached = self._prefixes.get(prefix)
        if cached is not None:
            self._prefixes.move_to_end(prefix)
            return cached
        from transformers import DynamicCache

        x = torch.tensor([list(prefix)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_arg: DynamicCache(config=self.model.config)})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._prefixes[prefix] = kv
        if len(self._prefixes) > PREFIX_CACHE_ENTRIES:
            self._prefixes.popitem(last=False)
        return kv

    def _mask(self, rows: Sequence[PackedRow], width: int, skip: int) -> torch.Tensor:
        """The 4-D mask of padded packed rows: the cached prefix, then each row's own tree mask."""
        mask = torch.zeros(len(rows), 1, width, skip + width, dtype=torch.bool)
        mask[:, :, :, :skip] = True
        for r, row in enumerate(rows):
            n = len(row)
            mask[r, 0, :n, skip:skip + n] = row.mask()
            padding = torch.arange(n, width)
            mask[r, 0, padding, skip + padding] = True  # padding sees itself: no empty softmax rows
        if self.bool_mask:
            return mask.to(self.device)
        return torch.zeros(mask.shape, dtype=self.model.dtype).masked_fill(
            ~mask, torch.finfo(self.model.dtype).min).to(self.device)

    @torch.inference_mode()
    def packed(self, jobs: Sequence[RowJob], prefix: tuple[int, ...] = ()) -> list[list[list[float]]]:
        """Label log-probs for every prompt of every row, in one forward pass. ``prefix`` (possibly empty) is the
        token prefix every prompt starts with and that the rows leave out."""
        rows = [job.row for job in jobs]
        count, width, skip = len(rows), max(len(r) for r in rows), len(prefix)
        ids = torch.zeros(count, width, dtype=torch.long)
        positions = torch.full((count, width), skip, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row.tokens)
            positions[r, :len(row)] = torch.tensor(row.positions)
        # Logits only where some row has a target; each row reads its own.
        wanted = sorted({t for row in rows for t in row.targets})
        where = {t: k for k, t in enumerate(wanted)}
        kwargs: dict[str, Any] = {}
        if skip:
            from transformers import DynamicCache

            kv = self._prefix_kv(prefix)
            kwargs[self.cache_arg] = DynamicCache(
                ddp_cache_data=[(k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1)) for k, v in kv]
            )
        attention = self._mask(rows, width, skip)
        logits = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=attention,
            use_cache=bool(skip),
            logits_to_keep=torch.tensor(wanted, device=self.device),
            **kwargs,
        ).logits
        out = []
        for r, job in enumerate(jobs):
            per_prompt = []
            for target, label_ids in zip(job.row.targets, job.labels):
                lp = torch.log_softmax(logits[r, where[target]].to(torch.float64), dim=-1)
                per_prompt.append([float(lp[i]) for i in label_ids])
            out.append(per_prompt)
        return out
