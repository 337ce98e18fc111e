"""OpenTelemetry traces (``decisiond.tracing``) from real decisiond servers to a real OTLP/HTTP receiver started
here: a simulated upstream on loopback that accepts ``POST /v1/traces`` and decodes each protobuf body with the OTLP
protocol's own ``ExportTraceServiceRequest``. Simulated upstreams (``upstreams``) record the headers they get.

Covered: a decision's span tree (request → auth, pipeline → stages → attempt) and its attributes; only the refusing
stage marked failed; a failover's two attempts and their outcomes; a cascade's steps; a judge guardrail's call; chat
traffic; a caller's ``traceparent`` honoured (and its "not sampled" too) and sent on to the upstream; the trace id on
the access line; the local engine's queue wait and forward pass on a plain ``serve --model`` traced by
``OTEL_EXPORTER_OTLP_ENDPOINT``; no secret and no request text in any attribute; nothing at all exported, nor any
``traceparent`` sent on, when tracing is off; and every protobuf field ``decisiond.otlp`` writes by hand.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest
import upstreams
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from servers import start_decisiond

from decisiond import tracing

KEY = "sk-client-key-0123456789-secret"
UPSTREAM_KEY = "sk-upstream-key-abcdef-secret"
TEXT = "My order 4711 arrived broken and the courier was rude"  # must never be in an attribute
BODY_QUESTIONS = [
    {"type": "predicate", "name": "damaged", "instructions": "Did the order arrive damaged?"},
    {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
     "choices": [{"value": "shipping"}, {"value": "billing"}]},
]

CONFIG = """
otel: {endpoint: "${RECEIVER}", service_name: decisiond-test, schedule_delay_ms: 50}
auth:
  keys: [{name: tester, key: "${TEST_KEY}"}]
providers:
  - {name: up, type: openai, base_url: "${UP}/v1", api_key: "${UP_KEY}"}
  - {name: down, type: openai, base_url: "${DOWN}/v1", api_key: "${UP_KEY}"}
  - {name: chatter, type: openai, base_url: "${CHAT}/v1", api_key: "${UP_KEY}"}
models:
  - {name: luna, provider: up, upstream: gpt-6-luna, pricing: {per_request: 0.001}}
  - {name: strong, provider: up, upstream: gpt-strong}
  - {name: broken, provider: down, upstream: gpt-down}
  - {name: guarded, provider: up, upstream: gpt-6-luna, guardrails: [polite]}
  - {name: chatty, provider: chatter, upstream: ok, capabilities: [chat]}
virtual_models:
  - {name: sturdy, targets: [broken, luna]}
  - {name: triage, strategy: cascade, escalate_below: 0.9, targets: [luna, strong]}
guardrails:
  - {name: polite, type: decision_judge, model: luna, instructions: "Is the customer rude?", threshold: 0.95,
     action: warn}
"""


# ------------------------------------------------------------------------------------------ the OTLP receiver

@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    service: str


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def in_memory_tracer(resource: dict[str, Any]) -> tuple[tracing.Tracer, Any, list[Any]]:
    """A tracer that samples everything, its OTLP encoder, and the list its processor hands each ended trace to."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    from decisiond import otlp

    handed: list[Any] = []

    class Processor:
        def on_end(self, spans: Any) -> None:
            handed.append(spans)

    encoder = otlp.Encoder(resource, "decisiond", "9.9")
    return tracing.Tracer(Processor(), ParentBased(ALWAYS_ON), encoder), encoder, handed


