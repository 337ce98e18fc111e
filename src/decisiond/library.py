"""decisiond as a Python library: decision models in-process (``load``) or from a remote server (``Client``),
with typed questions and typed answers.

In-process, no server::

    import decisiond
    from decisiond import Choice, Predicate, Score

    engine = decisiond.load()                       # the embedded SmolLM2; or a HF folder, a .gguf, a hub id
    decision = engine.decide("I was charged twice. Please fix this ASAP.", [
        Predicate("billing", "Is this ticket about billing?"),
        Choice("team", "Which team should handle it?", {"billing": "Charges, invoices", "shipping": None}),
        Score("urgency", "How urgent is it?", ["Can wait", "This week", "Today"]),
    ])
    decision["billing"].probability                  # P(yes)
    decision["team"].choice, decision["team"].probabilities, decision["team"].confidence
    decision["urgency"].score                        # expected level, 0 … len(levels) - 1

Questions may also be OpenAI-shaped dicts (``{"type": "predicate", "name": …, "instructions": …}``), or come
from a pydantic model::

    class Ticket(BaseModel):
        billing: bool | None = Field(None, description="Is this ticket about billing?")
        team: Literal["billing", "shipping"] | None = Field(None, description="Which team should handle it?")

    ticket = engine.decide_as(Ticket, "I was charged twice.", min_confidence=0.5)   # fields below it: None

A remote decisiond answers with the same types: ``decisiond.Client("http://127.0.0.1:8000", api_key=…)``.
Every request goes through the same gateway pipeline and OpenAI wire shape as ``POST /v1/decisions``, so a
refused request raises ``DecisionError`` naming the field at fault, locally and remotely alike.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import threading
import time
import types
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

import httpx

from . import probability
from .errors import DecisionError, InvalidRequest

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .engine.local import LocalEngine
    from .gateway.router import Router
    from .gateway.service import Gateway


M = TypeVar("M", bound="BaseModel")
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- questions


def _described(items: Sequence[Any] | Mapping[Any, str | None], key: str) -> list[dict[str, Any]]:
    pairs = items.items() if isinstance(items, Mapping) else ((item, None) for item in items)
    return [{key: value, **({"description": text} if text is not None else {})} for value, text in pairs]


@dataclass(frozen=True)
class Predicate:
    """A yes/no question; its answer is ``PredicateAnswer.probability`` = P(yes).

    >>> Predicate("billing", "Is this ticket about billing?").to_dict()["type"]
    'predicate'
    """

    name: str
    instructions: str

    def to_dict(self) -> dict[str, Any]:
        return {"type": "predicate", "name": self.name, "instructions": self.instructions}


@dataclass(frozen=True)
class Choice:
    """One of several options (strings or booleans), given as a list or as ``{value: description or None}``.

    >>> Choice("team", "Which team?", {"billing": "Charges, invoices", "shipping": None}).to_dict()["choices"]
    [{'value': 'billing', 'description': 'Charges, invoices'}, {'value': 'shipping'}]
    """

    name: str
    instructions: str
    choices: Sequence[str | bool] | Mapping[str | bool, str | None]

    def to_dict(self) -> dict[str, Any]:
        return {"type": "choice", "name": self.name, "instructions": self.instructions,
                "choices": _described(self.choices, "value")}


@dataclass(frozen=True)
class Score:
    """A level on an ordered scale, lowest first, given as labels or ``{label: description or None}``.

    >>> Score("urgency", "How urgent?", ["Can wait", "Today"]).to_dict()["levels"]
    [{'label': 'Can wait'}, {'label': 'Today'}]
    """

    name: str
    instructions: str
    levels: Sequence[str] | Mapping[str, str | None]

    def to_dict(self) -> dict[str, Any]:
        return {"type": "score", "name": self.name, "instructions": self.instructions,
                "levels": _described(self.levels, "label")}


QuestionLike = Union[Predicate, Choice, Score, Mapping[str, Any]]


def _question_dict(question: QuestionLike) -> dict[str, Any]:
    if isinstance(question, (Predicate, Choice, Score)):
        return question.to_dict()
    if isinstance(question, Mapping):
        return dict(question)
    raise TypeError(f"a question is a Predicate, Choice, Score or an OpenAI-shaped dict, not {type(question).__name__}")


# ------------------------------------------------------------------------------------------------ answers


@dataclass(frozen=True)
class PredicateAnswer:
    """``probability`` is P(yes); ``probabilities`` is ``{True: P(yes), False: P(no)}``."""

    name: str | None
    probability: float
    label_mass: float | None = None

    @property
    def probabilities(self) -> dict[bool, float]:
        return {True: self.probability, False: 1.0 - self.probability}

    @property
    def confidence(self) -> float:
        """The choice confidence of the two answers: 0 at 50/50, 1 when certain."""
        return probability.choice_confidence([self.probability, 1.0 - self.probability])

    @property
    def value(self) -> bool:
        return self.probability >= 0.5


@dataclass(frozen=True)
class ChoiceAnswer:
    """``choice`` is the most probable option; ``probabilities`` maps each option's value to its probability."""

    name: str | None
    choice: str | bool
    probabilities: dict[str | bool, float]
    confidence: float
    label_mass: float | None = None

    @property
    def value(self) -> str | bool:
        return self.choice


