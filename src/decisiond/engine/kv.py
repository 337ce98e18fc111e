"""KV memory: the keys and values of computed prompt tokens, and the cache object a forward pass reads and writes.

- ``Block``: the keys and values of consecutive tokens for every layer, in ONE allocation (``[layers, 2, kv heads,
  tokens, head dim]``), sized when the tokens to compute are known and filled in place pass after pass: a
  document prefilled in chunks is never copied, and a block large enough to matter is its own ``mmap`` that goes
  back to the system when the block is freed (many per-layer tensors would fragment the heap instead).
- ``Chain``: a prompt prefix's KV as pieces of blocks, in order. A prefix that extends a cached one (a document
  asked a new question) is the cached chain plus a block for its own new tokens: the document's block is shared,
  never duplicated, and the prefix cache counts each block once (``parts``). A few tokens of a large block (the
  chat header at the start of a document) are copied instead, so that they do not keep the whole block alive.
- ``PassCache``: what the model's attention layers call (``update``) during one forward pass over padded rows, each
  after its own past chain: it writes the new tokens of a row into its block when asked (``Store``) and returns,
  per layer, the keys and values the row attends to — its past, padded to the longest past of the pass, then the
  pass's own tokens. Those are built one layer at a time and dropped after the layer: the whole past is never held
  twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Geometry:
    """The shape of a model's KV cache: per token, ``layers`` × keys and values of ``heads`` × ``head_dim``."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: Any) -> Geometry:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        parameter = next(model.parameters())
        return cls(int(config.num_hidden_layers), heads, head_dim, parameter.dtype, parameter.device)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


# A block of at least ROOM_FROM tokens (a document) is allocated ROOM_TOKENS longer: room after its end where a pass
# of a few new tokens (a question asked again about the document) writes its keys and reads the document in place
# (``PassCache``), instead of copying it for every layer. At most 1/8 more memory, about 6 % for 2,000 tokens.
ROOM_FROM, ROOM_TOKENS = 1024, 128


def capacity_for(tokens: int) -> int:
    """The capacity of a block made for ``tokens`` tokens of a prefix."""
    return tokens + (ROOM_TOKENS if tokens >= ROOM_FROM else 0)


