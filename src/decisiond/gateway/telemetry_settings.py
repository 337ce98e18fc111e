"""The configuration of what the gateway tells about its traffic (``GatewayConfig.audit``, ``otel``, ``metrics``):
usage rows' bodies and retention, OpenTelemetry traces, the labels of ``/metrics``. Pure configuration models, as
``settings``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..limits import DEFAULT_QUESTION_LABELS, MAX_QUESTION_LABELS


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
