"""What the benchmark asks, reproducibly: support tickets of about 150 tokens, each asked 3 (or 10) typed questions;
documents of about 2,000 tokens (asked 5 questions, or one question and then another); the fairness workload's
50-question request. Also the names of the long-document workloads in the report."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ..canonical import DecisionRequest, Level, Message, Option, Question, Text
from ..dialects.openai import render_request

_OPENINGS = ["Hi team,", "Hello,", "Good morning,", "Hey there,", "Dear support,", "Hi,"]
_PRODUCTS = ["the invoicing dashboard", "the mobile app", "the CSV export", "the Stripe integration",
             "the team calendar", "single sign-on", "the reporting API", "the billing page"]
_PROBLEMS = [
    "keeps failing with a timeout error after about thirty seconds",
    "shows a blank page whenever I open it from the sidebar",
    "charged my card twice for the same monthly subscription",
    "stopped syncing new records sometime after last Tuesday's update",
    "logs everyone out of their accounts every few minutes",
    "exports files with all of the dates in the wrong format",
    "rejects my password even though I reset it twice today",
    "sends the same notification email to our customers three times",
]
_TRIED = [
    "I already cleared the cache, tried two browsers and restarted my laptop.",
    "We followed every step of your help center article, twice.",
    "Our admin removed and reconnected the integration, with no change at all.",
    "I contacted your chat assistant yesterday but it only sent me generic links.",
    "Reinstalling the app did not help, and neither did logging in from a phone.",
]
_IMPACT = [
    "Our accountant needs these documents by Friday for the quarterly filing.",
    "Forty people on my team cannot do their work until this is fixed.",
    "We are losing sales every hour this stays broken.",
    "It is not urgent, but it would be nice to have it sorted this month.",
    "Honestly I am starting to look at other tools because of this.",
    "I would like a refund for the days the service was unusable.",
]
_MOODS = [
    "Thanks in advance for your help.",
    "This is really frustrating and I expect a proper answer this time.",
    "No rush, whenever you get a chance.",
    "Please call me back as soon as possible, this is unacceptable!!",
    "I appreciate any pointers you can give.",
]
_PLANS = ["Free", "Pro", "Business", "Enterprise"]
_STEPS = [
    "To reproduce it, open the settings, pick any workspace, click export and wait for the spinner to stop.",
    "It happens on every record we created after the migration, but never on the older ones.",
    "The error message just says that something went wrong and asks me to try again later.",
    "My colleague in the Berlin office sees exactly the same behaviour on her machine.",
    "The status page says all systems are operational, which is clearly not the case for us.",
]


def ticket(rng: random.Random) -> str:
    parts = [
        rng.choice(_OPENINGS),
        f"since {rng.choice(['Monday', 'yesterday', 'last week', 'this morning', 'the last update'])} "
        f"{rng.choice(_PRODUCTS)} {rng.choice(_PROBLEMS)}.",
        f"It also {rng.choice(_PROBLEMS)} when I try {rng.choice(_PRODUCTS)} instead.",
        *rng.sample(_STEPS, 2),
        rng.choice(_TRIED),
        rng.choice(_IMPACT),
        rng.choice(_MOODS),
        f"Account {rng.randint(10000, 99999)}, {rng.choice(_PLANS)} plan, {rng.randint(2, 400)} seats, "
        f"previous ticket #{rng.randint(1000, 9999)} if that helps.",
        f"Best regards, {rng.choice(['Ana', 'Bruno', 'Chen', 'Dara', 'Emeka', 'Fatima', 'Goran', 'Hiro'])}",
    ]
    return " ".join(parts)


def _choice(name: str, text: str, options: list[tuple[str, str | None]]) -> Question:
    return Question("choice", name, (Text(text),), options=tuple(Option(n, d) for n, d in options))


def _score(name: str, text: str, levels: list[str]) -> Question:
    return Question("score", name, (Text(text),), levels=tuple(Level(x) for x in levels))


def _yes_no(name: str, text: str) -> Question:
    return Question("yes_no", name, (Text(text),))


TEAM = _choice("team", "Which team should handle this ticket?", [
    ("billing", "Payments, invoices and refunds"), ("technical", "Bugs or integration problems"),
    ("account", "Logins, access and settings"), ("sales", "Plans, pricing and upgrades")])
FRUSTRATION = _score("frustration", "How frustrated is the customer?", ["Calm", "Frustrated but civil", "Very angry"])
URGENT = _yes_no("urgent", "The customer needs an answer today.")

EXTRA = [
    _choice("product", "Which part of the product is affected?", [
        ("dashboard", "Web dashboard and reports"), ("mobile", "Mobile apps"),
        ("integrations", "Third-party integrations"), ("billing", "Billing and payments")]),
    _choice("plan", "Which plan is the customer on?", [("free", None), ("pro", None), ("business", None),
                                                        ("enterprise", None)]),
    _score("urgency", "How urgent is the ticket?", ["Can wait", "This month", "This week", "Today"]),
    _score("complexity", "How complex is the fix likely to be?", ["Simple", "Moderate", "Hard"]),
    _yes_no("refund", "The customer asks for a refund."),
    _yes_no("churn", "The customer might cancel their subscription."),
    _yes_no("bug", "The ticket reports a software bug."),
]

QUESTION_SETS = {1: (URGENT,), 3: (TEAM, FRUSTRATION, URGENT), 10: (TEAM, FRUSTRATION, URGENT, *EXTRA)}


# The in-process tickets of a question set of n questions are drawn with seed TICKETS_SEED + n, each HTTP phase's
# with another seed: no workload finds another's tickets in the prefix cache.
TICKETS_SEED = 7


def requests(count: int = 200, questions: int = 3, seed: int = TICKETS_SEED) -> list[DecisionRequest]:
    rng = random.Random(seed)
    chosen = QUESTION_SETS[questions]
    return [DecisionRequest((Message("user", (Text(ticket(rng)),)),), chosen)
            for _ in range(count)]


def openai_body(request: DecisionRequest, model: str) -> dict[str, Any]:
    """The same request in OpenAI's wire shape, for the HTTP clients."""
    return render_request(request, model)


