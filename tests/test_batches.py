"""OpenAI's Files and Batch APIs for decisions, through real servers on loopback with the official ``openai`` SDK as
the client: a fake OpenAI-shaped upstream answers the lines, SQLite holds the files' rows and the batches' progress.

Guarantees, each with the test that would catch its breach:
- every line of a batch runs the whole pipeline as the key that made it (its budgets, its rate limits, its usage
  rows): ``test_a_budget_that_runs_out_at_line_30_fails_the_rest_with_402``,
  ``test_a_batch_under_a_rate_limit_waits_for_it_and_fails_no_line``;
- each line is answered once in the output and leaves one usage row, charged once, even when the server is killed
  mid-batch: ``test_sigkill_at_line_20_of_100_then_restart_answers_each_line_once``;
- memory stays bounded whatever the file's size: ``test_a_100000_line_batch_runs_in_bounded_memory``;
- a key sees only its own files and batches: ``test_a_key_sees_only_its_own_files_and_batches``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import upstreams
from servers import start_decisiond

MASTER = "batch-master-key-0123456789"
ALICE = "batch-alice-key-0123456789"
BOB = "batch-bob-key-0123456789abc"
QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}

CONFIG = """
auth:
  master_key: "{master}"
  keys:
    - {{name: alice, key: "{alice}", user_path: /team/a}}
    - {{name: bob, key: "{bob}", user_path: /team/b, rate_limits: {{requests_per_second: 4}}}}
database_url: "sqlite:///{database}"
deadline: 120
providers:
  # Generous timeouts: a line held at a test's gate, or slowed by a loaded machine, is not a timeout.
  - {{name: openai, type: openai, base_url: "{upstream}/v1", api_key: sk-test, timeout: 60,
     pricing: {{per_request: 0.01}}}}
models:
  - {{name: luna, provider: openai, upstream: gpt-6-luna}}
  - {{name: luna-cached, provider: openai, upstream: gpt-6-luna, cache: true}}
  - {{name: metered, provider: openai, upstream: gpt-6-luna}}
budgets:
  - {{model: metered, limit_usd: 0.30, period: daily}}
batches:
  concurrency: {concurrency}
  lease_s: 5
  max_file_bytes: {max_file_bytes}
