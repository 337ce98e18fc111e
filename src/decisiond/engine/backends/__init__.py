"""Backends: what computes label log-probs (see ``engine.backend``)."""
