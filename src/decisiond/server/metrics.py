"""Prometheus metrics at ``GET /metrics`` (``prometheus-client``), one registry per app.

- requests by route, dialect, model (the resolved one: bounded) and status, with latency histograms, questions,
  input tokens and refusals by error code (rate-limit refusals are ``code="rate_limit_exceeded"``): read by a
  pure-ASGI middleware from the access-log fields the server already fills;
- upstream attempts, failovers, errors (by provider and code) and attempt latency: ``Metrics`` is the router's
  ``observer``;
- the usage writer's rows written, dead letters and lost records: read at scrape time;
- each local engine's queue depth, batches (forward passes), jobs, rows, and tokens requested vs computed (the
  prefix-sharing ratio) and padded: read from the scheduler at scrape time, so the engine carries no hook;
- the decisions' quality (confidence, label mass, refusals by model and question; cascade escalations):
  ``decision_metrics``, the gateway pipeline's observer.

Grafana: ``docs/grafana-dashboard.json``.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ProviderError
from ..gateway.cascade import Step
from ..gateway.catalog import Target
from ..gateway.router import Observer, Router
from ..gateway.service import Gateway
from ..limits import DEFAULT_QUESTION_LABELS
from .decision_metrics import DecisionMetrics, LabelQuality

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a tiny model answers in milliseconds, a CPU batch or an upstream in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Routes named as they are; anything else is "other" (a scanner's paths must not grow the label set).
ROUTES = ("/v1/decisions", "/v1/systemone", "/v1/score", "/v1/models", "/health", "/metrics", "/", "/playground")
PREFIXES = ("/admin", "/mcp", "/static")


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    for prefix in PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return prefix
    return "other"


class EngineCollector(Collector):
    """The local engines' scheduler counters, read when Prometheus scrapes (nothing is added to the engine)."""

    def __init__(self, router: Router):
        self.router = router

    def _engines(self) -> dict[str, Any]:
        return {name: engine for p in self.router.catalog.providers.values() for name, engine in p.engines().items()}

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("decisiond_engine_queue_depth", "Jobs waiting for the model's worker",
                                  labels=["model"])
        queued = GaugeMetricFamily("decisiond_engine_queued_tokens",
                                   "Tokens of admitted work not yet computed (bounded by --max-queued-tokens)",
                                   labels=["model"])
        # (where the counter lives: the scheduler's or the backend's stats, its field) → the metric
        counters = {
            ("scheduler", "runs"): CounterMetricFamily("decisiond_engine_batches",
                                                       "Batches (runs) handed to the backend", labels=["model"]),
            ("scheduler", "jobs"): CounterMetricFamily(
                "decisiond_engine_batched_jobs", "Requests served by those batches (÷ batches = mean batch size)",
                labels=["model"]),
            ("scheduler", "joined"): CounterMetricFamily(
                "decisiond_engine_joined_jobs", "Requests that joined an identical one in flight (SDK retries)",
                labels=["model"]),
            ("scheduler", "cancelled"): CounterMetricFamily(
                "decisiond_engine_cancelled_jobs", "Jobs dropped or stopped because every caller had gone",
                labels=["model"]),
            ("scheduler", "refused"): CounterMetricFamily(
                "decisiond_engine_refused_jobs", "Requests refused by admission control (400 or 503)",
                labels=["model"]),
            ("backend", "passes"): CounterMetricFamily("decisiond_engine_passes", "Forward passes of the model",
                                                       labels=["model"]),
            ("scheduler", "prompt_tokens"): CounterMetricFamily(
                "decisiond_engine_tokens_requested", "Prompt tokens the requests asked for", labels=["model"]),
            ("backend", "computed_tokens"): CounterMetricFamily(
                "decisiond_engine_tokens_computed",
                "Tokens actually computed after prefix sharing and the prefix cache", labels=["model"]),
            ("backend", "reused_tokens"): CounterMetricFamily(
                "decisiond_engine_prefix_cache_reused_tokens", "Prompt tokens taken from the prefix cache",
                labels=["model"]),
            ("backend", "padded_tokens"): CounterMetricFamily("decisiond_engine_tokens_padded",
                                                              "Tokens of the padded batches", labels=["model"]),
        }
        for name, engine in self._engines().items():
            scheduler = getattr(engine, "scheduler", None)
            if scheduler is not None:
                depth.add_metric([name], float(scheduler.waiting))
                queued.add_metric([name], float(scheduler.queued_tokens))
            sources = {"scheduler": getattr(scheduler, "stats", None),
                       "backend": getattr(getattr(engine, "backend", None), "stats", None)}
            for (source, field), family in counters.items():
                value = getattr(sources[source], field, None)
                if isinstance(value, (int, float)):
                    family.add_metric([name], float(value))
        yield depth
        yield queued
        yield from counters.values()


MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
USAGE_COUNTERS = (
    ("decisiond_usage_rows_written", "Usage rows written to the database", "written"),
    ("decisiond_usage_dead_letters", "Usage records the database refused, kept in the dead-letter file",
     "dead_letters"),
    ("decisiond_usage_records_lost", "Usage records dropped: the journal's disk and the writer's queue were full",
     "lost"))


def share_between_processes(directory: str) -> None:
    """Keep every instrument made from now on in files under ``directory``, which any process's scrape adds up (call
    before the workers of ``serve --workers`` start)."""
    os.environ[MULTIPROCESS_DIR] = directory
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