"""


def write_config(folder: Path, upstream: str, concurrency: int = 4, max_file_bytes: int = 200 * 1024 * 1024) -> Path:
    config = folder / "gateway.yaml"
    config.write_text(CONFIG.format(master=MASTER, alice=ALICE, bob=BOB, database=folder / "gw.sqlite3",
                                    upstream=upstream, concurrency=concurrency, max_file_bytes=max_file_bytes))
    return config


def line(custom_id: str, model: str = "luna", text: str | None = None, questions: list | None = None,
         url: str = "/v1/decisions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "input": text or f"ticket {custom_id}: I was charged twice",
                     "questions": questions or [QUESTION]}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(sdk: openai.OpenAI, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"),
             timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def read_lines(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines() if x.strip()]


def usage_rows(database: Path, batch_id: str) -> list[tuple]:
    with sqlite3.connect(database) as connection:
        return connection.execute("SELECT request_id, status, cost, request_type, key_id FROM usage "
                                  "WHERE batch_id = ? ORDER BY request_id", (batch_id,)).fetchall()


def wait_for_rows(database: Path, batch_id: str, count: int, timeout: float = 30.0) -> list[tuple]:
    deadline = time.monotonic() + timeout
    while True:
        rows = usage_rows(database, batch_id)
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.fixture(scope="module")
def upstream():
    up = upstreams.openai_server()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    server = start_decisiond("--config", str(write_config(folder, upstream.url, max_file_bytes=1024 * 1024)))
    server.database = folder / "gw.sqlite3"
    yield server
    server.stop()


def test_a_round_trip_of_50_lines_with_a_bad_one_answers_the_rest(gateway):
    sdk = client(gateway, ALICE)
    lines = [line(f"ticket-{i}") for i in range(50)]
    lines[17]["body"]["questions"] = [{"type": "predicate", "name": "billing"}]  # no instructions
    uploaded = sdk.files.create(file=("tickets.jsonl", jsonl(lines)), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "tickets.jsonl")
    assert uploaded.bytes == len(jsonl(lines))
    assert sdk.files.retrieve(uploaded.id).id == uploaded.id
    assert sdk.files.content(uploaded.id).content == jsonl(lines)

    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h",
                               metadata={"run": "nightly"})
    assert batch.status == "validating" and batch.request_counts.total == 50
    assert batch.metadata == {"run": "nightly"}
    done = wait_for(sdk, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (50, 49, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at

    output = read_lines(sdk, done.output_file_id)
    errors = read_lines(sdk, done.error_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"ticket-{i}" for i in range(50) if i != 17)
    for item in output:
        response = item["response"]
        assert response["status_code"] == 200 and item["error"] is None
        assert response["body"]["answers"][0]["name"] == "billing"
        assert response["body"]["answers"][0]["probability"] == pytest.approx(0.7)
    assert [e["custom_id"] for e in errors] == ["ticket-17"]
    error = errors[0]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["param"] == "questions[0].instructions"
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"

    rows = wait_for_rows(gateway.database, batch.id, 50)
    assert len(rows) == 50 and len({r[0] for r in rows}) == 50
    assert {r[3] for r in rows} == {"batch"} and {r[4] for r in rows} == {"static:alice"}
    assert sorted(r[1] for r in rows) == [200] * 49 + [400]
    ids = {item["id"] for item in output + errors}
    assert ids == {r[0] for r in rows}  # each output line names the usage row of its request
    assert done.usage.input_tokens == 49 * 50

    listed = sdk.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    assert sdk.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


@pytest.mark.parametrize("content, reason", [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/decisions", "body": {}}\nnot json\n', "line 2 of the file: not valid JSON"),
    (jsonl([line("a"), line("b"), line("a")]), "line 3 of the file: custom_id 'a' is already used on line 1"),
    (jsonl([line("a", url="/v1/chat/completions")]), "line 1 of the file: url must be one of"),
    (jsonl([{**line("a"), "method": "GET"}]), "line 1 of the file: method must be 'POST'"),
    (jsonl([{**line("a"), "body": "ask"}]), "line 1 of the file: body must be a JSON object"),
    (b"\n\n", "the file has no request lines"),
])
def test_a_file_with_a_bad_line_is_refused_naming_the_line(gateway, content, reason):
    sdk = client(gateway, ALICE)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("bad.jsonl", content), purpose="batch")
    assert refused.value.body["param"] == "file"
    assert reason in refused.value.body["message"]


def test_uploads_are_bounded_and_batches_checked(gateway):
    sdk = client(gateway, ALICE)
    big = jsonl([line(f"t{i}", text="x" * 1000) for i in range(1200)])  # over the 1 MiB limit of this server
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.files.create(file=("big.jsonl", big), purpose="batch")
    assert refused.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("a.jsonl", jsonl([line("a")])), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    uploaded = sdk.files.create(file=("a.jsonl", jsonl([line("a")])), purpose="batch")
    for fields, param in [({"endpoint": "/v1/chat/completions"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window"),
                          ({"input_file_id": "file-nope"}, "input_file_id")]:
        arguments = {"input_file_id": uploaded.id, "endpoint": "/v1/decisions", "completion_window": "24h",
                     **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(**arguments)
        assert refused.value.body["param"] == param


def test_lines_for_another_endpoint_fail_the_batch_naming_them(gateway):
    sdk = client(gateway, ALICE)
    lines = [line("a"), line("b", url="/v1/score"), line("c")]
    uploaded = sdk.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
    done = wait_for(sdk, batch.id)
    assert done.status == "failed" and done.failed_at
    assert [(e.line, e.param, e.code) for e in done.errors.data] == [(2, "url", "invalid_url")]


def test_a_key_sees_only_its_own_files_and_batches(gateway):
    alice, bob, master = client(gateway, ALICE), client(gateway, BOB), client(gateway, MASTER)
    uploaded = alice.files.create(file=("mine.jsonl", jsonl([line("a")])), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(uploaded.id), lambda: bob.files.content(uploaded.id),
                 lambda: bob.files.delete(uploaded.id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as refused:  # nor may it run a batch on it
        bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
    assert refused.value.body["param"] == "input_file_id"
    assert uploaded.id not in [f.id for f in bob.files.list()]
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert master.files.retrieve(uploaded.id).id == uploaded.id
    assert batch.id in [b.id for b in master.batches.list(limit=100)]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong-key-0123456789", max_retries=0).files.list()
    wait_for(alice, batch.id)


def test_a_budget_that_runs_out_at_line_30_fails_the_rest_with_402(gateway):
    """The model's budget has room for 30 requests at 0.01 USD: lines 31 to 50 are error lines with the 402 body,
    and the batch goes on to the end."""
    sdk = client(gateway, ALICE)
    uploaded = sdk.files.create(file=("metered.jsonl", jsonl([line(f"m{i}", model="metered") for i in range(50)])),
                                purpose="batch")
    done = wait_for(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions",
                                            completion_window="24h").id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (30, 20)
    errors = read_lines(sdk, done.error_file_id)
    assert len(errors) == 20
    assert {e["response"]["status_code"] for e in errors} == {402}
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"budget_exceeded"}
    rows = wait_for_rows(gateway.database, done.id, 50)
    assert round(sum(r[2] for r in rows), 6) == 0.30


def test_a_batch_under_a_rate_limit_waits_for_it_and_fails_no_line(gateway):
    """Bob may send 4 requests a second: a batch of 12 takes what the limit leaves and waits out each refusal."""
    sdk = client(gateway, BOB)
    uploaded = sdk.files.create(file=("bob.jsonl", jsonl([line(f"b{i}") for i in range(12)])), purpose="batch")
    done = wait_for(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions",
                                            completion_window="24h").id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 12, 0)
    rows = wait_for_rows(gateway.database, done.id, 12)
    assert sorted(r[1] for r in rows) == [200] * 12  # no refusal left a row


def test_a_score_batch_line_is_answered_in_the_score_routes_shape(gateway):
    sdk = client(gateway, ALICE)
    lines = [{"custom_id": "s", "method": "POST", "url": "/v1/score",
              "body": {"model": "luna", "query": "Is this about billing?", "items": ["yes", "no"]}}]
    uploaded = sdk.files.create(file=("score.jsonl", jsonl(lines)), purpose="batch")
    done = wait_for(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/score",
                                            completion_window="24h").id)
    assert done.status == "completed"
    [answer] = read_lines(sdk, done.output_file_id or done.error_file_id)
    assert answer["custom_id"] == "s"
    # The line is answered as POST /v1/score answers it: here SGLang's ErrorResponse, naming the missing field.
    assert answer["response"]["status_code"] == 400
    assert answer["response"]["body"]["object"] == "error"
    assert answer["response"]["body"]["param"] == "label_token_ids"


class Gate:
    """An upstream whose answers wait until the test opens the gate (or lets more through: ``let``): the test, not
    the machine's speed, says when lines are answered. ``count`` counts the requests that arrived, ``asked`` how
    often each input was asked."""

    def __init__(self, open_first: int = 0):
        self.inner = upstreams.openai_server()
        self.opened = threading.Event()
        self.count = 0
        self.open_first = open_first
        self.arrived = threading.Condition()
        self.asked: dict[str, int] = {}
        self.upstream = upstreams.Upstream(self.handle).start()

    def handle(self, seen):
        with self.arrived:
            self.count += 1
            n = self.count
            text = json.dumps(seen.json()["input"])
            again = self.asked.get(text, 0)
            self.asked[text] = again + 1
            self.arrived.notify_all()
            deadline = time.monotonic() + 120
            while n > self.open_first and not self.opened.is_set() and time.monotonic() < deadline:
                self.arrived.wait(0.05)
        status, headers, body = self.inner.handler(seen)
        if again:  # asked again: another answer, so that a test sees which answer a line kept
            for answer in body["answers"]:
                answer["probability"] = 0.55
        return status, headers, body

    def let(self, more: int) -> None:
        """Let ``more`` of the requests that wait (or are still to come) through."""
        with self.arrived:
            self.open_first += more
            self.arrived.notify_all()

    def wait_for(self, count: int, timeout: float = 120.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: self.count >= count, timeout), self.count

    def stop(self) -> None:
        self.opened.set()
        self.upstream.stop()
        self.inner.stop()


def test_cancel_stops_the_batch_and_keeps_what_was_answered(tmp_path):
    gate = Gate(open_first=5)
    server = start_decisiond("--config", str(write_config(tmp_path, gate.upstream.url, concurrency=2)))
    try:
        sdk = client(server, ALICE)
        uploaded = sdk.files.create(file=("c.jsonl", jsonl([line(f"c{i}") for i in range(40)])), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        gate.wait_for(7)  # 5 answered, 2 held at the upstream
        cancelling = sdk.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        gate.opened.set()
        done = wait_for(sdk, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        output = read_lines(sdk, done.output_file_id)
        assert 5 <= len(output) == done.request_counts.completed < 40
        assert gate.count < 40
        with pytest.raises(openai.APIStatusError) as refused:
            sdk.batches.cancel(batch.id)
        assert refused.value.status_code == 409
    finally:
        server.stop()
        gate.stop()


def test_sigkill_at_line_20_of_100_then_restart_answers_each_line_once(tmp_path):
    """The server is killed while line 21 is at the upstream (20 answered); a new server on the same database takes
    the batch up: 100 answers in the output, 100 usage rows, each line's cost charged once to its budget."""
    gate = Gate(open_first=20)
    config = write_config(tmp_path, gate.upstream.url, concurrency=1)
    database = tmp_path / "gw.sqlite3"
    text = config.read_text().replace("limit_usd: 0.30", "limit_usd: 100") + "audit: {log_bodies: true}\n"
    config.write_text(text)
    server = start_decisiond("--config", str(config))
    try:
        sdk = client(server, ALICE)
        uploaded = sdk.files.create(file=("k.jsonl", jsonl([line(f"k{i}", model="metered") for i in range(100)])),
                                    purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        gate.wait_for(21)
        server.process.kill()
        server.process.wait(30)
    finally:
        server.stop()
    gate.opened.set()
    server = start_decisiond("--config", str(config))
    try:
        sdk = client(server, ALICE)
        done = wait_for(sdk, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (100, 0)
        output = read_lines(sdk, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"k{i}" for i in range(100))
        rows = wait_for_rows(database, batch.id, 100)
        assert len(rows) == 100 and len({r[0] for r in rows}) == 100
        assert gate.count >= 100
        spend = httpx.get(server.url + "/admin/budgets", headers={"Authorization": f"Bearer {MASTER}"}).json()
        [metered] = [b for b in spend["data"] if b.get("model") == "metered"]
        assert round(metered["spent_usd"], 6) == 1.0  # 100 lines at 0.01, none charged twice
        assert_output_is_what_was_charged(server, batch.id, output)
    finally:
        server.stop()
        gate.stop()


def assert_output_is_what_was_charged(server, batch_id: str, output: list[dict]) -> None:
    """Each output line's answer is the one its usage row recorded (``audit.log_bodies``): a line answered twice
    keeps the answer that was charged."""
    rows = httpx.get(server.url + "/admin/audit", params={"batch": batch_id, "limit": 1000},
                     headers={"Authorization": f"Bearer {MASTER}"}).json()["data"]
    charged = {r["request_id"]: r["response_body"] for r in rows}
    assert len(charged) == len(output)
    for item in output:
        assert item["response"]["body"] == charged[item["id"]], item["custom_id"]


def test_a_graceful_stop_with_lines_in_flight_loses_none(tmp_path):
    """SIGTERM while two lines wait at the upstream: they are given up, not counted as done; the next server answers
    them, and every line is in the output once, as charged."""
    gate = Gate(open_first=5)
    config = write_config(tmp_path, gate.upstream.url, concurrency=2)
    # The upstream's timeout (60 s) outlasts the stop's grace: the two lines are still waiting when the server gives
    # them up.
    config.write_text(config.read_text() + "audit: {log_bodies: true}\n")
    server = start_decisiond("--config", str(config))
    try:
        sdk = client(server, ALICE)
        uploaded = sdk.files.create(file=("t.jsonl", jsonl([line(f"t{i}") for i in range(20)])), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        gate.wait_for(7)
        server.process.terminate()
        server.process.wait(60)
        assert "Application shutdown complete" in server.log()  # a graceful stop (uvicorn re-raises SIGTERM)
    finally:
        server.stop()
    gate.opened.set()
    server = start_decisiond("--config", str(config))
    try:
        sdk = client(server, ALICE)
        done = wait_for(sdk, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 20, 0), \
            read_lines(sdk, done.error_file_id)
        output = read_lines(sdk, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"t{i}" for i in range(20))
        wait_for_rows(tmp_path / "gw.sqlite3", batch.id, 20)
        assert_output_is_what_was_charged(server, batch.id, output)
    finally:
        server.stop()
        gate.stop()


def _peak_rss_kib(pid: int) -> int:
    for text in Path(f"/proc/{pid}/status").read_text().splitlines():
        if text.startswith("VmHWM:"):
            return int(text.split()[1])
    raise AssertionError("no VmHWM")


def test_a_100000_line_batch_runs_in_bounded_memory(tmp_path, upstream):
    """100,000 lines (about 20 MB; the lines repeat a few bodies, so the exact cache answers most of them): the
    server's peak resident memory grows by far less than the file's lines would take in memory."""
    config = write_config(tmp_path, upstream.url, concurrency=16)
    server = start_decisiond("--config", str(config))
    try:
        sdk = client(server, ALICE)
        warm = sdk.files.create(file=("w.jsonl", jsonl([line(f"w{i}", "luna-cached", f"ticket {i % 10}")
                                                         for i in range(200)])), purpose="batch")
        wait_for(sdk, sdk.batches.create(input_file_id=warm.id, endpoint="/v1/decisions", completion_window="24h").id)
        before = _peak_rss_kib(server.process.pid)
        count = 100_000
        content = jsonl([line(f"line-{i:06d}", "luna-cached", f"ticket {i % 10}") for i in range(count)])
        uploaded = sdk.files.create(file=("big.jsonl", content), purpose="batch")
        del content
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        done = wait_for(sdk, batch.id, timeout=1500)
        assert (done.status, done.request_counts.completed) == ("completed", count)
        seen = 0
        with httpx.stream("GET", f"{server.url}/v1/files/{done.output_file_id}/content",
                          headers={"Authorization": f"Bearer {ALICE}"}, timeout=120) as response:
            for text in response.iter_lines():
                seen += bool(text.strip())
        assert seen == count
        grown_mib = (_peak_rss_kib(server.process.pid) - before) / 1024
        assert grown_mib < 80, grown_mib
    finally:
        server.stop()


def test_a_batch_past_its_window_expires_with_its_unanswered_lines_as_errors(tmp_path):
    """In one process, on a clock the test moves: 3 of 10 lines are answered, then the 24 h window passes while the
    rest wait at the upstream; the batch is ``expired``, its 3 answers in the output and the 7 others in the error
    file as ``batch_expired``."""
    import asyncio

    from decisiond.gateway.config import load
    from decisiond.gateway.router import Router
    from decisiond.gateway.service import Gateway
    from decisiond.server.batch_runner import BatchRunner
    from decisiond.store.batches import BatchStore
    from decisiond.store.tables import BatchJob, StoredFile

    gate = Gate(open_first=3)
    config = load(write_config(tmp_path, gate.upstream.url, concurrency=1))
    now = [1_000_000.0]

    async def scenario():
        gateway = Gateway(Router.from_config(config, {}), config)
        await gateway.start()
        store = BatchStore(gateway.db, tmp_path / "files")
        runner = BatchRunner(gateway, store, config.batches, clock=lambda: now[0])
        store.folder.mkdir()
        (store.folder / "in.jsonl").write_bytes(jsonl([line(f"e{i}") for i in range(10)]))
        await store.add_file(StoredFile(id="file-in", key_id=None, filename="in.jsonl", purpose="batch", bytes=1,
                                        lines=10, path="in.jsonl", created_at=int(now[0]), expires_at=None))
        await store.add_batch(BatchJob(
            id="batch_x", key_id="static:alice", user_path="/team/a", master=False, input_file_id="file-in",
            endpoint="/v1/decisions", completion_window="24h", status="validating", total=10, completed=0,
            failed=0, input_tokens=0, cached_tokens=0, output_tokens=0, next_line=0, created_at=int(now[0]),
            expires_at=int(now[0]) + 86400))
        runner.start()
        try:
            await asyncio.to_thread(gate.wait_for, 4)  # 3 answered, the 4th held at the upstream
            now[0] += 86400
            gate.opened.set()
            for _ in range(600):
                batch = await store.batch("batch_x")
                if batch.status == "expired":
                    break
                await asyncio.sleep(0.1)
            assert batch.status == "expired" and batch.expired_at == int(now[0])
            output, errors = [[json.loads(x) for x in store.path(await store.file(ident)).read_text().splitlines()]
                              for ident in (batch.output_file_id, batch.error_file_id)]
            assert [o["custom_id"] for o in output] == ["e0", "e1", "e2", "e3"]
            assert [e["custom_id"] for e in errors] == [f"e{i}" for i in range(4, 10)]
            assert {e["error"]["code"] for e in errors} == {"batch_expired"}
            assert (batch.completed, batch.failed) == (4, 6)
        finally:
            await runner.aclose()
            await gateway.aclose()

    try:
        asyncio.run(scenario())
    finally:
        gate.stop()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "_total{"))


@pytest.fixture(scope="module")
def local_server(tiny_dir, tmp_path_factory):
    """The tiny random model served with no config and no keys: the Batch API keeps its rows in the default SQLite
    file of the server's own data directory."""
    server = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny",
                             env={"DECISIOND_DATA_DIR": str(tmp_path_factory.mktemp("local"))})
    yield server
    server.stop()


