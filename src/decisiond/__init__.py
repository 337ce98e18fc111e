"""decisiond: decision models from any chat LLM — typed questions in, a probability for every option out.

The Python library (see ``decisiond.library``)::

    import decisiond
    engine = decisiond.load()            # in-process; or decisiond.Client("http://host:8000", api_key=...)
    decision = engine.decide("I was charged twice.", [decisiond.Predicate("billing", "Is this about billing?")])
    decision["billing"].probability
"""

from .errors import (
    AuthenticationFailed,
    BudgetExceeded,
    ConnectionFailed,
    DecisionError,
    GuardrailBlocked,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ServerError,
    Timeout,
    Unavailable,
)
from .library.answers import Answer, ChoiceAnswer, Decision, PredicateAnswer, Refusal, ScoreAnswer, Usage
from .library.client import Client
from .library.inprocess import Engine, load
from .library.questions import Choice, Predicate, QuestionLike, Score, questions_from
from .version import __version__

__all__ = [
    "Answer",
    "AuthenticationFailed",
    "BudgetExceeded",
    "Choice",
    "ChoiceAnswer",
    "Client",
    "ConnectionFailed",
    "Decision",
    "DecisionError",
    "Engine",
    "GuardrailBlocked",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "PermissionDenied",
    "Predicate",
    "PredicateAnswer",
    "ProviderError",
    "ProviderTimeout",
    "QuestionLike",
    "RateLimited",
    "Refusal",
    "Score",
    "ScoreAnswer",
    "ServerError",
    "Timeout",
    "Unavailable",
    "Usage",
    "__version__",
    "load",
    "questions_from",
]
