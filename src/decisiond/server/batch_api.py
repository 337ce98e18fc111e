"""OpenAI's Files and Batch APIs, for decisions, in OpenAI's shapes (the official ``openai`` SDK unmodified):

- ``POST /v1/files`` (multipart: ``purpose=batch``, ``file``, optional ``expires_after[anchor|seconds]``): each line
  is checked as it is stored — a JSON object with ``custom_id`` (unique in the file), ``method: POST``, a ``url``
  that is a decision route and an object ``body`` — and a file with a bad line is refused (400, naming the line);
  ``GET /v1/files`` (``purpose``, ``after``, ``limit``, ``order``), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
- ``POST /v1/batches`` ``{input_file_id, endpoint, completion_window: "24h", metadata?, output_expires_after?}``,
  ``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

Each key holds at most ``batches.max_bytes_per_key`` bytes in ``batches.max_files_per_key`` files (``store.quotas``;
over it, an upload is 400 ``file_quota_exceeded``); the files folder and its files are private to the OS user
(``files_fs``). Files past their ``expires_at`` are deleted by the runner's housekeeping (then 404).

A key sees only the files and batches it made (404 for the others); the master key, or anyone on a server without
keys, sees all. The batches themselves are run by ``batch_runner``. Both APIs keep their rows in the gateway's
database, which every server opens (``database_url``, else the default SQLite file; 400 in an app whose gateway was
never started). Errors are OpenAI-shaped, naming the field at fault.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import IO, Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import Field, field_validator
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from ..dialects.common import StrictModel, validate_body
from ..errors import ClientGone, DecisionError, InvalidRequest, NotFound, invalid
from ..gateway.types import Caller
from ..limits import (
    BATCH_LIST_MAX,
    BATCH_MAX_CUSTOM_ID,
    BATCH_METADATA_KEY,
    BATCH_METADATA_PAIRS,
    BATCH_METADATA_VALUE,
    BODY_READ_TIMEOUT_S,
    FILE_LIST_MAX,
)
from ..store.quotas import Quota, add_within, check_room
from ..store.tables import BatchJob, StoredFile
from . import files_fs
from .batch_lines import ENDPOINTS
from .batch_runner import BatchRunner
from .boundary import OpenAIRoute
from .payload import read_payload, too_large
from .routes import authenticate

router = APIRouter(prefix="/v1", route_class=OpenAIRoute)

BATCH_BODY_LIMIT = 64 * 1024
COMPLETION_WINDOWS = {"24h": 24 * 3600}
# A file's expires_after, in seconds (OpenAI's bounds: an hour to 30 days); a batch input's default.
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86400
BATCH_FILE_EXPIRES_S = 30 * 86400
MULTIPART_OVERHEAD = 64 * 1024


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner | None = request.app.state.batches
    if runner is None:
        raise InvalidRequest("the Files and Batch APIs need the gateway's database, which this app has not opened "
                             "(its lifespan opens it)", code="batches_unavailable")
    return runner


def _sees(caller: Caller, key_id: str | None) -> bool:
    """A key sees what it made; the master key (and anyone on a server without keys: no key id) sees all."""
    return caller.key_id is None or key_id == caller.key_id


def _page(rows: list[Any], limit: int, shape: Any) -> dict[str, Any]:
    data = [shape(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def _whole(value: Any, low: int, high: int) -> int | None:
    """``value`` as a whole number from ``low`` to ``high`` (ASCII digits only), else None."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 12:
        return None
    number = int(value)
    return number if low <= number <= high else None


def _limit(value: str | None, default: int, most: int) -> int:
    if value is None:
        return default
    number = _whole(value, 1, most)
    if number is None:
        raise invalid(f"limit must be a whole number from 1 to {most}", "limit")
    return number


# Files


def file_object(row: StoredFile) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": row.expires_at,
            "status_details": None}


async def _owned_file(request: Request, file_id: str) -> tuple[BatchRunner, StoredFile]:
    caller = await authenticate(request)
    runner = _runner(request)
    row = await runner.store.file(file_id)
    if row is None or not _sees(caller, row.key_id):
        raise NotFound(f"No such File object: {file_id[:100]}", ("file_id",), code="file_not_found")
    return runner, row


@router.post("/files")
async def create_file(request: Request) -> JSONResponse:
    try:
        return await _create_file(request)
    except ClientDisconnect:  # gone while sending the file: nothing to answer
        return JSONResponse(None, status_code=ClientGone.status)


