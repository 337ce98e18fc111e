"""Any served chat LLM as a decision model, through the next-token log-probabilities of its OpenAI-compatible
routes (vLLM, SGLang, llama.cpp's server, Ollama, TGI, a hosted API).

A decision goes through the same ``engine.decider.Decider`` as the in-process engine's: the same checks, wording,
option orders, content-free calibration prompts and answers. Only the label log-probabilities come from the server:

- ``api: completions`` (the default): the prompt rendered with ``tokenizer:``'s chat template and sent as token ids
  to ``/v1/completions`` (one output token, ``temperature: 0``, ``logprobs: k``): the server adds nothing, and text
  in the user's content that spells a control token stays text;
- ``api: chat``: the rendered question as the user message of ``/v1/chat/completions`` (``logprobs``,
  ``top_logprobs``): the server's template applies and the answer is the first token; the request's images go as
  chat image parts. Labels are found by their token ids with a ``tokenizer:``, else by their text.

Each prompt is one request, which reads every label by its token id where the server can (vLLM's
``logprob_token_ids``, SGLang's native ``token_ids_logprob``; which server it is comes from its ``/v1/models``:
``dialects.served_servers``), and otherwise more where a label is not among the top ``k`` (``label_reads``); a
decision's prompts go out concurrently, at most ``logprobs.concurrency`` at a time, and share the input, which the
server's prefix cache (vLLM's and SGLang's automatic prefix caching, llama.cpp's slots) computes once. A server
that cannot be reached, a reply without log-probabilities, a label the server cannot score, a server's refusal of a
request decisiond checked and an answer inside a reasoning block are provider failures (502, failover), named with
the option and the reason; never an answer made up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ...canonical import DecisionRequest, DecisionResult, Image, Question, Usage
from ...dialects import completions as wire
from ...dialects import generate_route
from ...dialects import served_servers as servers
from ...engine import served
from ...engine.assembly import Prepared
from ...engine.bounds import max_token_chars
from ...engine.decider import Decider, Scoring
from ...engine.plain_prompt import PlainPrompter
from ...engine.prefix_cache import Lru
from ...engine.prompt import PROMPT_FORMAT_VERSION, REASONING_MARKERS, ChatPrompter
from ...errors import DecisionError, InvalidRequest, ProviderError, provider_error, refused
from ...limits import SERVED_TIMEOUT_S
from ..settings import Limits, ProviderConfig
from . import served_facts as facts
from .base import HttpProvider
from .label_reads import LabelReads, Read, Refusal, added, in_context
from .served_facts import Facts

T = TypeVar("T")
# Decisions of the served models of one provider (one Decider each, so that calibration priors stay per model).
UPSTREAM_ENTRIES = 64
# No context length known for the tokenizer: the server refuses what does not fit its own.
UNBOUNDED_CONTEXT = 1 << 30
# A chosen token that opens a reasoning block: the answer position is inside it.
REASONING_OPENERS = frozenset(start for start, _ in REASONING_MARKERS)


class LogprobsProvider(HttpProvider):
    format = "logprobs"
    capabilities = frozenset({"decisions", "images", "engine_options"})

    def __init__(self, config: ProviderConfig, tokenizer: Any = None, name: str = "",
                 context_length: int | None = None):
        if "timeout" not in config.model_fields_set:
            config = config.model_copy(update={"timeout": SERVED_TIMEOUT_S})
        super().__init__(config)
        self.tokenizer = tokenizer
        self.options = config.logprobs
        self.chat = config.api == "chat"
        self.model_name = name or config.name
        self.context_length = context_length or UNBOUNDED_CONTEXT
        self._deciders: Lru[Decider] = Lru(UPSTREAM_ENTRIES)
        # What this provider learned of its server from its replies, each fact for a while (served_facts).
        self.facts = Facts()
        self._rendered: tuple[DecisionRequest, list[Scoring]] | None = None
        self.decider("")  # the config's order and calibrate checked now, not at the first request

    @classmethod
    def from_config(cls, config: ProviderConfig, engines: Mapping[str, Any]) -> "LogprobsProvider":
        if not config.tokenizer:
            return cls(config)
        from ...engine.model import load_tokenizer  # transformers: only where a tokenizer is named

        loaded = load_tokenizer(config.tokenizer)
        return cls(config, loaded.tokenizer, loaded.name, loaded.context_length)

    @classmethod
    def check_config(cls, config: ProviderConfig) -> None:
        super().check_config(config)
        if config.api == "completions" and not config.tokenizer:
            raise ValueError(f"provider {config.name!r} (logprobs, api: completions) needs a tokenizer (default, a "
                             "folder, a .gguf or a hub id): decisiond renders the prompt itself")
        if config.calibration:
            raise ValueError(f"provider {config.name!r} (logprobs): calibration profiles are fitted on a local model; "
                             "a served model learns its profiles from labels (POST /admin/learn)")

    @classmethod
    def images_by_default(cls, config: ProviderConfig) -> bool:
        return config.api == "chat"

    def decider(self, upstream: str) -> Decider:
        """The Decider of one served model (made on first use)."""
        def make() -> Decider:
            prompter = ChatPrompter(self.tokenizer, self.context_length) if self.tokenizer is not None \
                else PlainPrompter()
            token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else None
            return Decider(upstream or self.model_name, prompter, self.context_length, token_chars,
                           self.config.order, self.config.calibrate, reads_images=self.chat)

        return self._deciders.get_or_make(upstream, make)

    @property
    def limits(self) -> Limits:
        """A question has at most ``top_logprobs`` options or levels: more could not all be read from one reply."""
        own = super().limits
        k = self.options.top_logprobs
        return own.model_copy(update={"max_choices": min(own.max_choices or k, k),
                                      "max_levels": min(own.max_levels or k, k)})

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        if request.return_prompt_token_ids and self.tokenizer is None:
            return InvalidRequest(f"return_prompt_token_ids needs the model's tokenizer, which provider {self.name!r} "
                                  "has not (tokenizer: in its config)", ("return_prompt_token_ids",),
                                  code="unsupported_parameter")
        return super().unsupported(request)

    def cache_identity(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "api": self.config.api, "tokenizer": self.config.tokenizer,
                "order": self.config.order, "calibrate": self.config.calibrate,
                "prompt_format_version": PROMPT_FORMAT_VERSION, **self.options.model_dump()}

    async def input_tokens(self, request: DecisionRequest) -> int | None:
        """The most input tokens ``request`` can send: every prompt (each rendering and calibration input), as many
        times as one prompt can be read (``most_reads``)."""
        scorings = await self._scorings(request)
        return None if scorings is None else sum(len(s.prompt.ids) for s in scorings) * self.most_reads()

    async def output_tokens(self, request: DecisionRequest) -> int | None:
        """The most output tokens: one a read."""
        scorings = await self._scorings(request)
        return None if scorings is None else len(scorings) * self.most_reads()

    async def _scorings(self, request: DecisionRequest) -> list[Scoring] | None:
        """The prompts ``request`` sends (None without a tokenizer to render them with); the last request's kept,
        since a budget asks for its input and its output tokens in turn."""
        if self.tokenizer is None:
            return None
        if self._rendered is not None and self._rendered[0] is request:
            return self._rendered[1]
        decider = self.decider("")
        scorings, _ = await asyncio.to_thread(lambda: decider.prompts(decider.prepare(request)))
        self._rendered = (request, scorings)
        return scorings

    def detokenize(self, ids: tuple[int, ...]) -> str:
        if self.tokenizer is None:
            return super().detokenize(ids)
        return str(self.tokenizer.decode(list(ids)))

    # ------------------------------------------------------------------------------------------ answering

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        decider = self.decider(upstream)
        prepared, scorings, pending = await asyncio.to_thread(self._prepare, decider, request)
        kwargs = decider.prompter.template_kwargs(request.chat_template_kwargs) if self.chat else {}
        images, server = request.images(), await self._server()
        reads = await _bounded([self._read(s, upstream, images, kwargs, server) for s in scorings],
                               self.options.concurrency)
        answers = decider.answers(request, prepared, decider.evidence_of(prepared, pending,
                                                                          [r.logprobs for r in reads]))
        inexact = {id(s.question) for s, r in zip(scorings, reads) if not r.exact and not s.prior}
        for q, answer in zip(prepared.questions, answers):
            if id(q) in inexact:
                answer.label_mass = None  # the labels' share of the mass was not in the replies
        usage = Usage()
        for r in reads:
            usage = added(usage, r.usage)
        return DecisionResult(upstream, answers, usage, PROMPT_FORMAT_VERSION, self.format)

    def _prepare(self, decider: Decider, request: DecisionRequest) -> tuple[Prepared, list[Scoring], list[str]]:
        """The request prepared and its prompts; a prompt sent as text must tokenize, at the server, into the ids
        decisiond rendered: an input that spells control tokens (``<|im_start|>``…) would not, and is refused."""
        prepared = decider.prepare(request)
        scorings, pending = decider.prompts(prepared)
        if not self.chat and self.options.prompt == "text":
            encode = decider.prompter.prompt_ids.encode if isinstance(decider.prompter, ChatPrompter) else None
            for scoring in scorings:
                if encode is not None and encode(scoring.prompt.text) != scoring.prompt.ids:
                    raise refused(f"the request's text spells the model's control tokens, which provider "
                                  f"{self.name!r} would send as control tokens (it sends prompts as text: "
                                  "logprobs.prompt: text; ids keeps them text)", "input", code="unsupported_input")
        return prepared, scorings, pending

    @property
    def vocabulary(self) -> int | None:
        """The tokenizer's vocabulary size, where there is a tokenizer."""
        return len(self.tokenizer) if self.tokenizer is not None else None

    def label_tokens(self, scoring: Scoring) -> list[served.LabelToken]:
        """Each label's token: its id and the text it adds in context (after the prompt's last tokens), as servers
        print a token; a lone ``decode`` would print SentencePiece's ``▁A`` as ``A``, the text of another token."""
        labels, ids = scoring.variant.labels, scoring.prompt.label_ids
        if not ids:
            return [served.LabelToken(label) for label in labels]
        return [served.LabelToken(label, i, in_context(self.tokenizer, scoring.prompt.ids, i))
                for label, i in zip(labels, ids)]

    async def _server(self) -> servers.Server:
        """The server behind ``base_url``: configured, or read from its ``/v1/models`` (``generic`` where that
        fails), and learned again after a while."""
        if self.options.server != "auto":
            return servers.SERVERS[self.options.server]
        known: servers.Server | None = self.facts.get(facts.SERVER)
        if known is None:
            try:
                known = servers.detect(await self.get_json(f"{self.base_url}/models", self.auth()))
            except ProviderError:
                known = servers.SERVERS["generic"]
            self.facts.learn(facts.SERVER, known)
        return known

    async def _read(self, scoring: Scoring, upstream: str, images: list[Image], kwargs: dict[str, Any],
                    server: servers.Server) -> Read:
        """One prompt's label log-probabilities: one read, which on a server that reads given token ids (vLLM's
        ``logprob_token_ids``) holds every label exactly; where a label is missing, a read restricted to the labels
        (not where this server proved to report log-probabilities before its restriction), then a plain read of
        the top ``widen_to``, at most the server's maximum."""
        reads = LabelReads(self, scoring, upstream, images, kwargs, server)
        found, usage = await reads.first()
        if served.complete(found):
            return Read([v for v in found if v is not None], True, usage)
        return await reads.fall_back(found, usage)

    def most_reads(self) -> int:
        """The most requests one prompt can take (what a budget reserves): on completions a native route's read
        (SGLang's), the first read and its retry without the server's own fields, the restricted read, the widened
        read and its retry at the server's maximum."""
        restricted = self.options.restrict != "none"
        widened = self.options.widen_to > self.options.top_logprobs
        return 2 + (not self.chat) + restricted + 2 * widened

    async def send(self, scoring: Scoring, upstream: str, images: list[Image], kwargs: dict[str, Any],
                   restrict: dict[str, Any], k: int, extra: dict[str, Any]) -> wire.Reply:
        """One request for ``scoring``'s answer position, with the server's own fields ``extra``. A server's
        refusal of a request decisiond checked is a provider failure (``Refusal``: 502, failover), never the
        caller's 400."""
        shown = [] if scoring.prior else images
        if self.chat:
            body = wire.chat_body(upstream, scoring.prompt.content, shown, k, restrict, kwargs, extra)
        else:
            prompt = scoring.prompt.ids if self.options.prompt == "ids" else scoring.prompt.text
            body = wire.completion_body(upstream, prompt, k, restrict, extra)
        route = "chat/completions" if self.chat else "completions"
        return await self._ask(scoring, f"{self.base_url}/{route}", body, wire.read_reply, shown)

    async def send_generate(self, scoring: Scoring, k: int, sampling: Mapping[str, Any]) -> wire.Reply:
        """One request to SGLang's native ``/generate`` route: the top ``k`` and every label by its token id, with
        the server's ``sampling`` settings; a server without the route (404) refuses it."""
        body = generate_route.generate_body(scoring.prompt.ids, k, scoring.prompt.label_ids, sampling)
        url = f"{generate_route.root(self.base_url)}/generate"
        return await self._ask(scoring, url, body, generate_route.read_generate_reply, [], missing_refuses=True)

    async def _ask(self, scoring: Scoring, url: str, body: dict[str, Any], read: Callable[[Any], wire.Reply],
                   shown: list[Image], missing_refuses: bool = False) -> wire.Reply:
        """POST ``body`` and ``read`` the reply; a server's refusal of a request decisiond checked is a ``Refusal``
        (a 404 too, where ``missing_refuses``: a route the server lacks)."""
        try:
            data = await self.post(url, self.auth(), json=body)
        except ProviderError as error:
            if error.failover or error.status in (401, 403) or (error.status == 404 and not missing_refuses):
                raise
            if shown and servers.about_images(error.message):
                raise self._refused_images(shown, error) from None
            raise Refusal(self.name, error.status, error.message) from None
        try:
            reply = read(data)
        except wire.NoLogprobs as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} answered without log-probabilities ({e}); "
                                 f"the server must support logprobs on its {urlsplit(url).path} route",
                                 code="upstream_no_logprobs") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} answered in an unexpected shape: {e}",
                                 code="upstream_invalid_response") from None
        self._check_reply(scoring, reply)
        return reply

    def _check_reply(self, scoring: Scoring, reply: wire.Reply) -> None:
        """Refuse a reply read at another position than decisiond's: inside a reasoning block (the server split
        reasoning off, or, on the chat route, where the server renders the template, the answer opens one), or from a
        prompt the server tokenized into another count of tokens."""
        chosen = reply.candidates[0]
        text = chosen.text or ""
        if chosen.id is not None and self.tokenizer is not None and text.startswith(wire.TOKEN_ID_PREFIX):
            text = str(self.tokenizer.decode([chosen.id]))
        if reply.reasoning or (self.chat and text.strip() in REASONING_OPENERS):  # completions: decisiond's template
            raise provider_error(self.name, 502, f"provider {self.name!r} answered inside a reasoning block (its "
                                 f"answer begins {(text or reply.reasoning[:20])!r}), so no answer position can be "
                                 "read: turn thinking off on the server (chat_template_kwargs enable_thinking: false; "
                                 "Ollama: reasoning_effort none) or use api: completions with a tokenizer",
                                 code="upstream_reasoning")
        counted, ours = reply.usage.input_tokens, len(scoring.prompt.ids)
        if not self.chat and self.options.prompt == "text" and counted and counted != ours:
            raise provider_error(self.name, 502, f"provider {self.name!r} tokenized the prompt into {counted} tokens "
                                 f"where decisiond rendered {ours}, so its answer position is not decisiond's (a "
                                 "server that adds a BOS to text prompts takes logprobs.prompt: ids)",
                                 code="upstream_prompt_mismatch")

    def unscored(self, scoring: Scoring, index: int, reason: str) -> ProviderError:
        """The failure to score one label, naming its option (by its name and, as the error's path, its field)."""
        question = scoring.question.question
        candidate = scoring.variant.order[index]
        name, path = _candidate(question, candidate)
        label = scoring.variant.labels[index]
        where = " (on a content-free calibration input)" if scoring.prior else ""
        error = provider_error(self.name, 502, f"provider {self.name!r} could not score option {name!r} of question "
                               f"{question.name or question.source!r} (label {label!r}){where}: {reason}",
                               code="upstream_label_unscored")
        error.path = path
        return error

    def _refused_images(self, images: list[Image], error: ProviderError) -> ProviderError:
        """A server that refuses the request's images: a provider failure naming the first image part (another
        target of the chain may read images)."""
        refused = provider_error(self.name, 502, f"provider {self.name!r} refused the request with its images (the "
                                 f"first at {'.'.join(map(str, images[0].source)) or 'input'}): {error.message}",
                                 code="upstream_refused_image")
        refused.path = images[0].source
        return refused


def _candidate(question: Question, index: int) -> tuple[str, tuple[str | int, ...]]:
    if question.kind == "choice":
        option = question.options[index]
        return option.name, option.source
    if question.kind == "score":
        level = question.levels[index]
        return str(level.label), level.source
    return ("yes", "no")[index], question.source


async def _bounded(calls: Sequence[Awaitable[T]], limit: int) -> list[T]:
    """Every call's result in order, at most ``limit`` running at once; the first failure cancels the others."""
    gate = asyncio.Semaphore(limit)

    async def run(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    tasks = [asyncio.ensure_future(run(c)) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

