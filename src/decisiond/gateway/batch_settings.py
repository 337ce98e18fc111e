"""The ``batches`` section of the gateway's config: the Files and Batch APIs (``server.batch_api``, run by
``server.batch_runner``). Its own module, beside ``settings``, which holds it as ``GatewayConfig.batches``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..limits import (
    BATCH_CONCURRENCY,
    BATCH_LEASE_S,
    BATCH_MAX_BYTES_PER_KEY,
    BATCH_MAX_FILE_BYTES,
    BATCH_MAX_FILES_PER_KEY,
)


class BatchesConfig(BaseModel):
    """The Batch API (``POST /v1/files``, ``POST /v1/batches``; ``gateway.batches``). It needs the gateway's
    database: a server without one answers those routes with 400."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    files_path: str | None = None
    """The folder uploaded files and batch outputs are kept in; unset: beside a SQLite database (``<file>.files``),
    else ``files/<a hash of the database URL>`` in the data directory. Replicas that share a database must share this
    folder too (any of them may run a batch and serve its files). decisiond makes it (and the folders above it that
    it makes) mode 0700 and every file in it 0600, whatever the process's umask."""
    max_file_bytes: int = Field(default=BATCH_MAX_FILE_BYTES, ge=1)
    """The largest file ``POST /v1/files`` takes, in bytes (413 above it)."""
    max_bytes_per_key: int = Field(default=BATCH_MAX_BYTES_PER_KEY, ge=1)
    """The bytes one key may hold in the files folder: its uploads and the output and error files of its batches
    (made on its behalf), until they are deleted or expire. An upload that would take the key past it is refused
    with 400 ``file_quota_exceeded``; a batch's output is never refused (its lines were answered and charged), so
    outputs can take a key past it, and its next upload is refused until it deletes files. The master key is not
    limited (nor by ``max_files_per_key``); on a server without keys, every caller shares one quota."""
    max_files_per_key: int = Field(default=BATCH_MAX_FILES_PER_KEY, ge=1)
    """The files one key may hold (uploads, and its batches' output and error files), as ``max_bytes_per_key``."""
    concurrency: int = Field(default=BATCH_CONCURRENCY, ge=1, le=256)
    """Lines of one batch answered at once. A batch's lines take what the rate limits leave: a line refused by a
    rate limit waits and is asked again, never failed."""
    max_running: int = Field(default=2, ge=1, le=64)
    """Batches one server process runs at once; the others wait their turn."""
    lease_s: float = Field(default=BATCH_LEASE_S, gt=0)
    """How long a batch stays with the process running it without a word from it: a batch whose process died on
    another host is taken up by another replica after this long (on the same host, at once)."""