async def _create_file(request: Request) -> JSONResponse:
    caller = await authenticate(request)
    runner = _runner(request)
    form = await _form(request, runner.config.max_file_bytes)
    try:
        row = await _stored_upload(runner, caller, form, request.app.state.settings.max_body_bytes)
    finally:
        for _, value in form.multi_items():
            if isinstance(value, UploadFile):
                await value.close()
    return JSONResponse(file_object(row))


@router.get("/files")
async def list_files(request: Request) -> JSONResponse:
    caller = await authenticate(request)
    store = _runner(request).store
    query = request.query_params
    limit = _limit(query.get("limit"), FILE_LIST_MAX, FILE_LIST_MAX)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'", "order")
    rows = await store.files(caller.key_id, caller.key_id is None, query.get("purpose"), query.get("after"),
                             limit, order == "desc")
    return JSONResponse(_page(rows, limit, file_object))


@router.get("/files/{file_id}")
async def get_file(request: Request, file_id: str) -> JSONResponse:
    _, row = await _owned_file(request, file_id)
    return JSONResponse(file_object(row))


@router.get("/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    runner, row = await _owned_file(request, file_id)
    path = runner.store.path(row)
    if not path.exists():
        raise NotFound(f"the content of {file_id} is gone from the files folder", ("file_id",), code="file_not_found")
    return FileResponse(path, media_type="application/jsonl", filename=row.filename)


@router.delete("/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> JSONResponse:
    runner, row = await _owned_file(request, file_id)
    if await runner.store.in_use(row.id):
        raise InvalidRequest(f"the file {row.id} is the input of a batch that is not done: cancel the batch "
                             "first", ("file_id",), code="file_in_use", status=409)
    await runner.store.delete_file(row.id)
    return JSONResponse({"id": row.id, "object": "file", "deleted": True})


async def _form(request: Request, max_file_bytes: int) -> Any:
    """The multipart form, its bytes counted as they arrive (413 past the file limit) and each chunk awaited at
    most ``BODY_READ_TIMEOUT_S`` (408); the file part spooled to disk by Starlette's parser, never held whole."""
    limit = max_file_bytes + MULTIPART_OVERHEAD
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(max_file_bytes)
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise invalid("POST /v1/files takes a multipart/form-data body with 'purpose' and 'file'", "file",
                      code="invalid_content_type")

    async def counted() -> AsyncGenerator[bytes, None]:
        size = 0
        chunks = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), BODY_READ_TIMEOUT_S)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise InvalidRequest(f"the upload stalled for {BODY_READ_TIMEOUT_S:.0f} s", code="request_timeout",
                                     status=408) from None
            size += len(chunk)
            if size > limit:
                raise too_large(max_file_bytes)
            yield chunk

    try:
        return await MultiPartParser(request.headers, counted(), max_files=1, max_fields=8,
                                     max_part_size=BATCH_BODY_LIMIT).parse()
    except MultiPartException as error:
        raise invalid(f"the multipart body could not be read: {error.message}", "file",
                      code="invalid_multipart") from None


async def _stored_upload(runner: BatchRunner, caller: Caller, form: Any, max_line_bytes: int) -> StoredFile:
    """The upload checked, copied into the files folder and recorded within its key's quota (``store.quotas``:
    refused before it is copied when it cannot fit, and recorded only if it still fits)."""
    store, config = runner.store, runner.config
    purpose = form.get("purpose")
    if purpose is None:
        raise invalid("purpose is required", "purpose", code="missing_required_parameter")
    if purpose != "batch":
        raise invalid(f"purpose must be 'batch' (files of this server are batch inputs), not {str(purpose)[:50]!r}",
                      "purpose")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise invalid("file is required: the file part of the form", "file", code="missing_required_parameter")
    now = int(runner.clock())
    expires_at = now + _expires_after(form)
    quota = None if caller.master else Quota(config.max_bytes_per_key, config.max_files_per_key)
    await check_room(store.db, caller.key_id, upload.size or 0, quota)
    file_id = "file-" + secrets.token_hex(12)
    name = f"{file_id}.jsonl"
    size, lines = await asyncio.to_thread(_check_and_copy, upload.file, store.folder, file_id, max_line_bytes,
                                          config.max_file_bytes)
    row = StoredFile(id=file_id, key_id=caller.key_id, filename=(upload.filename or "batch.jsonl")[:256],
                     purpose="batch", bytes=size, lines=lines, path=name, created_at=now, expires_at=expires_at)
    try:
        await add_within(store.db, row, quota)
    except BaseException:
        (store.folder / name).unlink(missing_ok=True)
        raise
    return row


