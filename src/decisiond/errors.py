"""decisiond's one exception tree, as httpx has one: every refusal, anywhere, is a ``DecisionError``.

```
DecisionError                  the root: message, field path, code, HTTP status, OpenAI error type
├── InvalidRequest             400 (System One: 422 when ``validation``): the request is malformed
│   └── LimitExceeded          400 ``limit_exceeded``, 413 ``request_too_large``: over a limit
├── AuthenticationFailed       401: no key, or a wrong, revoked or expired one
├── BudgetExceeded             402 ``budget_exceeded``: a budget has no room for the request
├── PermissionDenied           403: the key may not do this (a model outside its allowlist, …)
├── NotFound                   404: no such model, key or budget
├── GuardrailBlocked           400 ``guardrail_blocked``: a prompt guardrail refused the request
├── RateLimited                429 ``rate_limit_exceeded``, with retry headers
├── Timeout                    504: the request's deadline passed
├── ProviderError              a provider (an upstream, or the local model) failed: 5xx, or the upstream's 4xx
│   └── ProviderTimeout        504 ``upstream_timeout``: a provider did not answer in time (also a Timeout)
├── Unavailable                503: the server cannot take the request now (busy, its database down)
├── ConnectionFailed           ``decisiond.Client`` could not reach the server
└── ServerError                500: a fault of decisiond's own
```

A refusal carries the field at fault as a path in the wire terms of the dialect that parsed the request (each
canonical object remembers where it came from), so that each dialect renders it at one boundary in its own error
shape: OpenAI's ``param`` string, System One's FastAPI ``loc`` list, SGLang's message. Each class sets its status,
code and OpenAI error type; a raise may name a more precise code.

Beside the tree, ``InputError``: not a request's refusal but the command line's, a file or setting a command was
given that it cannot use (one line naming the file, line and field; exit code 2).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

Path = tuple[str | int, ...]


class DecisionError(Exception):
    """The root of decisiond's exceptions: a refused or failed request.

    ``message`` is for people; ``path`` names the field at fault; ``code`` is the machine-readable reason;
    ``status`` the HTTP status; ``type`` OpenAI's error type; ``validation`` marks errors about the request's shape
    (System One answers those with 422); ``headers`` go on the HTTP response; ``details`` lists every problem
    found (FastAPI style ``{loc, msg, type}``) when the error came from schema validation.
    """

    status: int = 400
    code: str = "invalid_value"
    type: str = "invalid_request_error"
    validation: bool = False
    default_headers: ClassVar[Mapping[str, str]] = {}

    def __init__(self, message: str, path: Path = (), *, code: str | None = None, status: int | None = None,
                 type: str | None = None, validation: bool | None = None,
                 headers: Mapping[str, str] | None = None, details: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.message = message
        self.path: Path = tuple(path)
        cls = self.__class__
        self.code = code if code is not None else cls.code
        self.status = status if status is not None else cls.status
        self.type = type if type is not None else cls.type
        self.validation = validation if validation is not None else cls.validation
        self.headers: dict[str, str] = {**cls.default_headers, **(headers or {})}
        self.details = details

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.message!r}, code={self.code!r}, status={self.status})"


class InvalidRequest(DecisionError):
    """The request is malformed or asks for something this server does not do."""


class LimitExceeded(InvalidRequest):
    """The request is over a limit (questions, choices, tokens, body size, …); it is never split or cut."""

    code = "limit_exceeded"


class AuthenticationFailed(DecisionError):
    """401: no API key, or a wrong, revoked or expired one."""

    status = 401
    code = "invalid_api_key"
    type = "authentication_error"
    default_headers = {"www-authenticate": "Bearer"}


class BudgetExceeded(DecisionError):
    """402: a budget of the key, its user path or the model has no room for the request; it resets with its
    period (``retry-after``)."""

    status = 402
    code = "budget_exceeded"
    type = "insufficient_quota"


class PermissionDenied(DecisionError):
    """403: the key may not do this (a model outside its allowlist, a user path outside its own, a master route)."""

    status = 403
    code = "permission_denied"
    type = "permission_error"


class NotFound(DecisionError):
    """404: no such model, key or budget."""

    status = 404
    code = "not_found"
    type = "not_found_error"


class GuardrailBlocked(DecisionError):
    """400: a prompt guardrail refused the request; the provider was not called."""

    code = "guardrail_blocked"


class RateLimited(DecisionError):
    """429 with the retry headers both SDKs honour (``retry-after-ms`` first, then ``Retry-After``)."""

    status = 429
    code = "rate_limit_exceeded"
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float | None = None, *, headers: Mapping[str, str] | None = None,
                 **kwargs: Any):
        merged = dict(headers or {})
        if retry_after_s is not None:
            retry_after_s = max(retry_after_s, 0.001)
            merged.update({"retry-after": str(max(1, math.ceil(retry_after_s))),
                           "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000)))})
        super().__init__(message, headers=merged, **kwargs)


class Timeout(DecisionError):
    """504: the request's deadline passed (``x-decisiond-timeout-ms``, a virtual model's deadline)."""

    status = 504
    code = "deadline_exceeded"
    type = "api_error"


class ProviderError(DecisionError):
    """A provider's failure, kept with its status and message (cut to 512 characters, credentials scrubbed).

    ``failover``: the provider was unavailable (429, 5xx, 529, a timeout or a broken connection), so the next
    target of a failover chain may answer; validation errors (other 4xx) end the chain.
    """

    status = 502
    code = "provider_error"
    type = "api_error"

    def __init__(self, message: str, path: Path = (), *, failover: bool = False, provider: str = "",
                 **kwargs: Any):
        super().__init__(message, path, **kwargs)
        self.failover = failover
        self.provider = provider


class ProviderTimeout(ProviderError, Timeout):
    """504: a provider did not answer in time."""

    status = 504
    code = "upstream_timeout"


class Unavailable(DecisionError):
    """503: the server cannot take the request now (the model is busy, its database is down); retry later."""

    status = 503
    code = "unavailable"
    type = "server_error"


class ConnectionFailed(DecisionError):
    """``decisiond.Client`` could not reach the server (refused, reset, or no answer)."""

    status = 503
    code = "connection_failed"
    type = "api_connection_error"


class ServerError(DecisionError):
    """500: a fault of decisiond's own; never carries a traceback."""

    status = 500
    code = "internal_error"
    type = "server_error"