@dataclass(frozen=True)
class ScoreAnswer:
    """``score`` is the expected level (0 … n−1); ``level`` the most probable one, ``label`` its label;
    ``probabilities`` maps each level's label to its probability, lowest level first."""

    name: str | None
    score: float
    probabilities: dict[str, float]
    confidence: float
    label_mass: float | None = None

    @property
    def level(self) -> int:
        return probability.argmax(list(self.probabilities.values()))

    @property
    def label(self) -> str:
        return list(self.probabilities)[self.level]

    @property
    def value(self) -> int:
        return self.level


@dataclass(frozen=True)
class Refusal:
    """The model (an upstream provider) did not answer this question."""

    name: str | None
    label_mass: float | None = None

    @property
    def probabilities(self) -> dict[Any, float]:
        return {}

    @property
    def confidence(self) -> float:
        return 0.0

    @property
    def value(self) -> None:
        return None


Answer = Union[PredicateAnswer, ChoiceAnswer, ScoreAnswer, Refusal]


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """The answers to one request, in question order; ``decision["name"]`` or ``decision[0]`` picks one."""

    answers: list[Answer]
    model: str
    usage: Usage = field(default_factory=Usage)
    # Wall time of the call as the caller saw it.
    latency_s: float = 0.0

    def __getitem__(self, key: str | int) -> Answer:
        if isinstance(key, int):
            return self.answers[key]
        for answer in self.answers:
            if answer.name == key:
                return answer
        raise KeyError(key)

    @classmethod
    def from_response(cls, body: Mapping[str, Any], latency_s: float = 0.0) -> "Decision":
        """From a ``POST /v1/decisions`` response body (OpenAI's shape)."""
        usage = body.get("usage") or {}
        return cls([_answer(a) for a in body["answers"]], str(body.get("model", "")), Usage(
            input_tokens=int(usage.get("input_tokens", 0)),
            cached_tokens=int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0)),
            output_tokens=int(usage.get("output_tokens", 0)),
            total_tokens=int(usage.get("total_tokens", 0))), latency_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what ``decisiond batch`` writes per line."""
        out = []
        for a in self.answers:
            row: dict[str, Any] = {"name": a.name, "type": type(a).__name__.removesuffix("Answer").lower(),
                                   "confidence": a.confidence, "label_mass": a.label_mass}
            if isinstance(a, PredicateAnswer):
                row["probability"] = a.probability
            elif isinstance(a, ChoiceAnswer):
                row.update(choice=a.choice, probabilities=[{"value": v, "probability": p}
                                                           for v, p in a.probabilities.items()])
            elif isinstance(a, ScoreAnswer):
                row.update(score=a.score, label=a.label, probabilities=[{"label": k, "probability": p}
                                                                        for k, p in a.probabilities.items()])
            out.append(row)
        return {"model": self.model, "answers": out, "usage": {"input_tokens": self.usage.input_tokens,
                                                               "total_tokens": self.usage.total_tokens},
                "latency_s": round(self.latency_s, 6)}


def _answer(raw: Mapping[str, Any]) -> Answer:
    kind, name, mass = raw.get("type"), raw.get("name"), raw.get("label_mass")
    if kind == "predicate":
        return PredicateAnswer(name, float(raw["probability"]), mass)
    if kind == "choice":
        return ChoiceAnswer(name, raw["choice"], {p["value"]: float(p["probability"]) for p in raw["probabilities"]},
                            float(raw["confidence"]), mass)
    if kind == "score":
        return ScoreAnswer(name, float(raw["score"]), {str(p["label"]): float(p["probability"])
                                                       for p in raw["probabilities"]}, float(raw["confidence"]), mass)
    return Refusal(name, mass)


# ---------------------------------------------------------------------------------- pydantic models


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _field_question(name: str, annotation: Any, description: str | None) -> Predicate | Choice | Score:
    instructions = description or name.replace("_", " ").capitalize() + "?"
    kind = _unwrap_optional(annotation)
    if kind is bool:
        return Predicate(name, instructions)
    if get_origin(kind) is Literal:
        values = get_args(kind)
        if all(isinstance(v, (str, bool)) for v in values):
            return Choice(name, instructions, list(values))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return Score(name, instructions, [str(v) for v in values])
    if inspect.isclass(kind) and issubclass(kind, enum.Enum):
        members = [m.value for m in kind]
        if all(isinstance(v, (str, bool)) for v in members):
            return Choice(name, instructions, members)
    raise TypeError(f"field {name!r} ({annotation!r}) has no question type: use bool (a yes/no question), a "
                    "Literal of strings or an Enum of strings (a choice), or a Literal of ints (a score)")


def questions_from(model: type[BaseModel]) -> list[Predicate | Choice | Score]:
    """One question per field of a pydantic model: ``bool`` → ``Predicate``; ``Literal[str, …]`` or a string
    ``Enum`` → ``Choice``; ``Literal[int, …]`` → ``Score`` (levels in the order written). The field's
    description is the question's instructions (else the field name).

    >>> from typing import Literal
    >>> from pydantic import BaseModel, Field
    >>> class Ticket(BaseModel):
    ...     billing: bool | None = Field(None, description="Is this about billing?")
    ...     team: Literal["billing", "shipping"] | None = None
    >>> [type(q).__name__ for q in questions_from(Ticket)]
    ['Predicate', 'Choice']
    """
    return [_field_question(name, f.annotation, f.description) for name, f in model.model_fields.items()]


def _field_value(annotation: Any, answer: Answer) -> Any:
    if isinstance(answer, ScoreAnswer):
        values = get_args(_unwrap_optional(annotation))
        return values[answer.level]
    return answer.value


# -------------------------------------------------------------------------------------- the deciders


def _body(model: str, input: Any, questions: Iterable[QuestionLike], options: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "input": input, "questions": [_question_dict(q) for q in questions]}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


class _Decider:
    """What ``Engine`` and ``Client`` share: a subclass answers one OpenAI-shaped body (``_call``)."""

    model: str

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    async def adecide(self, input: Any, questions: Iterable[QuestionLike], *, model: str | None = None,
                      **options: Any) -> Decision:
        """Answer ``questions`` about ``input`` (a string, or OpenAI input items). ``options`` are the request's
        other fields: ``temperature``, ``order``, ``calibrate``, ``chat_template_kwargs``…"""
        started = time.perf_counter()
        body = await self._call(_body(model or self.model, input, questions, options))
        return Decision.from_response(body, time.perf_counter() - started)

    def decide(self, input: Any, questions: Iterable[QuestionLike], *, model: str | None = None,
               **options: Any) -> Decision:
        """``adecide`` for code without an event loop (it works inside a notebook's running loop too)."""
        return self._run(self.adecide(input, list(questions), model=model, **options))

    async def adecide_as(self, schema: type[M], input: Any, *, min_confidence: float = 0.0,
                         model: str | None = None, **options: Any) -> M:
        """An instance of the pydantic model ``schema`` (questions from ``questions_from``): each field set to
        its answer, or ``None`` where the answer's confidence is below ``min_confidence`` (declare such fields
        ``X | None``)."""
        decision = await self.adecide(input, questions_from(schema), model=model, **options)
        values = {}
        for name, f in schema.model_fields.items():
            answer = decision[name]
            confident = answer.confidence >= min_confidence and not isinstance(answer, Refusal)
            values[name] = _field_value(f.annotation, answer) if confident else None
        return schema.model_validate(values)

    def decide_as(self, schema: type[M], input: Any, *, min_confidence: float = 0.0, model: str | None = None,
                  **options: Any) -> M:
        return self._run(self.adecide_as(schema, input, min_confidence=min_confidence, model=model, **options))

    async def aiter_many(self, items: Iterable[Any], questions: Iterable[QuestionLike] | None = None, *,
                         concurrency: int = 4, **options: Any) -> AsyncIterator[tuple[int, Decision | DecisionError]]:
        """``(index, Decision or DecisionError)`` as each item is answered (not in order). An item is an input
        (with ``questions``) or a whole request dict with its own ``input`` and ``questions``."""
        fixed = list(questions) if questions is not None else None
        semaphore = asyncio.Semaphore(max(1, concurrency))

        async def one(index: int, item: Any) -> tuple[int, Decision | DecisionError]:
            async with semaphore:
                try:
                    if isinstance(item, Mapping) and "questions" in item:
                        request = dict(item)
                        input_, asked = request.pop("input", None), request.pop("questions")
                        return index, await self.adecide(input_, asked, **{**options, **request})
                    if fixed is None:
                        raise InvalidRequest("no questions: give them with the item or for every item",
                                            ("questions",), code="missing_required_parameter")
                    return index, await self.adecide(item, fixed, **options)
                except DecisionError as error:
                    return index, error
                except (TypeError, ValueError, KeyError) as error:
                    return index, InvalidRequest(f"{type(error).__name__}: {error}")

        tasks = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(items)]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()

    async def adecide_many(self, items: Iterable[Any], questions: Iterable[QuestionLike] | None = None, *,
                           concurrency: int = 4, **options: Any) -> list[Decision | DecisionError]:
        """One ``Decision`` per item, in order; a refused item gives its ``DecisionError`` in its place."""
        items = list(items)
        out: list[Decision | DecisionError] = [DecisionError("not answered")] * len(items)
        async for index, result in self.aiter_many(items, questions, concurrency=concurrency, **options):
            out[index] = result
        return out

    def decide_many(self, items: Iterable[Any], questions: Iterable[QuestionLike] | None = None, *,
                    concurrency: int = 4, **options: Any) -> list[Decision | DecisionError]:
        return self._run(self.adecide_many(list(items), list(questions) if questions is not None else None,
                                           concurrency=concurrency, **options))


