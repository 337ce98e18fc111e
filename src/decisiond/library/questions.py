"""The library's typed questions (``Predicate``, ``Choice``, ``Score``, or an OpenAI-shaped dict) and pydantic
models as question sets: a model's fields become questions, and a decision's answers fill an instance of it."""

from __future__ import annotations

import enum
import inspect
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

from .answers import Decision, Refusal, ScoreAnswer

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .answers import Answer


M = TypeVar("M", bound="BaseModel")


def _described(items: Sequence[Any] | Mapping[Any, str | None], key: str) -> list[dict[str, Any]]:
    pairs = items.items() if isinstance(items, Mapping) else ((item, None) for item in items)
    return [{key: value, **({"description": text} if text is not None else {})} for value, text in pairs]


@dataclass(frozen=True)
class Predicate:
    """A yes/no question; its answer is ``PredicateAnswer.probability`` = P(yes).

    Examples:
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

    Examples:
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

    Examples:
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


def question_dict(question: QuestionLike) -> dict[str, Any]:
    """A question in the OpenAI wire shape of ``/v1/decisions``."""
    if isinstance(question, (Predicate, Choice, Score)):
        return question.to_dict()
    if isinstance(question, Mapping):
        return dict(question)
    raise TypeError(f"a question is a Predicate, Choice, Score or an OpenAI-shaped dict, not {type(question).__name__}")


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

    Examples:
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


def filled(schema: type[M], decision: Decision, min_confidence: float) -> M:
    """An instance of ``schema`` from the answers to its ``questions_from``: each field set to its answer, or
    ``None`` where the answer is a refusal or its confidence is below ``min_confidence``."""
    values = {}
    for name, f in schema.model_fields.items():
        answer = decision[name]
        confident = answer.confidence >= min_confidence and not isinstance(answer, Refusal)
        values[name] = _field_value(f.annotation, answer) if confident else None
    return schema.model_validate(values)
