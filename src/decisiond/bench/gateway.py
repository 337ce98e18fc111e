"""``decisiond bench --gateway``: what the gateway adds to a decision, measured side by side in one run.

A mock OpenAI-shaped upstream of its own (``bench.upstream``, in a process of its own) answers a two-question
decision; in front of it, each configuration is one ``decisiond serve`` process (``--workers N`` of them):

- ``upstream``: the mock alone (the floor);
- ``keyless``: decisiond without keys;
- ``keyless-traced``: the same with OpenTelemetry traces on, exported to an OTLP/HTTP receiver of its own (a second
  mock process, ``bench.upstream``, which counts what it receives): what traces cost, beside ``keyless``;
- ``keyed-sqlite``: a managed key with a rate limit and a budget, on the embedded SQLite database;
- ``keyed-postgres-redis``: the same on PostgreSQL, with the rate limits in Redis (where both are installed).

Every configuration runs once per round, rounds interleaved, at each client count (1: latency; 10 and 64:
throughput), and the median of the rounds is reported: added p50/p99 at one client (decisiond's minus the
upstream's), requests/s, p50, p99, p99/p50 and errors. Then two checks of the budget: one whose limit is half of
what 10 clients ask for 15 s must spend no more than its limit, and exactly the answered requests × their price;
and the same budget served by two workers against one.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from ..limits import BUDGET_CACHE_S
from . import load, services
from .load import Load

MASTER = "bench-master-key-0123456789abcdef"
PRICE = 0.0001  # USD a request (per_request pricing: the spend of N requests is exact)
BODY = json.dumps({
    "model": "luna", "input": "I was charged twice for my subscription this month. Please refund the second charge.",
    "questions": [
        {"type": "predicate", "name": "billing", "instructions": "Is this ticket about billing?"},
        {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
         "choices": [{"value": "billing"}, {"value": "technical"}, {"value": "sales"}]}]}).encode()


@dataclass
class Server:
    name: str
    url: str
    auth: str | None = None
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def stop(self) -> None:
        if self.process is not None:
            services.stop_process(self.process, 30)


@dataclass
class Bench:
    folder: Path
    workers: int
    seconds: float
    log: Callable[[str], None]
    servers: list[Server] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def upstream(self, name: str = "upstream") -> Server:
        port = services.free_port()
        process = subprocess.Popen([sys.executable, "-m", "decisiond.bench.upstream", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = Server(name, f"http://127.0.0.1:{port}/v1/decisions", process=process)
        _wait(f"http://127.0.0.1:{port}/v1/decisions", post=True)
        return server

    def decisiond(self, name: str, config: str, workers: int) -> Server:
        port = services.free_port()
        folder = self.folder / name
        folder.mkdir()
        (folder / "gateway.yaml").write_text(config)
        log = folder / "server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "decisiond.cli", "serve", "--config", str(folder / "gateway.yaml"), "--port",
                 str(port), "--workers", str(workers), "--log-level", "warning"], stdout=out, stderr=out,
                env={**os.environ, "DECISIOND_DATA_DIR": str(folder / "data")})
        server = Server(name, f"http://127.0.0.1:{port}/v1/decisions", process=process, log=log)
        try:
            _wait(f"http://127.0.0.1:{port}/health")
        except RuntimeError:
            server.stop()
            raise RuntimeError(f"{name} did not start: {log.read_text()[-500:]}") from None
        return server


def _wait(url: str, post: bool = False, timeout: float = 60) -> None:
    """Until ``url`` answers (a GET that succeeds, or any answer to a POST)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if post:
                httpx.post(url, content=b"{}")
            else:
                httpx.get(url).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def config(upstream: str, keyed: bool, database: str | None = None, redis: str | None = None,
           traces: str | None = None) -> str:
    """``traces``: the OTLP/HTTP receiver's base URL, to trace every request."""
    lines = [f'providers:\n  - {{name: up, type: openai, base_url: "{upstream.rsplit("/", 1)[0]}", api_key: sk-bench}}',
             f"models:\n  - {{name: luna, provider: up, upstream: gpt-6-luna, pricing: {{per_request: {PRICE}}}}}"]
    if traces:
        lines.insert(0, f'otel: {{endpoint: "{traces}"}}')
    if keyed:
        lines.insert(0, f'auth: {{master_key: "{MASTER}"}}')
    if database:
        lines.insert(0, f'database_url: "{database}"')
    if redis:
        lines.insert(0, f'redis_url: "{redis}"')
    return "\n".join(lines) + "\n"


