"""The one table of limits every layer reads: what each wire format publishes, what the local engine can
label, and what decisiond bounds on its own. A number appears here and nowhere else; the modules that enforce a
limit import it (the dialects in their schemas, ``gateway.sizes`` for every request whatever answers it and for
each provider, the engine for its labels)."""

from __future__ import annotations

import string
from dataclasses import dataclass


@dataclass(frozen=True)
class WireLimits:
    """Limits on a decision request; None means the wire format sets none."""

    max_questions: int | None = None
    min_choices: int = 1
    max_choices: int | None = None
    min_levels: int = 1
    max_levels: int | None = None
    max_images: int | None = None
    # Estimated tokens (4 characters a token, the input counted once per question).
    max_tokens: int | None = None
    max_question_tokens: int | None = None
    max_safety_identifier: int | None = None


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int
    max_values: int
    max_bytes: int


# OpenAI's Decisions API; checked for every request, whatever answers it.
OPENAI = WireLimits(max_questions=400, min_choices=2, max_choices=255, max_images=128, max_safety_identifier=128)
# OpenAI's limits on an input_json part (and on any JSON input decisiond renders).
JSON = JsonLimits(max_depth=32, max_values=10_000, max_bytes=256 * 1024)
# SGLang's /v1/decisions: options are labelled A-Z, levels 0-9.
SGLANG = WireLimits(max_questions=400, min_choices=2, max_choices=len(string.ascii_uppercase), min_levels=2,
                    max_levels=len(string.digits))
# TypeSafe's published limits, shared by System One servers (Jev, Kev, OpenRouter's decision models, SGLang's and
# decisiond's /v1/systemone).
SYSTEM_ONE = WireLimits(max_choices=255, max_levels=10, max_tokens=64 * 1024, max_question_tokens=32 * 1024)
# decisiond's local engine: levels are labelled 0-9; choices A-Z, then two letters AA-ZZ where each is one token.
LOCAL = WireLimits(max_choices=len(string.ascii_uppercase) ** 2, max_levels=len(string.digits))

# SGLang's /v1/score: items per request.
SCORE_MAX_ITEMS = 1024
# Container levels of a whole request body (OpenAI's input_json allows 32 inside it).
MAX_DOCUMENT_DEPTH = 64
# Seconds a client may take to send its request body.
BODY_READ_TIMEOUT_S = 30.0
# Request bodies, after decompression (``serve --max-body-bytes``).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

# Padded tokens per batched forward pass (``--max-batch-tokens``): on a CPU a pass over ~1,000 tokens is as efficient
# as it gets; larger batches only add latency and memory.
DEFAULT_MAX_BATCH_TOKENS = 1024
# The local engine's admission control. Tokens one request may make the model compute after prefix sharing
# (``--max-request-tokens``; over it: 400), and tokens admitted but not yet computed across all requests
# (``--max-queued-tokens``; a request that would go over it: 503 with retry-after-ms). On a 2-core CPU SmolLM2
# computes about 2,000-3,000 tokens a second.
DEFAULT_MAX_REQUEST_TOKENS = 32 * 1024
DEFAULT_MAX_QUEUED_TOKENS = 64 * 1024
# ``x-decisiond-timeout-ms``: the most a client may ask for (10 minutes).
MAX_CLIENT_TIMEOUT_MS = 600_000
# A chat template sent in a request (only with ``serve --allow-request-templates``): its size, and the time,
# memory and output size its rendering may take (rendered in a forked child process that is killed past them).
REQUEST_TEMPLATE_MAX_CHARS = 32 * 1024
REQUEST_TEMPLATE_TIMEOUT_S = 5.0
REQUEST_TEMPLATE_BUDGET_S = 15.0  # all renders of one request together (one per question and variant)
REQUEST_TEMPLATE_MEMORY_BYTES = 512 * 1024 * 1024
REQUEST_TEMPLATE_MAX_OUTPUT = 1024 * 1024

