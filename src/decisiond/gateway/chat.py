"""Chat traffic as the gateway sees it: ``POST /v1/chat/completions`` and ``POST /v1/responses`` as the stages see
them (``ChatRequest``), the answer's way back to the client (``Relay``), and the usage read from that answer as it
passes (``ChatStream``). The pipeline's last step for them is ``gateway.forward``.

A streamed answer is never held back longer than one event: each event goes to the client as it comes, and what is
needed to read the usage is kept on the side (``ChatStream``). Chat completions report ``usage.prompt_tokens`` and
``completion_tokens`` (streamed: in the last chunk, which decisiond always asks for with ``stream_options:
{include_usage: true}`` and hides from a client that did not ask); the Responses API reports
``usage.input_tokens``/``output_tokens`` (streamed: in the ``response.completed`` event's ``response``).

The pipeline's stages hold what they reserved (rate-limit tokens and slots, budget reservations) until the router's
chat call returns, that is until the last chunk has passed; so a streamed answer is settled with its real usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..canonical import Usage
from ..errors import DecisionError
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
    # What had passed when the client left mid-stream (set as the work is cancelled), so that it is still charged.
    partial: ChatResult | None = None

    def texts(self) -> tuple[str, ...]:
        return tuple(str(container[key]) for container, key in self.slots)

    def apply(self, texts: tuple[str, ...]) -> None:
        """Write (redacted) texts back where they came from."""
        for (container, key), text in zip(self.slots, texts):
            container[key] = text


@dataclass
class ChatResult:
    """What the pipeline returns for a chat request once the answer has passed: its usage — the upstream's
    (``reported``), else counted from what was relayed (``estimated``) — the model it named, its status, a JSON
    answer's body (for the audit; None for server-sent events), and the failure that ended a stream early."""

    usage: Usage
    model: str | None
    status: int
    reported: bool
    document: Any = None
    estimated: bool = False
    failure: DecisionError | None = None


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


_EVENT_END = re.compile(rb"\r?\n\r?\n")


class ChatStream:
    """An upstream's answer on its way to the client, fed chunk by chunk. It reads the usage and the model out of the
    answer, counts the characters of generated text relayed (for an estimate when no usage comes), and — where
    decisiond asked the upstream for a usage the client did not ask for (``hide_usage``: a streamed chat completion
    without ``stream_options.include_usage``) — takes that usage back out, so the client sees the stream it asked.

    A JSON answer passes as it comes and is kept (up to ``CHAT_USAGE_SCAN_BYTES``) to read at its end. Server-sent
    events pass one whole event at a time (an event is held until its blank line); an event longer than
    ``CHAT_USAGE_SCAN_BYTES`` passes through as it comes, unread."""

    def __init__(self, content_type: str, hide_usage: bool = False):
        self.events = "text/event-stream" in content_type.lower()
        self.hide_usage = hide_usage
        self.usage: Usage | None = None
        self.model: str | None = None
        self.document: Any = None
        self.text_chars = 0
        self.overflow = False
        self._buffer = bytearray()
        self._passing = False  # inside an event too long to hold: passed through until its end
        self._carry = b""  # while passing: the last bytes passed, to find an end that straddles two chunks

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` goes to the client now."""
        if not self.events:
            if not self.overflow:
                self._buffer += chunk
                if len(self._buffer) > CHAT_USAGE_SCAN_BYTES:
                    self.overflow, self._buffer = True, bytearray()
            return chunk
        out = bytearray()
        if self._passing:
            window = self._carry + chunk
            end = _EVENT_END.search(window)
            if end is None:
                self._carry = window[-3:]
                return chunk
            cut = end.end() - len(self._carry)
            out += chunk[:cut]
            chunk, self._passing, self._carry = chunk[cut:], False, b""
        self._buffer += chunk
        while True:
            end = _EVENT_END.search(self._buffer)
            if end is None:
                break
            out += self._event(bytes(self._buffer[:end.end()]))
            del self._buffer[:end.end()]
        if len(self._buffer) > CHAT_USAGE_SCAN_BYTES:
            self.overflow, self._passing, self._carry = True, True, bytes(self._buffer[-3:])
            out += self._buffer
            self._buffer.clear()
        return bytes(out)

    def finish(self) -> bytes:
        """The end of the answer: what is still held goes to the client; a JSON answer is read."""
        if self.events:
            rest, self._buffer = bytes(self._buffer), bytearray()
            return self._event(rest) if rest and not self._passing else rest
        if self._buffer:
            try:
                self.document = json.loads(self._buffer)
            except ValueError:
                self.document = None
            self._buffer.clear()
            self._take(self.document)
            self._count_answer(self.document)
        return b""

    def _event(self, event: bytes) -> bytes:
        data_lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if len(data_lines) != 1 or not data_lines[0].startswith(b"{"):
            return event
        try:
            data = json.loads(data_lines[0])
        except ValueError:
            return event
        if not isinstance(data, dict):
            return event
        self._count_delta(data)
        if isinstance(data.get("response"), dict):  # a Responses API event (response.completed holds the usage)
            self._take(data["response"])
        else:
            self._take(data)
        if not self.hide_usage or "usage" not in data:
            return event
        if data["usage"] is not None and not data.get("choices"):  # the usage chunk the client did not ask for
            return b""
        del data["usage"]  # every other chunk says "usage": null once usage is asked for
        return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def _take(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        usage = read_usage(data.get("usage"))
        if usage is not None:
            self.usage = usage
        model = data.get("model")
        if isinstance(model, str) and (usage is not None or self.model is None):
            self.model = model

    def _count_delta(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("delta"), str):  # response.output_text.delta
            self.text_chars += len(data["delta"])
        for choice in data.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self.text_chars += len(delta["content"])

    def _count_answer(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        for choice in data.get("choices") or []:
            message = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                self.text_chars += len(message["content"])
        for item in data.get("output") or []:
            for part in item.get("content") or [] if isinstance(item, dict) else []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    self.text_chars += len(part["text"])