class Receiver:
    """An OTLP/HTTP receiver on loopback (a simulated upstream, ``upstreams.Upstream``): every span of every export,
    decoded."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.lock = threading.Lock()
        self.upstream = upstreams.Upstream(self.handle).start()

    @property
    def url(self) -> str:
        return self.upstream.url

    def handle(self, seen: upstreams.Seen) -> tuple[int, dict[str, str], bytes]:
        if seen.path != "/v1/traces" or seen.headers.get("content-type") != "application/x-protobuf":
            return 404, {}, b""
        self.add(ExportTraceServiceRequest.FromString(seen.body))
        return 200, {"content-type": "application/x-protobuf"}, ExportTraceServiceResponse().SerializeToString()

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                        span.start_time_unix_nano, span.end_time_unix_nano,
                        {kv.key: _value(kv.value) for kv in span.attributes}, span.status.code,
                        resource.get("service.name", "")))
        with self.lock:
            self.exports += 1
            self.spans.extend(found)

    def wait(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 20) -> list[ReceivedSpan]:
        """The spans received, once ``done`` says they are all there (polled until ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the spans did not arrive: {sorted(s.name for s in spans)}")
            time.sleep(0.05)

    def trace(self, request_id: str, names: set[str], timeout: float = 20) -> dict[str, list[ReceivedSpan]]:
        """Every span of the trace whose request span has ``request_id``, by name, once ``names`` are among them."""
        def of_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
            roots = [s for s in spans if s.attributes.get(tracing.REQUEST_ID) == request_id]
            return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

        spans = of_trace(self.wait(lambda spans: names <= {s.name for s in of_trace(spans)}, timeout))
        by_name: dict[str, list[ReceivedSpan]] = {}
        for span in sorted(spans, key=lambda s: s.start):
            by_name.setdefault(span.name, []).append(span)
        return by_name

    def stop(self) -> None:
        self.upstream.stop()


def one(by_name: dict[str, list[ReceivedSpan]], name: str) -> ReceivedSpan:
    (span,) = by_name[name]
    return span


def access_lines(server: Any, request_id: str) -> list[dict[str, Any]]:
    lines = []
    for line in server.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == "decisiond.access" and entry.get("request_id") == request_id:
            lines.append(entry)
    return lines


def traceparents(upstream: upstreams.Upstream, trace_id: str) -> list[str]:
    return [s.headers["traceparent"] for s in upstream.seen if trace_id in s.headers.get("traceparent", "")]


# ------------------------------------------------------------------------------------------ servers

def upstream_handler(seen: upstreams.Seen) -> tuple[int, dict[str, str], Any]:
    """OpenAI's /v1/decisions: gpt-strong is sure of everything (0.96), any other model unsure (0.7 / 0.6)."""
    body = seen.json()
    answers = [upstreams.openai_answer(q, i) for i, q in enumerate(body["questions"])]
    if body["model"] == "gpt-strong":
        for answer in answers:
            answer.update({"probability": 0.96} if answer["type"] == "predicate" else {
                "confidence": 0.9, "probabilities": [{**p, "probability": 0.96 if j == 0 else 0.04 / (
                    len(answer["probabilities"]) - 1)} for j, p in enumerate(answer["probabilities"])]})
    return 200, {}, {"answers": answers, "model": body["model"],
                     "usage": {"input_tokens": 50, "output_tokens": 3, "total_tokens": 53}}


@pytest.fixture(scope="module")
def receiver():
    made = Receiver()
    yield made
    made.stop()


@pytest.fixture(scope="module")
def ups():
    made = {"up": upstreams.Upstream(upstream_handler).start(),
            "down": upstreams.status_server(503, {"error": {"message": "overloaded", "type": "server_error"}}),
            "chat": upstreams.ChatUpstream()}
    yield made
    for server in made.values():
        server.stop()


@pytest.fixture(scope="module")
def traced(receiver, ups, tmp_path_factory):
    """A gateway traced by its config (``otel:``), in front of the simulated upstreams."""
    folder = tmp_path_factory.mktemp("traced")
    (folder / "gateway.yaml").write_text(CONFIG)
    server = start_decisiond("--config", str(folder / "gateway.yaml"), env={
        "RECEIVER": receiver.url, "TEST_KEY": KEY, "UP": ups["up"].url, "DOWN": ups["down"].url, "CHAT": ups["chat"].url,
        "UP_KEY": UPSTREAM_KEY, "DECISIOND_DATA_DIR": str(folder / "data")})
    yield server
    server.stop()


def decide(server: Any, model: str, headers: dict[str, str] | None = None, text: str = TEXT) -> httpx.Response:
    response = httpx.post(server.url + "/v1/decisions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}", **(headers or {})},
        json={"model": model, "input": text, "questions": BODY_QUESTIONS})
    return response


STAGES = ["request_limits", "resolve", "allowlist", "cache", "rate_limit", "budget", "guardrails", "route"]


# ------------------------------------------------------------------------------------------ the tests

