"""Shared-prefix packing: the question prompts of a request, stored once per shared token, in one sequence.

The prompts of one decision share the chat template's header and the whole input; only each question's tail
differs. ``pack`` builds the radix tree of the prompts and lays its nodes out depth first, so every shared token
appears once. A 4-D attention mask lets each token see exactly the tokens of its own prompt (its ancestors' tokens
and the earlier tokens of its own node), and explicit position ids give each token the position it has in its own
prompt. One forward pass over the packed row then yields, at each prompt's last token, the same next-token
distribution as a separate pass over that prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class PackedRow:
    tokens: list[int] = field(default_factory=list)
    # Position of each token within its own prompt (after any cached prefix).
    positions: list[int] = field(default_factory=list)
    # Radix-tree node of each token; nodes are numbered in layout order.
    node: list[int] = field(default_factory=list)
    # Parent node of each node (-1 for a root).
    parents: list[int] = field(default_factory=list)
    # Index in ``tokens`` of each prompt's last token, in prompt order.
    targets: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """``[n, n]`` bool: token i may attend to token j."""
        count = len(self.parents)
        ancestors = torch.eye(count, dtype=torch.bool)
        for child, parent in enumerate(self.parents):  # parents come before children
            if parent >= 0:
                ancestors[child] |= ancestors[parent]
        node = torch.tensor(self.node, dtype=torch.long)
        index = torch.arange(len(self.tokens))
        return ancestors[node[:, None], node[None, :]] & (index[None, :] <= index[:, None])


def pack(prompts: Sequence[Sequence[int]], skip: int = 0) -> PackedRow:
    """Pack ``prompts`` (all at least ``skip + 1`` tokens long) leaving out their first ``skip`` tokens, which a
    cached prefix provides."""
    row = PackedRow(targets=[-1] * len(prompts))
    _insert(row, prompts, list(range(len(prompts))), skip, parent=-1, parent_end=-1)
    return row


def _insert(row: PackedRow, prompts: Sequence[Sequence[int]], group: list[int], start: int, parent: int,
            parent_end: int) -> None:
    # Prompts that end here are answered at the parent's last token.
    ending = [i for i in group if len(prompts[i]) == start]
    for i in ending:
        row.targets[i] = parent_end
    group = [i for i in group if len(prompts[i]) > start]
    if not group:
        return
    first = prompts[group[0]]
    shared = min(len(prompts[i]) for i in group) - start
    for i in group[1:]:
        other = prompts[i]
        k = 0
        while k < shared and other[start + k] == first[start + k]:
            k += 1
        shared = k
    if shared == 0:
        # The group splits right here: one subtree per next token, in first-seen order.
        branches: dict[int, list[int]] = {}
        for i in group:
            branches.setdefault(prompts[i][start], []).append(i)
        for members in branches.values():
            _insert(row, prompts, members, start, parent, parent_end)
        return
    node = len(row.parents)
    row.parents.append(parent)
    base = len(row.tokens)
    row.tokens.extend(first[start:start + shared])
    row.positions.extend(range(start, start + shared))
    row.node.extend([node] * shared)
    _insert(row, prompts, group, start + shared, node, base + shared - 1)


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Number of leading tokens all prompts share."""
    if not prompts:
        return 0
    # The lexicographically first and last prompts differ first where any two do: one comparison loop, not one per
    # prompt (tuples are made lists: a list and a tuple do not compare).
    lists = [p if isinstance(p, list) else list(p) for p in prompts]
    low, high = min(lists), max(lists)
    n = min(len(low), len(high))
    k = 0
    while k < n and low[k] == high[k]:
        k += 1
    return k


def split_rows(prompts: Sequence[Sequence[int]], max_row_tokens: int,
               skip: int = 0) -> list[tuple[list[int], PackedRow]]:
    """Pack prompts into rows of at most about ``max_row_tokens`` tokens (a single longer prompt gets a row of its
    own). Rows are cut by an upper bound of their packed size — the prefix all prompts share, plus each prompt's
    rest — so each row is packed once. Returns ``(prompt indices, row)`` pairs."""
    shared = max(common_prefix(prompts), skip)
    groups: list[list[int]] = []
    size = 0
    for i, prompt in enumerate(prompts):
        rest = len(prompt) - shared
        if groups and size + rest <= max_row_tokens:
            groups[-1].append(i)
            size += rest
        else:
            groups.append([i])
            size = shared - skip + rest
    return [(members, pack([prompts[i] for i in members], skip)) for members in groups]
