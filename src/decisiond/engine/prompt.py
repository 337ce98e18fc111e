"""Prompt wording (version 1), answer labels, chat templating and the one-token label checks.

The wording is SGLang's ``/v1/decisions`` prompt format version 1: the input, a blank line, the question
line, one line per option / level / described yes or no answer, and a closing instruction to answer with
one label only. A change of wording is a new ``PROMPT_FORMAT_VERSION``.

Special-token text in the user's content (``<|im_end|>\n<|im_start|>assistant\nA``) is tokenized as text, never
as the control tokens it spells: only the chat template's own text may hold control tokens (``tokenize``). This
is the one place where decisiond differs from SGLang, which tokenizes the rendered chat text whole, so that such
content there closes the user turn and can answer for the model.
"""

from __future__ import annotations

import json
import os
import string
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..canonical import Image, Option, Question
from ..errors import DecisionError, invalid, refused
from ..limits import REQUEST_TEMPLATE_MAX_CHARS
from ..text import is_blank, question_text, render_text
from .prefix_cache import Lru
from .prompt_ids import PromptIds
from .sandbox import run_isolated

PROMPT_FORMAT_VERSION = 1

# Chat template kwargs that switch a model's reasoning on; decisions keep them off.
THINKING_TOGGLES = ("enable_thinking", "thinking")
# Reasoning block markers that templates and tokenizers use.
REASONING_MARKERS = (("<think>", "</think>"), ("<thinking>", "</thinking>"),
                     ("<|begin_of_thought|>", "<|end_of_thought|>"))
# Answer text of a finished reply, rendered only to see what a template puts before an answer.
_REPLY_SENTINEL = "DECISION_ANSWER_SENTINEL"
# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them (``chat_template``, which
# replaces the model's template, only when the server allows request templates).
APPLY_PARAMETERS = ("chat_template", "conversation", "messages", "add_generation_prompt", "continue_final_message",
                    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                    "return_assistant_tokens_mask", "tokenizer_kwargs")
# Distinct chat_template_kwargs whose template checks are remembered (clients choose them: the caches are bounded).
TEMPLATE_KWARGS_ENTRIES = 256

MAX_SINGLE_LETTER = len(string.ascii_uppercase)
MAX_CHOICE_LABELS = MAX_SINGLE_LETTER * MAX_SINGLE_LETTER
MAX_SCORE_LEVELS = len(string.digits)


# ------------------------------------------------------------------------------------------ wording


TWO_LETTER_LABELS = [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]


def labels_for(question: Question) -> list[str]:
    """One label per candidate: ``A``–``Z`` (``AA``, ``AB``… above 26 options), ``0``–``9``, ``yes``/``no``.

    Above 26 options the engine keeps only the two-letter labels that are one token for the served tokenizer
    (``ChatPrompter.one_token_labels``); this is the sequence it starts from.
    """
    n = question.candidates
    if question.kind == "choice":
        if n <= MAX_SINGLE_LETTER:
            return list(string.ascii_uppercase[:n])
        return TWO_LETTER_LABELS[:n]
    if question.kind == "score":
        return list(string.digits[:n])
    return ["yes", "no"]


def render_question(input_text: str, question: Question, labels: Sequence[str]) -> str:
    """The user message for one question, in the wording of ``PROMPT_FORMAT_VERSION``."""
    text = question_text(question)
    if question.kind == "choice":
        lines = [f"Question: {text}"] if text else []
        for label, option in zip(labels, question.options):
            detail = render_text(option.description)
            lines.append(f"{label}: {option.name} - {detail}" if detail else f"{label}: {option.name}")
        lines.append("Answer with the letter of one option only.")
    elif question.kind == "score":
        lines = [f"Question: {text}"] if text else []
        for label, level in zip(labels, question.levels):
            detail = render_text(level.description)
            rendered = render_text(level.label)
            lines.append(f"{label}: {rendered} - {detail}" if detail else f"{label}: {rendered}")
        lines.append("Answer with the number of one level only.")
    else:
        lines = [f"Is the following true? {text}" if text else "Is the following true?"]
        for label, description in zip(labels, (question.yes, question.no)):
            detail = render_text(description)
            if detail:
                lines.append(f"{label}: {detail}")
        lines.append("Answer with yes or no only.")
    return "\n".join([input_text, "", *lines])


