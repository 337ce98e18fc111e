"""A setting that cannot work stops ``decisiond serve`` at start-up with exit 2 and one line naming the setting and
the cause, never a traceback: an unsupported or unreachable database, a Redis URL of another scheme, a usage journal
that cannot be written. (A setting the config's validation refuses is named with the file and its line too.)"""

from __future__ import annotations

import os

import pytest
from servers import free_port, run_decisiond

CONFIG = """
auth: {master_key: mk-startup-0123456789abcdef}
providers:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: sk-test}
models:
  - {name: luna, provider: openai, upstream: gpt-6-luna}
"""


def refusal(tmp_path, extra: str = "", env: dict[str, str] | None = None) -> str:
    """Run ``serve`` on CONFIG + ``extra``: it must exit 2 with no traceback; the one line it printed."""
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG + extra)
    done = run_decisiond("serve", "--port", str(free_port()), "--config", str(config), timeout=120,
                         env={**os.environ, "DECISIOND_DATA_DIR": str(tmp_path / "data"), **(env or {})})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("decisiond: ")]
    assert len(lines) == 1 and done.stderr.rstrip().endswith(lines[0]), done.stderr
    return lines[0]


@pytest.mark.parametrize(("extra", "env", "expected"), [
    ('database_url: "mysql://user@localhost/db"\n', {},
     "decisiond: database_url: mysql:// is not supported: use a sqlite:// or postgresql:// URL"),
    ("", {"DECISIOND_DATABASE_URL": "mysql+aiomysql://user@localhost/db"},
     "decisiond: DECISIOND_DATABASE_URL: mysql+aiomysql:// is not supported"),
    ('database_url: "not a url"\n', {}, "decisiond: database_url: Could not parse"),
    ('redis_url: "http://127.0.0.1:6379"\n', {},
     "decisiond: {config}:7: redis_url: a Redis URL must start with redis:// or rediss://, not http://"),
    ("cache: {redis_url: 127.0.0.1:6379}\n", {}, "decisiond: {config}:7: cache.redis_url: a Redis URL must start with"),
    ("", {"DECISIOND_REDIS_URL": "unix:///tmp/redis.sock"}, "decisiond: DECISIOND_REDIS_URL: a Redis URL must"),
])
def test_an_unsupported_url_is_one_line(tmp_path, extra, env, expected):
    assert refusal(tmp_path, extra, env).startswith(expected.replace("{config}", str(tmp_path / "gateway.yaml")))


def test_an_unreachable_postgresql_is_one_line_naming_it_without_its_password(tmp_path):
    port = free_port()  # nothing listens there
    line = refusal(tmp_path, f'database_url: "postgresql://decisiond:hunter2@127.0.0.1:{port}/usage"\n')
    assert line.startswith(f"decisiond: database_url: cannot open postgresql://decisiond:***@127.0.0.1:{port}/usage: ")
    # asyncio says "Connect call failed", uvloop "Connection refused": either names the cause
    assert ("Connect call failed" in line or "Connection refused" in line) and "hunter2" not in line
    line = refusal(tmp_path, env={"DECISIOND_DATABASE_URL": f"postgresql://u@127.0.0.1:{port}/usage"})
    assert line.startswith("decisiond: DECISIOND_DATABASE_URL: cannot open")


def test_a_sqlite_file_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    line = refusal(tmp_path, f'database_url: "sqlite:///{tmp_path}/a-file/usage.sqlite3"\n')
    assert line.startswith("decisiond: database_url: cannot open sqlite:///")


def test_an_unwritable_usage_journal_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    journal = tmp_path / "a-file" / "journal"
    line = refusal(tmp_path, f'database_url: "sqlite:///{tmp_path}/usage.sqlite3"\nusage_journal: "{journal}"\n')
    assert line == f"decisiond: usage_journal: cannot write the usage journal in {journal}: Not a directory"
    line = refusal(tmp_path, f'database_url: "sqlite:///{tmp_path}/usage.sqlite3"\n',
                   {"DECISIOND_USAGE_JOURNAL": str(journal)})
    assert line.startswith("decisiond: DECISIOND_USAGE_JOURNAL: cannot write the usage journal")