def test_a_decision_is_one_trace_request_stages_and_attempt(traced, receiver, ups):
    response = decide(traced, "luna")
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    spans = receiver.trace(request_id, {"POST /v1/decisions", "auth", "decide", *STAGES, "attempt luna"})

    request = one(spans, "POST /v1/decisions")
    assert request.parent_id == "" and request.kind == 2 and request.service == "decisiond-test"  # SERVER, a root
    assert request.attributes["http.request.method"] == "POST"
    assert request.attributes["http.route"] == "/v1/decisions"
    assert request.attributes["http.response.status_code"] == 200 and request.status != 2

    # auth and the pipeline are the request's children; each stage is the child of the one before (it wraps the
    # rest of the chain), the attempt the child of the route
    assert one(spans, "auth").parent_id == request.span_id
    pipeline = one(spans, "decide")
    assert pipeline.parent_id == request.span_id
    parent = pipeline
    for name in STAGES:
        stage = one(spans, name)
        assert stage.parent_id == parent.span_id, name
        assert stage.attributes[tracing.OUTCOME] == "ok" and stage.status != 2, name
        assert parent.start <= stage.start <= stage.end <= parent.end, name
        parent = stage
    attempt = one(spans, "attempt luna")
    assert attempt.parent_id == parent.span_id

    assert pipeline.attributes == {
        tracing.KIND: "CHAIN", tracing.OPERATION: "decide", tracing.DIALECT: "openai", tracing.REQUEST_ID: request_id,
        tracing.CACHE_HIT: False, tracing.REQUESTED_MODEL: "luna", tracing.MODEL: "luna", tracing.PROVIDER_NAME: "up",
        tracing.TARGET: "luna", tracing.COST: pytest.approx(0.001), tracing.QUESTIONS: 2, tracing.PROMPT_TOKENS: 50,
        tracing.COMPLETION_TOKENS: 3, tracing.TOTAL_TOKENS: 53, tracing.CACHED_TOKENS: 0}
    assert attempt.attributes == {
        tracing.KIND: "LLM", tracing.TARGET: "luna", tracing.MODEL: "gpt-6-luna", tracing.PROVIDER: "openai",
        tracing.PROVIDER_NAME: "up", tracing.QUESTIONS: 2, tracing.OUTCOME: "ok", tracing.PROMPT_TOKENS: 50,
        tracing.COMPLETION_TOKENS: 3, tracing.TOTAL_TOKENS: 53}

    # the upstream request carried the attempt's context; the access line carries the trace id
    assert traceparents(ups["up"], request.trace_id) == [f"00-{request.trace_id}-{attempt.span_id}-01"]
    (line,) = access_lines(traced, request_id)
    assert line["trace_id"] == request.trace_id


