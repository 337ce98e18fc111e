"""Forward passes: the full-vocabulary log-probabilities of the answer labels at the answer position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Scorer:
    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def next_token_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """log-softmax over the whole vocabulary of the token after ``ids``, in float64."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x, logits_to_keep=1, use_cache=False).logits[0, -1]
        return torch.log_softmax(logits.to(torch.float64), dim=-1)

    def label_logprobs(self, prompts: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> list[list[float]]:
        out = []
        for ids, label_ids in zip(prompts, labels):
            lp = self.next_token_logprobs(ids)
            out.append([float(lp[i]) for i in label_ids])
        return out
