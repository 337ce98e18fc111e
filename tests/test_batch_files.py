"""The files of the Files and Batch APIs: each key's quota, the expiry of batch outputs, the folder's modes and the
sweeping of what interrupted uploads leave — through real servers on loopback with the official ``openai`` SDK (or,
where the test moves the runner's clock, the real app in process, the SDK on an ASGI transport).

Guarantee (docs/guarantees.md, "Files are private to their key and to the OS user, and no key can fill the disk"),
each with the test that would catch its breach:
- a key at its quota is refused, naming the limit, while other keys upload and the master key is not limited; its
  batches' outputs count: ``test_a_key_at_its_quota_is_refused_naming_the_limit_while_another_key_uploads``;
- uploads made at once by one key, on one server or on two replicas, never pass its quota together:
  ``test_ten_uploads_at_once_by_one_key_never_pass_its_quota``;
- output and error files expire as ``output_expires_after`` says, then 404:
  ``test_output_files_expire_as_output_expires_after_says_then_404``;
- files 0600 and folders 0700 under umask 022: ``test_files_and_folders_are_private_under_umask_022``,
  ``test_an_uploads_temporary_files_are_private_while_it_is_copied``;
- temporary files of dead uploads are swept at start, a live upload's kept:
  ``test_leftovers_of_interrupted_uploads_are_swept_at_start_and_live_ones_kept``.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import upstreams
from servers import start_decisiond
from test_batches import ALICE, BOB, MASTER, client, jsonl, line, read_lines, wait_for, write_config

QUOTA_CODE = "file_quota_exceeded"


@pytest.fixture(scope="module")
def upstream():
    up = upstreams.openai_server()
    yield up
    up.stop()


def with_quota(config: Path, max_bytes: int, max_files: int, extra: str = "") -> Path:
    """The test config with a quota in its ``batches`` section (and ``extra`` lines of that section)."""
    config.write_text(config.read_text() + f"  max_bytes_per_key: {max_bytes}\n  max_files_per_key: {max_files}\n"
                      + extra)
    return config


def refused_over_quota(call) -> dict:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    body = refused.value.body
    assert refused.value.status_code == 400
    assert (body["code"], body["param"], body["type"]) == (QUOTA_CODE, "file", "invalid_request_error"), body
    return body


def uploads_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("file-"))


def temporary_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_key_at_its_quota_is_refused_naming_the_limit_while_another_key_uploads(tmp_path, upstream):
    """Alice may hold three files of S bytes: the fourth is refused naming max_bytes_per_key, nothing of it kept,
    while Bob uploads and the master key is not limited; a fifth small file passes the file count; a batch's output
    counts against her quota until she deletes it."""
    one = jsonl([line(f"q{i}") for i in range(5)])
    two = jsonl([line(f"r{i}") for i in range(10)])
    folder = tmp_path / "files"
    config = with_quota(write_config(tmp_path, upstream.url), 3 * len(one), 4, f"  files_path: {folder}\n")
    server = start_decisiond("--config", str(config))
    try:
        alice, bob, master = client(server, ALICE), client(server, BOB), client(server, MASTER)
        held = [alice.files.create(file=("q.jsonl", one), purpose="batch") for _ in range(3)]  # at her quota
        body = refused_over_quota(lambda: alice.files.create(file=("q.jsonl", one), purpose="batch"))
        assert "batches.max_bytes_per_key" in body["message"] and str(3 * len(one)) in body["message"]
        assert ALICE not in body["message"]
        assert len(alice.files.list().data) == 3 and len(uploads_in(folder)) == 3 and not temporary_in(folder)

        for _ in range(3):  # another key has its own quota
            bob.files.create(file=("b.jsonl", one), purpose="batch")
        for _ in range(5):  # the master key has none
            master.files.create(file=("m.jsonl", two), purpose="batch")

        alice.files.delete(held[0].id)  # room for two small files: 4 files, under the bytes
        small = alice.files.create(file=("s.jsonl", jsonl([line("s")])), purpose="batch")
        extra = alice.files.create(file=("t.jsonl", jsonl([line("t")])), purpose="batch")
        body = refused_over_quota(lambda: alice.files.create(file=("u.jsonl", jsonl([line("u")])), purpose="batch"))
        assert "batches.max_files_per_key (4)" in body["message"]

        for ident in (held[1].id, held[2].id, extra.id):
            alice.files.delete(ident)
        batch = alice.batches.create(input_file_id=small.id, endpoint="/v1/decisions", completion_window="24h")
        done = wait_for(alice, batch.id)
        assert done.status == "completed" and done.output_file_id
        output = alice.files.retrieve(done.output_file_id)
        assert output.purpose == "batch_output" and output.bytes > 0
        # Alice holds the small input and the output: a file of the bytes the input leaves fits only without it.
        rest = 3 * len(one) - small.bytes
        fill = jsonl([line("fill", text="x" * (1 + rest - len(jsonl([line("fill", text="x")]))))])
        assert len(fill) == rest
        refused_over_quota(lambda: alice.files.create(file=("f.jsonl", fill), purpose="batch"))
        alice.files.delete(done.output_file_id)
        alice.files.create(file=("f.jsonl", fill), purpose="batch")
    finally:
        server.stop()


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_ten_uploads_at_once_by_one_key_never_pass_its_quota(tmp_path, upstream, database):
    """Ten uploads of S bytes at once against a quota of 3.5 S: three are kept, seven refused with
    file_quota_exceeded, and nothing of them is left in the folder. On PostgreSQL the ten go to two replicas sharing
    the database and the folder."""
    content = jsonl([line(f"c{i}") for i in range(20)])
    folder = tmp_path / "files"
    config = with_quota(write_config(tmp_path, upstream.url), 3 * len(content) + len(content) // 2, 100,
                        f"  files_path: {folder}\n")
    postgres = None
    if database == "postgres":
        from services import start_postgres

        postgres = start_postgres()
        config.write_text(config.read_text().replace(f"sqlite:///{tmp_path / 'gw.sqlite3'}", postgres.url))
    servers = [start_decisiond("--config", str(config)) for _ in range(2 if postgres else 1)]
    try:
        start = threading.Barrier(10)
        outcomes: list[object] = [None] * 10

        def upload(i: int) -> None:
            sdk = client(servers[i % len(servers)], ALICE)
            start.wait(30)
            try:
                outcomes[i] = sdk.files.create(file=(f"c{i}.jsonl", content), purpose="batch").id
            except openai.APIStatusError as error:
                outcomes[i] = error

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        kept = [o for o in outcomes if isinstance(o, str)]
        refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
        assert len(kept) == 3 and len(refused) == 7, outcomes
        assert {(e.status_code, e.body["code"]) for e in refused} == {(400, QUOTA_CODE)}
        listed = client(servers[0], ALICE).files.list().data
        assert sorted(f.id for f in listed) == sorted(kept)
        assert sum(f.bytes for f in listed) == 3 * len(content)
        assert uploads_in(folder) == sorted(f"{ident}.jsonl" for ident in kept) and not temporary_in(folder)
    finally:
        for server in servers:
            server.stop()
        if postgres is not None:
            postgres.remove()


def test_output_files_expire_as_output_expires_after_says_then_404(tmp_path, upstream):
    """The real app in process, on a clock the test moves: a batch made with output_expires_after of an hour has
    output and error files that expire an hour after they were written; an hour on, the runner's housekeeping has
    deleted them (404, their bytes gone) and kept the input (30 days). Bounds are OpenAI's, each refusal naming the
    field."""
    import asyncio

    from decisiond.gateway.config import load
    from decisiond.gateway.router import Router
    from decisiond.gateway.service import Gateway
    from decisiond.server.app import create_app
    from decisiond.server.batch_runner import BatchRunner
    from decisiond.store.batches import BatchStore

    config = load(write_config(tmp_path, upstream.url))
    now = [2_000_000.0]
    lines = [line("ok"), line("bad")]
    lines[1]["body"]["questions"] = [{"type": "predicate", "name": "billing"}]  # no instructions: an error line

    async def scenario() -> None:
        router = Router.from_config(config, {})
        gateway = Gateway(router, config)
        await gateway.start()
        app = create_app(router, gateway=gateway)
        runner = app.state.batches = BatchRunner(gateway, BatchStore(gateway.db, tmp_path / "files"),
                                                 config.batches, clock=lambda: now[0])
        runner.start()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60)
        sdk = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=ALICE, http_client=http, max_retries=0)
        try:
            source = await sdk.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
            for policy, param in [({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds"),
                                  ({"anchor": "created_at", "seconds": 30 * 86400 + 1}, "output_expires_after.seconds"),
                                  ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor"),
                                  ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds")]:
                with pytest.raises(openai.BadRequestError) as refused:
                    await sdk.batches.create(input_file_id=source.id, endpoint="/v1/decisions",
                                             completion_window="24h", output_expires_after=policy)
                assert refused.value.body["param"] == param, refused.value.body
            batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/decisions",
                                             completion_window="24h",
                                             output_expires_after={"anchor": "created_at", "seconds": 3600})
            for _ in range(600):
                batch = await sdk.batches.retrieve(batch.id)
                if batch.status == "completed":
                    break
                await asyncio.sleep(0.1)
            assert batch.status == "completed" and batch.output_file_id and batch.error_file_id
            written = [await sdk.files.retrieve(ident) for ident in (batch.output_file_id, batch.error_file_id)]
            for row in written:
                assert row.expires_at == row.created_at + 3600
            paths = [runner.store.path(await runner.store.file(row.id)) for row in written]
            assert all(path.exists() for path in paths)

            now[0] = written[0].created_at + 3600  # the hour has passed
            runner.wake()
            for _ in range(300):
                if [await runner.store.file(row.id) for row in written] == [None, None]:
                    break
                await asyncio.sleep(0.1)
            for row in written:
                with pytest.raises(openai.NotFoundError):
                    await sdk.files.retrieve(row.id)
                with pytest.raises(openai.NotFoundError):
                    await sdk.files.content(row.id)
            assert not any(path.exists() for path in paths)
            kept = await sdk.files.retrieve(source.id)
            assert kept.expires_at == kept.created_at + 30 * 86400
        finally:
            await http.aclose()
            await runner.aclose()
            await gateway.aclose()

    asyncio.run(scenario())


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_files_and_folders_are_private_under_umask_022(tmp_path, upstream):
    """A server whose umask is 022 (files 0644, folders 0755 by default), its files folder three levels it makes:
    every folder 0700, every file (the upload, the output and error files) 0600."""
    base = tmp_path / "private"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    folder = base / "a" / "b" / "files"
    config = write_config(tmp_path, upstream.url)
    config.write_text(config.read_text() + f"  files_path: {folder}\n")
    server = start_decisiond("--config", str(config), umask=0o022)
    try:
        sdk = client(server, ALICE)
        lines = [line("ok"), line("bad")]
        lines[1]["body"]["questions"] = [{"type": "predicate", "name": "billing"}]
        source = sdk.files.create(file=("p.jsonl", jsonl(lines)), purpose="batch")
        done = wait_for(sdk, sdk.batches.create(input_file_id=source.id, endpoint="/v1/decisions",
                                                completion_window="24h").id)
        assert done.output_file_id and done.error_file_id
        assert read_lines(sdk, done.output_file_id)
        modes = _modes(base / "a")
        folders = {name for name in modes if (base / "a" / name).is_dir()}
        assert folders == {".", "b", "b/files"}
        assert {modes[name] for name in folders} == {0o700}, modes
        files = {name: mode for name, mode in modes.items() if name not in folders}
        assert len(files) == 3 and set(files.values()) == {0o600}, modes  # the upload, the output, the errors
    finally:
        server.stop()


class _Watching(io.BytesIO):
    """An upload's content that notes the modes of what is in ``folder`` each time a line is read from it."""

    def __init__(self, data: bytes, folder: Path):
        super().__init__(data)
        self.folder = folder
        self.seen: dict[str, int] = {}

    def readline(self, size: int | None = -1) -> bytes:
        if self.folder.exists():
            self.seen.update({p.name: stat.S_IMODE(p.stat().st_mode) for p in self.folder.iterdir()})
        return super().readline(size)