# Usage records (``gateway.usage_writer``): journaled on disk; only when the journal's disk refuses them do they wait
# in memory, at most this many (beyond, they are dropped, counted and logged); written this many a transaction; a
# failed write is retried after a pause doubling up to USAGE_RETRY_MAX_S; a clean stop keeps trying to flush for
# USAGE_FLUSH_TIMEOUT_S (what is left stays in the journal); retention is enforced every USAGE_PURGE_INTERVAL_S.
USAGE_QUEUE_MAX = 100_000
USAGE_BATCH = 500
# The writer writes at most once every USAGE_GATHER_S (a record that comes to an idle writer is written at once), so
# that a busy moment's records (and the budget charges they carry) go in one transaction, not one each.
USAGE_GATHER_S = 0.2
# Rows the writer prepares between two turns of the event loop (a batch's preparation never holds requests up long).
USAGE_SLICE = 32
USAGE_RETRY_MAX_S = 5.0
USAGE_FLUSH_TIMEOUT_S = 15.0
USAGE_PURGE_INTERVAL_S = 3600.0
# The usage journal (``gateway.journal``): other processes' journals on the same directory are looked at this often
# (a replica that died on this host has its records written by a live one); a string longer than its column is cut
# to the column's size, ending in this marker.
USAGE_ORPHAN_SCAN_S = 60.0
USAGE_CUT_MARKER = "…[cut]"
# Seconds a failed usage insert waits for ``SELECT 1`` before it counts the database as down (and retries the batch).
USAGE_PING_TIMEOUT_S = 5.0
# Seconds to connect to PostgreSQL (start-up fails with one line after that; later, a write is retried).
DATABASE_CONNECT_TIMEOUT_S = 10.0
# PostgreSQL ends a transaction whose process has sent nothing for this long (a process stopped, swapped out or
# stalled mid-transaction holds its row locks, and every replica's budget check would wait on them past
# BUDGET_DB_TIMEOUT_S). decisiond's transactions send their statements back to back.
DATABASE_IDLE_TRANSACTION_S = 2.0
# A SQLite write transaction (``Database.write``) waits this long in all for the file's write lock, asking for it
# again every SQLITE_LOCK_POLL_S.
SQLITE_LOCK_WAIT_S = 5.0
SQLITE_LOCK_POLL_S = 0.002
# Budgets: the list is re-read from the database at most this long after the last read (a change on another replica,
# a lowered limit, takes back the room leased under the old one within it); a reservation waits at most
# BUDGET_DB_TIMEOUT_S for the database (then 503; settlements ride on usage rows).
BUDGET_CACHE_S = 1.0
BUDGET_DB_TIMEOUT_S = 3.0
# Budget leases (``gateway.stages.budget_leases``): a process takes room of a budget for up to this many of a
# request's worst case at once (a quarter of the free room at most), gives back room unused for LEASE_IDLE_S, renews
# its live leases every third of budget_reservation_ttl_s, and deletes past windows every LEASE_PURGE_S.
LEASE_CHUNK_REQUESTS = 256
LEASE_IDLE_S = 0.5
LEASE_PURGE_S = 60.0
# GET /admin/audit: rows per page at most.
AUDIT_PAGE_MAX = 1000
# The response cache (``gateway.stages.cache``): seconds an entry lives (in memory and in Redis), and the bytes of
# encoded answers one process keeps in memory (least recently used first out).
CACHE_TTL_S = 3600
CACHE_MAX_BYTES = 64 * 1024 * 1024
# Chat traffic (``gateway.chat``): chunks of an answer waiting between the upstream and a slow client (the
# upstream is read no faster than the client takes them), and the most of a JSON answer, or of one server-sent event
# line, kept to read the usage from (a larger one passes through uncounted, logged).
CHAT_RELAY_CHUNKS = 16
CHAT_USAGE_SCAN_BYTES = 16 * 1024 * 1024
# Of an upstream's error answer, at most this much is read for its message (the rest is drained unread).
UPSTREAM_ERROR_BODY_BYTES = 64 * 1024
# A decision_judge guardrail reads the request's texts joined into one document of at most this many characters; a
# longer one is not judged in part: the guardrail fails, and its fail_mode decides (closed: blocked).
GUARDRAIL_JUDGE_MAX_CHARS = 64 * 1024
# A concurrency slot (rate_limits.concurrent) held in Redis expires this long after it was taken, so that a replica
# that dies holding slots does not hold them for ever (config: concurrency_slot_ttl_s).
CONCURRENCY_SLOT_TTL_S = 3600
# The output tokens a chat answer may bill when its request sets no max_tokens (budgets reserve this much; per model:
# max_output_tokens).
DEFAULT_MAX_OUTPUT_TOKENS = 4096
# A budget hold (a process's lease) not renewed for this long, by the database's clock, is released by whichever
# replica grows a lease on that budget next: its process died elsewhere, or stalled (config: budget_reservation_ttl_s).
# Live processes renew every third of it; one that died on the same host is released at once.
BUDGET_RESERVATION_TTL_S = 15.0
# GET /metrics: question names (from clients) that get a label value of their own in the decision quality metrics,
# per model and server process, by default and at most (config: metrics.question_labels; serve
# --metrics-question-labels); later names are counted as "_other".
DEFAULT_QUESTION_LABELS = 50
MAX_QUESTION_LABELS = 1000

