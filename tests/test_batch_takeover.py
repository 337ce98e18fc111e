"""A batch taken over from a holder killed mid-batch while another server on the host is already running (not a
restart): the dead holder's usage journal is written before the new holder asks any line, so no line whose answer
was journaled is asked again, and each line is answered and charged once (docs/guarantees.md, "A batch line is
answered and charged once")."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from servers import start_decisiond
from test_batches import (
    ALICE,
    Gate,
    assert_output_is_what_was_charged,
    client,
    jsonl,
    line,
    read_lines,
    wait_for,
    wait_for_rows,
    write_config,
)


def journaled(journal: Path, pid: int, batch_id: str) -> list[dict]:
    """The records of ``batch_id`` in process ``pid``'s usage journal."""
    found = []
    for segment in journal.glob(f"{pid}-*.jsonl"):
        for text in segment.read_text().splitlines():
            if batch_id in text:
                found.append(json.loads(text))
    return found


def test_a_holder_killed_mid_batch_beside_a_running_server_has_no_journaled_line_asked_again(tmp_path):
    """Server A runs a batch of 40 lines, 8 at once; server B runs beside it. With the database locked (so that
    neither A's usage writer nor its runner can store anything), A answers 8 lines: their answers are in A's journal
    only. A is killed (SIGKILL), the lock released: B takes the batch at once, and must write A's journal before it
    asks a line — the background scan would find it only a minute later. Every line is asked of the upstream once
    (an upstream that answers differently when asked again), the output is what was charged, 40 rows, 40 charges."""
    gate = Gate(open_first=0)
    config = write_config(tmp_path, gate.upstream.url, concurrency=8)
    config.write_text(config.read_text().replace("lease_s: 5", "lease_s: 30") + "audit: {log_bodies: true}\n")
    database = tmp_path / "gw.sqlite3"
    journal = tmp_path / "gw.sqlite3.usage-journal"
    a = start_decisiond("--config", str(config))
    b = None
    locker = None
    try:
        sdk = client(a, ALICE)
        uploaded = sdk.files.create(file=("t.jsonl", jsonl([line(f"t{i}") for i in range(40)])), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/decisions", completion_window="24h")
        gate.wait_for(8)  # A holds the batch; 8 lines wait at the upstream
        b = start_decisiond("--config", str(config))
        locker = sqlite3.connect(database, isolation_level=None, timeout=30)
        locker.execute("BEGIN IMMEDIATE")  # no writer gets the database's write lock now
        gate.let(8)
        deadline = time.monotonic() + 30
        while len(journaled(journal, a.process.pid, batch.id)) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        records = journaled(journal, a.process.pid, batch.id)
        assert len(records) == 8 and all(r.get("batch_line") for r in records), records
        a.process.kill()
        a.process.wait(30)
        locker.rollback()
        locker.close()
        locker = None
        gate.opened.set()

        sdk = client(b, ALICE)
        done = wait_for(sdk, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 40, 0)
        assert len(gate.asked) == 40
        twice = sorted(text for text, times in gate.asked.items() if times > 1)
        assert not twice, f"asked again although journaled by the dead holder: {twice}"
        output = read_lines(sdk, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"t{i}" for i in range(40))
        assert all(o["response"]["body"]["answers"][0]["probability"] == pytest.approx(0.7) for o in output)
        rows = wait_for_rows(database, batch.id, 40)
        assert len(rows) == 40 and len({r[0] for r in rows}) == 40
        assert round(sum(r[2] for r in rows), 6) == 0.40  # 40 lines at 0.01, none charged twice
        assert_output_is_what_was_charged(b, batch.id, output)
    finally:
        if locker is not None:
            locker.close()
        a.stop()
        if b is not None:
            b.stop()
        gate.stop()
