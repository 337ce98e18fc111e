"""Chat traffic as the gateway sees it: ``POST /v1/chat/completions`` and ``POST /v1/responses`` as the stages see
them (``ChatRequest``), the answer's way back to the client (``Relay``), and the usage read from that answer as it
passes (``UsageMeter``). The pipeline's last step for them is ``gateway.forward``.

The answer is never held back: each chunk goes to the client as it comes, and a copy of what is needed to read the
usage is kept on the side — for a JSON answer the body (usage is at its end), for server-sent events only the
current line. Chat completions report ``usage.prompt_tokens``/``completion_tokens`` (streamed: in the last chunk,
when the client asked ``stream_options: {include_usage: true}``); the Responses API reports
``usage.input_tokens``/``output_tokens`` (streamed: in the ``response.completed`` event's ``response``).

The pipeline's stages hold what they reserved (rate-limit tokens and slots, budget reservations) until ``forward``
returns, that is until the last chunk has passed; so a streamed answer is settled with its real usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..canonical import Usage
from ..limits import CHAT_RELAY_CHUNKS, CHAT_USAGE_SCAN_BYTES

log = logging.getLogger("decisiond.chat")

# The chat routes and the request type of their usage records.
ROUTES = {"chat/completions": "chat", "responses": "responses"}
# (container, key): a place in the JSON body holding prompt text, so a redaction can be written back in place.
Slot = tuple[Any, Any]


class Relay:
    """The answer's way from ``forward`` (inside the pipeline) to the HTTP response: its status and headers once the
    upstream has answered, then its chunks through a small bounded queue, then the end."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.provider: str | None = None
        self.closed = False
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue(CHAT_RELAY_CHUNKS)

    def start(self, status: int, headers: dict[str, str], provider: str) -> None:
        self.status, self.headers, self.provider = status, headers, provider
        self.started.set()

    async def send(self, chunk: bytes) -> None:
        await self._chunks.put(chunk)

    def close(self) -> None:
        """No more chunks (the end of the answer, or its failure). Never waits."""
        self.closed = True
        try:
            self._chunks.put_nowait(None)
        except asyncio.QueueFull:  # the reader is not waiting: it sees ``closed`` once it has drained the queue
            pass

    async def chunks(self) -> AsyncIterator[bytes]:
        while not (self.closed and self._chunks.empty()):
            chunk = await self._chunks.get()
            if chunk is None:
                return
            yield chunk


@dataclass
class ChatRequest:
    """A chat or Responses request: its route, the JSON body (sent on as it is, model replaced, redactions written
    into it), the model it names and where its prompt text is."""

    route: str
    body: dict[str, Any]
    model: str
    slots: list[Slot]
    relay: Relay = field(default_factory=Relay)

    def texts(self) -> tuple[str, ...]:
        return tuple(str(container[key]) for container, key in self.slots)

    def apply(self, texts: tuple[str, ...]) -> None:
        """Write (redacted) texts back where they came from."""
        for (container, key), text in zip(self.slots, texts):
            container[key] = text


@dataclass
class ChatResult:
    """What the pipeline returns for a chat request once the answer has passed: the upstream's usage (zero when it
    reported none — ``reported`` says which), the model it named, its status, and a JSON answer's body (for the
    audit; None for server-sent events)."""

    usage: Usage
    model: str | None
    status: int
    reported: bool
    document: Any = None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def read_usage(data: Any) -> Usage | None:
    """A ``usage`` object of either API (chat's ``prompt_tokens``, Responses' ``input_tokens``), or None."""
    if not isinstance(data, dict):
        return None
    details_in = data.get("prompt_tokens_details") or data.get("input_tokens_details") or {}
    details_out = data.get("completion_tokens_details") or data.get("output_tokens_details") or {}
    cost = data.get("cost")
    return Usage(
        input_tokens=_int(data.get("prompt_tokens", data.get("input_tokens"))),
        output_tokens=_int(data.get("completion_tokens", data.get("output_tokens"))),
        cached_tokens=_int(details_in.get("cached_tokens")) if isinstance(details_in, dict) else 0,
        reasoning_tokens=_int(details_out.get("reasoning_tokens")) if isinstance(details_out, dict) else 0,
        cost=float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) and cost >= 0 else None)


class UsageMeter:
    """Reads the usage out of an answer fed to it chunk by chunk (see the module docstring). At most
    ``CHAT_USAGE_SCAN_BYTES`` of a JSON body, or of one event line, are kept; a larger one passes uncounted."""

    def __init__(self, content_type: str):
        self.events = "text/event-stream" in content_type.lower()
        self.usage: Usage | None = None
        self.model: str | None = None
        self.document: Any = None
        self.overflow = False
        self._buffer = bytearray()
        self._skipping = False  # inside an event line too long to keep

    def feed(self, chunk: bytes) -> None:
        if not self.events:
            if not self.overflow:
                self._buffer += chunk
                if len(self._buffer) > CHAT_USAGE_SCAN_BYTES:
                    self.overflow, self._buffer = True, bytearray()
            return
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                break
            if not self._skipping:
                self._buffer += chunk[start:end]
                self._line(bytes(self._buffer))
            self._buffer.clear()
            self._skipping = False
            start = end + 1
        if not self._skipping:
            self._buffer += chunk[start:]
            if len(self._buffer) > CHAT_USAGE_SCAN_BYTES:
                self.overflow, self._skipping = True, True
                self._buffer.clear()

    def finish(self) -> None:
        if self.events:
            if self._buffer and not self._skipping:
                self._line(bytes(self._buffer))
            self._buffer.clear()
            return
        if self._buffer:
            try:
                self.document = json.loads(self._buffer)
            except ValueError:
                self.document = None
            self._buffer.clear()
            self._take(self.document)

    def _line(self, line: bytes) -> None:
        # Only ``data:`` lines that mention a usage are parsed (the last one that carries a usage wins), and the
        # first that names a model (an answer without a usage still says which model gave it).
        if not line.startswith(b"data:") or (b'"usage"' not in line and (self.model is not None
                                                                        or b'"model"' not in line)):
            return
        try:
            data = json.loads(line[5:])
        except ValueError:
            return
        if isinstance(data, dict) and isinstance(data.get("response"), dict):  # a Responses API event
            data = data["response"]
        self._take(data)

    def _take(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        usage = read_usage(data.get("usage"))
        if usage is not None:
            self.usage = usage
        model = data.get("model")
        if isinstance(model, str) and (usage is not None or self.model is None):
            self.model = model
