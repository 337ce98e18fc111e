"""``Decider``, what ``Engine`` and ``Client`` share: ``decide``, ``decide_as`` and ``decide_many``, each async
and sync, over one OpenAI-shaped body a subclass answers; and the private event loop the sync calls run on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from ..errors import DecisionError, InvalidRequest
from .answers import Decision
from .questions import M, QuestionLike, filled, question_dict, questions_from

T = TypeVar("T")


def _body(model: str, input: Any, questions: Iterable[QuestionLike], options: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "input": input, "questions": [question_dict(q) for q in questions]}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


class Decider:
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
        return filled(schema, decision, min_confidence)

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


class LoopThread:
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
