"""How the benchmark measures: the report's rows and their mode names, percentiles, peak RSS, the naive loop and
decisiond in-process timed side by side, and the FLOP bound (the best matmul rate probed, the FLOPs a workload
needs)."""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..canonical import DecisionRequest
from ..engine.local import LocalEngine
from ..engine.packing import common_prefix, pack
from ..engine.prompt import labels_for, render_question
from ..probability import label_probabilities
from ..text import render_input

NAIVE = "naive loop (transformers, 1 forward/question)"
IN_PROCESS = "decisiond in-process"
SERVED = "decisiond → llama.cpp's server (logprobs provider)"
SERVED_VLLM = "decisiond → vLLM (logprobs provider)"
# Each served engine's row, by the engine's name.
SERVED_MODES = {"llama.cpp's server": SERVED, "vLLM": SERVED_VLLM}
HTTP = "decisiond HTTP"
CACHE_MISS = "response cache: miss (first ask), HTTP 1 client"
CACHE_HIT = "response cache: hit (same request again), HTTP 1 client"


def clients_phrase(clients: int) -> str:
    """``1 client``, ``4 clients``: in an HTTP row's mode and in the key of its ``/health`` probe."""
    return f"{clients} client{'s' if clients > 1 else ''}"


def http_mode(clients: int) -> str:
    """The mode of an HTTP throughput row: ``decisiond HTTP, 4 clients``."""
    return f"{HTTP}, {clients_phrase(clients)}"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..1); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)] if ordered else float("nan")


@dataclass
class Row:
    workload: str
    mode: str
    requests: int
    questions: int
    seconds: float
    latencies: list[float] = field(default_factory=list, repr=False)
    tokens: int = 0  # prompt tokens of the requests' answers (usage.input_tokens), where counted

    @property
    def qps(self) -> float:
        return self.questions / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak resident memory in MB: this process's (``ru_maxrss``), or another's high-water mark (``VmHWM``)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss(pid: int) -> bool:
    """Start ``pid``'s high-water mark again from its current RSS (Linux: ``clear_refs`` 5), so that the next reading
    is the peak of what came after. False where the system does not allow it (the peaks then accumulate)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


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
            logits = model(torch.tensor([input_ids], device=model.device)).logits[0, -1]
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


# ------------------------------------------------------------------------------------------ FLOP bound


class MatmulRate:
    """The best FLOP/s a model-shaped matmul reached on this machine, probed again and again through the run: a
    shared machine's slower minutes lower single probes (178 and 269 GFLOP/s were read in two runs), and only the
    best rate keeps the bound a bound."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tokens: int = 512):
        self.shape, self.dtype, self.device = (tokens, hidden, intermediate), dtype, torch.device(device)
        self.rates: list[float] = []

    def probe(self) -> float:
        tokens, hidden, intermediate = self.shape
        a = torch.randn(tokens, hidden, dtype=self.dtype, device=self.device)
        b = torch.randn(hidden, intermediate, dtype=self.dtype, device=self.device)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            self._sync()
            t = time.perf_counter()
            a @ b
            self._sync()
            times.append(time.perf_counter() - t)
        self.rates.append(2 * tokens * hidden * intermediate / min(times))
        return self.rates[-1]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def best(self) -> float:
        return max(self.rates)


def flop_work(engine: LocalEngine, requests: list[DecisionRequest],
              asked_before: list[DecisionRequest] | None = None) -> dict[str, Any]:
    """FLOPs the workload needs, computing each distinct token once: per request, the radix tree of its prompts
    without the template header (computed once for the run), or, for a document ``asked_before``, without the part
    it shares with that earlier request; logits at each answer; and each computed token's attention over every
    earlier token of its prompt, cached ones included (they must be read: a document asked again is attended to in
    full by its new tokens)."""
    model = engine.loaded.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    body = total - embed.numel() - (0 if head is embed else head.numel())
    header = len(engine.prompter.header_ids(engine.prompter.template_kwargs({})))
    unique, targets, keys = 0 if asked_before else header, 0, 0
    for i, request in enumerate(requests):
        prompts = [q.prompt.ids for q in engine.prepare(request).questions]
        skip = header
        if asked_before:
            earlier = engine.prepare(asked_before[i]).questions[0].prompt.ids
            skip = max(skip, common_prefix([prompts[0], earlier]))
        row = pack(prompts, min(skip, min(len(p) for p in prompts) - 1))
        unique += len(row)
        keys += sum(p + 1 for p in row.positions)  # a token at position p attends to p + 1 keys
        targets += len(prompts)
    attention = attention_flops_per_key(model.config) * keys
    return {"body_params": body, "head_params": head.numel(), "unique_tokens": unique, "targets": targets,
            "attended_keys": keys, "attention_flops": attention,
            "flops": 2 * body * unique + 2 * head.numel() * targets + attention}


def attention_flops_per_key(config: Any) -> int:
    """One query against one key, over all layers: scores (q·k) and the weighted sum of values, 2 FLOPs a
    multiply-add each, for every attention head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * int(config.num_hidden_layers) * int(config.num_attention_heads) * int(head_dim)
