"""A mock OpenAI-shaped decision upstream for ``decisiond bench --gateway``: fast enough (tens of microseconds a
request) that what is measured in front of it is the gateway, not the mock.

It speaks HTTP/1.1 with keep-alive on a raw asyncio protocol (uvloop where installed), and answers
``POST …/decisions`` as OpenAI's Decisions API would: one answer per question of the request, a predicate's
probability 0.7, a choice's or a score's first option 0.6 and the rest shared, and a usage of
``INPUT_TOKENS`` input tokens. Anything else is a 404 in OpenAI's error shape. Run it in a process of its own
(``serve``), so that its work is not the gateway's.

It is also the bench's OTLP/HTTP receiver for traces: ``POST /v1/traces`` is answered 200 and counted, its spans not
decoded (``POST /v1/traces/received`` answers the counts: exports and bytes).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

INPUT_TOKENS = 50
MODEL = "gpt-6-luna"
_NOT_FOUND = json.dumps({"error": {"message": "not found", "type": "invalid_request_error"}}).encode()
TRACES = "/v1/traces"
_received = {"exports": 0, "bytes": 0}


def answer(question: dict[str, Any]) -> dict[str, Any]:
    """A valid answer to one OpenAI-shaped question."""
    name, kind = question.get("name"), question.get("type")
    if kind == "predicate":
        return {"type": "predicate", "name": name, "probability": 0.7}
    options = question.get("choices") if kind == "choice" else question.get("levels")
    n = len(options or ())
    probs = [1.0] if n <= 1 else [0.6] + [0.4 / (n - 1)] * (n - 1)
    if kind == "choice":
        return {"type": "choice", "name": name, "choice": options[0]["value"], "confidence": 0.6,  # type: ignore[index]
                "probabilities": [{"value": c["value"], "probability": p} for c, p in zip(options or (), probs)]}
    return {"type": "score", "name": name, "score": sum(i * p for i, p in enumerate(probs)), "confidence": 0.6,
            "probabilities": [{"label": lv["label"], "value": j, "probability": p}
                              for j, (lv, p) in enumerate(zip(options or (), probs))]}


def respond(path: str, body: bytes) -> tuple[int, bytes]:
    """The status and JSON body for one request."""
    if path.startswith(TRACES):
        if path == TRACES + "/received":
            return 200, json.dumps(_received).encode()
        _received["exports"] += 1
        _received["bytes"] += len(body)
        return 200, b""
    if not path.rstrip("/").endswith("/decisions"):
        return 404, _NOT_FOUND
    try:
        document = json.loads(body)
        answers = [answer(q) for q in document["questions"]]
    except (ValueError, KeyError, TypeError, IndexError):
        return 400, json.dumps({"error": {"message": "bad request", "type": "invalid_request_error"}}).encode()
    return 200, json.dumps({"answers": answers, "model": MODEL, "usage": {
        "input_tokens": INPUT_TOKENS, "output_tokens": 0, "total_tokens": INPUT_TOKENS}}).encode()


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            parts = head[0].split(" ")
            status, payload = respond(parts[1] if len(parts) > 1 else "/", body)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
            if self.transport is not None:
                self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                                     f"content-length: {len(payload)}\r\n\r\n".encode() + payload)


async def _serve(sock: socket.socket) -> None:
    server = await asyncio.get_running_loop().create_server(_Connection, sock=sock)
    async with server:
        await server.serve_forever()


def serve(sock: socket.socket) -> None:
    """Serve on a bound, listening socket until the process is stopped (uvloop where installed)."""
    try:
        import uvloop

        uvloop.run(_serve(sock))
    except ImportError:
        asyncio.run(_serve(sock))


if __name__ == "__main__":  # python -m decisiond.bench.upstream PORT
    import sys

    listening = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=1024)
    serve(listening)
