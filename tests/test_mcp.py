"""The MCP server through the ``mcp`` package's own client: over stdio (``decisiond mcp``) and over streamable
HTTP at ``/mcp`` on a real server, behind the same keys."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from servers import start_decisiond

MASTER = "mcp-master-key-0123456789"
QUESTIONS = [{"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
             {"type": "choice", "name": "team", "instructions": "Which team?",
              "choices": [{"value": "billing"}, {"value": "shipping"}]}]
TEXT = "I was charged twice."


def payload(result):
    assert not result.is_error, result.content
    if result.structured_content is not None:
        data = result.structured_content
        return data["result"] if isinstance(data, dict) and set(data) == {"result"} else data
    return json.loads(result.content[0].text)


async def exercise(client: Client, model: str) -> dict:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == {"decide", "list_models"}
    assert "questions" in tools["decide"].input_schema["properties"]
    models = payload(await client.call_tool("list_models", {}))
    assert model in [m["name"] for m in models]
    answer = payload(await client.call_tool("decide", {"input": TEXT, "questions": QUESTIONS, "model": model}))
    bad = await client.call_tool("decide", {"input": TEXT, "questions": [{**QUESTIONS[1], "choices": []}],
                                            "model": model})
    assert bad.is_error and "questions[0].choices" in bad.content[0].text
    return answer


def expected(server, model: str, key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = httpx.post(server.url + "/v1/decisions", headers=headers, timeout=60,
                      json={"model": model, "input": TEXT, "questions": QUESTIONS}).json()
    return body


def check(answer: dict, body: dict, model: str) -> None:
    assert answer["model"] == model and [a["name"] for a in answer["answers"]] == ["billing", "team"]
    assert answer["answers"][0]["probability"] == pytest.approx(body["answers"][0]["probability"], abs=1e-5)
    got = [p["probability"] for p in answer["answers"][1]["probabilities"]]
    assert got == pytest.approx([p["probability"] for p in body["answers"][1]["probabilities"]], abs=1e-5)
    assert answer["answers"][1]["confidence"] == pytest.approx(body["answers"][1]["confidence"], abs=1e-5)
    assert answer["answers"][0]["label_mass"] > 0


@pytest.mark.slow
def test_stdio(tiny_dir, tiny_server):
    params = StdioServerParameters(command=sys.executable, args=[
        "-m", "decisiond.cli", "mcp", "--model", tiny_dir, "--served-model-name", "tiny-modes", "--log-level",
        "warning"], env={**os.environ, "HF_HUB_OFFLINE": "1"})

    async def main():
        async with Client(params, read_timeout_seconds=120) as client:
            return await exercise(client, "tiny-modes")

    check(asyncio.run(main()), expected(tiny_server, "tiny-modes"), "tiny-modes")


@pytest.fixture(scope="module")
def keyed_server(tiny_dir, tmp_path_factory):
    database = tmp_path_factory.mktemp("keys") / "keys.db"  # its own key store: not the user's default file
    running = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny-keyed",
                              env={"DECISIOND_MASTER_KEY": MASTER, "DECISIOND_DATABASE_URL": f"sqlite:///{database}"})
    yield running
    running.stop()


def test_streamable_http_behind_the_keys(keyed_server):
    url = keyed_server.url + "/mcp"

    async def main(key: str | None):
        headers = {"authorization": f"Bearer {key}"} if key else None
        transport = streamable_http_client(url, http_client=create_mcp_http_client(headers=headers))
        async with Client(transport, read_timeout_seconds=60) as client:
            return await exercise(client, "tiny-keyed")

    check(asyncio.run(main(MASTER)), expected(keyed_server, "tiny-keyed", MASTER), "tiny-keyed")
    refused = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                         headers={"accept": "application/json, text/event-stream"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(Exception):
        asyncio.run(main("wrong-key"))
