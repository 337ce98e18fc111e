"""The runner: one run on one model, section by section. Measures, side by side, the naive loop (one full forward
pass per question with transformers, as a client would write it), decisiond in-process, and decisiond over HTTP
with several concurrent clients; then, when asked, long documents and fairness. Returns the numbers the report
(``report.py``) renders: questions per second, request latency, peak RSS, and the time over a FLOP bound."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..canonical import DecisionRequest
from ..engine.local import LocalEngine
from ..engine.model import load
from . import workload
from .clients import fairness, post_concurrently, repeated, start_server
from .measure import (
    SERVED_MODES,
    MatmulRate,
    Row,
    clients_phrase,
    flop_work,
    http_mode,
    naive_decide,
    peak_rss_mb,
    percentile,
    reset_peak_rss,
    side_by_side,
)

# The CLI (``decisiond bench``) calls ``runner.markdown`` and ``runner.to_json``: they are report.py's.
from .report import markdown as markdown
from .report import to_json as to_json
from .served import ServedEngine, gguf_of, start_served

T = TypeVar("T")


@dataclass
class Session:
    """One run: the engine, the matmul probe, the served model's settings, and what the sections measured so far.
    One ``decisiond serve`` answers every HTTP workload of the run (started at the first), so that its peak RSS is
    that of a server going through all of them; its high-water mark is read, and started again, per workload."""

    model: str
    server_args: list[str]
    clients: tuple[int, ...]
    log: Callable[[str], None]
    engine: LocalEngine
    rate: MatmulRate
    rows: list[Row] = field(default_factory=list)
    bounds: dict[str, dict[str, Any]] = field(default_factory=dict)
    agreement: dict[str, float] = field(default_factory=dict)
    health: dict[str, float] = field(default_factory=dict)
    fairness: dict[str, list[float]] = field(default_factory=dict)
    server_rss: dict[str, float] = field(default_factory=dict)
    server: tuple[subprocess.Popen[bytes], str] | None = None
    # The same model in llama.cpp's server and vLLM, read through the logprobs provider (``--served``).
    served: list[ServedEngine] = field(default_factory=list)

    def on_worker(self, fn: Callable[[], T]) -> T:
        """All model math runs on the engine's worker thread, the naive loop's too: the same thread pool for both."""
        result: T = self.engine.scheduler.call(fn)
        return result

    def naive(self, request: DecisionRequest) -> list[list[float]]:
        loaded = self.engine.loaded
        return self.on_worker(lambda: naive_decide(loaded.model, loaded.tokenizer, request))

    def warm(self, requests: list[DecisionRequest]) -> None:
        for r in requests:
            self.naive(r)
            self.engine.decide(r)

    def side_by_side(self, name: str, requests: list[DecisionRequest], naive_count: int, block: int = 10) -> None:
        """The naive loop and decisiond in-process on the same requests, taking turns; a row each (added to the
        workload's rows when called again), and the largest difference between their probabilities."""
        self.log(f"[{name}] naive loop ({naive_count} requests) and decisiond in-process ({len(requests)}), "
                 "side by side …")
        naive_row, inproc_row, naive_answers, results = side_by_side(
            name, requests, naive_count, self.naive, self.engine.decide, block,
            probe=lambda: self.on_worker(self.rate.probe))
        for row in (naive_row, inproc_row):
            self.add(row)
        worst = max(abs(a - b) for res, ref in zip(results, naive_answers)
                    for ans, probs in zip(res.answers, ref) for a, b in zip(ans.probabilities, probs))
        self.agreement[name] = max(self.agreement.get(name, 0.0), worst)

    def served_side_by_side(self, name: str, requests_for: Callable[[int], list[DecisionRequest]],
                            block: int = 10) -> None:
        """Each served engine (through the logprobs provider) and the in-process engine on the same requests, taking
        turns; a row each, with the prompt tokens each answered, and the largest difference of their
        probabilities. Each engine gets requests of its own (``requests_for(i)``), so that the in-process engine's
        prefix cache holds none of them from the engine before."""
        for i, served in enumerate(self.served):
            requests = requests_for(i)
            self.log(f"[{name}] {served.label} and decisiond in-process ({len(requests)} requests), side by side …")
            served_row, inproc_row, served_answers, results = side_by_side(
                name, requests, len(requests), served.decide, self.engine.decide, block)
            served_row.mode = SERVED_MODES[served.label]
            served_row.tokens = sum(r.usage.input_tokens for r in served_answers)
            inproc_row.tokens = sum(r.usage.input_tokens for r in results)
            inproc_row.workload = served_row.workload = f"{name} (beside {served.label})"
            self.rows += [inproc_row, served_row]
            worst = max(abs(a - b) for res, ref in zip(results, served_answers)
                        for ans, theirs in zip(res.answers, ref.answers) for a, b in zip(ans.probabilities,
                                                                                         theirs.probabilities))
            self.agreement[f"{name}: {served.label} vs in-process"] = worst

    def add(self, row: Row) -> None:
        """A row, or more of a row already measured (the same workload and mode)."""
        same = next((r for r in self.rows if (r.workload, r.mode) == (row.workload, row.mode)), None)
        if same is None:
            self.rows.append(row)
            return
        same.requests += row.requests
        same.questions += row.questions
        same.seconds += row.seconds
        same.latencies += row.latencies

    def url(self, workload_name: str) -> str:
        """The run's server (started at the first call), its peak RSS started again for ``workload_name``."""
        if self.server is None:
            self.log("starting decisiond serve …")
            self.server = start_server(self.model, self.server_args)
        reset_peak_rss(self.server[0].pid)
        return self.server[1]

    def read_peak(self, workload_name: str) -> None:
        if self.server is not None:
            peak = peak_rss_mb(self.server[0].pid)
            self.server_rss[workload_name] = max(self.server_rss.get(workload_name, 0.0), peak)

    def close(self) -> None:
        for served in self.served:
            served.close()
        self.served = []
        if self.server is not None:
            self.server[0].terminate()
            self.server[0].wait(timeout=30)
            self.server = None

    def over_http(self, name: str, phases: dict[int, list[DecisionRequest]], warm: list[DecisionRequest],
                  repeat: list[DecisionRequest] | None = None) -> None:
        """The served model, warmed up, then each number of concurrent clients posting its own requests (a row each,
        ``/health`` timed meanwhile), then the ``repeat`` tickets' cache miss and hit."""
        url = self.url(name)
        asyncio.run(post_concurrently(url, [workload.openai_body(r, "default") for r in warm], 1))
        for n, requests in phases.items():
            self.log(f"[{name}] decisiond over HTTP, {n} concurrent clients …")
            bodies = [workload.openai_body(r, "default") for r in requests]
            seconds, latencies, probes = asyncio.run(post_concurrently(url, bodies, n, probe_health=True))
            self.rows.append(Row(name, http_mode(n), len(bodies), sum(len(r.questions) for r in requests),
                                 seconds, latencies))
            self.health[f"{name}, {clients_phrase(n)}"] = percentile(probes, 0.99)
        if repeat:
            self.log(f"[{name}] repeated requests: cache miss then hit, ticket by ticket …")
            self.rows.extend(repeated(url, name, repeat))
        self.read_peak(name)


def run(model: str = "default", tickets: int = 200, question_sets: tuple[int, ...] = (3, 10),
        clients: tuple[int, ...] = (1, 4, 16), naive_tickets: int | None = None, dtype: str = "float32",
        long_documents: int = 0, fairness_blocks: int = 0, note: str = "",
        log: Callable[[str], None] = print, device: str = "auto",
        prefix_cache_mb: float | None = None, served: bool = False) -> dict[str, Any]:
    """The whole benchmark, in one process on one model: each question set, then the long documents and the
    fairness blocks when asked; ``served``: each question set also served by llama.cpp's server beside the in-process
    engine. Returns the report's numbers (``report.markdown``, ``report.to_json``)."""
    gguf = gguf_of(model) if served else None  # refused before the model loads
    session = start(model, dtype, device, prefix_cache_mb, clients, log)
    if gguf is not None:
        log("starting llama.cpp's server …")
        session.served = start_served(gguf, session.engine, torch.get_num_threads(), log)
    try:
        for count in question_sets:
            question_set(session, count, tickets, naive_tickets or tickets)
        if long_documents:
            long_document_set(session, long_documents)
        if fairness_blocks:
            fairness_set(session, fairness_blocks)
    finally:
        session.close()
    return summary(session, tickets, naive_tickets or tickets, long_documents, note)


def start(model: str, dtype: str, device: str, prefix_cache_mb: float | None, clients: tuple[int, ...],
          log: Callable[[str], None]) -> Session:
    """Load the model once (the naive loop and the in-process engine share it) and probe the matmul rate. The
    server is started with the same model, dtype, device and prefix cache."""
    loaded = load(model, dtype=dtype, device=device)
    engine = LocalEngine(loaded, prefix_cache_mb=prefix_cache_mb)
    config = loaded.model.config
    rate = MatmulRate(config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size),
                      loaded.model.dtype, loaded.device)
    server_args = ["--dtype", dtype, "--device", loaded.device]
    if prefix_cache_mb is not None:
        server_args += ["--prefix-cache-mb", str(prefix_cache_mb)]
    session = Session(model, server_args, clients, log, engine, rate)
    session.on_worker(rate.probe)
    return session


