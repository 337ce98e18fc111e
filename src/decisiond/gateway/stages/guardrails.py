"""Prompt guardrails: named checks over what a request asks about, run before the provider is called.

What a guardrail sees (``texts``): on decision requests the input — string input, text parts, every string inside
JSON data, message text, tool-call arguments and tool outputs — never question instructions; on chat traffic the
prompt messages' text. Types:

- ``regex``: patterns that block, warn or redact;
- ``pii``: e-mail addresses, phone numbers, card numbers (Luhn-checked), IBANs (mod-97-checked) and IP
  addresses, each switchable, redacted to ``[EMAIL]``-style placeholders;
- ``decision_judge``: one yes/no policy question asked of a decision model the gateway serves (the local engine,
  an upstream, a virtual model); blocks when P(yes) ≥ ``threshold``; identical text is judged once per request.

Guardrails of the same ``order`` run concurrently, orders in sequence (a later order sees earlier redactions).
When outcomes conflict, block > redact > warn > allow. A guardrail that fails or runs past ``timeout_ms`` blocks
(``fail_mode: closed``, the default) or is skipped (``open``). Blocked: 400 ``guardrail_blocked`` naming it, and
the provider is not called. Warned: ``x-decisiond-guardrail: warn; name=…``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...canonical import DecisionRequest, Json, Message, Part, Question, ScoreRequest, Text, ToolCall, ToolOutput
from ...errors import GuardrailBlocked, InvalidRequest, ServerError
from ...limits import GUARDRAIL_JUDGE_MAX_CHARS
from ..catalog import Catalog
from ..chat import ChatRequest
from ..guardrail_settings import GuardrailConfig, unknown_guardrail
from ..types import Context, Next

log = logging.getLogger("decisiond.guardrails")

GUARDRAIL_HEADER = "x-decisiond-guardrail"
_RANK = {"allow": 0, "warn": 1, "redact": 2, "block": 3}
# ------------------------------------------------------------------------------------------------ texts


@dataclass(frozen=True)
class Outcome:
    name: str
    action: str  # allow | warn | redact | block
    detail: str = ""
    texts: tuple[str, ...] | None = None  # the redacted texts, for "redact"


Texts = tuple[str, ...]


def _json_strings(data: Any) -> list[str]:
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [s for v in data.values() for s in _json_strings(v)]
    if isinstance(data, list):
        return [s for v in data for s in _json_strings(v)]
    return []


def _json_replace(data: Any, texts: list[str]) -> Any:
    """``data`` with its strings, in walk order, taken from ``texts`` (consumed); keys and other values untouched."""
    if isinstance(data, str):
        return texts.pop(0)
    if isinstance(data, dict):
        return {k: _json_replace(v, texts) for k, v in data.items()}
    if isinstance(data, list):
        return [_json_replace(v, texts) for v in data]
    return data


def _part_texts(part: Part) -> list[str]:
    if isinstance(part, Text):
        return [part.text]
    if isinstance(part, Json):
        return _json_strings(part.data)
    return []


def decision_texts(request: DecisionRequest) -> Texts:
    """What the guardrails of a decision request see, in a fixed order (never question instructions)."""
    out: list[str] = []
    for item in request.input:
        if isinstance(item, (Message, ToolOutput)):
            for part in item.parts:
                out += _part_texts(part)
        elif isinstance(item, ToolCall):
            out.append(item.arguments)
    return tuple(out)


def apply_texts(request: DecisionRequest, texts: Sequence[str]) -> DecisionRequest:
    """``request`` with its guarded texts replaced; an untouched part is the same object (its JSON unchanged)."""
    queue = list(texts)
    original = decision_texts(request)
    if tuple(queue) == original:
        return request

    def part(p: Part) -> Part:
        if isinstance(p, Text):
            new = queue.pop(0)
            return p if new == p.text else replace(p, text=new)
        if isinstance(p, Json):
            count = len(_json_strings(p.data))
            taken, queue[:count] = queue[:count], []
            return p if taken == _json_strings(p.data) else replace(p, data=_json_replace(p.data, list(taken)))
        return p

    items: list[Any] = []
    for item in request.input:
        if isinstance(item, (Message, ToolOutput)):
            items.append(replace(item, parts=tuple(part(p) for p in item.parts)))
        elif isinstance(item, ToolCall):
            items.append(replace(item, arguments=queue.pop(0)))
        else:
            items.append(item)
    return replace(request, input=tuple(items))


# ------------------------------------------------------------------------------------------------ checks

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
PHONE = re.compile(r"(?<![\w+])\+?\d[\d ().-]{7,}\d(?!\w)")
CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{2}-\d{2}-\d{4}")
IP = re.compile(r"(?<![\w.:])(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w.:])")


def luhn(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def iban_valid(text: str) -> bool:
    s = text.replace(" ", "")
    moved = s[4:] + s[:4]
    return 15 <= len(s) <= 34 and int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _ip_valid(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


# detector → (pattern, validity check, placeholder). Cards before phones: a card number also looks like a phone.
DETECTORS: dict[str, tuple[re.Pattern[str], Callable[[str], bool], str]] = {
    "email": (EMAIL, lambda m: True, "[EMAIL]"),
    "iban": (IBAN, iban_valid, "[IBAN]"),
    "card": (CARD, lambda m: luhn(re.sub(r"\D", "", m)), "[CARD]"),
    "ip": (IP, _ip_valid, "[IP]"),
    "phone": (PHONE, lambda m: 8 <= len(re.sub(r"\D", "", m)) <= 15 and not DATE.fullmatch(m), "[PHONE]"),
}


def _pii(config: GuardrailConfig, texts: Texts) -> Outcome:
    found: list[str] = []
    out = []
    for text in texts:
        for name in DETECTORS:
            if name not in config.detectors:
                continue
            pattern, valid, placeholder = DETECTORS[name]

            def sub(m: re.Match[str], valid: Callable[[str], bool] = valid, placeholder: str = placeholder,
                    name: str = name) -> str:
                if not valid(m.group(0)):
                    return m.group(0)
                found.append(name)
                return placeholder

            text = pattern.sub(sub, text)
        out.append(text)
    if not found:
        return Outcome(config.name, "allow")
    kinds = ", ".join(sorted(set(found)))
    if config.action == "redact":
        return Outcome(config.name, "redact", f"redacted {kinds}", tuple(out))
    return Outcome(config.name, config.action, f"found {kinds}")


def _regex(config: GuardrailConfig, texts: Texts) -> Outcome:
    worst, hits, out = "allow", [], list(texts)
    for p in config.patterns:
        action = p.action or config.action
        compiled = re.compile(p.pattern)
        if not any(compiled.search(t) for t in out):
            continue
        hits.append(p.pattern)
        if action == "redact":
            out = [compiled.sub(p.replacement, t) for t in out]
        if _RANK[action] > _RANK[worst]:
            worst = action
    if worst == "allow":
        return Outcome(config.name, "allow")
    return Outcome(config.name, worst, f"matched {hits[0]!r}", tuple(out) if worst == "redact" else None)


# A judge asks a decision model one question about one text, on behalf of the request ``request_id`` (the gateway
# records each call's usage under the guardrail's own user path); ``Judge`` is how the gateway lets it (the router).
Judge = Callable[[GuardrailConfig, str, str], Awaitable[float]]


def judged_document(texts: Texts) -> str:
    """What a judge reads: the request's texts joined into one document (identical texts once), so that an
    injection split across parts is judged whole, with one call whatever the number of parts."""
    return "\n\n".join(dict.fromkeys(t for t in texts if t.strip()))


async def _decision_judge(config: GuardrailConfig, texts: Texts, judge: Judge, request_id: str) -> Outcome:
    document = judged_document(texts)
    if not document:
        return Outcome(config.name, "allow", "nothing to judge")
    if len(document) > GUARDRAIL_JUDGE_MAX_CHARS:  # never judged in part: the guardrail fails (fail_mode decides)
        raise ValueError(f"the request's text is {len(document):,} characters, over the {GUARDRAIL_JUDGE_MAX_CHARS:,} "
                         "a judge reads")
    score = await judge(config, document, request_id)
    if score >= config.threshold:
        return Outcome(config.name, config.action, f"P(yes) = {score:.3f} ≥ {config.threshold:g}")
    return Outcome(config.name, "allow", f"P(yes) = {score:.3f}")


def judge_question(config: GuardrailConfig) -> Question:
    return Question("yes_no", "policy", (Text(config.instructions or ""),), yes=config.yes, no=config.no)


# ------------------------------------------------------------------------------------------------ running


@dataclass
class GuardrailSet:
    """The configured guardrails and which apply to a model or a key."""

    guardrails: dict[str, GuardrailConfig]
    judge: Judge | None = None
    by_model: dict[str, list[str]] = field(default_factory=dict)

    def for_request(self, models: Sequence[str], key_guardrails: Sequence[str] = ()) -> list[GuardrailConfig]:
        """The guardrails of every model whose policy applies (the resolved model and, for a virtual model, each
        entry it may route to: ``Catalog.policy_names``), then the key's. A managed key may name a guardrail since
        removed from the config: its requests are refused rather than sent on unguarded."""
        missing = unknown_guardrail(key_guardrails, self.guardrails)
        if missing is not None:
            log.error("a key names a guardrail that is not configured; its requests are refused",
                      extra={"guardrail": missing})
            raise ServerError(f"this API key is guarded by {missing!r}, which is not configured on this server; "
                              "the request is refused rather than sent unguarded", code="guardrail_not_configured")
        names = list(dict.fromkeys([*(n for m in models for n in self.by_model.get(m, [])), *key_guardrails]))
        return [self.guardrails[n] for n in names]

    def check_names(self, names: Sequence[str], param: str = "guardrails") -> None:
        """400 naming the first of ``names`` that is not configured (a managed key's guardrails, at creation)."""
        missing = unknown_guardrail(names, self.guardrails)
        if missing is not None:
            configured = ", ".join(repr(n) for n in self.guardrails) or "none"
            raise InvalidRequest(f"unknown guardrail {missing[:100]!r}; configured guardrails: {configured}",
                                (param, list(names).index(missing)), code="invalid_value")

    async def run(self, configs: list[GuardrailConfig], texts: Texts,
                  request_id: str = "") -> tuple[Texts, list[Outcome]]:
        """Orders in sequence, each order's guardrails concurrently; a block stops the run. ``request_id``: the
        request being guarded, named in the usage records of its judges' calls."""
        outcomes: list[Outcome] = []
        for order in sorted({c.order for c in configs}):
            batch = [c for c in configs if c.order == order]
            results = await asyncio.gather(*(self._one(c, texts, request_id) for c in batch))
            outcomes += results
            if any(o.action == "block" for o in results):
                return texts, outcomes
            # Redactions of one order compose in config order: the first as computed, later ones (regex and pii
            # redactors are pure and cheap) again over what the earlier ones left.
            redactors = [(c, o) for c, o in zip(batch, results) if o.action == "redact" and o.texts is not None]
            for i, (config, outcome) in enumerate(redactors):
                redone = outcome if i == 0 else await self._check(config, texts, request_id)
                texts = redone.texts if redone.texts is not None else texts
        return texts, outcomes

    async def _one(self, config: GuardrailConfig, texts: Texts, request_id: str) -> Outcome:
        try:
            return await asyncio.wait_for(self._check(config, texts, request_id), config.timeout_ms / 1000)
        except Exception as error:  # a timeout, a judge that is down, a bad answer
            reason = "timed out" if isinstance(error, asyncio.TimeoutError) else f"failed: {error}"
            log.warning("guardrail did not finish", extra={"guardrail": config.name, "reason": reason[:300],
                                                           "fail_mode": config.fail_mode})
            if config.fail_mode == "open":
                return Outcome(config.name, "allow", f"{reason} (fail open)")
            return Outcome(config.name, "block", f"{reason} (fail closed)")

    async def _check(self, config: GuardrailConfig, texts: Texts, request_id: str) -> Outcome:
        if config.type == "regex":
            return _regex(config, texts)
        if config.type == "pii":
            return _pii(config, texts)
        if self.judge is None:
            raise RuntimeError("no decision model is wired to judge")
        return await _decision_judge(config, texts, self.judge, request_id)


def verdict(outcomes: list[Outcome], headers: dict[str, str], context_outcomes: dict[str, str]) -> None:
    """Record every outcome; warn in a header; raise for the first block."""
    for o in outcomes:
        context_outcomes[f"guardrail:{o.name}"] = o.action + (f" ({o.detail})" if o.detail else "")
    warned = [o.name for o in outcomes if o.action == "warn"]
    if warned:
        headers[GUARDRAIL_HEADER] = "warn; " + "; ".join(f"name={n}" for n in warned)
    blocked = next((o for o in outcomes if o.action == "block"), None)
    if blocked is not None:
        raise GuardrailBlocked(f"guardrail {blocked.name!r} blocked this request: {blocked.detail}")


def score_texts(request: ScoreRequest, detokenize: Callable[[tuple[int, ...]], str]) -> Texts:
    """What the guardrails of a ``/v1/score`` request see: each prompt, token-id prompts decoded."""
    return tuple(p if isinstance(p, str) else detokenize(p) for p in request.prompts)


class GuardrailStage:
    """Stage: the guardrails of every model whose policy applies to the request (``Catalog.policy_names``) and of
    the caller's key, on every operation: decisions, ``/v1/score`` prompts and chat traffic."""

    name = "guardrails"

    def __init__(self, guardrails: GuardrailSet, catalog: Catalog):
        self.guardrails = guardrails
        self.catalog = catalog

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        models = self.catalog.policy_names(context.resolved_model) if context.resolved_model else ()
        configs = self.guardrails.for_request(models, context.caller.guardrails)
        if not configs:
            return await call_next(context, request)
        if isinstance(request, ChatRequest):  # the prompt messages' text, redactions written back into the body
            texts, outcomes = await self.guardrails.run(configs, request.texts(), context.request_id)
            verdict(outcomes, context.response_headers, context.outcomes)
            request.apply(texts)
            return await call_next(context, request)
        if isinstance(request, ScoreRequest):
            return await call_next(context, await self._score(context, request, configs))
        texts, outcomes = await self.guardrails.run(configs, decision_texts(request), context.request_id)
        verdict(outcomes, context.response_headers, context.outcomes)
        return await call_next(context, apply_texts(request, texts))

    async def _score(self, context: Context, request: ScoreRequest, configs: list[GuardrailConfig]) -> ScoreRequest:
        target = self.catalog.known_target(context.resolved_model or "")
        detokenize = target.provider.detokenize if target is not None else _no_tokenizer
        original = score_texts(request, detokenize)
        texts, outcomes = await self.guardrails.run(configs, original, context.request_id)
        redacted_ids = [i for i, (p, a, b) in enumerate(zip(request.prompts, original, texts))
                        if not isinstance(p, str) and a != b]
        if redacted_ids:
            outcomes.append(Outcome("guardrails", "block", f"a redaction touches the token-id prompt "
                                    f"items[{redacted_ids[0]}], which cannot be redacted in place"))
        verdict(outcomes, context.response_headers, context.outcomes)
        prompts = tuple(t if isinstance(p, str) else p for p, t in zip(request.prompts, texts))
        return replace(request, prompts=prompts)


def _no_tokenizer(ids: tuple[int, ...]) -> str:
    raise ValueError("token-id prompts cannot be guarded: this model has no tokenizer here")
