"""An answer must answer the question asked. Every result a provider returns is checked against the request
before it reaches a client: one answer per question (or a refusal), one probability per candidate, each finite
and in [0, 1], together summing to 1 within ``SUM_TOLERANCE``. A result that fails is the provider's failure
(502 ``upstream_invalid_response``, which a failover chain routes around) — never a made-up answer."""

from __future__ import annotations

import math

from ..canonical import DecisionRequest, DecisionResult
from ..errors import ProviderError, provider_error

SUM_TOLERANCE = 1e-3


def _problem(request: DecisionRequest, result: DecisionResult) -> str | None:
    if len(result.answers) != len(request.questions):
        return f"{len(result.answers)} answers for {len(request.questions)} questions"
    for i, (answer, q) in enumerate(zip(result.answers, request.questions)):
        if answer.refusal:
            continue
        where = f"the answer to question {q.name!r}" if q.name is not None else f"the answer to question {i}"
        if answer.kind != q.kind:
            return f"{where} is a {answer.kind} answer to a {q.kind} question"
        if len(answer.probabilities) != q.candidates:
            return f"{where} has {len(answer.probabilities)} probabilities for {q.candidates} candidates"
        for p in answer.probabilities:
            if not (math.isfinite(p) and -1e-9 <= p <= 1 + 1e-9):
                return f"{where} holds the probability {p!r}, outside [0, 1]"
        total = math.fsum(answer.probabilities)
        if abs(total - 1.0) > SUM_TOLERANCE:
            return f"{where} has probabilities summing to {total:.6g}, not 1"
    return None


def check_result(request: DecisionRequest, result: DecisionResult, provider: str) -> None:
    """Raise a failover-able 502 naming what is wrong with ``result``."""
    problem = _problem(request, result)
    if problem is not None:
        error: ProviderError = provider_error(provider, 502, f"provider {provider!r} answered wrongly: {problem}",
                                              code="upstream_invalid_response")
        raise error