class ClientGone(Exception):
    """The client disconnected before its answer was ready (or, on chat routes, while it streamed). Not a refusal:
    nobody is there to read one."""

    status = 499  # nginx's "client closed request": only ever in logs and usage records
    code = "client_closed_request"


class InputError(ValueError):
    """A file or setting a command was given that it cannot use: missing, unreadable, not JSON or YAML, of the
    wrong shape. ``str()`` is one line, ``FILE:LINE: FIELD: what is wrong`` (each part where known; the field as the
    server names it, ``questions[0].choices``); the command line prints it as ``decisiond: <line>`` and exits 2
    (``decisiond.cli.main``). Raised where the file is read, before any model loads."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message, path, line, field)
        self.message, self.path, self.line, self.field = message, path, line, field

    def __str__(self) -> str:
        where = None if self.path is None else os.fspath(self.path)
        if where is not None and self.line:
            where = f"{where}:{self.line}"
        return " ".join(": ".join(part for part in (where, self.field, self.message) if part).split("\n"))

    def at(self, path: str | os.PathLike[str], line: int | None = None) -> InputError:
        """The same error (of the same class), in the file ``path`` (at ``line``)."""
        return type(self)(self.message, path, line, self.field)

    @classmethod
    def read_text(cls, path: str | os.PathLike[str]) -> str:
        """The text of the UTF-8 file ``path``; an error of this class (``unreadable``) where it cannot be read."""
        try:
            return pathlib.Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise cls.unreadable(path, e) from None

    @classmethod
    def json_lines(cls, path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
        """(line number, counted from 1, and value) of each line of the JSON Lines file ``path`` that is not blank,
        parsed as it is reached; an error of this class naming the file (``read_text``), or the line that is not
        JSON (``not_json``)."""
        for number, line in enumerate(cls.read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise cls(cls.not_json(e), path, number) from None
            yield number, value

    @staticmethod
    def not_json(error: json.JSONDecodeError) -> str:
        """What is wrong with a text that is not JSON, as a refusal says it."""
        return f"not JSON ({error.msg}, column {error.colno})"

    @classmethod
    def unreadable(cls, path: str | os.PathLike[str], error: OSError | UnicodeDecodeError) -> InputError:
        """``path`` cannot be read: missing, a folder, not permitted, not text (an error of this class)."""
        if isinstance(error, UnicodeDecodeError):
            return cls(f"not UTF-8 text (byte {error.start})", path)
        return cls(f"cannot read it: {error.strerror or error}", path)


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


def invalid(message: str, *path: str | int, code: str = "invalid_value") -> InvalidRequest:
    """A malformed request (System One: 422)."""
    return InvalidRequest(message, tuple(path), code=code, validation=True)


def refused(message: str, *path: str | int, code: str = "unsupported_value") -> InvalidRequest:
    """A well-formed request this server does not do (400 everywhere)."""
    return InvalidRequest(message, tuple(path), code=code)


UPSTREAM_MESSAGE_LIMIT = 512
# The headers of a refusal that say when to retry, kept from an upstream's answer and relayed to clients (both SDKs
# honour ``retry-after-ms`` first, then ``retry-after``).
RETRY_HEADERS = ("retry-after", "retry-after-ms")


def retry_headers(headers: Any) -> dict[str, str]:
    """The retry headers among ``headers`` (any mapping, names in any case)."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in RETRY_HEADERS}
