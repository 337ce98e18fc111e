"""What a ``type: logprobs`` provider learns about its server from the server's own replies (``logprobs.py``), each
fact kept for ``limits.SERVED_LEARNED_S`` and then learned again: a server is upgraded, restarted or sits behind a
load balancer over several versions, so nothing learned once holds for the life of the process. The clock is a
parameter, so that a test moves it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...limits import SERVED_LEARNED_S

# The facts: the server behind the URL (dialects.served_servers.Server), that it reads its log-probabilities before it
# restricts the answer, that it refused decisiond's extra fields, the most log-probabilities it gives, and that its
# native route (SGLang's /generate) is not there.
SERVER, RESTRICTION_IGNORED, PLAIN_ONLY, MOST_LOGPROBS = "server", "restriction_ignored", "plain_only", "max_logprobs"
NO_GENERATE_ROUTE = "no_generate_route"


class Facts:
    """Facts by name, each forgotten ``ttl`` seconds after it was learned (``clock``: monotonic seconds)."""

    def __init__(self, ttl: float = SERVED_LEARNED_S, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._facts: dict[str, tuple[float, Any]] = {}

    def get(self, name: str, default: Any = None) -> Any:
        held = self._facts.get(name)
        if held is None:
            return default
        if self.clock() - held[0] >= self.ttl:
            del self._facts[name]
            return default
        return held[1]

    def learn(self, name: str, value: Any) -> None:
        self._facts[name] = (self.clock(), value)
