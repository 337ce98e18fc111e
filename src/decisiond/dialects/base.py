"""The ``Dialect`` protocol: how one wire format enters and leaves. Every dialect module is pure (no model, no
network) and exposes one ``DIALECT``, registered by one line in ``decisiond.dialects.REGISTRY``::

    DIALECT = WireDialect("acme", parse=parse_request, render=render_response, render_error=render_error)

- ``parse(document, files)``: the JSON document (and multipart files) → a canonical request, or a DecisionError
  naming the field at fault in the wire's own terms;
- ``render(result, request)``: a canonical result → the JSON body;
- ``render_error(error, document)``: a DecisionError raised anywhere (parsing, a pipeline stage, the router, the
  engine) → (HTTP status, JSON body) in the wire's error shape; ``document`` is None when the error came before
  the body was read (a 401, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol

from ..errors import DecisionError


class Dialect(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def operation(self) -> Literal["decide", "score"]:
        """"decide" (a decision request) or "score" (SGLang's /v1/score)."""

    @property
    def strict_model(self) -> bool:
        """Whether an unknown model name is refused (OpenAI) or answered by the served model (System One, SGLang)."""

    def parse(self, document: Any, files: Mapping[str, Any]) -> Any: ...

    def render(self, result: Any, request: Any) -> dict[str, Any]: ...

    def render_error(self, error: DecisionError, document: Any) -> tuple[int, dict[str, Any]]: ...


@dataclass(frozen=True)
class WireDialect:
    name: str
    parse: Callable[[Any, Mapping[str, Any]], Any]
    render: Callable[[Any, Any], dict[str, Any]]
    render_error: Callable[[DecisionError, Any], tuple[int, dict[str, Any]]]
    strict_model: bool = True
    operation: Literal["decide", "score"] = "decide"
