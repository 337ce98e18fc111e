"""What an accurate bf16 path costs end to end on a CPU (issue 57's second study): the float32 engine beside two
mixed-precision decoders, the same tickets, taking turns, a request at a time as ``decisiond bench`` asks them.

- ``bf16``: the seven projections of each layer as eager bf16 matmuls (bf16 weights, the input cast to bf16, the
  output cast back); the residual stream, norms, rotary, attention and the output layer stay float32. Its outputs
  are rounded to bf16, so it cannot meet 0.01 (``rounding.py``: ``wio``).
- ``fpmath``: the projections through oneDNN's fpmath mode (``torch.backends.mkldnn.matmul.fp32_precision =
  "bf16"``, set around each projection only) on float32 tensors holding bf16-rounded weights, so the output keeps
  its float32 accumulator, plus the 4 input channels of largest magnitude computed exactly in float32: the variant
  that ``rounding.py`` measures within 0.01 (``wik4``).

Each variant answers from an empty prefix cache, on the one engine's scorer thread (one OpenMP pool for all).
Prints questions/s of each, the ratio to float32, and the largest change of any option's probability.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/mixed_rate.py --tickets 30 --questions 3 --rounds 3 bf16 fpmath
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from precision import PatchedFunctional, answers
from rounding import changes

from decisiond.bench.workload import requests
from decisiond.engine import model as model_mod
from decisiond.engine.backends import decoder as dec
from decisiond.engine.local import LocalEngine

EXACT_CHANNELS = 4
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class Mixed(dec.LlamaDecoder):
    """The Llama decoder with its projections computed as ``mode`` says (the module's docstring)."""

    def __init__(self, model: Any, mode: str):
        super().__init__(model)
        self.mode = mode
        held = (lambda w: w.to(torch.bfloat16).float()) if mode == "fpmath" else (lambda w: w.to(torch.bfloat16))
        self.weights = {id(w): held(w) for layer in self.layers for w in (getattr(layer, n) for n in PROJECTIONS)}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weights[id(weight)]
        if self.mode == "bf16":
            out = F.linear(x.to(torch.bfloat16), w).float()
        else:
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            try:
                out = F.linear(x, w)
            finally:
                torch.backends.mkldnn.matmul.fp32_precision = "ieee"
            keep = x.reshape(-1, x.shape[-1]).abs().amax(0).topk(EXACT_CHANNELS).indices
            kept = x[..., keep]
            out += F.linear(kept - kept.to(torch.bfloat16).float(), w[:, keep])
        return out if bias is None else out + bias


def timed(loop: asyncio.AbstractEventLoop, engine: LocalEngine, asked: list[Any],
          variant: Any) -> tuple[float, list[Any]]:
    """One pass over ``asked`` with ``variant`` as the engine's decoder, from an empty prefix cache."""
    engine.backend.decoder = variant
    engine.backend.prefixes.clear()
    if isinstance(variant, Mixed):
        dec.F = PatchedFunctional(variant)  # type: ignore[assignment]  # the decoder module's F, for this run only
    try:
        start = time.perf_counter()
        got = loop.run_until_complete(answers(engine, asked))
        return time.perf_counter() - start, got
    finally:
        dec.F = F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="+", choices=["bf16", "fpmath"])
    parser.add_argument("--tickets", type=int, default=30)
    parser.add_argument("--questions", type=int, default=3, choices=[1, 3, 10])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loaded = model_mod.load("default", dtype="float32")
    asked = requests(args.tickets, args.questions)
    loop = asyncio.new_event_loop()
    engine = LocalEngine(loaded)  # one engine, one scorer thread: one OpenMP pool for every variant
    variants: dict[str, Any] = {"float32": engine.backend.decoder}
    variants.update({mode: Mixed(loaded.model, mode) for mode in args.modes})
    times: dict[str, list[float]] = {name: [] for name in variants}
    got: dict[str, list[Any]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not counted
        for name, variant in variants.items():
            took, got[name] = timed(loop, engine, asked, variant)
            times[name].append(took)
    answered = args.tickets * args.questions
    base = statistics.median(times["float32"][1:])
    for name, taken in times.items():
        median = statistics.median(taken[1:])
        worst = changes(got["float32"], got[name])[-1]
        print(f"{name}: {answered / median:.2f} questions/s, {base / median:.2f}x float32, max |dp| {worst:.4f}")


if __name__ == "__main__":
    main()