# ------------------------------------------------------------------------------------------ long documents

LONG = "long"  # documents of about 2,000 tokens, 5 questions each
FIRST = "2K doc, first ask"  # other documents, asked one question (nothing of them cached)
AGAIN = "2K doc, asked again"  # the same documents asked a new question: found in the prefix cache

LONG_QUESTIONS = (TEAM, FRUSTRATION, URGENT, EXTRA[0], EXTRA[4])  # 5 questions
ASK_FIRST = EXTRA[5]  # the churn question
ASK_AGAIN = EXTRA[6]  # the bug question
# Documents first asked together, then asked again (while the prefix cache's default budget still holds them).
ASKED_TOGETHER = 2


def document(rng: random.Random, tickets: int = 13) -> str:
    """A support thread of about 2,000 tokens (SmolLM2's tokenizer): ``tickets`` tickets, numbered."""
    return "\n\n".join(f"Message {i + 1}:\n{ticket(rng)}" for i in range(tickets))


def long_requests(count: int, questions: Sequence[Question] = LONG_QUESTIONS, seed: int = 11) -> list[DecisionRequest]:
    """``count`` documents of about 2,000 tokens, each asked ``questions`` (the same seed, the same documents)."""
    rng = random.Random(seed)
    return [DecisionRequest((Message("user", (Text(document(rng)),)),), tuple(questions))
            for _ in range(count)]


# ------------------------------------------------------------------------------------------ fairness

# 50 yes/no questions about one long document: the large request of the fairness workload.
MANY_QUESTIONS = tuple(_yes_no(f"m{i}", f"Message {i % 13 + 1} asks about {topic}.")
                       for i, topic in enumerate(["a refund", "an invoice", "a login problem", "an export",
                                                  "a cancellation"] * 10))
