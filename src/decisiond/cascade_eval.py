"""``decisiond eval SET --cascade NAME``: what a cascade's threshold buys, measured on labeled data, so that a user
picks the threshold that meets their accuracy at the lowest cost.

Every item is answered down the cascade (``gateway.cascade``, the gateway's own rules: the steps, their failover,
their prices) once per threshold of ``THRESHOLDS``, the same threshold at every step, and also at 0 (the first step
alone) and above 1 (every question to the last step). A call is made once and remembered: a threshold that sends
the same questions of an item to the same step reuses the answer (a step is asked at most one call per distinct
set of questions, so at most one per question of the item). Per threshold: the share of questions escalated past
the first call, the accuracy and log loss of the answers (``scores.metrics``), and the estimated cost per
1,000 requests: the mean over items of the calls' prices (each call priced by the target that answered it, on the
usage it reported) times 1,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .canonical import DecisionRequest, DecisionResult
from .evaluation import LabeledItem
from .gateway import cascade
from .gateway.catalog import Target
from .scores import metrics

if TYPE_CHECKING:
    from .gateway.router import Router

THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
NEVER, ALWAYS = 0.0, math.inf  # the first step alone; every question to the last step
CONCURRENCY = 4


class Calls:
    """The calls of a sweep, each made once: (step, item, questions) → the answer and the targets tried."""

    def __init__(self, router: Router):
        self.router = router
        self.made: dict[tuple[str, int, tuple[int, ...]], tuple[DecisionResult, list[Target]]] = {}

    def ask(self, item: int) -> cascade.Ask:
        async def ask(request: DecisionRequest, step: cascade.Step, gate: cascade.Gate) -> DecisionResult:
            key = (step.name, item, tuple(id(q) for q in request.questions))
            if key not in self.made:
                tried: list[Target] = []

                def note(target: Target) -> contextlib.nullcontext[None]:
                    tried.append(target)
                    return contextlib.nullcontext()

                result = await self.router.decide(request, self.router.catalog.canonical(step.name) or step.name, note)
                self.made[key] = (result, tried)
            result, tried = self.made[key]
            for target in tried:  # the cascade's step learns who answered, as on a live call
                async with gate(target):
                    pass
            return result
        return ask


async def _answer(router: Router, calls: Calls, number: int, item: LabeledItem, steps: list[str],
                  threshold: float) -> tuple[DecisionResult, list[cascade.Step]]:
    made: list[cascade.Step] = []
    request = dataclasses.replace(item.request, model=None)
    thresholds = [threshold] * (len(steps) - 1)
    result = await cascade.run(request, steps, thresholds, calls.ask(number),
                               lambda asked, step: router.catalog.first_target(asked, step) is not None,
                               lambda target: contextlib.nullcontext(), made.append)
    return result, made


async def sweep(router: Router, name: str, items: list[LabeledItem], thresholds: tuple[float, ...] = THRESHOLDS,
                progress: bool = True) -> dict[str, Any]:
    """The report: per threshold (and the two references) escalated share, accuracy, log loss, cost per 1,000."""
    from tqdm import tqdm

    canonical = router.catalog.canonical(name) or name
    steps = router.catalog.cascade_steps(canonical)
    if steps is None:
        raise ValueError(f"{name!r} is not a cascade of this config (strategy: cascade)")
    calls = Calls(router)
    levels = [NEVER, *sorted(thresholds), ALWAYS]
    outcome: dict[float, list[tuple[DecisionResult, list[cascade.Step]]]] = {t: [] for t in levels}
    semaphore = asyncio.Semaphore(CONCURRENCY)
    bar = tqdm(total=len(items), desc="cascade", unit="item", disable=not progress)

    async def one(number: int, item: LabeledItem) -> list[tuple[DecisionResult, list[cascade.Step]]]:
        async with semaphore:
            done = [await _answer(router, calls, number, item, steps, t) for t in levels]
            bar.update(1)
            return done

    try:
        per_item = await asyncio.gather(*(one(n, item) for n, item in enumerate(items)))
    finally:
        bar.close()
    for done in per_item:
        for t, answered in zip(levels, done):
            outcome[t].append(answered)
    rows = [_row(t, outcome[t], items) for t in levels]
    return {"cascade": canonical, "steps": steps, "items": len(items),
            "questions": sum(len(i.gold) for i in items), "calls": len(calls.made),
            "rows": rows[1:-1],
            "first_step_only": rows[0], "every_question_escalated": rows[-1]}


def _row(threshold: float, answered: list[tuple[DecisionResult, list[cascade.Step]]],
         items: list[LabeledItem]) -> dict[str, Any]:
    pairs = [(a.probabilities, gold) for (result, _), item in zip(answered, items)
             for a, gold in zip(result.answers, item.gold)]
    measured = metrics(pairs, 0.5)
    escalated = sum(cascade.escalated(steps) for _, steps in answered)
    cost = math.fsum(s.cost for _, steps in answered for s in steps) / len(answered)
    return {"threshold": threshold if math.isfinite(threshold) else None, "escalated": escalated / len(pairs),
            "accuracy": measured["accuracy"], "log_loss": measured["log_loss"], "cost_per_1000": cost * 1000,
            "calls_per_request": sum(len(steps) for _, steps in answered) / len(answered)}


def table(report: dict[str, Any]) -> str:
    """Markdown: one row per threshold, between the two references."""
    lines = [f"Cascade {report['cascade']} ({' → '.join(report['steps'])}), {report['items']} items, "
             f"{report['questions']} questions:", "",
             "| escalate below | escalated | accuracy | log loss | calls per request | cost per 1,000 requests |",
             "|---|---:|---:|---:|---:|---:|"]
    rows = [("never (first step only)", report["first_step_only"]),
            *((f"{r['threshold']:g}", r) for r in report["rows"]),
            ("always (every question escalated)", report["every_question_escalated"])]
    for label, r in rows:
        lines.append(f"| {label} | {r['escalated']:.1%} | {r['accuracy']:.3f} | {r['log_loss']:.3f} | "
                     f"{r['calls_per_request']:.2f} | ${r['cost_per_1000']:.4f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Accuracy against cost per 1,000 requests (each point labeled with its threshold), and the share escalated,
    accuracy and log loss against the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (trade, by_threshold) = plt.subplots(2, 1, figsize=(7, 9), dpi=100)
    trade.plot([r["cost_per_1000"] for r in rows], [r["accuracy"] for r in rows], marker="o", color="C0",
               label="cascade")
    for r in rows:
        trade.annotate(f"{r['threshold']:g}", (r["cost_per_1000"], r["accuracy"]), textcoords="offset points",
                       xytext=(4, 3), fontsize=7)
    for key, label, marker in (("first_step_only", "first step only", "s"),
                               ("every_question_escalated", "every question escalated", "^")):
        ref = report[key]
        trade.plot([ref["cost_per_1000"]], [ref["accuracy"]], marker=marker, linestyle="", label=label)
    trade.set_xlabel("estimated cost per 1,000 requests (USD)")
    trade.set_ylabel("accuracy")
    trade.set_title(f"Cascade {report['cascade']}: {' → '.join(report['steps'])}, {report['questions']} questions\n"
                    "(numbers: escalate_below)", fontsize=10)
    trade.legend(fontsize=7)
    x = [r["threshold"] for r in rows]
    by_threshold.plot(x, [r["escalated"] for r in rows], marker=".", label="share escalated")
    by_threshold.plot(x, [r["accuracy"] for r in rows], marker=".", label="accuracy")
    by_threshold.plot(x, [r["log_loss"] for r in rows], marker=".", label="log loss")
    by_threshold.set_xlabel("escalate_below")
    by_threshold.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
