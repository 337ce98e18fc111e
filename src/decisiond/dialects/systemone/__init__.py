"""TypeSafe's System One wire format (``POST /v1/systemone``, typesafe-sdk 0.7.5 contract). Pure translation, in
four modules by concern:

- ``schema``: the wire models (``SystemOneBody`` and its questions and assets) and the spelling of a level;
- ``parse``: a body (and multipart files) → the canonical ``DecisionRequest``;
- ``render``: a canonical result or error → the response body (answers keyed by id; 422 ``detail`` lists);
- ``upstream``: decisiond as a System One client (``render_request``, ``parse_response``, ``image_bytes``), for
  ``gateway/providers/systemone.py``.

This package assembles ``DIALECT`` and re-exports the names its importers use (``s1.parse_request`` and so on).
"""

from __future__ import annotations

from ..base import WireDialect
from .parse import parse_request as parse_request
from .render import models_body as models_body
from .render import render_error as render_error
from .render import render_response as render_response
from .schema import SystemOneBody as SystemOneBody
from .upstream import Outbound as Outbound
from .upstream import image_bytes as image_bytes
from .upstream import parse_response as parse_response
from .upstream import render_request as render_request

DIALECT = WireDialect("system_one", parse_request, render_response, render_error, strict_model=False)
