"""The tables, as SQLAlchemy declarative models. A change here is a new migration under ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Index, Integer, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# An auto-increment 64-bit id (SQLite only auto-increments an INTEGER primary key).
BigId = BigInteger().with_variant(Integer, "sqlite")


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    """A managed key. Only a salted SHA-256 of its secret is kept; the secret is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(64))
    user_path: Mapped[str] = mapped_column(String(256))
    models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    rate_limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Names of configured guardrails run on this key's requests (on top of the model's); None or [] for none.
    guardrails: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class UsageRow(Base):
    """One request: who, what, which target answered, tokens, cost, outcome — and, when audit.log_bodies is on,
    the redacted request and response bodies."""

    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_time", "time"), Index("ix_usage_key_time", "key_id", "time"),
                      Index("ix_usage_type_time", "request_type", "time"),
                      Index("ix_usage_request_id", "request_id"),
                      Index("ux_usage_record_id", "record_id", unique=True),
                      Index("ix_usage_batch", "batch_id"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # Unique per record (several rows may share a request id): a replayed journal inserts each record once.
    # NULL on rows written before migration 0005.
    record_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    day: Mapped[str] = mapped_column(String(10))
    request_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(210), nullable=True)
    user_path: Mapped[str] = mapped_column(String(256))
    request_type: Mapped[str] = mapped_column(String(32))
    dialect: Mapped[str | None] = mapped_column(String(32), nullable=True)
    requested_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    resolved_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    provider: Mapped[str | None] = mapped_column(String(200), nullable=True)
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    upstream_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    targets: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    latency_ms: Mapped[float] = mapped_column(Float)
    cache_hit: Mapped[bool] = mapped_column(Boolean, default=False)
    # True when the tokens were counted by decisiond (the upstream reported none), not reported by the upstream.
    estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    guardrail: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # The batch a line of which this request was (request type ``batch``); NULL otherwise.
    batch_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    outcomes: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    request_body: Mapped[Any] = mapped_column(JSON, nullable=True)
    response_body: Mapped[Any] = mapped_column(JSON, nullable=True)


class Budget(Base):
    """A spending limit on one scope (exactly one of key_id, user_path, model), per calendar period or seconds."""

    __tablename__ = "budgets"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(210), nullable=True)
    user_path: Mapped[str | None] = mapped_column(String(256), nullable=True)
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    limit_nanousd: Mapped[int] = mapped_column(BigInteger)
    period: Mapped[str | None] = mapped_column(String(16), nullable=True)
    period_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    source: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BudgetWindow(Base):
    """A budget's spend in one period, in nano-USD (integers: reservations and settlements add up exactly).
    ``reserved`` holds the estimates of requests in flight; ``spent`` the settled costs."""

    __tablename__ = "budget_windows"

    budget_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    spent: Mapped[int] = mapped_column(BigInteger, default=0)
    reserved: Mapped[int] = mapped_column(BigInteger, default=0)


class BudgetReservation(Base):
    """A hold on one budget window: the room one process's lease holds (``holder``: ``store.processes``), renewed
    while the process lives (``created_ms``, the database's clock). ``budget_windows.reserved`` is the sum of a
    window's holds; a hold not renewed for its time to live, or whose process died on the same host, is released."""

    __tablename__ = "budget_reservations"
    __table_args__ = (Index("ix_budget_reservations_budget_created", "budget_id", "created_ms"),
                      Index("ix_budget_reservations_holder", "holder"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    budget_id: Mapped[str] = mapped_column(String(64))
    window_start: Mapped[int] = mapped_column(BigInteger)
    amount: Mapped[int] = mapped_column(BigInteger)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)


class StoredFile(Base):
    """An uploaded file (``POST /v1/files``) or a batch's output or error file. The bytes are a file of their own
    under the files folder (``path``, relative to it); the row is what the Files API lists. ``key_id`` is the key
    that made it (None: the master key, or anyone on a server without keys)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_key_created", "key_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(210), nullable=True)
    filename: Mapped[str] = mapped_column(String(256))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    # Request lines in a batch input file (what a batch made from it counts as its total).
    lines: Mapped[int] = mapped_column(Integer, default=0)
    path: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class BatchJob(Base):
    """A batch (``POST /v1/batches``): its OpenAI fields, who runs its lines (the caller that made it), and its
    progress. Every line below ``next_line`` is done; lines at or past it that are done have a ``batch_results`` row.
    ``runner``/``lease_until`` name the process that runs it while its lease lasts."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_key_created", "key_id", "created_at"),
                      Index("ix_batches_status", "status"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(210), nullable=True)
    user_path: Mapped[str] = mapped_column(String(256))
    master: Mapped[bool] = mapped_column(Boolean, default=False)
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    next_line: Mapped[int] = mapped_column(Integer, default=0)
    # ``output_expires_after.seconds``: the output and error files expire this long after they are written (None:
    # they are kept until deleted).
    output_expires_s: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    runner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)


