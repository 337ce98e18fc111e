"""The configuration of who may do what, and how much (``GatewayConfig.auth``, ``rate_limits``, ``budgets``): user
paths, rate limits, budgets, and the keys listed in the file. Pure configuration models, as ``settings``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, model_validator

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
