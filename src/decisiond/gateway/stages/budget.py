"""Budgets: USD spending limits per key, per user-path subtree and per model, per UTC calendar hour/day/week/month
or per ``period_seconds`` (windows aligned on the Unix epoch), shared by every replica through the database.

The ``BudgetStage`` runs after the rate limits and before the router. For every budget that applies to the request
(a budget on a model applies to every request that model may answer, under any name and through any virtual model:
``Catalog.policy_names``) it *reserves* the most the request can cost: for the dearest target the model may route to
(for a cascade, the dearest of each step, summed), its input tokens (counted by the model's tokenizer when it runs
here, else bounded by the request's bytes: ``sizes.max_input_tokens``) plus the output the request can still
produce (its ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``, else the model's
``max_output_tokens``), priced by the same rules as the bill (``pricing.cost``). The reservation comes out of this
process's leases (``budget_leases``), which the ledger (``budget_ledger``) grants out of what the limit leaves — in
memory for most requests, one database transaction when a lease grows. A budget without room refuses with 402
``budget_exceeded`` before any provider is called.

When the request ends, its charges (``types.Charge``: each worst case to take off its lease's hold, the real cost
to add: its answer's price, what a stream relayed, an answer billed although it failed its check; 0 for a failure)
ride on its usage record: the usage writer applies them (``budget_ledger.apply_charges``) in the transaction that
inserts the row, so each request is settled exactly once, from the journal after a crash too.

The guarantee: spend never passes a limit by more than the sum, over the requests in flight together, of what each
was billed above its reservation — nothing while upstreams bill within what their requests allowed.

The stage decides or refuses: a lease that cannot grow within ``BUDGET_DB_TIMEOUT_S`` (a database that answers too
slowly) or any other failure to decide is 503 ``budget_unavailable`` (a growth that commits after its request gave up
stays in the lease, for the next requests or to be given back). Only for a database that is really down
(``store.db.transient`` and no answer to ``SELECT 1``) does ``budgets_when_database_down`` apply: ``admit``
(default) lets the request through unchecked — logged, its outcome ``unchecked: database unavailable`` — and charges
it when the database is back; ``refuse`` answers 503. A request that fits in a lease is admitted whatever the
database's state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from ...canonical import DecisionRequest, Usage
from ...errors import DecisionError, Unavailable, one_line
from ...limits import BUDGET_DB_TIMEOUT_S
from ...store.db import transient
from .. import pricing
from ..catalog import Catalog
from ..sizes import max_input_tokens, max_output_tokens
from ..types import Context, Next
from .budget_leases import LeaseBook
from .budget_ledger import Hold, Reservation, to_nano
from .budget_store import BudgetStore

log = logging.getLogger("decisiond.budgets")


class BudgetStage:
    """Reserve before the call, settle after (see the module docstring)."""

    name = "budget"

    def __init__(self, leases_of: Any, catalog: Catalog, when_down: Literal["admit", "refuse"] = "admit"):
        # ``leases_of()`` → the LeaseBook, or None before the database is open (no budgets then).
        self.leases_of = leases_of
        self.catalog = catalog
        self.when_down = when_down

    async def worst_case(self, context: Context, request: Any) -> int:
        """The most ``request`` can cost on any target its model may route to (see the module docstring); for a
        cascade, every step's worst case summed (every question may escalate to the last step)."""
        return await self._worst(context.resolved_model, request) if context.resolved_model else 0

    async def _worst(self, name: str, request: Any) -> int:
        steps = self.catalog.cascade_steps(name)
        if steps is not None:  # a step asks a subset of the questions: the whole request bounds its cost
            return sum([await self._worst(self.catalog.canonical(step) or step, request) for step in steps])
        worst = 0
        for t in self.catalog.chain(name):
            if t.price is None:
                continue
            decision = isinstance(request, DecisionRequest)
            counted = await t.provider.input_tokens(request) if decision else None
            output = await t.provider.output_tokens(request) if decision else None
            usage = Usage(input_tokens=counted if counted is not None else max_input_tokens(request),
                          output_tokens=output if output is not None else max_output_tokens(request,
                                                                                            t.max_output_tokens))
            worst = max(worst, to_nano(pricing.cost(t.price, usage, pricing.billed_as(request, t.provider.format))))
        return worst

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        book: LeaseBook | None = self.leases_of()
        if book is None:
            return await call_next(context, request)
        store = book.store
        try:
            budgets = [b for b in await store.budgets()
                       if b.applies(context.caller, self.catalog.policy_names(context.resolved_model or ""))]
            if not budgets:
                return await call_next(context, request)
            # At least 1 nano-USD: a budget already spent refuses even a free request, as a limit of 0 does.
            amount = max(1, await self.worst_case(context, request))
        except DecisionError:
            raise
        except Exception as error:  # no budget list, or no worst case (a tokenizer's error): nothing to decide on
            raise self._undecided(context, error, "budgets cannot be checked") from None
        try:
            admitted = book.admit_now(budgets, amount)
            if admitted is None:
                admitted = await asyncio.wait_for(book.admit(budgets, amount), BUDGET_DB_TIMEOUT_S)
            reservation = admitted
        except DecisionError:
            raise
        except Exception as error:
            if self.when_down == "refuse" or not await _down(store, error):
                raise self._undecided(context, error, "budgets not reserved") from None
            log.warning("budgets not checked: the database is unavailable; the request is charged when it returns",
                        extra={"request_id": context.request_id, "error": one_line(error)[:300]})
            context.outcomes[self.name] = "unchecked: database unavailable (charged when it returns)"
            reservation = Reservation([Hold(None, b.id, b.window()[0], 0) for b in budgets])
        try:
            return await call_next(context, request)
        finally:
            # What it cost (its answer's price, what a stream relayed before its client left, an answer that
            # failed its check; 0 for a failure), settled with its usage row by the usage writer.
            context.charges = book.settle(reservation, to_nano(context.cost or 0.0))

    def _undecided(self, context: Context, error: Exception, what: str) -> DecisionError:
        """503 for a budget stage that could not decide: never admitted unchecked, never admitted for free."""
        log.warning(f"{what}: the request is refused", extra={
            "request_id": context.request_id, "error": one_line(error)[:300], "when_down": self.when_down})
        return Unavailable("Budgets cannot be checked right now. Retry shortly.", code="budget_unavailable",
                           headers={"retry-after": "5"})


async def _down(store: BudgetStore, error: Exception) -> bool:
    """Whether ``error`` is the database being down (a connection that fails, a ``SELECT 1`` unanswered), as
    opposed to a database that answers but was too slow or refused this transaction."""
    return transient(error) and not await store.db.reachable(BUDGET_DB_TIMEOUT_S)
