"""The tickets and questions the real served-model tests ask (llama.cpp's server, vLLM): three inputs, and four
questions of every kind, one an eight-option choice."""

INPUTS = [
    "I was charged twice for the same order and nobody answers my emails. Fix this today!",
    "Could you tell me which plans include priority support? Thanks a lot.",
    "The app crashes every time I open the settings page on my phone.",
]
QUESTIONS = [
    {"type": "predicate", "name": "complaint", "instructions": "The customer is complaining."},
    {"type": "choice", "name": "team", "instructions": "Which team should handle this message?",
     "choices": [{"value": "billing", "description": "charges, refunds, invoices"},
                 {"value": "support", "description": "bugs and crashes"}, {"value": "sales"}]},
    {"type": "score", "name": "urgency", "instructions": "How urgent is this message?",
     "levels": [{"label": "not urgent"}, {"label": "somewhat urgent"}, {"label": "very urgent"}]},
    {"type": "choice", "name": "topic", "instructions": "What is the message about?",
     "choices": [{"value": v} for v in ("payment", "refund", "crash", "pricing", "account", "delivery", "privacy",
                                         "other")]},
]
