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
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..canonical import DecisionRequest
from ..engine.local import LocalEngine
from ..engine.packing import pack
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


def naive_decide(model, tokenizer, request: DecisionRequest) -> list[list[float]]:
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


def side_by_side(name: str, requests: list[DecisionRequest], naive_count: int, naive, engine,
                 block: int = 10) -> tuple[Row, Row, list, list]:
    """The naive loop and the in-process engine take turns, a block of tickets each, the same tickets, alternating
    which goes first: a slower minute of a shared machine slows both, and neither runs in the other's wake within a
    block. Each row's time is the sum of its request latencies."""
    timings: dict[str, list[float]] = {"naive": [], "engine": []}
    answers: dict[str, list] = {"naive": [], "engine": []}
    for b, start in enumerate(range(0, len(requests), block)):
        chunk = requests[start:start + block]
        turn = [("naive", naive, chunk[: max(0, naive_count - start)]), ("engine", engine, chunk)]
        for who, call, subset in (turn if b % 2 == 0 else turn[::-1]):
            for request in subset:
                t = time.perf_counter()
                answers[who].append(call(request))
                timings[who].append(time.perf_counter() - t)
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


async def _clients(url: str, bodies: list[dict], clients: int,
                   headers: dict[str, str] = NO_STORE) -> tuple[float, list[float]]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
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

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return time.perf_counter() - start, latencies


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


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "decisiond.cli", "serve", "--model", model, "--port", str(port),
                                "--log-level", "warning", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if process.poll() is not None:
            raise RuntimeError("decisiond serve exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError("decisiond serve did not start")


def peak_rss_mb(pid: int | None = None) -> float:
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ------------------------------------------------------------------------------------------ FLOP bound


def matmul_flops(hidden: int, intermediate: int, dtype: torch.dtype, tokens: int = 512) -> float:
    """Measured FLOP/s of a model-shaped matmul on this machine (the median of 20 runs)."""
    a = torch.randn(tokens, hidden, dtype=dtype)
    b = torch.randn(hidden, intermediate, dtype=dtype)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * tokens * hidden * intermediate / statistics.median(times)


def flop_bound(engine: LocalEngine, requests: list[DecisionRequest], flops: float) -> dict:
    """Seconds the workload needs at the measured matmul rate, computing each distinct token once: per request,
    the radix tree of its prompts without the template header; the header once; logits at each answer."""
    model = engine.loaded.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    body = total - embed.numel() - (0 if head is embed else head.numel())
    unique, header, targets = 0, 0, 0
    for request in requests:
        prepared = engine.prepare(request)
        header = max(header, len(prepared.header))
        unique += len(pack([p.prompt.ids for p in prepared.questions], len(prepared.header)))
        targets += len(prepared.questions)
    unique += header
    work = 2 * body * unique + 2 * head.numel() * targets
    return {"body_params": body, "head_params": head.numel(), "unique_tokens": unique, "targets": targets,
            "flops": work, "matmul_flops_per_s": flops, "seconds": work / flops}


# ----------------------------------------------------------------------------------------------- run


def run(model: str = "default", tickets: int = 200, question_sets: tuple[int, ...] = (3, 10),
        clients: tuple[int, ...] = (1, 4, 16), naive_tickets: int | None = None, dtype: str = "float32",
        log=print) -> dict:
    from ..engine.model import load

    loaded = load(model, dtype=dtype)
    engine = LocalEngine(loaded)
    # All model math runs on the engine's worker thread, the naive loop's too: the same thread pool for both.
    on_worker = engine.scheduler.call
    config = loaded.model.config
    flops = on_worker(lambda: matmul_flops(config.hidden_size, getattr(config, "intermediate_size",
                                                                       4 * config.hidden_size), loaded.model.dtype))
    rows: list[Row] = []
    bounds: dict[str, dict] = {}
    agreement: dict[str, float] = {}
    server_rss: float | None = None
    for count in question_sets:
        name = f"{count}q"
        requests = workload.requests(tickets, count)
        warm = workload.requests(2, count, seed=99)
        bounds[name] = flop_bound(engine, requests, flops)
        naive_set = requests[: naive_tickets or tickets]
        for r in warm:
            on_worker(lambda: naive_decide(loaded.model, loaded.tokenizer, r))
            engine.decide(r)
        log(f"[{name}] naive loop ({len(naive_set)} tickets) and decisiond in-process ({len(requests)}), "
            "side by side …")
        naive_row, inproc_row, naive_answers, results = side_by_side(
            name, requests, len(naive_set),
            lambda r: on_worker(lambda: naive_decide(loaded.model, loaded.tokenizer, r)), engine.decide)
        rows += [naive_row, inproc_row]
        agreement[name] = max(abs(a - b) for res, ref in zip(results, naive_answers)
                              for ans, probs in zip(res.answers, ref) for a, b in zip(ans.probabilities, probs))
        process, url = start_server(model, ["--dtype", dtype])
        try:
            bodies = [workload.openai_body(r, "default") for r in requests]
            asyncio.run(_clients(url, [workload.openai_body(r, "default") for r in warm], 1))
            for n in clients:
                log(f"[{name}] decisiond over HTTP, {n} concurrent clients …")
                seconds, latencies = asyncio.run(_clients(url, bodies, n))
                rows.append(Row(name, f"decisiond HTTP, {n} client{'s' if n > 1 else ''}", len(bodies),
                                sum(len(r.questions) for r in requests), seconds, latencies))
            log(f"[{name}] repeated requests: cache miss then hit, ticket by ticket …")
            rows += repeated(url, name, workload.requests(tickets, count, seed=1234))
            server_rss = max(server_rss or 0.0, peak_rss_mb(process.pid))
        finally:
            process.terminate()
            process.wait(timeout=30)
    return {
        "rows": rows,
        "bounds": bounds,
        "agreement": agreement,
        "server_peak_rss_mb": server_rss,
        "bench_peak_rss_mb": peak_rss_mb(),
        "model": loaded.name,
        "dtype": dtype,
        "tickets": tickets,
        "naive_tickets": naive_tickets or tickets,
        "clients": list(clients),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
    }


def speedups(report: dict) -> dict[str, float]:
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
            out[f"{name}: cache miss p50 / cache hit p50"] = misses[0].percentile(0.5) / hits[0].percentile(0.5)
        if len(http) >= 2:
            out[f"{name}: HTTP {report['clients'][-1]} clients / HTTP {report['clients'][0]} client"] = http[-1].qps / http[0].qps
    return out


def markdown(report: dict, command: str) -> str:
    lines = [
        "# decisiond benchmark",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Model {report['model']} ({report['dtype']}), {report['tickets']} support tickets of about 150 tokens "
        f"(naive loop: first {report['naive_tickets']}), on {report['machine']}. All rows come from the same run; "
        "the naive loop and the in-process engine take turns, 10 tickets each (their times are the sums of their "
        "request latencies); only ratios are meant to carry over to other machines. HTTP throughput rows send "
        "`Cache-Control: no-store`; the response-cache rows ask other tickets, each twice in a row (a miss, then a hit "
        "of the same request), so that miss and hit latencies are measured side by side.",
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
    lines += [
        f"- server peak RSS (VmHWM): **{report['server_peak_rss_mb']:.0f} MB**; benchmark process (naive loop and "
        f"in-process engine, one shared model): {report['bench_peak_rss_mb']:.0f} MB",
        "",
        "FLOP bound: 2 × non-embedding parameters × tokens that must be computed (each request's prompts as a radix "
        "tree, without the chat template's header, which is computed once for the run) + 2 × head parameters × "
        "answers, at the matmul rate measured on this machine; attention and element-wise work are left out, so the "
        "bound is below what any implementation can reach.",
        "",
        "| workload | tokens that must be computed | answers | FLOPs | measured matmul GFLOP/s | bound (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, b in report["bounds"].items():
        lines.append(f"| {name} | {b['unique_tokens']} | {b['targets']} | {b['flops']:.3g} | "
                     f"{b['matmul_flops_per_s'] / 1e9:.0f} | {b['seconds']:.1f} |")
    lines += ["", "Largest difference between the naive loop's and decisiond's probabilities (same tickets): " +
              ", ".join(f"{k} {v:.1e}" for k, v in report["agreement"].items()), ""]
    return "\n".join(lines)


def to_json(report: dict) -> str:
    data = {k: v for k, v in report.items() if k != "rows"}
    data["rows"] = [{**asdict(r), "qps": r.qps, "p50": r.percentile(0.5), "p95": r.percentile(0.95)}
                    for r in report["rows"]]
    data["speedups"] = speedups(report)
    return json.dumps(data, indent=2, default=str)