def test_an_uploads_temporary_files_are_private_while_it_is_copied(tmp_path):
    """Under umask 022, while an upload is copied: its .part file and its custom-id SQLite file are 0600, named
    after the file and this process, in a folder made 0700; once done, only the upload is left, 0600."""
    from decisiond.server.batch_api import _check_and_copy
    from decisiond.store.processes import process_mark

    folder = tmp_path / "made" / "files"
    source = _Watching(jsonl([line(f"w{i}") for i in range(3)]), folder)
    previous = os.umask(0o022)
    try:
        assert _check_and_copy(source, folder, "file-0123abcd", 1 << 20, 1 << 20)[1] == 3
    finally:
        os.umask(previous)
    stem = f".file-0123abcd.{process_mark()}"
    assert source.seen == {f"{stem}.part": 0o600, f"{stem}.custom-ids.sqlite3": 0o600}
    assert [p.name for p in folder.iterdir()] == ["file-0123abcd.jsonl"]
    assert stat.S_IMODE((folder / "file-0123abcd.jsonl").stat().st_mode) == 0o600
    assert {stat.S_IMODE(p.stat().st_mode) for p in (folder, folder.parent)} == {0o700}


def test_leftovers_of_interrupted_uploads_are_swept_at_start_and_live_ones_kept(tmp_path, upstream):
    """A files folder (0755) holding the temporary files of uploads: those of a dead process of this host and those
    over an hour old go when a server starts on it; those of a live process (this one), of another host's process
    still young, and stored files stay. The folder is made 0700."""
    from decisiond.store.processes import process_mark

    folder = tmp_path / "files"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    dead = subprocess.Popen(["true"])
    dead.wait()
    digest = process_mark().split("-")[0]
    here_dead, here_live, elsewhere = f"{digest}-{dead.pid}", process_mark(), "0badc0ffee00-4242"
    names = {
        f".file-aa11.{here_dead}.part": "swept", f".file-aa11.{here_dead}.custom-ids.sqlite3": "swept",
        f".file-bb22.{here_live}.part": "kept", f".file-bb22.{here_live}.custom-ids.sqlite3": "kept",
        f".file-cc33.{elsewhere}.part": "kept", f".file-dd44.{elsewhere}.part": "old",
        ".custom-ids-0123456789abcdef.sqlite3": "old", ".custom-ids-fedcba9876543210.sqlite3": "kept",
        ".file-ee55.jsonl.part": "old", ".file-ff66.0a1b2c3d.tmp": "old", "file-0123.jsonl": "old-stored",
    }
    hours_ago = time.time() - 2 * 3600
    for name, fate in names.items():
        (folder / name).write_bytes(b"x")
        if fate.startswith("old"):
            os.utime(folder / name, (hours_ago, hours_ago))
    config = write_config(tmp_path, upstream.url)
    config.write_text(config.read_text() + f"  files_path: {folder}\n")
    server = start_decisiond("--config", str(config))
    try:
        expected = sorted(name for name, fate in names.items() if fate in ("kept", "old-stored"))
        deadline = time.monotonic() + 60
        while sorted(p.name for p in folder.iterdir()) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(p.name for p in folder.iterdir()) == expected
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert "temporary files of interrupted work deleted" in server.log()
    finally:
        server.stop()