class Block:
    """Room for the KV of ``capacity`` consecutive tokens; ``filled`` of them computed so far."""

    def __init__(self, geometry: Geometry, capacity: int):
        self.data = torch.empty((geometry.layers, 2, geometry.heads, capacity, geometry.head_dim),
                                dtype=geometry.dtype, device=geometry.device)
        self.capacity = capacity
        self.filled = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_from(self, chain: Chain) -> None:
        """Its first tokens: a copy of ``chain``'s."""
        at = 0
        for p in chain.pieces:
            self.data[:, :, :, at:at + len(p)] = p.block.data[:, :, :, p.start:p.end]
            at += len(p)
        self.filled = at

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.data[layer, 0, :, start:end]

    def values(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.data[layer, 1, :, start:end]


@dataclass(frozen=True)
class Piece:
    block: Block
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Chain:
    """A prefix's KV: pieces of blocks, in token order."""

    pieces: tuple[Piece, ...] = ()

    def __len__(self) -> int:
        return sum(len(p) for p in self.pieces)

    def truncate(self, length: int) -> Chain:
        """The chain of its first ``length`` tokens."""
        out, left = [], length
        for piece in self.pieces:
            if left <= 0:
                break
            out.append(Piece(piece.block, piece.start, piece.start + min(left, len(piece))))
            left -= len(out[-1])
        if left > 0:
            raise ValueError(f"a chain of {len(self)} tokens has no prefix of {length}")
        return Chain(tuple(out))

    def then(self, block: Block, length: int) -> Chain:
        """This chain followed by the first ``length`` tokens of ``block``."""
        return Chain((*self.pieces, Piece(block, 0, length))) if length else self

    def split_for_reuse(self) -> tuple[Chain, Chain]:
        """``(kept, copied)``: the pieces a chain extending this one should hold, and the rest, which it should copy
        into its own block: from the first piece that uses under half of its block on. Holding a few tokens of a large
        block (a chat header inside a document's block) would keep the whole block alive for them."""
        for i, piece in enumerate(self.pieces):
            if 2 * len(piece) < piece.block.capacity:
                return Chain(self.pieces[:i]), Chain(self.pieces[i:])
        return self, Chain()

    def parts(self) -> list[tuple[int, int]]:
        """``(id, bytes)`` of each distinct block: what the prefix cache counts once, however many chains share it."""
        seen = {id(p.block): p.block.nbytes for p in self.pieces}
        return list(seen.items())


@dataclass(frozen=True)
class Store:
    """Write a row's first ``count`` new tokens into ``block`` at ``offset`` (it holds the tokens before them)."""

    block: Block
    offset: int
    count: int


class PassCache:
    """The ``cache`` of one forward pass over ``pasts`` (one chain per row; the rows padded to ``width`` tokens)."""

    is_compileable = False

    def __init__(self, pasts: Sequence[Chain], stores: Sequence[Store | None], width: int = 0):
        self.pasts = list(pasts)
        self.stores = list(stores)
        self.lengths = [len(c) for c in self.pasts]
        self.past_len = max(self.lengths, default=0)
        self.room = self._room(width)
        if self.room is not None:  # the keys read are the block's, from the past's start to the room
            self.past_len = len(self.room) - width

    def _room(self, width: int) -> Piece | None:
        """Where a single row's keys can be read in place: its past is one piece of a block that has room for the
        row's ``width`` tokens after its computed ones. The row's keys and values are written there (where a ``Store``
        of the row into that block writes its first tokens anyway), and each layer attends to a view of the block: the
        past is not copied (a document asked again is read where it lies). Tokens the block holds after the past (a
        question asked before about the document) lie between the two: the mask hides them, as it hides the padding
        of a shorter past (``past_len`` counts them). The room is scratch: it is not counted as filled."""
        if len(self.pasts) != 1 or len(self.pasts[0].pieces) != 1 or not width:
            return None
        piece, store = self.pasts[0].pieces[0], self.stores[0]
        block = piece.block
        if piece.end > block.filled or block.filled + width > block.capacity:
            return None
        if store is not None and store.block is block and store.offset != block.filled:
            return None  # it writes elsewhere in the block: no room of its own there
        return Piece(block, piece.start, block.filled + width)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past_len

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for row, store in enumerate(self.stores):
            if store is not None and store.count:
                end = store.offset + store.count
                store.block.data[layer_idx, 0, :, store.offset:end] = keys[row, :, :store.count]
                store.block.data[layer_idx, 1, :, store.offset:end] = values[row, :, :store.count]
        if not self.past_len:
            return keys, values
        if self.room is not None:
            block, start, end = self.room.block, self.room.start, self.room.end
            at = end - keys.shape[2]
            block.data[layer_idx, 0, :, at:end] = keys[0]
            block.data[layer_idx, 1, :, at:end] = values[0]
            return block.keys(layer_idx, start, end)[None], block.values(layer_idx, start, end)[None]
        if len(self.pasts) == 1:
            pieces = self.pasts[0].pieces
            return (torch.cat([*(p.block.keys(layer_idx, p.start, p.end)[None] for p in pieces), keys], dim=2),
                    torch.cat([*(p.block.values(layer_idx, p.start, p.end)[None] for p in pieces), values], dim=2))
        return self._padded(keys, layer_idx, 0), self._padded(values, layer_idx, 1)

    def _padded(self, new: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        """Each row's past, zero-padded at its end to the longest past (the mask hides the padding; zeros keep the
        masked products finite), then the pass's own tokens."""
        rows, heads, width, dim = new.shape
        out = new.new_empty(rows, heads, self.past_len + width, dim)
        for row, chain in enumerate(self.pasts):
            at = 0
            for p in chain.pieces:
                out[row, :, at:at + len(p)] = p.block.data[layer, which, :, p.start:p.end]
                at += len(p)
            out[row, :, at:self.past_len] = 0
        out[:, :, self.past_len:] = new
        return out

    def finish(self) -> None:
        """After the pass: the stored tokens count as computed."""
        for store in self.stores:
            if store is not None:
                store.block.filled = max(store.block.filled, store.offset + store.count)
