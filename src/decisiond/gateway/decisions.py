"""Stored decisions and their labels (a model's or virtual model's ``store: true``).

- **Kept.** A decision answered under a name with ``store: true`` is kept (``record``): the request as the model saw
  it (after guardrail redaction, in OpenAI's shape), its questions, the probabilities of every answer, and for a
  cascade every step's answers and the *teacher* labels — for each question that went on past the first step, the
  final answer's probabilities, a soft label for the first step. The record rides the usage journal with the
  request's usage record and is inserted in the same transaction, off the request path (``usage_writer``).
- **Labels.** ``POST /v1/decisions/{request_id}/labels {"labels": {name: value}}``: a predicate's ``true``/``false``,
  a choice's value, a score's level index (``check_labels``, 400 naming the field otherwise); a second label for a
  question replaces the first. A key labels (and deletes) only its own decisions; the master key any.
- **Whose labels.** Each label keeps the scope it was posted under (``label_scope``: the poster's user path; the
  master key's is ``/``, the operator's): it counts, for learning, for that user path and below it only
  (``gateway.profile_store``). A cascade's teacher labels are the operator's model's: scope ``/``.
- **Quality.** Over the newest labelled decisions of each model, per question: how many labels, the accuracy of the
  answer served (its most probable value against the label) and its expected calibration error over ``ECE_BINS``
  bins of confidence (``quality``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection

from .. import scores
from ..canonical import Answer, DecisionRequest, DecisionResult, Question
from ..dialects.openai.upstream import render_request
from ..errors import InvalidRequest, NotFound
from ..limits import ECE_BINS
from ..store.db import Database
from ..store.tables import StoredDecision
from .cascade import Step
from .learning import encode_features
from .profiles import options, signature
from .types import Caller

MAX_LABELS = 400  # one per question at most (the largest question count a dialect takes)


def _values(question: Question) -> list[Any]:
    """The values a label of the question may take, in the order of its answer's probabilities."""
    if question.kind == "yes_no":
        return [True, False]
    if question.kind == "choice":
        return [option.value for option in question.options]
    return list(range(len(question.levels)))


def source(answer: Answer, target: str | None, features: bool = True) -> dict[str, Any]:
    """What computed an answer, for learning (``gateway.profiles``): the target, and where they differ from what was
    served or exist at all, the probabilities before a learned profile, the profile, and (``features``) the
    features (base64)."""
    out: dict[str, Any] = {"target": target}
    if answer.profile is not None:
        out.update(profile=answer.profile, base=answer.base)
    if features and answer.features is not None:
        out["features"] = encode_features(answer.features)
    return out


def record(request: DecisionRequest, result: DecisionResult, model: str, request_id: str, caller: Caller,
           retention_days: int, steps: list[Step], now: datetime | None = None,
           target: str | None = None) -> dict[str, Any]:
    """What the decisions table keeps of one answered request (JSON-able: it is journaled); ``target``: the target
    that answered a request that is not a cascade."""
    now = now or datetime.now(timezone.utc)
    questions = [{"name": q.name, "type": q.kind, "values": _values(q), "signature": signature(q)}
                 for q in request.questions]
    stored: dict[str, Any] = {
        "request_id": request_id, "key_id": caller.key_id, "user_path": caller.user_path, "model": model,
        "time": now.isoformat(), "expires_at": (now + timedelta(days=retention_days)).isoformat(),
        "request": render_request(request), "questions": questions,
        "answers": [None if a.refusal else list(a.probabilities) for a in result.answers],
        "steps": None, "teacher": None,
        "sources": None if steps else [source(a, target) for a in result.answers],
    }
    if steps:
        stored["steps"] = [_step(s, s is steps[0]) for s in steps if s.result is not None]
        later = {k for s in steps[1:] if s.result is not None for k in s.asked}
        teacher = {str(questions[k]["name"] if questions[k]["name"] is not None else k): stored["answers"][k]
                   for k in sorted(later) if stored["answers"][k] is not None}
        stored["teacher"] = teacher or None
    return stored


