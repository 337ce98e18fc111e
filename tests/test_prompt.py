"""Prompt wording (version 1), chat templating, and the one-distinct-token label checks, on SmolLM2's tokenizer."""

from __future__ import annotations

import copy

import pytest

from decisiond.canonical import Json, Level, Message, Option, Question, Text, ToolCall, ToolOutput
from decisiond.engine.prompt import ChatPrompter, check_renderable, labels_for, render_question
from decisiond.errors import DecisionError
from decisiond.text import render_input

TICKET = "I've been trying to connect my Stripe account for 3 days and the integration keeps failing."
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def choice_question(*names, descriptions=None, text="Which team should handle this ticket?"):
    descriptions = descriptions or [None] * len(names)
    return Question("choice", "team", (Text(text),) if text else (),
                    options=tuple(Option(n, d) for n, d in zip(names, descriptions)))


def test_choice_wording_exact():
    q = choice_question("billing", "technical", "sales",
                        descriptions=["Payment or subscription issues", None, {"area": "pricing"}])
    assert render_question(TICKET, q, labels_for(q)) == (
        f"{TICKET}\n\n"
        "Question: Which team should handle this ticket?\n"
        "A: billing - Payment or subscription issues\n"
        "B: technical\n"
        'C: sales - {"area":"pricing"}\n'
        "Answer with the letter of one option only."
    )


def test_score_wording_exact():
    q = Question("score", "f", (Text("How frustrated is the customer?"),),
                 levels=(Level("Calm"), Level("Frustrated", "but civil"), Level({"level": "angry"})))
    assert render_question("x", q, labels_for(q)) == (
        "x\n\nQuestion: How frustrated is the customer?\n"
        "0: Calm\n1: Frustrated - but civil\n2: {\"level\":\"angry\"}\n"
        "Answer with the number of one level only."
    )


def test_yes_no_wording_exact():
    plain = Question("yes_no", "u", (Text("The customer needs an answer today."),))
    assert render_question("x", plain, labels_for(plain)) == (
        "x\n\nIs the following true? The customer needs an answer today.\nAnswer with yes or no only."
    )
    described = Question("yes_no", "u", (), yes="Payments, charges", no=None)
    assert render_question("x", described, labels_for(described)) == (
        "x\n\nIs the following true?\nyes: Payments, charges\nAnswer with yes or no only."
    )


def test_question_without_text_drops_the_question_line():
    q = choice_question("a", "b", text=None)
    assert render_question("in", q, ["A", "B"]) == "in\n\nA: a\nB: b\nAnswer with the letter of one option only."


def test_boolean_option_values_render_as_json_words():
    q = Question("choice", None, (Text("?"),), options=(Option(True), Option("maybe")))
    assert "A: true\nB: maybe" in render_question("in", q, labels_for(q))


def test_input_rendering_json_compact_and_transcript():
    one_user = (Message("user", (Text("Listing:"), Json({"price": 3, "tags": ["watch", "é"]}))),)
    assert render_input(one_user) == 'Listing:\n\n{"price":3,"tags":["watch","é"]}'
    conversation = (
        Message("system", (Text("You moderate a marketplace."),)),
        Message("user", (Text("Is this ok?"),)),
        ToolCall("call_1", "seller_lookup", '{"id":7}'),
        ToolOutput("call_1", (Text("seller age: 2 days"),)),
        Message("assistant", (Text("Checking seller."),)),
    )
    assert render_input(conversation) == (
        "system: You moderate a marketplace.\n\nuser: Is this ok?\n\n"
        'tool_call seller_lookup: {"id":7}\n\ntool_result: seller age: 2 days\n\nassistant: Checking seller.'
    )


def test_labels():
    assert labels_for(choice_question("a", "b", "c")) == ["A", "B", "C"]
    many = choice_question(*[f"o{i}" for i in range(40)])
    assert labels_for(many)[:3] == ["AA", "AB", "AC"] and labels_for(many)[-1] == "BN"
    assert labels_for(Question("score", None, levels=tuple(Level(str(i)) for i in range(4)))) == ["0", "1", "2", "3"]
    assert labels_for(Question("yes_no", None)) == ["yes", "no"]


@pytest.mark.parametrize(
    "names, message",
    [
        (["billing", " Billing "], "repeats another option"),
        (["billing", "  "], "must not be blank"),
        (["billing", "tech\nnical"], "control or line break"),
    ],
)
def test_ambiguous_option_names_are_refused(names, message):
    q = Question("choice", "q", (Text("?"),),
                 options=tuple(Option(n, source=("questions", 0, "choices", i)) for i, n in enumerate(names)),
                 source=("questions", 0))
    with pytest.raises(DecisionError, match=message) as e:
        check_renderable(q)
    assert e.value.path == ("questions", 0, "choices", 1)


