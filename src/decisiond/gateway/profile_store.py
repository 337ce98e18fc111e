"""Learned profiles, kept: versioned rows on the gateway's database, one active at most per target, question and
scope, and the labelled decisions learning reads. (What profiles are and how they are served: ``gateway.profiles``;
the learning that makes them: ``gateway.profile_learning``.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import String, and_, cast, func, insert, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ..errors import InvalidRequest, NotFound
from ..limits import LEARN_DECISIONS_MAX
from ..store.db import Database, aware
from ..store.tables import LearnedProfile, StoredDecision
from .learning import Outcome, Sample
from .learning_fits import Table

# The columns of a stored decision learning reads, in this order (``profile_learning.collect``).
LEARNED_COLUMNS = (StoredDecision.request_id, StoredDecision.questions, StoredDecision.answers,
                   StoredDecision.labels, StoredDecision.label_scopes, StoredDecision.steps, StoredDecision.teacher,
                   StoredDecision.sources, StoredDecision.request)


@dataclass
class TrainingSet:
    """One target's answers to one question as learned for one scope: the samples, and what ``ProfileStore.accept``
    keeps beside an accepted profile (how many human labels, of which ``inherited`` were posted under a scope above
    ``scope``; the rest of the samples are teacher labels)."""

    target: str
    signature: str
    question: str
    samples: Table | Sequence[Sample]
    labels: int = 0
    scope: str = "/"
    inherited: int = 0


class ProfileStore:
    """Learned profiles on the gateway's database."""

    def __init__(self, db: Database):
        self.db = db
        # One learning at a time (``profile_learning.learn_model``): each holds its samples and fits in memory.
        self.learning = asyncio.Lock()

    async def active_ids(self) -> set[str]:
        async with self.db.session() as session:
            return set((await session.execute(select(LearnedProfile.id).where(
                LearnedProfile.active.is_(True)))).scalars())

    async def active(self) -> list[tuple[str, str, str, str, str, dict[str, Any]]]:
        """(id, target, signature, scope, kind, params) of every active profile (``ProfileBook.replace``)."""
        async with self.db.session() as session:
            rows = (await session.execute(select(
                LearnedProfile.id, LearnedProfile.target, LearnedProfile.signature, LearnedProfile.scope,
                LearnedProfile.kind, LearnedProfile.params).where(LearnedProfile.active.is_(True)))).all()
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    async def active_rows(self) -> list[LearnedProfile]:
        async with self.db.session() as session:
            return list((await session.execute(select(LearnedProfile).where(
                LearnedProfile.active.is_(True)))).scalars())

    async def listing(self, model: str | None, scope: str | None = None) -> list[LearnedProfile]:
        """The newest 1,000 profiles (``model``: learned from, or serving, that name; ``scope``: of that scope)."""
        query = select(LearnedProfile).order_by(LearnedProfile.created_at.desc())
        if model is not None:
            query = query.where(or_(LearnedProfile.model == model, LearnedProfile.target == model))
        if scope is not None:
            query = query.where(LearnedProfile.scope == scope)
        async with self.db.session() as session:
            return list((await session.execute(query.limit(1000))).scalars())

    async def get(self, profile_id: str) -> LearnedProfile:
        async with self.db.session() as session:
            row = await session.get(LearnedProfile, profile_id)
        if row is None:
            raise NotFound(f"no profile {profile_id[:100]!r}", ("profile_id",), code="profile_not_found")
        return row

    async def accept(self, model: str, group: TrainingSet, outcome: Outcome, now: datetime | None = None) -> str:
        """Store an accepted profile as the active one of its target, question and scope, in one transaction."""
        now = now or datetime.now(timezone.utc)
        profile_id = "prof_" + uuid.uuid4().hex[:24]
        chosen = outcome.chosen
        if outcome.kind is None or outcome.params is None or chosen is None:
            raise ValueError("only an accepted outcome (its kind, parameters and candidate) is stored")

        def run(connection: Connection) -> None:
            where = (LearnedProfile.target == group.target, LearnedProfile.signature == group.signature,
                     LearnedProfile.scope == group.scope)
            version = connection.execute(select(func.count()).select_from(LearnedProfile).where(*where)).scalar_one()
            replaced = connection.execute(select(LearnedProfile.id).where(
                *where, LearnedProfile.active.is_(True))).scalar_one_or_none()
            connection.execute(update(LearnedProfile).where(*where, LearnedProfile.active.is_(True)).values(
                active=False))
            connection.execute(insert(LearnedProfile).values(
                id=profile_id, model=model, target=group.target, question=group.question, signature=group.signature,
                scope=group.scope, version=int(version) + 1, kind=outcome.kind, params=outcome.params,
                metrics={**outcome.describe(), "labels": group.labels, "inherited_labels": group.inherited,
                         "replaced": replaced, "cv": chosen.metrics, "strength": chosen.strength},
                accepted=True, active=True, created_at=now, activated_at=now))

        await self._changing(run)
        return profile_id

    async def set_active(self, profile_id: str, active: bool, now: datetime | None = None) -> str | None:
        """Make the profile the active one of its target, question and scope, or deactivate it and reactivate the
        one it replaced (if any); the id active now for its question and scope (None: none of that scope)."""
        now = now or datetime.now(timezone.utc)
        row = await self.get(profile_id)

        def run(connection: Connection) -> str | None:
            where = (LearnedProfile.target == row.target, LearnedProfile.signature == row.signature,
                     LearnedProfile.scope == row.scope)
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

    async def labelled_ids(self, model: str) -> list[str]:
        """The request ids of the newest ``LEARN_DECISIONS_MAX`` decisions of ``model`` with a label or a teacher
        label, newest first (a decision without teacher labels keeps a JSON ``null`` there, not SQL NULL)."""
        teacher = and_(StoredDecision.teacher.is_not(None), cast(StoredDecision.teacher, String) != "null")
        async with self.db.session() as session:
            return list((await session.execute(
                select(StoredDecision.request_id)
                .where(StoredDecision.model == model, or_(StoredDecision.labelled_at.is_not(None), teacher))
                .order_by(StoredDecision.time.desc(), StoredDecision.request_id.desc())
                .limit(LEARN_DECISIONS_MAX))).scalars())

    async def labelled_rows(self, ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """The ``LEARNED_COLUMNS`` of the decisions ``ids``, in that order (those deleted meanwhile left out)."""
        async with self.db.session() as session:
            rows = (await session.execute(select(*LEARNED_COLUMNS).where(
                StoredDecision.request_id.in_(list(ids))))).all()
        by_id = {r[0]: tuple(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]


def describe(row: LearnedProfile) -> dict[str, Any]:
    """A profile in ``GET /admin/profiles`` (its parameters left out: a head's weights are long)."""
    metrics = row.metrics or {}
    return {"id": row.id, "object": "profile", "model": row.model, "target": row.target, "question": row.question,
            "signature": row.signature, "scope": row.scope, "version": row.version, "kind": row.kind,
            "active": row.active, "accepted": row.accepted, "created_at": _epoch(row.created_at),
            "activated_at": _epoch(row.activated_at), "labels": metrics.get("labels"),
            "inherited_labels": metrics.get("inherited_labels"), "cv": metrics.get("cv"),
            "served_before": metrics.get("served"), "replaced": metrics.get("replaced")}


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
