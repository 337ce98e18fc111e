"""Learned profiles, kept and learned: versioned rows on the gateway's database, and the learning that makes them.
(What they are and how they are served: ``gateway.profiles``.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ..errors import DecisionError, InvalidRequest, NotFound
from ..limits import LEARN_DECISIONS_MAX
from ..store.db import Database, aware
from ..store.tables import LearnedProfile, StoredDecision
from .decisions import label_index
from .learning import Outcome, Sample, decode_features, learn, predict, prepare
from .profiles import Active, options

log = logging.getLogger("decisiond.gateway")


# ------------------------------------------------------------------------------------------------- samples


@dataclass
class Group:
    """The samples of one target's answers to one question."""

    target: str
    signature: str
    question: str
    samples: list[Sample]
    labels: int = 0  # of which human labels (the rest teacher labels)


def samples(rows: Sequence[tuple[Any, Any, Any, Any, Any, Any, Any]]) -> dict[tuple[str, str], Group]:
    """Per (target, signature), the samples of ``rows``: (questions, answers, labels, steps, teacher, sources,
    request) of stored decisions. Questions without a name or a signature (stored before profiles existed) are
    skipped; the samples of one input share a cross-validation fold."""
    groups: dict[tuple[str, str], Group] = {}
    for questions, answers, labels, steps, teacher, sources, request in rows:
        labels, teacher = labels or {}, teacher or {}
        about = hashlib.sha256(json.dumps((request or {}).get("input"), sort_keys=True).encode()).hexdigest()
        if steps:
            first = steps[0]
            given = {int(k): p for k, p in first["answers"].items()}
            origin = {int(k): s for k, s in (first.get("sources") or {}).items()}
        else:
            given = dict(enumerate(answers))
            origin = dict(enumerate(sources or []))
        for k, question in enumerate(questions):
            name, sig = question.get("name"), question.get("signature")
            src = origin.get(k)
            if name is None or sig is None or not src or src.get("target") is None or given.get(k) is None:
                continue
            width = len(question["values"])
            if name in labels:
                gold = label_index(question, labels[name])
                if gold is None:
                    continue
                target = [float(i == gold) for i in range(width)]
            elif name in teacher and steps and teacher[name] is not None:
                target = options(teacher[name], question["type"])
            else:
                continue
            base = options(src.get("base") or given[k], question["type"])
            features = decode_features(src["features"]) if src.get("features") else None
            group = groups.setdefault((src["target"], sig), Group(src["target"], sig, name, []))
            group.samples.append(Sample(base, features, target, about))
            group.labels += name in labels
    return groups


# --------------------------------------------------------------------------------------------------- store