class UsageCollector(Collector):
    """The usage writer's counters, read when Prometheus scrapes: rows written, records refused by the database
    (in the journal's dead-letter file) and records lost (neither the journal nor memory could hold them)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def collect(self) -> Iterable[Metric]:
        writer = self.gateway.usage
        for name, text, field in USAGE_COUNTERS:
            family = CounterMetricFamily(name, text)
            family.add_metric([], float(getattr(writer, field, 0)) if writer is not None else 0.0)
            yield family


class Metrics(Observer):
    """The app's registry and instruments; also the router's observer (``Router.observer``)."""

    def __init__(self, router: Router, gateway: Gateway | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("decisiond_requests", "HTTP requests", ["route", "dialect", "model", "status"],
                                registry=r)
        self.latency = Histogram("decisiond_request_duration_seconds", "Time to the response, by route",
                                 ["route", "dialect", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.questions = Counter("decisiond_questions", "Questions answered or asked", ["route", "model"],
                                 registry=r)
        self.input_tokens = Counter("decisiond_input_tokens", "Input tokens billed to callers", ["model"],
                                    registry=r)
        self.refusals = Counter("decisiond_refusals",
                                "Requests refused, by error code (rate limits included) and model (once resolved)",
                                ["route", "model", "code", "status"], registry=r)
        self.attempts = Counter("decisiond_upstream_attempts", "Attempts on a target", ["provider", "model"],
                                registry=r)
        self.failovers = Counter("decisiond_upstream_failovers",
                                 "Failed attempts of an unavailable upstream (a chain hands them to its next target)",
                                 ["provider"], registry=r)
        self.upstream_errors = Counter("decisiond_upstream_errors", "Failed attempts, by provider and error code",
                                       ["provider", "code"], registry=r)
        self.upstream_latency = Histogram("decisiond_upstream_attempt_seconds", "Duration of each attempt",
                                          ["provider"], buckets=LATENCY_BUCKETS, registry=r)
        self.engines = EngineCollector(router)
        r.register(self.engines)
        self.gateway = gateway
        # Several processes (``serve --workers``): every instrument above is kept in files that any worker's scrape
        # adds up (prometheus-client's multiprocess mode); the usage writer's counts, which each worker keeps, are
        # added to counters of the same names as they grow.
        self.shared = bool(os.environ.get(MULTIPROCESS_DIR))
        self._published: dict[str, float] = {}
        self.usage: dict[str, Counter] = {}
        if self.shared:
            self.usage = {field: Counter(name, text, registry=r) for name, text, field in USAGE_COUNTERS}
        elif gateway is not None:
            r.register(UsageCollector(gateway))
        router.observer = self
        question_labels = gateway.config.metrics.question_labels if gateway is not None else DEFAULT_QUESTION_LABELS
        self.decisions = DecisionMetrics(r, router.catalog, question_labels)
        self.label_quality: LabelQuality | None = None
        if gateway is not None:
            gateway.pipeline.observer = self.decisions
            self.label_quality = LabelQuality(gateway, question_labels)
            r.register(self.label_quality)

    # ---- the router's observer

    def attempt(self, target: Target) -> float:
        self.attempts.labels(target.provider.name, target.name).inc()
        return time.perf_counter()

    def attempt_done(self, target: Target, started: float, error: ProviderError | None = None) -> None:
        self.upstream_latency.labels(target.provider.name).observe(time.perf_counter() - started)
        if error is not None:
            self.upstream_errors.labels(target.provider.name, error.code).inc()
            if error.failover:
                self.failovers.labels(target.provider.name).inc()

    def cascade_step(self, cascade: str, step: Step) -> None:
        self.decisions.cascade_step(cascade, step)

    # ---- requests

    def observe(self, path: str, status: int, seconds: float, fields: dict[str, Any]) -> None:
        route = route_label(path)
        dialect = str(fields.get("dialect") or "")
        model = str(fields.get("resolved_model") or "")
        self.requests.labels(route, dialect, model, str(status)).inc()
        self.latency.labels(route, dialect, model).observe(seconds)
        if isinstance(fields.get("questions"), int):
            self.questions.labels(route, model).inc(fields["questions"])
        if isinstance(fields.get("input_tokens"), int) and fields["input_tokens"] > 0:
            self.input_tokens.labels(model).inc(fields["input_tokens"])
        if status >= 400 and fields.get("error_code"):
            self.refusals.labels(route, model, str(fields["error_code"]), str(status)).inc()
        if self.shared:
            self._publish_usage()

    def render(self) -> bytes:
        if not self.shared:
            return generate_latest(self.registry)
        self._publish_usage()
        registry = CollectorRegistry()
        WorkerFiles(registry)  # type: ignore[no-untyped-call]
        registry.register(self.engines)  # this worker's own engines
        if self.label_quality is not None:  # read from the database the workers share: the same in each
            registry.register(self.label_quality)
        return generate_latest(registry)

    def _publish_usage(self) -> None:
        writer = self.gateway.usage if self.gateway is not None else None
        if writer is None:
            return
        for field, counter in self.usage.items():
            value = float(getattr(writer, field, 0))
            grown = value - self._published.get(field, 0.0)
            if grown > 0:
                counter.inc(grown)
                self._published[field] = value


class WorkerFiles(multiprocess.MultiProcessCollector):
    """prometheus-client's multiprocess collector, less the files that hold nothing yet: a worker creates its file
    before it sizes it, and a scrape that reads it at 0 bytes fails whole (prometheus/client_python#1199; for good
    where that worker died in the moment)."""

    def collect(self) -> Iterable[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(path) > 0:
                    files.append(path)
            except OSError:  # gone since the listing
                continue
        return self.merge(files, accumulate=True)  # type: ignore[no-untyped-call,no-any-return]


class MetricsMiddleware:
    """Pure ASGI, inside ``RequestContext``: counts each HTTP request once its response has started, with the
    access-log fields (``scope["state"]["log"]``) the route filled in."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            fields = scope.get("state", {}).get("log") or {}
            self.metrics.observe(scope["path"], status, time.perf_counter() - start, fields)
