"""OTLP over HTTP for ``decisiond.tracing``: each span written, as it ends, as the protobuf of an OTLP ``Span``, and a
batch of them posted to a receiver's ``/v1/traces`` as one ``ExportTraceServiceRequest`` from the SDK's
``BatchSpanProcessor`` thread.

Spans are written directly as wire bytes, with the fields of OTLP's ``opentelemetry/proto/trace/v1/trace.proto`` (the
tests decode what is sent with OTLP's own generated classes); an attribute or a name seen before (an outcome, a
model) is written once and reused. Why not the SDK's own exporter: ``benchmarks/SERVER_NOTES.md``.

The exporter follows the OTLP/HTTP specification: ``Content-Type: application/x-protobuf``; 429, 502, 503 and 504
retried with exponential backoff (or the receiver's ``Retry-After``) within the timeout; the standard variables for
what the config leaves unset (``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``OTEL_EXPORTER_OTLP_HEADERS``,
``…_TIMEOUT``). A receiver that is down loses traces (one warning a batch), never requests.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger("decisiond.tracing")

RETRYABLE = frozenset({429, 502, 503, 504})
DEFAULT_TIMEOUT_S = 10.0
# Attributes written once and reused: keys with short values (outcomes, model names, counts), up to this many.
_CACHED_ATTRIBUTES = 4096
_CACHEABLE_CHARS = 64
# Span.flags = 16 (fixed32): the W3C trace flags, 0x100 (the next bit is known), 0x200 (the parent is remote).
_FLAGS = {(flags, remote): b"\x85\x01" + (0x100 | flags | (0x200 if remote else 0)).to_bytes(4, "little")
          for flags in (0, 1) for remote in (False, True)}

_double = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message): its tag, its length, itself."""
    return tag + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    """``AnyValue``: string_value = 1, bool_value = 2, int_value = 3, double_value = 4."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement, as protobuf writes it
    if isinstance(value, float):
        return b"\x21" + _double(value)
    return _field(b"\x0a", str(value).encode())


class Encoder:
    """Spans to the bytes of one ``ExportTraceServiceRequest``: every span under one resource and one scope."""

    def __init__(self, resource: Mapping[str, Any], scope: str, version: str):
        # (key, value) → (the value's type, the KeyValue as a Span.attributes field): True == 1, so the type says
        # which of the two was written.
        self.attributes: dict[tuple[str, Any], tuple[type, bytes]] = {}
        self.names: dict[tuple[str, Any], bytes] = {}
        # ResourceSpans.resource = 1 (Resource.attributes = 1); ScopeSpans.scope = 1 (name = 1, version = 2)
        self.resource = _field(b"\x0a", b"".join(_key_value(b"\x0a", k, v) for k, v in resource.items()))
        self.scope = _field(b"\x0a", _field(b"\x0a", scope.encode()) + _field(b"\x12", version.encode()))

    def span(self, span: Any, trace: bytes) -> bytes:
        """``Span`` (a ``tracing.Span``): trace_id = 1 (``trace``: written once a trace), span_id = 2,
        trace_state = 3, parent_span_id = 4, name = 5, kind = 6, start_time_unix_nano = 7, end_time_unix_nano = 8,
        attributes = 9, status = 15 (message = 2, code = 3), flags = 16 (the trace flags, and whether the parent is
        remote). Written once for every span a request makes, on the event loop: kept to few calls."""
        parts = [trace, b"\x12\x08", span.span_id.to_bytes(8, "big")]
        if span.trace_state:
            parts.append(_field(b"\x1a", span.trace_state.to_header().encode()))
        if span.parent_id:
            parts += (b"\x22\x08", span.parent_id.to_bytes(8, "big"))
        name = self.names.get((span.name, span.kind))
        if name is None:
            name = _field(b"\x2a", span.name.encode()) + b"\x30" + _varint(span.kind)  # name, kind
            if len(self.names) < _CACHED_ATTRIBUTES:
                self.names[(span.name, span.kind)] = name
        parts += (name, b"\x39", span.start_time.to_bytes(8, "little"), b"\x41", span.end_time.to_bytes(8, "little"))
        cache = self.attributes
        for item in span.attributes.items():
            hit = cache.get(item)
            if hit is not None and hit[0] is type(item[1]):
                parts.append(hit[1])
                continue
            written = _key_value(b"\x4a", *item)
            value = item[1]
            if (not isinstance(value, str) or len(value) <= _CACHEABLE_CHARS) and len(cache) < _CACHED_ATTRIBUTES:
                cache[item] = (type(value), written)
            parts.append(written)
        if span.error:  # Status: message, code ERROR (2); an unset status is not written
            parts.append(_field(b"\x7a", _field(b"\x12", span.error.encode()) + b"\x18\x02"))
        parts.append(_FLAGS[span.flags, span.remote_parent])
        body = b"".join(parts)
        size = len(body)
        return b"\x12" + (bytes((size,)) if size < 0x80 else _varint(size)) + body  # ScopeSpans.spans = 2

    def request(self, traces: Sequence[Any]) -> bytes:
        """``ExportTraceServiceRequest`` of ``tracing.TraceSpans`` (their spans written as they ended):
        resource_spans = 1 (ResourceSpans: resource = 1, scope_spans = 2)."""
        spans = b"".join([span for trace in traces for span in trace.written])
        return _field(b"\x0a", self.resource + _field(b"\x12", self.scope + spans))


def _key_value(tag: bytes, key: str, value: Any) -> bytes:
    """One ``KeyValue`` (key = 1, value = 2) as the field ``tag``."""
    return _field(tag, _field(b"\x0a", key.encode()) + _field(b"\x12", _any_value(value)))


def _setting(name: str) -> str | None:
    """A standard variable, its traces-only form first (``OTEL_EXPORTER_OTLP_TRACES_X``, ``OTEL_EXPORTER_OTLP_X``)."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def env_headers() -> dict[str, str]:
    raw = _setting("HEADERS")
    return dict(parse_env_headers(raw, liberal=True)) if raw else {}


