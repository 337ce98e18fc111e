"""Backends: what computes label log-probs (the protocol in ``backends.base``; ``transformers`` the one shipped)."""
