"""The decisions' quality in ``GET /metrics``: how sure the answers are, how much of the model's mass their labels
hold, how often a model refuses a question, and how many of a cascade's questions escalate.

- ``decisiond_decision_confidence`` (histogram; model, question): each answer's confidence, the number a cascade
  compares with its threshold (``gateway.cascade.confidence``): a choice's or a score's top probability, a
  predicate's max(p, 1 − p) — not the ``confidence`` field of a response (TypeSafe's formula);
- ``decisiond_decision_label_mass`` (histogram; model, question): the answer's ``label_mass``, where the provider
  gives one (local engines do; an upstream may not);
- ``decisiond_decision_refusals`` (model, question): questions the model refused to answer (no probabilities: not in
  the histograms, so that the refusal rate is refusals ÷ (refusals + the confidence histogram's count));
- ``decisiond_cascade_questions`` and ``decisiond_cascade_escalated`` (cascade, step, model): the questions each step
  of a cascade answered, and those of them below its threshold, sent on to a later step;
- ``decisiond_decision_accuracy``, ``decisiond_decision_ece`` and ``decisiond_decision_labels`` (gauges; model,
  question): for a model with stored decisions (``store: true``), over its newest ``DECISION_QUALITY_WINDOW``
  labelled decisions, the accuracy of the answers served, their expected calibration error (``ECE_BINS`` bins) and
  how many labels that is (``LabelQuality``: read from the database at most every ``DECISION_QUALITY_REFRESH_S``,
  when ``/metrics`` is scraped; question names bounded as above, the most labelled first).

Every answer a pipeline gives is recorded once, in the one place all routes and dialects pass through
(``Pipeline.observer``), cache hits included: the metrics describe what clients were answered. ``model`` is the
resolved name (bounded by the config); question names come from clients, so ``QuestionLabels`` bounds them: the first
``metrics.question_labels`` distinct names of each model (per server process) get their own label value, the others
are counted as ``_other``. The label children are bound once and kept in a dict: an answer costs a dict lookup and
two histogram observations.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..canonical import DecisionRequest, DecisionResult
from ..gateway import pipeline
from ..gateway.cascade import Step, confidence
from ..gateway.catalog import Catalog
from ..gateway.decisions import QuestionQuality, quality
from ..gateway.types import Context
from ..limits import DECISION_QUALITY_REFRESH_S, DECISION_QUALITY_WINDOW, DEFAULT_QUESTION_LABELS

if TYPE_CHECKING:
    from ..gateway.service import Gateway

log = logging.getLogger("decisiond.server")

# The top probability is at least 1/n: fine steps where thresholds are usually set.
CONFIDENCE_BUCKETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
# A low label mass (the model wanted to say something else) is the signal: finer steps at both ends.
LABEL_MASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
OTHER = "_other"
UNNAMED = "_unnamed"


class QuestionLabels:
    """The label value each question name gets, per model: its own for the first ``limit`` distinct names seen, then
    ``_other`` (an unnamed question is ``_unnamed``). The one place the bound lives: what it keeps per model is its
    ``limit`` names and one ``_other`` entry, whatever clients send."""

    def __init__(self, limit: int, bind: Any):
        """``bind(model, label)``: the instruments' children for a label value, made once per value."""
        self.limit = limit
        self.bind = bind
        self.named: dict[str, dict[str, Any]] = {}
        self.other: dict[str, Any] = {}

    def children(self, model: str, name: str | None) -> Any:
        named = self.named.get(model)
        if named is None:
            named = self.named[model] = {}
        label = UNNAMED if name is None else name
        found = named.get(label)
        if found is not None:
            return found
        if len(named) < self.limit:
            found = named[label] = self.bind(model, label)
            return found
        other = self.other.get(model)
        if other is None:
            other = self.other[model] = self.bind(model, OTHER)
        return other


