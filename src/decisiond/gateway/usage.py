"""Usage records: what one row says (``UsageRecord``), the redaction of logged bodies, and the queries behind the
admin API (summary, daily, audit) and ``GET /v1/usage``. Writing them is ``usage_writer``'s (through the journal,
``journal``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any, Iterable

from sqlalchemy import func, select
from sqlalchemy.sql.elements import ColumnElement

from ..errors import REDACTED, scrub
from ..store.db import Database
from ..store.tables import UsageRow

# "guardrail": a decision_judge guardrail's call to its judge model, under the guardrail's own user path;
# "chat", "responses": guarded chat traffic (/v1/chat/completions, /v1/responses).
# "batch": a line of a batch (``POST /v1/batches``), with the batch's id.
REQUEST_TYPES = ("decisions", "system_one", "score", "guardrail", "chat", "responses", "mcp", "batch")
# Group-by names of the admin summaries → usage columns.
GROUPS = {"key": "key_id", "user_path": "user_path", "model": "model", "provider": "provider",
          "request_type": "request_type", "resolved_model": "resolved_model", "status": "status"}
# Always redacted from logged bodies, at any depth (case-insensitive).
SECRET_FIELDS = frozenset({"authorization", "api_key", "api-key", "apikey", "key", "secret", "password", "token",
                           "access_token", "x-api-key"})


@dataclass
class UsageRecord:
    time: datetime
    request_id: str
    key_id: str | None
    user_path: str
    request_type: str
    dialect: str | None
    requested_model: str | None
    resolved_model: str | None
    provider: str | None
    model: str | None
    upstream_model: str | None
    attempts: int
    targets: list[str]
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float
    status: int
    error_code: str | None
    latency_ms: float
    cache_hit: bool = False
    estimated: bool = False
    guardrail: str | None = None
    outcomes: dict[str, str] | None = None
    request_body: Any = None
    response_body: Any = None
    # Budget charges settled with this row (``types.Charge.row``); journaled with it, not a column.
    charges: list[list[Any]] | None = None
    # The batch of a batch line's row.
    batch_id: str | None = None
    # A batch line's (line number, answered, its line of the output or error file): stored with this row, in its
    # transaction, so that the answer a batch keeps is the one whose row was written (``store.batches.put_results``).
    batch_line: list[Any] | None = None
    # The decision kept for a model with ``store: true`` (``decisions.record``); journaled with it, not a column.
    decision: dict[str, Any] | None = None
    # Its id, when the request may be answered again and must still leave one row (a batch line taken up again
    # after a restart): a record whose id is already in the table is not written, nor its charges settled. None: a
    # fresh id of its own (``usage_writer``).
    record_id: str | None = None

    def row(self) -> dict[str, Any]:
        """The record as the journal and the usage table take it (its values as they are: not copied)."""
        row = {f.name: getattr(self, f.name) for f in _FIELDS}
        row["day"] = self.time.strftime("%Y-%m-%d")
        return row


_FIELDS = fields(UsageRecord)


def redact(value: Any, fields: Iterable[str] = ()) -> Any:
    """``value`` with every field named in SECRET_FIELDS or ``fields`` (any depth, any case) replaced, and anything
    shaped like a credential inside free text (``Bearer …``, ``sk-…``, ``api_key=…``) cut out (``errors.scrub``)."""
    names = SECRET_FIELDS | {f.lower() for f in fields}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: REDACTED if str(k).lower() in names else walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            return scrub(v)
        return v

    return walk(value)


# ------------------------------------------------------------------------------------------------- queries


@dataclass
class UsageFilter:
    start: datetime | None = None
    end: datetime | None = None
    request_type: str | None = None
    key_id: str | None = None
    user_path: str | None = None  # the subtree
    model: str | None = None
    provider: str | None = None
    status: int | None = None
    batch_id: str | None = None

    def where(self) -> list[ColumnElement[bool]]:
        clauses: list[ColumnElement[bool]] = []
        if self.start is not None:
            clauses.append(UsageRow.time >= self.start)
        if self.end is not None:
            clauses.append(UsageRow.time < self.end)
        if self.request_type is not None:
            clauses.append(UsageRow.request_type == self.request_type)
        if self.key_id is not None:
            clauses.append(UsageRow.key_id == self.key_id)
        if self.user_path is not None and self.user_path != "/":
            root = self.user_path.rstrip("/")
            clauses.append((UsageRow.user_path == root) | UsageRow.user_path.startswith(root + "/", autoescape=True))
        if self.model is not None:
            clauses.append((UsageRow.model == self.model) | (UsageRow.resolved_model == self.model)
                           | (UsageRow.requested_model == self.model))
        if self.provider is not None:
            clauses.append(UsageRow.provider == self.provider)
        if self.status is not None:
            clauses.append(UsageRow.status == self.status)
        if self.batch_id is not None:
            clauses.append(UsageRow.batch_id == self.batch_id)
        return clauses


def _totals() -> list[Any]:
    return [func.count().label("requests"), func.coalesce(func.sum(UsageRow.input_tokens), 0).label("input_tokens"),
            func.coalesce(func.sum(UsageRow.output_tokens), 0).label("output_tokens"),
            func.coalesce(func.sum(UsageRow.cost), 0.0).label("cost_usd")]


def _row(row: Any, keys: list[str]) -> dict[str, Any]:
    out = {k: getattr(row, k) for k in keys}
    out.update(requests=int(row.requests), input_tokens=int(row.input_tokens), output_tokens=int(row.output_tokens),
               cost_usd=round(float(row.cost_usd), 10))
    return out


async def summary(db: Database, group_by: list[str], where: UsageFilter) -> list[dict[str, Any]]:
    columns = [getattr(UsageRow, GROUPS[g]).label(g) for g in group_by]
    query = select(*columns, *_totals()).where(*where.where())
    if columns:
        query = query.group_by(*columns).order_by(*columns)
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    return [_row(r, group_by) for r in rows]


async def daily(db: Database, group_by: list[str], where: UsageFilter) -> list[dict[str, Any]]:
    columns = [UsageRow.day.label("date")] + [getattr(UsageRow, GROUPS[g]).label(g) for g in group_by]
    query = select(*columns, *_totals()).where(*where.where()).group_by(*columns).order_by(*columns)
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    return [_row(r, ["date", *group_by]) for r in rows]


# The buckets of ``series``: their length in seconds, the SQLite ``strftime`` and PostgreSQL ``to_char`` formats
# of their start.
BUCKETS = {"minute": (60, "%Y-%m-%dT%H:%M:00Z", 'YYYY-MM-DD"T"HH24:MI:00"Z"'),
           "hour": (3600, "%Y-%m-%dT%H:00:00Z", 'YYYY-MM-DD"T"HH24:00:00"Z"'),
           "day": (86400, "%Y-%m-%dT00:00:00Z", 'YYYY-MM-DD"T"00:00:00"Z"')}


async def series(db: Database, bucket: str, group_by: list[str], where: UsageFilter,
                 limit: int) -> list[dict[str, Any]]:
    """Totals per time bucket (``BUCKETS``: its UTC start as ``bucket``, ISO) and ``group_by``, oldest first, at most
    ``limit`` rows."""
    _, sqlite_format, pg_format = BUCKETS[bucket]
    if db.dialect == "postgresql":
        start = func.to_char(func.timezone("UTC", UsageRow.time), pg_format)
    else:  # SQLite keeps UTC times as text
        start = func.strftime(sqlite_format, UsageRow.time)
    columns = [start.label("bucket")] + [getattr(UsageRow, GROUPS[g]).label(g) for g in group_by]
    query = select(*columns, *_totals()).where(*where.where()).group_by(*columns).order_by(*columns).limit(limit)
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    return [_row(r, ["bucket", *group_by]) for r in rows]


AUDIT_FIELDS = [c for c in UsageRow.__table__.columns.keys() if c not in ("day",)]


async def audit(db: Database, where: UsageFilter, limit: int, before_id: int | None) -> tuple[list[dict[str, Any]],
                                                                                                  int | None]:
    """Rows newest first, ``limit`` a page; the second value is the ``before_id`` of the next page (or None)."""
    query = select(UsageRow).where(*where.where())
    if before_id is not None:
        query = query.where(UsageRow.id < before_id)
    query = query.order_by(UsageRow.id.desc()).limit(limit + 1)
    async with db.session() as session:
        rows = list((await session.execute(query)).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    data = []
    for r in rows:
        item = {k: getattr(r, k) for k in AUDIT_FIELDS}
        item["time"] = r.time.astimezone(timezone.utc).isoformat() if r.time.tzinfo else r.time.isoformat() + "Z"
        data.append(item)
    return data, (rows[-1].id if more and rows else None)


async def key_spend(db: Database, key_id: str | None, user_path: str) -> dict[str, Any]:
    """A caller's own spend: today (UTC), this month and in all, by its key (or, keyless, its user path)."""
    now = datetime.now(timezone.utc)
    where = UsageFilter(key_id=key_id) if key_id is not None else UsageFilter(user_path=user_path)
    out: dict[str, Any] = {}
    for name, start in (("today", now.replace(hour=0, minute=0, second=0, microsecond=0)),
                        ("this_month", now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)),
                        ("total", None)):
        where.start = start
        rows = await summary(db, [], where)
        out[name] = rows[0] if rows else {"requests": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}
    return out
