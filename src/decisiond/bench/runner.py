"""Measure, side by side in one run on one model: the naive loop (one full forward pass per question with
transformers, as a client would write it), decisiond in-process, and decisiond over HTTP with several concurrent
clients. Reports questions per second, request latency, peak RSS, and the time over a FLOP bound."""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..canonical import DecisionRequest
from ..engine.local import LocalEngine
from ..engine.packing import common_prefix, pack
from ..engine.prompt import labels_for, render_question
from ..probability import label_probabilities
from ..text import render_input
from . import workload


@dataclass
class Row:
    workload: str
    mode: str
    requests: int
    questions: int
    seconds: float
    latencies: list[float] = field(default_factory=list, repr=False)

    @property
    def qps(self) -> float:
        return self.questions / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)] if ordered else float("nan")


# ---------------------------------------------------------------------------------------------- naive


def naive_decide(model: Any, tokenizer: Any, request: DecisionRequest) -> list[list[float]]:
    """The plain client-side way: per question, render the chat prompt, check each label is one token, run one
    full forward pass over the whole prompt, and softmax the labels' log-probs."""
    text = render_input(request.input)
    out = []
    for question in request.questions:
        labels = labels_for(question)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": render_question(text, question, labels)}],
                                               add_generation_prompt=True, enable_thinking=False, tokenize=False)
        input_ids = tokenizer.encode(prompt, add_special_tokens=False)
        label_ids = []
        for label in labels:
            ids = tokenizer.encode(prompt + label, add_special_tokens=False)
            if ids[: len(input_ids)] != input_ids or len(ids) != len(input_ids) + 1:
                raise ValueError(f"label {label} is not one token")
            label_ids.append(ids[-1])
        with torch.inference_mode():
            logits = model(torch.tensor([input_ids])).logits[0, -1]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        out.append(label_probabilities([float(logprobs[i]) for i in label_ids]))
    return out


def side_by_side(name: str, requests: list[DecisionRequest], naive_count: int, naive: Callable[..., Any],
                 engine: Callable[..., Any], block: int = 10,
                 probe: Callable[[], Any] | None = None) -> tuple[Row, Row, list[Any], list[Any]]:
    """The naive loop and the in-process engine take turns, a block of tickets each, the same tickets, alternating
    which goes first: a slower minute of a shared machine slows both, and neither runs in the other's wake within a
    block. Each row's time is the sum of its request latencies. ``probe`` (the matmul rate) runs between blocks."""
    timings: dict[str, list[float]] = {"naive": [], "engine": []}
    answers: dict[str, list[Any]] = {"naive": [], "engine": []}
    for b, start in enumerate(range(0, len(requests), block)):
        chunk = requests[start:start + block]
        turn = [("naive", naive, chunk[: max(0, naive_count - start)]), ("engine", engine, chunk)]
        for who, call, subset in (turn if b % 2 == 0 else turn[::-1]):
            for request in subset:
                t = time.perf_counter()
                answers[who].append(call(request))
                timings[who].append(time.perf_counter() - t)
        if probe is not None:
            probe()
    rows = []
    for who, mode, subset in (("naive", NAIVE, requests[:naive_count]), ("engine", IN_PROCESS, requests)):
        rows.append(Row(name, mode, len(subset), sum(len(r.questions) for r in subset), math.fsum(timings[who]),
                        timings[who]))
    return rows[0], rows[1], answers["naive"], answers["engine"]


NAIVE = "naive loop (transformers, 1 forward/question)"
IN_PROCESS = "decisiond in-process"


# ----------------------------------------------------------------------------------------------- http


# Throughput phases ask each ticket several times (once per client count): the response cache must not answer.
NO_STORE = {"cache-control": "no-store"}


async def _clients(url: str, bodies: list[dict[str, Any]], clients: int, probe_health: bool = False,
                   headers: dict[str, str] = NO_STORE) -> tuple[Any, ...]:
    """Post ``bodies`` from ``clients`` concurrent clients; with ``probe_health``, also time ``GET /health`` every
    50 ms meanwhile (the event loop's responsiveness under load). Returns (seconds, latencies[, health])."""
    import httpx

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
        if probing is None:
            return seconds, latencies
        await probing
        return seconds, latencies, health


async def _fairness(url: str, tiny: list[dict[str, Any]], large: list[dict[str, Any]], blocks: int,
                    log: Callable[[str], None]) -> dict[str, list[float]]:
    """Tiny requests one after another, in alternating blocks: alone, then while a client keeps a 50-question
    long-document request in flight (a new document each time, so the prefix cache cannot shorten it)."""
    import httpx

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


CACHE_MISS = "response cache: miss (first ask), HTTP 1 client"
CACHE_HIT = "response cache: hit (same request again), HTTP 1 client"


