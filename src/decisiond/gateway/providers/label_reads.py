"""The reads of one prompt's label log-probabilities from a served model (``logprobs.LogprobsProvider``), in order:

1. the first read: the top ``k`` and, where the server reads given token ids (vLLM's ``logprob_token_ids``), every
   label by its id, exactly, in this one request. A server whose refusal names one of the fields decisiond sent for
   its kind (``served_servers.Server.fields``) is asked again without them, and is not sent them again for a while;
2. where a label is still missing, a read restricted to the labels (``logit_bias``, ``allowed_token_ids``), not
   where the server proved to report log-probabilities before it restricts the answer;
3. a plain read of the top ``widen_to``, never more than the server gives: a server's refusal that names its maximum
   (vLLM's "max allowed: 20") is asked once more at that maximum, which is remembered.

A label no read holds is a provider failure (502) naming the option, why, and the server option that would fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...canonical import Image, Usage
from ...dialects import completions as wire
from ...dialects import served_servers as servers
from ...engine import served
from ...engine.decider import Scoring
from ...errors import ProviderError
from . import served_facts as facts

if TYPE_CHECKING:
    from .logprobs import LogprobsProvider

# The prompt's last tokens a label's text is decoded after (enough for any tokenizer's merges at a boundary).
CONTEXT_TOKENS = 4


class Refusal(ProviderError):
    """A server's refusal (a 4xx) of a request decisiond checked: a provider failure (502, failover), never the
    caller's 400; ``reason``: the server's own message."""

    code = "upstream_refused"

    def __init__(self, provider: str, status: int, reason: str):
        super().__init__(f"provider {provider!r} refused the request (HTTP {status}): {reason}", failover=True,
                         provider=provider)
        self.reason = reason


@dataclass
class Read:
    """The label log-probabilities of one prompt; ``exact``: full-vocabulary values (else shifted by a constant)."""

    logprobs: list[float]
    exact: bool
    usage: Usage


def in_context(tokenizer: Any, prompt: list[int], token: int) -> str:
    """The text ``token`` adds after ``prompt``: what servers that print tokens in context show (vLLM 0.32 and
    llama.cpp print SentencePiece's ``▁A`` as `` A``, where a lone ``decode`` gives ``A``, the text of another
    token)."""
    tail = list(prompt[-CONTEXT_TOKENS:])
    before = str(tokenizer.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    after = str(tokenizer.decode([*tail, token], skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return after[len(before):] if after.startswith(before) else str(tokenizer.decode([token]))


def added(a: Usage, b: Usage) -> Usage:
    return Usage(input_tokens=a.input_tokens + b.input_tokens, cached_tokens=a.cached_tokens + b.cached_tokens,
                 output_tokens=a.output_tokens + b.output_tokens)


class LabelReads:
    """The reads of one prompt (see the module docstring)."""

    def __init__(self, provider: LogprobsProvider, scoring: Scoring, upstream: str, images: list[Image],
                 kwargs: dict[str, Any], server: servers.Server):
        self.provider, self.scoring, self.upstream, self.images = provider, scoring, upstream, images
        self.kwargs, self.server = kwargs, server
        self.options = provider.options
        self.facts = provider.facts
        self.tokens = provider.label_tokens(scoring)
        self.found: list[float | None] = []

    async def _ask(self, restrict: dict[str, Any], k: int, what: str,
                   extra: dict[str, Any] | None = None) -> tuple[list[float | None], Usage]:
        fields = extra if extra is not None else self._fields(False)
        reply = await self.provider.send(self.scoring, self.upstream, self.images, self.kwargs, restrict, k, fields)
        return served.read_labels(reply.candidates, self.tokens), reply.usage

    def _fields(self, ids: bool) -> dict[str, Any]:
        if self.facts.get(facts.PLAIN_ONLY):
            return {}
        return self.server.fields(self.provider.chat, self.scoring.prompt.label_ids if ids else [], self.kwargs)

    async def first(self) -> tuple[list[float | None], Usage]:
        """The first read: the top ``k`` and, where the server reads them, the labels by their ids (on SGLang, its
        native route)."""
        ids = self.scoring.prompt.label_ids
        if self.server.generate_route and not self.provider.chat and ids and \
                not self.facts.get(facts.NO_GENERATE_ROUTE):
            try:
                reply = await self.provider.send_generate(self.scoring, self.options.top_logprobs, self.server.exact)
            except Refusal:  # the route is not there (a proxy in front of /v1 only): its OpenAI route, for a while
                self.facts.learn(facts.NO_GENERATE_ROUTE, True)
            else:
                self.found = served.read_labels(reply.candidates, self.tokens)
                return self.found, reply.usage
        extra = self._fields(True)
        try:
            self.found, usage = await self._ask({}, self.options.top_logprobs, "", extra)
        except Refusal as refusal:
            if not any(name in refusal.reason for name in extra):
                raise
            self.facts.learn(facts.PLAIN_ONLY, True)  # it refuses a field of its kind: OpenAI's alone, for now
            self.found, usage = await self._ask({}, self.options.top_logprobs, "", {})
        return self.found, usage

    async def fall_back(self, found: list[float | None], usage: Usage) -> Read:
        k, wide = self.options.top_logprobs, self.options.widen_to
        fallback: tuple[list[float], bool] | None = None
        restrict = wire.restriction(self.options.restrict, self.scoring.prompt.label_ids)
        if restrict and not self.facts.get(facts.RESTRICTION_IGNORED):
            got, more = await self._refusable(restrict, k, "restricted to the labels (" + ", ".join(restrict) + ")")
            usage = added(usage, more)
            if not served.complete(got):
                # log-probabilities read before the restriction (its top k may hold the chosen label alone, at its
                # unrestricted log-probability): the widened read is the way on
                self.facts.learn(facts.RESTRICTION_IGNORED, True)
            else:
                try:
                    fallback = served.combine(found, got)
                except served.Unscored as e:
                    raise self._unscored(e.index, e.reason) from None
                if fallback[1] or wide <= k:
                    return Read(fallback[0], fallback[1], usage)
        # never more than the server gives, nor than the vocabulary holds (vLLM's engine dies on a larger top k)
        wide = min(wide, self.facts.get(facts.MOST_LOGPROBS) or self.server.max_logprobs or wide,
                   self.provider.vocabulary or wide)
        if wide > k:
            try:
                widened, more = await self._widened(wide)
            except ProviderError:
                if fallback is None:
                    raise
                return Read(fallback[0], False, usage)  # the widened read was for the mass alone
            usage = added(usage, more)
            if served.complete(widened):
                return Read([v for v in widened if v is not None], True, usage)
            found = [w if w is not None else f for f, w in zip(found, widened)]
        if fallback is not None:  # exact probabilities among the labels; their share of the mass unknown
            return Read(fallback[0], False, usage)
        raise self._missing(found, restrict, max(k, wide))

    async def _widened(self, wide: int) -> tuple[list[float | None], Usage]:
        """A plain read of the top ``wide``; a server that refuses it naming a smaller maximum is asked once more at
        its maximum (remembered), where that is more than ``k``."""
        try:
            return await self._ask({}, wide, f"of the top {wide}")
        except ProviderError as error:
            most = servers.maximum(error.reason) if isinstance(error, Refusal) else None
            if most is not None:
                self.facts.learn(facts.MOST_LOGPROBS, most)
            if most is None or not self.options.top_logprobs < most < wide:
                raise self._refusal(error, f"of the top {wide}") from None
            return await self._refusable({}, most, f"of the top {most}")

    async def _refusable(self, restrict: dict[str, Any], k: int, what: str) -> tuple[list[float | None], Usage]:
        try:
            return await self._ask(restrict, k, what)
        except ProviderError as error:
            raise self._refusal(error, what) from None

    def _refusal(self, error: ProviderError, what: str) -> ProviderError:
        """A read beyond the first that the server refuses: a failure to score the first label still missing."""
        if not isinstance(error, Refusal):
            return error
        return self._unscored(self._first_missing(self.found), f"the server refused the read {what}: {error.reason}")

    def _missing(self, found: list[float | None], restrict: dict[str, Any], k: int) -> ProviderError:
        why = "no tokenizer gives the labels' token ids" if not self.scoring.prompt.label_ids else \
            "restrict: none" if not restrict else "the server reports log-probabilities before it restricts the answer"
        return self._unscored(self._first_missing(found), f"it is not among the server's top {k} "
                                                          f"log-probabilities, and the answer cannot be restricted "
                                                          f"to the labels ({why})")

    @staticmethod
    def _first_missing(found: list[float | None]) -> int:
        return next((i for i, v in enumerate(found) if v is None), 0)

    def _unscored(self, index: int, reason: str) -> ProviderError:
        fix = f"; {self.server.fix}" if self.server.fix else ""
        return self.provider.unscored(self.scoring, index, reason + fix)
