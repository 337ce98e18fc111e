"""The benchmark's HTTP side: starting a ``decisiond serve`` to measure, and the clients that load it (concurrent
throughput with ``/health`` timed meanwhile, the fairness blocks, the repeated-request cache run)."""

from __future__ import annotations

import asyncio
import math
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from ..canonical import DecisionRequest
from . import workload
from .measure import CACHE_HIT, CACHE_MISS, Row

# Throughput phases ask each ticket several times (once per client count): the response cache must not answer.
NO_STORE = {"cache-control": "no-store"}


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``decisiond serve --model model *extra`` on a free local port, once ``/health`` answers: (process, URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "decisiond.cli", "serve", "--model", model, "--port", str(port),
                                "--log-level", "warning", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=2) as client:  # one client: each new one loads the CA bundle (~80 ms of CPU)
        for _ in range(1200):
            if process.poll() is not None:
                raise RuntimeError("decisiond serve exited during start-up")
            try:
                if client.get(url + "/health").status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    process.kill()
    raise RuntimeError("decisiond serve did not start")


@contextmanager
def serving(model: str, extra: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``decisiond serve --model model *extra`` for the block's duration: (its process, its URL)."""
    process, url = start_server(model, extra)
    try:
        yield process, url
    finally:
        process.terminate()
        process.wait(timeout=30)


async def post_concurrently(url: str, bodies: list[dict[str, Any]], clients: int, probe_health: bool = False,
                            headers: dict[str, str] = NO_STORE) -> tuple[float, list[float], list[float]]:
    """Post ``bodies`` from ``clients`` concurrent clients; with ``probe_health``, also time ``GET /health`` every
    50 ms meanwhile (the event loop's responsiveness under load). Returns (seconds, latencies, health latencies)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            t = time.perf_counter()
            r = await client.post(url + "/v1/decisions", json=body, headers=headers)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t)

    health: list[float] = []
    done = asyncio.Event()

    async def prober() -> None:
        async with httpx.AsyncClient(timeout=60) as own:
            while not done.is_set():
                t = time.perf_counter()
                (await own.get(url + "/health")).raise_for_status()
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        probing = asyncio.create_task(prober()) if probe_health else None
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        seconds = time.perf_counter() - start
        done.set()
        if probing is not None:
            await probing
        return seconds, latencies, health


async def fairness(url: str, tiny: list[dict[str, Any]], large: list[dict[str, Any]], blocks: int,
                   log: Callable[[str], None]) -> dict[str, list[float]]:
    """Tiny requests one after another, in alternating blocks: alone, then while a client keeps a 50-question
    long-document request in flight (a new document each time, so the prefix cache cannot shorten it)."""
    out: dict[str, list[float]] = {"alone": [], "during": [], "large": []}
    per_block = max(1, len(tiny) // (2 * blocks))
    bodies = iter(tiny)
    documents = iter(large)
    async with httpx.AsyncClient(timeout=600) as client:
        async def post(body: dict[str, Any], into: list[float]) -> None:
            t = time.perf_counter()
            r = await client.post(url + "/v1/decisions", json=body, headers=NO_STORE)
            r.raise_for_status()
            into.append(time.perf_counter() - t)

        for block in range(blocks):
            log(f"[fairness] block {block + 1}/{blocks}: {per_block} tiny requests alone, then as many with a "
                "50-question document in flight …")
            for _ in range(per_block):
                await post(next(bodies), out["alone"])
            stop = asyncio.Event()
            started = asyncio.Event()

            async def keep_large() -> None:
                while not stop.is_set() and (document := next(documents, None)) is not None:
                    started.set()
                    await post(document, out["large"])

            task = asyncio.create_task(keep_large())
            await started.wait()
            await asyncio.sleep(0.5)  # the large request is prepared and computing
            for _ in range(per_block):
                await post(next(bodies), out["during"])
            stop.set()
            await task
    return out


def repeated(url: str, name: str, requests: list[DecisionRequest]) -> tuple[Row, Row]:
    """The repeated-request workload: each ticket (not asked before) is sent twice in a row, the first answer
    computed and stored (``X-Cache: MISS``), the second read from the cache (``HIT``): miss and hit latencies side
    by side, ticket by ticket. A response with any other ``X-Cache`` is an error."""
    latencies: dict[str, list[float]] = {"MISS": [], "HIT": []}
    with httpx.Client(timeout=600) as client:
        for request in requests:
            body = workload.openai_body(request, "default")
            for expected in ("MISS", "HIT"):
                t = time.perf_counter()
                r = client.post(url + "/v1/decisions", json=body)
                elapsed = time.perf_counter() - t
                r.raise_for_status()
                if r.headers.get("x-cache") != expected:
                    raise RuntimeError(f"expected X-Cache: {expected}, got {r.headers.get('x-cache')!r}")
                latencies[expected].append(elapsed)
    questions = sum(len(r.questions) for r in requests)
    return (Row(name, CACHE_MISS, len(requests), questions, math.fsum(latencies["MISS"]), latencies["MISS"]),
            Row(name, CACHE_HIT, len(requests), questions, math.fsum(latencies["HIT"]), latencies["HIT"]))
