#!/usr/bin/env python
"""Whether the in-process engine runs slower right after the naive loop in the same process (benchmarks/ENGINE_NOTES.md,
2026-12-07): blocks of 10 new 3-question tickets, answered by the engine (e) or the naive loop (n) in the order given.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/interleave.py e,e,e,n,e,n,e,e

Prints each block's questions per second. Only the spread between blocks of one kind, and the ratio, mean anything.
"""

import sys
import time

from decisiond.bench import workload
from decisiond.bench.measure import naive_decide
from decisiond.canonical import DecisionRequest
from decisiond.engine.local import LocalEngine
from decisiond.engine.model import load


def main(order: list[str]) -> None:
    loaded = load("default", dtype="float32", device="cpu")
    engine = LocalEngine(loaded)

    def naive(request: DecisionRequest) -> object:
        return engine.scheduler.call(lambda: naive_decide(loaded.model, loaded.tokenizer, request))

    for request in workload.requests(2, 3, seed=1000):
        engine.decide(request)
    for i, who in enumerate(order):
        requests = workload.requests(10, 3, seed=1001 + i)
        answer = engine.decide if who == "e" else naive
        start = time.perf_counter()
        for request in requests:
            answer(request)
        print(who, f"{30 / (time.perf_counter() - start):.2f} q/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["e", "e", "n", "e", "n", "e"])