def test_the_guides_batch_api_example_runs(local_server, tmp_path):
    import subprocess
    import sys

    from test_docs import DOCS, _against, _env, blocks

    [block] = [b for b in blocks(DOCS / "guides" / "batch.md") if "client.batches.create" in b.text]
    done = subprocess.run([sys.executable, "-c", _against(local_server.url, block.text)], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [x.split()[0] for x in done.stdout.splitlines()] == ["ticket-0", "ticket-1"]


def test_lines_on_a_local_model_share_their_input_and_answer_as_the_route_does(local_server):
    """Six lines asking about one document on a local model: each answer is the one ``POST /v1/decisions`` gives
    for its body, and the document is computed about once, not six times (prefix sharing and the prefix cache)."""
    server = local_server
    document = "Order 1234 was charged twice and the customer asks for a refund. " * 12
    questions = [{"type": "predicate", "name": f"q{i}", "instructions": f"Is point {i} raised?"}
                 for i in range(6)]
    lines = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/decisions",
              "body": {"model": "tiny", "input": document, "questions": [questions[i]]}} for i in range(6)]
    sdk = client(server, "none")
    requested, computed = _metric(server, "decisiond_engine_tokens_requested"), _metric(
        server, "decisiond_engine_tokens_computed")
    uploaded = sdk.files.create(file=("local.jsonl", jsonl(lines)), purpose="batch")
    done = wait_for(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions",
                                            completion_window="24h").id)
    assert (done.status, done.request_counts.completed) == ("completed", 6)
    requested = _metric(server, "decisiond_engine_tokens_requested") - requested
    computed = _metric(server, "decisiond_engine_tokens_computed") - computed
    assert requested > 6 * 100 and computed < requested / 2, (requested, computed)
    for item in read_lines(sdk, done.output_file_id):
        body = lines[int(item["custom_id"][1:])]["body"]
        direct = httpx.post(server.url + "/v1/decisions", json=body, timeout=120).json()
        answer = item["response"]["body"]["answers"][0]
        assert answer["probability"] == pytest.approx(direct["answers"][0]["probability"], abs=1e-5)


