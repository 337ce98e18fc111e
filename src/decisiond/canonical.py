"""The canonical decision request and result every other module speaks. No I/O, no wire format.

Dialects (``decisiond.dialects``) translate their wire shapes to and from these types; the engine and the
gateway providers only ever see them. Each object can remember where it came from on the wire
(``source``, a path such as ``("questions", 1, "choices", 3)``) so that a refusal raised deep in the engine
names the field at fault in the caller's own terms. ``source`` takes no part in equality or hashing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from .errors import Path

# A piece of text the prompt renders: a string as is, an object or array as compact JSON.
TextValue = Union[str, dict[str, Any], list[Any]]

QuestionKind = Literal["yes_no", "choice", "score"]


# Field metadata: a mapping whose key order never changes an answer (options, not text the model reads). The key
# order of JSON the model reads (``Json.data``, an object ``TextValue``) is rendered into the prompt, so it counts.
UNORDERED = {"unordered": True}


def _source() -> Any:
    return field(default=(), compare=False, repr=False)


# ---------------------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class Text:
    text: str
    # OpenAI's prompt_cache_breakpoint on an input_text part (kept for forwarding).
    cache_breakpoint: bool = False
    source: Path = _source()


@dataclass(frozen=True)
class Json:
    data: Any
    source: Path = _source()


@dataclass(frozen=True)
class Image:
    """An image: a ``data:`` URL, an http(s) URL, or raw bytes from a System One asset."""

    url: str | None = None
    data: bytes | None = None
    media_type: str | None = None
    detail: str | None = None
    cache_breakpoint: bool = False
    source: Path = _source()


Part = Union[Text, Json, Image]


@dataclass(frozen=True)
class Message:
    """A message of the input. How it was spelled on the wire (a string or a list of parts, OpenAI's ``phase``,
    refusal parts) is the dialect's business: see ``DecisionRequest.wire``."""

    role: Literal["user", "system", "developer", "assistant"]
    parts: tuple[Part, ...]
    source: Path = _source()


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # function call: JSON text; custom tool call: free text input
    custom: bool = False
    id: str | None = None
    namespace: str | None = None
    status: str | None = None
    source: Path = _source()


@dataclass(frozen=True)
class ToolOutput:
    call_id: str
    parts: tuple[Part, ...]
    custom: bool = False
    id: str | None = None
    status: str | None = None
    source: Path = _source()


Item = Union[Message, ToolCall, ToolOutput]


# ------------------------------------------------------------------------------------------ questions


@dataclass(frozen=True)
class Option:
    """One candidate of a choice question. ``value`` keeps its JSON type: ``True`` is not ``"true"``."""

    value: str | bool
    description: TextValue | None = None
    source: Path = _source()

    @property
    def name(self) -> str:
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return self.value


@dataclass(frozen=True)
class Level:
    """One level of a score question, lowest first; its index is its value."""

    label: TextValue
    description: TextValue | None = None
    source: Path = _source()


@dataclass(frozen=True)
class Question:
    kind: QuestionKind
    # The caller's name or id for the question; None when unnamed (OpenAI allows that).
    name: str | None
    # What is asked, as parts; empty when the question has no text of its own.
    instructions: tuple[Part, ...] = ()
    options: tuple[Option, ...] = ()
    levels: tuple[Level, ...] = ()
    yes: TextValue | None = None
    no: TextValue | None = None
    source: Path = _source()

    @property
    def candidates(self) -> int:
        if self.kind == "choice":
            return len(self.options)
        if self.kind == "score":
            return len(self.levels)
        return 2


# ------------------------------------------------------------------------------------------- request


@dataclass(frozen=True)
class DecisionRequest:
    input: tuple[Item, ...]
    questions: tuple[Question, ...]
    model: str | None = None
    # Divides the label log-probs before the softmax over the labels; None means the model's default (1).
    temperature: float | None = None
    # Every field below that can change an answer takes part in equality (and in the response cache's key, see
    # ``cache_key``); dicts are left out of hashing only, since they cannot be hashed.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False, metadata=UNORDERED)
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool = False
    # decisiond's quality extensions: "given" | "cyclic" option order, "none" | "contextual" calibration;
    # None means the model's default.
    order: str | None = None
    calibrate: str | None = None
    # OpenAI's cache and safety fields, kept so a request forwarded upstream loses nothing.
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = field(default=None, hash=False, metadata=UNORDERED)
    safety_identifier: str | None = None
    # Other top-level fields the caller sent, name → JSON value, in the caller's order.
    extra: dict[str, Any] = field(default_factory=dict, hash=False, metadata=UNORDERED)
    # Dialect name → how the request was spelled on that wire (e.g. ``dialects.openai.OpenAIWire``), so that a
    # request forwarded in the wire format it came in keeps its shape. Never changes an answer, so it takes no part
    # in equality or in the cache key: the same decision asked through two dialects is one request.
    wire: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def images(self) -> list[Image]:
        found = [p for item in self.input for p in _parts(item) if isinstance(p, Image)]
        found += [p for q in self.questions for p in q.instructions if isinstance(p, Image)]
        return found


def _parts(item: Item) -> tuple[Part, ...]:
    return item.parts if isinstance(item, (Message, ToolOutput)) else ()


# -------------------------------------------------------------------------------------------- result


@dataclass
class Answer:
    kind: QuestionKind
    name: str | None
    # One probability per candidate in question order (options, levels, or yes then no); sums to 1.
    probabilities: list[float] = field(default_factory=list)
    # Full-vocabulary log-probabilities of the candidates' labels at the answer position.
    label_logprobs: list[float] = field(default_factory=list)
    # Σ exp(label log-prob): how much of the model's next-token mass the labels hold.
    label_mass: float | None = None
    confidence: float | None = None
    prompt_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    label_token_ids: list[int] | None = None
    # The provider did not answer this question.
    refusal: bool = False
    # Extension diagnostics (decisiond-specific), rendered by dialects that carry extensions.
    extensions: dict[str, Any] = field(default_factory=dict)
    # The model's final hidden state at the answer position (a local model's; no dialect renders it): what a learned
    # linear head reads (``gateway.learning``).
    features: list[float] | None = None
    # The learned profile that set ``probabilities`` (``gateway.profiles``), and the probabilities before it.
    profile: str | None = None
    base: list[float] | None = None


@dataclass
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    # A provider's own cost figure (OpenRouter's usage.cost), kept when it reports one.
    cost: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class DecisionResult:
    model: str
    answers: list[Answer]
    usage: Usage = field(default_factory=Usage)
    prompt_format_version: int | None = None
    # Which wire format answered (openai | system_one | local), for the gateway's response header.
    provider_format: str = "local"


# ---------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Candidate:
    """One next-token candidate a served model reported: its log-probability, its text and, where the server says,
    its token id."""

    logprob: float
    text: str | None = None
    id: int | None = None



@dataclass(frozen=True)
class ScoreRequest:
    """Next-token probabilities of given label tokens after given prompts (SGLang's ``/v1/score``)."""

    # Each prompt is text (tokenized by the engine, special tokens added) or token ids, used as they are.
    prompts: tuple[str | tuple[int, ...], ...]
    label_token_ids: tuple[tuple[int, ...], ...]
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    model: str | None = None


@dataclass
class ScoreResult:
    # Per prompt, per label: softmax over the labels of log-prob / T, or the full-vocabulary probability.
    scores: list[list[float]]
    # Per prompt, per label: full-vocabulary log-probabilities.
    token_logprobs: list[list[float]]
    model: str
    prompt_tokens: int