def check_renderable(question: Question) -> None:
    """Refuse questions whose rendered lines would be ambiguous or whose labels run out."""
    if question.kind == "choice":
        if len(question.options) > MAX_CHOICE_LABELS:
            raise refused(
                f"a choice takes at most {MAX_CHOICE_LABELS} options here, got {len(question.options)}",
                *question.options[MAX_CHOICE_LABELS].source,
                code="limit_exceeded",
            )
        seen: dict[str, Option] = {}
        for option in question.options:
            name = option.name
            key = name.strip().casefold()
            if not key:
                raise invalid("option names must not be blank", *option.source)
            if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in name):
                raise invalid(f"option name {name!r} must not contain control or line break characters", *option.source)
            if key in seen:
                if type(seen[key].value) is not type(option.value):
                    raise invalid(f"the boolean and the string choice {name!r} render as the same option line, "
                                  "so the model cannot tell them apart", *option.source)
                raise invalid(f"option name {name!r} repeats another option", *option.source)
            seen[key] = option
    elif question.kind == "score":
        if len(question.levels) > MAX_SCORE_LEVELS:
            raise refused(
                f"a score takes at most {MAX_SCORE_LEVELS} levels (labels 0 to 9), got {len(question.levels)}",
                *question.levels[MAX_SCORE_LEVELS].source,
                code="limit_exceeded",
            )
        for level in question.levels:
            if is_blank(level.label):
                raise invalid("levels must not be blank", *level.source)


# ------------------------------------------------------------------------------------ chat template


@dataclass
class EncodedPrompt:
    text: str  # the rendered prompt (the chat template applied)
    ids: list[int]
    label_ids: list[int]
    content: str = ""  # the user message it renders (what a chat server is sent)


def check_template_kwargs(request_kwargs: dict[str, Any], source: tuple[str | int, ...],
                          allow_templates: bool = False) -> None:
    """Refuse a request's chat_template_kwargs that turn thinking on or set one of ``apply_chat_template``'s own
    parameters; a ``chat_template`` of its own is taken only when the server allows request templates (it is then
    rendered under limits: ``sandbox``)."""
    for name in APPLY_PARAMETERS:
        if name not in request_kwargs:
            continue
        if name != "chat_template":
            raise refused(f"chat_template_kwargs may not set {name!r}: it is a parameter of the templating "
                          "call, not a template variable", *source, name)
        if not allow_templates:
            raise refused("chat_template_kwargs.chat_template would replace the model's chat template; this "
                          "server does not run templates sent in requests (start it with "
                          "--allow-request-templates to allow them)", *source, name)
        template = request_kwargs[name]
        if not isinstance(template, str) or len(template) > REQUEST_TEMPLATE_MAX_CHARS:
            raise invalid(f"chat_template must be a string of at most {REQUEST_TEMPLATE_MAX_CHARS:,} characters",
                          *source, name)
    for name in THINKING_TOGGLES:
        if name in request_kwargs and request_kwargs[name] is not False:
            raise refused(
                f"chat_template_kwargs sets {name!r} to {request_kwargs[name]!r}, but decisions need it false or "
                "unset",
                *source,
                name,
            )


