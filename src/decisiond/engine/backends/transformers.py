"""The transformers backend: label log-probs from a causal LM's forward passes, on CPU or GPU.

How a batch of requests (groups) is computed, top to bottom:

1. **Plan each group.** Its prompts share a prefix ``P`` (template header and document; at least one token of
   every prompt is left out of it, to be read at). The cross-request ``PrefixCache`` gives the KV of the longest
   cached prefix of ``P`` (``kv.Chain``): ``k`` tokens that need no compute — at least the chat template's header
   once any request has been answered. Then either
   - **one row**: when ``P[k:]`` and the prompts' own tails fit one pass (a short request), they are packed as a
     radix tree (``packing``) into a single row after the cached ``k`` tokens: one forward pass for the request,
     which also writes ``P[k:]``'s KV into a new block for the cache; or
   - **prefill, then tails**: ``P[k:]`` is prefilled in chunks into a new block (and the result cached), and the
     prompts' own tails, packed, go into rows that all attend to it: a shared prefix of any length is computed
     once, whatever the row budget.
   A prefix extending a cached one holds the cached blocks and a block of its own new tokens (``kv``): a document
   asked again is never copied. A request asked again computes only its tails against the cached prefix; its
   answers then differ from the first ask's at float rounding only (about 1e-7 in float32).
   Prefill chunks and passes take at most ``step_budget`` tokens, which the scheduler sets: ``max_batch_tokens``
   for small requests, an eighth of it for a large request while others wait (so that it can answer them between
   two short passes), half of it for a large request alone.
2. **Run the rows** (tails packed to at most one pass) in passes of at most ``step_budget`` padded tokens.
   Rows of different groups have different pasts: each attention layer reads each row's past, padded to the
   longest one (``kv.PassCache``), and a 4-D mask lets each token see its own row's past and its own prompt's
   earlier tokens; explicit positions put every token at its place in its own prompt.
3. **Read** the log-softmax over the full vocabulary at each prompt's last token, in float64.

Models whose attention is not plain causal over the whole context (sliding windows, mixed layer types) take the
``reference`` path — one pass per prompt — which needs no custom mask and no cache.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...limits import DEFAULT_MAX_BATCH_TOKENS
from ..kv import Block, Chain, Geometry, PassCache, Store, capacity_for
from ..memory import RELEASE_EVERY, release_freed
from ..packing import PackedRow, common_prefix, pack, split_rows
from ..prefix_cache import PrefixCache, default_prefix_cache_bytes
from .base import Group, Scored, Steps, run_steps
from .decoder import LlamaDecoder

log = logging.getLogger("decisiond.engine")

# Rows of question tails are packed to at most one pass (``step_budget``) and at least this many tokens: passes are
# cut small while other requests wait, and one row a pass then reads its document's KV once.
ROW_TOKENS = 128


@dataclass
class Stats:
    """Counters of the work done, for tests and benchmarks."""

    passes: int = 0
    computed_tokens: int = 0  # real tokens run through the model (prefill chunks and rows)
    padded_tokens: int = 0  # rows × width of every pass, padding included
    prefill_tokens: int = 0  # of computed_tokens, those prefilled in chunks
    reused_tokens: int = 0  # prompt-prefix tokens taken from the prefix cache
    largest_pass: int = 0  # the most padded tokens of one pass


@dataclass
class RowWork:
    """One packed row of one group, after the cached prefix it continues."""

    group: int
    row: PackedRow
    members: list[int]  # the group's prompt indices, in the row's target order
    past: Chain
    # The row's first tokens to write into a block (a prefix it computes), and the prefix to cache after the pass.
    store: Store | None = None
    keep: tuple[tuple[int, ...], Chain] | None = None


@dataclass
class Plan:
    rows: list[RowWork] = field(default_factory=list)
    computed: int = 0
    reused: int = 0


class TransformersBackend:
    def __init__(self, model: Any, name: str = "", max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 prefix_cache_bytes: int | None = None, description: str = ""):
        self.model = model
        self.name = name
        self.max_batch_tokens = max_batch_tokens
        self.device = next(model.parameters()).device
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(config.vocab_size)
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        self.packing = impl in ("sdpa", "eager") and layer_types == {"full_attention"} and not sliding
        self.bool_mask = impl == "sdpa"
        # Llama models run through ``decoder`` (the same function in fewer operations), others through transformers.
        self.decoder = LlamaDecoder.of(model) if self.packing else None
        log.info("model %s (%s) is served by %s", name or "(unnamed)", type(model).__name__, self.path)
        # Padded tokens the next pass may take: ``max_batch_tokens``, or less while other requests wait (the
        # scheduler sets it before each step).
        self.step_budget = max_batch_tokens
        self.geometry = Geometry.of(model)
        if prefix_cache_bytes is None:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            context = int(getattr(config, "max_position_embeddings", None) or 2048)
            prefix_cache_bytes = default_prefix_cache_bytes(weights, self.geometry.bytes_per_token, context)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self.stats = Stats()
        self.description = description
        # The input of the output layer in the last forward pass (the final hidden states at the positions whose
        # logits are read): each prompt's features (``Scored.features``), seen by a hook held during each pass.
        self._head_input: torch.Tensor | None = None
        self._head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    @contextlib.contextmanager
    def _reading_head(self) -> Iterator[None]:
        """Keep the output layer's input of the forward passes this thread runs meanwhile (``_head_input``). The
        hook is the backend's own and lives only as long as the pass: another backend over the same model, on
        another thread, neither sees nor disturbs it."""
        self._head_input = None
        if self._head is None:
            yield
            return
        thread = threading.get_ident()

        def capture(module: Any, args: tuple[Any, ...]) -> None:
            if threading.get_ident() == thread and args and isinstance(args[0], torch.Tensor):
                self._head_input = args[0]

        handle = self._head.register_forward_pre_hook(capture)
        try:
            yield
        finally:
            handle.remove()

    def describe(self) -> str:
        return self.description or f"{self.name} (transformers)"

    @property
    def path(self) -> str:
        """Which forward pass computes this model's answers, and why (logged once the backend is built)."""
        if self.decoder is not None:
            return "decisiond's Llama decoder, in packed passes with a prefix cache"
        if self.packing:
            return ("transformers' forward pass, in packed passes with a prefix cache (the Llama decoder covers "
                    "float32 LlamaForCausalLM models with SDPA attention and silu MLPs only)")
        return ("one plain transformers forward pass per prompt, without packing or a prefix cache (its attention "
                "is not causal over the whole context: a sliding window or mixed layer types)")

    # ------------------------------------------------------------------------------------ scoring

    def score(self, groups: Sequence[Group]) -> list[Scored]:
        return run_steps(self.steps(groups))

    def steps(self, groups: Sequence[Group]) -> Steps:
        """``score`` one forward pass at a time: yields the tokens of each pass, returns the answers. The scheduler
        runs other requests' passes in between, and stops a request nobody waits for any longer."""
        if not self.packing:
            return (yield from self._one_by_one(groups))
        plans = []
        for i, g in enumerate(groups):
            plans.append((yield from self._plan(i, g)))
        logprobs: list[dict[int, list[float]]] = [{} for _ in groups]
        features: list[dict[int, torch.Tensor | None]] = [{} for _ in groups]
        rows = [r for plan in plans for r in plan.rows]
        while rows:
            batch = self._next_pass(rows)
            del rows[:len(batch)]
            for work, values in zip(batch, self._run(batch, [groups[w.group] for w in batch])):
                logprobs[work.group].update(zip(work.members, (v for v, _ in values)))
                features[work.group].update(zip(work.members, (f for _, f in values)))
                if work.keep is not None:
                    self.prefixes.put(work.keep[0], work.keep[1], work.keep[1].parts())
            self._release_evicted()
            if rows:  # after the last pass: the answers, at once
                yield sum(len(w.row) for w in batch)
        return [Scored([lp[i] for i in range(len(g.prompts))], plan.computed, plan.reused,
                       [f[i] for i in range(len(g.prompts))])
                for g, lp, f, plan in zip(groups, logprobs, features, plans)]

    def _one_by_one(self, groups: Sequence[Group]) -> Steps:
        out, last = [], 0
        for g in groups:
            one_by_one, features = [], []
            for prompt, labels in zip(g.prompts, g.labels):
                if last:  # the pass before this one (the last pass returns at once)
                    yield last
                one_by_one.append(self.reference(prompt, labels))
                features.append(_feature(self._head_input, 0, -1))
                last = len(prompt)
            out.append(Scored(one_by_one, sum(len(p) for p in g.prompts), 0, features))
        return out

    def _plan(self, index: int, group: Group) -> Generator[int, None, Plan]:
        prompts = group.prompts
        shared = min(common_prefix(prompts), min(len(p) for p in prompts) - 1)
        prefix = tuple(prompts[0][:shared])
        k, cached = self.prefixes.longest(prefix) if shared else (0, None)
        past = cached.truncate(k) if isinstance(cached, Chain) and k else Chain()
        plan = Plan(reused=k)
        self.stats.reused_tokens += k
        if shared - k + sum(len(p) - shared for p in prompts) <= self.step_budget:
            # A short request: its prefix and tails in one row, one pass.
            row = pack(prompts, skip=k)
            work = RowWork(index, row, list(range(len(prompts))), past)
            if shared > k:
                kept, block = self._extend(past, shared - k)
                work.past = kept.then(block, block.filled)
                work.store = Store(block, block.filled, shared - k)
                work.keep = (prefix, kept.then(block, block.filled + shared - k))
            plan.rows.append(work)
            plan.computed = len(row)
            return plan
        if shared > k:
            past = yield from self._prefill(prefix, past, k)
            plan.computed += shared - k
            k = shared
        # A prompt whose own tail is over the budget: its tail is prefilled too, and its last token read alone.
        short = []
        for i, prompt in enumerate(prompts):
            if len(prompt) - k <= self.max_batch_tokens:
                short.append(i)
                continue
            own = yield from self._prefill(tuple(prompt[:-1]), past, k)
            plan.rows.append(RowWork(index, pack([prompt], skip=len(prompt) - 1), [i], own))
            plan.computed += len(prompt) - k
        # Tails in rows of at most one pass (at least ROW_TOKENS): rows of one group share their past, which each row
        # of a pass reads on its own.
        width = min(max(ROW_TOKENS, self.step_budget), self.max_batch_tokens)
        rows = split_rows([prompts[i] for i in short], width, skip=k) if short else []
        for members, row in rows:
            plan.rows.append(RowWork(index, row, [short[m] for m in members], past))
            plan.computed += len(row)
        return plan

    def _prefill(self, tokens: tuple[int, ...], past: Chain, start: int) -> Generator[int, None, Chain]:
        """The KV of ``tokens``, given that of its first ``start`` tokens, computed in chunks into one new block
        (and cached)."""
        kept, block = self._extend(past, len(tokens) - start)
        head = block.filled
        begin = start
        while begin < len(tokens):
            end = min(begin + self.step_budget, len(tokens))
            chunk = pack([tokens[:end]], skip=begin)
            at = head + begin - start
            self._forward([RowWork(-1, chunk, [], kept.then(block, at), Store(block, at, end - begin))])
            self.stats.prefill_tokens += end - begin
            yield end - begin
            begin = end
        chain = kept.then(block, head + len(tokens) - start)
        self.prefixes.put(tokens, chain, chain.parts())
        return chain

    def _release_evicted(self) -> None:
        """Once the prefix cache has freed a share of its budget, give that memory back to the system (``memory``);
        a cache that holds nothing (``--prefix-cache-mb 0``) frees nothing, and never trims."""
        if self.prefixes.evicted and self.prefixes.evicted * RELEASE_EVERY >= self.prefixes.max_bytes:
            self.prefixes.take_evicted()
            release_freed()

    def _extend(self, past: Chain, new: int) -> tuple[Chain, Block]:
        """A block for ``new`` tokens after ``past``, and the pieces of ``past`` worth holding: the block's head is a
        copy of the others (``Chain.split_for_reuse``); ``block.filled`` tokens of it are the head."""
        kept, copied = past.split_for_reuse()
        capacity = capacity_for(len(copied) + new)
        self.prefixes.make_room(self.geometry.bytes_per_token * capacity)
        self._release_evicted()
        block = Block(self.geometry, capacity)
        block.copy_from(copied)
        return kept, block

    def _next_pass(self, rows: list[RowWork]) -> list[RowWork]:
        """The first rows that fit one pass of ``step_budget`` padded tokens (a longer row alone)."""
        batch = [rows[0]]
        width = len(rows[0].row)
        for work in rows[1:]:
            width = max(width, len(work.row))
            if (len(batch) + 1) * width > self.step_budget:
                break
            batch.append(work)
        return batch

    def _run(self, batch: list[RowWork], groups: list[Group]
             ) -> list[list[tuple[list[float], torch.Tensor | None]]]:
        """Label log-probs and features of every prompt of every row."""
        logits, where = self._forward(batch)
        hidden = self._head_input
        out = []
        for r, (work, group) in enumerate(zip(batch, groups)):
            per_prompt = []
            for slot, member in zip(work.row.targets, work.members):
                lp = torch.log_softmax(logits[r, where[slot]].to(torch.float64), dim=-1)
                per_prompt.append(([float(lp[i]) for i in group.labels[member]], _feature(hidden, r, where[slot])))
            out.append(per_prompt)
        return out

    # ------------------------------------------------------------------------------ the forward pass

    @torch.inference_mode()
    def _forward(self, batch: list[RowWork]) -> tuple[torch.Tensor, dict[int, int]]:
        """One forward pass over padded rows, each after its own past, writing what each row stores. Returns the
        logits ``[rows, wanted, vocabulary]`` and where each target position (an index in its row) is among them."""
        rows = [w.row for w in batch]
        count, width = len(rows), max(len(r) for r in rows)
        ids = torch.zeros(count, width, dtype=torch.long)
        positions = torch.zeros(count, width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row.tokens)
            positions[r, :len(row)] = torch.tensor(row.positions)
            positions[r, len(row):] = row.positions[-1] if len(row) else 0
        wanted = sorted({t for row in rows for t in row.targets}) or [width - 1]
        cache = PassCache([w.past for w in batch], [w.store for w in batch], width)
        mask = self._mask(batch, width, cache.past_len)
        ids, positions = ids.to(self.device), positions.to(self.device)
        keep = torch.tensor(wanted, device=self.device)
        with self._reading_head():
            if self.decoder is not None:
                logits = self.decoder(ids, positions, mask, cache, keep)
            else:
                logits = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                                    logits_to_keep=keep, **{self.cache_arg: cache}).logits
        cache.finish()
        self.stats.passes += 1
        self.stats.computed_tokens += sum(len(r) for r in rows)
        self.stats.padded_tokens += count * width
        self.stats.largest_pass = max(self.stats.largest_pass, count * width)
        return logits, {t: k for k, t in enumerate(wanted)}

    def _mask(self, batch: list[RowWork], width: int, past_len: int) -> torch.Tensor:
        """``[rows, 1, width, past_len + width]``: each row's own past, then its tree mask."""
        mask = torch.zeros(len(batch), 1, width, past_len + width, dtype=torch.bool)
        for r, work in enumerate(batch):
            n = len(work.row)
            mask[r, 0, :n, :len(work.past)] = True
            mask[r, 0, :n, past_len:past_len + n] = work.row.mask()
            padding = torch.arange(n, width)
            mask[r, 0, padding, past_len + padding] = True  # padding sees itself: no empty softmax rows
        if self.bool_mask:
            return mask.to(self.device)
        return torch.zeros(mask.shape, dtype=self.model.dtype).masked_fill(
            ~mask, torch.finfo(self.model.dtype).min).to(self.device)

    # -------------------------------------------------------------------------------- one by one

    @torch.inference_mode()
    def reference(self, ids: Sequence[int], label_ids: Sequence[int]) -> list[float]:
        """One plain forward pass over one prompt: the yardstick the packed path is tested against."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with self._reading_head():
            logits = self.model(input_ids=x, logits_to_keep=1, use_cache=False).logits[0, -1]
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        self.stats.passes += 1
        self.stats.computed_tokens += len(ids)
        return [float(lp[i]) for i in label_ids]


def _feature(hidden: torch.Tensor | None, row: int, column: int) -> torch.Tensor | None:
    """A prompt's features: the output layer's input at its answer position, a float32 vector on the CPU (None when
    the output layer was not seen). Left as a tensor: only the features of answers are turned into numbers."""
    if hidden is None or hidden.dim() != 3:
        return None
    return hidden[row, column].float().cpu()
