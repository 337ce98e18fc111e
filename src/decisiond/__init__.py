"""decisiond: decision models from any chat LLM — typed questions in, a probability for every option out.

The Python library (see ``decisiond.library``)::

    import decisiond
    engine = decisiond.load()            # in-process; or decisiond.Client("http://host:8000", api_key=...)
    decision = engine.decide("I was charged twice.", [decisiond.Predicate("billing", "Is this about billing?")])
    decision["billing"].probability
"""

__version__ = "0.1.0"

from .library import (  # noqa: E402
    Answer,
    Choice,
    ChoiceAnswer,
    Client,
    Decision,
    DecisionError,
    Engine,
    Predicate,
    PredicateAnswer,
    QuestionLike,
    Refusal,
    Score,
    ScoreAnswer,
    Usage,
    load,
    questions_from,
)

__all__ = [
    "Answer",
    "Choice",
    "ChoiceAnswer",
    "Client",
    "Decision",
    "DecisionError",
    "Engine",
    "Predicate",
    "PredicateAnswer",
    "QuestionLike",
    "Refusal",
    "Score",
    "ScoreAnswer",
    "Usage",
    "__version__",
    "load",
    "questions_from",
]