class _LoopThread:
    """A private event loop on a daemon thread, so that the sync API works with or without a running loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="decisiond-library", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


class Engine(_Decider):
    """Decision models in this process, behind the same gateway pipeline as the server (limits, model names,
    validation). Build one with ``load()``, or from a ``LocalEngine`` or a configured ``Router``.

    >>> engine = decisiond.load("default")                                   # doctest: +SKIP
    >>> engine.decide("The app crashes on start.", [Predicate("bug", "Is this a bug report?")])["bug"].probability
    0.87
    """

    def __init__(self, source: LocalEngine | Router, model: str = "default"):
        from .gateway.router import Router
        from .gateway.service import Gateway

        self.router = source if isinstance(source, Router) else Router.local_only(source)
        self.gateway: Gateway = Gateway(self.router)
        self.model = model
        self._loop = _LoopThread()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coroutine)

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.gateway.answer_openai(body)

    def models(self) -> list[str]:
        """The names this engine answers to (``default`` too)."""
        return [m.name for m in self.router.model_list("decisions")]

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(model: str = "default", *, dtype: str = "float32", device: str = "auto", served_name: str | None = None,
         order: str = "given", calibrate: str = "none", calibration: str | None = None,
         **scheduling: Any) -> Engine:
    """Load a model into this process: ``"default"`` (the embedded SmolLM2-135M-Instruct), a Hugging Face folder,
    a ``.gguf`` file or a hub id. ``order``/``calibrate`` are the model's quality defaults, ``calibration`` a
    profile written by ``decisiond calibrate``; ``max_batch_tokens``/``max_wait_s`` tune batching.

    >>> engine = decisiond.load("default", order="cyclic")                   # doctest: +SKIP
    """
    from .engine import model as model_mod
    from .engine.calibration import Profile
    from .engine.local import LocalEngine

    loaded = model_mod.load(model, dtype=dtype, device=device, served_name=served_name)
    profile = Profile.load(calibration) if calibration else None
    return Engine(LocalEngine(loaded, order=order, calibrate=calibrate, profile=profile, **scheduling))


class Client(_Decider):
    """A remote decisiond (``POST /v1/decisions``), answering with the same types as ``Engine``.

    >>> client = decisiond.Client("http://127.0.0.1:8000", api_key="sk-…")  # doctest: +SKIP
    >>> client.decide("I was charged twice.", [Predicate("billing", "About billing?")])["billing"].value
    True
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str = "default", timeout: float = 60.0):
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.model = model
        self.timeout = timeout
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[int, httpx.AsyncClient] = {}
        self._loop = _LoopThread()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coroutine)

    def _client(self) -> httpx.AsyncClient:
        key = id(asyncio.get_running_loop())  # an httpx pool belongs to the loop that made it
        if key not in self._clients:
            self._clients[key] = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                                   timeout=self.timeout)
        return self._clients[key]

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._client().post("/v1/decisions", json=body)
        try:
            data: Any = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400 or not isinstance(data, dict):
            error = data.get("error") if isinstance(data, dict) else None
            if not isinstance(error, dict):
                error = {"message": response.text[:500] or f"HTTP {response.status_code}"}
            param = error.get("param")
            raise DecisionError(str(error.get("message")), (param,) if isinstance(param, str) else (),
                                code=str(error.get("code") or "http_error"), status=response.status_code,
                                type=str(error.get("type") or "invalid_request_error"))
        return data

    async def amodels(self) -> list[str]:
        response = await self._client().get("/v1/models")
        response.raise_for_status()
        return [m["id"] for m in response.json()["data"]]

    def models(self) -> list[str]:
        return self._run(self.amodels())

    def close(self) -> None:
        for client in self._clients.values():
            try:
                self._loop.run(client.aclose())
            except RuntimeError:
                pass
        self._clients.clear()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