def repeated(url: str, name: str, requests: list[DecisionRequest]) -> tuple[Row, Row]:
    """The repeated-request workload: each ticket (not asked before) is sent twice in a row, the first answer
    computed and stored (``X-Cache: MISS``), the second read from the cache (``HIT``): miss and hit latencies side
    by side, ticket by ticket. A response with any other ``X-Cache`` is an error."""
    import httpx

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


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import httpx

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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)] if ordered else float("nan")


def peak_rss_mb(pid: int | None = None) -> float:
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ------------------------------------------------------------------------------------------ FLOP bound


class MatmulRate:
    """The best FLOP/s a model-shaped matmul reached on this machine, probed again and again through the run: a
    shared machine's slower minutes lower single probes (178 and 269 GFLOP/s were read in two runs), and only the
    best rate keeps the bound a bound."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, tokens: int = 512):
        self.shape, self.dtype = (tokens, hidden, intermediate), dtype
        self.rates: list[float] = []

    def probe(self) -> float:
        tokens, hidden, intermediate = self.shape
        a = torch.randn(tokens, hidden, dtype=self.dtype)
        b = torch.randn(hidden, intermediate, dtype=self.dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        self.rates.append(2 * tokens * hidden * intermediate / min(times))
        return self.rates[-1]

    @property
    def best(self) -> float:
        return max(self.rates)


def flop_work(engine: LocalEngine, requests: list[DecisionRequest],
              asked_before: list[DecisionRequest] | None = None) -> dict[str, Any]:
    """FLOPs the workload needs, computing each distinct token once: per request, the radix tree of its prompts
    without the template header (computed once for the run), or, for a document ``asked_before``, without the part
    it shares with that earlier request; logits at each answer."""
    model = engine.loaded.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    body = total - embed.numel() - (0 if head is embed else head.numel())
    header = len(engine.prompter.header_ids(engine.prompter.template_kwargs({})))
    unique, targets = 0 if asked_before else header, 0
    for i, request in enumerate(requests):
        prompts = [q.prompt.ids for q in engine.prepare(request).questions]
        skip = header
        if asked_before:
            earlier = engine.prepare(asked_before[i]).questions[0].prompt.ids
            skip = max(skip, common_prefix([prompts[0], earlier]))
        unique += len(pack(prompts, min(skip, min(len(p) for p in prompts) - 1)))
        targets += len(prompts)
    return {"body_params": body, "head_params": head.numel(), "unique_tokens": unique, "targets": targets,
            "flops": 2 * body * unique + 2 * head.numel() * targets}


# ----------------------------------------------------------------------------------------------- run


LONG = "long"  # documents of about 2,000 tokens, 5 questions each
FIRST = "2K doc, first ask"
AGAIN = "2K doc, asked again"


def run(model: str = "default", tickets: int = 200, question_sets: tuple[int, ...] = (3, 10),
        clients: tuple[int, ...] = (1, 4, 16), naive_tickets: int | None = None, dtype: str = "float32",
        long_documents: int = 0, fairness_blocks: int = 0, note: str = "",
        log: Callable[[str], None] = print) -> dict[str, Any]:
    from ..engine.model import load

    loaded = load(model, dtype=dtype)
    engine = LocalEngine(loaded)
    # All model math runs on the engine's worker thread, the naive loop's too: the same thread pool for both.
    on_worker = engine.scheduler.call
    config = loaded.model.config
    rate = MatmulRate(config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size),
                      loaded.model.dtype)
    on_worker(rate.probe)
    def naive(r: DecisionRequest) -> list[list[float]]:
        result: list[list[float]] = on_worker(lambda: naive_decide(loaded.model, loaded.tokenizer, r))
        return result

    rows: list[Row] = []
    bounds: dict[str, dict[str, Any]] = {}
    agreement: dict[str, float] = {}
    health: dict[str, float] = {}
    server_rss: float | None = None

    def measure(name: str, requests: list[DecisionRequest], naive_count: int, call: Callable[..., Any],
                block: int = 10) -> None:
        log(f"[{name}] naive loop ({naive_count} requests) and decisiond in-process ({len(requests)}), side by side …")
        naive_row, inproc_row, naive_answers, results = side_by_side(name, requests, naive_count, naive, call, block,
                                                                     probe=lambda: on_worker(rate.probe))
        rows.extend([naive_row, inproc_row])
        agreement[name] = max(abs(a - b) for res, ref in zip(results, naive_answers)
                              for ans, probs in zip(res.answers, ref) for a, b in zip(ans.probabilities, probs))

    def over_http(name: str, requests: list[DecisionRequest], warm: list[DecisionRequest],
                  phases: tuple[int, ...] = clients, repeat: list[DecisionRequest] | None = None) -> None:
        nonlocal server_rss
        process, url = start_server(model, ["--dtype", dtype])
        try:
            bodies = [workload.openai_body(r, "default") for r in requests]
            asyncio.run(_clients(url, [workload.openai_body(r, "default") for r in warm], 1))
            for n in phases:
                log(f"[{name}] decisiond over HTTP, {n} concurrent clients …")
                seconds, latencies, probes = asyncio.run(_clients(url, bodies, n, probe_health=True))
                rows.append(Row(name, f"decisiond HTTP, {n} client{'s' if n > 1 else ''}", len(bodies),
                                sum(len(r.questions) for r in requests), seconds, latencies))
                health[f"{name}, {n} client{'s' if n > 1 else ''}"] = _percentile(probes, 0.99)
            if repeat:
                log(f"[{name}] repeated requests: cache miss then hit, ticket by ticket …")
                rows.extend(repeated(url, name, repeat))
            server_rss = max(server_rss or 0.0, peak_rss_mb(process.pid))
        finally:
            process.terminate()
            process.wait(timeout=30)

    for count in question_sets:
        name = f"{count}q"
        requests = workload.requests(tickets, count)
        warm = workload.requests(2, count, seed=99)
        bounds[name] = flop_work(engine, requests)
        for r in warm:
            naive(r)
            engine.decide(r)
        measure(name, requests, min(len(requests), naive_tickets or tickets), engine.decide)
        over_http(name, requests, warm, repeat=workload.requests(tickets, count, seed=1234))

    if long_documents:
        # Documents of about 2,000 tokens, 5 questions each.
        requests = workload.long_requests(long_documents)
        warm = workload.long_requests(1, seed=98)
        bounds[LONG] = flop_work(engine, requests)
        naive(warm[0])
        engine.decide(warm[0])
        measure(LONG, requests, len(requests), engine.decide, block=2)
        # Over HTTP: as many other documents as the most clients, all posted at once, /health timed meanwhile.
        over_http(LONG, workload.long_requests(max(clients), seed=13), warm, phases=(max(clients),))
        # Other documents, asked one question (nothing of them cached), then asked a new question: the second
        # request finds the document in the prefix cache.
        first = workload.long_requests(long_documents, (workload.ASK_FIRST,), seed=12)
        again = workload.long_requests(long_documents, (workload.ASK_AGAIN,), seed=12)
        bounds[FIRST] = flop_work(engine, first)
        bounds[AGAIN] = flop_work(engine, again, asked_before=first)
        measure(FIRST, first, len(first), engine.decide, block=2)
        measure(AGAIN, again, len(again), engine.decide, block=2)

    fairness: dict[str, list[float]] = {}
    if fairness_blocks:
        tiny = [workload.openai_body(r, "default") for r in workload.requests(40 * fairness_blocks, 1, seed=21)]
        large = [workload.openai_body(r, "default")
                 for r in workload.long_requests(20 * fairness_blocks, workload.MANY_QUESTIONS, seed=22)]
        process, url = start_server(model, ["--dtype", dtype])
        try:
            fairness = asyncio.run(_fairness(url, tiny, large, fairness_blocks, log))
        finally:
            process.terminate()
            process.wait(timeout=30)

    for b in bounds.values():
        b["matmul_flops_per_s"] = rate.best
        b["seconds"] = b["flops"] / rate.best
    return {
        "rows": rows,
        "bounds": bounds,
        "agreement": agreement,
        "health_p99_s": health,
        "fairness": fairness,
        "matmul_probes_gflops": [round(r / 1e9, 1) for r in rate.rates],
        "server_peak_rss_mb": server_rss,
        "bench_peak_rss_mb": peak_rss_mb(),
        "model": loaded.name,
        "dtype": dtype,
        "tickets": tickets,
        "naive_tickets": naive_tickets or tickets,
        "long_documents": long_documents,
        "note": note,
        "clients": list(clients),
        "backend": dict(vars(stats)) if (stats := getattr(engine.backend, "stats", None)) is not None else {},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
    }


def speedups(report: dict[str, Any]) -> dict[str, float]:
    """The issue's target ratios, computed from the rows of one run."""
    by = {(r.workload, r.mode): r for r in report["rows"]}
    out = {}
    for name in report["bounds"]:
        naive = by[(name, NAIVE)].qps
        out[f"{name}: in-process / naive"] = by[(name, IN_PROCESS)].qps / naive
        http = [r for r in report["rows"] if r.workload == name and r.mode.startswith("decisiond HTTP")]
        misses = [r for r in report["rows"] if r.workload == name and r.mode == CACHE_MISS]
        hits = [r for r in report["rows"] if r.workload == name and r.mode == CACHE_HIT]
        if misses and hits:
            out[f"{name}: cache miss p50 / cache hit p50"] = (misses[0].percentile(0.5)
                                                              / hits[0].percentile(0.5))
        if len(http) >= 2:
            key = f"{name}: HTTP {report['clients'][-1]} clients / HTTP {report['clients'][0]} client"
            out[key] = http[-1].qps / http[0].qps
    if (AGAIN, IN_PROCESS) in by:
        again, first = by[(AGAIN, IN_PROCESS)], by[(FIRST, IN_PROCESS)]
        out["2K doc asked again / its first ask (in-process)"] = again.qps / first.qps
    return out


