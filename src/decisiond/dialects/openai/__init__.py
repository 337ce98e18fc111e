"""OpenAI's Decisions API wire format (``POST /v1/decisions``, openai-python 3.57 contract). Pure translation, in
four modules by concern:

- ``schema``: the wire models (``DecisionBody`` and its parts, ``EXTENSION_FIELDS``) and ``OpenAIWire``, the record
  of how a request was spelled;
- ``parse``: a request body → the canonical ``DecisionRequest``;
- ``render``: a canonical result or error → the response body (``render_response``, ``render_error``);
- ``upstream``: decisiond as an OpenAI client (``render_request``, ``parse_response``), for
  ``gateway/providers/openai.py``.

decisiond extensions, sent by the SDK through ``extra_body``: ``temperature``, ``chat_template_kwargs``,
``prompt_format_version``, ``return_prompt_token_ids``, ``order``, ``calibrate``; each answer also carries
``label_mass`` (and ``order_spread`` under cyclic order).

This package assembles ``DIALECT`` and re-exports the names its importers use (``wire.parse_request`` and so on).
"""

from __future__ import annotations

from ..base import WireDialect
from .parse import parse_request as parse_request
from .render import error_body as error_body
from .render import error_message as error_message
from .render import render_error as render_error
from .render import render_response as render_response
from .schema import DIALECT_NAME as DIALECT_NAME
from .schema import EXTENSION_FIELDS as EXTENSION_FIELDS
from .schema import DecisionBody as DecisionBody
from .schema import OpenAIWire as OpenAIWire
from .upstream import parse_response as parse_response
from .upstream import render_request as render_request

DIALECT = WireDialect(DIALECT_NAME, parse_request, render_response, render_error)
