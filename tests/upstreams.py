"""Small real HTTP servers on loopback that stand in for upstream decision providers, following their documented
wire formats (OpenAI's /v1/decisions, Azure's deployment route, System One), and servers that misbehave the ways
providers do: 529, 429 with retry-after, a hang, a dropped connection."""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse


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

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                parsed = urlparse(self.path)
                seen = Seen("POST", parsed.path, parse_qs(parsed.query), {k.lower(): v for k, v in self.headers.items()},
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
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handle)
        self.server.daemon_threads = True
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