FAILOVER_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})

# What credentials look like in an upstream's error text: bearer tokens, sk-/dk- style keys, key=value pairs.
_CREDENTIALS = re.compile(
    r"(?i)(bearer\s+)[^\s\"',;]+"
    r"|\b(?:sk|dk|rk|pk|ak)-[A-Za-z0-9_\-]{6,}"
    r"|((?:api[_-]?key|access[_-]?token|secret|password|authorization)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;]+")
REDACTED = "[redacted]"


def one_line(error: BaseException) -> str:
    """An error as one line for a log or a refusal: its type and its message's first line (the driver's own error
    where a library wraps one in ``orig``, as SQLAlchemy does), credentials cut out."""
    inner = getattr(error, "orig", None) or error
    first = (str(inner).strip().splitlines() or [""])[0]
    return scrub(f"{type(inner).__name__}: {first}"[:300])


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` without the given secrets and without anything that looks like a credential."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _CREDENTIALS.sub(lambda m: (m.group(1) or m.group(2) or "") + REDACTED, text)


def provider_error(provider: str, status: int, message: str, headers: dict[str, str] | None = None,
                   code: str | None = None, secrets: tuple[str, ...] = ()) -> ProviderError:
    """A provider's error as clients and logs may see it: scrubbed of credentials, cut to 512 characters; a
    ``ProviderTimeout`` for a 504."""
    message = scrub(message, secrets)
    message = message if len(message) <= UPSTREAM_MESSAGE_LIMIT else message[: UPSTREAM_MESSAGE_LIMIT - 1] + "…"
    failover = status in FAILOVER_STATUSES or status >= 500
    kind = "rate_limit_error" if status == 429 else "api_error" if status >= 500 else "invalid_request_error"
    cls = ProviderTimeout if status == 504 else ProviderError
    return cls(message, code=code or f"upstream_{status}", status=status, type=kind, headers=headers or {},
               failover=failover, provider=provider)
