"""Request bodies as clients send them: a size limit, ``Content-Encoding`` (zstd, gzip, deflate), and JSON or
``multipart/form-data`` (a ``request`` JSON part plus file parts, as the TypeSafe SDK sends images). A large or
compressed body is decoded and parsed in a thread, its decoded size held to the limit as it is decoded."""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, TypeVar

import zstandard
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from ..dialects.common import parse_json
from ..errors import DecisionError, InvalidRequest, LimitExceeded, invalid
from ..limits import BODY_READ_TIMEOUT_S

MAX_PARTS = 1000
# A plain body up to this size is parsed on the event loop (it takes microseconds); a larger or compressed one in a
# thread. Compressed bodies are decoded this much at a time.
INLINE_BODY_BYTES = 64 * 1024
DECODE_CHUNK_BYTES = 1024 * 1024
T = TypeVar("T")


@dataclass
class UploadedFile:
    data: bytes
    content_type: str | None = None


@dataclass
class Payload:
    document: Any
    files: dict[str, UploadedFile] = field(default_factory=dict)
    content_encoding: str = "identity"
    multipart: bool = False


def too_large(limit: int) -> DecisionError:
    return LimitExceeded(f"The request body is larger than the {limit} byte limit.", code="request_too_large",
                         status=413)


async def read_body(request: Request, limit: int, timeout: float = BODY_READ_TIMEOUT_S) -> bytes:
    """The raw body, refused with 413 once it passes ``limit`` bytes (checked while reading), and with 408 when
    the client has not sent it all within ``timeout`` seconds (a stalled client holds no slot for long)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise InvalidRequest(f"The request body was not received within {timeout:g} s.", code="request_timeout",
                             status=408) from None


def _zstd(raw: bytes, limit: int) -> tuple[bytes, bool]:
    """The frame decoded a chunk at a time, stopping once past ``limit``; and whether it ended early."""
    chunks, size = [], 0
    with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
        while size <= limit:
            chunk = reader.read(min(DECODE_CHUNK_BYTES, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    declared = zstandard.get_frame_parameters(raw).content_size if raw else 0
    return b"".join(chunks), bool(raw and not size) or 0 < declared <= limit and size < declared


def decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """Undo ``Content-Encoding``; the decoded body is held to the same size limit as it is decoded (no
    decompression bombs: decoding stops one byte past the limit)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    try:
        if encoding == "zstd":
            out, truncated = _zstd(raw, limit)
        elif encoding in ("gzip", "x-gzip", "deflate"):
            wbits = 16 + zlib.MAX_WBITS if "gzip" in encoding else zlib.MAX_WBITS
            decoder = zlib.decompressobj(wbits)
            out = decoder.decompress(raw, limit + 1)
            truncated = len(out) <= limit and not decoder.eof
        else:
            raise InvalidRequest(f"Content-Encoding {encoding!r} is not supported; send zstd, gzip, deflate or none.",
                                 code="unsupported_encoding", status=415)
    except (zstandard.ZstdError, zlib.error) as e:
        raise invalid(f"The request body is not valid {encoding} data: {e}", code="invalid_encoding") from e
    if len(out) > limit:
        raise too_large(limit)
    if truncated:
        raise invalid(f"The request body is not valid {encoding} data: the compressed stream ends early.",
                      code="invalid_encoding")
    return out


async def _off_loop(raw: bytes, encoding: str, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on the event loop for a small plain body, else in a thread: decoding and parsing a large
    body (or a small compressed one, which may expand to the limit) must not stop the server answering others."""
    if len(raw) <= INLINE_BODY_BYTES and encoding == "identity":
        return work(*args)
    return await asyncio.to_thread(work, *args)


def _json_body(raw: bytes, encoding: str, limit: int) -> Any:
    return parse_json(decompress(raw, encoding, limit))


async def _multipart(data: bytes, content_type: str) -> tuple[Any, dict[str, UploadedFile]]:
    async def stream() -> AsyncGenerator[bytes, None]:
        yield data

    try:
        form = await MultiPartParser(Headers({"content-type": content_type}), stream(),
                                     max_files=MAX_PARTS, max_fields=MAX_PARTS).parse()
    except MultiPartException as e:
        raise invalid(f"The multipart body could not be parsed: {e.message}", code="invalid_multipart") from e
    files: dict[str, UploadedFile] = {}
    document: Any = None
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            content = await value.read()
            if name == "request":
                document = parse_json(content)
            else:
                files[name] = UploadedFile(content, value.content_type)
        elif name == "request":
            document = parse_json(value.encode())
    if document is None:
        raise invalid("The multipart body has no 'request' part holding the JSON request.", "request",
                      code="missing_required_parameter")
    return document, files


def check_content_type(content_type: str) -> None:
    """415 unless the body is JSON (``application/json``, ``application/*+json``, or no Content-Type at all) or
    ``multipart/form-data``. A browser page can POST ``text/plain`` or a URL-encoded form to any host without a
    CORS preflight; refusing them before the body is read keeps such a page from spending on a server it reaches.
    (A multipart form from another origin is refused by its ``Origin``: ``server.guard``.)"""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in ("", "application/json", "multipart/form-data") or (
            media.startswith("application/") and media.endswith("+json")):
        return
    raise InvalidRequest(f"Content-Type {media!r} is not accepted here; send application/json (or "
                         "multipart/form-data with a 'request' part).", ("content-type",),
                         code="unsupported_media_type", status=415)


async def read_payload(request: Request, limit: int, timeout: float = BODY_READ_TIMEOUT_S) -> Payload:
    check_content_type(request.headers.get("content-type", ""))
    raw = await read_body(request, limit, timeout)
    encoding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
    content_type = request.headers.get("content-type", "")
    if content_type.lower().startswith("multipart/form-data"):
        data = await _off_loop(raw, encoding, decompress, raw, encoding, limit)
        document, files = await _multipart(data, content_type)
        return Payload(document, files, encoding, multipart=True)
    return Payload(await _off_loop(raw, encoding, _json_body, raw, encoding, limit), {}, encoding)