def _expires_after(form: Any) -> int:
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return BATCH_FILE_EXPIRES_S
    if anchor != "created_at":
        raise invalid("expires_after.anchor must be 'created_at'", "expires_after", "anchor")
    number = _whole(seconds, EXPIRES_MIN_S, EXPIRES_MAX_S)
    if number is None:
        raise invalid(f"expires_after.seconds must be a whole number from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}",
                      "expires_after", "seconds")
    return number


def _check_and_copy(source: IO[bytes], folder: Path, file_id: str, max_line_bytes: int,
                    max_file_bytes: int) -> tuple[int, int]:
    """Copy the upload into ``folder/<file_id>.jsonl`` line by line, checking each (400 naming the first bad line,
    nothing kept): its size and request lines. ``custom_id`` uniqueness is checked in a SQLite file beside it, so
    memory stays bounded whatever the file's size. Its files are private (``files_fs``: 0600, in a 0700 folder) and
    its temporary ones named after this process (``files_fs.sweep`` deletes them if it dies)."""
    files_fs.make_folder(folder)
    target = folder / f"{file_id}.jsonl"
    partial, seen_path = files_fs.upload_names(folder, file_id)
    files_fs.create(seen_path).close()  # an empty file is an empty database, made 0600 before SQLite opens it
    seen = sqlite3.connect(seen_path)
    size = lines = 0
    try:
        seen.execute("PRAGMA journal_mode=OFF")
        seen.execute("PRAGMA synchronous=OFF")
        seen.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, line INTEGER)")
        with files_fs.create(partial) as out:
            n = 0
            while True:
                raw = source.readline(max_line_bytes + 2)
                if not raw:
                    break
                n += 1
                size += len(raw)
                if size > max_file_bytes:
                    raise too_large(max_file_bytes)
                if len(raw) > max_line_bytes and not raw.endswith(b"\n") or len(raw.rstrip(b"\r\n")) > max_line_bytes:
                    raise _bad_line(n, f"longer than the {max_line_bytes} byte limit of one request")
                out.write(raw)
                if not raw.strip():
                    continue
                custom_id = _check_line(n, raw)
                previous = seen.execute("SELECT line FROM ids WHERE id = ?", (custom_id,)).fetchone()
                if previous is not None:
                    raise _bad_line(n, f"custom_id {custom_id[:100]!r} is already used on line {previous[0]}: each "
                                       "custom_id must be unique in the file")
                seen.execute("INSERT INTO ids VALUES (?, ?)", (custom_id, n))
                lines += 1
            out.flush()
            os.fsync(out.fileno())
        if lines == 0:
            raise invalid("the file has no request lines: each line is a JSON object with custom_id, method, url "
                          "and body", "file", code="invalid_file")
        partial.replace(target)
        return size, lines
    finally:
        seen.close()
        seen_path.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)


def _bad_line(n: int, reason: str) -> DecisionError:
    return invalid(f"line {n} of the file: {reason}", "file", code="invalid_file")


def _check_line(n: int, raw: bytes) -> str:
    """A request line's custom_id, or 400 naming the line and what is wrong with it."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _bad_line(n, "not valid JSON") from None
    if not isinstance(item, dict):
        raise _bad_line(n, "not a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= BATCH_MAX_CUSTOM_ID:
        raise _bad_line(n, f"custom_id must be a string of 1 to {BATCH_MAX_CUSTOM_ID} characters")
    if item.get("method") != "POST":
        raise _bad_line(n, "method must be 'POST'")
    if item.get("url") not in ENDPOINTS:
        raise _bad_line(n, f"url must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(item.get("body"), dict):
        raise _bad_line(n, "body must be a JSON object: the request as POST url takes it")
    return custom_id


# Batches


class ExpiresAfter(StrictModel):
    """``output_expires_after``: the output and error files expire ``seconds`` after they are written (OpenAI's
    bounds, as a file's ``expires_after``)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_MIN_S, le=EXPIRES_MAX_S)


class BatchCreate(StrictModel):
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > BATCH_METADATA_PAIRS or any(
                len(k) > BATCH_METADATA_KEY or len(v) > BATCH_METADATA_VALUE for k, v in value.items())):
            raise ValueError(f"metadata holds at most {BATCH_METADATA_PAIRS} pairs, keys of at most "
                             f"{BATCH_METADATA_KEY} characters and values of at most {BATCH_METADATA_VALUE}")
        return value