class ProfileStore:
    """Learned profiles on the gateway's database."""

    def __init__(self, db: Database):
        self.db = db
        # One learning at a time (``learn_model``): each holds its samples and fits in memory.
        self.learning = asyncio.Lock()

    async def active_ids(self) -> set[str]:
        async with self.db.session() as session:
            return set((await session.execute(select(LearnedProfile.id).where(
                LearnedProfile.active.is_(True)))).scalars())

    async def active(self) -> list[tuple[str, str, str, str, dict[str, Any]]]:
        async with self.db.session() as session:
            rows = (await session.execute(select(
                LearnedProfile.id, LearnedProfile.target, LearnedProfile.signature, LearnedProfile.kind,
                LearnedProfile.params).where(LearnedProfile.active.is_(True)))).all()
        return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def listing(self, model: str | None) -> list[LearnedProfile]:
        query = select(LearnedProfile).order_by(LearnedProfile.created_at.desc())
        if model is not None:
            query = query.where(or_(LearnedProfile.model == model, LearnedProfile.target == model))
        async with self.db.session() as session:
            return list((await session.execute(query.limit(1000))).scalars())

    async def get(self, profile_id: str) -> LearnedProfile:
        async with self.db.session() as session:
            row = await session.get(LearnedProfile, profile_id)
        if row is None:
            raise NotFound(f"no profile {profile_id[:100]!r}", ("profile_id",), code="profile_not_found")
        return row

    async def accept(self, model: str, group: Group, outcome: Outcome, now: datetime | None = None) -> str:
        """Store an accepted profile as the active one of its target and question, in one transaction."""
        now = now or datetime.now(timezone.utc)
        profile_id = "prof_" + uuid.uuid4().hex[:24]
        chosen = outcome.chosen
        assert outcome.kind is not None and outcome.params is not None and chosen is not None

        def run(connection: Connection) -> None:
            where = (LearnedProfile.target == group.target, LearnedProfile.signature == group.signature)
            version = connection.execute(select(func.count()).select_from(LearnedProfile).where(*where)).scalar_one()
            replaced = connection.execute(select(LearnedProfile.id).where(
                *where, LearnedProfile.active.is_(True))).scalar_one_or_none()
            connection.execute(update(LearnedProfile).where(*where, LearnedProfile.active.is_(True)).values(
                active=False))
            connection.execute(insert(LearnedProfile).values(
                id=profile_id, model=model, target=group.target, question=group.question, signature=group.signature,
                version=int(version) + 1, kind=outcome.kind, params=outcome.params,
                metrics={**outcome.describe(), "labels": group.labels, "replaced": replaced,
                         "cv": chosen.metrics},
                accepted=True, active=True, created_at=now, activated_at=now))

        await self._changing(run)
        return profile_id

    async def set_active(self, profile_id: str, active: bool, now: datetime | None = None) -> str | None:
        """Make the profile the active one of its target and question, or deactivate it and reactivate the one it
        replaced (if any); the id active now for its question (None: the base answers)."""
        now = now or datetime.now(timezone.utc)
        row = await self.get(profile_id)

        def run(connection: Connection) -> str | None:
            where = (LearnedProfile.target == row.target, LearnedProfile.signature == row.signature)
            current = connection.execute(select(LearnedProfile.id).where(
                *where, LearnedProfile.active.is_(True))).scalar_one_or_none()
            if active:
                if current != profile_id:
                    connection.execute(update(LearnedProfile).where(*where, LearnedProfile.active.is_(True)).values(
                        active=False))
                    # What a rollback of it serves again: the profile it displaces now.
                    metrics = connection.execute(select(LearnedProfile.metrics).where(
                        LearnedProfile.id == profile_id)).scalar_one()
                    connection.execute(update(LearnedProfile).where(LearnedProfile.id == profile_id).values(
                        active=True, activated_at=now, metrics={**(metrics or {}), "replaced": current}))
                return profile_id
            if current != profile_id:
                return current  # not the one served: nothing to roll back
            connection.execute(update(LearnedProfile).where(LearnedProfile.id == profile_id).values(active=False))
            previous = (connection.execute(select(LearnedProfile.metrics).where(
                LearnedProfile.id == profile_id)).scalar_one() or {}).get("replaced")
            if previous is not None and connection.execute(update(LearnedProfile).where(
                    LearnedProfile.id == previous, *where).values(active=True, activated_at=now)).rowcount:
                return str(previous)
            return None

        changed: str | None = await self._changing(run)
        return changed

    async def _changing(self, run: Any) -> Any:
        try:
            return await self.db.write(run)
        except IntegrityError:
            raise InvalidRequest("another change activated a profile for this question at the same time; try again",
                                 ("profile",), code="profile_conflict", status=409) from None

    async def labelled(self, model: str) -> list[tuple[Any, Any, Any, Any, Any, Any, Any]]:
        """The newest ``LEARN_DECISIONS_MAX`` decisions of ``model`` with a label or a teacher label."""
        async with self.db.session() as session:
            rows = (await session.execute(
                select(StoredDecision.questions, StoredDecision.answers, StoredDecision.labels, StoredDecision.steps,
                       StoredDecision.teacher, StoredDecision.sources, StoredDecision.request)
                .where(StoredDecision.model == model,
                       or_(StoredDecision.labelled_at.is_not(None), StoredDecision.teacher.is_not(None)))
                .order_by(StoredDecision.time.desc()).limit(LEARN_DECISIONS_MAX))).all()
        return [(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows]


async def learn_model(store: ProfileStore, model: str) -> dict[str, Any]:
    """``POST /admin/learn``: learn from ``model``'s stored decisions, per target and question; accept what the rule
    allows. Reading the samples and fitting run in a thread, off the event loop; one learning runs at a time in a
    process (another waits). A question whose learning fails is reported with its error; the others go on."""
    async with store.learning:
        rows = await store.labelled(model)
        groups = await asyncio.to_thread(samples, list(reversed(rows)))  # oldest first: folds interleave over time
        active = {(t, s): Active(i, k, prepare(k, p)) for i, t, s, k, p in await store.active()}
        out = []
        for key, group in sorted(groups.items(), key=lambda kv: (kv[1].question, kv[0])):
            current = active.get(key)
            report: dict[str, Any] = {"question": group.question, "target": group.target,
                                      "signature": group.signature, "labels": group.labels,
                                      "teacher_labels": len(group.samples) - group.labels}

            def served(sample: Sample, current: Active | None = current) -> list[float]:
                if current is not None:
                    changed = predict(current.kind, current.params, sample.base, sample.features)
                    if changed is not None:
                        return changed
                return sample.base

            try:
                outcome = await asyncio.to_thread(learn, group.samples, served)
                profile_id = await store.accept(model, group, outcome) if outcome.kind is not None else None
            except DecisionError as error:
                out.append({**report, "profile": None, "accepted": None, "candidates": [], "served": {},
                            "samples": len(group.samples), "reason": error.message})
                continue
            except Exception as error:
                log.exception("learning failed", extra={"model": model, "question": group.question})
                out.append({**report, "profile": None, "accepted": None, "candidates": [], "served": {},
                            "samples": len(group.samples), "reason": f"learning failed: {type(error).__name__}"})
                continue
            if profile_id is not None:
                log.info("profile accepted", extra={"model": model, "target": group.target,
                                                    "question": group.question, "profile": profile_id,
                                                    "kind": outcome.kind})
            out.append({**report, "replaces": current.id if current is not None and profile_id else None,
                        "profile": profile_id, **outcome.describe()})
    return {"object": "learning", "model": model, "decisions": len(rows), "questions": out}


def describe(row: LearnedProfile) -> dict[str, Any]:
    """A profile in ``GET /admin/profiles`` (its parameters left out: a head's weights are long)."""
    return {"id": row.id, "object": "profile", "model": row.model, "target": row.target, "question": row.question,
            "signature": row.signature, "version": row.version, "kind": row.kind, "active": row.active,
            "accepted": row.accepted, "created_at": _epoch(row.created_at), "activated_at": _epoch(row.activated_at),
            "labels": (row.metrics or {}).get("labels"), "cv": (row.metrics or {}).get("cv"),
            "served_before": (row.metrics or {}).get("served"), "replaced": (row.metrics or {}).get("replaced")}


def _epoch(value: datetime | None) -> int | None:
    """Seconds since the epoch of a stored time."""
    stored = aware(value)
    return None if stored is None else int(stored.timestamp())


def check_model(model: str, stored: dict[str, int]) -> str:
    """``model``, if it keeps decisions (``stored``: the names with ``store: true``); else 400 naming it."""
    if model not in stored:
        raise InvalidRequest(f"{model[:100]!r} keeps no decisions (learning reads the stored decisions of a model or "
                             "virtual model with store: true)", ("model",), code="model_not_stored")
    return model