def test_two_replicas_on_postgres_run_a_batch_once_and_take_it_over_when_one_dies(tmp_path):
    """Replica A runs a batch of 60 lines on PostgreSQL and is killed with line 21 at the upstream; replica B, on
    the same database and files folder, takes the batch over: 60 answers, 60 usage rows, none twice."""
    from services import start_postgres

    postgres = start_postgres()
    gate = Gate(open_first=20)
    config = write_config(tmp_path, gate.upstream.url, concurrency=1)
    config.write_text(config.read_text().replace(f"sqlite:///{tmp_path / 'gw.sqlite3'}", postgres.url)
                      + f"  files_path: {tmp_path / 'files'}\n")
    a = start_decisiond("--config", str(config))
    b = None
    try:
        sdk = client(a, ALICE)
        uploaded = sdk.files.create(file=("r.jsonl", jsonl([line(f"r{i}") for i in range(60)])), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        gate.wait_for(21)
        b = start_decisiond("--config", str(config))
        a.process.kill()
        a.process.wait(30)
        gate.opened.set()
        sdk = client(b, ALICE)
        done = wait_for(sdk, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 60, 0), \
            read_lines(sdk, done.error_file_id)
        assert sorted(o["custom_id"] for o in read_lines(sdk, done.output_file_id)) == sorted(
            f"r{i}" for i in range(60))
        deadline = time.monotonic() + 30
        while True:
            rows = httpx.get(b.url + "/admin/audit", params={"batch": batch.id, "limit": 1000},
                             headers={"Authorization": f"Bearer {MASTER}"}).json()["data"]
            if len(rows) >= 60 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert len(rows) == 60 and len({r["request_id"] for r in rows}) == 60
    finally:
        a.stop()
        if b is not None:
            b.stop()
        gate.stop()
        postgres.remove()
