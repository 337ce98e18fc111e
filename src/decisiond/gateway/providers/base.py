"""What every provider offers the router, and the HTTP plumbing the upstream ones share."""

from __future__ import annotations

import json
from typing import Any

import httpx

from ...canonical import DecisionRequest, DecisionResult
from ...errors import DecisionError, upstream_error
from ..config import Limits, ProviderConfig


class Provider:
    """A decision provider. ``format`` says which wire format answers: openai, system_one or local."""

    format = "local"
    default_limits = Limits()

    def __init__(self, config: ProviderConfig):
        self.config = config
        self.name = config.name

    @property
    def limits(self) -> Limits:
        own = self.config.limits.model_dump(exclude_none=True) if self.config.limits else {}
        return self.default_limits.model_copy(update=own)

    @property
    def reads_images(self) -> bool:
        return self.config.reads_images

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        """Why this provider cannot take ``request`` at all (it is then skipped without an attempt), or None."""
        images = request.images()
        if images and not self.reads_images:
            return DecisionError(f"provider {self.name!r} reads text only, so the request's images cannot be sent "
                                 "to it", images[0].source, code="unsupported_input")
        return None

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        raise NotImplementedError

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
            return error["message"]
        if isinstance(body.get("message"), str):
            return body["message"]
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
    def __init__(self, config: ProviderConfig):
        super().__init__(config)
        self.base_url = (config.base_url or "").rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        )

    async def post(self, url: str, headers: dict[str, str], **kwargs: Any) -> Any:
        """POST and return the JSON body; an unavailable provider or an error status becomes an UpstreamError."""
        try:
            response = await self.client.post(url, headers={**self.config.headers, **headers}, **kwargs)
        except httpx.TimeoutException as e:
            raise upstream_error(self.name, 504, f"provider {self.name!r} timed out: {type(e).__name__}",
                                 code="upstream_timeout") from e
        except httpx.HTTPError as e:
            raise upstream_error(self.name, 502, f"provider {self.name!r} is unreachable: {type(e).__name__}: {e}",
                                 code="upstream_unavailable") from e
        if response.status_code >= 400:
            kept = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "retry-after-ms")}
            raise upstream_error(self.name, response.status_code, error_message(response.text), kept)
        try:
            return response.json()
        except ValueError as e:
            raise upstream_error(self.name, 502, f"provider {self.name!r} answered with a body that is not JSON",
                                 code="upstream_invalid_response") from e

    def translate(self, parse, *args: Any) -> DecisionResult:
        """Translate an upstream answer; one that does not fit its wire format is the provider's fault (502)."""
        try:
            return parse(*args)
        except DecisionError as e:
            if e.status < 500:
                raise
            raise upstream_error(self.name, 502, f"provider {self.name!r}: {e.message}",
                                 code="upstream_invalid_response") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise upstream_error(self.name, 502, f"provider {self.name!r} answered in an unexpected shape: {e}",
                                 code="upstream_invalid_response") from e

    async def aclose(self) -> None:
        await self.client.aclose()
