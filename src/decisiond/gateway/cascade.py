"""A cascade (``strategy: cascade``): every question of a request goes to the cascade's first step; each question
whose confidence is below that step's threshold goes on to the next step, in **one** call holding only those
questions, and so on down the steps. Each answer comes from the last step that was asked its question, in the
request's order.

- **Confidence**: a predicate's max(p, 1 − p), a choice's or a score's top probability — the probabilities the
  step returned, so after the model's calibration profile where it has one. A refusal has none (0): it escalates
  under any threshold above 0. Threshold 0 never escalates; a threshold above 1 always does.
- **Steps**: each step is a model name (a model, a raw upstream or a failover virtual model), answered by the
  router's own rules — skips and failover within the step, the cascade's deadline over all of them. A step none of
  whose targets can serve the (partial) request is skipped: its questions go on to the next step.
- **Calls**: every call is reported as a ``Step`` (even one that failed), so that the gateway prices each by the
  target that answered it and writes one usage row per call; the answer's usage is their sum.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, AsyncContextManager, Awaitable, Callable

from ..canonical import Answer, DecisionRequest, DecisionResult, Usage
from ..errors import ServerError
from . import pricing
from .catalog import Target

log = logging.getLogger("decisiond.gateway")

# The response header: how many of the request's questions went on past the first call, of how many.
ESCALATED_HEADER = "x-decisiond-escalated"

# Admission for one attempt on a target (its model and provider rate limits): an async context manager that
# raises a failover-able ProviderError when the target is at its limit, and yields something with
# ``settle(input_tokens)`` or None. The router's gates are of this type too.
Gate = Callable[[Target], AsyncContextManager[Any]]


@dataclass
class Step:
    """One call of a cascade: the step's model name, the targets it tried (failed attempts included: the last one
    answered), how many questions it was asked (and which), its answer (None when the call failed), its place in the
    cascade's targets (1 for the first) and how many of its answers were below its threshold, to go on to a later
    step."""

    name: str
    tried: list[Target]
    questions: int
    result: DecisionResult | None = None
    position: int = 1
    escalated: int = 0
    # The request's questions it was asked, by their place in the request (its answers are in this order).
    asked: tuple[int, ...] = ()

    @property
    def answered_by(self) -> Target | None:
        return self.tried[-1] if self.result is not None and self.tried else None

    @property
    def cost(self) -> float:
        """The call's price, by the target that answered it (0 for a failed call)."""
        target = self.answered_by
        if target is None or self.result is None:
            return 0.0
        return pricing.cost(target.price, self.result.usage, self.result.provider_format)


# Answer a (partial) request at one step (its model name and its place in the cascade), through the given gate.
Ask = Callable[[DecisionRequest, Step, Gate], Awaitable[DecisionResult]]


def confidence(answer: Answer) -> float:
    """The top probability (a predicate's max(p, 1 − p)); 0 for a refusal."""
    return 0.0 if answer.refusal or not answer.probabilities else max(answer.probabilities)


def unsure(answers: Sequence[Answer], threshold: float) -> list[int]:
    """The positions of the answers whose confidence is below ``threshold``."""
    return [i for i, answer in enumerate(answers) if confidence(answer) < threshold]


def escalated(steps: Sequence[Step]) -> int:
    """How many questions went on past the first call (every later call asks a subset of the second's)."""
    return steps[1].questions if len(steps) > 1 else 0


def summed(usages: Sequence[Usage]) -> Usage:
    costs = [u.cost for u in usages if u.cost is not None]
    return Usage(input_tokens=sum(u.input_tokens for u in usages), cached_tokens=sum(u.cached_tokens for u in usages),
                 cache_write_tokens=sum(u.cache_write_tokens for u in usages),
                 output_tokens=sum(u.output_tokens for u in usages),
                 reasoning_tokens=sum(u.reasoning_tokens for u in usages), cost=sum(costs) if costs else None)


def merged(answers: Sequence[Answer | None], results: Sequence[DecisionResult]) -> DecisionResult:
    """The cascade's answer: every question's answer in the request's order, the usage of every call summed, the
    model of the last call, and the wire formats that answered (``local+openai`` when they differ)."""
    if not results or any(a is None for a in answers):
        raise ServerError("a cascade ended with questions no step answered")
    versions = {r.prompt_format_version for r in results}
    formats = list(dict.fromkeys(r.provider_format for r in results))
    return DecisionResult(model=results[-1].model, answers=[a for a in answers if a is not None],
                          usage=summed([r.usage for r in results]),
                          prompt_format_version=versions.pop() if len(versions) == 1 else None,
                          provider_format="+".join(formats))


async def run(request: DecisionRequest, steps: Sequence[str], thresholds: Sequence[float], ask: Ask,
              servable: Callable[[DecisionRequest, str], bool], gate: Gate,
              report: Callable[[Step], None]) -> DecisionResult:
    """Answer ``request`` down the cascade's ``steps`` (``thresholds``: one per step but the last)."""
    answers: list[Answer | None] = [None] * len(request.questions)
    pending = list(range(len(request.questions)))
    results: list[DecisionResult] = []
    for i, name in enumerate(steps):
        last = i == len(steps) - 1
        asked = request if len(pending) == len(request.questions) else dataclasses.replace(
            request, questions=tuple(request.questions[k] for k in pending))
        if (results or not last) and not servable(asked, name):
            log.warning("skipping cascade step", extra={"step": name, "questions": len(pending),
                                                        "reason": "no target of the step can serve the request"})
            continue
        step = Step(name, [], len(pending), position=i + 1, asked=tuple(pending))

        def step_gate(target: Target, tried: list[Target] = step.tried) -> AsyncContextManager[Any]:
            tried.append(target)
            return gate(target)

        going_on: list[int] = []
        try:
            result = step.result = await ask(asked, step, step_gate)
            going_on = [] if last else unsure(result.answers, thresholds[i])
            step.escalated = len(going_on)
        finally:
            report(step)  # a failed call too: it has its usage row
        results.append(result)
        for k, answer in zip(pending, result.answers):
            answers[k] = answer
        pending = [pending[j] for j in going_on]
        if not pending:
            break
    return merged(answers, results)
