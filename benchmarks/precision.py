"""How far bf16 matmuls move the engine's probabilities from float32's, per group of projections (issue 57's study).

Each Llama layer's projections fall in four groups: ``qkv`` (the attention inputs), ``o`` (the attention output),
``gu`` (the MLP's gate and up) and ``d`` (the MLP's down projection). A variant gives each group a mode:

- ``fp32``: float32 weights and inputs (the engine as it is);
- ``bf16``: bf16 weights and inputs (oneDNN accumulates in float32, the output is rounded to bf16);
- ``split``: bf16 weights, the input as a bf16 high part plus a bf16 low part (two matmuls: the input's rounding
  goes, the weights' and the output's stay).

The residual stream, the norms, rotary, attention and the output layer stay float32 in every variant. The script
answers the benchmark's tickets (``bench.workload.requests``) with the float32 engine and with each variant, and
prints, per variant, the median, 90th percentile and largest change of any option's probability, and whether the
top option agrees. Probabilities are deterministic: the numbers do not depend on the machine's load.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/precision.py --tickets 30 --questions 3 \\
        bf16,bf16,bf16,bf16  fp32,fp32,split,bf16
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import torch
import torch.nn.functional as F

from decisiond.bench.workload import requests
from decisiond.engine import model as model_mod
from decisiond.engine.backends import decoder as dec
from decisiond.engine.local import LocalEngine

GROUPS = ("qkv", "o", "gu", "d")


class Variant(dec.LlamaDecoder):
    """The Llama decoder with each group of projections computed in its mode (see the module's docstring)."""

    def __init__(self, model: Any, modes: dict[str, str]):
        super().__init__(model)
        self.modes = modes
        group = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gu", "up": "gu", "down": "d"}
        self.weights: dict[int, tuple[str, torch.Tensor]] = {}
        for layer in self.layers:
            for name, g in group.items():
                w = getattr(layer, name)
                self.weights[id(w)] = (modes[g], w if modes[g] == "fp32" else w.to(torch.bfloat16))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        mode, w = self.weights[id(weight)]
        if mode == "fp32":
            return F.linear(x, w, bias)
        if mode == "bf16":
            out = F.linear(x.to(torch.bfloat16), w).float()
        else:
            high = x.to(torch.bfloat16)
            low = (x - high.float()).to(torch.bfloat16)
            out = F.linear(high, w).float() + F.linear(low, w).float()
        return out if bias is None else out + bias


class PatchedFunctional:
    """``torch.nn.functional`` as the decoder's module sees it during a variant's run: the projections whose weights
    the variant holds (``variant.weights``, by ``id``) through ``variant.linear``, everything else as it is. Shared by
    ``rounding.py`` and ``mixed_rate.py``."""

    def __init__(self, variant: Any):
        self.variant = variant

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(weight) in self.variant.weights:
            out: torch.Tensor = self.variant.linear(x, weight, bias)
            return out
        return F.linear(x, weight, bias)


async def answers(engine: LocalEngine, asked: list[Any]) -> list[Any]:
    return [await engine.decide_async(r) for r in asked]


def float32_answers(tickets: int, questions: int) -> tuple[Any, list[Any], asyncio.AbstractEventLoop, list[Any]]:
    """The embedded model in float32, the benchmark's tickets, an event loop, and the float32 engine's answers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loaded = model_mod.load("default", dtype="float32")
    asked = requests(tickets, questions)
    loop = asyncio.new_event_loop()
    return loaded, asked, loop, loop.run_until_complete(answers(LocalEngine(loaded), asked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="modes of qkv,o,gu,d: fp32 | bf16 | split each")
    parser.add_argument("--tickets", type=int, default=30)
    parser.add_argument("--questions", type=int, default=3, choices=[1, 3, 10])
    args = parser.parse_args()
    loaded, asked, loop, base = float32_answers(args.tickets, args.questions)
    for spec in args.variants:
        modes = dict(zip(GROUPS, spec.split(",")))
        engine = LocalEngine(loaded)
        variant = Variant(loaded.model, modes)
        engine.backend.decoder = variant
        dec.F = PatchedFunctional(variant)  # type: ignore[assignment]  # the decoder module's F, for this run only
        try:
            got = loop.run_until_complete(answers(engine, asked))
        finally:
            dec.F = F
        changes, agree, total = [], 0, 0
        for a, b in zip(base, got):
            for x, y in zip(a.answers, b.answers):
                changes.append(max(abs(p - q) for p, q in zip(x.probabilities, y.probabilities)))
                top = max(range(len(x.probabilities)), key=x.probabilities.__getitem__)
                agree += top == max(range(len(y.probabilities)), key=y.probabilities.__getitem__)
                total += 1
        changes.sort()
        print(f"{spec}: |dp| median {changes[len(changes) // 2]:.4f}, p90 {changes[int(len(changes) * 0.9)]:.4f}, "
              f"max {changes[-1]:.4f}, over 0.01: {sum(c > 0.01 for c in changes)} of {total}; "
              f"top option agrees {agree}/{total}")


if __name__ == "__main__":
    main()
