"""The one exception type every layer raises for a refused request.

A refusal carries the field at fault as a path in the wire terms of the dialect that parsed the request
(each canonical object remembers where it came from), so every dialect can render it in its own error shape:
OpenAI's ``param`` string, System One's FastAPI ``loc`` list, SGLang's message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ClientGone",
    "DecisionError",
    "FAILOVER_STATUSES",
    "Path",
    "UPSTREAM_MESSAGE_LIMIT",
    "UpstreamError",
    "invalid",
    "openai_param",
    "refused",
    "upstream_error",
]

Path = tuple[str | int, ...]


@dataclass
class DecisionError(Exception):
    message: str
    path: Path = ()
    code: str = "invalid_value"
    status: int = 400
    # OpenAI's error type; also decides System One's 422 (invalid request) versus 400 (other refusal).
    type: str = "invalid_request_error"
    # Set on errors that are about the request's shape (System One answers those with 422).
    validation: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    # Every problem found, FastAPI style ({loc, msg, type}), when the error came from schema validation.
    details: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ClientGone(Exception):
    """The client disconnected before its answer was ready (or, on chat routes, while it streamed)."""

    status = 499  # nginx's "client closed request": only ever in logs and usage records
    code = "client_closed_request"


def openai_param(path: Path) -> str | None:
    """``("questions", 1, "choices", 0)`` → ``questions[1].choices[0]``."""
    if not path:
        return None
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def invalid(message: str, *path: str | int, code: str = "invalid_value") -> DecisionError:
    return DecisionError(message, tuple(path), code=code, validation=True)


def refused(message: str, *path: str | int, code: str = "unsupported_value") -> DecisionError:
    return DecisionError(message, tuple(path), code=code)


UPSTREAM_MESSAGE_LIMIT = 512
FAILOVER_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})


@dataclass
class UpstreamError(DecisionError):
    """An upstream provider's error, kept with its status and message (cut to 512 characters).

    ``failover``: the provider was unavailable (429, 5xx, 529, a timeout or a broken connection), so the next
    target of a failover chain may answer; validation errors (other 4xx) end the chain.
    """

    failover: bool = False
    provider: str = ""


# What credentials look like in an upstream's error text: bearer tokens, sk-/dk- style keys, key=value pairs.
_CREDENTIALS = re.compile(
    r"(?i)(bearer\s+)[^\s\"',;]+"
    r"|\b(?:sk|dk|rk|pk|ak)-[A-Za-z0-9_\-]{6,}"
    r"|((?:api[_-]?key|access[_-]?token|secret|password|authorization)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;]+")
REDACTED = "[redacted]"


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` without the given secrets and without anything that looks like a credential."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _CREDENTIALS.sub(lambda m: (m.group(1) or m.group(2) or "") + REDACTED, text)


def upstream_error(provider: str, status: int, message: str, headers: dict[str, str] | None = None,
                   code: str | None = None, secrets: tuple[str, ...] = ()) -> UpstreamError:
    """An upstream's error as clients and logs may see it: scrubbed of credentials, cut to 512 characters."""
    message = scrub(message, secrets)
    message = message if len(message) <= UPSTREAM_MESSAGE_LIMIT else message[: UPSTREAM_MESSAGE_LIMIT - 1] + "…"
    failover = status in FAILOVER_STATUSES or status >= 500
    kind = "rate_limit_error" if status == 429 else "api_error" if status >= 500 else "invalid_request_error"
    return UpstreamError(message, (), code=code or f"upstream_{status}", status=status, type=kind,
                         headers=headers or {}, failover=failover, provider=provider)