def test_whole_chat_prompt_exact(tokenizer):
    prompter = ChatPrompter(tokenizer, 8192)
    q = choice_question("billing", "technical")
    content = render_question(TICKET, q, ["A", "B"])
    encoded = prompter.encode(content, ["A", "B"], prompter.template_kwargs({}))
    assert encoded.text == f"{SYSTEM}<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert encoded.ids == tokenizer.encode(encoded.text, add_special_tokens=False)
    # Each label's id is what re-tokenizing prompt + label appends.
    for label, token in zip(["A", "B"], encoded.label_ids):
        assert tokenizer.encode(encoded.text + label, add_special_tokens=False) == encoded.ids + [token]
    assert len(set(encoded.label_ids)) == 2


def test_label_ids_match_full_prompt_check(tokenizer):
    """The added-token shortcut gives the same ids as checking on the whole prompt."""
    prompter = ChatPrompter(tokenizer, 8192)
    labels = ["A", "B", "0", "9", "yes", "no", "AA", "AB"]
    text = prompter.render("some input\n\nAnswer.", {})
    ids = tokenizer.encode(text, add_special_tokens=False)
    fast = prompter.label_ids(text, ids, labels)
    full = [tokenizer.encode(text + label, add_special_tokens=False)[-1] for label in labels]
    assert fast == full


def with_template(tokenizer, template: str):
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def test_label_that_is_not_one_token_is_refused(tokenizer):
    # A template whose answer position follows a space: " yes" merges with the space into one token,
    # so "yes" does not add exactly one token after the prompt.
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\nAnswer: {% endif %}"
    prompter = ChatPrompter(with_template(tokenizer, template), 8192)
    with pytest.raises(DecisionError, match="not one distinct token") as e:
        prompter.encode("x\n\nIs the following true?\nAnswer with yes or no only.", ["yes", "no"], {},
                        ("questions", 2))
    assert e.value.path == ("questions", 2) and e.value.status == 400


def test_repeated_label_token_is_refused(tokenizer):
    prompter = ChatPrompter(tokenizer, 8192)
    text = prompter.render("x", {})
    ids = tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(DecisionError, match="'A' is not one distinct token"):
        prompter.label_ids(text, ids, ["A", "A"])


QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_thinking_is_turned_off_and_turning_it_on_is_refused(tokenizer):
    prompter = ChatPrompter(with_template(tokenizer, QWEN_LIKE), 8192)
    assert prompter.toggle == "enable_thinking"
    kwargs = prompter.template_kwargs({})
    assert kwargs == {"enable_thinking": False}
    text = prompter.render("x\n\nAnswer with yes or no only.", kwargs)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(DecisionError, match="'enable_thinking' to True") as e:
        prompter.template_kwargs({"enable_thinking": True})
    assert e.value.path == ("chat_template_kwargs", "enable_thinking")


def test_template_that_leaves_reasoning_open_is_refused(tokenizer):
    always_open = QWEN_LIKE.replace(
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}",
        "<think>\n",
    )
    prompter = ChatPrompter(with_template(tokenizer, always_open), 8192)
    with pytest.raises(DecisionError, match="leaves a reasoning block open"):
        prompter.render("x\n\nAnswer with yes or no only.", prompter.template_kwargs({}))


def test_template_that_starts_every_answer_with_reasoning_is_refused(tokenizer):
    # The generation prompt shows no reasoning, but the template's own finished reply starts with a think block.
    hidden = QWEN_LIKE.replace(
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}", ""
    ).replace("<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}", "<think>\nreasoning\n</think>\n{% endif %}{{ m['content'] }}")
    prompter = ChatPrompter(with_template(tokenizer, hidden), 8192)
    with pytest.raises(DecisionError, match="starts every answer with a reasoning block"):
        prompter.render("x\n\nAnswer with yes or no only.", prompter.template_kwargs({}))


def test_template_error_is_a_clear_400(tokenizer):
    prompter = ChatPrompter(with_template(tokenizer, "{{ raise_exception('only system messages') }}"), 8192)
    with pytest.raises(DecisionError, match="the chat template failed: only system messages") as e:
        prompter.render("x", {})
    assert e.value.status == 400


def test_prompt_over_context_length_is_refused(tokenizer):
    prompter = ChatPrompter(tokenizer, 64)
    with pytest.raises(DecisionError, match="does not fit the context length of 64 tokens") as e:
        prompter.encode("word " * 100, ["yes", "no"], {}, ("questions", 0))
    assert e.value.code == "context_length_exceeded" and e.value.path == ("questions", 0)


def test_model_without_a_chat_template_is_refused(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DecisionError, match="no chat template") as e:
        ChatPrompter(bare, 8192).render("x", {})
    assert e.value.status == 400


class LossyTokenizer:
    """SmolLM2's tokenizer with a decode that loses accents, like a normalising tokenizer would."""

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        return self.inner.decode(ids, **kwargs).replace("ü", "u")


def test_tokenizer_that_does_not_round_trip_is_refused(tokenizer):
    assert not ChatPrompter(tokenizer, 8192).lossy
    prompter = ChatPrompter(LossyTokenizer(tokenizer), 8192)
    assert prompter.lossy
    with pytest.raises(DecisionError, match="does not encode the rendered chat text back"):
        prompter.render("x", {})
