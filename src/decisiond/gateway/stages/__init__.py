"""The gateway's policy, one pipeline stage per module (``types.Stage``), in the order ``service`` chains them:
request limits → resolve → allowlist → cache → rate limits → budget → guardrails. ``auth`` establishes the caller
before the body is read, outside the chain."""