# The Batch API (``gateway.batches``): the largest upload (OpenAI's own limit), lines of one batch answered at once,
# how long a batch stays with a process that has gone silent, the longest custom_id, a batch's metadata (OpenAI's:
# 16 pairs, keys of 64 characters, values of 512), the pages of the list routes, how often a runner looks for work
# and renews its leases, and how many answered lines are written in one transaction (at least every
# BATCH_FLUSH_S).
BATCH_MAX_FILE_BYTES = 200 * 1024 * 1024
# What one key may hold in the files folder (its uploads and its batches' outputs) by default: bytes and files.
BATCH_MAX_BYTES_PER_KEY = 10 * 1024 * 1024 * 1024
BATCH_MAX_FILES_PER_KEY = 1000
BATCH_CONCURRENCY = 8
BATCH_LEASE_S = 30.0
BATCH_MAX_CUSTOM_ID = 512
BATCH_METADATA_PAIRS = 16
BATCH_METADATA_KEY = 64
BATCH_METADATA_VALUE = 512
BATCH_LIST_MAX = 100
FILE_LIST_MAX = 10_000
BATCH_POLL_S = 1.0
BATCH_FLUSH_LINES = 64
# How far past its slowest line in flight a batch answers (what a restart reads back of it stays this small).
BATCH_MAX_AHEAD = 10_000
BATCH_FLUSH_S = 0.25
# Validation errors a failed batch lists (OpenAI's ``errors.data``); the rest are counted in the last one's message.
BATCH_MAX_ERRORS = 100

# Stored decisions (``store: true``): how long they are kept by default, the most labels one request may post, and
# the labelled decisions the accuracy and ECE of ``/metrics`` are computed over (the newest this many per model, read
# again every DECISION_QUALITY_REFRESH_S), in ECE_BINS bins of confidence.
DECISION_RETENTION_DAYS = 30
DECISION_QUALITY_WINDOW = 1000
DECISION_QUALITY_REFRESH_S = 15.0
ECE_BINS = 15
# The stored decisions ``GET /admin/quality`` reads, the newest first.
QUALITY_DECISIONS_MAX = 100_000
# Learned profiles (``POST /admin/learn``): the labelled decisions one learning reads (the newest first), and how often
# each replica reads the active profiles by default.
LEARN_DECISIONS_MAX = 5000
LEARN_PAGE = 200  # of those, read from the database (and turned into samples) at a time
PROFILE_REFRESH_S = 5.0

# Seconds one attempt on a served model (provider ``type: logprobs``) may take when its config sets no ``timeout``:
# a decision is several requests to the server (a question each, more for option orders and calibration), and the
# first request to a server that just started can take seconds; still under the gateway's default deadline.
SERVED_TIMEOUT_S = 9.0
# Seconds a fact learned from a served model's replies is kept (the server behind it, that it ignores a restriction or
# label ids, the most log-probabilities it gives): a server is upgraded, restarted or load-balanced over versions, so
# each is learned again after this long.
SERVED_LEARNED_S = 300.0
