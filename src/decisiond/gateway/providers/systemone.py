"""System One servers: TypeSafe's hosted Jev, self-hosted Kev, OpenRouter's decision models, SGLang, and other
decisiond instances. Bearer auth; the request and answers are translated both ways (``dialects.systemone``).
Images go as TypeSafe assets (multipart), with ``TypeSafe-Danger-Zone-Images: true``, to hosted Jev only."""

from __future__ import annotations

import json

from ...canonical import DecisionRequest, DecisionResult
from ...dialects import systemone as wire
from ...errors import DecisionError
from ..settings import TYPESAFE_HOSTED, ProviderConfig
from ..sizes import SYSTEM_ONE
from .base import HttpProvider


class SystemOneProvider(HttpProvider):
    format = "system_one"
    default_limits = SYSTEM_ONE

    @classmethod
    def images_by_default(cls, config: ProviderConfig) -> bool:
        """TypeSafe's hosted API reads images; Kev, OpenRouter's models and other servers do not."""
        return (config.base_url or "").rstrip("/") == TYPESAFE_HOSTED

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        """Besides text-only servers: an image this provider cannot be sent (a link, not a PNG or JPEG) skips it,
        without spending an attempt, so that a later target of the chain may take the request."""
        reason = super().unsupported(request)
        if reason is not None:
            return reason
        for image in request.images():
            try:
                wire.image_bytes(image)
            except DecisionError as error:
                return error
        return None

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        outbound = wire.render_request(request, upstream)
        headers = self.auth()
        if outbound.files:
            headers["TypeSafe-Danger-Zone-Images"] = "true"
            files: list[tuple[str, tuple[str | None, bytes, str]]] = [
                ("request", (None, json.dumps(outbound.body).encode(), "application/json"))]
            files += [(name, (name, data, media_type)) for name, data, media_type in outbound.files]
            data = await self.post(f"{self.base_url}/v1/systemone", headers, files=files)
        else:
            data = await self.post(f"{self.base_url}/v1/systemone", headers, json=outbound.body)
        return self.translate(wire.parse_response, data, request, outbound.keys)
