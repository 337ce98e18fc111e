"""The benchmark's report, from one run's numbers: the target ratios (``speedups``), the markdown of
benchmarks/RESULTS.md, and the JSON of RESULTS.json (the markdown renders nothing the JSON does not hold)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from .measure import CACHE_HIT, CACHE_MISS, HTTP, IN_PROCESS, NAIVE, SERVED_MODES, percentile
from .workload import AGAIN, FIRST


def speedups(report: dict[str, Any]) -> dict[str, float]:
    """The issue's target ratios, computed from the rows of one run."""
    by = {(r.workload, r.mode): r for r in report["rows"]}
    out = {}
    for name in report["bounds"]:
        naive = by[(name, NAIVE)].qps
        out[f"{name}: in-process / naive"] = by[(name, IN_PROCESS)].qps / naive
        http = [r for r in report["rows"] if r.workload == name and r.mode.startswith(HTTP)]
        misses = [r for r in report["rows"] if r.workload == name and r.mode == CACHE_MISS]
        hits = [r for r in report["rows"] if r.workload == name and r.mode == CACHE_HIT]
        if misses and hits:
            out[f"{name}: cache miss p50 / cache hit p50"] = (misses[0].percentile(0.5)
                                                              / hits[0].percentile(0.5))
        if len(http) >= 2:
            key = f"{name}: HTTP {report['clients'][-1]} clients / HTTP {report['clients'][0]} client"
            out[key] = http[-1].qps / http[0].qps
    served = {mode: label for label, mode in SERVED_MODES.items()}
    for r in report["rows"]:
        if r.mode in served:
            local = by[(r.workload, IN_PROCESS)]
            out[f"{r.workload}: in-process / {served[r.mode]} (questions/s)"] = local.qps / r.qps
            if r.tokens and local.tokens:
                out[f"{r.workload}: in-process / {served[r.mode]} (prompt tokens/s: "
                    f"{local.tokens / local.seconds:.0f} / {r.tokens / r.seconds:.0f})"] = \
                    (local.tokens / local.seconds) / (r.tokens / r.seconds)
    if (AGAIN, IN_PROCESS) in by:
        again, first = by[(AGAIN, IN_PROCESS)], by[(FIRST, IN_PROCESS)]
        out["2K doc asked again / its first ask (in-process)"] = again.qps / first.qps
    return out


def spreads(report: dict[str, Any]) -> dict[str, float]:
    """p95 / p50 of the request latencies with the most concurrent HTTP clients, per workload: how evenly the
    server treats its clients."""
    most = report["clients"][-1] if report.get("clients") else None
    out = {}
    for r in report["rows"]:
        if most is not None and r.mode == f"{HTTP}, {most} clients" and r.latencies:
            out[f"{r.workload}: HTTP {most} clients, p95 / p50 latency"] = r.percentile(0.95) / r.percentile(0.5)
    return out


def markdown(report: dict[str, Any], command: str) -> str:
    """benchmarks/RESULTS.md: how the run was made, a row per workload and mode, the ratios, the FLOP bounds, the
    fairness blocks (when run), the matmul probes and the agreement of the naive loop with decisiond."""
    lines = _introduction(report, command) + _rows(report) + _ratios(report) + _bounds(report)
    lines += _fairness(report)
    lines += ["", "Matmul rate probes (GFLOP/s), in run order: " +
              ", ".join(f"{x:.0f}" for x in report.get("matmul_probes_gflops", [])), ""]
    lines += ["Largest difference between the naive loop's and decisiond's probabilities (same tickets): " +
              ", ".join(f"{k} {v:.1e}" for k, v in report["agreement"].items()), ""]
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    """RESULTS.json: the run's numbers, each row with its rate and percentiles, and the ratios."""
    data = {k: v for k, v in report.items() if k != "rows"}
    data["rows"] = [{**asdict(r), "qps": r.qps, "p50": r.percentile(0.5), "p95": r.percentile(0.95)}
                    for r in report["rows"]]
    data["speedups"] = speedups(report)
    data["latency_spread"] = spreads(report)
    return json.dumps(data, indent=2, default=str)


