"""The command line refuses a file it cannot use as the server refuses a request: one line on stderr, ``decisiond:
FILE:LINE: FIELD: what is wrong`` (the line where the format has lines, the field as the server names it), exit code
2, never a traceback, and before any model loads. Every subcommand that takes a file is run here, as a user runs it
(a new interpreter), on a missing file, a file of the wrong shape and a config it cannot use; a subcommand, or a
``--config`` or ``--calibration`` option, without cases here fails ``test_every_subcommand_has_its_cases``.

And every ``--help`` names the docs page that explains the command (``decisiond.cli.DOCS``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decisiond.cli import DOCS, build_parser, docs_epilog

ROOT = Path(__file__).resolve().parent.parent

QUESTION = {"type": "predicate", "name": "billing", "instructions": "The message is about billing."}
LABELED = {"input": "My card was charged twice.", "questions": [QUESTION], "gold": {"billing": True}}

# The files the cases name under the test's folder ({tmp}); "missing.*" and "folder" are not files.
FILES = {
    "labeled.jsonl": json.dumps(LABELED) + "\n",
    # the measured case: ``question`` where ``questions`` belongs
    "question.jsonl": "".join(json.dumps({"input": text, "question": [QUESTION], "gold": {"billing": True}}) + "\n"
                              for text in ("My card was charged twice.", "Where is my parcel?")),
    "no-gold.jsonl": json.dumps({k: v for k, v in LABELED.items() if k != "gold"}) + "\n",
    "wrong-gold.jsonl": json.dumps({**LABELED, "gold": {"billing": "yes"}}) + "\n",
    "no-choices.jsonl": json.dumps({**LABELED, "questions": [{"type": "choice", "name": "team",
                                                              "instructions": "Which team?"}]}) + "\n",
    "not-json.jsonl": json.dumps(LABELED) + "\n\n{input: x}\n",
    "request.json": json.dumps({"model": "default", "input": "x", "question": [QUESTION]}),
    "questions.json": json.dumps({"question": [QUESTION]}),
    "no-choices.json": json.dumps([{"type": "choice", "name": "team", "instructions": "Which team?"}]),
    "profile.json": json.dumps({"model": "SmolLM2-135M-Instruct", "fits": {}}),
    "profile-not-json.json": '{\n  "model": "x",\n}\n',
    "list.yaml": "- providers\n",
    "invalid.yaml": "providers:\n  - name: a\n    type: vertex\n    base_url: http://127.0.0.1:9\n",
    "unset.yaml": "providers:\n  - {name: a, type: openai, base_url: 'http://x', api_key: '${DECISIOND_TEST_UNSET}'}\n",
    "not-yaml.yaml": "providers: [\n",
    "db.yaml": "database_url: sqlite:///{tmp}/folder\n",
    "labels.jsonl": json.dumps({"request_id": "req_1", "labels": {"billing": True}}) + "\n"
                    + json.dumps({"request_id": "req_2", "label": {"billing": True}}) + "\n",
}

MISSING = "cannot read it: No such file or directory"
FOLDER = "cannot read it: Is a directory"
# Each command's cases: (id, arguments, the stderr line after "decisiond: "), {tmp} the test's folder.
CONFIG_CASES = [
    ("config-missing", ["--config", "{tmp}/missing.yaml"], f"{{tmp}}/missing.yaml: {MISSING}"),
    ("config-folder", ["--config", "{tmp}/folder"], f"{{tmp}}/folder: {FOLDER}"),
    ("config-not-a-mapping", ["--config", "{tmp}/list.yaml"],
     "{tmp}/list.yaml: the config must be a YAML mapping with providers, models and virtual_models"),
    ("config-invalid", ["--config", "{tmp}/invalid.yaml"],
     "{tmp}/invalid.yaml:3: providers.0.type: unknown provider type 'vertex'; registered types: "),
    ("config-unset-variable", ["--config", "{tmp}/unset.yaml"],
     "{tmp}/unset.yaml:2: providers[0].api_key: environment variable DECISIOND_TEST_UNSET is not set"),
    ("config-not-yaml", ["--config", "{tmp}/not-yaml.yaml"], "{tmp}/not-yaml.yaml:2: not YAML: "),
]
# The ones every other command with --config runs (serve runs them all: the config is read by one function).
CONFIG_CORE = [case for case in CONFIG_CASES if case[0] in ("config-missing", "config-folder", "config-invalid")]
CALIBRATION_CASES = [
    ("calibration-missing", ["--calibration", "{tmp}/missing.json"], f"{{tmp}}/missing.json: {MISSING}"),
    ("calibration-wrong-shape", ["--calibration", "{tmp}/profile.json"],
     "{tmp}/profile.json: prompt_format_version: missing: not a decisiond calibration profile"),
    ("calibration-not-json", ["--calibration", "{tmp}/profile-not-json.json"],
     "{tmp}/profile-not-json.json:3: not JSON (Expecting property name enclosed in double quotes, column 1): "
     "not a decisiond calibration profile"),
]
CALIBRATION_CORE = [case for case in CALIBRATION_CASES if case[0] in ("calibration-missing", "calibration-wrong-shape")]
LABELED_CASES = [
    ("missing", ["{tmp}/missing.jsonl"], f"{{tmp}}/missing.jsonl: {MISSING}"),
    ("folder", ["{tmp}/folder"], f"{{tmp}}/folder: {FOLDER}"),
    ("question-not-questions", ["{tmp}/question.jsonl"],
     "{tmp}/question.jsonl:1: questions: missing: each line holds input, questions and gold (this one has "
     "question)"),
    ("no-gold", ["{tmp}/no-gold.jsonl"], "{tmp}/no-gold.jsonl:1: gold: missing"),
    ("wrong-gold", ["{tmp}/wrong-gold.jsonl"],
     "{tmp}/wrong-gold.jsonl:1: gold.billing: must be true or false (a predicate's answer), not 'yes'"),
    ("no-choices", ["{tmp}/no-choices.jsonl"], "{tmp}/no-choices.jsonl:1: questions[0].choices: "),
    ("not-json", ["{tmp}/not-json.jsonl"], "{tmp}/not-json.jsonl:3: not JSON ("),
]
BATCH = ["{tmp}/labeled.jsonl", "--out", "{tmp}/answers.jsonl"]
DATABASE_CASES = [
    ("database-url-folder", ["--database-url", "sqlite:///{tmp}/folder"],
     "--database-url: cannot open sqlite:///{tmp}/folder: OperationalError: unable to open database file"),
    ("database-url-unsupported", ["--database-url", "mysql://localhost/db"],
     "--database-url: mysql:// is not supported: use a sqlite:// or postgresql:// URL"),
    ("config-database-folder", ["--config", "{tmp}/db.yaml"],
     "{tmp}/db.yaml: database_url: cannot open sqlite:///{tmp}/folder: OperationalError: unable to open database "
     "file"),
]


def _case(command: str, case: str, args: list[str], line: str) -> tuple[str, str, list[str], str]:
    return command, case, args, line


CASES = [
    *(_case("serve", *c) for c in CONFIG_CASES + CALIBRATION_CASES),
    *(_case("mcp", *c) for c in CONFIG_CORE + CALIBRATION_CORE),
    _case("decide", "missing", ["{tmp}/missing.json"], f"{{tmp}}/missing.json: {MISSING}"),
    _case("decide", "folder", ["{tmp}/folder"], f"{{tmp}}/folder: {FOLDER}"),
    *(_case("decide", case, [*args, "{tmp}/request.json"], line) for case, args, line in CALIBRATION_CORE),
    _case("batch", "missing", ["{tmp}/missing.jsonl", "--out", "{tmp}/answers.jsonl"],
          f"{{tmp}}/missing.jsonl: {MISSING}"),
    _case("batch", "folder", ["{tmp}/folder", "--out", "{tmp}/answers.jsonl"], f"{{tmp}}/folder: {FOLDER}"),
    _case("batch", "out-folder", ["{tmp}/labeled.jsonl", "--out", "{tmp}/folder"], f"{{tmp}}/folder: {FOLDER}"),
    _case("batch", "out-in-missing-folder", ["{tmp}/labeled.jsonl", "--out", "{tmp}/missing/answers.jsonl"],
          "{tmp}/missing/answers.jsonl: cannot write it: the folder {tmp}/missing does not exist"),
    _case("batch", "questions-missing", [*BATCH, "--questions", "{tmp}/missing.json"],
          f"{{tmp}}/missing.json: {MISSING}"),
    _case("batch", "questions-wrong-shape", [*BATCH, "--questions", "{tmp}/questions.json"],
          '{tmp}/questions.json: questions: must be a JSON list of questions, or an object {"questions": [...]}'),
    _case("batch", "questions-invalid", [*BATCH, "--questions", "{tmp}/no-choices.json"],
          "{tmp}/no-choices.json: questions[0].choices: "),
    *(_case("batch", case, [*BATCH, *args], line) for case, args, line in CONFIG_CORE + CALIBRATION_CORE),
    *(_case("eval", *c) for c in LABELED_CASES),
    *(_case("eval", case, ["{tmp}/labeled.jsonl", "--cascade", "triage", *args], line)
      for case, args, line in CONFIG_CORE),
    _case("eval", "out-dir-a-file", ["{tmp}/labeled.jsonl", "--out-dir", "{tmp}/labeled.jsonl"],
          "{tmp}/labeled.jsonl: cannot write the report there: it is a file, not a folder"),
    *(_case("calibrate", *c) for c in LABELED_CASES),
    _case("calibrate", "out-in-missing-folder", ["{tmp}/labeled.jsonl", "--out", "{tmp}/missing/profile.json"],
          "{tmp}/missing/profile.json: cannot write it: the folder {tmp}/missing does not exist"),
    *(_case("keys", case, [*args, "list"], line) for case, args, line in CONFIG_CORE + DATABASE_CASES),
    *(_case("usage", *c) for c in CONFIG_CORE + DATABASE_CASES),
    _case("labels", "missing", ["import", "{tmp}/missing.jsonl"], f"{{tmp}}/missing.jsonl: {MISSING}"),
    _case("labels", "folder", ["import", "{tmp}/folder"], f"{{tmp}}/folder: {FOLDER}"),
    _case("labels", "wrong-shape", ["import", "{tmp}/labels.jsonl"],
          "{tmp}/labels.jsonl:2: labels: missing: each line holds request_id and labels"),
    _case("labels", "not-json", ["import", "{tmp}/not-json.jsonl"], "{tmp}/not-json.jsonl:1: request_id: missing"),
    _case("quality", "out-in-missing-folder", ["--model", "luna", "--png", "{tmp}/missing/quality.png"],
          "{tmp}/missing/quality.png: cannot write it: the folder {tmp}/missing does not exist"),
    *(_case("learn", case, ["--model", "m", *args], line)
      for case, args, line in CONFIG_CORE + DATABASE_CASES[:2]),
    _case("learn", "model-not-stored", ["--model", "nothing", "--config", "{tmp}/db.yaml"],
          "learn: --model 'nothing' keeps no decisions in {tmp}/db.yaml (models with store: true: none)"),
    _case("bench", "out-in-missing-folder", ["--out", "{tmp}/missing/bench.md"],
          "{tmp}/missing/bench.md: cannot write it: the folder {tmp}/missing does not exist"),
    _case("bench", "json-a-folder", ["--json", "{tmp}/folder"], "{tmp}/folder: cannot write it: it is a folder"),
]

# Subcommands that read no file and write none, each with why (none today).
NO_FILE: dict[str, str] = {}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand of ``decisiond``, by name: the parser the command line runs."""
    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def subcommands() -> dict[str, set[str]]:
    """Each subcommand of ``decisiond`` and its options."""
    return {name: {option for a in sub._actions for option in a.option_strings} for name, sub in parsers().items()}


