"""What the engine needs from a model: log-probs of these label ids after these token-id prompts.

Everything else — prompt wording, chat templating and tokenizing, label checks, order and calibration modes,
batching requests across clients — is the engine's and does not depend on how the numbers are computed. A
backend gets the prompts of several requests at once (one ``Group`` per request; a request's prompts usually
share a long prefix, the document) and is free to compute them any way that gives each prompt's next-token
log-probs: shared prefixes once, a cache across calls, batches within a memory budget.

Example, a backend for any callable that gives next-token log-probs of one prompt (slow but complete)::

    class OnePassBackend:
        name = "one-pass"

        def __init__(self, next_logprobs, vocab_size):
            self.next_logprobs, self.vocab_size = next_logprobs, vocab_size

        def score(self, groups):
            out = []
            for g in groups:
                rows = [self.next_logprobs(p) for p in g.prompts]
                out.append(Scored([[row[i] for i in labels] for row, labels in zip(rows, g.labels)],
                                  computed_tokens=sum(map(len, g.prompts)), reused_tokens=0))
            return out

        def describe(self):
            return "one forward pass per prompt"

    engine = LocalEngine(loaded, backend=OnePassBackend(my_fn, 49152))

A backend that can stop between forward passes also offers ``steps(groups)``: a generator that yields after each
pass but the last (the tokens it computed) and returns what ``score`` would right after its last pass, so that the
answers go out as soon as they are computed. The scheduler then interleaves the passes of different requests, so a
small request is not stuck behind a large one, and stops computing a request whose callers have all gone. A backend
without ``steps`` is run as one step (``stepwise``).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ...errors import Unavailable


@dataclass
class Group:
    """One request's prompts (token ids) and, for each prompt, the label token ids to read after it."""

    prompts: list[list[int]]
    labels: list[list[int]]


@dataclass
class Scored:
    """A group's answer: the label log-probs per prompt (natural log, over the full vocabulary), the tokens the
    model ran for this group (each shared token once) and the prompt tokens taken from a cache across calls."""

    logprobs: list[list[float]]
    computed_tokens: int
    reused_tokens: int = 0
    # Per prompt, the model's final hidden state at the answer position (the input of its output layer): a float
    # vector (a list, or anything with ``tolist()``), where the backend reads it; None where it does not. What a
    # learned linear head reads (``gateway.learning``).
    features: list[Any] | None = None


class Backend(Protocol):
    name: str
    vocab_size: int

    def score(self, groups: Sequence[Group]) -> list[Scored]:
        """One ``Scored`` per group, in order. Called from one thread at a time (the scheduler's worker)."""
        ...

    def describe(self) -> str:
        """One line for model lists: what answers and how."""
        ...


# Yields the tokens of each forward pass but the last; returns one ``Scored`` per group after the last.
Steps = Generator[int, None, list[Scored]]


@runtime_checkable
class SteppedBackend(Backend, Protocol):
    def steps(self, groups: Sequence[Group]) -> Steps:
        """``score``, one forward pass per step."""
        ...


@runtime_checkable
class PacedBackend(SteppedBackend, Protocol):
    """A stepped backend whose passes the scheduler sizes: before each step it sets ``step_budget``, the padded
    tokens the next forward pass may take (short passes for a large request while others wait)."""

    step_budget: int


def stepwise(backend: Backend, groups: Sequence[Group]) -> Steps:
    """The backend's steps, or its whole ``score`` as one step."""
    if isinstance(backend, SteppedBackend):
        return (yield from backend.steps(groups))
    return backend.score(groups)
    yield 0  # unreachable: makes this a generator (one step, which returns the answers)


def run_steps(steps: Steps) -> list[Scored]:
    """Run every step; the result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: list[Scored] = done.value
            return result


def check_finite(scored: Scored) -> None:
    """NaN or infinite log-probs (overflow in a low precision, broken weights) are the model's failure, said
    plainly: they would otherwise become NaN probabilities or a label mass of 1."""
    for values in scored.logprobs:
        if not all(math.isfinite(v) for v in values):
            raise Unavailable(
                "the model produced non-finite label log-probabilities (NaN or infinity) for this request, so it "
                "cannot be answered; this usually means the model overflows in its dtype (try --dtype float32)",
                code="model_output_invalid", type="api_error")
