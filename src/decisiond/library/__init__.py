"""decisiond as a Python library: decision models in-process (``load``) or from a remote server (``Client``),
with typed questions and typed answers.

In-process, no server::

    import decisiond
    from decisiond import Choice, Predicate, Score

    engine = decisiond.load()                       # the embedded SmolLM2; or a HF folder, a .gguf, a hub id
    decision = engine.decide("I was charged twice. Please fix this ASAP.", [
        Predicate("billing", "Is this ticket about billing?"),
        Choice("team", "Which team should handle it?", {"billing": "Charges, invoices", "shipping": None}),
        Score("urgency", "How urgent is it?", ["Can wait", "This week", "Today"]),
    ])
    decision["billing"].probability                  # P(yes)
    decision["team"].choice, decision["team"].probabilities, decision["team"].confidence
    decision["urgency"].score                        # expected level, 0 … len(levels) - 1

Questions may also be OpenAI-shaped dicts (``{"type": "predicate", "name": …, "instructions": …}``), or come
from a pydantic model::

    class Ticket(BaseModel):
        billing: bool | None = Field(None, description="Is this ticket about billing?")
        team: Literal["billing", "shipping"] | None = Field(None, description="Which team should handle it?")

    ticket = engine.decide_as(Ticket, "I was charged twice.", min_confidence=0.5)   # fields below it: None

A remote decisiond answers with the same types: ``decisiond.Client("http://127.0.0.1:8000", api_key=…)``.
Every request goes through the same gateway pipeline and OpenAI wire shape as ``POST /v1/decisions``, so a
refused request raises ``DecisionError`` naming the field at fault, locally and remotely alike.

The modules, each importing only those before it:

- ``questions``: the typed questions (``Predicate``, ``Choice``, ``Score``) and pydantic models as question sets;
- ``answers``: the typed answers and ``Decision``, read from a ``/v1/decisions`` response body;
- ``decider``: ``Decider``, the sync and async API that ``Engine`` and ``Client`` share;
- ``inprocess``: ``Engine`` and ``load``, models in this process behind the gateway pipeline;
- ``client``: ``Client``, a remote decisiond, whose every failure is raised as a ``DecisionError``.

The public names are ``decisiond``'s (``decisiond.__all__``), imported there from these modules.
"""
