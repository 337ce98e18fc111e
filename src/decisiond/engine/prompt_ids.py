"""Token ids of long prompts that begin like a recent one, from the point where they differ.

The prompts of a document asked several questions (in one request, or again later) share the chat header and the
whole document, and differ in the question's last lines: tokenizing each of them whole would cost a visible share
of answering a question asked again about a cached document (benchmarks/ENGINE_NOTES.md).

A byte-level BPE tokenizer with GPT-2's pre-tokenizer (GPT-2, SmolLM2, StarCoder…) cuts text into words with a
regular expression scanned left to right, then each word into tokens on its own; a line break followed by a character
that is not a space always ends a word. So where two texts agree up to well past such a line break, the tokens of the
first text up to the break are the second's too, and only the rest of the second is tokenized. The cut is checked on
the known text itself (its tokens must be those of its part before the cut followed by those of its part after), and
it is taken only where it saves most of the work: otherwise the whole new text is tokenized. Tokenizers with other
pre-tokenizers (Llama 3's and Qwen's split line breaks differently) always tokenize whole.

``PromptIds.encode`` equals ``tokenizer.encode(text, add_special_tokens=False)`` (the tests compare them on texts made
to break it).
"""

from __future__ import annotations

import threading
from typing import Any

from .prefix_cache import Lru

# Texts shorter than this are tokenized whole (cheap); this many recent long texts are kept with their ids, each at
# most MAX_CHARS long (a longer prompt is refused for the context length anyway: it is not kept).
MIN_CHARS, ENTRIES, MAX_CHARS = 2048, 16, 65536
# The cut lies at least this many characters before the texts differ: a word's end depends on a character or two
# after it (the regular expression's look-ahead).
MARGIN = 16


def _shared_length(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (by bisection, each step a prefix comparison in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if b.startswith(a[:middle]):
            low = middle
        else:
            high = middle - 1
    return low


def byte_level_bpe(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a fast byte-level BPE tokenizer with GPT-2's pre-tokenizer and no normalizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or type(backend.model).__name__ != "BPE":
        return False
    pre = backend.pre_tokenizer
    return (type(pre).__name__ == "ByteLevel" and not getattr(pre, "add_prefix_space", True)
            and getattr(pre, "use_regex", False))


class PromptIds:
    """``encode(text)``: the token ids of ``text`` (no special tokens added), reusing a recent text's ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.enabled = byte_level_bpe(tokenizer)
        self._known: Lru[tuple[int, ...]] = Lru(ENTRIES)  # recent long texts and their ids
        self._count = threading.Lock()
        self.reused = 0  # texts tokenized from a cut (for tests)

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if not self.enabled or len(text) < MIN_CHARS:
            return self._whole(text)
        known = self._known.get(text)
        if known is not None:
            return list(known)
        ids = self._from_known(text)
        if ids is None:
            ids = self._whole(text)
        else:
            with self._count:
                self.reused += 1
        if len(text) <= MAX_CHARS:
            self._known.put(text, tuple(ids))
        return ids

    def _from_known(self, text: str) -> list[int] | None:
        best, shared = "", 0
        best_ids: tuple[int, ...] = ()
        for other, ids in self._known.items():
            n = _shared_length(str(other), text)
            if n > shared:
                best, best_ids, shared = str(other), ids, n
        cut = self._cut(text, shared - MARGIN)
        # Taken where the two tails to tokenize are at most half the new text (a new document shares the chat header
        # with every earlier prompt: tokenizing the known text's rest then would cost more than the new text whole).
        if cut is None or 2 * ((len(best) - cut) + (len(text) - cut)) > len(text):
            return None
        # The cut checked on the known text: its ids are those of its head, then those of its rest.
        rest = self._whole(best[cut:])
        head = len(best_ids) - len(rest)
        if head <= 0 or list(best_ids[head:]) != rest:
            return None
        return [*best_ids[:head], *self._whole(text[cut:])]

    @staticmethod
    def _cut(text: str, before: int) -> int | None:
        """The last position at most ``before`` that follows a line break and holds a character other than a space."""
        brk = text.rfind("\n", 0, max(before, 0))
        while brk >= 0 and text[brk + 1].isspace():
            brk = text.rfind("\n", 0, brk)
        return brk + 1 if brk >= 0 else None
