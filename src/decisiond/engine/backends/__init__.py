"""Backends: what computes label log-probs (see ``engine.backend``)."""

__all__: list[str] = []
