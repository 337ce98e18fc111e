"""Learned profiles, as served: the active ones of this process, applied by the router to each target's answers.
Fitted by ``gateway.learning``, kept by ``gateway.profile_store``, learned by ``gateway.profile_learning``.

- **Learning** (``profile_learning.learn_model``; ``POST /admin/learn``, ``decisiond learn``): the newest
  ``LEARN_DECISIONS_MAX`` stored decisions of a model with labels (or, for a cascade, teacher labels) give, per
  target, question and scope, samples of what the target answered; ``gateway.learning`` fits the candidates and
  applies the acceptance rule. An accepted profile is a new row, made the active one of its target, question and
  scope in the same transaction.
- **Whose answers.** A profile belongs to the *target* that answered (a model entry of the catalog) and to the
  question, by its ``signature``: its type, name, instructions and options, so that a question reworded is a new
  question. For a plain model, the samples are its own answers; for a cascade, its first step's answers, with the
  human label where there is one and else the later step's answer (the teacher). The profile then applies wherever
  that target answers that question: alone, or as a cascade's first step, before its threshold is read (so that
  a confident profile escalates fewer questions).
- **Serving** (``ProfileBook``): each process holds the active profiles, read from the database in one query every
  ``learning.refresh_s`` and at once after a change it made; an answer a profile changed keeps the probabilities it
  replaced (``Answer.base``) and its id (``Answer.profile``, the ``x-decisiond-profile`` header).
- **Scopes** (learning stays in its tenant): a label counts for the user path it was posted under and below
  (``decisions.label_scope``; a cascade's teacher labels and the master key's are ``/``, the operator's). A profile
  has a scope, the user path whose requests it serves: it learned from the labels of that scope and of the scopes
  above it, never from a sibling's. A request is served by the active profile of the most specific scope that
  contains its caller's user path (``/`` last; ``ProfileBook.serving``), and the response cache keys on the set of
  profiles that may serve that path (``ProfileBook.generation``).
- **Guarantee**: at most one profile is active per target, question and scope (a partial unique index): a change is
  one transaction, so every replica reads either the old active set or the new one, never a mix.
- **Rollback**: ``PUT /admin/profiles/{id} {"active": false}`` deactivates a profile and makes the one it displaced
  in its scope active again (where there was one); ``{"active": true}`` makes any accepted profile the active one of
  its scope.
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
    """What makes two questions the same question to a profile: type, name, instructions and options (SHA-256).
    Hashed once per question: kept on the (frozen) question as ``functools.cached_property`` keeps a value, for a
    request that reads it twice (to apply its profiles, and to store its decision)."""
    known: str | None = question.__dict__.get("_signature")
    if known is None:
        text = json.dumps(request_tree(question), separators=(",", ":"), ensure_ascii=False)
        known = question.__dict__["_signature"] = hashlib.sha256(text.encode()).hexdigest()[:32]
    return known


@dataclass(frozen=True)
class Active:
    id: str
    kind: str
    params: dict[str, Any]  # a head's weights and intercept as arrays (``learning.prepare``)


def enclosing(user_path: str) -> list[str]:
    """The scopes whose profiles may serve ``user_path``, the most specific first: the path itself and each path
    above it, ``/`` last (``/team/a/bob`` → ``/team/a/bob``, ``/team/a``, ``/team``, ``/``): the paths it is
    ``settings.in_subtree`` of."""
    parts = [p for p in user_path.split("/") if p]
    return ["/" + "/".join(parts[:n]) for n in range(len(parts), -1, -1)]


class ProfileBook:
    """The active profiles of this process, by target name, question signature and scope (replaced whole on each
    read). A request is served, per question, by the active profile of the most specific scope that contains its
    caller's user path (``/`` last); no other."""

    def __init__(self) -> None:
        self._by_target: dict[str, dict[str, dict[str, Active]]] = {}
        self._ids_by_scope: dict[str, list[str]] = {}

    @property
    def ids(self) -> set[str]:
        return {i for ids in self._ids_by_scope.values() for i in ids}

    def replace(self, rows: Sequence[tuple[str, str, str, str, str, dict[str, Any]]]) -> None:
        """``rows``: (id, target, signature, scope, kind, params) of every active profile; their weights become
        arrays here, once."""
        by_target: dict[str, dict[str, dict[str, Active]]] = {}
        ids_by_scope: dict[str, list[str]] = {}
        for id_, target, sig, scope, kind, params in rows:
            by_target.setdefault(target, {}).setdefault(sig, {})[scope] = Active(id_, kind, prepare(kind, params))
            ids_by_scope.setdefault(scope, []).append(id_)
        self._by_target, self._ids_by_scope = by_target, {s: sorted(i) for s, i in ids_by_scope.items()}

    def generation(self, user_path: str) -> str:
        """The set of active profiles that may serve ``user_path`` (those of its ``enclosing`` scopes), as a short
        hash; "" for none. Two callers with the same generation get the same answers from the same request (the
        response cache keys on it)."""
        ids = [i for scope in enclosing(user_path) for i in self._ids_by_scope.get(scope, ())]
        return hashlib.sha256(",".join(ids).encode()).hexdigest()[:16] if ids else ""

    def serving(self, target: str, sig: str, user_path: str) -> Active | None:
        """The profile that serves ``user_path``'s answers of ``target`` to the question ``sig``, if any."""
        by_scope = self._by_target.get(target, {}).get(sig)
        if not by_scope:
            return None
        return next((by_scope[s] for s in enclosing(user_path) if s in by_scope), None)

    def apply(self, target: str, request: DecisionRequest, result: DecisionResult, user_path: str = "/") -> None:
        """Replace the probabilities of each answer whose question has a profile serving ``user_path`` for
        ``target`` (``serving``). A request that sets its own temperature, option order or calibration gets the
        target's plain answers: a profile was learned from, and speaks for, the target's defaults."""
        if target not in self._by_target or request.temperature is not None or request.order is not None or \
                request.calibrate is not None:
            return
        for question, answer in zip(request.questions, result.answers):
            if answer.refusal or not answer.probabilities:
                continue
            profile = self.serving(target, signature(question), user_path)
            if profile is None:
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