class DecisionMetrics(pipeline.Observer):
    """The quality instruments on ``registry``; the gateway pipeline's observer, and told of each cascade call by
    ``Metrics`` (the router's observer)."""

    def __init__(self, registry: CollectorRegistry, catalog: Catalog, question_labels: int = DEFAULT_QUESTION_LABELS):
        r = registry
        self.confidence = Histogram(
            "decisiond_decision_confidence",
            "Confidence of each answer (top probability; a predicate's max(p, 1-p)), cache hits included",
            ["model", "question"], buckets=CONFIDENCE_BUCKETS, registry=r)
        self.label_mass = Histogram(
            "decisiond_decision_label_mass",
            "Label mass of each answer that reports one (the probability the model put on the answer labels)",
            ["model", "question"], buckets=LABEL_MASS_BUCKETS, registry=r)
        self.refusals = Counter("decisiond_decision_refusals", "Questions the model refused to answer",
                                ["model", "question"], registry=r)
        self.cascade_questions = Counter("decisiond_cascade_questions", "Questions each step of a cascade answered",
                                         ["cascade", "step", "model"], registry=r)
        self.cascade_escalated = Counter(
            "decisiond_cascade_escalated", "Questions a cascade step answered below its threshold, sent on to the next",
            ["cascade", "step", "model"], registry=r)
        self.questions = QuestionLabels(question_labels, self._bind)
        self.steps: dict[tuple[str, int], tuple[Any, Any]] = {}
        for virtual in catalog.virtual.values():  # every step's series from the start, at 0
            if virtual.strategy == "cascade":
                for position, name in enumerate(virtual.targets, 1):
                    self._step(virtual.name, position, name)

    def _bind(self, model: str, label: str) -> tuple[Any, Any, Any]:
        return (self.confidence.labels(model, label), self.label_mass.labels(model, label),
                self.refusals.labels(model, label))

    def _step(self, cascade: str, position: int, name: str) -> tuple[Any, Any]:
        children = self.steps[cascade, position] = (self.cascade_questions.labels(cascade, str(position), name),
                                                    self.cascade_escalated.labels(cascade, str(position), name))
        return children

    def answered(self, context: Context, request: Any, result: Any) -> None:
        if not isinstance(result, DecisionResult) or not isinstance(request, DecisionRequest):
            return
        try:
            model = context.resolved_model or result.model
            children = self.questions.children
            for question, answer in zip(request.questions, result.answers):
                observed_confidence, observed_mass, refused = children(model, question.name)
                if answer.refusal or not answer.probabilities:
                    refused.inc()
                    continue
                observed_confidence.observe(confidence(answer))
                if answer.label_mass is not None:
                    observed_mass.observe(answer.label_mass)
        except Exception:  # a metric must never fail the request
            log.exception("decision metrics not recorded", extra={"request_id": context.request_id})

    def cascade_step(self, cascade: str, step: Step) -> None:
        if step.result is None:  # a failed call answered nothing
            return
        children = self.steps.get((cascade, step.position)) or self._step(cascade, step.position, step.name)
        children[0].inc(step.questions)
        if step.escalated:
            children[1].inc(step.escalated)


class LabelQuality(Collector):
    """The rolling accuracy and ECE of each stored model's labelled decisions, per question, as gauges: computed
    from the database by ``refresh`` (the ``/metrics`` route awaits it; at most once every
    ``DECISION_QUALITY_REFRESH_S``), read by ``collect``."""

    def __init__(self, gateway: "Gateway", question_labels: int = DEFAULT_QUESTION_LABELS,
                 window: int = DECISION_QUALITY_WINDOW):
        self.gateway = gateway
        self.question_labels = question_labels
        self.window = window
        self.snapshot: dict[tuple[str, str], QuestionQuality] = {}
        self.refreshed = float("-inf")

    async def refresh(self) -> None:
        store = self.gateway.decisions
        if store is None or not self.gateway.stored_models or \
                time.monotonic() - self.refreshed < DECISION_QUALITY_REFRESH_S:
            return
        self.refreshed = time.monotonic()
        snapshot = {}
        try:
            for model in self.gateway.stored_models:
                rows = await store.labelled(model, self.window)
                named = Tally(name for _, _, labels in rows for name in labels)
                kept = {name for name, _ in named.most_common(self.question_labels)}
                renamed = [([{**q, "name": q["name"] if q["name"] in kept or q["name"] is None else OTHER}
                             for q in questions], answers,
                            {(name if name in kept else OTHER): value for name, value in labels.items()})
                           for questions, answers, labels in rows]
                for name, measured in quality(renamed).items():
                    snapshot[model, name] = measured
        except Exception:  # the database: the last snapshot stays
            log.warning("decision quality not read from the database", exc_info=True)
            return
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        accuracy = GaugeMetricFamily("decisiond_decision_accuracy", "Accuracy of the answers served, over the "
                                     "newest labelled stored decisions", labels=["model", "question"])
        ece = GaugeMetricFamily("decisiond_decision_ece", "Expected calibration error of the answers served, over "
                                "the newest labelled stored decisions", labels=["model", "question"])
        labels = GaugeMetricFamily("decisiond_decision_labels", "Labelled stored decisions the accuracy and ECE are "
                                   "computed over", labels=["model", "question"])
        for (model, name), measured in sorted(self.snapshot.items()):
            accuracy.add_metric([model, name], measured.accuracy)
            ece.add_metric([model, name], measured.ece)
            labels.add_metric([model, name], measured.labels)
        yield accuracy
        yield ece
        yield labels
