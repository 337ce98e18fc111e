"""``decisiond batch``: a JSON Lines file of requests (or inputs) in, one answer record per line out.

Each line of the source is either a whole request (an object with ``questions``, in ``/v1/decisions``'s OpenAI
shape, ``model`` optional) or one input — a string, OpenAI input items, or an object with ``input`` — answered
with the questions of ``--questions``. An ``id`` field on an object line is copied to its record.

Each record is ``{"line": n, "id"?, "model", "answers", "usage", "latency_s"}`` or ``{"line": n, "error": {message,
code, status, param}}``; records are written as answers come (not in line order) and flushed one by one, so a
killed run loses at most the line being written. Run again with the same ``--out`` and it resumes: lines that
have a record are skipped, except those whose error was the server's or an upstream's (status 5xx), which are
tried again (the newest record of a line is the one that counts).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DecisionError, InvalidRequest, openai_param
from .library.answers import Decision
from .library.decider import Decider
from .library.questions import QuestionLike


@dataclass
class Summary:
    lines: int = 0
    skipped: int = 0
    answered: int = 0
    errors: int = 0
    questions: int = 0

    def __str__(self) -> str:
        return (f"{self.lines} lines: {self.answered} answered, {self.errors} errors, {self.skipped} skipped "
                f"(answered by an earlier run), {self.questions} questions")


def answered_lines(out: Path) -> set[int]:
    """Lines that already have a final record in ``out``. A torn last line (a killed run) is cut off."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with out.open("r+b") as f:
            f.truncate(len(data))
    done: set[int] = set()
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("line"), int):
            continue
        error = record.get("error")
        if error is None or not (isinstance(error, dict) and int(error.get("status") or 0) >= 500):
            done.add(record["line"])
    return done


def _error_record(line: int, error: DecisionError) -> dict[str, Any]:
    return {"line": line, "error": {"message": error.message, "code": error.code, "status": error.status,
                                    "param": openai_param(error.path)}}


def _item(document: Any) -> tuple[Any, Any]:
    """(the id to copy, the item for ``aiter_many``)."""
    if isinstance(document, dict):
        document = dict(document)
        ident = document.pop("id", None)
        if "questions" in document:
            return ident, document
        if "input" in document:
            return ident, document["input"]
        return ident, document
    return None, document


def _count(item: Any, questions: Sequence[QuestionLike] | None) -> int:
    if isinstance(item, dict) and isinstance(item.get("questions"), list):
        return len(item["questions"])
    return len(questions or ())


async def run_async(decider: Decider, source: Path, out: Path, questions: Sequence[QuestionLike] | None = None,
                    *, concurrency: int = 4, progress: bool = True, **options: Any) -> Summary:
    from tqdm import tqdm

    summary = Summary()
    done = answered_lines(out)
    pending: list[tuple[int, Any, Any]] = []  # (line, id, item)
    with out.open("a", encoding="utf-8") as sink:
        def write(record: dict[str, Any]) -> None:
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()

        with source.open(encoding="utf-8") as lines:
            for number, raw in enumerate(lines, 1):
                if not raw.strip():
                    continue
                summary.lines += 1
                if number in done:
                    summary.skipped += 1
                    continue
                try:
                    document = json.loads(raw)
                except ValueError as e:
                    summary.errors += 1
                    write(_error_record(number, InvalidRequest(f"line {number} is not JSON: {e}",
                                                              code="invalid_json")))
                    continue
                ident, item = _item(document)
                pending.append((number, ident, item))

        bar = tqdm(total=sum(_count(item, questions) for _, _, item in pending), unit="q", disable=not progress,
                   desc=source.name, file=sys.stderr, smoothing=0.1)
        try:
            async for index, result in decider.aiter_many([item for _, _, item in pending], questions,
                                                          concurrency=concurrency, **options):
                number, ident, item = pending[index]
                if isinstance(result, Decision):
                    summary.answered += 1
                    summary.questions += len(result.answers)
                    write({"line": number, **({"id": ident} if ident is not None else {}), **result.to_dict()})
                else:
                    summary.errors += 1
                    write({**_error_record(number, result), **({"id": ident} if ident is not None else {})})
                bar.update(_count(item, questions))
                bar.set_postfix(errors=summary.errors, refresh=False)
        finally:
            bar.close()
            sink.flush()
            os.fsync(sink.fileno())
    return summary


def run(decider: Decider, source: Path, out: Path, questions: Sequence[QuestionLike] | None = None, *,
        concurrency: int = 4, progress: bool = True, **options: Any) -> Summary:
    return asyncio.run(run_async(decider, source, out, questions, concurrency=concurrency, progress=progress,
                                 **options))
