"""The gateway: names to models, policy, failover and the control plane around them, between the dialects (which
parse a request into the canonical form) and the providers (which answer it).

Layers, bottom up. A module imports only from its own layer or the layers above it in this list, never from a
later one (``tests/test_layers.py`` reads this list and checks it, and that no import cycle exists anywhere):

1. types: types.py settings.py access_settings.py guardrail_settings.py telemetry_settings.py batch_settings.py
   console_settings.py logprobs_settings.py virtual.py pricing.py sizes.py chat.py fingerprint.py result_check.py
   pipeline.py
   — the shared gateway types, the pure configuration models (by section: access, guardrails, telemetry, virtual
   models, batches, the console and served models' log-probs on their own), prices, request sizes and limits, chat
   traffic's request/relay types, request fingerprints, the answer check, the stage chain. No I/O.
2. providers: providers/
   — one module per provider type, registered in one table (``providers.REGISTRY``).
3. config: config.py
   — loading the YAML, ``${ENV}``, and validating each provider entry against its registered type.
4. router: catalog.py router.py cascade.py forward.py learning_fits.py learning.py profiles.py
   — every spelling of a model to its one entry and policy; skip rules and failover; a cascade's steps; chat traffic
   forwarded; learned profiles fitted (pure) and applied to each target's answers.
5. stages: stages/
   — one module per pipeline stage (request limits, resolve, allowlist, cache, rate limits, budget, guardrails),
   and the caller's authentication.
6. service: usage.py journal.py usage_writer.py decisions.py profile_store.py profile_learning.py service.py
   — usage records, their journal and their writer; stored decisions and their labels; learned profiles kept and
   learned; the gateway assembled (stages in order, the router last).

The HTTP surfaces (``decisiond.server``) sit on top and are the only callers of the service.
"""
