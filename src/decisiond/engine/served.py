"""Label log-probabilities from a served model's next-token log-probabilities, as OpenAI-compatible servers return
them: the top-k candidates of the answer position (and the token the server chose), each known by its text and, on
some servers, its token id. Pure: no I/O.

A label is found among a read's candidates by its token id where both are known (llama.cpp's ``id``, vLLM's
``token_id:N``), else by its token's text (``tokenizer.decode([id])``, what servers print for one token); without a
tokenizer (a chat model decisiond cannot tokenize for) by the label's own text, surrounding spaces ignored and, for
``yes``/``no``, case too: there the distinct tokens that spell a label (``A``, `` A``) are added up.

One read may not hold every label: a server returns its top-k, and a label below them is not in the reply. A second
read with the answer restricted to the labels (``logit_bias``; vLLM's ``allowed_token_ids``) then holds them all where
the server reports log-probabilities after the restriction (SGLang, llama-cpp-python, vLLM's
``--logprobs-mode processed_logprobs``): those are the labels' log-probabilities shifted by one constant, the log of
the labels' share of the mass. ``combine`` puts the two reads together: a label both reads hold gives the constant,
and the labels only the restricted read holds get their full-vocabulary log-probability back. Where no label is in
the plain read the constant is unknown: the probabilities among the labels are still exact (they do not depend on
it), but the mass outside the labels is not known (``exact`` False: ``label_mass`` is then not reported).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..canonical import Candidate

# Two reads of one prompt agree on the labels' log-probabilities up to one constant; beyond this many nats apart
# (after the constant) they are not two reads of the same distribution.
READS_TOLERANCE = 0.05
# Cased spellings that stand for the same answer label.
CASELESS_LABELS = ("yes", "no")


@dataclass(frozen=True)
class LabelToken:
    """What an answer label is at the answer position: its text, and its token id and that token's text where a
    tokenizer gave them."""

    label: str
    id: int | None = None
    text: str | None = None


class Unscored(ValueError):
    """Labels no read could score: the index of the first one, and why."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index = index
        self.reason = reason


def _spells(candidate: Candidate, token: LabelToken) -> bool:
    if token.id is not None and candidate.id is not None:
        return candidate.id == token.id
    if token.text is not None:
        return candidate.text == token.text
    if candidate.text is None:
        return False
    text = candidate.text.strip()
    return text == token.label or (token.label in CASELESS_LABELS and text.lower() == token.label)


def find(candidates: Sequence[Candidate], token: LabelToken) -> float | None:
    """The log-probability of ``token`` among ``candidates`` (None: not among them). A token listed twice (the chosen
    token is also in the top-k) counts once; distinct tokens that spell the label are added up."""
    seen: dict[object, float] = {}
    for c in candidates:
        if math.isfinite(c.logprob) and _spells(c, token):
            key = c.id if c.id is not None else c.text
            seen[key] = max(seen.get(key, -math.inf), c.logprob)
    if not seen:
        return None
    top = max(seen.values())
    return top + math.log(math.fsum(math.exp(v - top) for v in seen.values()))


def read_labels(candidates: Sequence[Candidate], tokens: Sequence[LabelToken]) -> list[float | None]:
    return [find(candidates, t) for t in tokens]


def complete(found: Sequence[float | None]) -> bool:
    return all(v is not None for v in found)


def combine(plain: Sequence[float | None], restricted: Sequence[float | None]) -> tuple[list[float], bool]:
    """Every label's log-probability from a plain read and a read restricted to the labels (see the module
    docstring), and whether they are full-vocabulary values (else shifted by an unknown constant). Raises
    ``Unscored`` for a label neither read holds, or for reads that do not agree."""
    missing = next((i for i, (p, r) in enumerate(zip(plain, restricted)) if p is None and r is None), None)
    if missing is not None:
        raise Unscored(missing, "it is not among the server's top log-probabilities, even with the answer "
                                "restricted to the labels")
    both = {i: p - r for i, (p, r) in enumerate(zip(plain, restricted)) if p is not None and r is not None}
    if not both:
        gap = next((i for i, r in enumerate(restricted) if r is None), None)
        if gap is not None:
            raise Unscored(gap, "the read restricted to the labels left it out, and no label is in both reads")
        return [float(r) for r in restricted if r is not None], False
    shift = math.fsum(both.values()) / len(both)
    worst = max(both, key=lambda i: abs(both[i] - shift))
    if abs(both[worst] - shift) > READS_TOLERANCE:
        raise Unscored(worst, "the server's log-probabilities with and without the restriction to the labels "
                              "disagree beyond one constant")
    out = []
    for p, r in zip(plain, restricted):
        out.append(p if p is not None else (r if r is not None else -math.inf) + shift)
    return out, True