def _step(step: Step, first: bool) -> dict[str, Any]:
    """A cascade call as stored: its answers by the request's question index, and what computed them (features only
    for the first step: the one a profile learns for)."""
    if step.result is None:
        raise ValueError("a cascade step is stored once it has answered")
    target = step.answered_by.name if step.answered_by else None
    asked = list(zip(step.asked, step.result.answers))
    return {"step": step.name, "position": step.position, "target": target,
            "answers": {str(k): (None if a.refusal else list(a.probabilities)) for k, a in asked},
            "sources": {str(k): source(a, target, first) for k, a in asked if not a.refusal}}


def check_labels(questions: list[dict[str, Any]], body: Any) -> dict[str, Any]:
    """``{"labels": {name: value}}`` checked against the decision's questions: the labels, or 400 naming the field
    at fault (an unknown question, a value the question does not allow)."""
    if not isinstance(body, dict) or set(body) != {"labels"}:
        unknown = sorted(set(body) - {"labels"}) if isinstance(body, dict) else []
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0]!r}: the body is {{\"labels\": {{name: value}}}}",
                                 (unknown[0],), code="unknown_parameter")
        raise InvalidRequest("the body is {\"labels\": {question name: value}}", ("labels",),
                             code="missing_required_parameter")
    labels = body["labels"]
    if not isinstance(labels, dict) or not labels:
        raise InvalidRequest("labels must be an object of question names to values, with at least one", ("labels",))
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(f"at most {MAX_LABELS} labels a request", ("labels",))
    by_name = {q["name"]: q for q in questions if q["name"] is not None}
    for name, value in labels.items():
        question = by_name.get(name)
        if question is None:
            raise InvalidRequest(f"this decision has no question named {name[:100]!r} (it has "
                                 f"{', '.join(repr(n) for n in list(by_name)[:20]) or 'no named question'})",
                                 ("labels", name), code="unknown_question")
        if label_index(question, value) is None:
            allowed = question["values"]
            shown = ("true or false" if question["type"] == "yes_no" else
                     f"a level index from 0 to {len(allowed) - 1}" if question["type"] == "score" else
                     "one of " + ", ".join(repr(v) for v in allowed[:20]))
            raise InvalidRequest(f"a label of {name!r} is {shown}, not {str(value)[:100]!r}", ("labels", name),
                                 code="invalid_label")
    return labels


def label_scope(caller: Caller) -> str:
    """The scope of the labels ``caller`` posts: its user path — a key's own, or the path below it that it named
    (``X-Decisiond-User-Path``); the master key's ``/`` unless it names one. Its labels count for that path and
    below only."""
    return caller.user_path


def label_index(question: dict[str, Any], value: Any) -> int | None:
    """The position of a label's value among the question's answer probabilities: a score's level index, else the
    value's place among the question's values (of the same JSON type: ``true`` is no choice ``1``); None for a value
    the question does not allow."""
    if question["type"] == "score":
        allowed = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(question["values"])
        return value if allowed else None
    return next((i for i, v in enumerate(question["values"]) if type(v) is type(value) and v == value), None)


@dataclass
class QuestionQuality:
    labels: int
    accuracy: float
    log_loss: float
    brier: float
    ece: float


def quality(rows: list[tuple[list[dict[str, Any]], list[Any], dict[str, Any]]],
            bins: int = ECE_BINS) -> dict[str, QuestionQuality]:
    """Per question name, over ``rows`` of (questions, answers, labels): how many labels, and the accuracy, log
    loss, Brier score and expected calibration error (``bins`` bins) of the answers served (``scores.metrics``; a
    predicate's probabilities are (p, 1 − p))."""
    out = {}
    for name, labelled in _pairs(rows).items():
        measured = scores.metrics(labelled, bins=bins)
        out[name] = QuestionQuality(len(labelled), measured["accuracy"], measured["log_loss"], measured["brier"],
                                    measured["ece"])
    return out


def report(model: str, rows: list[tuple[list[dict[str, Any]], list[Any], dict[str, Any] | None, Any, Any]],
           bins: int = ECE_BINS) -> dict[str, Any]:
    """``GET /admin/quality``: per question of ``model``'s stored decisions (``rows``: questions, answers, labels,
    steps, label scopes), how many were stored and labelled (and the labels per scope they count under), the
    quality of the answers served against the labels (``scores.metrics``) with the reliability diagram's bins, and
    for a cascade the share that went on past its first step."""
    stored: dict[str, int] = {}
    escalated: dict[str, int] = {}
    cascade = False
    for questions, _, _, steps, _ in rows:
        later = {int(k) for step in (steps or [])[1:] for k in step["answers"]}
        cascade = cascade or steps is not None
        for k, question in enumerate(questions):
            name = question["name"]
            if name is None:
                continue
            stored[name] = stored.get(name, 0) + 1
            escalated[name] = escalated.get(name, 0) + (k in later)
    labelled = [(questions, answers, labels) for questions, answers, labels, _, _ in rows if labels]
    pairs = _pairs(labelled)
    scoped = _label_scopes(rows)
    out = []
    for name in sorted(stored):
        measured = scores.metrics(pairs.get(name, []), bins=bins)
        out.append({
            "question": name, "stored": stored[name], "labels": int(measured["n"]),
            "labels_by_scope": dict(sorted(scoped.get(name, {}).items())),
            "served": {k: measured[k] for k in ("accuracy", "log_loss", "brier", "ece")} if measured["n"] else None,
            "reliability": scores.reliability(pairs.get(name, []), bins),
            "escalated_share": escalated[name] / stored[name] if cascade else None,
        })
    return {"object": "decision.quality", "model": model, "decisions": len(rows), "bins": bins, "questions": out}


def _label_scopes(rows: list[tuple[list[dict[str, Any]], list[Any], dict[str, Any] | None, Any, Any]]
                  ) -> dict[str, dict[str, int]]:
    """Per question name, how many of its labels (those ``_pairs`` counts) count under each scope."""
    out: dict[str, dict[str, int]] = {}
    for questions, answers, labels, _, scopes in rows:
        for k, question in enumerate(questions):
            name = question["name"]
            if name is None or name not in (labels or {}) or k >= len(answers) or not answers[k]:
                continue
            scope = (scopes or {}).get(name, "unknown")
            counts = out.setdefault(name, {})
            counts[scope] = counts.get(scope, 0) + 1
    return out


Pairs = dict[str, list[tuple[list[float], int]]]


def _pairs(rows: list[tuple[list[dict[str, Any]], list[Any], dict[str, Any]]]) -> Pairs:
    """Per question name, (the served probabilities, the label's index) of each labelled answer (a predicate's
    probabilities as (p, 1 − p))."""
    pairs: Pairs = {}
    for questions, answers, labels in rows:
        for k, question in enumerate(questions):
            name = question["name"]
            if name is None or name not in labels or k >= len(answers) or not answers[k]:
                continue
            gold = label_index(question, labels[name])
            if gold is None:  # checked when posted (``check_labels``): never
                continue
            pairs.setdefault(name, []).append((options(answers[k], question["type"]), gold))
    return pairs


class DecisionStore:
    """Stored decisions on the gateway's database."""

    def __init__(self, db: Database):
        self.db = db

    async def get(self, request_id: str, caller: Caller) -> StoredDecision:
        """The decision, if ``caller`` may see it (its own key's; the master key: any) — else 404."""
        async with self.db.session() as session:
            row = await session.get(StoredDecision, request_id)
        if row is None or not (caller.key_id is None or row.key_id == caller.key_id):
            raise NotFound(f"no stored decision {request_id[:100]!r} (only decisions of a model with store: true are "
                           "kept, and a key sees only its own)", ("request_id",), code="decision_not_found")
        return row

    async def label(self, request_id: str, labels: dict[str, Any], scope: str,
                    now: datetime | None = None) -> dict[str, Any]:
        """Merge ``labels``, posted under ``scope`` (``label_scope``), into the decision's (a question labelled again
        takes the new value and the new scope): all its labels."""
        now = now or datetime.now(timezone.utc)

        def run(connection: Connection) -> dict[str, Any]:
            row = connection.execute(select(StoredDecision.labels, StoredDecision.label_scopes).where(
                StoredDecision.request_id == request_id)).one_or_none()
            current, scopes = (row[0] or {}, row[1] or {}) if row is not None else ({}, {})
            merged = {**current, **labels}
            connection.execute(update(StoredDecision).where(StoredDecision.request_id == request_id).values(
                labels=merged, label_scopes={**scopes, **{name: scope for name in labels}}, labelled_at=now))
            return merged

        return await self.db.write(run)

    async def delete(self, request_id: str) -> None:
        def run(connection: Connection) -> None:
            connection.execute(delete(StoredDecision).where(StoredDecision.request_id == request_id))

        await self.db.write(run)

    async def purge(self, now: datetime | None = None) -> int:
        """Delete the decisions past their retention; how many."""
        now = now or datetime.now(timezone.utc)

        def run(connection: Connection) -> int:
            return int(connection.execute(delete(StoredDecision).where(StoredDecision.expires_at < now)).rowcount
                       or 0)

        return await self.db.write(run)

    async def since(self, model: str, since: datetime | None, limit: int) -> list[tuple[Any, Any, Any, Any, Any]]:
        """The newest ``limit`` stored decisions of ``model`` (from ``since``): (questions, answers, labels, steps,
        label scopes)."""
        query = select(StoredDecision.questions, StoredDecision.answers, StoredDecision.labels,
                       StoredDecision.steps, StoredDecision.label_scopes).where(StoredDecision.model == model)
        if since is not None:
            query = query.where(StoredDecision.time >= since)
        async with self.db.session() as session:
            rows = (await session.execute(query.order_by(StoredDecision.time.desc()).limit(limit))).all()
        return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def timed(self, model: str, since: datetime | None, limit: int
                    ) -> list[tuple[datetime, list[dict[str, Any]], list[Any], dict[str, Any]]]:
        """The newest ``limit`` labelled decisions of ``model`` asked from ``since``: (the time it was asked,
        questions, answers, labels) each, oldest first."""
        query = select(StoredDecision.time, StoredDecision.questions, StoredDecision.answers, StoredDecision.labels
                       ).where(StoredDecision.model == model, StoredDecision.labelled_at.is_not(None))
        if since is not None:
            query = query.where(StoredDecision.time >= since)
        async with self.db.session() as session:
            rows = (await session.execute(query.order_by(StoredDecision.time.desc()).limit(limit))).all()
        return [(_aware(r[0]), r[1], r[2], r[3]) for r in reversed(rows)]

    async def labelled(self, model: str, limit: int) -> list[tuple[list[dict[str, Any]], list[Any], dict[str, Any]]]:
        """The newest ``limit`` labelled decisions of ``model``: (questions, answers, labels) each."""
        async with self.db.session() as session:
            rows = (await session.execute(
                select(StoredDecision.questions, StoredDecision.answers, StoredDecision.labels)
                .where(StoredDecision.model == model, StoredDecision.labelled_at.is_not(None))
                .order_by(StoredDecision.labelled_at.desc()).limit(limit))).all()
        return [(r[0], r[1], r[2]) for r in rows]


def insert_rows(connection: Connection, stored: list[dict[str, Any]]) -> None:
    """Insert journaled decision records, in the usage writer's transaction (each request's once: a request id
    already there is left as it is)."""
    if not stored:
        return
    ids = [s["request_id"] for s in stored]
    there = set(connection.execute(select(StoredDecision.request_id).where(
        StoredDecision.request_id.in_(ids))).scalars())
    fresh = [{**s, "time": _time(s["time"]), "expires_at": _time(s["expires_at"])} for s in stored
             if s["request_id"] not in there]
    if fresh:
        connection.execute(insert(StoredDecision), fresh)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _time(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)
