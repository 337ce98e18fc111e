"""The documentation site builds, and what it shows runs.

- ``mkdocs build --strict`` succeeds: a broken link, a missing page or a page left out of the nav fails it, and the
  generated reference pages (the config file from the pydantic settings, the CLI from the parser) are in the site.
- Every field of the gateway's config has a description, so the generated config reference documents every key.
- Every code block of the docs and the README that is a complete example runs: each ``python`` block as a program,
  each ``bash`` block of ``curl`` commands as a script, both against a real ``decisiond serve`` of the embedded
  SmolLM2 model (``http://127.0.0.1:8000`` in the text is replaced by its URL); each ``yaml`` block is a gateway
  config that loads (``gateway.config.parse``), or, marked ``<!-- config-fragment -->``, a piece of one whose keys
  are the config's. A block that cannot run here says why, in ``<!-- not-run: reason -->`` on the line before it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts) + [ROOT / "README.md"]
LOCAL_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")
FENCE = re.compile(r"^(\s*)```(\w*)")
MARKER = re.compile(r"^\s*<!--\s*(not-run|config-fragment|not-config)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based, the fence's line
    lang: str
    text: str
    marker: str | None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, each with the marker comment on the line before it, if any."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, lang, body = len(start.group(1)), start.group(2), []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(previous)
        found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None,
                           (marker.group(2) or "") if marker else ""))
        i = j + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def runnable(lang: str) -> list[Block]:
    return [b for b in ALL if b.lang == lang]


def test_the_pages_have_code_blocks_and_markers_have_reasons():
    assert len(PAGES) > 15, "the documentation site's pages are missing"
    assert runnable("python") and runnable("yaml")
    for b in ALL:
        if b.marker == "not-run":
            assert b.reason, f"{b.id}: <!-- not-run: … --> must say why"


def test_site_builds_strict_with_the_generated_reference(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    for key in ("budgets_when_database_down", "escalate_below", "first_byte_timeout_s", "limit_usd"):
        assert key in config
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for command in ("decisiond serve", "decisiond keys create", "decisiond calibrate", "--max-queued-tokens"):
        assert command in cli


def test_every_config_key_is_documented():
    from pydantic import BaseModel

    from decisiond.gateway.settings import GatewayConfig

    seen: set[type[BaseModel]] = set()
    missing = []

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                for inner in (arg, *typing.get_args(arg)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(inner)

    walk(GatewayConfig)
    assert len(seen) > 10
    assert not missing, f"config fields without a docstring (the config reference shows it): {missing}"


@pytest.mark.parametrize("block", [b for b in runnable("yaml") if b.marker != "not-config"], ids=lambda b: b.id)
def test_yaml_examples_are_gateway_configs(block, monkeypatch):
    from decisiond.gateway import config as gateway_config
    from decisiond.gateway.settings import GatewayConfig

    for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", block.text):
        monkeypatch.setenv(name, f"example-value-of-{name}".lower())
    data = yaml.safe_load(block.text)
    if block.marker == "config-fragment":
        assert isinstance(data, dict), f"{block.id}: a config fragment is a mapping of config keys"
        unknown = set(data) - set(GatewayConfig.model_fields)
        assert not unknown, f"{block.id}: {sorted(unknown)} are not config keys"
        return
    gateway_config.parse(data)


def _against(server_url: str, text: str) -> str:
    for url in LOCAL_URLS:
        text = text.replace(url, server_url)
    return text


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "NO_MKDOCS_2_WARNING": "1"}


@pytest.mark.parametrize("block", [b for b in runnable("python") if b.marker != "not-run"], ids=lambda b: b.id)
def test_python_examples_run(block, server, tmp_path):
    done = subprocess.run([sys.executable, "-c", _against(server.url, block.text)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout}\n{done.stderr}"


def _curl_only(block: Block) -> bool:
    commands = [line for line in block.text.splitlines()
                if line.strip() and not line.lstrip().startswith("#") and not line.startswith((" ", "\t"))]
    return bool(commands) and all(c.startswith("curl ") for c in commands) and \
        any(url in block.text for url in LOCAL_URLS)


@pytest.mark.parametrize("block", [b for b in runnable("bash") if b.marker != "not-run" and _curl_only(b)],
                         ids=lambda b: b.id)
def test_curl_examples_run(block, server, tmp_path):
    script = "set -euo pipefail\n" + _against(server.url, block.text).replace("curl ", "curl --fail-with-body ")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{block.id}: no answer"