def managed_key(server: Server, limit_usd: float, rate: int = 1_000_000) -> tuple[str, str]:
    """A managed key with a rate limit and a daily budget of ``limit_usd``: (key, budget id)."""
    base = server.url.rsplit("/v1/", 1)[0]
    admin = {"Authorization": f"Bearer {MASTER}"}
    created = httpx.post(base + "/admin/keys", headers=admin, timeout=30,
                         json={"name": "bench", "rate_limits": {"requests_per_second": rate}})
    created.raise_for_status()
    key = created.json()
    budget = httpx.put(base + "/admin/budgets", headers=admin, timeout=30,
                       json={"key": key["id"], "limit_usd": limit_usd, "period": "daily"})
    budget.raise_for_status()
    time.sleep(BUDGET_CACHE_S + 0.5)  # every worker has read the budget list again: from now on it applies
    return key["key"], budget.json()["id"]


def spend(server: Server, budget: str) -> dict[str, Any]:
    base = server.url.rsplit("/v1/", 1)[0]
    listed = httpx.get(base + "/admin/budgets", headers={"Authorization": f"Bearer {MASTER}"}, timeout=30).json()
    found: dict[str, Any] = next(b for b in listed["data"] if b["id"] == budget)
    return found


@contextlib.contextmanager
def backing(bench: Bench) -> Iterator[tuple[str | None, str | None]]:
    """PostgreSQL and Redis for the ``keyed-postgres-redis`` configuration: (their URLs), or (None, None)."""
    postgres = redis = None
    try:
        postgres = services.start_postgres()
        redis = services.start_redis()
        yield postgres.url, redis.url
    except services.Unavailable as error:
        bench.skipped["keyed-postgres-redis"] = str(error)
        yield None, None
    finally:
        for service in (redis, postgres):
            if isinstance(service, services.Postgres):
                service.remove()
            elif service is not None:
                service.stop()


def measure(bench: Bench, clients: list[int], rounds: int) -> dict[str, dict[int, list[Load]]]:
    """Every server at every client count, once a round, the rounds interleaved."""
    results: dict[str, dict[int, list[Load]]] = {s.name: {c: [] for c in clients} for s in bench.servers}
    for server in bench.servers:  # warm every connection pool and cache before anything counts
        body = BODY.replace(b'"luna"', b'"gpt-6-luna"') if server.name == "upstream" else BODY
        load.run(server.url, body, 4, 1, server.auth)
    for r in range(rounds):
        for c in clients:
            for server in bench.servers:
                body = BODY.replace(b'"luna"', b'"gpt-6-luna"') if server.name == "upstream" else BODY
                result = load.run(server.url, body, c, bench.seconds, server.auth)
                results[server.name][c].append(result)
                bench.log(f"round {r + 1}: {server.name}, {c} clients: {result.rate:,.0f}/s, p50 {result.p50_ms:.2f} "
                          f"ms, p99 {result.p99_ms:.2f} ms, errors {result.errors}, non-2xx {result.non_2xx}")
    return results


def median(loads: list[Load]) -> dict[str, float]:
    return {"rate": statistics.median(x.rate for x in loads), "p50_ms": statistics.median(x.p50_ms for x in loads),
            "p99_ms": statistics.median(x.p99_ms for x in loads), "errors": sum(x.errors for x in loads),
            "non_2xx": sum(x.non_2xx for x in loads)}


def budget_check(bench: Bench, upstream: Server, rate: float, workers: int) -> dict[str, Any]:
    """A budget with room for half of what 10 clients ask in 15 s (in 3 × ``--seconds`` when that is shorter):
    what it admitted, spent and refused."""
    seconds = min(15.0, 3 * bench.seconds)
    limit = round(max(1.0, rate * seconds / 2) * PRICE, 6)
    server = bench.decisiond(f"budget-{workers}-workers", config(upstream.url, keyed=True), workers)
    try:
        key, budget = managed_key(server, limit)
        result = load.run(server.url, BODY, 10, seconds, key)
        answered = result.requests - result.non_2xx
        deadline = time.monotonic() + 30
        while (view := spend(server, budget))["reserved_usd"] > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the last usage rows (and their charges) are written within a second
        view = spend(server, budget)
        return {"workers": workers, "seconds": seconds, "limit_usd": limit, "spent_usd": view["spent_usd"],
                "answered": answered,
                "refused": result.non_2xx, "errors": result.errors, "rate": result.rate,
                "answered_x_price": round(answered * PRICE, 9),
                "exact": abs(view["spent_usd"] - answered * PRICE) < 1e-9 and view["spent_usd"] <= limit + 1e-12}
    finally:
        server.stop()


