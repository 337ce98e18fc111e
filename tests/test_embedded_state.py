"""Out of the box: the embedded default, with no config and no key, keeps its state in the default SQLite file of its
data directory and serves every route — the Files and Batch APIs through the official ``openai`` SDK, usage rows, and
the decisions a model stores (``store: true``) — while a server without keys stays without keys on loopback. A
gateway-only install (no torch) serves upstreams and refuses a local model naming the engine extra; ``serve`` takes
its settings from ``DECISIOND_*`` variables, and a bad one is refused naming it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import upstreams
from servers import free_port, run_decisiond, start_decisiond

QUESTION = {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}
LINE = ('{{"custom_id": "t{n}", "method": "POST", "url": "/v1/decisions", "body": {{"model": "tiny", "input": '
        '"ticket {n}", "questions": [{{"type": "predicate", "name": "billing", "instructions": "Billing?"}}]}}}}\n')

STORED = """
providers:
  - {name: up, type: openai, base_url: "${UP}/v1"}
models:
  - {name: luna, provider: up, upstream: gpt-6-luna, store: true}
"""

# A gateway-only install, in this venv: torch and transformers cannot be imported.
WITHOUT_TORCH = """
import sys
for name in ("torch", "transformers", "gguf", "accelerate"):
    sys.modules[name] = None
from decisiond import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def upstream():
    up = upstreams.openai_server()
    yield up
    up.stop()


def rows(database: Path, table: str) -> int:
    with sqlite3.connect(database) as connection:
        return int(connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def test_the_embedded_default_keeps_files_batches_and_usage_in_its_default_file_and_stays_keyless(tiny_dir,
                                                                                                  tmp_path):
    data = tmp_path / "data"
    made = run_decisiond("keys", "create", "--name", "old", env={**os.environ, "DECISIOND_DATA_DIR": str(data)})
    assert made.returncode == 0, made.stderr  # a managed key in the default file: never asked for below
    server = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny", umask=0o022,
                             env={"DECISIOND_DATA_DIR": str(data)})
    try:
        assert httpx.post(server.url + "/v1/decisions", timeout=60, json={
            "model": "tiny", "input": "I was charged twice.", "questions": [QUESTION]}).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        upload = client.files.create(file=("t.jsonl", "".join(LINE.format(n=n) for n in range(3)).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/decisions", completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            time.sleep(0.3)
            batch = client.batches.retrieve(batch.id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 3)
        assert len(client.files.content(batch.output_file_id).text.splitlines()) == 3
        assert httpx.get(server.url + "/admin/keys", timeout=30).status_code in (401, 403)  # no master key
        database = data / "decisiond.sqlite3"
        deadline = time.monotonic() + 30
        while rows(database, "usage") < 4 and time.monotonic() < deadline:  # the request and three lines
            time.sleep(0.2)
        assert rows(database, "usage") == 4 and rows(database, "batches") == 1 and rows(database, "files") == 2
        assert (data.stat().st_mode & 0o777, database.stat().st_mode & 0o777) == (0o700, 0o600)
        wal = database.with_name(database.name + "-wal")
        assert not wal.exists() or wal.stat().st_mode & 0o777 == 0o600
    finally:
        server.stop()


def test_a_config_without_a_database_url_keeps_the_decisions_its_model_stores(upstream, tmp_path):
    (tmp_path / "gateway.yaml").write_text(STORED)
    data = tmp_path / "data"
    server = start_decisiond("--config", str(tmp_path / "gateway.yaml"),
                             env={"UP": upstream.url, "DECISIOND_DATA_DIR": str(data)})
    try:
        answered = httpx.post(server.url + "/v1/decisions", timeout=60, json={
            "model": "luna", "input": "I was charged twice.", "questions": [QUESTION]})
        assert answered.status_code == 200, answered.text
        request_id = answered.headers["x-request-id"]
        labelled = httpx.post(f"{server.url}/v1/decisions/{request_id}/labels", json={"labels": {"billing": True}},
                              timeout=30)
        assert labelled.status_code == 200, labelled.text
        assert labelled.json()["labels"] == {"billing": True}
        assert rows(data / "decisiond.sqlite3", "decisions") == 1
    finally:
        server.stop()


def _without_torch(*args: str, data: Path, env: dict[str, str] | None = None,
                   timeout: float = 60) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WITHOUT_TORCH, *args], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "DECISIOND_DATA_DIR": str(data), **(env or {})})


def test_a_gateway_only_install_serves_upstreams_and_refuses_a_local_model_naming_the_engine_extra(upstream,
                                                                                                 tmp_path):
    refused = _without_torch("serve", "--port", str(free_port()), data=tmp_path / "refused")
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2, out
    assert "decisiond[engine]" in out and "torch cannot be imported" in out
    assert not (tmp_path / "refused").exists()  # refused before any database is opened
    (tmp_path / "gateway.yaml").write_text(STORED)
    port = free_port()
    gateway = _without_torch("serve", "--config", str(tmp_path / "gateway.yaml"), "--port", str(port),
                             data=tmp_path / "data", env={"UP": upstream.url})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert gateway.poll() is None and time.monotonic() < deadline, gateway.communicate()[0]
            try:
                answered = httpx.post(f"http://127.0.0.1:{port}/v1/decisions", timeout=30, json={
                    "model": "luna", "input": "I was charged twice.", "questions": [QUESTION]})
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert answered.status_code == 200, answered.text
    finally:
        gateway.terminate()
        assert gateway.wait(60) in (0, -15)  # uvicorn raises SIGTERM again once it has stopped


@pytest.mark.parametrize("name,value", [("DECISIOND_WORKERS", "two"), ("DECISIOND_WORKERS", "0"),
                                        ("DECISIOND_PORT", "99999")])
def test_a_serve_setting_from_the_environment_that_cannot_be_used_is_refused_naming_it(name, value, tmp_path):
    done = run_decisiond("serve", env={**os.environ, name: value, "DECISIOND_DATA_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"decisiond: {name} must be a whole number from ")


def test_serve_reads_its_config_and_address_from_the_environment(upstream, tmp_path):
    (tmp_path / "gateway.yaml").write_text(STORED)
    port = free_port()
    server = start_decisiond(env={"DECISIOND_CONFIG": str(tmp_path / "gateway.yaml"), "UP": upstream.url,
                                  "DECISIOND_PORT": str(port), "DECISIOND_DATA_DIR": str(tmp_path / "data")})
    try:  # the command line (--port from start_decisiond) wins over DECISIOND_PORT
        assert f"http://127.0.0.1:{port}" != server.url
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["luna"]
    finally:
        server.stop()
