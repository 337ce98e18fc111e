"""Load for ``decisiond bench --gateway``: N keep-alive clients posting one body as fast as answers come, for a
number of seconds. ``wrk`` where it is installed (C, a fraction of the server's CPU); otherwise a Python client in
a process of its own (``python -m decisiond.bench.load``), which costs more CPU per request and says so in the
report (``generator``)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("DECISIOND_BENCH_BODY"), "rb"); wrk.body = f:read("*a"); f:close()
local auth = os.getenv("DECISIOND_BENCH_AUTH")
if auth and auth ~= "" then wrk.headers["Authorization"] = "Bearer " .. auth end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@dataclass
class Load:
    """What one run measured: requests answered (any status), their rate, latency percentiles (ms), transport
    errors (connect, read, write, timeouts) and non-2xx answers."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    non_2xx: int
    generator: str

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def generator() -> str:
    return "wrk" if shutil.which("wrk") else "python"


def run(url: str, body: bytes, clients: int, seconds: float, auth: str | None = None) -> Load:
    """``clients`` connections posting ``body`` to ``url`` for ``seconds``."""
    with tempfile.TemporaryDirectory() as folder:
        body_path = Path(folder) / "body.json"
        body_path.write_bytes(body)
        env = {"DECISIOND_BENCH_BODY": str(body_path), "DECISIOND_BENCH_AUTH": auth or "", "PATH": "/usr/bin:/bin"}
        if generator() == "wrk":
            script = Path(folder) / "post.lua"
            script.write_text(_WRK_SCRIPT)
            done = subprocess.run(["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
                                   "-s", str(script), url], capture_output=True, text=True, env=env,
                                  timeout=seconds + 60)
            found = re.search(r"RESULT (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", done.stdout)
            if found is None:
                raise RuntimeError(f"wrk gave no result: {done.stdout[-300:]} {done.stderr[-300:]}")
            n, duration_us, p50, p99, errors, non_2xx = (int(x) for x in found.groups())
            return Load(n, duration_us / 1e6, p50 / 1000, p99 / 1000, errors, non_2xx, "wrk")
        done = subprocess.run([sys.executable, "-m", "decisiond.bench.load", url, str(clients), str(seconds)],
                              capture_output=True, text=True, env={**env, "PYTHONPATH": ":".join(sys.path)},
                              timeout=seconds + 60)
        return Load(**json.loads(done.stdout.strip().splitlines()[-1]))


async def _client(host: str, port: int, request: bytes, stop: float, latencies: list[float],
                  counts: dict[str, int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop:
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            if not head.startswith(b"HTTP/1.1 2"):
                counts["non_2xx"] += 1
    except (OSError, asyncio.IncompleteReadError, AttributeError):
        counts["errors"] += 1
    finally:
        writer.close()


async def _python_load(url: str, clients: int, seconds: float) -> Load:
    import os

    parts = urlsplit(url)
    body = Path(os.environ["DECISIOND_BENCH_BODY"]).read_bytes()
    auth = os.environ.get("DECISIOND_BENCH_AUTH")
    headers = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n" \
              f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {auth}\r\n" if auth else "") + "\r\n"
    request = headers.encode() + body
    latencies: list[float] = []
    counts = {"errors": 0, "non_2xx": 0}
    started = time.perf_counter()
    await asyncio.gather(*(_client(parts.hostname or "127.0.0.1", parts.port or 80, request, started + seconds,
                                   latencies, counts) for _ in range(clients)))
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    return Load(len(latencies), elapsed, pct(0.5), pct(0.99), counts["errors"], counts["non_2xx"], "python")


if __name__ == "__main__":
    print(json.dumps(asdict(asyncio.run(_python_load(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))))
