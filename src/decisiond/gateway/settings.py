"""The gateway's configuration as data: pydantic models of the YAML (providers, models, virtual models, keys,
limits, budgets, guardrails, cache, audit), each validated on its own and against its siblings. Pure: no I/O and no
provider registry — ``gateway.config`` reads the file, interpolates ``${ENV}`` and checks each provider entry
against its registered type.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    field_validator,
    model_validator,
)

from ..limits import (
    BUDGET_RESERVATION_TTL_S,
    CACHE_MAX_BYTES,
    CACHE_TTL_S,
    CONCURRENCY_SLOT_TTL_S,
    DECISION_RETENTION_DAYS,
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_QUESTION_LABELS,
    MAX_QUESTION_LABELS,
    PROFILE_REFRESH_S,
)
from .batch_settings import BatchesConfig
from .console_settings import ConsoleConfig
from .logprobs_settings import LogprobsOptions
from .pricing import Pricing
from .virtual import VirtualModelConfig, check_chains

# Under the TypeSafe SDK's 10 s per call, so that its retry never races an attempt still running here.
DEFAULT_DEADLINE = 9.5

TYPESAFE_HOSTED = "https://api.typesafe.ai"
# What the rate limiter (``limits``' Redis storage) and the cache (redis-py) can both connect to.
REDIS_SCHEMES = ("redis", "rediss")


def check_redis_url(url: str | None) -> str | None:
    """A Redis URL is ``redis://`` or ``rediss://`` (``async+`` in front is taken too); else a ValueError naming the
    scheme it has (never the URL, which may hold a password)."""
    if not url:
        return None
    scheme, sep, _ = url.removeprefix("async+").partition("://")
    if not sep or scheme.lower() not in REDIS_SCHEMES:
        raise ValueError("a Redis URL must start with redis:// or rediss://, not "
                         + (f"{scheme}://" if sep else "a name without a scheme"))
    return url


class Limits(BaseModel):
    """A provider's limits, checked after OpenAI's; None means no limit of its own."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_questions: int | None = None
    """Most questions in one request."""
    max_choices: int | None = None
    """Most options of one choice question."""
    max_levels: int | None = None
    """Most levels of one score question."""
    max_tokens: int | None = None
    """Most input tokens of one request."""
    max_question_tokens: int | None = None
    """Most tokens of one question's instructions."""


USER_PATH = re.compile(r"^/([A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*)?$")
MAX_USER_PATH = 256


def check_user_path(value: str) -> str:
    """A user path: ``/`` or ``/team/alpha`` (segments of letters, digits and ``._~-``), at most 256 characters."""
    if len(value) > MAX_USER_PATH or not USER_PATH.match(value):
        raise ValueError(f"user path {value[:40]!r} must look like /team/alpha: segments of letters, digits and "
                         f"'._~-' after '/', at most {MAX_USER_PATH} characters")
    return value


def in_subtree(path: str, root: str) -> bool:
    """``/team/alpha/bob`` is in ``/team/alpha`` and in ``/``; ``/team/alphabet`` is not in ``/team/alpha``."""
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/") or root == ""


Action = Literal["block", "warn", "redact"]
Detector = Literal["email", "phone", "card", "iban", "ip"]
DETECTOR_NAMES: tuple[Detector, ...] = ("email", "phone", "card", "iban", "ip")


class PatternConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pattern: str = Field(min_length=1, max_length=1000)
    """A Python regular expression."""
    action: Action | None = None
    """What a match does; unset: the guardrail's action."""
    replacement: str = "[REDACTED]"
    """What a redacted match is replaced with."""


class GuardrailConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name models, virtual models and keys list it by."""
    type: Literal["regex", "pii", "decision_judge"]
    """``regex`` (patterns), ``pii`` (detectors) or ``decision_judge`` (a decision model asked a yes/no question)."""
    order: int = 0
    """Guardrails run in ascending order."""
    action: Action = "block"
    """``block`` (400), ``warn`` (a header, the request goes on) or ``redact`` (matches replaced)."""
    fail_mode: Literal["closed", "open"] = "closed"
    """When the guardrail itself fails (a judge that errors or times out): ``closed`` refuses the request, ``open``
    lets it through.
    """
    timeout_ms: int = Field(default=5000, ge=1)
    """How long a judge may take."""
    patterns: list[PatternConfig] = Field(default_factory=list)
    """regex: the patterns."""
    detectors: list[Detector] = Field(default_factory=lambda: list(DETECTOR_NAMES))
    """pii: which detectors run."""
    model: str | None = None
    """decision_judge: the model (or virtual model) that judges."""
    instructions: str | None = None
    """decision_judge: the yes/no question asked of the request's text."""
    yes: str | None = None
    """decision_judge: what yes means (a description of the option)."""
    no: str | None = None
    """decision_judge: what no means."""
    threshold: float = Field(default=0.5, ge=0, le=1)
    """decision_judge: P(yes) at or above which the guardrail acts."""
    user_path: str = "/guardrails"
    """decision_judge: the user path the judge's own usage rows are charged to."""

    @model_validator(mode="after")
    def _complete(self) -> "GuardrailConfig":
        if self.type == "regex":
            if not self.patterns:
                raise ValueError(f"guardrail {self.name!r} (regex) needs patterns")
            for p in self.patterns:
                try:
                    re.compile(p.pattern)
                except re.error as e:
                    raise ValueError(f"guardrail {self.name!r}: pattern {p.pattern!r} is not a regex: {e}") from None
        if self.type == "decision_judge" and not (self.model and self.instructions):
            raise ValueError(f"guardrail {self.name!r} (decision_judge) needs a model and instructions")
        if self.type == "decision_judge" and self.action == "redact":
            raise ValueError(f"guardrail {self.name!r}: a judge blocks or warns; it cannot redact")
        check_user_path(self.user_path)
        return self


def unknown_guardrail(names: Iterable[str], defined: Collection[str]) -> str | None:
    """The first of ``names`` that is not a configured guardrail, else None: models, virtual models and keys (static
    or managed) may only name configured guardrails."""
    return next((n for n in names if n not in defined), None)