def _introduction(report: dict[str, Any], command: str) -> list[str]:
    return [
        "# decisiond benchmark",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Model {report['model']} ({report['dtype']}, on {report.get('device', 'cpu')}), {report['tickets']} support "
        f"tickets of about 150 tokens (naive loop: first {report['naive_tickets']}), on {report['machine']}. All "
        "rows come from the same run; the naive loop and the in-process engine take turns, 10 tickets each (2 "
        "documents of the long workload, 1 of the documents asked once and again; their times are the sums of "
        "their request latencies); only ratios are meant to carry "
        "over to other machines. Each HTTP phase asks tickets of its own, and the in-process rows others again, so "
        "that no row finds another's prompts in the prefix cache; one server answers every HTTP workload. HTTP "
        "throughput rows send `Cache-Control: no-store`; the response-cache rows ask other tickets, each twice in a "
        "row (a miss, then a hit of the same request), so that miss and hit latencies are measured side by side. "
        "Documents asked again are asked two at a time right after their first ask, while the prefix cache holds "
        "them." + (f" {report['note']}" if report.get("note") else ""),
        "",
    ]


def _rows(report: dict[str, Any]) -> list[str]:
    lines = ["| workload | mode | questions/s | p50 request (s) | p95 request (s) | × naive | time / FLOP bound |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        base = r.workload.split(" (beside ")[0]
        naive = next(x for x in report["rows"] if x.workload == base and x.mode == NAIVE)
        bound = report["bounds"][base]
        per_question_bound = bound["seconds"] / bound["targets"]
        lines.append(f"| {r.workload} | {r.mode} | {r.qps:.2f} | {r.percentile(0.5):.3f} | {r.percentile(0.95):.3f} "
                     f"| {r.qps / naive.qps:.2f} | {(1 / r.qps) / per_question_bound:.2f} |")
    return lines


def _ratios(report: dict[str, Any]) -> list[str]:
    lines = ["", "Target ratios (same run):", ""]
    lines += [f"- {k}: **{v:.2f}×**" for k, v in speedups(report).items()]
    lines += [f"- {k}: **{v:.2f}**" for k, v in spreads(report).items()]
    lines += [f"- p99 of `GET /health` while {k} post: **{v * 1000:.0f} ms**"
              for k, v in report.get("health_p99_s", {}).items()]
    by_workload = report.get("server_peak_rss_mb_by_workload") or {}
    each = "; ".join(f"{k} {v:.0f} MiB" for k, v in by_workload.items())
    budget = report.get("prefix_cache_mb")
    lines.append(f"- server peak RSS (VmHWM), one server through every HTTP workload: "
                 f"**{report['server_peak_rss_mb'] or 0:.0f} MiB**" + (f" (per workload: {each})" if each else "")
                 + (f", prefix cache budget {budget:.0f} MiB" if budget is not None else "")
                 + f"; benchmark process (naive loop and in-process engine, one shared model): "
                 f"{report['bench_peak_rss_mb']:.0f} MiB")
    return lines


def _bounds(report: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "FLOP bound: 2 × non-embedding parameters × tokens that must be computed (each request's prompts as a radix "
        "tree, without the chat template's header, which is computed once for the run; for a document asked again, "
        "without the part its first ask computed) + 2 × head parameters × answers + attention: each computed token "
        "against every earlier token of its prompt, cached ones included (4 × layers × heads × head size FLOPs a "
        "key: a document asked again must still be read by its new tokens), at the best matmul rate probed on this "
        "machine during the run; element-wise work is left out, so the bound is below what any implementation can "
        "reach.",
        "",
        "| workload | tokens that must be computed | answers | attention FLOPs | FLOPs | best matmul GFLOP/s | "
        "bound (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, b in report["bounds"].items():
        lines.append(f"| {name} | {b['unique_tokens']} | {b['targets']} | {b.get('attention_flops', 0):.3g} | "
                     f"{b['flops']:.3g} | {b['matmul_flops_per_s'] / 1e9:.0f} | {b['seconds']:.2f} |")
    return lines


def _fairness(report: dict[str, Any]) -> list[str]:
    if not report.get("fairness"):
        return []
    f = report["fairness"]
    lines = ["", "Fairness: tiny requests (1 question, about 150 tokens) from one client over HTTP, in "
             "alternating blocks — alone, then while another client keeps a 50-question request on a new "
             "~2,000-token document in flight:", "",
             "| tiny requests | count | p50 (s) | p95 (s) | max (s) |", "|---|---:|---:|---:|---:|"]
    for label, key in (("alone", "alone"), ("with a 50-question document in flight", "during")):
        v = f[key]
        lines.append(f"| {label} | {len(v)} | {percentile(v, 0.5):.3f} | {percentile(v, 0.95):.3f} | "
                     f"{max(v):.3f} |")
    ratio = percentile(f["during"], 0.95) / percentile(f["alone"], 0.95)
    lines += ["", f"The 50-question requests meanwhile: {len(f['large'])}, p50 "
              f"{percentile(f['large'], 0.5):.2f} s. p95 of tiny requests, in flight / alone: **{ratio:.2f}×**."]
    return lines
