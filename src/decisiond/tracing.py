"""OpenTelemetry traces of what decisiond serves, exported by OTLP over HTTP (protobuf). Off unless the gateway config
has ``otel: {endpoint: …}`` or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` is
set; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turns them off whatever else is set.

The spans of one request, top down (attribute names from OpenInference where it has them, OTel's HTTP conventions
on the request's span, ``decisiond.*`` for the rest; never a secret, never the text of a request):

- ``POST /v1/decisions`` (``server.middleware``): the HTTP request, the child of the caller's W3C ``traceparent``;
  its trace id is the access line's ``trace_id``;
- ``auth`` (``server.routes``), then ``decide`` / ``score`` / ``chat`` (``gateway.pipeline``: model, provider,
  questions, tokens, cost, cache hit, escalated questions, outcome), and in it one span per stage, each wrapping the
  rest of the chain as the stage itself does (``request_limits`` → ``resolve`` → … → ``route``); a judge guardrail's
  call is ``judge <name>`` (``gateway.service``), with a pipeline of its own;
- ``attempt <target>`` per upstream attempt (``gateway.router``: target, provider, outcome, tokens), each under a
  ``cascade step <n>`` in a cascade; every upstream request carries its attempt's ``traceparent``
  (``gateway.providers``);
- ``engine queue`` and ``engine forward`` (``engine.local``): a local request's wait for the model's worker and the
  run of forward passes that answered it, timed on the worker.

Cost. Off, nothing here runs: whoever traces holds ``tracer = None`` and branches once (``OFF``: a shared block
that does nothing). On, the OpenTelemetry SDK batches and exports — its ``BatchSpanProcessor`` thread posts batches,
never on a request's path; its samplers decide — but a span is this module's own small object, current in a
context variable of its own, written as OTLP protobuf as it ends (``decisiond.otlp``): the SDK's spans, context and
encoder cost ~10 times more, and a request has a dozen spans (``benchmarks/GATEWAY.md``, "Traces"). The SDK is
imported only when tracing starts.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Union

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .version import __version__

TraceContext = otel_context.Context
# A span's kind, as OTLP numbers them (``SpanKind`` + 1).
INTERNAL = 1
SERVER = 2

TRACES_PATH = "/v1/traces"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

# OpenInference (https://github.com/Arize-ai/openinference, semantic conventions)
KIND = "openinference.span.kind"  # CHAIN, LLM, GUARDRAIL
MODEL = "llm.model_name"
PROVIDER = "llm.provider"  # the provider's type: openai, azure, systemone, local
PROMPT_TOKENS = "llm.token_count.prompt"
COMPLETION_TOKENS = "llm.token_count.completion"
TOTAL_TOKENS = "llm.token_count.total"
CACHED_TOKENS = "llm.token_count.prompt_details.cache_read"
COST = "llm.cost.total"  # USD
# OpenTelemetry
ERROR_TYPE = "error.type"
# decisiond's own
REQUEST_ID = "decisiond.request_id"
OPERATION = "decisiond.operation"
DIALECT = "decisiond.dialect"
REQUESTED_MODEL = "decisiond.requested_model"
PROVIDER_NAME = "decisiond.provider"  # the provider's name in the config
TARGET = "decisiond.target"
QUESTIONS = "decisiond.questions"
ITEMS = "decisiond.items"
CACHE_HIT = "decisiond.cache_hit"
ESCALATED = "decisiond.escalated_questions"
OUTCOME = "decisiond.outcome"  # ok, refused: <code>, failover: <code>, error: <code>, …
UPSTREAM_STATUS = "decisiond.upstream_status"
CASCADE_STEP = "decisiond.cascade_step"
GUARDRAIL = "decisiond.guardrail"
GUARDRAIL_SCORE = "decisiond.guardrail_score"  # the judge's P(yes)
ENGINE_JOINED = "decisiond.engine.joined"  # the request joined an identical one already queued or running
ENGINE_PASSES = "decisiond.engine.passes"  # forward passes of the run that answered it
ENGINE_RUN_REQUESTS = "decisiond.engine.run_requests"  # requests batched in that run
ENGINE_RUN_TOKENS = "decisiond.engine.run_tokens"  # tokens the run computed, after prefix sharing
ENGINE_TOKENS = "decisiond.engine.tokens"  # the request's own share of them

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_PROPAGATOR = TraceContextTextMapPropagator()
# The current span of the running task. decisiond's own variable, not OpenTelemetry's context, whose every change
# copies a dictionary: a request makes a dozen spans current, and this is on its path.
_current: ContextVar[Span | None] = ContextVar("decisiond_span", default=None)


def traces_url(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where spans go: the configured endpoint (a base URL gets ``/v1/traces``; a URL that ends so is taken as it
    is), else the standard variables; None when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or \
            environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if configured:
        return configured if configured.rstrip("/").endswith(TRACES_PATH) else configured.rstrip("/") + TRACES_PATH
    if environ.get(TRACES_ENDPOINT_ENV):
        return environ[TRACES_ENDPOINT_ENV]
    if environ.get(ENDPOINT_ENV):
        return environ[ENDPOINT_ENV].rstrip("/") + TRACES_PATH
    return None


class Tracer:
    """Starts spans. Each span is written (``encoder``: ``otlp.Encoder``) as it ends, into its trace's
    ``TraceSpans``, which goes whole to the SDK's ``BatchSpanProcessor`` when the trace's first span here ends: one
    hand-over a request, not one a span, and nothing left for the processor's thread but to post what is written
    (the GIL it would hold to write a batch is the one the event loop needs: written here a span at a time, the cost
    is spread evenly). ``processor`` and ``sampler`` are the SDK's (``start`` makes them)."""

    def __init__(self, processor: Any, sampler: Any, encoder: Any):
        self.processor = processor
        self.sampler = sampler
        self.encoder = encoder

    def start(self, name: str, attributes: dict[str, Any] | None = None, kind: int = INTERNAL,
              parent: TraceContext | None = None, start_time: int | None = None, failures: bool = True) -> Span:
        """A span: the child of the current span, or of the caller's span in ``parent`` (an extracted
        ``traceparent``), else a root. A child of a local span shares its sampling decision; a root or the child of
        a caller's span is sampled by the sampler (``ParentBased``: a caller's decision stands). ``attributes`` is
        the span's own from then on; ``failures``: see ``Span``."""
        if parent is None:
            above = _current.get()
            if above is not None:
                if not above.recorded:  # its children carry its context on, unrecorded too
                    return Span(None, name, above.trace_id, above.span_id, False, above.trace_state, None, kind,
                                None, 0, False, 0)
                return Span(self, name, above.trace_id, above.span_id, False, above.trace_state, above.spans, kind,
                            attributes, start_time or time.time_ns(), failures)
            up = None
        else:
            up = trace.get_current_span(parent).get_span_context()
            up = up if up.is_valid else None
        trace_id = up.trace_id if up is not None else random.getrandbits(128) or 1
        sampled = self.sampler.should_sample(parent, trace_id, name, SpanKind(kind - 1), attributes)
        recorded = sampled.decision.is_sampled()
        return Span(self if recorded else None, name, trace_id, up.span_id if up is not None else 0, up is not None,
                    sampled.trace_state, None, kind, attributes, start_time or time.time_ns(), failures,
                    1 if recorded else 0)

    def current(self, name: str, attributes: dict[str, Any] | None = None, failures: bool = True) -> Span:
        """``start``: a span to use as a ``with`` block (see ``Span``)."""
        return self.start(name, attributes, failures=failures)

    def past(self, name: str, started: float, ended: float, attributes: dict[str, Any] | None = None,
             offset: int | None = None) -> None:
        """A span that has already happened, the child of the current span: ``started`` and ``ended`` are
        ``time.monotonic()`` readings, taken on any thread, placed on the wall clock by ``offset``
        (``wall_offset_ns()``, read now when not given). Spans that share an instant (one's end, the next's start)
        must share one reading: the wall clock moves against the monotonic one between two."""
        if offset is None:
            offset = wall_offset_ns()
        self.start(name, attributes, start_time=int(started * 1e9) + offset).end(int(ended * 1e9) + offset)