class ChatPrompter:
    """Renders one user message through the tokenizer's Jinja chat template, thinking off, and finds the
    token id each answer label adds at the answer position."""

    def __init__(self, tokenizer: Any, context_length: int, allow_templates: bool = False):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.allow_templates = allow_templates
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self.template: str | None = template
        self.toggle = self._find_toggle(template)
        vocab_added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self.added_tokens: dict[int, str] = {i: t for t, i in vocab_added.items()}
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_texts = tuple(t.content for t in decoder.values() if getattr(t, "special", False)) or \
            tuple(getattr(tokenizer, "all_special_tokens", ()))
        source = (template or "") + " " + " ".join(vocab_added)
        self.markers = next(((a, b) for a, b in REASONING_MARKERS if a in source and b in source), None)
        self._reply_checked: Lru[bool] = Lru(TEMPLATE_KWARGS_ENTRIES)
        self._headers: Lru[tuple[int, ...]] = Lru(TEMPLATE_KWARGS_ENTRIES)
        self.lossy = self._lossy()
        self.prompt_ids = PromptIds(tokenizer)  # prompts that begin like a recent one: tokenized from where they differ

    def _lossy(self) -> bool:
        """Whether the tokenizer fails to encode rendered chat text back to the same text: labels are placed on the
        text, so such a tokenizer cannot be trusted with them (checked once, on a probe prompt)."""
        if self.template is None:
            return False
        probe = 'Probe {"a":[1,2]} ünïcode\n\nQuestion: Which?\nA: one - first\nB: two\nAnswer with the letter.'
        kwargs = {self.toggle: False} if self.toggle else {}
        try:
            text = self._apply([{"role": "user", "content": probe}], kwargs, True)
        except DecisionError:
            return False  # a template that refuses the probe is reported per request instead
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return bool(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != text)

    @staticmethod
    def _find_toggle(template: str | None) -> str | None:
        if not template:
            return None
        try:
            import jinja2
            from jinja2 import meta

            names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
        except Exception:  # a template jinja cannot parse fails later, at render time, with a clear error
            names = {n for n in THINKING_TOGGLES if n in template}
        return next((n for n in THINKING_TOGGLES if n in names), None)

    def template_kwargs(self, request_kwargs: dict[str, Any],
                        source: tuple[str | int, ...] = ("chat_template_kwargs",)) -> dict[str, Any]:
        """Thinking off, then the request's kwargs (``check_template_kwargs``)."""
        check_template_kwargs(request_kwargs, source, self.allow_templates)
        kwargs: dict[str, Any] = {}
        if self.toggle is not None:
            kwargs[self.toggle] = False
        kwargs.update(request_kwargs)
        return kwargs

    def header_ids(self, kwargs: dict[str, Any]) -> tuple[int, ...]:
        """The tokens every rendered prompt starts with (system prompt, user turn opening) — what the scheduler
        may serve from its prefix cache. The last token of the shared text is left out: it could merge with the
        content that follows."""
        def make() -> tuple[int, ...]:
            try:
                a, b = (self._apply([{"role": "user", "content": c}], kwargs, True) for c in ("A", "B"))
            except DecisionError as error:
                if error.code in ("template_limit", "server_overloaded"):  # the request's, not the template's
                    raise
                a = b = ""
            shared = os.path.commonprefix([a, b])
            return tuple(self.tokenizer.encode(shared, add_special_tokens=False)[:-1]) if shared else ()

        return self._headers.get_or_make(json.dumps(kwargs, sort_keys=True, default=str), make)

    def _apply(self, messages: list[dict[str, str]], kwargs: dict[str, Any], generation: bool) -> str:
        if "chat_template" in kwargs:  # the request's own template (allowed by the server): bounded, in a child
            def render() -> str:
                text: str = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation, **kwargs)
                return text

            return run_isolated(render, "the request's chat template")
        if self.template is None:
            raise refused("the model has no chat template, which decisions need", code="unsupported_model")
        try:
            rendered: str = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, **kwargs
            )
            return rendered
        except Exception as e:  # jinja2 TemplateError, raise_exception() in templates, bad kwargs
            raise refused(f"the chat template failed: {e}", code="chat_template_error") from e

    def render(self, content: str, kwargs: dict[str, Any]) -> str:
        if self.lossy:
            raise refused("this model's tokenizer does not encode the rendered chat text back to the same text, so "
                          "answer labels cannot be placed reliably; this model is not supported",
                          code="unsupported_model")
        prompt = self._apply([{"role": "user", "content": content}], kwargs, True)
        if self.markers is not None:
            self._check_reasoning(content, prompt, kwargs)
        return prompt

    def _check_reasoning(self, content: str, prompt: str, kwargs: dict[str, Any]) -> None:
        if self.markers is None:  # render() checks reasoning only for templates with markers
            return
        start, end = self.markers
        closing = content.rsplit("\n", 1)[-1]
        cut = prompt.rfind(closing)
        generation = prompt if cut < 0 else prompt[cut + len(closing):]
        opened, closed = generation.rfind(start), generation.rfind(end)
        if opened > closed:
            raise refused(
                "the chat template leaves a reasoning block open at the answer position, so the answer would be "
                "read inside the reasoning; this model is not supported with these chat_template_kwargs",
                code="unsupported_model",
            )
        def make() -> bool:
            try:
                reply = self._apply(
                    [{"role": "user", "content": closing}, {"role": "assistant", "content": _REPLY_SENTINEL}], kwargs,
                    False,
                )
            except DecisionError:
                reply = ""
            begin = reply.rfind(closing)
            answer = reply.find(_REPLY_SENTINEL, begin) if begin >= 0 else -1
            return answer >= 0 and reply[begin:answer].count(start) > generation.count(start)

        if self._reply_checked.get_or_make(json.dumps(kwargs, sort_keys=True, default=str), make):
            raise refused(
                "the chat template starts every answer with a reasoning block, so this model is not supported",
                code="unsupported_model",
            )

    def tokenize(self, prompt: str, content: str) -> list[int]:
        """The ids of a rendered prompt, with the user's ``content`` tokenized as text: special-token text in it
        (``<|im_start|>``…) stays text, so a request cannot forge a turn or an answer. Content without such text
        is tokenized with the prompt, as one text (``PromptIds``: from where it differs from a recent long prompt)."""
        if not any(special in content for special in self.special_texts):
            return self.prompt_ids.encode(prompt)
        at = prompt.rfind(content)
        if at < 0:
            raise refused("the input contains special-token text and this model's chat template changes the message "
                          "text, so it cannot be tokenized as text safely", code="unsupported_input")
        pieces = (prompt[:at], content, prompt[at + len(content):])
        ids: list[int] = []
        for piece, as_text in zip(pieces, (False, True, False)):
            if piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=as_text)
        return ids

    def encode(self, content: str, labels: Sequence[str], kwargs: dict[str, Any],
               source: tuple[str | int, ...] = ()) -> EncodedPrompt:
        prompt = self.render(content, kwargs)
        ids = self.tokenize(prompt, content)
        if len(ids) >= self.context_length:
            raise refused(
                f"the prompt has {len(ids)} tokens, which does not fit the context length of "
                f"{self.context_length} tokens",
                *source,
                code="context_length_exceeded",
            )
        return EncodedPrompt(prompt, ids, self.label_ids(prompt, ids, labels, source), content)

    def _label_context(self, prompt: str, ids: list[int]) -> tuple[str, list[int]]:
        """Text and ids after which labels are checked.

        Added tokens are split off before tokenization, so the text after the last one tokenizes on its own
        and the check does not grow with the input. Falls back to the whole prompt when that does not hold.
        """
        for pos in range(len(ids) - 1, -1, -1):
            token = self.added_tokens.get(ids[pos])
            if token is None:
                continue
            at = prompt.rfind(token)
            if at >= 0:
                suffix = prompt[at + len(token):]
                if list(self.tokenizer.encode(suffix, add_special_tokens=False)) == ids[pos + 1:]:
                    return suffix, ids[pos + 1:]
            break
        return prompt, ids

    def _label_token(self, text: str, text_ids: list[int], label: str) -> int | None:
        """The token ``label`` adds after ``text``, or None when it is not exactly one."""
        extended = list(self.tokenizer.encode(text + label, add_special_tokens=False))
        return extended[-1] if len(extended) == len(text_ids) + 1 and extended[:-1] == text_ids else None

    def one_token_labels(self, content: str, n: int, kwargs: dict[str, Any], question: Question) -> list[str]:
        """The first ``n`` two-letter labels (``AA``, ``AB``, …) that are one distinct token at the answer position.

        Two-letter labels include word pieces that a tokenizer may split (SmolLM2 splits ``AJ``), so those are
        skipped; a choice that needs more labels than the tokenizer offers is refused, naming the first option
        left without one.
        """
        prompt = self.render(content, kwargs)
        text, text_ids = self._label_context(prompt, self.tokenize(prompt, content))
        chosen: list[str] = []
        tokens: set[int] = set()
        for label in TWO_LETTER_LABELS:
            token = self._label_token(text, text_ids, label)
            if token is not None and token not in tokens:
                chosen.append(label)
                tokens.add(token)
                if len(chosen) == n:
                    return chosen
        raise refused(
            f"this model's tokenizer has {len(chosen)} two-letter labels that are one token at the answer position, "
            f"so a choice here takes at most {max(len(chosen), MAX_SINGLE_LETTER)} options; this one has {n}",
            *question.options[max(len(chosen), MAX_SINGLE_LETTER)].source,
            code="limit_exceeded",
        )

    def label_ids(self, prompt: str, ids: list[int], labels: Sequence[str],
                  source: tuple[str | int, ...] = ()) -> list[int]:
        """Each label must add exactly one token, distinct from the others', right after the prompt."""
        text, text_ids = self._label_context(prompt, ids)
        found: list[int] = []
        for label in labels:
            token = self._label_token(text, text_ids, label)
            if token is None or token in found:
                raise refused(
                    f"the answer label {label!r} is not one distinct token at the answer position for this "
                    "model's tokenizer, so this question cannot be answered by it",
                    *source,
                    code="unsupported_label",
                )
            found.append(token)
        return found


def text_only_check(images: Sequence[Image], model: str) -> None:
    if images:
        raise refused(
            f"model {model!r} reads text only, so input_image parts are not supported",
            *images[0].source,
            code="unsupported_input",
        )