def markdown(report: dict[str, Any], command: str) -> str:
    lines = [
        "# decisiond benchmark",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Model {report['model']} ({report['dtype']}), {report['tickets']} support tickets of about 150 tokens "
        f"(naive loop: first {report['naive_tickets']}), on {report['machine']}. All rows come from the same run; "
        "the naive loop and the in-process engine take turns, 10 tickets each (2 for the long documents; their "
        "times are the sums of their request latencies); only ratios are meant to carry over to other machines. "
        "HTTP throughput rows send `Cache-Control: no-store`; the response-cache rows ask other tickets, each twice "
        "in a row (a miss, then a hit of the same request), so that miss and hit latencies are measured side by "
        "side." + (f" {report['note']}" if report.get("note") else ""),
        "",
        "| workload | mode | questions/s | p50 request (s) | p95 request (s) | × naive | time / FLOP bound |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        naive = next(x for x in report["rows"] if x.workload == r.workload and x.mode == NAIVE)
        bound = report["bounds"][r.workload]
        per_question_bound = bound["seconds"] / bound["targets"]
        lines.append(f"| {r.workload} | {r.mode} | {r.qps:.2f} | {r.percentile(0.5):.3f} | {r.percentile(0.95):.3f} "
                     f"| {r.qps / naive.qps:.2f} | {(1 / r.qps) / per_question_bound:.2f} |")
    lines += ["", "Target ratios (same run):", ""]
    lines += [f"- {k}: **{v:.2f}×**" for k, v in speedups(report).items()]
    lines += [f"- p99 of `GET /health` while {k} post: **{v * 1000:.0f} ms**"
              for k, v in report.get("health_p99_s", {}).items()]
    lines += [
        f"- server peak RSS (VmHWM): **{report['server_peak_rss_mb'] or 0:.0f} MB**; benchmark process (naive loop and "
        f"in-process engine, one shared model): {report['bench_peak_rss_mb']:.0f} MB",
        "",
        "FLOP bound: 2 × non-embedding parameters × tokens that must be computed (each request's prompts as a radix "
        "tree, without the chat template's header, which is computed once for the run; for a document asked again, "
        "without the part its first ask computed) + 2 × head parameters × answers, at the best matmul rate probed "
        "on this machine during the run; attention and element-wise work are left out, so the bound is below what "
        "any implementation can reach.",
        "",
        "| workload | tokens that must be computed | answers | FLOPs | best matmul GFLOP/s | bound (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, b in report["bounds"].items():
        lines.append(f"| {name} | {b['unique_tokens']} | {b['targets']} | {b['flops']:.3g} | "
                     f"{b['matmul_flops_per_s'] / 1e9:.0f} | {b['seconds']:.1f} |")
    if report.get("fairness"):
        f = report["fairness"]
        lines += ["", "Fairness: tiny requests (1 question, about 150 tokens) from one client over HTTP, in "
                  "alternating blocks — alone, then while another client keeps a 50-question request on a new "
                  "~2,000-token document in flight:", "",
                  "| tiny requests | count | p50 (s) | p95 (s) | max (s) |", "|---|---:|---:|---:|---:|"]
        for label, key in (("alone", "alone"), ("with a 50-question document in flight", "during")):
            v = f[key]
            lines.append(f"| {label} | {len(v)} | {_percentile(v, 0.5):.3f} | {_percentile(v, 0.95):.3f} | "
                         f"{max(v):.3f} |")
        ratio = _percentile(f["during"], 0.95) / _percentile(f["alone"], 0.95)
        lines += ["", f"The 50-question requests meanwhile: {len(f['large'])}, p50 "
                  f"{_percentile(f['large'], 0.5):.2f} s. p95 of tiny requests, in flight / alone: **{ratio:.2f}×**."]
    lines += ["", "Matmul rate probes (GFLOP/s), in run order: " +
              ", ".join(f"{x:.0f}" for x in report.get("matmul_probes_gflops", [])), ""]
    lines += ["Largest difference between the naive loop's and decisiond's probabilities (same tickets): " +
              ", ".join(f"{k} {v:.1e}" for k, v in report["agreement"].items()), ""]
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    data = {k: v for k, v in report.items() if k != "rows"}
    data["rows"] = [{**asdict(r), "qps": r.qps, "p50": r.percentile(0.5), "p95": r.percentile(0.95)}
                    for r in report["rows"]]
    data["speedups"] = speedups(report)
    return json.dumps(data, indent=2, default=str)
