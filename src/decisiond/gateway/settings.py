"""The gateway's configuration as data: pydantic models of the YAML (providers, models, virtual models, keys, limits,
budgets, guardrails, cache, audit), each validated on its own and against its siblings. A section of its own per
module beside this one: keys, user paths, rate limits and budgets (``access_settings``), guardrails
(``guardrail_settings``), audit, traces and metrics (``telemetry_settings``), batches, the console, served models'
log-probs; ``GatewayConfig``, here, holds them all. Pure: no I/O and no provider registry — ``gateway.config`` reads
the file, interpolates ``${ENV}`` and checks each provider entry against its registered type.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
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
    PROFILE_REFRESH_S,
)
from .access_settings import AuthConfig, BudgetConfig, RateLimitConfig, UserPathLimit
from .batch_settings import BatchesConfig
from .console_settings import ConsoleConfig
from .guardrail_settings import GuardrailConfig, unknown_guardrail
from .logprobs_settings import LogprobsOptions
from .pricing import Pricing
from .telemetry_settings import AuditConfig, MetricsConfig, OtelConfig
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
