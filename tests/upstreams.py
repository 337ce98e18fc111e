"""Small real HTTP servers on loopback that stand in for upstream decision providers, following their documented
wire formats (OpenAI's /v1/decisions, Azure's deployment route, System One), and servers that misbehave the ways
providers do: 529, 429 with retry-after, a hang, a dropped connection."""

from __future__ import annotations

import email.parser
import email.policy
import json
import select
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse


class Listening(ThreadingHTTPServer):
    """A thread per connection, and room for every connection a test opens at once: the standard library's backlog of
    5 overflows under 40 concurrent requests on a busy machine, and the kernel then resets connections it had
    already completed (a ReadError at the gateway, not a failure of what the test checks)."""

    daemon_threads = True
    request_queue_size = 256


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


# A handler returns (status, headers, body) — or None to drop the connection without answering.
Handler = Callable[[Seen], "tuple[int, dict[str, str], Any] | None"]


@dataclass
class Upstream:
    handler: Handler
    seen: list[Seen] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Upstream":
        upstream = self

        class Handle(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.do_POST("GET")

            def do_POST(self, method: str = "POST"):
                length = int(self.headers.get("content-length") or 0)
                parsed = urlparse(self.path)
                seen = Seen(method, parsed.path, parse_qs(parsed.query), {k.lower(): v for k, v in self.headers.items()},
                            self.rfile.read(length))
                upstream.seen.append(seen)
                answer = upstream.handler(seen)
                if answer is None:  # drop the connection without a response
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, headers, body = answer
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                if "content-type" not in {k.lower() for k in headers}:  # JSON unless the handler says otherwise
                    self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the caller has gone (a test killed it)
                    self.close_connection = True

        self.server = Listening(("127.0.0.1", 0), Handle)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # stop() waits one poll
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------ answers

def openai_answer(question: dict, i: int) -> dict:
    """A deterministic valid answer: the first candidate gets 0.6 (0.7 for a predicate)."""
    name = question.get("name")
    if question["type"] == "predicate":
        return {"type": "predicate", "name": name, "probability": 0.7}
    if question["type"] == "choice":
        n = len(question["choices"])
        probs = [0.6] + [0.4 / (n - 1)] * (n - 1)
        return {"type": "choice", "name": name, "choice": question["choices"][0]["value"], "confidence": 0.4,
                "probabilities": [{"value": c["value"], "probability": p} for c, p in zip(question["choices"], probs)]}
    n = len(question["levels"])
    probs = [0.6] + [0.4 / (n - 1)] * (n - 1) if n > 1 else [1.0]
    return {"type": "score", "name": name, "score": sum(i * p for i, p in enumerate(probs)), "confidence": 0.5,
            "probabilities": [{"label": lv["label"], "value": j, "probability": p}
                              for j, (lv, p) in enumerate(zip(question["levels"], probs))]}


def openai_server(model_name: str = "gpt-6-luna") -> Upstream:
    def handle(seen: Seen):
        if seen.path.rstrip("/") != "/v1/decisions":
            return 404, {}, {"error": {"message": "not found", "type": "invalid_request_error"}}
        body = seen.json()
        return 200, {"x-request-id": "req_up"}, {
            "answers": [openai_answer(q, i) for i, q in enumerate(body["questions"])],
            "model": model_name,
            "usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 10, "cache_write_tokens": 0},
                      "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 50},
        }
    return Upstream(handle).start()


def azure_server(deployment: str, api_key: str, api_version: str) -> Upstream:
    inner = openai_server(deployment)

    def handle(seen: Seen):
        if seen.headers.get("api-key") != api_key:
            return 401, {}, {"error": {"message": "Access denied due to invalid subscription key.", "code": "401"}}
        if seen.path != f"/openai/deployments/{deployment}/decisions" or seen.query.get("api-version") != [api_version]:
            return 404, {}, {"error": {"message": "The API deployment for this resource does not exist.",
                                       "code": "DeploymentNotFound"}}
        return inner.handler(Seen(seen.method, "/v1/decisions", {}, seen.headers, seen.body))
    return Upstream(handle).start()


def multipart_request(seen: Seen) -> tuple[dict, dict[str, tuple[bytes, str]]]:
    """The ``request`` JSON part and the file parts of a multipart body."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + seen.headers["content-type"].encode() + b"\r\n\r\n" + seen.body)
    request, files = None, {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name == "request":
            request = json.loads(part.get_payload(decode=True))
        else:
            files[name] = (part.get_payload(decode=True), part.get_content_type())
    return request, files


def systemone_server(model_name: str = "jev-1.14.0", skip: tuple[str, ...] = ()) -> Upstream:
    """A System One server (TypeSafe's wire format): JSON or multipart, answers keyed by question id, and no answer
    for the ids in ``skip``."""
    def handle(seen: Seen):
        if seen.path != "/v1/systemone":
            return 404, {}, {"detail": "Not Found"}
        if seen.headers.get("content-type", "").startswith("multipart/"):
            body, _ = multipart_request(seen)
        else:
            body = seen.json()
        answers = {}
        for key, q in body["questions"].items():
            if key in skip:
                continue
            if q["type"] == "noul":
                answers[key] = {"type": "noul", "noul": 0.8}
            elif q["type"] == "choice":
                names = list(q["criteria"])
                probs = [0.6] + [0.4 / (len(names) - 1)] * (len(names) - 1)
                answers[key] = {"type": "choice", "choice": names[0], "confidence": 0.4,
                                "probabilities": dict(zip(names, probs))}
            else:
                levels = q["criteria"]
                probs = [0.6] + [0.4 / (len(levels) - 1)] * (len(levels) - 1)
                answers[key] = {"type": "score", "score": sum(i * p for i, p in enumerate(probs)), "confidence": 0.5,
                                "legend": {str(i): c for i, c in enumerate(levels)},
                                "probabilities": {str(i): p for i, p in enumerate(probs)}}
        return 200, {"x-typesafe-request-id": "req_jev"}, {
            "model": model_name, "answers": answers, "usage": {"input_tokens": 120, "output_tokens": 20}}
    return Upstream(handle).start()


def status_server(status: int, body: Any, headers: dict[str, str] | None = None) -> Upstream:
    return Upstream(lambda seen: (status, headers or {}, body)).start()


def hanging_server(seconds: float = 30.0) -> Upstream:
    def handle(seen: Seen):
        time.sleep(seconds)
        return 500, {}, {"error": {"message": "too late"}}
    return Upstream(handle).start()


def dropping_server() -> Upstream:
    return Upstream(lambda seen: None).start()


# ------------------------------------------------------------------------------------------------ chat


class ChatUpstream:
    """OpenAI's chat completions and Responses API on loopback (JSON, or server-sent events when ``stream``), with a
    behaviour chosen by the upstream model name the request carries:

    ``ok`` answers ("Hello"), billing ``output_tokens`` completion tokens; ``quiet`` answers but never reports a
    usage; ``e500``/``e400``/``e429`` fail with that status; ``hang`` never answers (it notes when its client gives
    up, in ``cancelled``); ``slow`` answers after ``slow_s`` seconds; ``cut`` streams its first event and drops the
    connection; ``pause`` streams its first half, then stays silent for ``pause_s`` seconds."""

    def __init__(self, output_tokens: int = 3, slow_s: float = 7.0, pause_s: float = 5.0):
        self.output_tokens, self.slow_s, self.pause_s = output_tokens, slow_s, pause_s
        self.seen: list[dict[str, Any]] = []
        self.cancelled = threading.Event()
        upstream = self

        class Handle(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                upstream.seen.append({"path": self.path, "body": body, "auth": self.headers.get("authorization"),
                                      "traceparent": self.headers.get("traceparent")})
                upstream.answer(self, self.path.rstrip("/").endswith("/responses"), body)

        self.server = Listening(("127.0.0.1", 0), Handle)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- behaviours

    def answer(self, handler: BaseHTTPRequestHandler, responses: bool, body: dict) -> None:
        model = body.get("model", "ok")
        if model.startswith("e") and model[1:].isdigit():
            return self._json(handler, int(model[1:]), {"error": {"message": f"upstream says {model}",
                                                                  "type": "server_error", "code": None}})
        if model == "hang":
            self._wait_for_close(handler, 30)
            return None
        if model == "slow":
            time.sleep(self.slow_s)
        usage = self._usage(responses, body) if model != "quiet" else None
        if not body.get("stream"):
            document = self._document(responses, body, usage)
            return self._json(handler, 200, document)
        return self._stream(handler, responses, body, usage, model)

    def _usage(self, responses: bool, body: dict) -> dict:
        if responses:
            return {"input_tokens": 9, "output_tokens": self.output_tokens, "total_tokens": 9 + self.output_tokens}
        return {"prompt_tokens": 9, "completion_tokens": self.output_tokens, "total_tokens": 9 + self.output_tokens}

    def _document(self, responses: bool, body: dict, usage: dict | None) -> dict:
        if responses:
            return {"id": "resp_1", "object": "response", "created_at": 1, "model": body["model"], "status":
                    "completed", "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status":
                                             "completed", "content": [{"type": "output_text", "text": "Hello",
                                                                       "annotations": []}]}],
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage}
        return {"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"], "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hello"}}],
            "usage": usage}

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, status: int, document: dict) -> None:
        data = json.dumps(document).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _stream(self, handler: BaseHTTPRequestHandler, responses: bool, body: dict, usage: dict | None,
                model: str) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("transfer-encoding", "chunked")
        handler.end_headers()
        handler.close_connection = True
        events = self._responses_events(body, usage) if responses else self._chat_events(body, usage)
        half = len(events) // 2
        try:
            for i, event in enumerate(events):
                if i == 1 and model == "cut":  # after one event the body ends without its last chunk: broken
                    handler.connection.shutdown(2)
                    return
                if i == half and model == "pause":
                    time.sleep(self.pause_s)
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            return

    def _chat_events(self, body: dict, usage: dict | None) -> list[bytes]:
        asked = (body.get("stream_options") or {}).get("include_usage") and usage is not None

        def chunk(content, finish=None, last=False):
            data = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                    "choices": [] if last else [{"index": 0, "finish_reason": finish,
                                                 "delta": {"content": content} if content else {}}]}
            if asked:
                data["usage"] = usage if last else None
            return f"data: {json.dumps(data)}\n\n".encode()

        events = [chunk("Hel"), chunk("lo"), chunk(None, "stop")]
        if asked:
            events.append(chunk(None, last=True))
        return events + [b"data: [DONE]\n\n"]

    def _responses_events(self, body: dict, usage: dict | None) -> list[bytes]:
        done = self._document(True, body, usage)
        pairs = [("response.created", {"response": {**done, "status": "in_progress", "output": [], "usage": None}}),
                 ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "content_index": 0,
                                                 "delta": "Hel", "logprobs": []}),
                 ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "content_index": 0,
                                                 "delta": "lo", "logprobs": []}),
                 ("response.completed", {"response": done})]
        return [f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': i, **data})}\n\n".encode()
                for i, (name, data) in enumerate(pairs)]

    def _wait_for_close(self, handler: BaseHTTPRequestHandler, seconds: float) -> None:
        """Hold the request; note when the client closes its end (its call was cancelled)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([handler.connection], [], [], 0.05)
            if ready and not handler.connection.recv(1, 2):  # MSG_PEEK: readable and empty means closed
                self.cancelled.set()
                return
