"""Schema-driven fuzzing: schemathesis generates requests from /openapi.json (the dialects' own wire models) and
sends them to a real server on the tiny model, with the master key so that the admin routes are reached too.
Not one may answer 5xx."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from servers import start_decisiond

MASTER = "fuzz-master-key-0123456789"


def test_openapi_describes_each_decision_route_body(tiny_dir, tmp_path):
    server = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny",
                             env={"DECISIOND_MASTER_KEY": MASTER, "DECISIOND_DATA_DIR": str(tmp_path)})
    try:
        # With keys configured the schema, like every route but /health's liveness, needs a key.
        assert httpx.get(server.url + "/openapi.json").status_code == 401
        schema = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {MASTER}"}).json()
        for path, title in (("/v1/decisions", None), ("/v1/systemone", "SystemOneBody"), ("/v1/score", "ScoreBody")):
            body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body.get("title") == title or "oneOf" in body
        assert {"DecisionBody", "SGLangBody"} <= {s.get("title") for s in
                                                  schema["paths"]["/v1/decisions"]["post"]["requestBody"]["content"]
                                                  ["application/json"]["schema"]["oneOf"]}
        binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
        assert binary is not None, "schemathesis is a test dependency (pyproject.toml)"
        schema_file = tmp_path / "openapi.json"
        schema_file.write_text(json.dumps(schema))
        run = subprocess.run([binary, "run", str(schema_file), "--url", server.url, "--checks", "not_a_server_error",
                              "--max-examples", "20", "--phases", "examples,coverage,fuzzing", "--no-color",
                              "--seed", "1", "-H", f"Authorization: Bearer {MASTER}"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:]
        # The summary's count of test cases, not its warnings (an operation that answers only 401 for want of a
        # console session is a warning whose text says "Authentication failed").
        cases = re.search(r"Test cases:\s*\n\s*(\d+) generated, (.*)", run.stdout)
        assert cases is not None, run.stdout[-4000:]
        counts = cases.group(2)
        assert " passed" in counts and "fail" not in counts and "error" not in counts, run.stdout[-4000:]
        assert "Traceback" not in server.log()
    finally:
        server.stop()