class RateLimitConfig(BaseModel):
    """Limits on one scope (a key, a user-path subtree, a model or a provider); None means no limit."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    requests_per_second: int | None = Field(default=None, ge=1)
    """Requests per second."""
    requests_per_minute: int | None = Field(default=None, ge=1)
    """Requests per minute."""
    requests_per_hour: int | None = Field(default=None, ge=1)
    """Requests per hour."""
    requests_per_day: int | None = Field(default=None, ge=1)
    """Requests per day."""
    input_tokens_per_minute: int | None = Field(default=None, ge=1)
    """Input tokens per minute, counted before the request is sent."""
    concurrent: int | None = Field(default=None, ge=1)
    """Requests in flight at once."""
    requests_per_window: int | None = Field(default=None, ge=1)
    """Any other window: this many requests per ``window_seconds``."""
    window_seconds: int = Field(default=60, ge=1, le=86400)
    """The window of ``requests_per_window``."""

    def empty(self) -> bool:
        return all(v is None for k, v in self.model_dump().items() if k != "window_seconds")


class ChatTimeouts(BaseModel):
    """How long chat traffic may wait on a provider, apart from decision timeouts: a completion takes as long as it
    takes (no overall cap but the client's ``x-decisiond-timeout-ms``), so only connecting, the first byte of the
    answer (for a non-streamed answer, most upstreams send nothing before it is complete) and each silence between
    chunks are bounded. Past one before the client's first byte, the next target of a virtual model is tried."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds to connect to the provider."""
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds until the answer's first byte."""
    idle_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds of silence allowed between two chunks of a streamed answer."""


class ProviderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name models refer to it by."""
    type: str
    """A registered provider type (``gateway.providers.REGISTRY``): openai, azure, systemone, local, logprobs."""
    base_url: str | None = None
    """The upstream's URL (openai, azure, systemone; logprobs: the server's ``/v1``); unset: the type's default."""
    api_key: str | None = None
    """The upstream's key, best given as ``${ENV}``; never logged or listed."""
    api_version: str | None = None
    """azure: the API version."""
    model: str | None = None
    """local: the model spec (default, a folder, a .gguf, a hub id)."""
    served_model_name: str | None = None
    """local: the name it answers to (default: from model)."""
    dtype: str = "float32"
    """local: the weights' dtype (float32, bfloat16, float16)."""
    api: Literal["completions", "chat"] = "completions"
    """logprobs: the served model's route. ``completions``: decisiond renders the prompt with ``tokenizer`` as its
    local engine does; ``chat``: the server's chat template applies, and images can be sent."""
    tokenizer: str | None = None
    """logprobs: the served model's tokenizer and chat template (``default``, a folder, a .gguf, a hub id); needed
    with ``api: completions``, optional with ``chat`` (labels are then found by their text)."""
    logprobs: LogprobsOptions = Field(default_factory=LogprobsOptions)
    """logprobs: how the server's log-probabilities are read (how many, the restriction to the labels, concurrency)."""
    order: Literal["given", "cyclic"] | None = None
    """local, logprobs: default option order (else the CLI's)."""
    calibrate: Literal["none", "contextual"] | None = None
    """local, logprobs: default calibration (else the CLI's)."""
    calibration: str | None = None
    """local: a profile from `decisiond calibrate`."""
    timeout: float = Field(default=4.0, gt=0)
    """Seconds one attempt may take (connect included); short enough by default that a hanging first target leaves a
    failover chain time for the next within a client's timeout (the TypeSafe SDK's is 10 s). Unset for a logprobs
    provider: 9 (a decision is several requests to the server).
    """
    connect_timeout: float = Field(default=2.0, gt=0)
    """Seconds to connect, within ``timeout``."""
    chat: ChatTimeouts = Field(default_factory=ChatTimeouts)
    """Chat traffic's own timeouts (connect, first byte, between chunks)."""
    images: bool | None = None
    """Whether the provider reads images; None leaves it to the provider type (see its ``images_by_default``)."""
    limits: Limits | None = None
    """The provider's request limits, checked after OpenAI's."""
    rate_limits: RateLimitConfig | None = None
    """Limits shared by every request to this provider."""
    pricing: Pricing | None = None
    """The default price of this provider's models (see gateway.pricing); a model's own price wins."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra headers sent with every upstream request."""
    cache: bool | None = None
    """Whether its answers are cached (see ``CacheConfig``); None: local providers yes, upstream providers no."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name clients ask for."""
    provider: str
    """The provider that serves it."""
    upstream: str | None = None
    """The provider's model name (Azure: the deployment); defaults to ``name``."""
    capabilities: list[str] = Field(default_factory=lambda: ["decisions"])
    """What it serves: ``decisions``, ``score``, ``chat``."""
    images: bool | None = None
    """Whether it reads images; unset: its provider's setting."""
    description: str = ""
    """Shown in ``GET /v1/models``."""
    rate_limits: RateLimitConfig | None = None
    """Limits shared by every caller of this model."""
    guardrails: list[str] = Field(default_factory=list)
    """Guardrails (by name) every request to it runs through."""
    pricing: Pricing | None = None
    """Its price (else its provider's)."""
    max_output_tokens: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1)
    """The most output tokens an answer may bill when the request sets no max_tokens of its own (budgets reserve it)."""
    cache: bool | None = None
    """Whether its answers are cached; None leaves it to its provider."""
    store: bool = False
    """Keep each decision it answers (the input as the model saw it, the questions, the answers), so that labels can
    be posted for it (``POST /v1/decisions/{request_id}/labels``) and its accuracy measured."""
    store_retention_days: int = Field(default=DECISION_RETENTION_DAYS, ge=1)
    """How long a stored decision is kept, in days (with its labels)."""


