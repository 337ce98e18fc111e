"""The router, the response cache and the metrics go by what a provider declares (``capabilities``, ``own_model``,
``cache_identity``, ``engines``, ``score``), never by its type: a provider that is not the local engine but declares
``score`` serves ``/v1/score``, and no module outside ``providers/local.py`` names ``LocalProvider``."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from decisiond.canonical import DecisionRequest, Message, Question, ScoreRequest, ScoreResult, Text
from decisiond.errors import DecisionError
from decisiond.gateway.catalog import Catalog, Target
from decisiond.gateway.providers.base import Provider
from decisiond.gateway.router import Router
from decisiond.gateway.settings import ProviderConfig
from decisiond.gateway.stages.cache import cache_key
from decisiond.server.metrics import EngineCollector

SRC = Path(__file__).resolve().parents[1] / "src" / "decisiond"


def test_no_module_outside_the_local_provider_names_it_or_reaches_into_an_engine():
    allowed = {SRC / "gateway" / "providers" / "local.py", SRC / "gateway" / "providers" / "__init__.py"}
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in allowed:
            continue
        text = path.read_text()
        if "LocalProvider" in text:
            offenders.append(f"{path.relative_to(SRC)}: names LocalProvider")
        if path.is_relative_to(SRC / "gateway") or path.name == "metrics.py":
            if re.search(r"\.engine\.loaded|engine\.loaded\.|\.provider\.engine\b", text):
                offenders.append(f"{path.relative_to(SRC)}: reaches into an engine")
    assert not offenders
    # The registry's one line is the only mention in providers/__init__.py.
    init = (SRC / "gateway" / "providers" / "__init__.py").read_text()
    assert init.count("LocalProvider") == 2  # the import and the REGISTRY entry


class Counters:
    def __init__(self):
        class Stats:
            passes = 7
            computed_tokens = 70

        self.stats = Stats()


class FakeEngine:
    """Has a backend with counters but no scheduler: the metrics read what is there."""

    def __init__(self):
        self.backend = Counters()


class Scorer(Provider):
    """Not the local engine: an upstream-like provider that declares score and a model of its own."""

    format = "openai"
    capabilities = frozenset({"decisions", "score"})
    needs_base_url = False

    def __init__(self, config):
        super().__init__(config)
        self.scored: list[ScoreRequest] = []
        self.engine = FakeEngine()

    @property
    def own_model(self):
        return "scorer-1"

    def describe(self):
        return "a fake scorer"

    def release_date(self):
        return "2020-02-02"

    def cache_identity(self):
        return {"weights": "v1"}

    def engines(self):
        return {"scorer-1": self.engine}

    async def score(self, request):
        self.scored.append(request)
        return ScoreResult([[0.25, 0.75]], [[-1.0, -0.5]], "scorer-1", 3)


class Plain(Provider):
    format = "openai"
    needs_base_url = False


def router():
    scorer = Scorer(ProviderConfig(name="s", type="openai", base_url="http://127.0.0.1:9/v1"))
    plain = Plain(ProviderConfig(name="p", type="openai", base_url="http://127.0.0.1:9/v1"))
    models = {"s/scorer-1": Target("s/scorer-1", scorer, "scorer-1", description=scorer.describe()),
              "plain": Target("plain", plain, "up")}
    aliases = {"s/default": "s/scorer-1", "scorer-1": "s/scorer-1"}  # its own model's other spellings
    return Router(Catalog({"s": scorer, "p": plain}, models, default_model="s/scorer-1", aliases=aliases,
                          allow_raw_upstreams=True)), scorer, plain


def test_score_goes_to_the_provider_that_declares_it():
    r, scorer, _ = router()
    request = ScoreRequest(((1, 2, 3),), ((4, 5),), model="s/scorer-1")
    assert r.score_target("s/scorer-1").provider is scorer
    result = asyncio.run(r.score(request))
    assert result.scores == [[0.25, 0.75]] and scorer.scored == [request]
    with pytest.raises(DecisionError) as refused:
        r.score_target("plain")
    assert refused.value.path == ("model",) and "not a local model" in refused.value.message


def test_own_model_names_listing_and_cache_identity_come_from_the_provider():
    r, scorer, plain = router()
    assert r.catalog.known_target("s/default") is r.catalog.models["s/scorer-1"]  # <provider>/default: its own model
    assert r.catalog.known_target("s/other") is None  # a provider with a model of its own serves no other
    assert r.catalog.known_target("p/anything").upstream == "anything"  # one without forwards any name
    listed = {m.name: m for m in r.catalog.model_list()}
    assert listed["s/scorer-1"].release_date == "2020-02-02" and listed["s/scorer-1"].description == "a fake scorer"
    request = ScoreRequest(((1, 2, 3),), ((4, 5),))
    key = cache_key("score", "s/scorer-1", r.catalog.models["s/scorer-1"], request)
    scorer.cache_identity = lambda: {"weights": "v2"}  # other weights: another entry
    assert cache_key("score", "s/scorer-1", r.catalog.models["s/scorer-1"], request) != key
    assert plain.cache_identity() is None


def test_engine_options_follow_the_capability():
    r, scorer, plain = router()
    request = DecisionRequest((Message("user", (Text("x"),)),), (Question("yes_no", "q", (Text("?"),)),),
                              temperature=0.5)
    refused = r.catalog.models["plain"].unsupported(request)
    assert refused is not None and refused.code == "unsupported_parameter" and refused.path == ("temperature",)
    scorer.capabilities = frozenset({"decisions", "score", "engine_options"})
    assert r.catalog.models["s/scorer-1"].unsupported(request) is None


def test_metrics_read_the_engines_a_provider_declares():
    r, _, _ = router()
    families = {f.name: f for f in EngineCollector(r).collect()}
    assert [(s.labels, s.value) for s in families["decisiond_engine_passes"].samples if s.name.endswith("_total")] \
        == [({"model": "scorer-1"}, 7.0)]