def test_a_callers_traceparent_is_honoured_and_sent_on(traced, receiver, ups):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = decide(traced, "luna", {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=x1"})
    assert response.status_code == 200
    spans = receiver.trace(response.headers["x-request-id"], {"POST /v1/decisions", "attempt luna"})
    request, attempt = one(spans, "POST /v1/decisions"), one(spans, "attempt luna")
    assert request.trace_id == trace_id and request.parent_id == parent_id
    assert all(s.trace_id == trace_id for group in spans.values() for s in group)
    (sent,) = [s for s in ups["up"].seen if trace_id in s.headers.get("traceparent", "")]
    assert sent.headers["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
    assert sent.headers["tracestate"] == "vendor=x1"
    assert access_lines(traced, response.headers["x-request-id"])[0]["trace_id"] == trace_id


def test_a_caller_that_samples_its_trace_out_is_not_recorded_but_its_trace_goes_on(traced, receiver, ups):
    trace_id = uuid.uuid4().hex
    response = decide(traced, "luna", {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-00"})
    assert response.status_code == 200
    (sent,) = traceparents(ups["up"], trace_id)
    assert sent.endswith("-00")  # the caller's decision goes on with its trace
    assert access_lines(traced, response.headers["x-request-id"])[0]["trace_id"] == trace_id
    # A later request's spans: the earlier one's, had it been recorded, would have been exported before them.
    later = decide(traced, "luna")
    receiver.trace(later.headers["x-request-id"], {"POST /v1/decisions"})
    assert not [s for s in receiver.spans if s.trace_id == trace_id]


def test_a_failover_is_two_attempts_with_their_outcomes(traced, receiver):
    response = decide(traced, "sturdy")
    assert response.status_code == 200, response.text
    spans = receiver.trace(response.headers["x-request-id"], {"attempt broken", "attempt luna", "route"})
    route, failed, answered = one(spans, "route"), one(spans, "attempt broken"), one(spans, "attempt luna")
    assert failed.parent_id == answered.parent_id == route.span_id
    assert failed.end <= answered.start
    assert failed.attributes[tracing.OUTCOME] == "failover: upstream_503"
    assert failed.attributes[tracing.UPSTREAM_STATUS] == 503 and failed.status == 2
    assert failed.attributes[tracing.ERROR_TYPE] == "upstream_503"
    assert failed.attributes[tracing.MODEL] == "gpt-down" and failed.attributes[tracing.PROVIDER_NAME] == "down"
    assert answered.attributes[tracing.OUTCOME] == "ok" and answered.status != 2
    assert route.status != 2 and one(spans, "decide").attributes[tracing.TARGET] == "luna"


def test_a_cascade_is_a_span_per_step_each_with_its_attempt(traced, receiver):
    response = decide(traced, "triage")
    assert response.status_code == 200, response.text
    assert response.headers["x-decisiond-escalated"] == "2 of 2"  # luna is never 0.9 sure
    spans = receiver.trace(response.headers["x-request-id"],
                           {"cascade step 1", "cascade step 2", "attempt luna", "attempt strong"})
    first, second = one(spans, "cascade step 1"), one(spans, "cascade step 2")
    assert first.parent_id == second.parent_id == one(spans, "route").span_id
    assert first.attributes == {tracing.KIND: "CHAIN", tracing.CASCADE_STEP: 1, tracing.MODEL: "luna",
                                tracing.QUESTIONS: 2}
    assert second.attributes[tracing.MODEL] == "strong" and second.attributes[tracing.QUESTIONS] == 2
    assert one(spans, "attempt luna").parent_id == first.span_id
    assert one(spans, "attempt strong").parent_id == second.span_id
    pipeline = one(spans, "decide")
    assert pipeline.attributes[tracing.ESCALATED] == 2 and pipeline.attributes[tracing.MODEL] == "triage"
    assert pipeline.attributes[tracing.PROMPT_TOKENS] == 100  # both calls


def test_a_judge_guardrails_call_is_a_span_with_its_own_pipeline(traced, receiver):
    response = decide(traced, "guarded")
    assert response.status_code == 200, response.text
    spans = receiver.trace(response.headers["x-request-id"], {"judge polite", "guardrails"})
    judge = one(spans, "judge polite")
    assert judge.parent_id == one(spans, "guardrails").span_id
    assert judge.attributes[tracing.KIND] == "GUARDRAIL" and judge.attributes[tracing.GUARDRAIL] == "polite"
    assert judge.attributes[tracing.GUARDRAIL_SCORE] == pytest.approx(0.7)
    judged = [s for s in spans["decide"] if s.parent_id == judge.span_id]
    assert [s.attributes[tracing.DIALECT] for s in judged] == ["guardrail"]
    (attempt,) = [s for s in spans["attempt luna"] if s.start >= judge.start and s.end <= judge.end]
    assert attempt.attributes[tracing.QUESTIONS] == 1


def test_chat_traffic_is_traced_as_decisions_are(traced, receiver, ups):
    response = httpx.post(traced.url + "/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "chatty", "messages": [{"role": "user", "content": TEXT}]})
    assert response.status_code == 200, response.text
    spans = receiver.trace(response.headers["x-request-id"], {"POST /v1/chat/completions", "auth", "chat",
                                                               "route", "attempt chatty"})
    pipeline, attempt = one(spans, "chat"), one(spans, "attempt chatty")
    assert pipeline.parent_id == one(spans, "POST /v1/chat/completions").span_id
    assert pipeline.attributes[tracing.OPERATION] == "chat" and pipeline.attributes[tracing.COMPLETION_TOKENS] == 3
    assert attempt.parent_id == one(spans, "route").span_id and attempt.attributes[tracing.OUTCOME] == "ok"
    assert [s["traceparent"] for s in ups["chat"].seen if attempt.trace_id in (s["traceparent"] or "")] == [
        f"00-{attempt.trace_id}-{attempt.span_id}-01"]


def test_only_the_stage_that_refuses_is_marked_failed(traced, receiver):
    response = decide(traced, "no-such-model")
    assert response.status_code == 400
    spans = receiver.trace(response.headers["x-request-id"], {"POST /v1/decisions", "decide", "resolve"})
    resolve = one(spans, "resolve")
    assert resolve.attributes[tracing.OUTCOME] == "refused: model_not_found" and resolve.status == 2
    assert resolve.attributes[tracing.ERROR_TYPE] == "model_not_found"
    limits = one(spans, "request_limits")
    assert limits.attributes[tracing.OUTCOME] == "ok" and limits.status != 2  # the refusal only passed through
    assert "allowlist" not in spans
    assert one(spans, "decide").attributes[tracing.ERROR_TYPE] == "model_not_found"
    request = one(spans, "POST /v1/decisions")  # a 4xx is the client's: the server's span is not failed
    assert request.attributes["http.response.status_code"] == 400 and request.status != 2


def test_no_secret_and_no_request_text_in_any_attribute(traced, receiver):
    response = decide(traced, "sturdy", {"x-api-key": KEY})
    assert response.status_code == 200
    receiver.trace(response.headers["x-request-id"], {"attempt luna"})
    values = [str(v) for s in receiver.spans for v in (*s.attributes.values(), s.name)]
    assert len(values) > 50
    for secret in (KEY, UPSTREAM_KEY, "Bearer", TEXT, "4711", "courier"):
        assert not [v for v in values if secret in v], secret
    assert not [k for s in receiver.spans for k in s.attributes if "authorization" in k.lower() or "key" in k.lower()]


def test_a_plain_serve_is_traced_by_the_standard_variable_with_the_engines_spans(tiny_dir, receiver):
    """``decisiond serve --model`` without a config: ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns traces on; the local
    engine's request is its queue wait and its forward pass, timed on the worker, inside the attempt."""
    server = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny-env", env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "decisiond-env"})
    try:
        response = httpx.post(server.url + "/v1/decisions", timeout=60, json={
            "model": "tiny-env", "input": TEXT, "questions": BODY_QUESTIONS})
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        spans = receiver.trace(request_id, {"POST /v1/decisions", "attempt tiny-env", "engine queue",
                                            "engine forward"})
        assert one(spans, "POST /v1/decisions").service == "decisiond-env"
        attempt, queue, forward = one(spans, "attempt tiny-env"), one(spans, "engine queue"), one(spans,
                                                                                                   "engine forward")
        assert attempt.attributes[tracing.PROVIDER] == "local" and attempt.attributes[tracing.OUTCOME] == "ok"
        assert queue.parent_id == forward.parent_id == attempt.span_id
        assert attempt.start <= queue.start <= queue.end <= forward.start < forward.end <= attempt.end
        assert forward.attributes[tracing.ENGINE_PASSES] >= 1
        assert forward.attributes[tracing.ENGINE_RUN_REQUESTS] >= 1
        assert forward.attributes[tracing.ENGINE_TOKENS] > 0 and queue.attributes[tracing.ENGINE_JOINED] is False
        assert access_lines(server, request_id)[0]["trace_id"] == attempt.trace_id
    finally:
        server.stop()


def test_nothing_is_exported_nor_sent_on_when_tracing_is_off(ups, tmp_path):
    """``OTEL_SDK_DISABLED=true`` wins over an endpoint: no span reaches the receiver (not even as the server stops,
    when a traced one exports what is left), no trace id on the access line, no ``traceparent`` to the upstream."""
    quiet = Receiver()
    (tmp_path / "gateway.yaml").write_text(f"""
providers:
  - {{name: up, type: openai, base_url: "{ups['up'].url}/v1"}}
models:
  - {{name: luna, provider: up, upstream: gpt-6-luna}}
""")
    server = start_decisiond("--config", str(tmp_path / "gateway.yaml"), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": quiet.url, "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SDK_DISABLED": "true"})
    trace_id, before = uuid.uuid4().hex, len(ups["up"].seen)
    try:
        response = httpx.post(server.url + "/v1/decisions", timeout=30,
                              headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"},
                              json={"model": "luna", "input": TEXT, "questions": BODY_QUESTIONS})
        assert response.status_code == 200
        (line,) = access_lines(server, response.headers["x-request-id"])
        assert "trace_id" not in line
    finally:
        server.stop()
    try:
        assert quiet.exports == 0 and quiet.spans == []
        sent = ups["up"].seen[before:]
        assert sent and not [s for s in sent if "traceparent" in s.headers or "tracestate" in s.headers]
    finally:
        quiet.stop()


@pytest.mark.parametrize(("configured", "environ", "url"), [
    (None, {}, None),
    ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318/v1/traces", {}, "http://collector:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/t", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://d"},
     "http://c:9/t"),
    ("http://collector:4318", {"OTEL_SDK_DISABLED": "true"}, None),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
])
def test_where_traces_go(configured, environ, url):
    assert tracing.traces_url(configured, environ) == url


def test_without_tracing_the_pipeline_is_built_without_spans():
    """Off, the chain is the plain one: no link is wrapped (what a request pays for tracing off is nothing)."""
    from decisiond.gateway.pipeline import Pipeline

    async def terminal(context, request):
        return None

    class Stage:
        name = "stage"

        async def __call__(self, context, request, call_next):
            return await call_next(context, request)

    plain = Pipeline([Stage()], terminal)
    traced_pipeline = Pipeline([Stage()], terminal, tracer=object())  # type: ignore[arg-type]
    assert plain._chain.__name__ == "link" and traced_pipeline._chain.__name__ == "traced"


def test_what_decisiond_writes_is_otlp_as_its_own_classes_read_it():
    """``decisiond.otlp`` writes protobuf by hand: every field it writes, decoded by OTLP's generated classes."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer, encoder, handed = in_memory_tracer({"service.name": "decisiond-x", "service.instance": 3})
    caller = TraceContextTextMapPropagator().extract({
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=x1"})
    long_text = "é" * 300  # not cached, two bytes a character
    with tracer.start("POST /x", {"s": "ok", "b": True, "i": -7, "big": 2**40, "f": 0.25, "long": long_text},
                      tracing.SERVER, caller) as root:
        for _ in range(2):  # the second time from the cache
            with tracer.current("child", {"b": False, "one": 1, "t": True}) as child:
                tracing.error(child, "rate_limit_exceeded")
        tracer.past("engine queue", time.monotonic() - 0.002, time.monotonic() - 0.001)
    (trace,) = handed
    decoded = ExportTraceServiceRequest.FromString(encoder.request([trace, trace]))
    (resource_spans,) = decoded.resource_spans
    assert {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes} == {
        "service.name": "decisiond-x", "service.instance": 3}
    (scope_spans,) = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("decisiond", "9.9")
    spans = {s.name: s for s in scope_spans.spans}
    assert len(scope_spans.spans) == 8 and set(spans) == {"POST /x", "child", "engine queue"}
    top, child, queue = spans["POST /x"], spans["child"], spans["engine queue"]
    assert top.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and top.span_id.hex() == format(root.span_id, "016x")
    assert top.parent_span_id.hex() == "b7ad6b7169203331" and top.trace_state == "vendor=x1"
    assert top.kind == 2 and child.kind == 1 and top.flags == 0x301 and child.flags == 0x101  # sampled; remote parent
    assert {kv.key: _value(kv.value) for kv in top.attributes} == {
        "s": "ok", "b": True, "i": -7, "big": 2**40, "f": 0.25, "long": long_text}
    assert {kv.key: _value(kv.value) for kv in child.attributes} == {
        "b": False, "one": 1, "t": True, tracing.ERROR_TYPE: "rate_limit_exceeded"}
    assert [kv.value.WhichOneof("value") for kv in child.attributes][:3] == ["bool_value", "int_value", "bool_value"]
    assert child.status.code == 2 and child.status.message == "rate_limit_exceeded" and top.status.code == 0
    assert child.parent_span_id == queue.parent_span_id == top.span_id and child.trace_id == top.trace_id
    assert top.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano <= top.end_time_unix_nano
    assert queue.end_time_unix_nano - queue.start_time_unix_nano == pytest.approx(1_000_000, rel=0.05)


def test_the_engines_two_spans_meet_at_one_instant_while_the_wall_clock_moves(monkeypatch):
    """``engine queue`` ends exactly where ``engine forward`` starts, however the wall clock moves against the
    monotonic one between their two placings (a CI run saw the queue end 4 µs after the forward began)."""
    import itertools
    from types import SimpleNamespace

    from decisiond.engine import local

    tracer, encoder, handed = in_memory_tracer({"service.name": "decisiond-x"})
    wall, ahead = time.time_ns, itertools.count()
    monkeypatch.setattr(time, "time_ns", lambda: wall() + 10_000 * next(ahead))  # 10 µs more at each reading
    now = time.monotonic()
    run = SimpleNamespace(started=now - 0.002, finished=now - 0.001, passes=1, jobs=[None], size=9)
    ticket = SimpleNamespace(submitted=now - 0.003, joined=False, job=SimpleNamespace(run=run, size=9))
    with tracer.start("attempt"):
        local._traced(ticket)
    (trace,) = handed
    (resource_spans,) = ExportTraceServiceRequest.FromString(encoder.request([trace])).resource_spans
    spans = {span.name: span for span in resource_spans.scope_spans[0].spans}
    queue, forward = spans["engine queue"], spans["engine forward"]
    assert queue.end_time_unix_nano == forward.start_time_unix_nano
    assert queue.end_time_unix_nano - queue.start_time_unix_nano == pytest.approx(1_000_000, rel=0.01)