class StaticKeyConfig(BaseModel):
    """A key listed in the YAML: its secret from the environment (``key: ${ENV}``) or its SHA-256
    (``key_sha256: <hex>``), never stored in clear past start-up."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=200)
    """The key's name (its id is ``static:<name>``)."""
    key: str | None = Field(default=None, min_length=16, repr=False)
    """The secret, at least 16 characters, best given as ``${ENV}``."""
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Or the secret's SHA-256, in hex."""
    user_path: str = "/"
    """Where its usage is counted (``/team/alpha``); budgets and limits of the subtrees above it apply."""
    models: list[str] | None = None
    """The models (and virtual models) it may use; unset: all."""
    rate_limits: RateLimitConfig | None = None
    """Limits on this key."""
    guardrails: list[str] = Field(default_factory=list)
    """Guardrails (by name) every request made with it runs through."""

    @model_validator(mode="after")
    def _one_secret(self) -> "StaticKeyConfig":
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"key {self.name!r} needs exactly one of key (e.g. ${{ENV}}) or key_sha256")
        check_user_path(self.user_path)
        return self


class AuthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    master_key: str | None = Field(default=None, min_length=16, repr=False)
    """The master key; DECISIOND_MASTER_KEY is used when this is not set."""
    keys: list[StaticKeyConfig] = Field(default_factory=list)
    """Keys listed in the file (managed keys live in the database: ``decisiond keys``, ``/admin/keys``)."""


class CacheConfig(BaseModel):
    """The exact response cache (``gateway.cache``): in-process memory, plus Redis shared by replicas when
    ``redis_url`` is set. Which models it applies to: ``cache`` on a virtual model, a model or a provider (any
    ``false`` wins, then any ``true``), else local models only."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Whether the cache runs at all."""
    ttl: float = Field(default=CACHE_TTL_S, gt=0)
    """Seconds an entry lives."""
    max_bytes: int = Field(default=CACHE_MAX_BYTES, ge=0)
    """Memory for in-process entries (least recently used out first)."""
    redis_url: str | None = Field(default=None, repr=False)
    """Entries shared by several replicas (redis://…); in-process memory only when unset."""

    _redis_url = field_validator("redis_url")(check_redis_url)


class UserPathLimit(RateLimitConfig):
    """Limits shared by every caller whose user path is ``user_path`` or below it."""

    user_path: str
    """The subtree (``/team/alpha``) whose callers share these limits."""

    @model_validator(mode="after")
    def _path(self) -> "UserPathLimit":
        check_user_path(self.user_path)
        return self


class BudgetConfig(BaseModel):
    """A spending limit in USD on one scope — a key (its id: a managed key's ``key_...`` or ``static:<name>``), a
    user-path subtree or a model — per UTC calendar hour/day/week/month or per ``period_seconds``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    key: str | None = Field(default=None, min_length=1, max_length=200)
    """Scope: a key's id (``key_...`` for a managed key, ``static:<name>``)."""
    user_path: str | None = None
    """Scope: a user-path subtree."""
    model: str | None = Field(default=None, min_length=1, max_length=200)
    """Scope: a model or virtual model."""
    limit_usd: NonNegativeFloat
    """The most the scope may spend in one period, in USD."""
    period: Literal["hourly", "daily", "weekly", "monthly"] | None = None
    """A UTC calendar period."""
    period_seconds: int | None = Field(default=None, ge=1, le=366 * 86400)
    """Or a rolling period of this many seconds."""

    @model_validator(mode="after")
    def _one_scope(self) -> "BudgetConfig":
        if sum(v is not None for v in (self.key, self.user_path, self.model)) != 1:
            raise ValueError("a budget needs exactly one of key, user_path or model")
        if (self.period is None) == (self.period_seconds is None):
            raise ValueError("a budget needs exactly one of period (hourly, daily, weekly, monthly) or "
                             "period_seconds")
        if self.user_path is not None:
            check_user_path(self.user_path)
        return self


class AuditConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    log_bodies: bool = False
    """Keep request and response bodies with each usage row (secrets and redact_fields replaced)."""
    redact_fields: list[str] = Field(default_factory=list)
    """Extra field names (at any depth) to redact from logged bodies, besides the built-in secret names."""
    retention_days: int | None = Field(default=90, ge=1)
    """Usage and audit rows older than this are purged (hourly); None keeps them."""


class OtelConfig(BaseModel):
    """OpenTelemetry traces (``decisiond.tracing``), exported by OTLP over HTTP (protobuf): on when ``endpoint`` is
    set here or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is;
    ``OTEL_SDK_DISABLED=true`` turns them off."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    endpoint: str | None = None
    """The OTLP/HTTP receiver (a collector): a base URL such as ``http://collector:4318`` (spans go to its
    ``/v1/traces``) or the whole traces URL; unset: ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    """
    service_name: str | None = None
    """The spans' ``service.name``; unset: ``OTEL_SERVICE_NAME``, else ``decisiond``."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """The share of requests traced, chosen by trace id; a caller's ``traceparent`` that says whether it is sampled
    decides for its request.
    """
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    """Headers sent with every export (a hosted collector's key, best given as ``${ENV}``); unset:
    ``OTEL_EXPORTER_OTLP_HEADERS``.
    """
    schedule_delay_ms: int | None = Field(default=None, ge=1)
    """The longest an ended span waits before its batch is exported; unset: ``OTEL_BSP_SCHEDULE_DELAY``, else 5000."""

    @field_validator("endpoint")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value and not value.lower().startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over HTTP)")
        return value


class MetricsConfig(BaseModel):
    """What ``GET /metrics`` labels the decision quality metrics by (``server.decision_metrics``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    question_labels: int = Field(default=DEFAULT_QUESTION_LABELS, ge=0, le=MAX_QUESTION_LABELS)
    """Question names (they come from clients) that get a label value of their own, per model: the first this many
    distinct names a server process sees; every later one is counted as ``_other``. 0: every question is ``_other``
    (per-model series only).
    """


class LearningConfig(BaseModel):
    """Learned profiles (``POST /admin/learn``; ``gateway.profiles``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    refresh_s: float = Field(default=PROFILE_REFRESH_S, gt=0, le=3600)
    """How often each server process reads the active profiles from the database: a profile accepted or rolled back
    on one replica is served by every replica within this many seconds (at once on the one that made the change)."""


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    auth: AuthConfig = Field(default_factory=AuthConfig)
    """The master key and the keys listed in the file."""
    database_url: str | None = None
    """Where managed keys, usage rows and budget spend live: a SQLite file by default, PostgreSQL to share them."""
    redis_url: str | None = None
    """Shared rate-limit counters for several replicas; in-process memory when unset."""
    usage_journal: str | None = None
    """The directory of the usage journal (``gateway.journal``): by default beside the SQLite file, else in the data
    directory (one per database). A local disk: records wait there until the database has them.
    """
    rate_limits: list[UserPathLimit] = Field(default_factory=list)
    """Limits per user-path subtree."""
    cache: CacheConfig = Field(default_factory=CacheConfig)
    """The exact response cache."""
    deadline: float = Field(default=DEFAULT_DEADLINE, gt=0)
    """Seconds a decision request may spend on upstream attempts in all (local engines are not bounded by it)."""
    guardrails: list[GuardrailConfig] = Field(default_factory=list)
    """Guardrails models, virtual models and keys may name."""
    providers: list[ProviderConfig] = Field(default_factory=list)
    """Where answers come from: local engines and upstream providers."""
    models: list[ModelConfig] = Field(default_factory=list)
    """The names clients ask for, each on one provider."""
    virtual_models: list[VirtualModelConfig] = Field(default_factory=list)
    """Names for other models: failover, alias, cascade."""
    budgets: list[BudgetConfig] = Field(default_factory=list)
    """Spending limits in USD."""
    budgets_when_database_down: Literal["admit", "refuse"] = "admit"
    """While the database cannot be reached, requests under a budget are admitted unchecked ("admit", the default:
    their usage rows wait in the usage journal) or refused with 503 ("refuse").
    """
    budget_reservation_ttl_s: float = Field(default=BUDGET_RESERVATION_TTL_S, ge=1, le=86400)
    """Seconds after its last renewal (by the database's clock) that a process's budget hold is released by other
    replicas: its process died on another host, or stalled. Live processes renew every third of it and use a hold
    for two thirds of it after each renewal; a process that died on the same host is released at once."""
    audit: AuditConfig = Field(default_factory=AuditConfig)
    """What each usage row keeps, and for how long."""
    otel: OtelConfig = Field(default_factory=OtelConfig)
    """OpenTelemetry traces: where they are exported, under which service name, which share of requests."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """How the decision quality metrics of ``GET /metrics`` are labelled: how many question names get their own."""
    batches: BatchesConfig = Field(default_factory=BatchesConfig)
    """The Batch API: where files are kept, their size limit and each key's quota, how many lines and batches run at
    once."""
    learning: LearningConfig = Field(default_factory=LearningConfig)
    """Learned profiles: how often each replica reads the active ones."""
    console: ConsoleConfig = Field(default_factory=ConsoleConfig)
    """The operator's console (``/console``): its sessions and single sign-on with OpenID Connect."""
    default_model: str | None = None
    """The model that answers System One and SGLang requests whose model name is unknown (their APIs accept any name);
    defaults to the first local provider's model.
    """
    allow_raw_upstreams: bool = False
    """Whether a request may name ``<provider>/<upstream>`` that no model entry covers (a raw upstream, with no policy
    of its own); even then only keys whose allowlist names it may use one (see gateway.catalog).
    """
    concurrency_slot_ttl_s: float = Field(default=CONCURRENCY_SLOT_TTL_S, gt=0)
    """Seconds a concurrency slot held in Redis lives: a replica that dies holding slots frees them after this long."""
    public_docs: bool = False
    """Whether /openapi.json, /docs and /redoc answer without a key when keys are configured."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host names (besides loopback names and the address it serves on) a server without keys answers to: the Host
    header of every request must name one, so that DNS rebinding cannot reach an open server ("*": any).
    """

    _redis_url = field_validator("redis_url")(check_redis_url)

    @model_validator(mode="after")
    def _consistent(self) -> "GatewayConfig":
        names = [p.name for p in self.providers]
        if len(set(names)) != len(names):
            raise ValueError("provider names must be unique")
        providers = set(names)
        for m in self.models:
            if m.provider not in providers:
                raise ValueError(f"model {m.name!r} names unknown provider {m.provider!r}")
        model_names = [m.name for m in self.models] + [v.name for v in self.virtual_models]
        if len(set(model_names)) != len(model_names):
            raise ValueError("model and virtual model names must be unique")
        check_chains(self)
        defined = {g.name for g in self.guardrails}
        if len(defined) != len(self.guardrails):
            raise ValueError("guardrail names must be unique")
        for owner, names in [*((f"model {m.name!r}", m.guardrails) for m in self.models),
                             *((f"virtual model {v.name!r}", v.guardrails) for v in self.virtual_models),
                             *((f"key {k.name!r}", k.guardrails) for k in self.auth.keys)]:
            unknown = unknown_guardrail(names, defined)
            if unknown is not None:
                raise ValueError(f"{owner} names unknown guardrail {unknown!r}")
        return self
