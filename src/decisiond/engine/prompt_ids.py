"""Token ids of long prompts that begin like a recent one, from the point where they differ.

The prompts of a document asked several questions (in one request, or again later) share the chat header and the
whole document, about 2,000 tokens, and differ in the question's last lines: tokenizing each of them whole costs
3 ms a prompt on a CPU, as much as a twentieth of answering a question asked again about a cached document.

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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Texts shorter than this are tokenized whole (cheap); this many recent long texts are kept with their ids, each at
# most MAX_CHARS long (a longer prompt is refused for the context length anyway: it is not kept).
MIN_CHARS, ENTRIES, MAX_CHARS = 2048, 16, 65536
# The cut lies at least this many characters before the texts differ: a word's end depends on a character or two
# after it (the regular expression's look-ahead).
MARGIN = 16


@dataclass(frozen=True)
class _Known:
    text: str
    ids: tuple[int, ...]


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
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0  # texts tokenized from a cut (for tests)

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if not self.enabled or len(text) < MIN_CHARS:
            return self._whole(text)
        with self._lock:
            known = self._known.get(text)
            if known is not None:
                self._known.move_to_end(text)
                return list(known.ids)
            recent = list(self._known.values())
        ids = self._from_known(text, recent)
        reused = ids is not None
        if ids is None:
            ids = self._whole(text)
        with self._lock:
            self.reused += reused
            if len(text) <= MAX_CHARS:
                self._known[text] = _Known(text, tuple(ids))
                self._known.move_to_end(text)
                while len(self._known) > ENTRIES:
                    self._known.popitem(last=False)
        return ids

    def _from_known(self, text: str, recent: list[_Known]) -> list[int] | None:
        best, shared = None, 0
        for entry in recent:
            n = _shared_length(entry.text, text)
            if n > shared:
                best, shared = entry, n
        if best is None:
            return None
        cut = self._cut(text, shared - MARGIN)
        # Taken where the two tails to tokenize are at most half the new text (a new document shares the chat header
        # with every earlier prompt: tokenizing the known text's rest then would cost more than the new text whole).
        if cut is None or 2 * ((len(best.text) - cut) + (len(text) - cut)) > len(text):
            return None
        # The cut checked on the known text: its ids are those of its head, then those of its rest.
        rest = self._whole(best.text[cut:])
        head = len(best.ids) - len(rest)
        if head <= 0 or list(best.ids[head:]) != rest:
            return None
        return [*best.ids[:head], *self._whole(text[cut:])]

    @staticmethod
    def _cut(text: str, before: int) -> int | None:
        """The last position at most ``before`` that follows a line break and holds a character other than a space."""
        at = before
        while at > 0:
            brk = text.rfind("\n", 0, at)
            if brk < 0:
                return None
            if brk + 1 < len(text) and not text[brk + 1].isspace() and brk + 1 <= before:
                return brk + 1
            at = brk
        return None