def shared_budget(bench: Bench, upstream: Server, clients: int, rounds: int) -> dict[str, dict[int, float]]:
    """Requests a second served by 1 and by 2 workers: keyed on SQLite, one budget (with room for all of them)
    shared by the workers; and keyless, which shares nothing (the machine's own ceiling for a second worker)."""
    rates: dict[str, dict[int, list[float]]] = {"keyed": {1: [], 2: []}, "keyless": {1: [], 2: []}}
    servers: dict[tuple[str, int], Server] = {}
    try:
        for kind in rates:
            for workers in (1, 2):
                server = bench.decisiond(f"shared-{kind}-{workers}", config(upstream.url, keyed=kind == "keyed"),
                                         workers)
                if kind == "keyed":
                    server.auth = managed_key(server, 1e6)[0]
                load.run(server.url, BODY, 4, 1, server.auth)
                servers[(kind, workers)] = server
        for _ in range(rounds):  # interleaved
            for (kind, workers), server in servers.items():
                result = load.run(server.url, BODY, clients, bench.seconds, server.auth)
                rates[kind][workers].append(result.rate)
                bench.log(f"{kind}, {workers} worker(s), {clients} clients: {result.rate:,.0f}/s, "
                          f"errors {result.errors}, non-2xx {result.non_2xx}")
    finally:
        for server in servers.values():
            server.stop()
    return {kind: {w: statistics.median(r) for w, r in by.items()} for kind, by in rates.items()}


