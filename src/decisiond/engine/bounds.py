"""What a text's characters alone prove about its tokens: an input too long for the model's context is refused
before any templating or tokenizing (tokenizing 10 MB of text takes seconds and hundreds of MB).

The bound: no token stands for more characters of the input than its vocabulary entry is long (``max_token_chars``:
the longest entry, special and added tokens included). In a byte-level BPE vocabulary (SmolLM2, Llama 3, Qwen, GPT)
an entry has one character per byte, and a byte is at most one character of text; in a SentencePiece vocabulary
(Llama 2, Mistral, Gemma) an entry is the text it stands for, with ``▁`` for a space, and a byte-fallback entry
(``<0xE4>``) stands for less than a character. A prompt that holds ``n`` characters of input therefore has at least
``ceil(n / max_token_chars)`` tokens, whatever the chat template adds.

That holds only where the tokenizer keeps every character of the text: no normalizer that drops or merges
characters (stripping accents, collapsing spaces; NFC and NFKC compose at most four code points into one, the
longest canonical decomposition in Unicode, so they multiply the bound by four), no pre-tokenizer that removes
text (whitespace splitters), and no unknown characters dropped or fused into one token (a byte-level alphabet or
byte fallback covers every character). Where the tokenizer is not one of these (or not a fast tokenizer whose
parts can be read), there is no bound and the input is tokenized to be measured. For SmolLM2 (longest entry 81
characters, context 8,192 tokens) an input of more than 663,471 characters is refused at once.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import refused

# Normalizers that never shorten the text; those that compose characters, and by how much at most.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD", "Sequence"})
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
# Pre-tokenizers that only split (a ``Split`` or ``Punctuation`` whose behavior removes the pattern does not).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts",
                                     "Sequence"})


def _parts(state: Any, key: str) -> list[dict[str, Any]]:
    """A serialized normalizer or pre-tokenizer as the flat list of its parts (a ``Sequence`` unfolded)."""
    if state is None:
        return []
    node = json.loads(state.__getstate__()) if not isinstance(state, dict) else state
    if node.get("type") == "Sequence":
        return [part for child in node.get(key) or [] for part in _parts(child, key)]
    return [node]


def _normalizer_factor(normalizer: Any) -> int | None:
    """How many characters of input one character after the normalizer may stand for (None: no bound)."""
    factor = 1
    for part in _parts(normalizer, "normalizers"):
        kind = part.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor *= _COMPOSING_NORMALIZERS[kind]
        elif kind == "Replace":
            pattern = (part.get("pattern") or {}).get("String")
            if pattern is None or len(part.get("content") or "") < len(pattern):
                return None
        elif kind not in _KEEPING_NORMALIZERS:
            return None
    return factor


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input text one token of ``tokenizer`` can stand for, or None when the tokenizer may
    drop or merge characters (see the module's docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "get_vocab"):
        return None
    try:
        factor = _normalizer_factor(backend.normalizer)
        pre = _parts(backend.pre_tokenizer, "pretokenizers")
        model = backend.model
    except (AttributeError, TypeError, ValueError):
        return None
    if factor is None or any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or
                             str(p.get("behavior", "")).lower() == "removed" for p in pre):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    if type(model).__name__ == "BPE":
        covered = byte_level or bool(getattr(model, "byte_fallback", False)) or (
            getattr(model, "unk_token", None) is not None and not getattr(model, "fuse_unk", True))
    else:
        covered = type(model).__name__ == "Unigram" and bool(getattr(model, "byte_fallback", False))
    if not covered:
        return None
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=0)
    return longest * factor if longest > 0 else None


def check_fits(text: str, token_chars: int | None, context_length: int, *source: str | int) -> None:
    """Refuse (400 ``context_length_exceeded``) a prompt that will hold ``text`` when its characters alone prove it
    longer than the context: at least ``ceil(len(text) / token_chars)`` tokens. Costs a ``len``."""
    if token_chars is None:
        return
    least = math.ceil(len(text) / token_chars)
    if least >= context_length:
        raise refused(f"the input has {len(text):,} characters, so its prompt has at least {least:,} tokens (no "
                      f"token of this model stands for more than {token_chars} characters), which does not fit the "
                      f"context length of {context_length:,} tokens", *source, code="context_length_exceeded")
