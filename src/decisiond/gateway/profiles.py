"""Learned profiles, as served: the active ones of this process, applied by the router to each target's answers.
Fitted by ``gateway.learning``, kept and learned by ``gateway.profile_store``.

- **Learning** (``profile_store.learn_model``; ``POST /admin/learn``, ``decisiond learn``): the newest
  ``LEARN_DECISIONS_MAX`` stored decisions of a model with labels (or, for a cascade, teacher labels) give, per
  target and question, samples of what the target answered; ``gateway.learning`` fits the candidates and applies
  the acceptance rule. An accepted profile is a new row, made the active one of its target and question in the same
  transaction.
- **Whose answers.** A profile belongs to the *target* that answered (a model entry of the catalog) and to the
  question, by its ``signature``: its type, name, instructions and options, so that a question reworded is a new
  question. For a plain model, the samples are its own answers; for a cascade, its first step's answers, with the
  human label where there is one and else the later step's answer (the teacher). The profile then applies wherever
  that target answers that question: alone, or as a cascade's first step, before its threshold is read (so that
  a confident profile escalates fewer questions).
- **Serving** (``ProfileBook``): each process holds the active profiles, read from the database in one query every
  ``learning.refresh_s`` and at once after a change it made; an answer a profile changed keeps the probabilities it
  replaced (``Answer.base``) and its id (``Answer.profile``, the ``x-decisiond-profile`` header).
- **Guarantee**: at most one profile is active per target and question (a partial unique index): a change is one
  transaction, so every replica reads either the old active set or the new one, never a mix.
- **Rollback**: ``PUT /admin/profiles/{id} {"active": false}`` deactivates a profile and makes the one it displaced
  active again (where there was one); ``{"active": true}`` makes any accepted profile the active one.
- **Not applied** to a request that sets its own ``temperature``, ``order`` or ``calibrate``: a profile was learned
  from the target's defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import probability
from ..canonical import DecisionRequest, DecisionResult, Question
from .fingerprint import request_tree
from .learning import predict, prepare

log = logging.getLogger("decisiond.gateway")

PROFILE_HEADER = "x-decisiond-profile"


def signature(question: Question) -> str:
    """What makes two questions the same question to a profile: type, name, instructions and options (SHA-256)."""
    text = json.dumps(request_tree(question), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Active:
    id: str
    kind: str
    params: dict[str, Any]  # a head's weights and intercept as arrays (``learning.prepare``)


class ProfileBook:
    """The active profiles of this process, by target name and question signature (replaced whole on each read)."""

    def __init__(self) -> None:
        self._by_target: dict[str, dict[str, Active]] = {}
        self.generation = ""

    @property
    def ids(self) -> set[str]:
        return {a.id for active in self._by_target.values() for a in active.values()}

    def replace(self, rows: Sequence[tuple[str, str, str, str, dict[str, Any]]]) -> None:
        """``rows``: (id, target, signature, kind, params) of every active profile; their weights become arrays
        here, once."""
        by_target: dict[str, dict[str, Active]] = {}
        for id_, target, sig, kind, params in rows:
            by_target.setdefault(target, {})[sig] = Active(id_, kind, prepare(kind, params))
        self._by_target = by_target
        self.generation = hashlib.sha256(",".join(sorted(r[0] for r in rows)).encode()).hexdigest()[:16] \
            if rows else ""

    def apply(self, target: str, request: DecisionRequest, result: DecisionResult) -> None:
        """Replace the probabilities of each answer whose question has an active profile for ``target``. A request
        that sets its own temperature, option order or calibration gets the target's plain answers: a profile was
        learned from, and speaks for, the target's defaults."""
        active = self._by_target.get(target)
        if not active or request.temperature is not None or request.order is not None or \
                request.calibrate is not None:
            return
        for question, answer in zip(request.questions, result.answers):
            profile = active.get(signature(question))
            if profile is None or answer.refusal or not answer.probabilities:
                continue
            try:
                changed = predict(profile.kind, profile.params, options(answer.probabilities, question.kind),
                                  answer.features)
            except Exception:  # a profile that cannot read this answer leaves it as it is
                log.exception("profile not applied", extra={"profile": profile.id, "target": target})
                continue
            if changed is None:
                continue
            answer.base, answer.profile = list(answer.probabilities), profile.id
            answer.probabilities = changed if len(answer.probabilities) == len(changed) else changed[:1]
            answer.confidence = probability.confidence(answer.kind, answer.probabilities)


def options(probabilities: list[float], kind: str) -> list[float]:
    """An answer's probabilities, one per option: a predicate's, whether given as [p] or [p, q], as (p, 1 − p)."""
    if kind == "yes_no":
        return [probabilities[0], 1.0 - probabilities[0]]
    return list(probabilities)