def batch_object(row: BatchJob) -> dict[str, Any]:
    usage = {"input_tokens": row.input_tokens, "input_tokens_details": {"cached_tokens": row.cached_tokens},
             "output_tokens": row.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": row.input_tokens + row.output_tokens}
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "model": None,
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id, "error_file_id": row.error_file_id, "created_at": row.created_at,
        "in_progress_at": row.in_progress_at, "expires_at": row.expires_at, "finalizing_at": row.finalizing_at,
        "completed_at": row.completed_at, "failed_at": row.failed_at, "expired_at": row.expired_at,
        "cancelling_at": row.cancelling_at, "cancelled_at": row.cancelled_at,
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "usage": usage, "metadata": row.batch_metadata,
    }


async def _owned_batch(request: Request, batch_id: str) -> tuple[BatchRunner, BatchJob]:
    caller = await authenticate(request)
    runner = _runner(request)
    row = await runner.store.batch(batch_id)
    if row is None or not _sees(caller, row.key_id):
        raise NotFound(f"No such Batch object: {batch_id[:100]}", ("batch_id",), code="batch_not_found")
    return runner, row


@router.post("/batches")
async def create_batch(request: Request) -> JSONResponse:
    try:
        return await _create_batch(request)
    except ClientDisconnect:
        return JSONResponse(None, status_code=ClientGone.status)


async def _create_batch(request: Request) -> JSONResponse:
    caller = await authenticate(request)
    runner = _runner(request)
    payload = await read_payload(request, BATCH_BODY_LIMIT)
    body = validate_body(BatchCreate, payload.document)
    source = await runner.store.file(body.input_file_id)
    if source is None or not _sees(caller, source.key_id):
        raise invalid(f"no file {body.input_file_id!r}: upload it with POST /v1/files first", "input_file_id",
                      code="file_not_found")
    if source.purpose != "batch":
        raise invalid(f"the file {source.id} is a {source.purpose} file, not a batch input", "input_file_id")
    now = int(runner.clock())
    row = BatchJob(id="batch_" + secrets.token_hex(12), key_id=caller.key_id, user_path=caller.user_path,
                   master=caller.master, input_file_id=source.id, endpoint=body.endpoint,
                   completion_window=body.completion_window, status="validating", batch_metadata=body.metadata,
                   errors=None, total=source.lines, completed=0, failed=0, input_tokens=0, cached_tokens=0,
                   output_tokens=0, next_line=0, created_at=now,
                   expires_at=now + COMPLETION_WINDOWS[body.completion_window],
                   output_expires_s=body.output_expires_after.seconds if body.output_expires_after else None)
    await runner.store.add_batch(row)
    runner.wake()
    return JSONResponse(batch_object(row))


@router.get("/batches")
async def list_batches(request: Request) -> JSONResponse:
    caller = await authenticate(request)
    store = _runner(request).store
    limit = _limit(request.query_params.get("limit"), 20, BATCH_LIST_MAX)
    rows = await store.batches(caller.key_id, caller.key_id is None, request.query_params.get("after"), limit)
    return JSONResponse(_page(rows, limit, batch_object))


@router.get("/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    _, row = await _owned_batch(request, batch_id)
    return JSONResponse(batch_object(row))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    runner, row = await _owned_batch(request, batch_id)
    row = await cancel(runner, row)
    return JSONResponse(batch_object(row))


async def cancel(runner: BatchRunner, row: BatchJob) -> BatchJob:
    """Cancel a batch that has not ended (``cancelling``, its runner woken to stop it); 409 for one that has."""
    if row.status not in ("validating", "in_progress", "cancelling"):
        raise InvalidRequest(f"a batch that is {row.status} cannot be cancelled", ("batch_id",),
                             code="batch_not_cancellable", status=409)
    row = await runner.store.cancel(row.id, int(runner.clock())) or row
    runner.wake()
    return row
