"""Learning profiles from a stored model's labels (``POST /admin/learn``, ``decisiond learn``), per target, question
and scope; ``gateway.learning`` fits and judges, ``gateway.profile_store`` keeps.

- **Read in pages.** The request ids of the newest ``LEARN_DECISIONS_MAX`` decisions with a label or a teacher label
  are read first, then their rows ``LEARN_PAGE`` at a time, each page turned into samples (off the event loop) and
  dropped: what stays is per target and question one list of compact columns (``Answers``: the features as one
  float32 array per answer, not base64 text and JSON).
- **Scopes.** A human label counts under the scope it was posted under (``decisions.label_scope``), a cascade's
  teacher label under ``/``. Each scope that has labels is learned on its own: from the labels of that scope and of
  the scopes above it (``profiles.enclosing``), never a sibling's or a narrower one's; where an answer has a human
  label visible there, it replaces the answer's teacher label. What is served now for a scope — the baseline — is
  the active profile of the most specific scope above or at it (``/`` last), fitted again per fold on its own
  samples (``learning.Baseline``). An accepted profile serves its scope and below.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import DecisionError
from ..limits import LEARN_PAGE
from ..store.tables import LearnedProfile
from .decisions import label_index
from .learning import Baseline, Outcome, decode_features, learn
from .learning_fits import Table
from .profile_store import ProfileStore, TrainingSet
from .profiles import enclosing, options

log = logging.getLogger("decisiond.gateway")

TEACHER_SCOPE = "/"  # a cascade's teacher labels: its own strong step's, the operator's


@dataclass
class Answers:
    """Every labelled answer of one target to one question, newest first, as columns; each with its label's scope,
    whether it is a teacher label, and which answer it is (``answer``: a human label replaces the teacher label of
    the same answer)."""

    target: str
    signature: str
    question: str
    base: list[list[float]] = field(default_factory=list)
    targets: list[list[float]] = field(default_factory=list)
    features: list[NDArray[np.float32] | None] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    scopes: list[str] = field(default_factory=list)
    teacher: list[bool] = field(default_factory=list)
    answer: list[tuple[int, int]] = field(default_factory=list)

    def add(self, base: list[float], target: list[float], features: NDArray[np.float32] | None, about: str,
            scope: str, teacher: bool, answer: tuple[int, int]) -> None:
        self.base.append(base)
        self.targets.append(target)
        self.features.append(features)
        self.inputs.append(about)
        self.scopes.append(scope)
        self.teacher.append(teacher)
        self.answer.append(answer)

    def learned_scopes(self) -> list[str]:
        """The scopes to learn: every scope a label of these answers counts under, the widest first."""
        return sorted(set(self.scopes), key=lambda s: (len(enclosing(s)), s))

    def visible(self, scope: str) -> list[int]:
        """The samples a profile of ``scope`` learns from, oldest first: the labels of ``scope`` and of the scopes
        above it, an answer's human label in place of its teacher label."""
        above = set(enclosing(scope))
        rows = [i for i, s in enumerate(self.scopes) if s in above]
        human = {self.answer[i] for i in rows if not self.teacher[i]}
        return [i for i in reversed(rows) if not self.teacher[i] or self.answer[i] not in human]

    def group(self, scope: str, rows: Sequence[int]) -> TrainingSet:
        """``rows`` (``visible(scope)``) as a ``TrainingSet`` whose samples are one ``Table``."""
        kept = [self.features[i] for i in rows]
        widths = {None if f is None else len(f) for f in kept}
        features = np.stack([f for f in kept if f is not None]).astype(np.float32, copy=False) \
            if rows and None not in widths and len(widths) == 1 else None
        table = Table(np.array([self.base[i] for i in rows], dtype=np.float64),
                      np.array([self.targets[i] for i in rows], dtype=np.float64), features,
                      [self.inputs[i] for i in rows])
        human = [i for i in rows if not self.teacher[i]]
        return TrainingSet(self.target, self.signature, self.question, table, len(human), scope,
                     sum(self.scopes[i] != scope for i in human))


def collect(rows: Sequence[tuple[Any, ...]], found: dict[tuple[str, str], Answers], start: int = 0) -> None:
    """Add the samples of ``rows`` (``profile_store.LEARNED_COLUMNS`` of stored decisions, numbered from ``start``)
    to ``found``, per (target, signature). Questions without a name or a signature (stored before profiles existed)
    are skipped, and so is a label without a scope (none after migration 0010: fail closed)."""
    for number, (_, questions, answers, labels, scopes, steps, teacher, sources, request) in enumerate(rows, start):
        labels, scopes, teacher = labels or {}, scopes or {}, teacher or {}
        about = hashlib.sha256(json.dumps((request or {}).get("input"), sort_keys=True).encode()).hexdigest()
        if steps:
            first = steps[0]
            given = {int(k): p for k, p in first["answers"].items()}
            origin = {int(k): s for k, s in (first.get("sources") or {}).items()}
        else:
            given = dict(enumerate(answers))
            origin = dict(enumerate(sources or []))
        for k, question in enumerate(questions):
            name, sig, src = question.get("name"), question.get("signature"), origin.get(k)
            if name is None or sig is None or not src or src.get("target") is None or given.get(k) is None:
                continue
            base = options(src.get("base") or given[k], question["type"])
            features = decode_features(src["features"]) if src.get("features") else None
            into = found.setdefault((src["target"], sig), Answers(src["target"], sig, name))
            gold = label_index(question, labels[name]) if name in labels else None
            if gold is not None and scopes.get(name) is not None:
                into.add(base, [float(i == gold) for i in range(len(question["values"]))], features, about,
                         scopes[name], False, (number, k))
            if steps and teacher.get(name) is not None:
                into.add(base, options(teacher[name], question["type"]), features, about, TEACHER_SCOPE, True,
                         (number, k))


