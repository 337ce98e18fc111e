"""What every provider offers the router (the ``DecisionProvider`` protocol and its ``Provider`` base), and the
HTTP plumbing the upstream ones share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Protocol

import aiohttp
import httpx
import orjson

from ... import tracing
from ...canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult
from ...errors import DecisionError, InvalidRequest, provider_error, retry_headers
from ..settings import Limits, ProviderConfig


class DecisionProvider(Protocol):
    """What the router needs of a provider. Example: an upstream that always answers "yes"::

        class Yes(Provider):
            format = "openai"

            async def decide(self, request, upstream):
                return DecisionResult(upstream, [Answer(q.kind, q.name, [1.0, 0.0]) for q in request.questions])

    What a provider can do is declared, never inferred from its type: ``capabilities`` (see ``Provider``), the model
    it runs itself (``own_model``), what shapes its answers besides the request (``cache_identity``), and the
    in-process engines whose counters the metrics read (``engines``).
    """

    name: str
    format: str
    capabilities: ClassVar[frozenset[str]]
    timed_by_router: ClassVar[bool]
    cached_by_default: ClassVar[bool]

    @property
    def limits(self) -> Limits: ...

    @property
    def reads_images(self) -> bool: ...

    @property
    def own_model(self) -> str | None: ...

    def describe(self) -> str: ...

    def release_date(self) -> str: ...

    def cache_identity(self) -> dict[str, Any] | None: ...

    def engines(self) -> dict[str, Any]: ...

    def detokenize(self, ids: tuple[int, ...]) -> str: ...

    async def input_tokens(self, request: DecisionRequest) -> int | None: ...

    async def output_tokens(self, request: DecisionRequest) -> int | None: ...

    def unsupported(self, request: DecisionRequest) -> DecisionError | None: ...

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult: ...

    async def score(self, request: ScoreRequest) -> ScoreResult: ...

    async def aclose(self) -> None: ...


class Provider:
    """The base of every provider type. ``format`` says which wire format answers (openai, system_one, local);
    ``capabilities`` what it can serve; ``default_limits`` its own request limits (config may tighten them).

    Capabilities: ``decisions`` (``decide``), ``chat`` (chat traffic is forwarded to it), ``images`` (it can read
    images), ``score`` (``score``: SGLang's ``/v1/score``, label log-probs after given prompts) and
    ``engine_options`` (it applies decisiond's own engine options — ``temperature``, ``order``, ``calibrate``,
    ``prompt_format_version``, ``chat_template_kwargs``, ``return_prompt_token_ids``; a request using one is not
    sent to a provider without it)."""

    format = "local"
    capabilities: ClassVar[frozenset[str]] = frozenset({"decisions"})
    default_limits = Limits()
    needs_base_url = True
    # Whether answers carry token counts; a provider that reports none may only be priced per request.
    reports_tokens: ClassVar[bool] = True
    # Whether the router bounds each attempt by a timeout (an in-process engine bounds its own work instead).
    timed_by_router: ClassVar[bool] = True
    # Whether the response cache holds its answers when no config says either way (deterministic answerers).
    cached_by_default: ClassVar[bool] = False

    def __init__(self, config: ProviderConfig):
        self.config = config
        self.name = config.name

    @classmethod
    def from_config(cls, config: ProviderConfig, engines: Mapping[str, Any]) -> "Provider":
        return cls(config)

    @classmethod
    def check_config(cls, config: ProviderConfig) -> None:
        """Refuse, at start-up, a config this type cannot work with (a ValueError naming the provider)."""
        if cls.needs_base_url and not config.base_url:
            raise ValueError(f"provider {config.name!r} ({config.type}) needs a base_url")

    @classmethod
    def images_by_default(cls, config: ProviderConfig) -> bool:
        return False

    @property
    def limits(self) -> Limits:
        own = self.config.limits.model_dump(exclude_none=True) if self.config.limits else {}
        return self.default_limits.model_copy(update=own)

    @property
    def reads_images(self) -> bool:
        return self.config.images if self.config.images is not None else self.images_by_default(self.config)

    @property
    def own_model(self) -> str | None:
        """The one model this provider runs itself (served as ``<provider>/<model>`` and ``<model>``, no other
        ``<provider>/...`` name), or None for a provider that forwards any upstream model name."""
        return None

    def describe(self) -> str:
        """One line for model lists about ``own_model``."""
        return ""

    def release_date(self) -> str:
        """``own_model``'s release date (YYYY-MM-DD), or "" when unknown."""
        return ""

    def cache_identity(self) -> dict[str, Any] | None:
        """Everything besides the request and the target that shapes this provider's answers (weights, default
        modes, profile, prompt format), as JSON-able data for the response cache's key; None when nothing does."""
        return None

    def engines(self) -> dict[str, Any]:
        """The in-process engines this provider runs, by served name, for the metrics to read at scrape time."""
        return {}

    async def input_tokens(self, request: DecisionRequest) -> int | None:
        """The input tokens ``request`` will be billed for, counted exactly where this provider runs its own model
        (its tokenizer), else None: the caller then uses a bound (``sizes.max_input_tokens``)."""
        return None

    async def output_tokens(self, request: DecisionRequest) -> int | None:
        """The most output tokens ``request`` can be billed for where this provider knows it (a served model: one a
        read), else None: the caller then uses a bound (``sizes.max_output_tokens``)."""
        return None

    def detokenize(self, ids: tuple[int, ...]) -> str:
        """The text of token ids (what guardrails read of a ``/v1/score`` token-id prompt); only a provider that
        runs its own model has a tokenizer."""
        raise ValueError(f"provider {self.name!r} has no tokenizer to read token ids with")

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        """Why this provider cannot take ``request`` at all (it is then skipped without an attempt), or None."""
        images = request.images()
        if images and not self.reads_images:
            return InvalidRequest(f"provider {self.name!r} reads text only, so the request's images cannot be sent "
                                 "to it", images[0].source, code="unsupported_input")
        return None

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        raise NotImplementedError

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Label log-probs after prompts; only for providers with the ``score`` capability."""
        raise NotImplementedError(f"provider {self.name!r} has no score capability")

    async def aclose(self) -> None:
        return None


def error_message(text: str) -> str:
    """The provider's own message from an error body: OpenAI's ``error.message``, System One's ``detail``."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        return text.strip() or "(no body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail
        if isinstance(detail, list):
            return "; ".join(
                ".".join(str(p) for p in d.get("loc", []) if p != "body") + f": {d.get('msg', '')}"
                for d in detail if isinstance(d, dict)
            )
    return text.strip()


class HttpProvider(Provider):
    """An upstream reached over HTTP. Decisions go through an aiohttp session (the request's hot path: a
    connection pool of ``max_connections``, kept alive between requests); chat traffic, which is relayed as it
    streams (``gateway.forward``), through an httpx client (``client``)."""

    max_connections = 100

    def __init__(self, config: ProviderConfig):
        super().__init__(config)
        self.base_url = (config.base_url or "").rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        )
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._timeout = aiohttp.ClientTimeout(total=config.timeout, sock_connect=config.connect_timeout)

    @property
    def secrets(self) -> tuple[str, ...]:
        """What this provider sends that must never be echoed: its key and its configured header values."""
        return tuple(v for v in (self.config.api_key, *self.config.headers.values()) if v)

    def headers(self, own: dict[str, str]) -> dict[str, str]:
        """An upstream request's headers: the configured ones, the request's ``own`` (its key) and, when the gateway
        traces, the current attempt's ``traceparent``."""
        headers = {**self.config.headers, **own}
        tracing.inject(headers)
        return headers

    def auth(self) -> dict[str, str]:
        """The header that carries this provider's key (a Bearer token; Azure overrides it)."""
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session of the running event loop (made on first use: a session belongs to one loop)."""
        session, loop = self._session, asyncio.get_running_loop()
        if session is None or session.closed or self._session_loop is not loop:
            if session is not None and not session.closed:
                session.detach()  # its loop is gone (a library user's earlier asyncio.run): nothing left to close
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections), timeout=self._timeout,
                json_serialize=_dumps, skip_auto_headers=("User-Agent",))
            self._session_loop = loop
        return session

    async def post(self, url: str, headers: dict[str, str], json: Any = None,
                   files: list[tuple[str, tuple[str | None, bytes, str]]] | None = None) -> Any:
        """POST ``json`` (or ``files`` as multipart/form-data: (field, (filename, bytes, content type))) and
        return the JSON body; an unavailable provider or an error status becomes a ``ProviderError``."""
        data: aiohttp.FormData | None = None
        if files is not None:
            data = aiohttp.FormData()
            for field, (filename, content, content_type) in files:
                data.add_field(field, content, filename=filename, content_type=content_type)
        return await self._exchange("POST", url, headers, json=json, data=data)

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        """GET ``url`` and return its JSON body; failures as ``post``'s."""
        return await self._exchange("GET", url, headers)

    async def _exchange(self, method: str, url: str, headers: dict[str, str], **body: Any) -> Any:
        try:
            async with self.session().request(method, url, headers=self.headers(headers), **body) as response:
                status, raw = response.status, await response.read()
                kept = retry_headers(response.headers) if status >= 400 else {}
        except asyncio.TimeoutError as e:
            raise provider_error(self.name, 504, f"provider {self.name!r} timed out: {type(e).__name__}",
                                 code="upstream_timeout") from e
        except (aiohttp.ClientError, OSError) as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} is unreachable: {type(e).__name__}: {e}",
                                 secrets=self.secrets, code="upstream_unavailable") from e
        if status >= 400:
            raise provider_error(self.name, status, error_message(raw.decode("utf-8", "replace")), kept,
                                 secrets=self.secrets)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} answered with a body that is not JSON",
                                 code="upstream_invalid_response") from e

    def translate(self, parse: Callable[..., DecisionResult], *args: Any) -> DecisionResult:
        """Translate an upstream answer; one that does not fit its wire format is the provider's fault (502)."""
        try:
            return parse(*args)
        except DecisionError as e:
            if e.status < 500:
                raise
            raise provider_error(self.name, 502, f"provider {self.name!r}: {e.message}",
                                 code="upstream_invalid_response") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} answered in an unexpected shape: {e}",
                                 code="upstream_invalid_response") from e

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()