class TraceSpans:
    """A trace's spans in this process, as ``otlp`` writes them, handed to the processor together when the first of
    them ends (the processor batches these; ``otlp.Exporter`` posts them). ``context`` is that span's: the
    processor reads that it is sampled."""

    def __init__(self, context: SpanContext):
        self.context = context
        self.trace = b"\x0a\x10" + context.trace_id.to_bytes(16, "big")  # each span's trace_id field
        self.written: list[bytes] = []
        self.sent = False


class Span:
    """A span: ids, a name, times, attributes and an error (what ``otlp.Encoder.span`` writes) — or, for a trace
    that was sampled out, only the ids its children carry on upstream (``recorded`` False: nothing else is kept).

    Used as a ``with`` block, it is the current span (its children's parent) inside it and ends after it; with
    ``failures``, an exception that leaves the block marks it failed (``failed``). Not the SDK's span, nor
    OpenTelemetry's context (why: ``benchmarks/SERVER_NOTES.md``)."""

    __slots__ = ("tracer", "name", "trace_id", "span_id", "parent_id", "remote_parent", "trace_state", "flags",
                 "spans", "kind", "attributes", "start_time", "end_time", "error", "failures", "token")

    def __init__(self, tracer: Tracer | None, name: str, trace_id: int, parent_id: int, remote_parent: bool,
                 trace_state: TraceState | None, spans: TraceSpans | None, kind: int,
                 attributes: dict[str, Any] | None, start_time: int, failures: bool, flags: int = 1):
        self.tracer = tracer  # None: not recorded
        self.name = name
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.parent_id = parent_id  # 0: a root
        self.remote_parent = remote_parent
        self.trace_state = trace_state
        self.flags = flags  # W3C trace flags: 1 sampled
        # Its trace's spans here; it hands them over as it ends when it made them (None: it is the first).
        self.spans = spans if spans is not None or tracer is None else \
            TraceSpans(SpanContext(trace_id, self.span_id, False, _SAMPLED))
        self.kind = kind
        self.attributes = attributes if attributes is not None else {}
        self.start_time = start_time
        self.end_time = 0
        self.error: str | None = None  # failed: its error status's description (``error``)
        self.failures = failures
        self.token: Token[Span | None] | None = None

    @property
    def recorded(self) -> bool:
        return self.tracer is not None

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def update_name(self, name: str) -> None:
        self.name = name

    def end(self, end_time: int | None = None) -> None:
        if self.end_time or self.tracer is None or self.spans is None:
            return
        self.end_time = end_time or time.time_ns()
        spans = self.spans
        if spans.sent:  # ended after the span that handed its trace over (nothing in decisiond does): alone
            spans = TraceSpans(spans.context)
        spans.written.append(self.tracer.encoder.span(self, spans.trace))
        if spans.context.span_id == self.span_id or spans is not self.spans:
            spans.sent = True
            self.tracer.processor.on_end(spans)

    def __enter__(self) -> Span:
        self.token = _current.set(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exception: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.token is not None:
            _current.reset(self.token)
        if exception is not None and self.failures:
            failed(self, exception)
        self.end()


class Off:
    """What ``span`` gives when tracing is off: a block that does nothing (one shared object)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exception: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None


OFF = Off()
# A span's block, or one that does nothing.
Block = Union[Span, Off]


def span(tracer: Tracer | None, name: str, attributes: dict[str, Any] | None = None) -> Block:
    """``tracer.current(name, attributes)``, or a block that does nothing when tracing is off (``tracer`` None)."""
    return OFF if tracer is None else tracer.current(name, attributes)


def attach(span: Span) -> Token[Span | None]:
    """Make ``span`` the current one outside a ``with`` block; the token is for ``detach``."""
    return _current.set(span)


def detach(token: Token[Span | None]) -> None:
    _current.reset(token)


def error(span: Span, code: str) -> None:
    """Mark ``span`` failed: ``error.type`` and an error status, both ``code``."""
    span.set_attribute(ERROR_TYPE, code)
    span.error = code


def failed(span: Span, exception: BaseException) -> None:
    """Mark ``span`` failed by ``exception``: its code (a ``DecisionError``'s) or its type, never its message."""
    error(span, str(getattr(exception, "code", None) or type(exception).__name__))


def outcome(span: Span, text: str, code: str | None = None) -> None:
    """What a stage or an attempt decided (``ok``, ``refused: rate_limit_exceeded``, …); a ``code`` marks the span
    failed by it."""
    span.set_attribute(OUTCOME, text)
    if code is not None:
        error(span, code)


def trace_id(span: Span) -> str:
    """The span's trace id as W3C writes it (32 hex digits)."""
    return format(span.trace_id, "032x")


def extract(headers: Iterable[tuple[bytes, bytes]]) -> TraceContext | None:
    """The caller's trace context from an ASGI request's headers (``traceparent``, ``tracestate``), or None."""
    carrier = {}
    for key, value in headers:
        if key == b"traceparent" or key == b"tracestate":
            carrier[key.decode()] = value.decode("latin-1")
    return _PROPAGATOR.extract(carrier) if carrier else None


def inject(headers: dict[str, str]) -> None:
    """Add the current span's W3C ``traceparent`` (and ``tracestate``) to an upstream request's headers; nothing
    when no span is current (tracing off)."""
    current = _current.get()
    if current is not None:
        headers["traceparent"] = f"00-{current.trace_id:032x}-{current.span_id:016x}-{current.flags:02x}"
        if current.trace_state:
            headers["tracestate"] = current.trace_state.to_header()


def wall_offset_ns() -> int:
    """What to add to a ``time.monotonic()`` reading, in nanoseconds, to place it on the wall clock now."""
    return time.time_ns() - time.monotonic_ns()


def recording() -> Tracer | None:
    """The tracer, when the current span is recorded (its children are worth making)."""
    current = _current.get()
    return current.tracer if current is not None and not current.end_time else None


class Tracing:
    """Tracing in this process: its tracer, and the batch processor whose thread exports what it records."""

    def __init__(self, tracer: Tracer, url: str):
        self.tracer = tracer
        self.url = url

    def shutdown(self) -> None:
        """Export what is left (within the processor's timeout) and stop its thread: when the server stops. Blocks:
        run it off the event loop."""
        self.tracer.processor.shutdown()


def start(endpoint: str | None = None, service_name: str | None = None, sample_ratio: float = 1.0,
          headers: Mapping[str, str] | None = None, schedule_delay_ms: int | None = None) -> Tracing | None:
    """Start tracing this process (see the module's docstring for when it is on); None when it is off. Unset
    settings are the standard variables' (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_SCHEDULE_DELAY``, …) or their defaults; the service name is
    ``decisiond`` by default."""
    url = traces_url(endpoint)
    if url is None:
        return None
    # Lazy: the SDK costs tens of milliseconds to import, for nothing when tracing is off.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

    from . import otlp

    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "decisiond"
    resource = Resource.create({"service.name": name, "service.version": __version__})
    encoder = otlp.Encoder(resource.attributes, "decisiond", __version__)
    # What it batches are a request's spans each (``TraceSpans``): 64 requests, some 800 spans, a batch.
    processor = BatchSpanProcessor(otlp.Exporter(url, encoder, headers), schedule_delay_millis=schedule_delay_ms,
                                   max_export_batch_size=64)
    tracer = Tracer(processor, ParentBased(ALWAYS_ON if sample_ratio >= 1 else TraceIdRatioBased(sample_ratio)),
                    encoder)
    return Tracing(tracer, url)