def env_timeout() -> float:
    raw = _setting("TIMEOUT")
    try:
        return float(raw) / 1000 if raw else DEFAULT_TIMEOUT_S  # the variables are in milliseconds
    except ValueError:
        return DEFAULT_TIMEOUT_S


class Exporter(SpanExporter):
    """The ``SpanExporter`` of decisiond's ``BatchSpanProcessor``: each batch posted to ``url`` on one kept-alive
    connection (the standard library's: a fraction of an HTTP client library's CPU a batch)."""

    def __init__(self, url: str, encoder: Encoder, headers: Mapping[str, str] | None = None,
                 timeout: float | None = None):
        self.url = url
        parsed = urlsplit(url)
        self.https = parsed.scheme == "https"
        self.host, self.port = parsed.hostname or "localhost", parsed.port
        self.path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self.encoder = encoder
        self.timeout = timeout if timeout is not None else env_timeout()
        self.headers = {**(headers if headers else env_headers()), "Content-Type": "application/x-protobuf"}
        self.connection: http.client.HTTPConnection | None = None
        self.stopping = threading.Event()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        """``spans``: what the processor batched, ``tracing.TraceSpans`` (a request's spans each)."""
        body = self.encoder.request(spans)
        return SpanExportResult.SUCCESS if self.post(body) else SpanExportResult.FAILURE

    def post(self, body: bytes) -> bool:
        """Send one batch, retrying what the specification says to retry until the timeout; False when it was lost
        (logged: a receiver that is down loses traces, never requests)."""
        deadline = time.monotonic() + self.timeout
        status: int | None = None
        reason = ""
        for attempt in range(8):
            reused = self.connection is not None
            try:
                status, reason, wait = self.send(body, max(0.1, deadline - time.monotonic()))
            except (OSError, http.client.HTTPException) as error:
                self.close()
                if reused:  # a kept-alive connection the receiver had closed: once more, on a new one
                    continue
                status, reason, wait = None, type(error).__name__, None
            else:
                if status < 300:
                    return True
                if status not in RETRYABLE:
                    break
            backoff = wait if wait is not None else min(2 ** attempt, 30) * (0.5 + random.random() / 2)
            if time.monotonic() + backoff >= deadline or self.stopping.wait(backoff):
                break
        log.warning("traces lost: the OTLP receiver did not take them", extra={
            "receiver": self.url, "status": status, "reason": reason})
        return False

    def send(self, body: bytes, timeout: float) -> tuple[int, str, float | None]:
        """One POST: the status, its reason, and the receiver's ``Retry-After`` in seconds (or None)."""
        if self.connection is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.connection = kind(self.host, self.port, timeout=timeout)
        self.connection.timeout = timeout
        if self.connection.sock is not None:
            self.connection.sock.settimeout(timeout)
        self.connection.request("POST", self.path, body, self.headers)
        response = self.connection.getresponse()
        response.read()
        if response.will_close:
            self.close()
        return response.status, response.reason, _retry_after(response.getheader("retry-after"))

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def shutdown(self) -> None:
        self.stopping.set()
        self.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is kept here: the processor holds the spans


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
