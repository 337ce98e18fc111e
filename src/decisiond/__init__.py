"""decisiond: decision models from any chat LLM."""

__version__ = "0.1.0"
