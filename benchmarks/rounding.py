"""Where a bf16 projection's error comes from: its weights, its inputs or its output, per group of projections, and
how much keeping a few outlier input channels exact buys back (issue 57's second study). Every variant is emulated in
float32, so it needs no bf16 operator: each rounding is applied alone, the product itself is float32's.

A variant gives each group (``qkv``, ``o``, ``gu``, ``d``: see ``precision.py``) a mode made of letters:

- ``w``: the weights rounded to bf16;
- ``i``: the inputs rounded to bf16; with ``kN`` (``ik4``), the N input channels of largest magnitude in this call
  kept exact (the outliers a bf16 matmul with a small float32 correction could carry);
- ``o``: the output rounded to bf16 (what an eager bf16 matmul on a CPU returns);
- ``x``: none (float32, the engine as it is).

``wi`` is therefore a bf16 matmul whose float32 accumulator is kept, an operator PyTorch 2.13 has only on CUDA
(``aten::mm.dtype``). With ``--stats``, the largest input magnitudes of each projection group and layer are printed.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rounding.py --tickets 30 --questions 3 wio,wio,wio,wio wi,wi,wi,wi \\
        wo,wo,wo,wo w,w,w,w wik4,wik4,wik4,wik4
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch
import torch.nn.functional as F
from precision import GROUPS, PatchedFunctional, answers, float32_answers

from decisiond.engine.backends import decoder as dec
from decisiond.engine.local import LocalEngine

GROUP = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gu", "up": "gu", "down": "d"}


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class Emulated(dec.LlamaDecoder):
    """The Llama decoder with each projection rounded as its group's mode says (the module's docstring)."""

    def __init__(self, model: Any, modes: dict[str, str]):
        super().__init__(model)
        self.stats: dict[tuple[str, int], torch.Tensor] = {}
        self.weights: dict[int, tuple[str, torch.Tensor, str, int]] = {}
        for index, layer in enumerate(self.layers):
            for name, group in GROUP.items():
                w = getattr(layer, name)
                mode = modes[group]
                self.weights[id(w)] = (mode, rounded(w) if "w" in mode else w, group, index)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        mode, w, group, index = self.weights[id(weight)]
        largest = x.abs().reshape(-1, x.shape[-1]).amax(0)
        seen = self.stats.setdefault((group, index), torch.zeros_like(largest))
        torch.maximum(seen, largest, out=seen)
        if "i" in mode:
            exact = re.search(r"k(\d+)", mode)
            inputs = rounded(x)
            if exact:
                keep = largest.topk(int(exact.group(1))).indices
                inputs[..., keep] = x[..., keep]
            x = inputs
        out = F.linear(x, w)
        if "o" in mode:
            out = rounded(out)
        return out if bias is None else out + bias


def changes(base: list[Any], got: list[Any]) -> list[float]:
    return sorted(max(abs(p - q) for p, q in zip(x.probabilities, y.probabilities))
                  for a, b in zip(base, got) for x, y in zip(a.answers, b.answers))


def print_stats(variant: Emulated) -> None:
    for (group, index), largest in sorted(variant.stats.items()):
        top = largest.topk(4)
        print(f"{group} layer {index}: largest |input| {[round(v, 1) for v in top.values.tolist()]} at channels "
              f"{top.indices.tolist()}, median channel {largest.median().item():.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="modes of qkv,o,gu,d, each letters of w, i[kN], o, or x")
    parser.add_argument("--tickets", type=int, default=30)
    parser.add_argument("--questions", type=int, default=3, choices=[1, 3, 10])
    parser.add_argument("--stats", action="store_true", help="print the largest input channels of the last variant")
    args = parser.parse_args()
    loaded, asked, loop, base = float32_answers(args.tickets, args.questions)
    for spec in args.variants:
        engine = LocalEngine(loaded)
        variant = Emulated(loaded.model, dict(zip(GROUPS, spec.split(","))))
        engine.backend.decoder = variant
        dec.F = PatchedFunctional(variant)  # type: ignore[assignment]  # the decoder module's F, for this run only
        try:
            got = changes(base, loop.run_until_complete(answers(engine, asked)))
        finally:
            dec.F = F
        print(f"{spec}: |dp| median {got[len(got) // 2]:.4f}, p90 {got[int(len(got) * 0.9)]:.4f}, "
              f"max {got[-1]:.4f}, over 0.01: {sum(c > 0.01 for c in got)} of {len(got)}", flush=True)
    if args.stats:
        print_stats(variant)


if __name__ == "__main__":
    main()