def run(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """``decisiond ARGS`` in a new interpreter, as a user runs it, in ``tmp`` (its own data folder, no database or
    Redis from this environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DECISIOND_")}
    env.update(HF_HUB_OFFLINE="1", DECISIOND_DATA_DIR=str(tmp / "data"))
    return subprocess.run([sys.executable, "-m", "decisiond.cli", *args], capture_output=True, text=True, env=env,
                          cwd=tmp, stdin=subprocess.DEVNULL, timeout=120)


def test_every_subcommand_has_its_cases():
    commands = subcommands()
    covered = {command for command, *_ in CASES}
    assert covered | set(NO_FILE) == set(commands) and not covered & set(NO_FILE)
    for command, options in commands.items():
        ids = {case for c, case, *_ in CASES if c == command}
        if "--config" in options:
            assert {case for case, *_ in CONFIG_CORE} <= ids, command
        if "--calibration" in options:
            assert {case for case, *_ in CALIBRATION_CORE} <= ids, command
        if command not in NO_FILE:
            assert ids & {"missing", "config-missing", "out-in-missing-folder"}, command


@pytest.mark.parametrize(("command", "case", "args", "line"), CASES,
                         ids=[f"{command}-{case}" for command, case, *_ in CASES])
def test_a_file_the_command_cannot_use_is_one_line_and_exit_2(tmp_path, command, case, args, line):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text.replace("{tmp}", str(tmp_path)))
    (tmp_path / "folder").mkdir()
    done = run([command, *(a.replace("{tmp}", str(tmp_path)) for a in args)], tmp_path)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [shown] = done.stderr.splitlines()
    assert shown.startswith("decisiond: " + line.replace("{tmp}", str(tmp_path))), shown
    assert not (tmp_path / "answers.jsonl").exists()  # refused before anything ran


def test_decide_answers_a_request_it_cannot_take_as_the_server_does(tmp_path):
    """A request file of the wrong shape is the request's refusal, not the file's: the error object the server
    answers, exit 1, before the model loads."""
    (tmp_path / "request.json").write_text(FILES["request.json"])
    (tmp_path / "not-json.json").write_text("{model: default}")
    done = run(["decide", str(tmp_path / "request.json")], tmp_path)
    assert done.returncode == 1 and done.stderr == "", done.stderr
    assert json.loads(done.stdout)["error"]["param"] == "questions"
    done = run(["decide", str(tmp_path / "not-json.json")], tmp_path)
    assert done.returncode == 1 and json.loads(done.stdout)["error"]["code"] == "invalid_json"


def test_every_help_names_its_docs_pages():
    commands = subcommands()
    assert set(DOCS) == {None, *commands}
    assert build_parser().format_help().rstrip().endswith(docs_epilog(None))
    for name, sub in parsers().items():
        assert sub.format_help().rstrip().endswith(docs_epilog(name)), name
    pages = {page for named in DOCS.values() for page, _ in named}
    assert all(page.startswith("docs/") for page in pages)
    assert sorted(page for page in pages if not (ROOT / page).is_file()) == []


def test_the_help_a_user_sees_names_the_docs(tmp_path):
    top = run(["--help"], tmp_path)
    assert top.returncode == 0 and "docs: docs/index.md" in top.stdout and "docs: docs/quickstart.md" in top.stdout
    serve = run(["serve", "--help"], tmp_path)
    assert "docs: docs/guides/serving.md" in serve.stdout and "docs: docs/guides/gateway.md" in serve.stdout
    keys = run(["keys", "create", "--help"], tmp_path)
    assert "docs: docs/guides/keys-limits-budgets.md" in keys.stdout