def question_set(session: Session, count: int, tickets: int, naive_tickets: int) -> None:
    """``tickets`` support tickets asked ``count`` questions each: in-process beside the naive loop, over HTTP (other
    tickets for each number of clients, so that no phase finds another's prefixes cached), and other tickets twice
    each for the response cache."""
    name = f"{count}q"
    requests = workload.requests(tickets, count, seed=workload.TICKETS_SEED + count)
    warm = workload.requests(2, count, seed=99)
    session.bounds[name] = flop_work(session.engine, requests)
    session.warm(warm)
    session.side_by_side(name, requests, min(len(requests), naive_tickets))
    session.served_side_by_side(
        name, lambda i: workload.requests(tickets, count, seed=workload.TICKETS_SEED + count + 7 + 1000 * i))
    phases = {n: workload.requests(tickets, count, seed=workload.TICKETS_SEED + count + 100 * (i + 1))
              for i, n in enumerate(session.clients)}
    session.over_http(name, phases, warm, repeat=workload.requests(tickets, count, seed=1234))


def long_document_set(session: Session, count: int) -> None:
    """``count`` documents of about 2,000 tokens, 5 questions each; then other documents asked one question (nothing
    of them cached) and then a new question (the second request finds the document in the prefix cache)."""
    requests = workload.long_requests(count)
    warm = workload.long_requests(1, seed=98)
    session.bounds[workload.LONG] = flop_work(session.engine, requests)
    session.warm(warm)
    session.side_by_side(workload.LONG, requests, len(requests), block=2)
    # Over HTTP: as many other documents as the most clients, all posted at once, /health timed meanwhile.
    most = max(session.clients)
    session.over_http(workload.LONG, {most: workload.long_requests(most, seed=13)}, warm)
    first = workload.long_requests(count, (workload.ASK_FIRST,), seed=12)
    again = workload.long_requests(count, (workload.ASK_AGAIN,), seed=12)
    session.bounds[workload.FIRST] = flop_work(session.engine, first)
    session.bounds[workload.AGAIN] = flop_work(session.engine, again, asked_before=first)
    # Two documents at a time: first asked, then asked again while the prefix cache still holds them (its default
    # budget holds two or three such documents; asking six, then six again, would find none of them).
    for start in range(0, count, workload.ASKED_TOGETHER):
        session.side_by_side(workload.FIRST, first[start:start + workload.ASKED_TOGETHER], len(first), block=1)
        session.side_by_side(workload.AGAIN, again[start:start + workload.ASKED_TOGETHER], len(again), block=1)
    # Prefill side by side: other documents, each asked one question (nothing of them cached anywhere).
    session.served_side_by_side(
        workload.FIRST, lambda i: workload.long_requests(count, (workload.ASK_FIRST,), seed=31 + 1000 * i), block=1)