def run(workers: int = 1, seconds: float = 8, rounds: int = 2, clients: list[int] | None = None,
        postgres: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    clients = clients or [1, 10, 64]
    with tempfile.TemporaryDirectory(prefix="decisiond-bench-") as folder:
        bench = Bench(Path(folder), workers, seconds, log)
        upstream = bench.upstream()
        bench.servers.append(upstream)
        receiver = bench.upstream("otlp-receiver")
        traces = receiver.url.rsplit("/v1/", 1)[0]
        try:
            bench.servers.append(bench.decisiond("keyless", config(upstream.url, keyed=False), workers))
            bench.servers.append(bench.decisiond("keyless-traced", config(upstream.url, False, traces=traces),
                                                 workers))
            sqlite = bench.decisiond("keyed-sqlite", config(upstream.url, keyed=True), workers)
            sqlite.auth = managed_key(sqlite, 1e6)[0]
            bench.servers.append(sqlite)
            with backing(bench) if postgres else contextlib.nullcontext((None, None)) as (pg, redis):
                if pg is not None:
                    backed = bench.decisiond("keyed-postgres-redis", config(upstream.url, True, pg, redis), workers)
                    backed.auth = managed_key(backed, 1e6)[0]
                    bench.servers.append(backed)
                elif not postgres:
                    bench.skipped["keyed-postgres-redis"] = "--no-postgres"
                results = measure(bench, clients, rounds)
                for server in bench.servers[1:]:
                    server.stop()  # a traced server exports its last spans as it stops
            received = httpx.post(traces + "/v1/traces/received", timeout=10).json()
            sqlite_rate = median(results["keyed-sqlite"][10 if 10 in clients else clients[-1]])["rate"]
            budgets = [budget_check(bench, upstream, sqlite_rate, workers)]
            shared = shared_budget(bench, upstream, 64 if 64 in clients else clients[-1], rounds + 1)
        finally:
            for server in [*bench.servers, receiver]:
                server.stop()
    table = {name: {c: median(loads) for c, loads in by_clients.items()} for name, by_clients in results.items()}
    return {"workers": workers, "seconds": seconds, "rounds": rounds, "clients": clients,
            "generator": load.generator(), "table": table, "budgets": budgets, "shared": shared,
            "shared_clients": 64 if 64 in clients else clients[-1], "skipped": bench.skipped,
            "cpus": os.cpu_count(), "traces_received": received}


def traces_line(report: dict[str, Any]) -> list[str]:
    """What traces cost: ``keyless-traced`` against ``keyless``, latency at the first client count and requests a
    second at the others, and what the receiver got."""
    table, clients = report["table"], report["clients"]
    if "keyless-traced" not in table or "keyless" not in table:
        return []
    plain, traced, one = table["keyless"], table["keyless-traced"], clients[0]
    rates = [f"{c} clients {traced[c]['rate']:,.0f}/s against {plain[c]['rate']:,.0f}/s "
             f"({(traced[c]['rate'] / max(plain[c]['rate'], 1e-9) - 1) * 100:+.0f} %)" for c in clients[1:]]
    received = report.get("traces_received") or {}
    return ["", f"Traces on (keyless-traced against keyless): {traced[one]['p50_ms'] - plain[one]['p50_ms']:+.2f} ms "
            f"p50 and {traced[one]['p99_ms'] - plain[one]['p99_ms']:+.2f} ms p99 at {one} client"
            + "".join(f"; {r}" for r in rates)
            + f"; the receiver got {received.get('exports', 0):,} exports ({received.get('bytes', 0) / 1e6:.1f} MB)."]


def markdown(report: dict[str, Any], command: str) -> str:
    clients = report["clients"]
    up = report["table"]["upstream"][clients[0]]
    lines = [f"Reproduce: `{command}`", "",
             f"{report['cpus']} CPUs; load by {report['generator']}; {report['workers']} worker(s) a server; "
             f"medians of {report['rounds']} interleaved rounds of {report['seconds']:g} s.", "",
             f"| configuration | added p50 / p99, {clients[0]} client (ms) | "
             + " | ".join(f"{c} clients: req/s, p50, p99 (ms), p99/p50, errors" for c in clients[1:]) + " |",
             "|---|---|" + "---|" * (len(clients) - 1)]
    for name, row in report["table"].items():
        one = row[clients[0]]
        if name == "upstream":
            added = f"(itself: {one['p50_ms']:.2f} / {one['p99_ms']:.2f})"
        else:
            added = f"{one['p50_ms'] - up['p50_ms']:.2f} / {one['p99_ms'] - up['p99_ms']:.2f}"
        cells = [f"{row[c]['rate']:,.0f}/s, {row[c]['p50_ms']:.2f}, {row[c]['p99_ms']:.2f}, "
                 f"{row[c]['p99_ms'] / max(row[c]['p50_ms'], 1e-9):.1f}, {row[c]['errors'] + row[c]['non_2xx']}"
                 for c in clients[1:]]
        lines.append(f"| {name} | {added} | " + " | ".join(cells) + " |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} |" + " |" * (len(clients) - 1))
    lines += traces_line(report)
    seconds = report["budgets"][0]["seconds"]
    lines += ["", f"Budgets: a managed key whose daily budget has room for half of what 10 clients ask in {seconds:g} "
              f"s (${PRICE} a request):", "",
              "| workers | limit | spent | answered × price | answered | refused (402) | errors | exact, within |",
              "|---|---|---|---|---|---|---|---|"]
    for b in report["budgets"]:
        lines.append(f"| {b['workers']} | ${b['limit_usd']:.4f} | ${b['spent_usd']:.4f} | "
                     f"${b['answered_x_price']:.4f} | {b['answered']:,} | {b['refused']:,} | {b['errors']} | "
                     f"{'yes' if b['exact'] else 'NO'} |")
    keyed, keyless = report["shared"]["keyed"], report["shared"]["keyless"]
    lines += ["", f"One budget shared by the workers (keyed, SQLite), {report['shared_clients']} clients: "
              f"{keyed[1]:,.0f} requests/s admitted by one worker, {keyed[2]:,.0f}/s by two: "
              f"**{keyed[2] / max(keyed[1], 1e-9):.2f}×**; keyless, sharing nothing, on the same two cores (with the "
              f"load and the upstream): {keyless[1]:,.0f}/s and {keyless[2]:,.0f}/s, "
              f"{keyless[2] / max(keyless[1], 1e-9):.2f}×."]
    return "\n".join(lines) + "\n"