async def learn_model(store: ProfileStore, model: str) -> dict[str, Any]:
    """``POST /admin/learn``: learn from ``model``'s stored decisions, per target, question and scope; accept what
    the rule allows. Reading the samples and fitting run in threads, off the event loop; one learning runs at a time
    in a process (another waits). A question whose learning fails is reported with its error; the others go on."""
    async with store.learning:
        ids = await store.labelled_ids(model)
        found: dict[tuple[str, str], Answers] = {}
        for start in range(0, len(ids), LEARN_PAGE):
            page = await store.labelled_rows(ids[start:start + LEARN_PAGE])
            await asyncio.to_thread(collect, page, found, start)
        serving = await store.active_rows()
        out = []
        for answers in sorted(found.values(), key=lambda a: (a.question, a.target)):
            for scope in answers.learned_scopes():
                report = await _learn_scope(store, model, answers, scope, serving)
                if report["profile"] is not None:  # what a narrower scope's learning is judged against now
                    serving = await store.active_rows()
                out.append(report)
    return {"object": "learning", "model": model, "decisions": len(ids), "scopes": _per_scope(out),
            "questions": out}


def serving_profile(active: Sequence[LearnedProfile], target: str, sig: str, scope: str) -> LearnedProfile | None:
    """Of the ``active`` profiles, the one serving ``scope``'s answers of ``target`` to ``sig``: that of the most
    specific scope at or above it (``ProfileBook.serving``'s choice)."""
    mine = {p.scope: p for p in active if p.target == target and p.signature == sig}
    return next((mine[s] for s in enclosing(scope) if s in mine), None)


def _strength(profile: LearnedProfile) -> float | None:
    """The strength a profile was fitted at (profiles accepted before it was kept: from its candidates)."""
    metrics = profile.metrics or {}
    if metrics.get("strength") is not None:
        return float(metrics["strength"])
    found = [c.get("strength") for c in metrics.get("candidates") or () if c.get("kind") == profile.kind]
    return float(found[0]) if found and found[0] is not None else None


def _judge(answers: Answers, scope: str, current: LearnedProfile | None) -> tuple[TrainingSet, Outcome]:
    """``scope``'s samples and what the rule decides on them, against ``current`` fitted again per fold on its own
    samples (in a thread: the tables are built and the fits made here)."""
    group = answers.group(scope, answers.visible(scope))
    baseline = None
    if current is not None:
        own = group.samples if current.scope == scope else answers.group(
            current.scope, answers.visible(current.scope)).samples
        baseline = Baseline(current.kind, current.params, _strength(current), own if isinstance(own, Table) else None)
    return group, learn(group.samples, baseline)


async def _learn_scope(store: ProfileStore, model: str, answers: Answers, scope: str,
                       serving: Sequence[LearnedProfile]) -> dict[str, Any]:
    """Learn one target's question for one scope: its report (``POST /admin/learn``'s ``questions``)."""
    current = serving_profile(serving, answers.target, answers.signature, scope)
    report: dict[str, Any] = {"question": answers.question, "target": answers.target,
                              "signature": answers.signature, "scope": scope,
                              "served_by": current.id if current is not None else None}
    try:
        group, outcome = await asyncio.to_thread(_judge, answers, scope, current)
        report.update(labels=group.labels, inherited_labels=group.inherited,
                      teacher_labels=_size(group) - group.labels)
        profile_id = await store.accept(model, group, outcome) if outcome.kind is not None else None
    except Exception as error:
        if not isinstance(error, DecisionError):
            log.exception("learning failed", extra={"model": model, "question": answers.question, "scope": scope})
        reason = error.message if isinstance(error, DecisionError) else f"learning failed: {type(error).__name__}"
        return {"labels": None, "inherited_labels": None, "teacher_labels": None, **report, "profile": None,
                "replaces": None, "accepted": None, "candidates": [], "served": {}, "samples": None,
                "reason": reason}
    if profile_id is not None:
        log.info("profile accepted", extra={"model": model, "target": answers.target, "question": answers.question,
                                            "scope": scope, "profile": profile_id, "kind": outcome.kind})
    replaces = current.id if current is not None and current.scope == scope and profile_id else None
    return {**report, "replaces": replaces, "profile": profile_id, **outcome.describe()}


def _size(group: TrainingSet) -> int:
    return group.samples.size if isinstance(group.samples, Table) else len(group.samples)


def _per_scope(questions: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per scope learned: how many questions were learned there, with how many labels, and how many accepted."""
    out: dict[str, dict[str, int]] = {}
    for q in questions:
        counts = out.setdefault(q["scope"], {"questions": 0, "labels": 0, "teacher_labels": 0, "accepted": 0})
        counts["questions"] += 1
        counts["labels"] += q["labels"] or 0
        counts["teacher_labels"] += q["teacher_labels"] or 0
        counts["accepted"] += q["profile"] is not None
    return out