def fairness_set(session: Session, blocks: int) -> None:
    """Tiny requests alone and beside a 50-question document in flight, ``blocks`` times, on the served model."""
    tiny = [workload.openai_body(r, "default") for r in workload.requests(40 * blocks, 1, seed=21)]
    large = [workload.openai_body(r, "default")
             for r in workload.long_requests(20 * blocks, workload.MANY_QUESTIONS, seed=22)]
    url = session.url("fairness")
    session.fairness = asyncio.run(fairness(url, tiny, large, blocks, session.log))
    session.read_peak("fairness")


def summary(session: Session, tickets: int, naive_tickets: int, long_documents: int, note: str) -> dict[str, Any]:
    """The run's numbers, each FLOP bound at the best matmul rate probed during the whole run."""
    rate = session.rate
    for b in session.bounds.values():
        b["matmul_flops_per_s"] = rate.best
        b["seconds"] = b["flops"] / rate.best
    backend = session.engine.backend
    stats = getattr(backend, "stats", None)
    prefixes = getattr(backend, "prefixes", None)
    loaded = session.engine.loaded
    return {
        "rows": session.rows,
        "bounds": session.bounds,
        "agreement": session.agreement,
        "health_p99_s": session.health,
        "fairness": session.fairness,
        "matmul_probes_gflops": [round(r / 1e9, 1) for r in rate.rates],
        "server_peak_rss_mb": max(session.server_rss.values(), default=None),
        "server_peak_rss_mb_by_workload": session.server_rss,
        "bench_peak_rss_mb": peak_rss_mb(),
        "prefix_cache_mb": prefixes.max_bytes / 2**20 if prefixes is not None else None,
        "model": loaded.name,
        "dtype": loaded.dtype,
        "device": loaded.device,
        "tickets": tickets,
        "naive_tickets": naive_tickets,
        "long_documents": long_documents,
        "note": note,
        "clients": list(session.clients),
        "backend": dict(vars(stats)) if stats is not None else {},
        "machine": machine(loaded.device),
    }


def machine(device: str) -> str:
    """The processor (and the GPU, on one), torch's version and its CPU threads."""
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    if device.startswith("cuda"):
        where += f", {torch.cuda.get_device_name(torch.device(device))}"
    return f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads"