class BatchResult(Base):
    """One answered line of a batch that is not finalized yet: the line of its output or error file. Written with
    the batch's progress in one transaction; deleted when the batch's files are written."""

    __tablename__ = "batch_results"

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    ok: Mapped[bool] = mapped_column(Boolean)
    body: Mapped[Any] = mapped_column(JSON)


class StoredDecision(Base):
    """A decision kept for its model's ``store: true``: the request as the model saw it (after guardrail redaction,
    in OpenAI's shape), its questions (name, type, the values a label may take), the answer's probabilities per
    question, a cascade's steps and the soft labels its later steps give its first (``teacher``), and the labels
    posted for it. Deleted ``expires_at`` (its model's ``store_retention_days``)."""

    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_model_labelled", "model", "labelled_at"),
                      Index("ix_decisions_expires", "expires_at"))

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(210), nullable=True)
    user_path: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(256))
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    request: Mapped[Any] = mapped_column(JSON)
    questions: Mapped[Any] = mapped_column(JSON)
    answers: Mapped[Any] = mapped_column(JSON)
    steps: Mapped[Any] = mapped_column(JSON, nullable=True)
    teacher: Mapped[Any] = mapped_column(JSON, nullable=True)
    labels: Mapped[Any] = mapped_column(JSON, nullable=True)
    # Per label, the user path it was posted under (the poster's: ``gateway.decisions.label_scope``): it counts for
    # that path and below only. Labels from before migration 0010 were given ``/``, the operator's.
    label_scopes: Mapped[Any] = mapped_column(JSON, nullable=True)
    labelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Per answer, what computed it: the target, the probabilities before a learned profile, the features a learned
    # head reads (base64 float32) and the profile's id (``gateway.decisions.sources``).
    sources: Mapped[Any] = mapped_column(JSON, nullable=True)


class LearnedProfile(Base):
    """A profile ``POST /admin/learn`` fitted for one target's answers to one question (``signature``: its type,
    name, instructions and options), from the labels of ``model``'s stored decisions: its ``kind`` (``calibration``:
    a temperature and a bias per option; ``head``: a linear head over the model's hidden state) and ``params``, the
    cross-validated ``metrics`` it was judged on, whether the acceptance rule took it, and whether it is the one
    served (at most one active per target, signature and scope). ``scope``: the user path whose requests it serves
    (``/``: everyone's, where no profile of a narrower scope applies), learned from labels posted there or above.
    ``version`` counts the profiles of its target, question and scope."""

    __tablename__ = "profiles"
    __table_args__ = (Index("ix_profiles_active", "active"), Index("ix_profiles_question", "target", "signature"),
                      Index("ux_profiles_one_active_scope", "target", "signature", "scope", unique=True,
                            sqlite_where=text("active"), postgresql_where=text("active")))

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    target: Mapped[str] = mapped_column(String(256))
    question: Mapped[str] = mapped_column(String(256))
    signature: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(256), server_default="/")
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    params: Mapped[Any] = mapped_column(JSON)
    metrics: Mapped[Any] = mapped_column(JSON)
    accepted: Mapped[bool] = mapped_column(Boolean)
    active: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    activated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
