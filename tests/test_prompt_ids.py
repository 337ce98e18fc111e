"""Prompts that begin like a recent one, tokenized from where they differ (``engine/prompt_ids.py``): always the ids
of a whole tokenization, on texts made to break it (spaces and line breaks around the cut, digits, accents, CJK,
emoji, the chat template's special tokens)."""

from __future__ import annotations

import random

from decisiond.engine import prompt_ids
from decisiond.engine.prompt_ids import PromptIds, byte_level_bpe

PIECES = ["word", " word", "  ", " ", "\n", "\n\n", " \n", "\n ", "\t", "12345", " 7", ".", ",", "!?", "'s", "'ll",
          "é", "naïve", "日本語", "🙂", "—", "<|im_end|>", "<|im_start|>user\n", "Question:", "A:", "\r\n", "x"]


def text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(pieces))


def test_prompts_sharing_a_long_beginning_get_the_ids_of_a_whole_tokenization(tokenizer):
    assert byte_level_bpe(tokenizer)
    rng = random.Random(7)
    ids = PromptIds(tokenizer)
    for _ in range(60):
        document = text(rng, 900)
        first = document + text(rng, rng.randrange(1, 40))
        second = document[:len(document) - rng.randrange(0, 30)] + text(rng, rng.randrange(1, 40))
        for prompt in (first, second):
            assert ids.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.reused > 30  # the cut was taken, not only the whole tokenization


def test_a_new_document_after_the_same_chat_header_is_tokenized_whole(tokenizer):
    """Every prompt shares the chat header: reusing it would tokenize the known text's rest and the new text, twice
    the work of the new text whole."""
    rng = random.Random(3)
    header = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    ids = PromptIds(tokenizer)
    first, second = header + text(rng, 900), header + text(rng, 900)
    assert ids.encode(first) == tokenizer.encode(first, add_special_tokens=False)
    assert ids.encode(second) == tokenizer.encode(second, add_special_tokens=False) and ids.reused == 0
    again = ids.encode(second)  # an exact repeat: the kept ids, a list of the caller's own
    again.append(-1)
    assert ids.encode(second) == tokenizer.encode(second, add_special_tokens=False)


def test_short_texts_and_other_tokenizers_are_tokenized_whole(tokenizer, monkeypatch):
    ids = PromptIds(tokenizer)
    short = "a ticket\nQuestion: is it urgent?"
    assert len(short) < prompt_ids.MIN_CHARS and ids.encode(short) == tokenizer.encode(short, add_special_tokens=False)
    assert ids.encode(short + "!") and ids.reused == 0

    class Plain:
        def encode(self, text, add_special_tokens=False):
            return [len(text)]

    plain = PromptIds(Plain())
    assert not plain.enabled and plain.encode("x" * 5000) == [5000] and plain.encode("x" * 5001) == [5001]
