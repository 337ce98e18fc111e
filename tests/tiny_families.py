"""Tiny models of other tokenizer families, with random weights, built offline with ``tokenizers`` and
``transformers`` (no hub): what the embedded SmolLM2 (a GPT-2-style byte-level BPE with ChatML) cannot show.

- ``metaspace``: a Llama 2 / Mistral style SentencePiece BPE: byte fallback (``<0x00>``…``<0xFF>``), a Metaspace
  pre-tokenizer (``▁`` for a space, prepended to the first word), ``[INST]`` and ``[/INST]`` as control tokens, so
  that the answer label comes right after a control token. Its ``▁A`` and ``A`` are two tokens that a lone
  ``decode`` prints alike.
- ``qwen3``: a Qwen3 style byte-level BPE with ChatML and the thinking toggle (``enable_thinking``): with thinking
  off the generation prompt ends with an empty ``<think>\\n\\n</think>\\n\\n`` block.

Each is a folder (``save_pretrained``) that decisiond's engine, its ``tokenizer:`` setting and vLLM all load.
"""

from __future__ import annotations

import string
from pathlib import Path

# Words for the tokenizers' training: decisiond's prompt wording, the tests' tickets, letters and digits alone.
CORPUS = """You are a careful assistant. Read the input and answer the question.
Question: Which team should handle this message? Answer with the letter of one option only.
Answer with yes or no only. Answer with the number of one level only. How urgent is this message?
I was charged twice for the same order and nobody answers my emails. Fix this today!
Could you tell me which plans include priority support? Thanks a lot.
The app crashes every time I open the settings page on my phone. billing support sales refund payment crash
pricing account delivery privacy other complaint urgency not urgent somewhat urgent very urgent
The customer is complaining. What is the message about? Input: Options: Levels:
""" + " ".join(string.ascii_uppercase) + " " + " ".join(string.digits) + " yes no Yes No\nyes\nno\nyes\nno\n"

METASPACE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% else %}{{ ' ' + message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}")

QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line] * 4


def metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  initial_alphabet=list(string.ascii_letters + string.digits + "▁"),
                                  show_progress=False)
    tok.train_from_iterator(_lines(), trainer)
    tok.add_special_tokens(["[INST]", "[/INST]"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   add_bos_token=False)
    fast.chat_template = METASPACE_TEMPLATE
    return fast


def qwen3_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_lines(), trainer)
    tok.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE
    return fast


def build(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random-weight model of ``family`` saved in ``folder`` (float32), with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = metaspace_tokenizer() if family == "metaspace" else qwen3_tokenizer()
    vocab = len(tokenizer)
    # head_dim 64: vLLM's CPU attention takes no smaller head
    shape = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, head_dim=64,
                 tie_word_embeddings=True)
    if family == "metaspace":
        config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        cls = LlamaForCausalLM
    else:
        config = Qwen3Config(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        cls = Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # spread the logits, so that label probabilities differ visibly from uniform
        model.model.norm.weight.mul_(40.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
